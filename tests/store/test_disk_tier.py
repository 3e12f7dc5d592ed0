"""The disk tier (NOTE [ Disk tier ]) and ``SnapshotStore(disk=...)`` (NOTE [ Snapshot disk tier ] Rules 1-3), on the CPU.

Every restore is checked bit for bit against what was saved; loops against the plain unrolled
loop. Files are checked gone after the last free, after ``close()``, after an exception, at
garbage collection and at process exit; I/O errors (a full disk, simulated) must reach the
owner's thread as ``torchckpt:`` errors with no snapshot lost.
"""
from __future__ import annotations

import errno
import gc
import mmap
import os
import subprocess
import sys
import threading
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from ckpt_models import assert_bits_equal, replay_snapshots, small_pool
from torchckpt import CheckpointError, SnapshotStore, checkpointed_loop, checkpointed_scan, run_schedule
from torchckpt.codecs import Identity
from torchckpt.memory import DiskTier, HostPool
from torchckpt.memory.disk import ALIGN, PIECE
from torchckpt.schedules import (
    Action, Revolve, Schedule, Tier, Uniform, ZCut, plan_flushes, plan_prefetch,
)

D = torch.float64


def tier_at(path: Any, direct: bool | None) -> DiskTier:
    """A tier in ``path``; ``direct=True`` skips where the file system refuses O_DIRECT."""
    try:
        return DiskTier(path, direct=direct)
    except CheckpointError as e:
        if direct and "O_DIRECT" in str(e):
            pytest.skip(f"this file system refuses O_DIRECT: {e}")
        raise


def snap_files(root: Any) -> list[str]:
    """Every file under ``root`` (the tiers' private directories included)."""
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def host_in_use(pool: HostPool) -> int:
    pool.free(pool.alloc(1))  # reclaims parked blocks
    return pool.stats().in_use_bytes


def state(n: int) -> list[torch.Tensor]:
    """Snapshot n: a tuple of tensors of several dtypes, every bit a function of n."""
    g = torch.Generator().manual_seed(500 + n)
    return [
        torch.randn(33, 7, generator=g, dtype=D),
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.randn(3, 3, generator=g).to(torch.float16).t(),  # non-contiguous source
        torch.randint(-(2**62), 2**62, (4,), generator=g),
        torch.randint(0, 255, (1001,), generator=g, dtype=torch.uint8),
        torch.randn(4, generator=g) > 0,
        torch.randn(3, generator=g, dtype=torch.complex64),
        torch.tensor([float("nan"), -0.0, float("inf")]) + n,
    ]


class Gate:
    """An ``after`` event for ``DiskTier.write``: the I/O thread waits in ``synchronize`` until ``open``."""

    def __init__(self) -> None:
        self._ev = threading.Event()

    def open(self) -> None:
        self._ev.set()

    def synchronize(self) -> None:
        assert self._ev.wait(10)


def enospc(*args: Any, **kw: Any) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


# -- DiskTier -----------------------------------------------------------------------------------
def aligned_bytes(n: int) -> torch.Tensor:
    """A page-aligned uint8 tensor (O_DIRECT goes straight from it)."""
    return torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("size", [1, ALIGN - 1, ALIGN, 3 * ALIGN + 5, PIECE + ALIGN + 3])
@pytest.mark.parametrize("offset", [0, 1])
def test_tier_round_trip_bit_exact(tmp_path: Any, direct: bool, size: int, offset: int) -> None:
    """NOTE [ Disk tier ] Rule 4: aligned (straight) and unaligned (bounce) buffers, padded tails, both modes, read and prefetch."""
    tier = tier_at(tmp_path, direct)
    assert tier.direct is direct
    g = torch.Generator().manual_seed(size)
    src = aligned_bytes(size + offset)[offset:]
    src.copy_(torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8))
    want = src.clone()
    fut = tier.write("k", src)
    assert fut.result() is None
    assert torch.equal(src, want)  # the source is only read
    assert torch.equal(tier.read("k"), want)  # synchronous read into a new buffer
    out = aligned_bytes(size + 1)[1:]
    assert tier.prefetch("k", out).result() is out
    assert torch.equal(tier.read("k", out), want)
    assert torch.equal(tier.read("k", aligned_bytes(size)), want)
    st = tier.stats()
    assert (st.writes, st.reads, st.bytes_written, st.bytes_read, st.direct) == (1, 3, size, 3 * size, direct)
    assert len(tier.files()) == 1 and os.path.getsize(tier.files()[0]) >= size
    tier.delete("k")
    assert tier.files() == []
    tier.close()
    assert snap_files(tmp_path) == []


def test_tier_auto_mode_says_which(tmp_path: Any) -> None:
    """``direct=None`` takes O_DIRECT exactly where ``direct=True`` is accepted."""
    tier = DiskTier(tmp_path)
    try:
        DiskTier(tmp_path, direct=True).close()
        takes = True
    except CheckpointError:
        takes = False
    assert tier.direct is takes
    tier.close()


def test_tier_write_is_behind(tmp_path: Any) -> None:
    """NOTE [ Disk tier ] Rule 2: write returns before the bytes are written; the future says when the source is free."""
    tier = DiskTier(tmp_path, direct=False)
    gate = Gate()
    src = torch.arange(100, dtype=torch.uint8)
    fut = tier.write(0, src, after=gate)
    assert not fut.done() and tier.stats().writes == 0
    gate.open()
    fut.result(timeout=10)
    assert tier.stats().writes == 1
    f2 = tier.prefetch(0)
    assert torch.equal(f2.result(timeout=10), src)
    assert torch.equal(tier.read(0), src)
    tier.close()


def test_tier_jobs_of_a_key_run_in_order(tmp_path: Any) -> None:
    """NOTE [ Disk tier ] Rule 3: a prefetch asked for while the write is held back reads the written bytes."""
    tier = DiskTier(tmp_path, direct=False, threads=3)
    gate = Gate()
    src = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    tier.write("x", src, after=gate)
    fut = tier.prefetch("x")
    assert not fut.done()
    gate.open()
    assert torch.equal(tier.read("x"), src)
    assert tier.stats().read_waits <= 1
    tier.close()


def test_tier_write_again_replaces_and_delete_removes(tmp_path: Any) -> None:
    tier = DiskTier(tmp_path, direct=False)
    tier.write(1, torch.zeros(10, dtype=torch.uint8))
    tier.write(1, torch.ones(20, dtype=torch.uint8)).result()
    assert torch.equal(tier.read(1), torch.ones(20, dtype=torch.uint8)) and len(tier.files()) == 1
    tier.delete(1)
    tier.delete(1)  # twice: nothing left to do
    assert tier.files() == [] and 1 not in tier
    with pytest.raises(CheckpointError, match="^torchckpt: DiskTier.read.*never written"):
        tier.read(1)
    tier.close()


def test_tier_delete_cancels_a_queued_write(tmp_path: Any) -> None:
    """NOTE [ Disk tier ] Rule 6: a write deleted before it started never makes its file."""
    tier = DiskTier(tmp_path, direct=False, threads=1)
    gate = Gate()
    tier.write("a", torch.ones(10, dtype=torch.uint8), after=gate)  # holds the only thread
    b = tier.write("b", torch.ones(10, dtype=torch.uint8))  # queued behind it
    tier.delete("b")
    assert b.cancelled()
    gate.open()
    tier.write("c", torch.ones(10, dtype=torch.uint8)).result(timeout=10)  # runs after a (and b, were it there)
    assert len(tier.files()) == 2 and tier.stats().writes == 2
    tier.close()


def test_tier_enospc_reported_once_on_the_owner_thread(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Disk tier ] Rule 5: a full disk fails the job, and the next call on the owner's thread raises it (once)."""
    tier = DiskTier(tmp_path, direct=False)
    monkeypatch.setattr(os, "pwrite", enospc)
    src = torch.arange(64, dtype=torch.uint8)
    fut = tier.write("a", src)
    err = fut.exception(timeout=10)
    assert isinstance(err, CheckpointError) and str(err).startswith("torchckpt:") and "full" in str(err)
    assert torch.equal(src, torch.arange(64, dtype=torch.uint8))  # the caller still has the data
    assert tier.files() == []  # no partial file
    with pytest.raises(CheckpointError, match=r"^torchckpt: the disk tier at .* is full \(ENOSPC\).*Free space"):
        tier.write("b", src)
    tier.check()  # reported once
    with pytest.raises(CheckpointError, match="^torchckpt: a read of a snapshot whose write failed"):
        tier.read("a")
    monkeypatch.undo()
    tier.close()
    assert snap_files(tmp_path) == []


def test_tier_bad_directories(tmp_path: Any) -> None:
    """NOTE [ Disk tier ] Rule 5: a missing directory, a path under a file, an unwritable directory raise at construction."""
    with pytest.raises(CheckpointError, match="^torchckpt: the disk tier's directory .* does not exist"):
        DiskTier(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="^torchckpt: the disk tier's directory .* is not a directory"):
        DiskTier(tmp_path / "file")
    with pytest.raises(CheckpointError, match="^torchckpt: the disk tier's directory"):
        DiskTier(tmp_path / "file" / "sub")
    with pytest.raises(TypeError, match="^torchckpt: DiskTier"):
        DiskTier(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^torchckpt: DiskTier"):
        DiskTier(tmp_path, threads=0)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes through chmod 0o500")
def test_tier_unwritable_directory(tmp_path: Any) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match="^torchckpt: the disk tier cannot write"):
            DiskTier(ro)
    finally:
        ro.chmod(0o700)


def test_tier_files_removed_when_collected(tmp_path: Any) -> None:
    """NOTE [ Disk tier ] Rule 6: a tier dropped without close() removes its directory."""
    tier = DiskTier(tmp_path, direct=False)
    tier.write(0, torch.ones(10, dtype=torch.uint8)).result()
    assert len(snap_files(tmp_path)) == 1
    del tier
    gc.collect()
    assert snap_files(tmp_path) == [] and os.listdir(tmp_path) == []


def test_tier_files_removed_at_process_exit(tmp_path: Any) -> None:
    """NOTE [ Disk tier ] Rule 6: a process that exits with a tier open (and a write in flight) leaves no file."""
    code = (
        "import sys, torch\n"
        "from torchckpt.memory import DiskTier\n"
        "t = DiskTier(sys.argv[1])\n"
        "t.write(0, torch.ones(1 << 20, dtype=torch.uint8)).result()\n"
        "t.write(1, torch.ones(1 << 20, dtype=torch.uint8))\n"
        "sys.modules['__main__'].keep = t\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=120)
    assert os.listdir(tmp_path) == []


def test_tier_measure_bandwidth(tmp_path: Any) -> None:
    tier = DiskTier(tmp_path)
    w, r = tier.measure_bandwidth(1 << 20)
    assert w > 0 and r > 0 and tier.files() == []
    tier.close()


# -- SnapshotStore(disk=...) ----------------------------------------------------------------------
def disk_store(tmp_path: Any, slots: int = 1, direct: bool | None = False, **kw: Any) -> SnapshotStore:
    return SnapshotStore("cpu", slots=slots, host=small_pool(), disk=tier_at(tmp_path, direct), **kw)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("codec", [None, Identity()])
def test_store_round_trip_bit_exact(tmp_path: Any, direct: bool, codec: Any) -> None:
    """NOTE [ Snapshot disk tier ] Rules 1-2: DISK snapshots (a tuple of dtypes) come back from their files bit for bit;
    host memory holds none of them once written; freeing deletes the files."""
    s = disk_store(tmp_path, slots=1, direct=direct, codec=codec)
    for n in range(5):
        s.save(n, Tier.DISK, state(n))
    s.disk.wait()  # type: ignore[union-attr]
    s.save(5, Tier.HOST, state(5))  # the next action collects the finished writes
    assert s.stats().disk.writes == 5  # type: ignore[union-attr]
    assert len(snap_files(tmp_path)) == 5
    assert host_in_use(s.host) == s._size(5)  # only the HOST snapshot stays in host memory
    for n in [3, 0, 4, 4, 1, 2, 0, 5]:
        tier = Tier.HOST if n == 5 else Tier.DISK
        if n == 1:
            s.prefetch(n, Tier.DISK, Tier.GPU)  # read ahead on an I/O thread
        assert_bits_equal([t.clone() for t in s.restore(n, tier)], state(n))
        s.after_use()
    st = s.stats()
    assert st.disk is not None and st.disk.reads >= 5 and st.disk.direct is direct
    assert st.prefetches == 1 and st.hits == 2 and st.misses == 6  # 4 read back at once, 1 slot hit
    for n in range(5):
        s.free(n, Tier.DISK)
        assert len(snap_files(tmp_path)) == 4 - n
    s.free(5, Tier.HOST)
    assert host_in_use(s.host) == 0
    s.close()
    s.disk.close()  # type: ignore[union-attr]
    assert os.listdir(tmp_path) == []


def test_store_disk_save_with_every_slot_pinned(tmp_path: Any) -> None:
    """NOTE [ Snapshot store ] Rule 4 with NOTE [ Snapshot disk tier ] Rule 1: a save that bypasses the pinned slots is
    written behind all the same."""
    s = disk_store(tmp_path, slots=1)
    s.save(0, Tier.DISK, state(0))
    s.prefetch(0, Tier.GPU, Tier.GPU)  # pins the only slot
    s.save(1, Tier.DISK, state(1))  # straight to host, then to disk
    s.stats()  # waits for the writes and collects them
    assert len(snap_files(tmp_path)) == 2 and host_in_use(s.host) == 0
    for n in (1, 0):
        assert_bits_equal([t.clone() for t in s.restore(n, Tier.DISK)], state(n))
        s.after_use()
    s.close()


def test_store_close_deletes_its_files_in_a_shared_tier(tmp_path: Any) -> None:
    """NOTE [ Snapshot disk tier ] Rule 3: close() deletes the store's files, snapshots only on disk included; the
    caller's tier stays open."""
    tier = DiskTier(tmp_path, direct=False)
    s = SnapshotStore("cpu", slots=1, host=small_pool(), disk=tier)
    for n in range(4):
        s.save(n, Tier.DISK, state(n))
    s.stats()
    assert len(tier.files()) == 4 and host_in_use(s.host) == 0  # every snapshot only on disk
    s.close()
    assert tier.files() == [] and not tier.closed
    tier.close()


def replay(store: SnapshotStore, actions: Iterable[Action], flushes: frozenset[int] | None = None) -> int:
    return replay_snapshots(store, actions, state, flushes)


def disk_schedules(n: int) -> list[Schedule]:
    return [Revolve(n, 4, tier=Tier.DISK), Uniform(n, 4, tier=Tier.DISK), ZCut(n, tier=Tier.DISK)]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("mode", ["plain", "prefetch", "write-back"])
def test_store_replays_disk_schedules_as_host_ones(tmp_path: Any, k: int, mode: str) -> None:
    """The same cache bookkeeping as HOST (hits, misses, prefetches); every file gone at the end."""
    for sched in disk_schedules(25):
        acts: list[Action] = list(plan_prefetch(sched, k)) if mode != "plain" else list(sched)
        flushes = frozenset(plan_flushes(acts, k)) if mode == "write-back" else None
        host = SnapshotStore("cpu", slots=k, host=small_pool())
        replay(host, acts, flushes)
        s = disk_store(tmp_path, slots=k)
        replay(s, acts, flushes)
        a, b = host.stats(), s.stats()
        assert (a.hits, a.misses, a.prefetches) == (b.hits, b.misses, b.prefetches), (sched, k)
        # A miss while its write is still under way is served from the host block the write reads (NOTE
        # [ Snapshot disk tier ] Rule 1), so whether files are read back here depends on the disk's speed;
        # test_store_round_trip_bit_exact and the loop tests wait for the writes and check the reads.
        assert b.disk is not None and b.disk.writes > 0
        assert s.disk is not None and s.disk.files() == [] and host_in_use(s.host) == 0, (sched, k)
        s.close()
        s.disk.close()
    assert os.listdir(tmp_path) == []


def test_store_without_disk_is_unchanged() -> None:
    """No ``disk=``: Tier.DISK is held as HOST and there are no disk counters."""
    s = SnapshotStore("cpu", slots=1, host=small_pool())
    for n in range(3):
        s.save(n, Tier.DISK, state(n))
    for n in (0, 2, 1):
        assert_bits_equal([t.clone() for t in s.restore(n, Tier.DISK)], state(n))
        s.after_use()
    assert s.stats().disk is None and s.disk is None
    s.close()


def test_store_disk_argument(tmp_path: Any) -> None:
    with pytest.raises(TypeError, match=r"^torchckpt: SnapshotStore\(disk=\.\.\.\) expects a directory"):
        SnapshotStore("cpu", disk=3)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="^torchckpt: the disk tier's directory"):
        SnapshotStore("cpu", host=small_pool(), disk=tmp_path / "f" / "sub")
    with SnapshotStore("cpu", slots=1, host=small_pool(), disk=str(tmp_path)) as s:  # a path: the store owns it
        s.save(0, Tier.DISK, state(0))
        s.save(1, Tier.DISK, state(1))
        s.stats()
        assert len(snap_files(tmp_path)) == 2
    assert s.disk is not None and s.disk.closed and os.listdir(tmp_path) == []


def test_store_enospc_keeps_the_snapshot(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Snapshot disk tier ] Rule 3: a failed write raises at the next action; the snapshot stays in host memory,
    bit-exact."""
    s = disk_store(tmp_path, slots=1)
    monkeypatch.setattr(os, "pwrite", enospc)
    s.save(0, Tier.DISK, state(0))  # written behind: the write fails on an I/O thread
    s.disk.wait()  # type: ignore[union-attr]
    with pytest.raises(CheckpointError, match=r"^torchckpt: the disk tier at .* is full.*fewer Tier.DISK"):
        s.restore(0, Tier.DISK)
    monkeypatch.undo()
    s.save(1, Tier.DISK, state(1))  # evicts 0 from the only slot: 0 comes back from its host block
    for n in (0, 1, 0):
        assert_bits_equal([t.clone() for t in s.restore(n, Tier.DISK)], state(n))
        s.after_use()
    s.free(0, Tier.DISK)
    s.free(1, Tier.DISK)
    assert host_in_use(s.host) == 0 and snap_files(tmp_path) == []
    s.close()


# -- loops ----------------------------------------------------------------------------------------
def make_loop() -> tuple[Any, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(16, 16, generator=g, dtype=D).mul_(0.3).requires_grad_()
    x0 = torch.randn(4, 16, generator=g, dtype=D).requires_grad_()
    return (lambda x: torch.tanh(x @ w) + 0.1 * x), w, x0


@pytest.mark.parametrize("sched", disk_schedules(40), ids=["revolve", "uniform", "zcut"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_loop_gradients_bit_exact_and_files_gone(tmp_path: Any, sched: Schedule, prefetch: bool) -> None:
    step, w, x0 = make_loop()
    x = x0
    for _ in range(40):
        x = step(x)
    ref = x.detach()
    g_ref = torch.autograd.grad(x.square().sum(), [w, x0])
    step, w, x0 = make_loop()
    with disk_store(tmp_path, slots=2, direct=None) as snaps:
        out = checkpointed_loop(step, x0, 40, schedule=sched, store=snaps, slots=2, prefetch=prefetch)
        snaps.disk.wait()  # type: ignore[union-attr]
        assert len(snap_files(tmp_path)) >= 2  # evicted snapshots of the forward sweep are on disk
        got = torch.autograd.grad(out.square().sum(), [w, x0])
        assert torch.equal(out.detach(), ref)
        assert all(torch.equal(a, b) for a, b in zip(got, g_ref))
        st = snaps.stats()
        assert st.disk is not None and st.disk.writes > 0 and st.disk.reads > 0
        assert snap_files(tmp_path) == [] and host_in_use(snaps.host) == 0
    snaps.disk.close()  # type: ignore[union-attr]
    assert os.listdir(tmp_path) == []


def test_scan_and_run_schedule_with_a_disk_store(tmp_path: Any) -> None:
    g = torch.Generator().manual_seed(3)
    c = torch.rand(32, generator=g, dtype=D).requires_grad_()
    xs = torch.randn(30, 32, generator=g, dtype=D)

    def step(u: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u = torch.sin(c * u) + f
        return u, u.sum()

    u, ys = torch.zeros(32, dtype=D), []
    for k in range(30):
        u, y = step(u, xs[k])
        ys.append(y)
    g_ref = torch.autograd.grad(u.sum() + torch.stack(ys).square().sum(), [c])
    tier = DiskTier(tmp_path)  # one tier, two stores (their files are named apart)
    with SnapshotStore("cpu", slots=2, host=small_pool(), disk=tier) as snaps:
        u2, ys2 = checkpointed_scan(step, torch.zeros(32, dtype=D), xs, schedule=Revolve(30, 3, tier=Tier.DISK),
                                    store=snaps)
        snaps.disk.wait()  # type: ignore[union-attr]  # the forward's writes ended: the backward reads files
        got = torch.autograd.grad(u2.sum() + ys2.square().sum(), [c])
        assert torch.equal(got[0], g_ref[0]) and snap_files(tmp_path) == []
        assert snaps.stats().disk.reads > 0  # type: ignore[union-attr]
    assert not tier.closed  # the caller's tier stays open
    with SnapshotStore("cpu", slots=1, host=small_pool(), disk=tier) as snaps:
        x, log = [torch.tensor([1.0], dtype=D)], []
        st = run_schedule(
            Revolve(12, 3, tier=Tier.DISK),
            forward=lambda n0, n1: x.__setitem__(0, x[0] * 2 ** (n1 - n0)),
            save=lambda n: x[0],
            restore=lambda n, t: x.__setitem__(0, t[0].clone()),
            backward=lambda n: log.append((n, x[0].item())),
            store=snaps)
        assert log == [(n, 2.0**n) for n in range(11, -1, -1)]
        assert st.disk is not None and st.disk.writes > 0 and snap_files(tmp_path) == []
    tier.close()
    assert os.listdir(tmp_path) == []


class Boom(Exception):
    pass


@pytest.mark.parametrize("close", ["with", "close"])
def test_exception_mid_backward_leaves_no_file(tmp_path: Any, close: str) -> None:
    """An exception escaping the loop body in backward; the owner closes the store: no file is left."""
    _, w, x0 = make_loop()
    calls = [0]

    def step(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] > 45:  # in the backward's recomputations
            raise Boom()
        return torch.tanh(x @ w)

    snaps = SnapshotStore("cpu", slots=1, host=small_pool(), disk=tmp_path)
    if close == "with":
        with pytest.raises(Boom), snaps:
            out = checkpointed_loop(step, x0, 40, schedule=Revolve(40, 4, tier=Tier.DISK), store=snaps)
            assert calls[0] < 45
            snaps.disk.wait()  # type: ignore[union-attr]
            assert len(snap_files(tmp_path)) >= 2  # the snapshots of the forward sweep, on disk
            out.sum().backward()
    else:
        out = checkpointed_loop(step, x0, 40, schedule=Revolve(40, 4, tier=Tier.DISK), store=snaps)
        with pytest.raises(Boom):
            out.sum().backward()
        snaps.disk.wait()  # type: ignore[union-attr]
        assert snap_files(tmp_path) != []
        snaps.close()
    assert snaps.disk is not None and snaps.disk.closed
    assert os.listdir(tmp_path) == [] and host_in_use(snaps.host) == 0


def test_loop_full_disk_raises_on_the_owner_thread(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk during the loop: a ``torchckpt:`` error out of backward (never wrong gradients)."""
    step, w, x0 = make_loop()
    with SnapshotStore("cpu", slots=1, host=small_pool(), disk=tmp_path) as snaps:
        monkeypatch.setattr(os, "pwrite", enospc)
        with pytest.raises(CheckpointError, match=r"^torchckpt: the disk tier at .* is full") as info:
            out = checkpointed_loop(step, x0, 40, schedule=Revolve(40, 4, tier=Tier.DISK), store=snaps)
            out.square().sum().backward()
        assert "no data was lost" in str(info.value)
        monkeypatch.undo()
    assert os.listdir(tmp_path) == []
