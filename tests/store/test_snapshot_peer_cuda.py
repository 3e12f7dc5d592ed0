"""``SnapshotStore("cuda", peers=...)`` over NCCL, one process per GPU (NOTE [ Snapshot peer tier ] Rules 1-6).

The replay of ``test_snapshot_peer.py`` (Revolve on HOST, rank 0 overflowing into rank 1's spare memory, with the
max-flow and the greedy plan), each restore compared bit for bit, with the store's host copies and fills held back
by random device sleeps. Needs 2 GPUs of one host; the rounds' metadata goes over gloo (NOTE [ Peer tier ] Rule 6).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from test_snapshot_peer import check_both_plans, run

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                       reason="needs 2 CUDA devices and NCCL"),
]


@pytest.mark.parametrize("mode", ["plain", "write-back", "codec"])
def test_replay_two_gpus_nccl(tmp_path: Any, mode: str) -> None:
    check_both_plans(run(2, str(tmp_path), "both", backend="nccl", mode=mode, device="cuda"))
