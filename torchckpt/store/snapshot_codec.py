"""The codec side of ``SnapshotStore``: snapshots held compressed, in slots sized from their blobs.

``SnapshotStore`` (store/snapshots.py, NOTE [ Snapshot store ] Rules 8-9) takes these methods from ``CodecSide``:
compressing a snapshot at save, decoding it at restore (into fresh tensors or the caller's, NOTE [ Snapshot store ]
Rule 11), writing it into a slot, and sizing or growing the slots from the blobs.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from torchckpt.codecs.base import Codec, Packed
from torchckpt.codecs.blob import Blob
from torchckpt.store.snapshot_slots import Layout, Slots

__all__ = ["CodecSide"]


def _identity(tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], ...]:
    """What makes a compression of ``tensors`` reusable: the same memory, unchanged since (version)."""
    return tuple((t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.device) for t in tensors)


class CodecSide:
    """The codec methods of ``SnapshotStore``, over the store's state (declared here, set by the store)."""

    device: torch.device
    codec: Codec | None
    slot_margin: float
    _c: dict[str, Any]
    _mover: Any
    _layout: Layout | None
    _slots: Slots
    _blobs: dict[int, Blob]
    _save_views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]]
    _first: tuple[tuple[tuple[Any, ...], ...], list[Packed]] | None
    _warned_grow: bool

    def _first_blob(self, tensors: Sequence[torch.Tensor], packs: Sequence[Packed] | None) -> int:
        """Compress the first snapshot once (or take ``packs``, its compression), kept for its save; the slot size it
        asks for: its blob times ``1 + slot_margin`` (NOTE [ Snapshot store ] Rule 9)."""
        if packs is None:
            packs = self._compress(tensors, count=False)
        self._first = (_identity(tensors), list(packs))
        return int(Blob(list(packs)).nbytes * (1.0 + self.slot_margin))

    def _compress(self, tensors: Sequence[torch.Tensor], count: bool = True) -> list[Packed]:
        assert self.codec is not None
        first, self._first = self._first, None
        if first is not None and count and first[0] == _identity(tensors):
            packs = first[1]  # the first snapshot, compressed once by calibrate
        else:
            packs = [self.codec.compress(t.detach()) for t in tensors]
        if count:
            self._c["raw_bytes"] += sum(p.orig_nbytes for p in packs)
            self._c["packed_bytes"] += sum(p.nbytes for p in packs)
        return packs

    def _decompress(self, packs: Sequence[Packed], outs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """``packs`` decoded into fresh tensors, or straight into ``outs`` (NOTE [ Snapshot store ] Rules 8, 11)."""
        assert self.codec is not None
        if outs is None:
            return [self.codec.decompress(p) for p in packs]
        return [self.codec.decompress(p, out=o) for p, o in zip(packs, outs)]

    def _views(self, n: int, flat: torch.Tensor, outs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Snapshot ``n``'s tensors from a slot (or a loaded buffer): views, or decompressed
        (NOTE [ Snapshot store ] Rule 8); written into ``outs`` when given (NOTE [ Snapshot store ] Rule 11)."""
        if self.codec is not None:
            return self._decompress(self._blobs[n].read(flat), outs)
        assert self._layout is not None
        views = self._layout.views(flat)
        return views if outs is None else self._copy_into(views, outs)

    @staticmethod
    def _copy_into(src: Sequence[torch.Tensor], outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """One copy of each of ``src`` into ``outs`` (NOTE [ Snapshot store ] Rule 11)."""
        for o, v in zip(outs, src):
            o.copy_(v)
        return outs

    def _fill_flat(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], packs: list[Packed] | None,
                   blob: Blob | None, s: int | None = None) -> None:  # s: the slot, its views kept with its buffer
        if packs is not None and blob is not None:
            blob.write(flat, packs)
            return
        assert self._layout is not None
        kept = self._save_views.get(s) if s is not None else None
        if kept is None or kept[0] is not flat:
            kept = (flat, self._layout.views(flat))
            if s is not None:
                self._save_views[s] = kept
        for dst, src in zip(kept[1], tensors):
            dst.copy_(src)

    def _ensure_room(self, s: int, nbytes: int) -> None:
        """Grow slot ``s`` to ``nbytes`` when a blob does not fit (NOTE [ Snapshot store ] Rule 9)."""
        old = self._slots[s]
        if nbytes <= old.numel():
            return
        self._mover.keep_alive(old)  # the old buffer may still be read by a flush or written by a fill
        self._slots[s] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._c["slot_grows"] += 1
        if not self._warned_grow:
            self._warned_grow = True
            warnings.warn(
                f"torchckpt: a compressed snapshot of {nbytes} bytes did not fit its slot of {old.numel()} bytes; "
                "the slot grew (GPU memory beyond the store's budget). Pass SnapshotStore(slot_bytes=...) or a "
                "larger slot_margin, or a codec setting with a steadier ratio.",
                RuntimeWarning, stacklevel=4,
            )

