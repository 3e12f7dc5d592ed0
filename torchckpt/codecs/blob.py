"""A compressed tensor (or several) laid out in one flat byte buffer, for one copy each way.

A codec's ``Packed`` may hold several buffers (TritonQuant: codes, block parameters, raw
blocks). The store and the snapshot store move compressed data as one byte span: ``Blob``
records where each buffer sits (offsets aligned to ``ALIGN``), writes them into a flat
buffer and reads ``Packed`` views back out of one. The metadata stays on the host.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchckpt._errors import internal_error
from torchckpt.codecs.base import Meta, Packed, flat_bytes

_ALIGN = 256


class Blob:
    """Where the buffers of some ``Packed`` sit in one flat byte buffer.

    Example::

        >>> from torchckpt.codecs import Identity
        >>> c = Identity()
        >>> packs = [c.compress(torch.arange(3.0)), c.compress(torch.ones(2, dtype=torch.int64))]
        >>> blob = Blob(packs)
        >>> flat = torch.empty(blob.nbytes, dtype=torch.uint8)
        >>> blob.write(flat, packs)
        >>> [c.decompress(p) for p in blob.read(flat)]
        [tensor([0., 1., 2.]), tensor([1, 1])]
    """

    __slots__ = ("metas", "spans", "nbytes")

    def __init__(self, packs: Sequence[Packed]) -> None:
        self.metas: list[Meta] = [p.meta for p in packs]
        self.spans: list[list[tuple[int, int]]] = []
        off = 0
        for p in packs:
            sp = []
            for b in p.buffers:
                n = b.numel() * b.element_size()
                sp.append((off, n))
                off += (n + _ALIGN - 1) // _ALIGN * _ALIGN
            self.spans.append(sp)
        self.nbytes = max(off, _ALIGN)

    def write(self, flat: torch.Tensor, packs: Sequence[Packed], non_blocking: bool = False) -> None:
        """Copy the buffers of ``packs`` to their places in ``flat`` (which may be on another device)."""
        for p, sp in zip(packs, self.spans):
            for b, (off, n) in zip(p.buffers, sp):
                if n:
                    src = b if b.dtype is torch.uint8 and b.dim() == 1 else flat_bytes(b)
                    flat[off : off + n].copy_(src, non_blocking=non_blocking)

    def write_raw(self, flat: torch.Tensor, packs: Sequence[Packed], copy: Callable[[int, int, int, Any], None],
                  stream: Any) -> None:
        """``write`` through ``copy(dst_ptr, src_ptr, nbytes, stream)`` (NOTE [ Cheap streams ] Rule 6): byte copies
        on ``stream``, no tensor op per buffer; a buffer that is not contiguous goes through ``copy_``."""
        base, room = flat.data_ptr(), flat.numel() * flat.element_size()
        if not flat.is_contiguous():
            raise internal_error("Blob.write_raw needs a contiguous flat buffer")
        for p, sp in zip(packs, self.spans):
            for b, (off, n) in zip(p.buffers, sp):
                if not n:
                    continue
                if off + n > room or b.numel() * b.element_size() != n:
                    raise internal_error(f"Blob.write_raw: a buffer of {b.numel() * b.element_size()} bytes for the "
                                         f"span ({off}, {n}) of a flat buffer of {room}")
                if b.is_contiguous():
                    copy(base + off, b.data_ptr(), n, stream)
                else:
                    flat[off : off + n].copy_(flat_bytes(b), non_blocking=True)

    def read(self, flat: torch.Tensor) -> list[Packed]:
        out = []
        for meta, sp in zip(self.metas, self.spans):
            bufs = tuple(flat[off : off + n] for off, n in sp)
            out.append(Packed(bufs if len(bufs) != 1 else bufs[0], meta))
        return out
