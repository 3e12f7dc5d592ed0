"""The disk side of ``SnapshotStore``: its ``Tier.DISK`` snapshots written behind, read back and freed.

``SnapshotStore`` (store/snapshots.py, NOTE [ Snapshot store ]) takes these methods from ``DiskSide``; the
files' own NOTE [ Disk tier ] is memory/disk.py's.

# NOTE [ Snapshot disk tier ]
# 1. With ``disk=`` (a directory, or a ``DiskTier``: NOTE [ Disk tier ], memory/disk.py),
#    ``Tier.DISK`` snapshots go one tier further. A save is a HOST save (a slot, flushed to a host
#    block); the block is then written behind to a file, and given back to the host pool once
#    the write has ended, so host memory holds only the disk snapshots in flight. On CUDA the
#    I/O thread waits for the flush's event before it reads the block. A write-back snapshot
#    (NOTE [ Snapshot store ] Rule 6) is written when it is flushed, at its eviction.
# 2. A restore that misses the slots reads the file into a host block (or collects a prefetch's
#    read) and goes on as a HOST restore; the block goes back once the slot is filled from it.
#    ``Prefetch(n, DISK, GPU)`` takes and pins a slot as NOTE [ Snapshot store ] Rule 3 says and
#    starts the read on an I/O thread; the slot's fill is issued on the owner's thread once the
#    read has ended: by the next action that finds it done, at the latest by the restore (which
#    waits for the read).
# 3. ``free`` deletes the file (cancelling a queued write, waiting for one under way); ``close``
#    deletes every file of the store, and closes the tier when the store made it. Each action
#    first collects the tier's finished jobs and raises its I/O errors (NOTE [ Disk tier ] Rule 5);
#    a snapshot whose write failed keeps its host block and is a HOST snapshot from then on: an
#    error, never a lost or wrong snapshot. ``stats()`` waits for the jobs under way, so a loop's
#    own write errors reach it. With a codec the files hold the blobs (NOTE [ Snapshot store ] Rule 8).
# 4. Reads in flight: the prefetches' reads run on the tier's read threads (NOTE [ Disk tier ]
#    Rule 7), so as many reads as the schedule has prefetches ahead (``slots - 1`` with
#    ``plan_prefetch``), up to the tier's ``reads``, are under way at once, each into its own host
#    block and tracked by its own future in ``_reading``. Each action collects the reads that have
#    ended, whichever order they end in, and fills their slots; a restore waits only for its own
#    snapshot's read (Rule 2). The bytes, the slot fills and the order of the frees are those of
#    one read at a time: a block goes back as Rule 1 says, whenever its read ended.
# 5. A failed read is collected only by its own snapshot's restore: ``_poll`` leaves it in
#    ``_reading``, and the tier reports it to no other action (NOTE [ Disk tier ] Rule 7). That
#    restore raises the tier's ``torchckpt:`` error, which names the file, after giving back the
#    snapshot's host block and slot (nothing of it stays: never a wrong restore); its file stays
#    until ``free`` or ``close`` deletes it. ``close`` of a store that made its tier joins the
#    tier's threads, reads in flight included (NOTE [ Disk tier ] Rules 6-7).
# 6. Reads into the slot (``DiskTier(device_reads=...)``: NOTE [ Disk tier ] Rule 8, NOTE [ cuFile reads ]): where the
#    tier reads into the store's device memory and the snapshots are not compressed (a blob is decoded from host
#    memory), a prefetch's read goes straight into its pinned slot, with no host block and no fill: the read thread
#    first waits for the slot's last flush and its last use by compute (or, with no record of it, everything the
#    compute stream had issued), and the slot holds the snapshot once the read's future is done, which the restore
#    waits for (Rule 2). A failed read gives the slot back as Rule 5 says. A restore that misses the slots reads
#    through a host block as before (Rule 2).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from torchckpt.codecs.blob import Blob
from torchckpt.memory import DiskTier, HostBlock, HostPoolBase
from torchckpt.schedules.cache import Cache

__all__ = ["DiskSide"]


class DiskSide:
    """The disk-tier methods of ``SnapshotStore``, over the store's state (declared here, set by the store)."""

    disk: DiskTier | None
    host: HostPoolBase
    codec: Any
    _uid: int
    _disk_ns: set[int]
    _writing: dict[int, Future[None]]
    _on_disk: set[int]
    _reading: dict[int, Future[Any]]
    _on_host: dict[int, tuple[HostBlock, Any]]
    _blobs: dict[int, Blob]
    _layout: Any
    _prefetched: set[int]
    _rank: Cache[int]
    _slot_of: dict[int, int]
    _free_slots: list[int]
    _fill_of: list[int | None]
    _fill_ev: list[Any]
    _flush_ev: list[Any]
    _use_ev: list[Any]
    _slots: Any
    _into_slot: set[int]
    device: torch.device

    def _fill(self, s: int, n: int) -> Any:  # SnapshotStore's: a slot filled from host (NOTE [ Snapshot store ] Rule 3)
        raise NotImplementedError

    def _record(self) -> Any:  # SnapshotStore's: an event at the compute stream's position
        raise NotImplementedError

    def _read_ahead(self, n: int, s: int) -> None:
        """Start the prefetch's read of disk snapshot ``n`` for slot ``s``: straight into the slot, or into a host
        block the slot is filled from once it has ended (NOTE [ Snapshot disk tier ] Rules 2, 6)."""
        assert self.disk is not None
        k = self._size(n)
        if self.codec is None and self.disk.reads_into(self.device):  # NOTE [ Snapshot disk tier ] Rule 6
            slot = self._slots[s]
            after = (self._flush_ev[s], self._use_ev[s] if self._use_ev[s] is not None else self._record())
            self._reading[n] = self.disk.prefetch(self._key(n), slot if slot.numel() == k else slot[:k],
                                                  tuple(ev for ev in after if ev is not None))
            self._into_slot.add(n)
            self._fill_of[s] = n
            self._fill_ev[s] = None
            return
        block = self.host.alloc(k)
        self._on_host[n] = (block, None)
        self._reading[n] = self.disk.prefetch(self._key(n), block.tensor)

    def _key(self, n: int) -> tuple[int, int]:
        return (self._uid, n)

    def _size(self, n: int) -> int:
        """Bytes of off-GPU snapshot ``n`` in a host block: its blob, or the layout."""
        if self.codec is not None:
            return self._blobs[n].nbytes
        assert self._layout is not None
        return self._layout.nbytes

    def _write_behind(self, n: int) -> None:
        """Start writing disk snapshot ``n``'s new host block to its file (NOTE [ Snapshot disk tier ] Rule 1)."""
        if n not in self._disk_ns:
            return
        assert self.disk is not None
        block, ev = self._on_host[n]
        self._on_disk.discard(n)
        self._writing[n] = self.disk.write(self._key(n), block.tensor, after=ev)

    def _load(self, n: int) -> None:
        """Read disk snapshot ``n`` into a new host block, now (NOTE [ Snapshot disk tier ] Rule 2)."""
        assert self.disk is not None
        block = self.host.alloc(self._size(n))
        try:
            self.disk.read(self._key(n), block.tensor)
        except BaseException:
            self.host.free(block)
            raise
        self._on_host[n] = (block, None)

    def _finish_read(self, n: int) -> None:
        """Collect the prefetch's read of ``n`` (waiting for it) and fill its pinned slot
        (NOTE [ Snapshot disk tier ] Rules 2, 4-5)."""
        assert self.disk is not None
        self._reading.pop(n)
        direct = n in self._into_slot  # NOTE [ Snapshot disk tier ] Rule 6
        self._into_slot.discard(n)
        if direct:
            dst, k = self._slots[self._slot_of[n]], self._size(n)
            buf = dst if dst.numel() == k else dst[:k]
        else:
            block, _ = self._on_host[n]
            buf = block.tensor
        try:
            self.disk.read(self._key(n), buf)  # the prefetch's buffer: waits, raises its error
        except BaseException:  # nothing of n stays in host memory or in a slot: never a wrong restore
            if not direct:
                del self._on_host[n]
                self.host.free(block)
            self._prefetched.discard(n)
            self._rank.remove(n)
            slot = self._slot_of.pop(n, None)
            if slot is not None:
                self._free_slots.append(slot)
                if direct:
                    self._fill_of[slot] = None  # it holds no snapshot
            raise
        s = self._slot_of.get(n)
        if s is not None and not direct:
            self._fill(s, n)
        self._release_host(n)

    def _release_host(self, n: int) -> None:
        """Give back disk snapshot ``n``'s host block once its file is complete and nothing waits on it
        (NOTE [ Snapshot disk tier ] Rule 1)."""
        if n not in self._on_disk or n in self._writing or n in self._reading or n not in self._on_host:
            return
        block, ev = self._on_host.pop(n)
        s = self._slot_of.get(n)
        filled = s is not None and self._fill_of[s] == n  # a fill from the block may still run
        self.host.free(block, self._fill_ev[s] if filled else ev)  # type: ignore[index]

    def _poll(self) -> None:
        """Collect the disk tier's finished jobs, then raise its I/O errors (NOTE [ Snapshot disk tier ] Rule 3)."""
        disk = self.disk
        if disk is None or disk.closed:
            return
        for n, fut in list(self._writing.items()):
            if not fut.done():
                continue
            del self._writing[n]
            if fut.cancelled() or fut.exception() is not None:
                self._disk_ns.discard(n)  # the host block keeps it: a HOST snapshot from now on
                disk.delete(self._key(n))
            else:
                self._on_disk.add(n)
                self._release_host(n)
        for n in [n for n, fut in self._reading.items() if fut.done() and not fut.cancelled() and not fut.exception()]:
            self._finish_read(n)  # a failed read waits for its own restore (NOTE [ Snapshot disk tier ] Rule 5)
        disk.check()

    def _closing(self) -> list[int]:
        """The off-GPU snapshots ``close`` frees, once every queued read is cancelled: ``close`` then waits only for
        the reads already running (NOTE [ Snapshot disk tier ] Rule 5)."""
        for fut in self._reading.values():
            fut.cancel()
        return [*self._on_host, *(self._disk_ns - self._on_host.keys())]

    def _drop_disk(self, n: int) -> None:
        """Forget disk snapshot ``n``: its jobs cancelled or waited for, its file deleted
        (NOTE [ Snapshot disk tier ] Rule 3)."""
        if n not in self._disk_ns:
            return
        assert self.disk is not None
        self._disk_ns.discard(n)
        self._writing.pop(n, None)
        self._reading.pop(n, None)
        self._into_slot.discard(n)
        self._on_disk.discard(n)
        self.disk.delete(self._key(n))
