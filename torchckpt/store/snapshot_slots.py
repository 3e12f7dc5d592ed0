"""Where a ``SnapshotStore``'s off-GPU snapshots sit on the device: the flat layout of a snapshot's tensors in one
slot buffer, and the slot buffers themselves (NOTE [ Snapshot store ] Rules 2, 9-10, store/snapshots.py)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from torchckpt.memory.device_arena import ArenaSlots

__all__ = ["ALIGN", "Layout", "Slots"]

ALIGN = 256  # bytes: where each tensor of a snapshot starts in its slot


class Layout:
    """Shapes and dtypes of a snapshot and where each tensor sits in a flat buffer."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.meta = tuple((t.shape, t.dtype) for t in tensors)
        self.offsets = []
        off = 0
        for t in tensors:
            self.offsets.append(off)
            off += (t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN
        self.nbytes = off

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for (shape, dtype), off in zip(self.meta, self.offsets):
            n = dtype.itemsize * shape.numel()
            out.append(flat[off : off + n].view(dtype).view(shape))
        return out


class Slots:
    """The store's slots: arena slots (NOTE [ Snapshot store ] Rule 10), each replaceable by a grown buffer
    (NOTE [ Snapshot store ] Rule 9)."""

    def __init__(self, slots: ArenaSlots | None = None) -> None:
        self._arena_slots = slots
        self._own: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._arena_slots) if self._arena_slots is not None else 0

    def __getitem__(self, i: int) -> torch.Tensor:
        t = self._own.get(i)
        if t is not None:
            return t
        assert self._arena_slots is not None
        return self._arena_slots[i]

    def __setitem__(self, i: int, t: torch.Tensor) -> None:
        self._own[i] = t

    def release(self) -> None:
        self._own.clear()
        if self._arena_slots is not None:
            self._arena_slots.release()
