"""checkpoint_chain on CUDA: a GPT-style stack in bf16 and fp32, gradients bit for bit, and the memory it frees."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import torchckpt
from torchckpt.schedules import Multistage, optimal_forward_steps
from torchckpt.recompute.chain import SLOTS

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


class GPTBlock(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.drop(self.proj(a))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def _stack(n: int, d: int, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[GPTBlock(d, 4) for _ in range(n)]).to("cuda", dtype)


def _step(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """Gradients, and the bytes the forward leaves allocated for the backward (what the blocks' inputs are part of:
    the step's peak itself comes late in the backward of a model this small, where the parameters' gradients are)."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.manual_seed(5)
    torch.cuda.manual_seed(5)
    loss = model(x).float().square().mean()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - start
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads, held


def _compare(model: nn.Module, x: torch.Tensor, **chain_args: Any) -> tuple[Any, ...]:
    """Plain autograd, per-block Recompute() and checkpoint_chain(**chain_args) on one model (the last two after a
    warm-up step): the gradients and the bytes the forward leaves of each, and the chain's handle."""
    with sdpa_kernel(SDPBackend.MATH):  # deterministic, so that torch.equal is meaningful
        plain, _ = _step(model, x)
        for blk in model:
            torchckpt.checkpoint(blk, policy=torchckpt.Recompute())
        _step(model, x)
        per_block, per_block_held = _step(model, x)
        for blk in model:
            blk.__dict__.pop("forward")
        chain = torchckpt.checkpoint_chain(list(model), **chain_args)
        _step(model, x)
        got, chain_held = _step(model, x)
        chain.remove()
    return plain, per_block, per_block_held, got, chain_held, chain


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpt_stack_exact_and_holds_fewer_inputs(dtype: torch.dtype) -> None:
    n, d, s = 12, 256, 3
    model = _stack(n, d, dtype)
    x = torch.randn(8, 512, d, device="cuda", dtype=dtype)
    plain, per_block, per_block_held, got, chain_held, chain = _compare(model, x, snapshots=s)
    assert all(torch.equal(a, b) for a, b in zip(plain, per_block))
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    assert chain.stats.advances == 2 * (optimal_forward_steps(n, s) - (n - 1))
    # per-block recomputation holds all n inputs at the end of the forward; the chain s + 1 of them
    freed = (n - s - 1) * x.nbytes
    assert abs(per_block_held - chain_held - freed) <= freed // 8, (per_block_held, chain_held, freed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpt_stack_host_snapshots(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Multistage with one GPU slot and three host slots (NOTE [ Chain of blocks ] Rule 8): exact gradients, fewer
    inputs left on the device than per-block recomputation, and host snapshots prefetched back ahead of their
    restores."""
    monkeypatch.setenv("TORCHCKPT_DEVICE_CACHE", "caching")  # the store's slots in memory_allocated(), not an arena
    n, d = 12, 256
    sched = Multistage(n, gpu_slots=1, host_slots=3)
    model = _stack(n, d, dtype)
    x = torch.randn(8, 512, d, device="cuda", dtype=dtype)
    plain, per_block, per_block_held, got, chain_held, chain = _compare(model, x, schedule=sched)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(plain, per_block))
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    assert chain.stats.advances == 2 * (optimal_forward_steps(n, 4) - (n - 1))
    st = chain.snapshot_stats()
    assert st is not None and st.host_saves > 0
    assert st.prefetch_hits > 0, f"prefetch hits {st.prefetch_hits}, misses {st.misses}: {st}"
    # the forward leaves the GPU snapshot, the current state and the store's slots: per-block recomputation all n
    assert chain_held < per_block_held, (chain_held, per_block_held)
    freed = (n - 2 - SLOTS) * x.nbytes
    assert abs(per_block_held - chain_held - freed) <= freed // 8, (per_block_held, chain_held, freed, st.misses)
