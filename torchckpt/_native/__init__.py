"""Loads the compiled extension ``torchckpt._C`` if it was built; never fails import.

Every native feature has a pure-Python path; ``native_available()`` says which one runs.
Build the extension with ``pip install --no-build-isolation -e .`` where torch is
installed (skip it with ``TORCHCKPT_USE_CPP=0``).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from torchckpt._errors import CheckpointError

_log = logging.getLogger("torchckpt")
_error: str | None = None

try:
    import torchckpt._C  # noqa: F401  (registers torch.ops.torchckpt.*)
except ImportError as e:  # not built, or built against another torch
    _error = str(e)
    _log.debug("torchckpt: native extension not loaded: %s", e)


def native_available() -> bool:
    """Whether the compiled ops are loaded."""
    return _error is None


def native_error() -> str | None:
    """Why the compiled ops are not loaded (``None`` when they are)."""
    return _error


def touch_pages(buf: torch.Tensor, page_bytes: int = 4096) -> int:
    """Write one byte per page of the CPU tensor ``buf`` (keeping its data); returns the page count.

    Uses the native op when built, else a strided in-place update in PyTorch.
    """
    if native_available():
        return int(torch.ops.torchckpt.touch_pages(buf, page_bytes))
    flat = buf.view(torch.uint8).view(-1)
    if flat.numel() == 0:
        return 0
    flat[::page_bytes].add_(0)
    return (flat.numel() + page_bytes - 1) // page_bytes


def host_pool_available() -> bool:
    """Whether the native lazily pinned host pool (csrc/host_pool.cpp) is loaded."""
    if not native_available():
        return False
    try:
        torch.ops.torchckpt.host_page_bytes.default  # noqa: B018  (raises when the op is missing)
        return True
    except (AttributeError, RuntimeError):
        return False


def host_pool_can_register() -> bool:
    """Whether the native host pool was built with the CUDA runtime (it can pin memory)."""
    return host_pool_available() and bool(torch.ops.torchckpt.host_pool_built_with_cuda())


def native_host_pool_class() -> Any:
    """The native host pool class (``torch.classes.torchckpt.HostPool``); raises when not built."""
    if not host_pool_available():
        raise CheckpointError(
            "torchckpt: the native host pool is not available "
            f"({native_error() or 'this build of torchckpt._C has no host_pool.cpp'}); build the extension with "
            "`pip install --no-build-isolation -e .` where torch is installed, or use HostPool."
        )
    return torch.classes.torchckpt.HostPool
