"""A disk tier behind host memory: snapshot bytes in files, written behind and read ahead by I/O threads.

The third layer of a multilayer buffer system (HBM -> DRAM -> NVMe, MLBS): ``SnapshotStore(disk=...)``
sends its ``Tier.DISK`` snapshots here once they are in host memory, so that host memory holds only the
snapshots in flight. Known gaps: the read-ahead starts with the snapshot cache's prefetch (no deeper,
disk-level look-ahead such as MLBS's LIFO prefetch), and no autotuner ranks the tiers by bandwidth
(``DiskTier.measure_bandwidth`` is the measurement it would use).

# NOTE [ Disk tier ]
# 1. One file per written key, named by a sequence number, in a private directory
#    ``torchckpt-*`` that the tier makes under the directory it is given. A file per snapshot
#    (not offsets in one file) gives the space back at once when a snapshot is freed (unlink)
#    and needs no allocator on disk; writing a key again replaces its file.
# 2. Write-behind and read-ahead: ``write`` and ``prefetch`` queue a job on ``threads`` I/O
#    threads (a ``ThreadPoolExecutor``) and return a ``Future`` at once; the jobs call
#    ``os.pwrite`` / ``os.preadv``, which release the GIL. The buffer a job reads (a write's
#    source) or fills (a prefetch's destination) is the job's until its future is done: the
#    caller keeps it alive and does not touch it until then. A write may name an event
#    (``after``, e.g. the CUDA event of the device-to-host copy that fills its source) that the
#    I/O thread waits for before it reads the source.
# 3. Jobs of one key run in the order they were asked for: a job first waits for the key's
#    previous job (the pool starts jobs first in, first out, so the previous one is running or
#    done: no deadlock). Only the owner's thread calls the tier; the I/O threads touch their
#    job's buffer and file, and the statistics and error list under a lock.
# 4. O_DIRECT: ``direct=None`` probes the directory at construction (opens a file with
#    ``O_DIRECT`` and writes and reads one block); a file system that refuses (EINVAL: tmpfs on
#    older kernels, some network file systems) gets buffered I/O, and ``direct`` says which mode
#    is in use (``direct=True`` raises instead of falling back; ``False`` never tries). With
#    O_DIRECT, file offsets and lengths are multiples of ``ALIGN``; data moves in pieces of
#    ``PIECE`` bytes straight from or to the caller's buffer where its address is aligned (to
#    512 bytes when the probe shows the device takes that, else ``ALIGN``), otherwise through
#    an aligned bounce buffer of the thread's; the file's last piece is padded with zeros.
#    Reads give back exactly the bytes written: the mode changes speed and page-cache use,
#    never results.
# 5. Errors: construction raises ``CheckpointError`` for a missing or unwritable directory (the
#    probe writes a file there). An I/O error in a write thread (ENOSPC, EIO, ...) becomes a
#    ``CheckpointError`` that the job's future holds and that the next ``write``, ``prefetch``,
#    ``read`` or ``check`` raises on the owner's thread (once; ``read`` of the failed key
#    raises it itself). A failed write leaves no file and its source untouched: the caller
#    still holds the data (SnapshotStore keeps the host block). A failed read leaves no data;
#    its error is the key's ``read``'s (Rule 7).
# 6. Cleanup: ``delete(key)`` cancels the key's queued jobs (or waits for a running one) and
#    unlinks its file; ``close()`` cancels queued jobs, waits for running ones and removes the
#    directory; a ``weakref.finalize`` does the same when the tier is collected and at process
#    exit (the pool's threads finish their running jobs first).
# 7. Reads in flight: ``prefetch`` queues its job on ``reads`` read threads of their own (default
#    ``READS``), apart from the write threads, so reads never queue behind writes and up to
#    ``reads`` files are read at once (more queue, first in, first out). A read job waits only
#    for its key's previous job (Rule 3; a write runs on the other pool, which never waits for a
#    read: no deadlock), reads into the caller's buffer, and its error (naming the file) stays in
#    its future: ``read(key)``, the collection that needs the bytes, raises it, never ``check``,
#    so one snapshot's failed read fails that snapshot's restore, not another action. A read never
#    collected (its key deleted) needed no bytes: its error goes with it. ``close()`` cancels both
#    pools' queued jobs first (a running read waiting for a cancelled write then ends), then joins
#    both pools' threads.
# 8. Reads into the store's own memory (``device_reads``, NOTE [ cuFile reads ] in memory/gds.py): ``prefetch`` and
#    ``read`` take an ``out`` on the store's device when ``reads_into(device)`` says so: a CUDA buffer is filled by
#    ``cuFileRead`` on the read thread (``True``: wherever cuFile opens, compatibility mode included; ``None``, the
#    default: only with GPUDirect Storage's driver loaded; ``False``: never), a CPU one (a CPU store's slot) by the
#    same reads as a host block. ``prefetch(..., after=...)`` names events the read thread waits for before it writes
#    ``out`` (the slot's last use and flush). The bytes are the file's either way.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import errno
import itertools
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Hashable
from typing import Any

import torch

from torchckpt._errors import CheckpointError, internal_error
from torchckpt.memory import gds

__all__ = ["ALIGN", "READS", "DiskStats", "DiskTier"]

ALIGN = 4096  # O_DIRECT file offsets and lengths (NOTE [ Disk tier ] Rule 4)
PIECE = 8 << 20  # bytes per O_DIRECT call, and the bounce buffer's size (NOTE [ Disk tier ] Rule 4)
READS = 4  # read threads by default: the default 4 slots prefetch 3 ahead, + 1 (NOTE [ Disk tier ] Rule 7)
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_log = logging.getLogger("torchckpt")


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclasses.dataclass(frozen=True)
class DiskStats:
    """What a disk tier did. Times in seconds.

    Attributes:
        writes / reads: files written / read (prefetches and synchronous reads).
        bytes_written / bytes_read: payload bytes moved each way (without O_DIRECT padding).
        write_s / read_s: time the I/O threads (and synchronous reads) spent in those calls.
        read_waits / read_wait_s: reads the owner's thread had to wait for (a synchronous read,
            or a prefetch not yet done), and its time spent waiting.
        direct: whether the tier uses O_DIRECT (NOTE [ Disk tier ] Rule 4).
    """

    writes: int = 0
    reads: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_s: float = 0.0
    read_s: float = 0.0
    read_waits: int = 0
    read_wait_s: float = 0.0
    direct: bool = False


class _Shared:
    """What the I/O threads share with the owner (NOTE [ Disk tier ] Rule 3): counters and errors, under ``lock``."""

    def __init__(self, root: str, direct: bool, mem_align: int) -> None:
        self.lock = threading.Lock()
        self.root = root
        self.direct = direct
        self.mem_align = mem_align
        self.c: dict[str, Any] = {f.name: 0 for f in dataclasses.fields(DiskStats) if f.name != "direct"}
        self.errors: list[CheckpointError] = []
        self.local = threading.local()

    def count(self, **kw: float) -> None:
        with self.lock:
            for k, v in kw.items():
                self.c[k] += v

    def fail(self, err: CheckpointError) -> CheckpointError:
        with self.lock:
            self.errors.append(err)
        return err

    def bounce(self) -> tuple[memoryview, torch.Tensor]:
        """This thread's aligned bounce buffer (an anonymous mapping: page aligned)."""
        b = getattr(self.local, "bounce", None)
        if b is None:
            m = mmap.mmap(-1, PIECE)
            b = (memoryview(m), torch.frombuffer(m, dtype=torch.uint8))
            self.local.bounce = b
        return b


class _Entry:
    """A key's file: its name, payload size, its write's job and the key's last job (NOTE [ Disk tier ] Rule 3)."""

    __slots__ = ("name", "nbytes", "written", "job")

    def __init__(self, name: str, nbytes: int, written: cf.Future[None]) -> None:
        self.name = name
        self.nbytes = nbytes
        self.written = written
        self.job: cf.Future[Any] = written


def _flat_bytes(t: object, what: str, device: bool = False) -> torch.Tensor:
    """``t`` if it is a flat contiguous uint8 tensor on the CPU (or, with ``device``, anywhere: NOTE [ Disk tier ]
    Rule 8), else a ``TypeError``."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or (t.device.type != "cpu" and not device) \
            or t.dim() != 1 or not t.is_contiguous():
        found = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"torchckpt: DiskTier.{what} takes a flat contiguous uint8 CPU tensor, found {found}; pass "
                        "e.g. a host block's tensor or t.view(-1).view(torch.uint8).")
    return t


def _write_error(shared: _Shared, nbytes: int, e: Exception) -> CheckpointError:
    where = shared.root
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        what = f"the disk tier at {where} is full (ENOSPC) writing a snapshot of {nbytes} bytes"
    else:
        what = f"writing a snapshot of {nbytes} bytes to the disk tier at {where} failed ({e})"
    return CheckpointError(
        f"torchckpt: {what}. Free space there, pass another directory (SnapshotStore(disk=...)), or use a "
        "schedule with fewer Tier.DISK snapshots. The snapshot stayed in host memory: no data was lost.")


def _read_error(path: str, nbytes: int, e: Exception) -> CheckpointError:
    return CheckpointError(
        f"torchckpt: reading a snapshot of {nbytes} bytes back from the disk tier's file {path} failed ({e}); "
        "the snapshot is lost. Check the device and its file system, or pass another directory "
        "(SnapshotStore(disk=...)).")


def _open(path: str, write: bool, direct: bool) -> int:
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    if direct:
        flags |= _O_DIRECT
    return os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)


def _aligned(addr: int, n: int, shared: _Shared) -> bool:
    return addr % shared.mem_align == 0 and n % ALIGN == 0


def _pwrite_all(fd: int, mv: memoryview, off: int) -> None:
    done = 0
    while done < len(mv):
        k = os.pwrite(fd, mv[done:], off + done)
        if k <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {k} bytes")
        done += k


def _pread_all(fd: int, mv: memoryview, off: int, need: int) -> None:
    """Fill ``mv`` from ``off``; at least ``need`` bytes must come (the rest is O_DIRECT padding)."""
    done = 0
    while done < need:
        k = os.preadv(fd, [mv[done:]], off + done)
        if k <= 0:
            raise OSError(errno.EIO, f"the file ended after {done} of {need} bytes")
        done += k


def _write_file(shared: _Shared, path: str, src: torch.Tensor) -> None:
    """``src``'s bytes into a new file at ``path`` (NOTE [ Disk tier ] Rule 4: straight, or in aligned pieces)."""
    n = src.numel()
    mv = src.numpy().data
    fd = _open(path, write=True, direct=shared.direct)
    try:
        if not shared.direct:
            _pwrite_all(fd, mv, 0)
            return
        base = src.data_ptr()
        for off in range(0, n, PIECE):
            k = min(PIECE, n - off)
            if _aligned(base + off, k, shared):
                _pwrite_all(fd, mv[off : off + k], off)
                continue
            bmv, bt = shared.bounce()
            padded = _round_up(k, ALIGN)
            bt[:k].copy_(src[off : off + k])
            bt[k:padded].zero_()
            _pwrite_all(fd, bmv[:padded], off)
    finally:
        os.close(fd)


def _read_file(shared: _Shared, path: str, out: torch.Tensor) -> None:
    """The file at ``path`` into ``out`` (exactly ``out.numel()`` bytes; NOTE [ Disk tier ] Rules 4 and 8)."""
    n = out.numel()
    if out.device.type == "cuda":
        gds.read(path, out, n, shared.direct)  # NOTE [ cuFile reads ] Rule 3
        return
    mv = out.numpy().data
    fd = _open(path, write=False, direct=shared.direct)
    try:
        if not shared.direct:
            _pread_all(fd, mv, 0, n)
            return
        base = out.data_ptr()
        for off in range(0, n, PIECE):
            k = min(PIECE, n - off)
            if _aligned(base + off, k, shared):
                _pread_all(fd, mv[off : off + k], off, k)
                continue
            bmv, bt = shared.bounce()
            _pread_all(fd, bmv[: _round_up(k, ALIGN)], off, k)
            out[off : off + k].copy_(bt[:k])
    finally:
        os.close(fd)


def _wait(futs: list[cf.Future[Any]]) -> None:
    """Wait for ``futs``, skipping cancelled ones (``cf.wait`` would wait for the pool to dequeue them)."""
    cf.wait([f for f in futs if not f.cancelled()])


def _failed_write(written: cf.Future[None]) -> BaseException | None:
    """The error of a finished write, if it failed (a cancelled write never wrote)."""
    if written.cancelled():
        return CheckpointError("torchckpt: internal: the write was cancelled")
    return written.exception()


def _write_job(shared: _Shared, path: str, src: torch.Tensor, after: Any) -> None:
    t0 = time.perf_counter()
    try:
        if after is not None:
            after.synchronize()  # the copy that fills src (NOTE [ Disk tier ] Rule 2)
        t0 = time.perf_counter()
        _write_file(shared, path, src)
    except Exception as e:  # noqa: BLE001 - every failure reaches the owner (NOTE [ Disk tier ] Rule 5)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise shared.fail(_write_error(shared, src.numel(), e)) from e
    shared.count(writes=1, bytes_written=src.numel(), write_s=time.perf_counter() - t0)


def _read_job(shared: _Shared, path: str, out: torch.Tensor, prev: cf.Future[Any],
              written: cf.Future[None], after: tuple[Any, ...] = ()) -> torch.Tensor:
    _wait([prev, written])  # NOTE [ Disk tier ] Rule 3
    for ev in after:  # NOTE [ Disk tier ] Rule 8: out's last use and flush end first
        ev.synchronize()
    failed = _failed_write(written)
    if failed is not None:  # held by the future: ``read`` of the key raises it (NOTE [ Disk tier ] Rule 7)
        raise CheckpointError(f"torchckpt: a read of a snapshot whose write failed (file {path}): {failed}")
    t0 = time.perf_counter()
    try:
        _read_file(shared, path, out)
    except Exception as e:  # noqa: BLE001 - the owner's ``read`` of the key raises it (NOTE [ Disk tier ] Rule 7)
        raise _read_error(path, out.numel(), e) from e
    shared.count(reads=1, bytes_read=out.numel(), read_s=time.perf_counter() - t0)
    return out


def _cleanup(pools: tuple[cf.ThreadPoolExecutor, ...], root: str) -> None:
    """NOTE [ Disk tier ] Rules 6-7: queued jobs of both pools cancelled (a running read that waits for a
    cancelled write then ends), running ones waited for and the threads joined, the directory removed."""
    for pool in pools:
        pool.shutdown(wait=False, cancel_futures=True)
    for pool in pools:
        pool.shutdown(wait=True)
    shutil.rmtree(root, ignore_errors=True)


def _probe(root: str, direct: bool, mem_offset: int) -> None:
    """Write and read back one ``ALIGN`` block at ``root`` (from ``mem_offset`` into an aligned buffer)."""
    path = os.path.join(root, "probe")
    m, back = mmap.mmap(-1, 2 * ALIGN), mmap.mmap(-1, 2 * ALIGN)  # page aligned; freed by the GC, not closed
    span = slice(mem_offset, mem_offset + ALIGN)
    m[span] = bytes(range(256)) * (ALIGN // 256)
    try:
        fd = _open(path, write=True, direct=direct)
        try:
            _pwrite_all(fd, memoryview(m)[span], 0)
        finally:
            os.close(fd)
        fd = _open(path, write=False, direct=direct)
        try:
            _pread_all(fd, memoryview(back)[span], 0, ALIGN)
        finally:
            os.close(fd)
        if back[span] != m[span]:
            raise OSError(errno.EIO, "the probe read back other bytes than it wrote")
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


class DiskTier:
    """Snapshot bytes in files under a directory, written behind and read ahead by I/O threads (NOTE [ Disk tier ]).

    Args:
        path: an existing, writable directory (an NVMe file system in practice); the tier works in a
            private subdirectory of it, removed by ``close()``.
        threads: I/O threads for writes (>= 1).
        reads: read threads (>= 1), the most reads in flight at once (NOTE [ Disk tier ] Rule 7);
            default ``READS``.
        direct: ``None``: O_DIRECT where the file system takes it, buffered I/O elsewhere; ``True``:
            O_DIRECT or a ``CheckpointError``; ``False``: buffered I/O (NOTE [ Disk tier ] Rule 4).
        device_reads: whether a store reads snapshots straight into its own memory (NOTE [ Disk tier ] Rule 8):
            ``None``: on CUDA where GPUDirect Storage's driver is loaded; ``True``: on CUDA wherever cuFile opens
            (a ``CheckpointError`` where it cannot), and on the CPU into the store's slots; ``False``: never.

    Raises:
        CheckpointError: ``path`` is missing, not a directory or not writable.

    Example::

        >>> import tempfile
        >>> tier = DiskTier(tempfile.mkdtemp(), direct=False)
        >>> src = torch.arange(10, dtype=torch.uint8)
        >>> tier.write("a", src).result()  # returns at once; src stays untouched until the future is done
        >>> tier.read("a")
        tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], dtype=torch.uint8)
        >>> tier.stats().writes, tier.stats().reads
        (1, 1)
        >>> tier.close()
    """

    def __init__(self, path: str | os.PathLike[str], threads: int = 2, direct: bool | None = None,
                 reads: int | None = None, device_reads: bool | None = None) -> None:
        reads = READS if reads is None else reads
        if device_reads is not None and not isinstance(device_reads, bool):
            raise TypeError(f"torchckpt: DiskTier(device_reads=...) expects None, True or False, got {device_reads!r}.")
        self.device_reads = device_reads
        if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
            raise TypeError(f"torchckpt: DiskTier(path=...) expects a directory path (str or os.PathLike), got "
                            f"{type(path).__name__} {path!r}; pass e.g. DiskTier('/mnt/nvme/scratch').")
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"torchckpt: DiskTier(threads=...) must be an int >= 1, got {threads!r}; pass e.g. "
                             "threads=2.")
        if not isinstance(reads, int) or isinstance(reads, bool) or reads < 1:
            raise ValueError(f"torchckpt: DiskTier(reads=...) must be an int >= 1 (reads in flight), got {reads!r}; "
                             f"pass e.g. reads={READS}, or None.")
        if direct is not None and not isinstance(direct, bool):
            raise TypeError(f"torchckpt: DiskTier(direct=...) expects None, True or False, got {direct!r}.")
        where = os.fspath(path)
        if not os.path.isdir(where):
            why = "does not exist" if not os.path.exists(where) else "is not a directory"
            raise CheckpointError(f"torchckpt: the disk tier's directory {where!r} {why}; create it first, or pass an "
                                  "existing directory on a fast local file system (e.g. an NVMe mount).")
        try:
            root = tempfile.mkdtemp(prefix="torchckpt-", dir=where)
        except OSError as e:
            raise CheckpointError(f"torchckpt: the disk tier cannot write in {where!r} ({e}); pass a directory you "
                                  "can write to.") from e
        try:
            use_direct, mem_align = self._choose_mode(root, direct)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        self.root = root
        self.threads = threads
        self._shared = _Shared(root, use_direct, mem_align)
        self.reads = reads
        self._pool = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="torchckpt-disk")
        self._read_pool = cf.ThreadPoolExecutor(max_workers=reads, thread_name_prefix="torchckpt-disk-read")
        self._files: dict[Hashable, _Entry] = {}
        self._reads: dict[Hashable, tuple[cf.Future[torch.Tensor], torch.Tensor]] = {}  # prefetches not collected
        self._seq = itertools.count()
        self._closed = False
        pools = (self._read_pool, self._pool)
        self._finalizer = weakref.finalize(self, _cleanup, pools, root)  # NOTE [ Disk tier ] Rules 6-7

    @staticmethod
    def _choose_mode(root: str, direct: bool | None) -> tuple[bool, int]:
        """(O_DIRECT?, memory alignment) for ``root``, probed (NOTE [ Disk tier ] Rule 4); raises if it cannot be written."""
        if direct is not False and _O_DIRECT:
            try:
                _probe(root, True, 0)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise CheckpointError(f"torchckpt: the disk tier cannot write in {os.path.dirname(root)!r} "
                                          f"({e}); pass a directory you can write to.") from e
                if direct:
                    raise CheckpointError(
                        f"torchckpt: DiskTier(direct=True), but the file system of {os.path.dirname(root)!r} refuses "
                        "O_DIRECT; pass direct=None (buffered I/O where O_DIRECT is refused) or a directory on "
                        "another file system.") from e
                _log.info("torchckpt: %s refuses O_DIRECT; the disk tier uses buffered I/O", root)
            else:
                try:
                    _probe(root, True, 512)
                except OSError:
                    return True, ALIGN
                return True, 512
        elif direct:
            raise CheckpointError("torchckpt: DiskTier(direct=True), but this platform has no O_DIRECT; pass "
                                  "direct=None or False.")
        try:
            _probe(root, False, 0)
        except OSError as e:
            raise CheckpointError(f"torchckpt: the disk tier cannot write in {os.path.dirname(root)!r} ({e}); pass a "
                                  "directory you can write to.") from e
        return False, 1

    # -- the owner's calls ---------------------------------------------------------------
    @property
    def direct(self) -> bool:
        """Whether files are read and written with O_DIRECT (NOTE [ Disk tier ] Rule 4)."""
        return self._shared.direct

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def __contains__(self, key: object) -> bool:
        return key in self._files

    def reads_into(self, device: torch.device) -> bool:
        """Whether reads go straight into memory of ``device`` (NOTE [ Disk tier ] Rule 8); raises where
        ``device_reads=True`` asks for cuFile and it cannot open."""
        if self.device_reads is False or (device.type == "cpu" and not self.device_reads):
            return False
        if device.type != "cuda":
            return device.type == "cpu"
        ok, how = gds.probe(self._shared.root, self._shared.direct)  # NOTE [ cuFile reads ] Rule 2
        if not ok and self.device_reads:
            raise CheckpointError(f"torchckpt: DiskTier(device_reads=True), but cuFile cannot read here: {how}; "
                                  "pass device_reads=None (GPUDirect Storage where its driver is loaded) or False.")
        return ok and (how == "gds" or bool(self.device_reads))

    def nbytes(self, key: Hashable) -> int:
        """Payload bytes written under ``key``."""
        return self._entry(key, "nbytes").nbytes

    def write(self, key: Hashable, src: torch.Tensor, after: Any = None) -> cf.Future[None]:
        """Start writing ``src`` (flat ``uint8`` CPU tensor) under ``key``; returns at once (NOTE [ Disk tier ] Rule 2).

        ``src`` must stay alive and unmodified until the returned future is done. ``after``: an event
        (anything with ``synchronize()``) the I/O thread waits for before reading ``src``. Writing
        ``key`` again replaces its file. Raises a pending error of an earlier job (NOTE [ Disk tier ] Rule 5).
        """
        self.check()
        src = _flat_bytes(src, "write")
        if src.numel() == 0:
            raise ValueError("torchckpt: DiskTier.write needs at least one byte.")
        if key in self._files:
            self.delete(key)
        name = os.path.join(self.root, f"{next(self._seq)}.snap")
        fut = self._pool.submit(_write_job, self._shared, name, src, after)
        self._files[key] = _Entry(name, src.numel(), fut)
        return fut

    def prefetch(self, key: Hashable, out: torch.Tensor | None = None,
                 after: tuple[Any, ...] = ()) -> cf.Future[torch.Tensor]:
        """Start reading ``key`` into ``out`` (or a new buffer) on a read thread; the future gives the buffer.

        ``out`` is the job's until the future is done (NOTE [ Disk tier ] Rule 2); ``read(key, out)`` collects it,
        and raises the read's error (NOTE [ Disk tier ] Rule 7). ``out`` may be on a device ``reads_into`` accepts,
        ``after`` names events the read waits for before it writes ``out`` (NOTE [ Disk tier ] Rule 8).
        """
        self.check()
        e = self._entry(key, "prefetch")
        got = self._reads.get(key)
        if got is not None:
            return got[0]
        buf = self._out(e, out)
        # NOTE [ Disk tier ] Rule 7: on the read threads
        fut = self._read_pool.submit(_read_job, self._shared, e.name, buf, e.job, e.written, after)
        e.job = fut
        self._reads[key] = (fut, buf)
        return fut

    def read(self, key: Hashable, out: torch.Tensor | None = None) -> torch.Tensor:
        """``key``'s bytes in ``out`` (or a new buffer): from a pending prefetch (waiting if needed), else read now."""
        self.check()
        e = self._entry(key, "read")
        out = self._out(e, out)
        shared = self._shared
        got = self._reads.pop(key, None)
        t0 = time.perf_counter()
        if got is not None:
            fut, buf = got
            waited = not fut.done()
            try:
                fut.result()
            except CheckpointError as err:
                self._forget(err)
                raise
            if waited:
                shared.count(read_waits=1, read_wait_s=time.perf_counter() - t0)
            if buf.data_ptr() != out.data_ptr():
                out.copy_(buf)
            return out
        _wait([e.job])  # NOTE [ Disk tier ] Rule 3
        failed = _failed_write(e.written)
        if failed is not None:
            self._forget(failed)
            raise CheckpointError(f"torchckpt: a read of a snapshot whose write failed (file {e.name}): "
                                  f"{failed}") from failed
        try:
            _read_file(shared, e.name, out)
        except OSError as err:
            raise _read_error(e.name, out.numel(), err) from err
        dt = time.perf_counter() - t0
        shared.count(reads=1, bytes_read=out.numel(), read_s=dt, read_waits=1, read_wait_s=dt)
        return out

    def delete(self, key: Hashable) -> None:
        """Drop ``key``: its queued jobs cancelled, a running one waited for, its file unlinked
        (NOTE [ Disk tier ] Rule 6).

        Does not raise the errors of its jobs: they are reported by the next ``check`` (NOTE [ Disk tier ] Rule 5).
        """
        e = self._files.pop(key, None)
        self._reads.pop(key, None)
        if e is None:
            return
        for job in (e.job, e.written):
            job.cancel()  # queued: never runs; running: waited for below
        _wait([e.job, e.written])
        try:
            os.unlink(e.name)
        except FileNotFoundError:
            pass

    def done(self, key: Hashable) -> bool:
        """Whether ``key``'s jobs have ended (written, or prefetched)."""
        e = self._files.get(key)
        return e is None or e.job.done()

    def wait(self) -> None:
        """Wait for every job asked for so far (errors are reported by ``check``)."""
        _wait([e.job for e in self._files.values()])

    def check(self) -> None:
        """Raise the first error of a finished job not yet reported (NOTE [ Disk tier ] Rule 5), once."""
        if self._closed:
            raise CheckpointError("torchckpt: this DiskTier was closed; make a new one (or a new "
                                  "SnapshotStore(disk=...)).")
        shared = self._shared
        with shared.lock:
            errs, shared.errors = shared.errors, []
        if errs:
            more = f" ({len(errs) - 1} more I/O errors of the disk tier since)" if len(errs) > 1 else ""
            raise CheckpointError(f"{errs[0]}{more}") from errs[0]

    def stats(self) -> DiskStats:
        """Counters so far (jobs still running are not in them yet)."""
        with self._shared.lock:
            return DiskStats(**self._shared.c, direct=self._shared.direct)

    def files(self) -> list[str]:
        """Paths of the files the tier holds now."""
        return sorted(os.path.join(self.root, f) for f in os.listdir(self.root)) if os.path.isdir(self.root) else []

    def measure_bandwidth(self, nbytes: int = 64 << 20) -> tuple[float, float]:
        """Write then read back ``nbytes`` of random bytes; returns (write, read) bandwidth in bytes per second.

        With buffered I/O (``direct`` False) the read may come from the page cache and overstate the disk.
        """
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1:
            raise ValueError(f"torchckpt: measure_bandwidth(nbytes=...) must be an int >= 1, got {nbytes!r}.")
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        key = ("torchckpt.measure_bandwidth", next(self._seq))
        t0 = time.perf_counter()
        self.write(key, src).result()
        t1 = time.perf_counter()
        back = self.read(key)
        t2 = time.perf_counter()
        self.delete(key)
        if not torch.equal(back, src):
            raise internal_error("the disk tier read back other bytes than it wrote")
        return nbytes / max(t1 - t0, 1e-9), nbytes / max(t2 - t1, 1e-9)

    def close(self) -> None:
        """Cancel queued jobs, wait for running ones and remove every file (NOTE [ Disk tier ] Rule 6); errors are not raised."""
        self._closed = True
        self._files.clear()
        self._reads.clear()
        self._finalizer()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DiskTier({os.path.dirname(self.root)!r}, threads={self.threads}, direct={self.direct}, "
                f"reads={self.reads})")

    # -- internals -----------------------------------------------------------------------
    def _entry(self, key: Hashable, what: str) -> _Entry:
        e = self._files.get(key)
        if e is None:
            raise CheckpointError(f"torchckpt: DiskTier.{what}({key!r}) of a key that was never written (or was "
                                  "deleted); write it first.")
        return e

    def _out(self, e: _Entry, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return torch.empty(e.nbytes, dtype=torch.uint8)
        out = _flat_bytes(out, "read", device=isinstance(out, torch.Tensor) and out.device.type != "cpu"
                          and self.reads_into(out.device))  # NOTE [ Disk tier ] Rule 8
        if out.numel() != e.nbytes:
            raise ValueError(f"torchckpt: DiskTier read into {out.numel()} bytes of a snapshot of {e.nbytes}; pass a "
                             f"buffer of exactly {e.nbytes} bytes (or none).")
        return out

    def _forget(self, err: BaseException) -> None:
        """An error the owner gets from ``read`` itself is not reported again by ``check``."""
        shared = self._shared
        with shared.lock:
            shared.errors = [x for x in shared.errors if x is not err]
