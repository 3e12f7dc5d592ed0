"""The training store's disk spill on a GPU (NOTE [ Spill to disk ]): pinned staging, device copies and events."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import torchckpt
from torchckpt.memory import HostPool

from test_saved_disk import Stack, files_under, host_in_use
from ckpt_models import Block, clone

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MiB = 1 << 20


@pytest.mark.parametrize("gpu_bytes", [0, 4 * MiB])
def test_training_on_the_gpu_spills_past_the_host_cap_bit_exact(tmp_path: Any, gpu_bytes: int) -> None:
    host = HostPool(capacity_bytes=2 * MiB, chunk_bytes=MiB, pin=True)
    store = torchckpt.Store("cuda", gpu_bytes=gpu_bytes, min_bytes=0, host=host, disk=tmp_path)
    torch.manual_seed(5)
    plain = Stack([Block(d=128, p=0.0) for _ in range(4)]).cuda()
    wrapped = clone(plain)
    wrapped.blocks = torch.nn.ModuleList(torchckpt.checkpoint(b, policy=torchckpt.Offload(store)) for b in wrapped.blocks)
    x = torch.randn(8, 128, 128, device="cuda")
    for _ in range(3):  # the second step on out of the store's prefetch plan
        ref = torch.autograd.grad(plain(x).square().mean(), list(plain.parameters()))
        got = torch.autograd.grad(wrapped(x).square().mean(), list(wrapped.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
        torch.cuda.synchronize()
        assert files_under(tmp_path) == []
        assert host_in_use(store.host) == 0  # type: ignore[arg-type]
    st = store.stats()
    assert st.spilled > 0 and st.disk is not None and st.disk.bytes_written > 0 and st.disk.reads > 0
    store.close()
    assert os.listdir(tmp_path) == []
