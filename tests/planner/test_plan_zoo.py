"""torchckpt.plan on models torchckpt's authors did not write (tests/zoo_models.py): the chain is found without
per-model code and every plan gives plain autograd's gradients, bit for bit (CPU; CUDA with the ``cuda`` marker)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from torchckpt.planner import find_blocks, plans
from zoo_models import BY_NAME, ZOO, Batch, Zoo, available, deterministic_cuda, to

# The entries whose hand-written block lists find_blocks finds by itself (resnet18's list is its four stages, where
# find_blocks takes the eight blocks inside them; mobilenet_v3's ends with a last conv layer, which is not a block).
SAME_BLOCKS = {"gpt2", "llama", "bert", "vit", "swin", "convnext"}
CASES = [z.name for z in ZOO if not z.name.startswith("ode")]


class LossOf(nn.Module):
    """The zoo entry's loss on its batch, as a module whose forward is the step's loss."""

    def __init__(self, z: Zoo, model: nn.Module, batch: Batch) -> None:
        super().__init__()
        self.z, self.model, self.batch = z, model, batch

    def forward(self) -> torch.Tensor:
        return self.z.loss(self.model, self.batch, False)


def _grads(m: LossOf, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    params = [p for p in m.parameters() if p.requires_grad]
    return list(torch.autograd.grad(m(), params, allow_unused=True, materialize_grads=True))


def check(name: str, device: str) -> None:
    z = BY_NAME[name]
    if not available(z):
        pytest.skip(f"{z.package} is not installed")
    model, batch = z.build()
    model = model.to(device).train(z.train)
    m = LossOf(z, model, to(batch, device))
    found = [mod for _, mod in find_blocks(m)]
    assert found, name
    if name in SAME_BLOCKS:
        assert [id(b) for b in found] == [id(b) for b in z.blocks(model)], name
    with deterministic_cuda() if device == "cuda" else contextlib.nullcontext():
        ref = _grads(m, 0)
        again = _grads(m, 0)
        if not all(torch.equal(u, v) for u, v in zip(ref, again)):
            pytest.skip(f"plain autograd is not reproducible for {name} on {device}")
        top = plans(m, budgets=[1 << 50])[1 << 50]
        lo, hi = top.floor_bytes, top.none_peak_bytes
        budgets = sorted({int(lo + (hi - lo) * f) for f in (0.0, 0.5)} | {hi, hi + hi // 5})
        found_plans = plans(m, budgets=budgets)
        assert found_plans, (name, lo, hi)  # hi + 20%: keeping everything passes verification at least
        modes = set()
        for budget, p in found_plans.items():
            modes |= {b.mode for b in p.blocks}
            applied = p.apply(m)
            try:
                for step in range(2):
                    got = _grads(m, 0)
                    bad = [i for i, (u, v) in enumerate(zip(ref, got)) if not torch.equal(u, v)]
                    assert not bad, f"{name}: budget {budget}, step {step}: gradients {bad} differ"
            finally:
                applied.remove()
        if device == "cpu":  # on CUDA, verification may turn down every plan of a tiny model (cuDNN workspaces)
            assert modes != {"keep"} or lo == hi, (name, modes)


@pytest.mark.parametrize("name", CASES)
def test_plan_zoo_cpu(name: str) -> None:
    check(name, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CASES)
def test_plan_zoo_cuda(name: str) -> None:
    check(name, "cuda")
