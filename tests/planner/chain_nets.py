"""A chain of transformer blocks between two linear layers, and a profile of it with fixed times: what the planner's
CPU tests plan (tests/planner/test_plan_simple.py, test_calibrate.py)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from ckpt_models import Block as TransformerBlock
from torchckpt.planner.profiling import Profile, profile

D, H = 32, 4


class Net(nn.Module):
    """``n`` blocks made by ``block()`` (default: attention and an MLP, tests/ckpt_models.py's Block)."""

    def __init__(self, n: int = 4, block: Callable[[], nn.Module] = lambda: TransformerBlock(D, H)) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.h = nn.ModuleList(block() for _ in range(n))
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for blk in self.h:
            x = blk(x)
        return self.out(x)


def fixed_profile(net: nn.Module, seed: int = 5) -> Profile:
    """A profile of ``net`` on a batch of 4 x 16 with fixed times (the CPU's vary from run to run): 1 ms forward and
    2 ms backward a block, its ops sharing the forward evenly."""
    torch.manual_seed(seed)
    prof = profile(net, (torch.randn(4, 16, D),), {})
    ops = tuple(tuple(dataclasses.replace(o, seconds=1e-3 / len(b)) for o in b) for b in prof.ops)
    n = len(prof.names)
    return dataclasses.replace(prof, fwd_s=(1e-3,) * n, bwd_s=(2e-3,) * n, ops=ops, other_fwd_s=1e-4,
                               other_bwd_s=2e-4, step_s=3e-3 * n + 3e-4)
