"""NOTE [ Lending a snapshot store ]: the one place every run gets its SnapshotStore (issue 23 Deliver 3).

``run_schedule`` lent a training ``Store``'s host pool and codec but not its disk tier, so its ``Tier.DISK``
snapshots silently stayed in host memory; ``checkpointed_loop`` and ``checkpoint_chain`` had copies of their own.
"""
from __future__ import annotations

import os
from typing import Any

import torch

import torchckpt
from torchckpt.memory import HostPool, shared_host_pool
from torchckpt.schedules import Revolve, Tier
from torchckpt.store.lend import lend_snapshot_store


def _pool() -> HostPool:
    return HostPool(capacity_bytes=1 << 20, chunk_bytes=1 << 20, pin=False)


def test_a_snapshot_store_is_used_as_it_is() -> None:
    mine = torchckpt.SnapshotStore("cpu", slots=3, host=_pool())
    assert lend_snapshot_store(mine, torch.device("cpu"), 2) == (mine, False)
    mine.close()


def test_a_training_store_lends_its_device_host_codec_and_disk(tmp_path: Any) -> None:
    codec = torchckpt.codecs.base.Identity()
    train = torchckpt.Store("cpu", host=_pool(), codec=codec, disk=tmp_path)
    snaps, owned = lend_snapshot_store(train, torch.device("cpu"), 2)
    assert owned and snaps.host is train.host and snaps.codec is codec and snaps.disk is train.disk
    snaps.close()
    train.close()


def test_no_store_takes_the_shared_host_pool() -> None:
    snaps, owned = lend_snapshot_store(None, torch.device("cpu"), 2)
    assert owned and snaps.host is shared_host_pool(pin=False) and snaps.disk is None and snaps.codec is None
    snaps.close()


def test_run_schedule_with_a_disk_store_puts_snapshots_on_disk(tmp_path: Any) -> None:
    """A ``Store(disk=...)`` passed to run_schedule: its ``Tier.DISK`` snapshots are written to files there."""
    x, log = [torch.arange(4096, dtype=torch.float64)], []
    store = torchckpt.Store("cpu", gpu_bytes=0, host=_pool(), disk=tmp_path)
    stats = torchckpt.run_schedule(
        Revolve(8, 3, tier=Tier.DISK),
        forward=lambda n0, n1: x.__setitem__(0, x[0] + (n1 - n0)),
        save=lambda n: x[0],
        restore=lambda n, t: x.__setitem__(0, t[0].clone()),
        backward=lambda n: log.append((n, x[0][0].item())),
        end_forward=lambda: store.disk.wait(),  # type: ignore[union-attr]  # the writes end: backward reads files
        store=store, slots=1)
    assert log == [(n, float(n)) for n in range(7, -1, -1)]  # adjoint step n saw state n, rebuilt from disk
    assert stats.disk is not None and stats.disk.writes > 0 and stats.disk.reads > 0
    store.close()
    assert os.listdir(tmp_path) == []
