"""Loads the compiled extension ``torchckpt._C`` if it was built; never fails import.

Every native feature has a pure-Python path; ``native_available()`` says which one runs.
Build the extension with ``pip install --no-build-isolation -e .`` where torch is
installed (skip it with ``TORCHCKPT_USE_CPP=0``).
"""
from __future__ import annotations

import logging

import torch

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
