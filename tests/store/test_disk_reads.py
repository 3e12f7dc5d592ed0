"""Reads in flight on the disk tier's read path (NOTE [ Disk tier ] Rule 7, NOTE [ Snapshot disk tier ] Rules 4-5).

Several prefetches' reads run at once and restores stay bit-exact; a failed read reaches its own snapshot's
restore as a ``torchckpt:`` error naming the file, and no other action; ``close()`` with reads in flight joins
the read threads in bounded time and leaves no file.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any

import pytest
import torch

from ckpt_models import assert_bits_equal, small_pool
from disk_checks import fail_read, host_in_use, run_checked
from torchckpt import CheckpointError, SnapshotStore, run_schedule
from torchckpt.memory import DiskTier
from torchckpt.memory import disk as disk_mod
from torchckpt.schedules import Revolve, Schedule, Tier, ZCut

D = torch.float64


def snap(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(900 + n)
    return [torch.randn(257, generator=g, dtype=D), torch.randint(0, 255, (999,), generator=g, dtype=torch.uint8)]


class InFlight:
    """A ``_read_file`` that counts the reads under way at once (each held ``hold`` seconds)."""

    def __init__(self, real: Any, hold: float) -> None:
        self.real, self.hold = real, hold
        self.lock = threading.Lock()
        self.now = self.most = self.calls = 0

    def __call__(self, shared: Any, path: str, out: torch.Tensor) -> None:
        with self.lock:
            self.now += 1
            self.calls += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(self.hold)
            self.real(shared, path, out)
        finally:
            with self.lock:
                self.now -= 1


def read_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("torchckpt-disk-read")]


@pytest.mark.parametrize("sched", [Revolve(60, 30, tier=Tier.DISK), ZCut(60, segment=1, tier=Tier.DISK)],
                         ids=["revolve", "zcut"])
def test_run_schedule_bit_exact_with_reads_in_flight(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                     sched: Schedule) -> None:
    """NOTE [ Snapshot disk tier ] Rule 4: with 6 slots (5 prefetches ahead) and 4 read threads, several files are
    read at once; every state the backward sees equals the plain forward's, bit for bit."""
    counter = InFlight(disk_mod._read_file, 0.02)
    monkeypatch.setattr(disk_mod, "_read_file", counter)
    tier = DiskTier(tmp_path, direct=False, reads=4)
    st, _ = run_checked(sched, tier, snap(0), 60, 1.5, 6)
    assert st.disk is not None and st.disk.reads == counter.calls > 2
    assert counter.most >= 3, counter.most  # reads in flight, beyond the 2 write threads
    tier.close()
    assert os.listdir(tmp_path) == []


def test_read_error_reaches_its_own_restore_only(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Snapshot disk tier ] Rule 5: snapshot 1's read fails; restoring 2 (whose action finds 1's read ended)
    succeeds, restoring 1 raises a ``torchckpt:`` error naming 1's file, 0 still restores, close leaves nothing."""
    snaps = SnapshotStore("cpu", slots=4, host=small_pool(), disk=DiskTier(tmp_path, direct=False, reads=4))
    tier = snaps.disk
    assert tier is not None
    for k in range(10):  # 0-5 leave the 4 slots: read back from their files
        snaps.save(k, Tier.DISK, snap(k))
    tier.wait()
    bad = fail_read(monkeypatch, snaps, tier, 1)
    for k in (2, 1, 0):
        snaps.prefetch(k, Tier.DISK, Tier.GPU)
    tier.wait()  # every read has ended, 1's with its error
    assert tier.stats().reads == 2
    out = [torch.empty_like(t) for t in snap(0)]
    assert_bits_equal(snaps.restore(2, Tier.DISK, out=out), snap(2))
    snaps.free(2, Tier.DISK)
    with pytest.raises(CheckpointError, match=r"^torchckpt: reading a snapshot of \d+ bytes back from the disk "
                                              rf"tier's file {bad} failed \(.*injected"):
        snaps.restore(1, Tier.DISK, out=out)
    assert_bits_equal(snaps.restore(0, Tier.DISK, out=out), snap(0))
    monkeypatch.undo()
    snaps.close()
    tier.close()
    assert tier.closed and os.listdir(tmp_path) == [] and host_in_use(snaps.host) == 0
    assert read_threads() == []


def test_read_error_in_run_schedule_names_the_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed read during ``run_schedule``'s backward: a ``torchckpt:`` error out of it, no state from the failed
    snapshot reaches backward, and the store closes with no file left."""
    real = disk_mod._read_file
    hit: list[str] = []

    def failing(shared: Any, path: str, out: torch.Tensor) -> None:
        if not hit:
            hit.append(path)
            raise OSError(errno.EIO, "Input/output error (injected)")
        real(shared, path, out)

    x = [torch.zeros(64, dtype=D)]
    seen: list[int] = []

    def backward(k: int) -> None:
        assert torch.equal(x[0], torch.full((64,), float(k), dtype=D))
        seen.append(k)

    snaps = SnapshotStore("cpu", slots=3, host=small_pool(), disk=tmp_path)
    tier = snaps.disk
    assert tier is not None
    monkeypatch.setattr(disk_mod, "_read_file", failing)
    with pytest.raises(CheckpointError, match=r"^torchckpt: .*disk tier's file .*\.snap failed"):
        run_schedule(Revolve(40, 10, tier=Tier.DISK), forward=lambda a, b: x[0].add_(b - a),
                     save=lambda k: x, backward=backward, store=snaps, slots=3, end_forward=tier.wait,
                     restore_into=lambda k: x)
    assert hit and hit[0].startswith(tier.root)
    assert seen == list(range(39, 39 - len(seen), -1))  # every state before the error was right
    monkeypatch.undo()
    snaps.close()
    assert tier.closed and os.listdir(tmp_path) == [] and host_in_use(snaps.host) == 0


@pytest.mark.parametrize("via", ["tier", "store"])
def test_close_joins_reads_in_flight(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, via: str) -> None:
    """NOTE [ Disk tier ] Rule 7: 12 slow reads asked for, 2 read threads; ``close()`` cancels the queued ones, waits
    for the 2 running, joins the threads and removes every file, in far less than the 12 reads would take."""
    hold = 0.25
    monkeypatch.setattr(disk_mod, "_read_file", InFlight(disk_mod._read_file, hold))
    before = len(read_threads())
    tier = DiskTier(tmp_path, direct=False, reads=2)
    snaps = SnapshotStore("cpu", slots=13, host=small_pool(), disk=tier) if via == "store" else None
    for k in range(30):  # with a store, 0-16 leave the 13 slots: read back from their files
        if snaps is not None:
            snaps.save(k, Tier.DISK, snap(k))
        elif k < 12:
            tier.write(k, snap(k)[1])
    tier.wait()
    for k in range(12):
        if snaps is not None:
            snaps.prefetch(k, Tier.DISK, Tier.GPU)
        else:
            tier.prefetch(k)
    assert len(read_threads()) == before + 2
    t0 = time.perf_counter()
    if snaps is not None:
        snaps.close()
    tier.close()
    took = time.perf_counter() - t0
    assert took < 4 * hold, took  # 12 reads one after another on 2 threads: 6 * hold
    assert len(read_threads()) == before  # joined
    assert os.listdir(tmp_path) == []
    if snaps is not None:
        assert host_in_use(snaps.host) == 0


def test_reads_argument() -> None:
    with pytest.raises(ValueError, match=r"^torchckpt: DiskTier\(reads=...\) must be an int >= 1"):
        DiskTier("/tmp", reads=0)
    with DiskTier("/tmp", direct=False) as t:
        assert t.reads == disk_mod.READS and "reads=" in repr(t)
