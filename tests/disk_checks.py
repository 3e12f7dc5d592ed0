"""An adjoint through a CPU ``SnapshotStore`` with a disk tier, every state its backward sees checked bit for bit
(tests/store/test_disk_reads.py, test_disk_into_slot.py)."""
from __future__ import annotations

import errno
from typing import Any

import pytest
import torch

from ckpt_models import assert_bits_equal, small_pool
from torchckpt import SnapshotStore, run_schedule
from torchckpt.store import SnapshotStats
from torchckpt.memory import DiskTier, HostPoolBase
from torchckpt.memory import disk as disk_mod
from torchckpt.schedules import Schedule


def host_in_use(pool: HostPoolBase) -> int:
    pool.free(pool.alloc(1))  # reclaims parked blocks
    return pool.stats().in_use_bytes


def fail_read(monkeypatch: pytest.MonkeyPatch, snaps: SnapshotStore, tier: DiskTier, n: int) -> str:
    """Every later read of snapshot ``n``'s file fails with an injected EIO (the other files read as they are); returns
    that file's path."""
    real = disk_mod._read_file
    bad = tier._files[snaps._key(n)].name

    def failing(shared: Any, path: str, out: torch.Tensor) -> None:
        if path == bad:
            raise OSError(errno.EIO, "Input/output error (injected)")
        real(shared, path, out)

    monkeypatch.setattr(disk_mod, "_read_file", failing)
    return bad


def run_checked(sched: Schedule, tier: DiskTier, first: list[torch.Tensor], n: int, rate: float, slots: int
                ) -> tuple[SnapshotStats, list[tuple[int, int]]]:
    """``sched`` over ``n`` steps from state ``first`` (a step: floating tensors ``t * rate + k``, the others ``t + k``)
    through a CPU store with ``tier`` and ``slots`` slots, restoring into the state; every state the backward sees
    equals the forward's, the backward sees every step once, and at the end no file nor host block is left. Returns
    the store's statistics and its slots' (address, bytes)."""
    ref = [first]
    for k in range(1, n):
        ref.append([t * rate + k if t.is_floating_point() else t + k for t in ref[-1]])
    state = [t.clone() for t in first]
    seen: list[int] = []

    def forward(n0: int, n1: int) -> None:
        for k in range(n0 + 1, n1 + 1):
            for t in state:
                t.copy_(t * rate + k if t.is_floating_point() else t + k)

    def backward(k: int) -> None:
        assert_bits_equal(state, ref[k])
        seen.append(k)

    with SnapshotStore("cpu", slots=slots, host=small_pool(), disk=tier) as snaps:
        st = run_schedule(sched, forward=forward, save=lambda k: state, backward=backward, store=snaps, slots=slots,
                          end_forward=tier.wait,  # the forward's writes ended: the backward reads files
                          restore_into=lambda k: state)
        where: list[tuple[int, int]] = [(snaps._slots[s].data_ptr(), snaps._slots[s].numel())
                                        for s in range(len(snaps._slots))]
        assert seen == list(range(n - 1, -1, -1))
        assert tier.files() == [] and host_in_use(snaps.host) == 0
    return st, where
