"""Typed wrappers of the compiled ops (NOTE [ Native code ] Rule 2): the only callers of ``torch.ops.torchckpt``.

Each wrapper assumes its extension is loaded (check with ``torchckpt._native``'s ``*_error``
functions first). The zfp ops write into a buffer they are given; fake kernels registered at
load let them appear under ``torch.compile`` (they return nothing and change no metadata).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["host_page_bytes", "host_pool_built_with_cuda", "register_zfp_fakes", "touch_pages", "vmm_status",
           "zfp_compress", "zfp_decompress", "zfp_has_cuda"]


def touch_pages(buf: torch.Tensor, page_bytes: int) -> int:
    """Write one byte per ``page_bytes`` page of CPU tensor ``buf``, keeping its data; the page count."""
    return int(torch.ops.torchckpt.touch_pages(buf, page_bytes))


def host_page_bytes() -> int:
    """The page size the native host pool uses."""
    return int(torch.ops.torchckpt.host_page_bytes())


def host_pool_built_with_cuda() -> bool:
    """Whether csrc/host_pool.cpp was built with the CUDA runtime (it can pin memory)."""
    return bool(torch.ops.torchckpt.host_pool_built_with_cuda())


def vmm_status(device_index: int) -> str:
    """"" when CUDA device ``device_index`` supports the VMM arena, else why not."""
    return str(torch.ops.torchckpt.vmm_status(device_index))


def zfp_has_cuda() -> bool:
    """Whether ``torchckpt._zfp`` was built with cuZFP."""
    return bool(torch.ops.torchckpt.zfp_has_cuda())


def zfp_compress(field: torch.Tensor, shape: Sequence[int], rate: float, out: torch.Tensor) -> None:
    """Compress ``field`` (zfp field ``shape``) at fixed ``rate`` bits per value into the byte buffer ``out``."""
    torch.ops.torchckpt.zfp_compress(field, list(shape), float(rate), out)


def zfp_decompress(data: torch.Tensor, shape: Sequence[int], rate: float, out: torch.Tensor) -> None:
    """Decompress ``data`` (zfp field ``shape``, fixed ``rate``) into ``out``."""
    torch.ops.torchckpt.zfp_decompress(data, list(shape), float(rate), out)


def register_zfp_fakes() -> None:
    """Fake kernels for the zfp ops, so that they trace under torch.compile (they mutate ``out`` only)."""
    for op in ("zfp_compress", "zfp_decompress"):
        try:
            torch.library.register_fake("torchckpt::" + op)(lambda *args: None)
        except (RuntimeError, AttributeError):  # already registered, or an older torch
            pass
