"""Reads straight into the store's memory (NOTE [ Disk tier ] Rule 8, NOTE [ Snapshot disk tier ] Rule 6): on the CPU
a prefetch's read fills its slot with no host block; restores stay bit-exact, a failed read gives its slot back and
reaches its own restore only; ``device_reads`` is checked, and CUDA without cuFile is refused or passed over."""
from __future__ import annotations

import os
import types
from typing import Any

import pytest
import torch

from ckpt_models import assert_bits_equal, small_pool
from disk_checks import fail_read, host_in_use, run_checked
from torchckpt import CheckpointError, SnapshotStore
from torchckpt.memory import DiskTier, gds
from torchckpt.memory import disk as disk_mod
from torchckpt.schedules import Revolve, Schedule, Tier, ZCut

D = torch.float64


def snap(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(700 + n)
    return [torch.randn(513, generator=g, dtype=D), torch.randint(0, 255, (1001,), generator=g, dtype=torch.uint8)]


class Outs:
    """A ``_read_file`` that records where each read went (a host block's memory or a slot's)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.ptrs: list[int] = []

    def __call__(self, shared: Any, path: str, out: torch.Tensor) -> None:
        self.ptrs.append(out.data_ptr())
        self.real(shared, path, out)


def run(tmp_path: Any, sched: Schedule, device_reads: bool | None, monkeypatch: pytest.MonkeyPatch
        ) -> tuple[Any, list[tuple[int, int]], list[int]]:
    """``sched`` over 40 steps through a CPU store with a disk tier, every state checked (``run_checked``). Returns the
    store's statistics, the slots' (address, bytes) and where the reads went."""
    outs = Outs(disk_mod._read_file)
    monkeypatch.setattr(disk_mod, "_read_file", outs)
    tier = DiskTier(tmp_path, direct=False, reads=4, device_reads=device_reads)
    st, slots = run_checked(sched, tier, snap(0), 40, 1.25, 4)
    tier.close()
    assert os.listdir(tmp_path) == []
    return st, slots, outs.ptrs


@pytest.mark.parametrize("sched", [Revolve(40, 20, tier=Tier.DISK), ZCut(40, segment=1, tier=Tier.DISK)],
                         ids=["revolve", "zcut"])
def test_prefetches_read_into_their_slots_bit_exact(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                    sched: Schedule) -> None:
    """NOTE [ Snapshot disk tier ] Rule 6: with ``device_reads=True`` a CPU store's prefetches read into the slots
    (no host block, no fill: fewer bytes moved to the slots), bit-exact as the host-block path, which ``None`` keeps."""
    os.makedirs(tmp_path / "a")
    os.makedirs(tmp_path / "b")
    into, slots, ptrs = run(tmp_path / "a", sched, True, monkeypatch)
    monkeypatch.undo()
    plain, plain_slots, plain_ptrs = run(tmp_path / "b", sched, None, monkeypatch)
    in_slot = [p for p in ptrs if any(a <= p < a + k for a, k in slots)]
    assert len(in_slot) == into.prefetches == plain.prefetches > 0  # every disk restore was prefetched here
    assert into.disk.reads == plain.disk.reads == len(ptrs) == len(plain_ptrs)
    assert not any(any(a <= p < a + k for a, k in plain_slots) for p in plain_ptrs)  # None: host blocks only
    assert into.bytes_to_device == 0 < plain.bytes_to_device  # no fill from a host block
    assert into.prefetch_hits == plain.prefetch_hits


def test_a_failed_read_into_a_slot_gives_the_slot_back(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Snapshot disk tier ] Rules 5-6: snapshot 1's read into its slot fails: restoring 2 succeeds, restoring 1
    raises the tier's error naming the file, the slot is free again (a later prefetch and restore use it), close
    leaves nothing."""
    tier = DiskTier(tmp_path, direct=False, reads=4, device_reads=True)
    snaps = SnapshotStore("cpu", slots=3, host=small_pool(), disk=tier)
    for k in range(8):  # 0-4 leave the 3 slots: read back from their files
        snaps.save(k, Tier.DISK, snap(k))
    tier.wait()
    bad = fail_read(monkeypatch, snaps, tier, 1)
    for k in (2, 1):
        snaps.prefetch(k, Tier.DISK, Tier.GPU)
        assert k in snaps._into_slot  # read into the slot (an earlier one may be collected by this action)
    tier.wait()
    out = [torch.empty_like(t) for t in snap(0)]
    assert_bits_equal(snaps.restore(2, Tier.DISK, out=out), snap(2))
    snaps.free(2, Tier.DISK)
    free_before = len(snaps._free_slots)
    with pytest.raises(CheckpointError, match=rf"^torchckpt: reading a snapshot of \d+ bytes back from the disk "
                                              rf"tier's file {bad} failed \(.*injected"):
        snaps.restore(1, Tier.DISK, out=out)
    assert len(snaps._free_slots) == free_before + 1 and 1 not in snaps._slot_of
    monkeypatch.undo()
    snaps.prefetch(0, Tier.DISK, Tier.GPU)
    assert_bits_equal(snaps.restore(0, Tier.DISK, out=out), snap(0))
    snaps.close()
    tier.close()
    assert os.listdir(tmp_path) == [] and host_in_use(snaps.host) == 0


def test_device_reads_argument_and_where_it_applies(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Disk tier ] Rule 8: ``device_reads`` is None, True or False; on the CPU only True reads into the store's
    memory; on CUDA None reads there only with GPUDirect Storage's driver, True wherever cuFile opens and raises a
    ``torchckpt:`` error saying what to pass where it cannot, False never."""
    with pytest.raises(TypeError, match=r"^torchckpt: DiskTier\(device_reads=\.\.\.\) expects None, True or False"):
        DiskTier(tmp_path, device_reads="yes")  # type: ignore[arg-type]
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    tiers = {v: DiskTier(tmp_path, direct=False, device_reads=v) for v in (None, True, False)}
    try:
        assert [tiers[v].reads_into(cpu) for v in (None, True, False)] == [False, True, False]
        assert not tiers[False].reads_into(cuda)
        for found, want_none, want_true in (((False, "no CUDA device"), False, None), ((True, "compat"), False, True),
                                            ((True, "gds"), True, True)):
            monkeypatch.setattr(gds, "probe", lambda directory=None, direct=False, found=found: found)
            assert tiers[None].reads_into(cuda) is want_none
            if want_true is None:
                with pytest.raises(CheckpointError, match=r"^torchckpt: DiskTier\(device_reads=True\), but cuFile "
                                                          r"cannot read here: no CUDA device; pass device_reads=None"):
                    tiers[True].reads_into(cuda)
            else:
                assert tiers[True].reads_into(cuda) is want_true
    finally:
        for t in tiers.values():
            t.close()


def test_probe_says_why_without_cuda() -> None:
    """NOTE [ cuFile reads ] Rule 2: on a machine without CUDA the probe says so (once per process)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/store/test_disk_into_slot_cuda.py")
    assert gds.probe() == (False, "no CUDA device")


def test_probe_tries_a_file_of_the_directory(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ cuFile reads ] Rule 2: an open driver is not enough; where cuFile registers no file of the directory (the
    H100 machine's HANDLE_NOT_REGISTERED) the probe says so, ``device_reads=True`` raises and ``None`` reads through host
    blocks; the probe's file is gone either way, and each directory and mode is tried once."""
    calls: list[int] = []

    class Refusing:
        class FileHandleType:
            OPAQUE_FD = 1

        class Descr:
            def __init__(self) -> None:
                self.handle = types.SimpleNamespace(fd=-1)
                self.ptr = 0

        @staticmethod
        def handle_register(ptr: int) -> int:
            calls.append(ptr)
            raise RuntimeError("HANDLE_NOT_REGISTERED (5027): file descriptor is not registered")

    monkeypatch.setattr(gds, "_state", {"probe": (True, "compat"), "cufile": Refusing})
    ok, why = gds.probe(str(tmp_path))
    assert not ok and why.startswith(f"cuFileHandleRegister failed on a file of {os.path.realpath(tmp_path)} "
                                     "(HANDLE_NOT_REGISTERED (5027)")
    assert gds.probe(str(tmp_path)) == (ok, why) and len(calls) == 1  # once per directory and mode
    assert gds.probe() == (True, "compat")  # the driver alone
    cuda = torch.device("cuda", 0)
    with DiskTier(tmp_path, direct=False, device_reads=True) as tier:
        with pytest.raises(CheckpointError, match=r"^torchckpt: DiskTier\(device_reads=True\), but cuFile cannot read "
                                                  r"here: cuFileHandleRegister failed .*; pass device_reads=None"):
            tier.reads_into(cuda)
    with DiskTier(tmp_path, direct=False) as tier:
        assert not tier.reads_into(cuda)
    assert os.listdir(tmp_path) == []
