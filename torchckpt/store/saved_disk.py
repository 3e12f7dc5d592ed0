"""The disk side of ``Store``: offloaded tensors the host pool has no room for, in files.

``Store`` (store/saved.py) takes these methods from ``DiskSpill``, as ``SnapshotStore`` takes its
disk side from store/snapshot_disk.py; the files themselves are NOTE [ Disk tier ]'s (memory/disk.py).

# NOTE [ Spill to disk ]
# 1. ``Store(disk=...)`` (a directory, or a ``DiskTier``) puts a third tier behind the host pool.
#    An entry's copy off the device (NOTE [ Store ] Rule 3) takes a host block while the pool
#    has room under its cap: its blocks in use plus this one within ``capacity_bytes``. Past
#    that, the entry *spills*: its copy goes to a staging buffer (pinned where the pool pins)
#    and is written behind to a file of its own on the tier's I/O threads, which wait for the
#    copy's event before reading the buffer; the buffer is let go once the write has ended.
#    A pool that refuses a block under its cap (a chunk too fragmented to hold it; it then
#    warns once that it goes pageable) gets the block back and the entry spills; the pool
#    counts as full until its use drops below the level it refused at.
# 2. Staging buffers (writes in flight and reads ahead) hold at most ``STAGING_BYTES``: a spill
#    that would pass it first waits for the oldest write in flight (one buffer is always
#    allowed, however large). So host memory stays within the pool's cap plus that.
# 3. A spilled entry is read back when it is loaded (an unpack that misses, or a prefetch of the
#    plan): from its staging buffer while its write is still under way, else from its file
#    into a fresh staging buffer, then copied to the device as a host block would be. With a
#    codec the file holds the compressed blob (NOTE [ Store ] Rule 9).
# 4. Read-ahead: on the prefetch plan (NOTE [ Prefetch from a recorded trace ]), each action
#    position also starts, in trace order, the file reads of the spilled entries unpacked
#    next, as far as the staging budget allows; the load collects the read (waiting for it
#    if needed). Off the plan (the first step, ``prefetch=False``) loads read on demand.
# 5. The file is deleted when the entry dies (its last handle released: after its last unpack,
#    at the end of backward, or when an exception drops the graph); ``close()`` deletes every
#    file of the store, closes the tier when the store made it, and later loads of what it
#    held raise. The tier's own finalizer removes its directory at garbage collection and at
#    process exit (NOTE [ Disk tier ] Rule 6).
# 6. Errors (NOTE [ Disk tier ] Rule 5): a write that fails (a full disk, ENOSPC) leaves the
#    entry's bytes in its staging buffer, which serves its loads from then on, and the next
#    pack or unpack raises a ``torchckpt:`` error saying what to change: never a lost tensor
#    or a wrong gradient. A failed read raises from the unpack that needs it. A directory
#    that is missing or cannot be written fails ``Store(disk=...)`` itself.
"""
from __future__ import annotations

import contextlib
import errno
import itertools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from typing import Any

import torch

from torchckpt._errors import CheckpointError
from torchckpt.memory import DiskStats, DiskTier, HostBlock, HostPoolBase
from torchckpt.schedules.trace import UNPACK, TracePrefetch

__all__ = ["STAGING_BYTES", "DiskSpill"]

STAGING_BYTES = 256 << 20  # NOTE [ Spill to disk ] Rule 2
_uids = itertools.count()  # names a store's files in a tier it may share


def check_disk(disk: object) -> None:
    """``Store(disk=...)`` takes a directory or a ``DiskTier``."""
    if disk is not None and not isinstance(disk, (str, os.PathLike, DiskTier)):
        raise TypeError(f"torchckpt: Store(disk=...) expects a directory path or a torchckpt.memory.DiskTier, got "
                        f"{type(disk).__name__} {disk!r}; pass e.g. disk='/mnt/nvme/scratch', or None to keep "
                        "offloaded tensors in host memory only.")


class DiskSpill:
    """The disk-tier methods of ``Store`` (NOTE [ Spill to disk ]), over the store's state."""

    host: HostPoolBase
    _mover: Any
    _c: dict[str, Any]
    _plan: TracePrefetch | None
    _entries: dict[int, Any]

    def _disk_init(self, disk: str | os.PathLike[str] | DiskTier | None) -> None:
        check_disk(disk)
        self._own_disk = disk is not None and not isinstance(disk, DiskTier)
        self.disk: DiskTier | None = disk if disk is None or isinstance(disk, DiskTier) else DiskTier(disk)
        self._disk_uid = next(_uids)
        self._disk_seq = itertools.count()
        self._disk_keys: set[Any] = set()  # files of live entries (and writes that failed: NOTE [ Spill to disk ] Rule 6)
        self._staged: dict[Any, tuple[torch.Tensor, Future[None] | None]] = {}  # key -> (buffer, its write or None)
        self._ahead: dict[Any, tuple[Future[Any], torch.Tensor]] = {}  # NOTE [ Spill to disk ] Rule 4: reads under way
        self._staged_bytes = 0
        self._refused_at: int | None = None  # NOTE [ Spill to disk ] Rule 1: the pool's use when it last refused a block under its cap
        self._spill_error: BaseException | None = None  # NOTE [ Spill to disk ] Rule 6: a failed write, not raised yet
        self._ahead_pos = 0  # NOTE [ Spill to disk ] Rule 4: how far the read-ahead has looked in the plan's trace
        self._ahead_last = -1

    # -- NOTE [ Spill to disk ] Rule 1: host block or staging buffer -------------------------
    def _alloc_for(self, e: Any) -> Callable[[int], HostBlock]:
        """The allocator of ``e``'s copy off the device: the host pool, or a staging buffer
        (NOTE [ Spill to disk ] Rule 1)."""
        if self.disk is None:
            return self.host.alloc

        def alloc(n: int) -> HostBlock:
            st = self.host.stats()
            used = st.in_use_bytes + st.pageable_in_use_bytes
            room = used + n <= self.host.capacity_bytes and (self._refused_at is None or used < self._refused_at)
            if room:
                block = self.host.alloc(n)
                if block.chunk >= 0:
                    return block
                self.host.free(block)  # the pool went pageable under its cap: spill instead
                self._refused_at = used
            if self.disk is None or self.disk.closed:
                raise CheckpointError("torchckpt: a saved tensor must spill to disk (the host pool is at its cap), but "
                                      "Store.close() closed this store's disk tier; make a new Store(disk=...) for "
                                      "more training, or give the host pool more room (HostPool(capacity_bytes=...)).")
            e.disk = ("saved", self._disk_uid, next(self._disk_seq))
            return HostBlock(self._staging(n, wait_writes=True), -1, 0, n, False)

        return alloc

    def _staging(self, n: int, wait_writes: bool) -> torch.Tensor:
        """A staging buffer of ``n`` bytes, first waiting for old writes to keep within the budget
        (NOTE [ Spill to disk ] Rule 2)."""
        if wait_writes:
            for key, (_, fut) in list(self._staged.items()):
                if self._staged_bytes + n <= STAGING_BYTES:
                    break
                if fut is not None:
                    wait([fut])
                    self._collect(key)
        pin = self._mover.cuda and bool(self.host.pin)
        return torch.empty(n, dtype=torch.uint8, pin_memory=pin)

    def _spill(self, e: Any) -> None:
        """Start writing the staging buffer ``e.host`` (just filled by the copy off the device) to a file
        (NOTE [ Spill to disk ] Rule 1)."""
        assert self.disk is not None and e.host is not None
        buf, e.host = e.host.tensor, None
        key = e.disk
        self._disk_keys.add(key)
        self._staged[key] = (buf, None)  # the bytes stay here whatever the write does (NOTE [ Spill to disk ] Rule 6)
        self._staged_bytes += buf.numel()
        self._c["spilled"] += 1
        self._c["spilled_bytes"] += buf.numel()
        with self._disk_errors():
            self._staged[key] = (buf, self.disk.write(key, buf, after=e.d2h))

    def _collect(self, key: Any) -> None:
        """Let go of ``key``'s staging buffer if its write has ended well; keep it if it failed
        (NOTE [ Spill to disk ] Rule 6)."""
        buf, fut = self._staged[key]
        if fut is None or not fut.done():
            return
        err = CheckpointError("torchckpt: the write was cancelled") if fut.cancelled() else fut.exception()
        if err is None:
            del self._staged[key]
            self._staged_bytes -= buf.numel()
        else:
            self._staged[key] = (buf, None)
            if self._spill_error is None:
                self._spill_error = err

    def _poll_disk(self, raise_errors: bool) -> None:
        """Collect finished writes; with ``raise_errors``, raise a failed one's error (NOTE [ Spill to disk ] Rule 6)
        and the tier's."""
        if self.disk is None:
            return
        for key in [k for k, (_, f) in self._staged.items() if f is not None and f.done()]:
            self._collect(key)
        if not raise_errors or self.disk.closed:
            return
        err, self._spill_error = self._spill_error, None
        if err is not None:
            try:
                self.disk.check()  # the same error, as the tier reports it: consumed here
            except CheckpointError:
                pass
            raise _write_failed(self.disk, err) from err
        with self._disk_errors():
            self.disk.check()

    # -- NOTE [ Spill to disk ] Rules 3 and 4: reading back ----------------------------------
    def _disk_source(self, e: Any) -> torch.Tensor:
        """Host bytes of spilled entry ``e`` for its copy to the device (NOTE [ Spill to disk ] Rule 3)."""
        disk, key = self.disk, e.disk
        if disk is None or disk.closed:
            raise CheckpointError("torchckpt: a saved tensor this Store spilled to disk is needed after Store.close() "
                                  "deleted its file; close the store only once backward has run (or the graph is "
                                  "dropped).")
        staged = self._staged.get(key)
        if staged is not None:  # the write is under way (or failed): the staging buffer has the bytes
            return staged[0]
        with self._disk_errors():
            ahead = self._ahead.pop(key, None)
            if ahead is not None:
                self._staged_bytes -= ahead[1].numel()
                return disk.read(key, ahead[1])  # waits for the read-ahead if needed (NOTE [ Spill to disk ] Rule 4)
            return disk.read(key, self._staging(disk.nbytes(key), wait_writes=False))

    def _read_ahead(self, pos: int) -> None:
        """Start the file reads of the spilled entries unpacked next on the plan, within the budget
        (NOTE [ Spill to disk ] Rule 4)."""
        disk, plan = self.disk, self._plan
        if disk is None or disk.closed or plan is None or pos < 0:
            return
        if pos < self._ahead_last:  # a new step
            self._ahead_pos = 0
        self._ahead_last = pos
        trace = plan.trace
        i = max(self._ahead_pos, pos + 1)
        while i < len(trace):
            kind, eid, _ = trace[i]
            e = self._entries.get(eid) if kind == UNPACK else None
            key = None if e is None or e.gpu is not None else e.disk
            if key is not None and key not in self._staged and key not in self._ahead:
                n = disk.nbytes(key)
                if self._staged_bytes + n > STAGING_BYTES and (self._staged or self._ahead):
                    break
                buf = self._staging(n, wait_writes=False)
                with self._disk_errors():
                    self._ahead[key] = (disk.prefetch(key, buf), buf)
                self._staged_bytes += n
            i += 1
        self._ahead_pos = i

    # -- NOTE [ Spill to disk ] Rule 5: files freed ------------------------------------------
    def _forget_disk(self, e: Any) -> None:
        """``e`` died: its read-ahead and staging buffer dropped, its write cancelled or waited for, its file deleted."""
        key = e.disk
        ahead = self._ahead.pop(key, None)
        if ahead is not None:
            self._staged_bytes -= ahead[1].numel()
        staged = self._staged.pop(key, None)
        if staged is not None:
            self._staged_bytes -= staged[0].numel()
        self._disk_keys.discard(key)
        if self.disk is not None:
            self.disk.delete(key)  # waits for a job under way on the buffers above (NOTE [ Disk tier ] Rule 6)

    def _disk_stats(self) -> DiskStats | None:
        """The tier's counters once its jobs have ended (``Store.stats``)."""
        if self.disk is None or self.disk.closed:
            return None
        self.disk.wait()
        self._poll_disk(raise_errors=False)
        return self.disk.stats()

    def close(self) -> None:
        """Delete this store's files on its disk tier, and close the tier if the store made it (NOTE [ Spill to disk ]).

        Tensors still held by a graph that were spilled can no longer be read back (their unpack
        raises). Without ``disk=`` there is nothing to do: host memory is the pool's.

        Example::

            >>> import tempfile, torchckpt
            >>> store = torchckpt.Store("cpu", disk=tempfile.mkdtemp())
            >>> store.close()
            >>> store.disk.closed
            True
        """
        disk = self.disk
        if disk is None or disk.closed:
            return
        for key in list(self._disk_keys):
            disk.delete(key)
        self._disk_keys.clear()
        self._staged.clear()
        self._ahead.clear()
        self._staged_bytes = 0
        if self._own_disk:
            disk.close()

    @contextlib.contextmanager
    def _disk_errors(self) -> Iterator[None]:
        """The tier's errors (raised by its calls) as the Store's (NOTE [ Spill to disk ] Rule 6)."""
        try:
            yield
        except CheckpointError as err:
            if str(err).startswith("torchckpt: the Store's disk tier") or self.disk is None:
                raise
            for key in [k for k, (_, f) in self._staged.items() if f is not None and f.done()]:
                self._collect(key)
            mine, self._spill_error = self._spill_error, None
            if mine is not None:  # the tier reported a write of ours: say what it means for a saved tensor
                raise _write_failed(self.disk, mine) from mine
            what = str(err).removeprefix("torchckpt: ")
            raise CheckpointError(f"torchckpt: the Store's disk tier failed: {what}") from err


def _write_failed(disk: DiskTier, err: BaseException) -> CheckpointError:
    """NOTE [ Spill to disk ] Rule 6's error for a spilled tensor whose file could not be written."""
    cause = err.__cause__ if isinstance(err.__cause__, OSError) else err
    where = os.path.dirname(disk.root)
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        what = f"the disk at {where} is full (ENOSPC)"
    else:
        what = f"writing to the disk tier at {where} failed ({cause})"
    return CheckpointError(
        f"torchckpt: {what}: a saved tensor that the host pool had no room for could not be written there "
        "(Store(disk=...)). Free space there or pass Store(disk=...) another directory, or give the host pool more "
        "room (HostPool(capacity_bytes=...)) so that fewer saved tensors spill to disk. The tensor stayed in host "
        "memory: no data was lost.")
