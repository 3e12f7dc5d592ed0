"""Where a ``SnapshotStore``'s off-GPU snapshots sit on the device: the flat layout of a snapshot's tensors in one
slot buffer, and the slot buffers themselves (NOTE [ Snapshot store ] Rules 2, 9-10, store/snapshots.py).

# NOTE [ Slot views ]
# A view of a tensor in a flat slot (a slice, a dtype view, a shape view) costs microseconds of host time on the
# CPU, more than the rest of a save or a restore of a small state; a loop makes one save and one restore a step.
# 1. The views of a snapshot's tensors in slot ``s``'s buffer are made once per buffer (``CodecSide._kept_views``,
#    kept with the buffer they view: a grown slot gets new ones) and serve every save into the slot and every
#    restore from it; they never leave the store.
# 2. A restore that copies into the caller's tensors (``out=``, NOTE [ Snapshot store ] Rule 11) reads the kept
#    views; one that returns views (NOTE [ Snapshot store ] Rule 5) returns fresh views of them (``view_as``: the
#    same memory, shapes, strides and version counter), so what a caller does to its views stays off the store's.
# 3. ``Slots`` looks each slot's buffer up in the arena once and keeps it until it grows or ``release``.
"""
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
    (NOTE [ Snapshot store ] Rule 9); each buffer looked up once (NOTE [ Slot views ] Rule 3)."""

    def __init__(self, slots: ArenaSlots | None = None) -> None:
        self._arena_slots = slots
        self._at: list[torch.Tensor | None] = [None] * (len(slots) if slots is not None else 0)

    def __len__(self) -> int:
        return len(self._at)

    def __getitem__(self, i: int) -> torch.Tensor:
        t = self._at[i]
        if t is None:
            assert self._arena_slots is not None
            t = self._at[i] = self._arena_slots[i]  # maps its memory at its first use (NOTE [ Snapshot store ] Rule 10)
        return t

    def __setitem__(self, i: int, t: torch.Tensor) -> None:
        self._at[i] = t

    def release(self) -> None:
        self._at = [None] * len(self._at)
        if self._arena_slots is not None:
            self._arena_slots.release()
