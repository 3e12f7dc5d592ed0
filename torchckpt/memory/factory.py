"""Which host pool a store gets (``make_host_pool``), the environment that decides it, and the
process-wide shared pools (``shared_host_pool``).

Environment: ``TORCHCKPT_HOST_POOL`` (``python`` | ``lazy`` | ``auto``), ``TORCHCKPT_NODE_LOCK``
(``0``: lazy pools register without the node lock), ``TORCHCKPT_SHARED_POOL`` (``0``: a new pool
per ``run_schedule`` call); ``LOCAL_WORLD_SIZE`` (set by torchrun: the processes on this node, among
which the default cap is shared, NOTE [ Host pool ] Rule 6).
"""
from __future__ import annotations

import os
import threading
from typing import Any

import torch

from torchckpt._native import host_pool_available, host_pool_can_register
from torchckpt.memory.host_pool import HostPool, HostPoolBase
from torchckpt.memory.lazy_pool import LazyHostPool
from torchckpt.memory.sysinfo import device_index

__all__ = ["default_pool_kind", "make_host_pool", "node_lock_default", "release_shared_host_pools", "shared_host_pool"]

_MiB = 1 << 20


def default_pool_kind(pin: bool) -> str:
    """Which pool ``make_host_pool(pin=pin)`` makes: ``"lazy"`` (``LazyHostPool``) or ``"python"``.

    ``TORCHCKPT_HOST_POOL`` decides when set; otherwise the lazy pool wherever it can pin
    (the native pool built with CUDA, and a GPU present).

    Example::

        >>> default_pool_kind(pin=False) in ("python", "lazy")
        True
    """
    mode = os.environ.get("TORCHCKPT_HOST_POOL", "auto").strip().lower() or "auto"
    if mode not in ("auto", "python", "lazy"):
        raise ValueError(f"torchckpt: TORCHCKPT_HOST_POOL must be 'python' or 'lazy', got {mode!r}.")
    lazy_ok = host_pool_available() and (not pin or (torch.cuda.is_available() and host_pool_can_register()))
    return "lazy" if mode == "lazy" or (mode == "auto" and pin and lazy_ok) else "python"


def node_lock_default() -> bool:
    """Whether the stores' default lazy pool serializes registrations (``TORCHCKPT_NODE_LOCK``, default on)."""
    return os.environ.get("TORCHCKPT_NODE_LOCK", "1") != "0"


_shared_pools: dict[tuple[bool, int], HostPoolBase] = {}
_shared_lock = threading.Lock()


def shared_host_pool(pin: bool | None = None, device: int | torch.device | None = None) -> HostPoolBase:
    """The process's host pool for ``run_schedule`` given no store: made once, then reused.

    An adjoint run once per shot or per optimization step then touches and registers its host
    memory once, not at every call (on a virtual machine that takes freed memory back, each
    new pool would pay the first touch again: NOTE [ Lazy host pool ] Rule 8), as
    ``checkpointed_loop`` without a store does through ``default_store``'s pool. Like
    PyTorch's own pinned memory cache, this pool keeps what it has pinned until the process
    ends or :func:`release_shared_host_pools`.
    ``TORCHCKPT_SHARED_POOL=0`` makes a new pool per call again.

    Args:
        pin: pin host memory (``None``: when CUDA is available).
        device: the CUDA device whose context registers the pool (``None``: the current one).

    Returns:
        The shared pool for ``(pin, device)`` (``make_host_pool``'s kind).

    Example::

        >>> shared_host_pool(pin=False) is shared_host_pool(pin=False)
        True
    """
    if pin is None:
        pin = torch.cuda.is_available()
    if os.environ.get("TORCHCKPT_SHARED_POOL", "1") == "0":
        return make_host_pool(pin=pin)
    key = (bool(pin), device_index(device) if pin and torch.cuda.is_available() else -1)
    with _shared_lock:
        pool = _shared_pools.get(key)
        if pool is None:
            pool = _shared_pools[key] = make_host_pool(pin=pin, device=device) if pin else make_host_pool(pin=False)
        return pool


def release_shared_host_pools() -> None:
    """Drop the shared pools: their memory goes once no block of them is held any more."""
    with _shared_lock:
        _shared_pools.clear()


def make_host_pool(
    pin: bool | None = None,
    *,
    capacity_bytes: int | None = None,
    chunk_bytes: int | None = None,
    **lazy_kw: Any,
) -> HostPoolBase:
    """The host pool the store should use: ``LazyHostPool`` when it can pin, else ``HostPool``.

    ``TORCHCKPT_HOST_POOL=python`` forces ``HostPool``; ``=lazy`` forces ``LazyHostPool``
    (an error when the native pool is not built). The lazy pool registers under the node lock
    unless ``TORCHCKPT_NODE_LOCK=0`` (see the comment in the body for the measurement).

    Args:
        pin: pin host memory (``None``: when CUDA is available).
        capacity_bytes: the pool's cap (``None``: each class's default, this process's share of
            the node, divided among the ``LOCAL_WORLD_SIZE`` processes on it, NOTE [ Host pool ]
            Rule 6; the lazy pool then touches only ``ahead_bytes`` = 256 MiB beyond what is used
            unless told otherwise). A given cap is used as it is.
        chunk_bytes: chunk size (``None``: 1 GiB for ``LazyHostPool``, 256 MiB for ``HostPool``,
            which needs a power of two of at least 1 MiB).
        **lazy_kw: further ``LazyHostPool`` arguments (ignored by ``HostPool``).

    Returns:
        A ``HostPool`` (a ``LazyHostPool`` is one).

    Example::

        >>> pool = make_host_pool(pin=False, capacity_bytes=8 << 20, chunk_bytes=1 << 20)
        >>> type(pool).__name__
        'HostPool'
    """
    if pin is None:
        pin = torch.cuda.is_available()
    if default_pool_kind(pin) == "lazy":
        # 1 GiB chunks: each cudaHostRegister stalls the process's other CUDA calls for a while,
        # and fewer, larger registrations block checkpointing least (docs/benchmarks.md). Chunks
        # grow from first_chunk_bytes, so small pools still start with small registrations.
        chunk_bytes = chunk_bytes if chunk_bytes is not None else 1 << 30
        if capacity_bytes is None:
            lazy_kw.setdefault("ahead_bytes", 256 * _MiB)  # a store's default pool: pin what is used, a bit ahead
        lazy_kw.setdefault("first_chunk_bytes", min(64 * _MiB, chunk_bytes))
        # Registrations serialized across the node by default (the fair lock, NOTE [ Node
        # registration lock ]; docs/benchmarks.md has the measurement). TORCHCKPT_NODE_LOCK=0 (or
        # node_lock=False) registers in parallel.
        lazy_kw.setdefault("node_lock", node_lock_default())
        return LazyHostPool(capacity_bytes=capacity_bytes, chunk_bytes=chunk_bytes, pin=pin, **lazy_kw)
    return HostPool(capacity_bytes=capacity_bytes, chunk_bytes=chunk_bytes if chunk_bytes is not None else 256 * _MiB,
                    pin=pin)
