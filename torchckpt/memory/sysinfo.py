"""What the machine offers the memory layer: page size, physical and available memory, huge pages, and how many
processes of the job share the node (``local_ranks``, ``node_share``: NOTE [ Host pool ] Rule 6).

Read from ``os.sysconf``, ``/proc`` and the launcher's environment; every function answers something sensible
(0, 1 or ``None``) where the information cannot be read (not Linux, no launcher).
"""
from __future__ import annotations

import os
import threading
import warnings

import torch

__all__ = ["available_memory_bytes", "device_index", "huge_page_bytes", "local_ranks", "node_share", "page_bytes",
           "physical_memory_bytes"]

_LOCAL = "LOCAL_WORLD_SIZE"  # set by torchrun and torch.distributed.elastic: the processes of the job on this node
_warn_lock = threading.Lock()
_warned_alone = False


def page_bytes() -> int:
    """The host page size in bytes (chunk sizes must be multiples of it)."""
    return int(os.sysconf("SC_PAGE_SIZE"))


def physical_memory_bytes() -> int:
    """Total physical RAM of this machine in bytes (0 when unknown)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def available_memory_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo in bytes (physical RAM when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_memory_bytes()


def huge_page_bytes(base: int, nbytes: int, smaps: str = "/proc/self/smaps") -> int | None:
    """Bytes of the mapping ``[base, base + nbytes)`` that the kernel backs with transparent huge pages.

    ``MADV_HUGEPAGE`` is only advice: the kernel may back the pool with 4 KiB pages, and then
    registering it costs several times more (NOTE [ Lazy host pool ] Rule 8). Sums ``AnonHugePages`` of the mappings in
    ``/proc/self/smaps`` that lie in the range; ``None`` where that file cannot be read (not Linux).

    Example::

        >>> huge_page_bytes(0, 4096) in (0, None)
        True
    """
    end = base + nbytes
    total = 0
    inside = False
    try:
        with open(smaps) as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo >= base and hi <= end
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return total


def device_index(device: int | torch.device | None) -> int:
    """The CUDA device index ``device`` names (the current device for ``None`` or a bare "cuda")."""
    if device is None:
        return int(torch.cuda.current_device()) if torch.cuda.is_available() else 0
    if isinstance(device, int):
        return device
    if device.index is None:
        return int(torch.cuda.current_device()) if torch.cuda.is_available() else 0
    return int(device.index)


def local_ranks() -> int:
    """How many processes of this job share this node's memory (NOTE [ Host pool ] Rule 6).

    ``LOCAL_WORLD_SIZE`` when set (torchrun and torch.distributed.elastic set it to the processes they start on the
    node); otherwise 1, this process alone. The ranks on the node are never asked: a gather of host names when a pool
    is made, which need not happen on every rank at the same moment, could hang. Where ``torch.distributed`` is
    initialised with several ranks and the variable is not set, one warning says to set it.

    Returns:
        The number of processes on this node, at least 1.

    Raises:
        ValueError: ``LOCAL_WORLD_SIZE`` is set to something other than a positive integer.

    Example::

        >>> local_ranks() >= 1
        True
    """
    raw = os.environ.get(_LOCAL, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(
                f"torchckpt: {_LOCAL} must be a positive integer, the number of processes of this job on this node "
                f"(torchrun sets it), found {raw!r}; set it to that number (e.g. {_LOCAL}=8 for 8 GPUs per node), "
                "unset it (the process then counts as alone on its node), or pass the host pool's capacity_bytes."
            )
        return n
    _warn_if_alone_among_ranks()
    return 1


def _warn_if_alone_among_ranks() -> None:
    global _warned_alone
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    with _warn_lock:
        if _warned_alone:
            return
        _warned_alone = True
    warnings.warn(
        f"torchckpt: torch.distributed runs {dist.get_world_size()} ranks but {_LOCAL} is not set, so this "
        "process's default host pool cap assumes it is alone on its node (NOTE [ Host pool ] Rule 6); set "
        f"{_LOCAL} to the number of processes on this node (torchrun sets it), or pass capacity_bytes=... .",
        RuntimeWarning,
        stacklevel=4,
    )


def node_share(nbytes: int) -> int:
    """This process's share of ``nbytes`` of the node's memory: ``nbytes // local_ranks()`` (NOTE [ Host pool ] Rule 6).

    Args:
        nbytes: a figure for the whole node (e.g. half of its physical memory).

    Returns:
        The bytes one of the node's ``local_ranks()`` processes may take.

    Raises:
        ValueError: ``LOCAL_WORLD_SIZE`` is malformed (``local_ranks``).

    Example::

        >>> node_share(1 << 30) == (1 << 30) // local_ranks()
        True
    """
    return int(nbytes) // local_ranks()
