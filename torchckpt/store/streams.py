"""NVTX ranges around pack, unpack and every copy (visible in Nsight Systems).

Ranges are pushed only when CUDA is available, so CPU runs pay nothing.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_ENABLED = torch.cuda.is_available()


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """Mark ``name`` as an NVTX range on the calling thread (no-op without CUDA)."""
    if not _ENABLED:
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
