"""Storages several blocks reference, counted once by the step model (NOTE [ Shared storages ])."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from torchckpt.planner.costs import KEEP, RECOMPUTE, Block, Decision, Link, StepCosts, predict
from torchckpt.planner.profiling import profile
from torchckpt.planner.shared import shared_of

MiB = 1 << 20
X, M = 32 * MiB, 16 * MiB  # a block's input and output; the tensor it saves in between
LINK = Link(25e9, 25e9)


def resnet_like(n: int = 3) -> StepCosts:
    """Block i saves its input (position 0), a tensor of its own and its output (position 2), which block i + 1 takes
    as its input and saves again (a ReLU's output, then a convolution's input): storage i + 1 is block i's output."""
    saved = [[(i, X if i == 0 else 0), (100 + i, M), (i + 1, X)] for i in range(n)]
    inputs = [[(i, X)] for i in range(n)]
    shared = shared_of(saved, inputs)
    blocks = tuple(Block(f"b{i}", 1e-3, 2e-3, X, tuple(nb for _, nb in saved[i]), shared=shared[i]) for i in range(n))
    return StepCosts(blocks, 0, 0, 0.0, 0.0, LINK, bwd_fixed_bytes=0)


def alone(chain: StepCosts) -> StepCosts:
    """``chain`` as the model counted it per block, before NOTE [ Shared storages ]."""
    return dataclasses.replace(chain, blocks=tuple(dataclasses.replace(b, shared=()) for b in chain.blocks))


def test_shared_of_lists_what_another_block_references() -> None:
    """NOTE [ Shared storages ] Rule 2: block i's output is in block i's and block i + 1's lists (where each saved it,
    and as block i + 1's input); the first block's input and the last block's output are no other block's."""
    chain = resnet_like()
    assert [b.shared for b in chain.blocks] == [((1, X, 2),), ((1, X, 0), (2, X, 2), (1, X, -1)),
                                               ((2, X, 0), (2, X, -1))]


def test_a_kept_block_holds_the_output_of_a_recomputed_one() -> None:
    """NOTE [ Shared storages ] Rules 1-2: recomputing block 0 does not free its output while block 1, kept, saved it
    too (per block the model freed it: 128 MiB where 160 are held); and a recomputed block holds its input in its
    backward though the previous block saved it first (per block: 112 MiB where 144 are held)."""
    chain = resnet_like()
    first = [RECOMPUTE, KEEP, KEEP]
    assert predict(chain, first).peak_bytes == X + (X + M + X) + (M + X) == 160 * MiB
    assert predict(alone(chain), first).peak_bytes == 128 * MiB
    every = [RECOMPUTE] * 3
    got = predict(chain, every)  # the last block's backward: the inputs kept, its own input, its tensors made again
    assert (got.peak_bytes, got.at) == (2 * X + X + (M + X), "backward 2") and got.peak_bytes == 144 * MiB
    assert predict(alone(chain), every).peak_bytes == 112 * MiB
    assert predict(chain, [KEEP] * 3).peak_bytes == predict(alone(chain), [KEEP] * 3).peak_bytes  # each counted once


def test_an_input_handed_to_many_recomputed_blocks_counts_once() -> None:
    """NOTE [ Shared storages ] Rule 2: a tensor every block takes (T5's position bias), saved by none, is held once by
    the recomputed blocks that take it, however many; offloaded or kept blocks do not hold it."""
    n, bias = 4, 8 * MiB
    shared = shared_of([[(10 + i, X)] for i in range(n)], [[(i, X), (99, bias)] for i in range(n)])
    blocks = tuple(Block(f"b{i}", 1e-3, 2e-3, X + bias, (X,), shared=shared[i]) for i in range(n))
    chain = StepCosts(blocks, 0, 0, 0.0, 0.0, LINK, bwd_fixed_bytes=0)
    every = [RECOMPUTE] * n
    assert predict(chain, every).fwd_peak_bytes == n * X + bias
    assert predict(alone(chain), every).fwd_peak_bytes == n * (X + bias)
    mixed = [Decision("offload", (0,)), KEEP, RECOMPUTE, RECOMPUTE]
    assert predict(chain, mixed).fwd_peak_bytes == predict(alone(chain), mixed).fwd_peak_bytes - bias


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x) + bias)  # the add saves neither; the ReLU saves its output, the next Linear too


class _Chain(nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.h = nn.ModuleList(_Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = torch.sin(self.scale * x.mean(0))  # an activation every block takes
        for blk in self.h:
            x = blk(x, bias)
        return x


def test_the_profile_records_which_storages_blocks_share() -> None:
    """NOTE [ Shared storages ] Rule 2 from a real step (CPU): each block's output is the next block's input and is
    saved by both; the bias every block takes is held once by the recomputed blocks; keeping every block is unchanged."""
    n, d = 4, 64
    net = _Chain(n, d)
    x = torch.randn(32, d, requires_grad=True)
    prof = profile(net, (x,), {}, blocks=[(f"h.{i}", b) for i, b in enumerate(net.h)], repeats=1)
    chain = prof.chain(LINK)
    out, bias = 32 * d * 4, d * 4
    for i, b in enumerate(chain.blocks):
        taken = {s for s, _, pos in b.shared if pos == -1}
        assert len(taken) == 2 if i else len(taken) == 1  # the bias; from block 1 on, the previous block's output
        assert sorted(nb for _, nb, pos in b.shared if pos == -1) == ([bias, out] if i else [bias])
    ref = alone(chain)
    assert predict(chain, [KEEP] * n).peak_bytes == predict(ref, [KEEP] * n).peak_bytes
    every = [RECOMPUTE] * n
    assert predict(chain, every).fwd_peak_bytes == predict(ref, every).fwd_peak_bytes - (n - 1) * bias
    first = [RECOMPUTE] + [KEEP] * (n - 1)  # block 0's output stays with block 1
    assert predict(chain, first).fwd_peak_bytes == predict(ref, first).fwd_peak_bytes + out


def test_an_offload_sends_every_position_of_a_storage_or_none() -> None:
    """NOTE [ Plan search ] Rule 1: a block that saved one storage at two positions (the two halves of one output, as
    Mixtral's experts save their gate-and-up product) gets offload rungs with both positions or neither: sending one
    view alone would leave the storage on the device, referenced by the other (on an H100 such plans peaked 0.4-1.2
    GiB over their predictions). Without ``Block.same`` the rungs are as before."""
    from torchckpt.planner.optimize import ladder

    saved = (0, 64 * MiB, 0, 16 * MiB, 8 * MiB)  # position 2 shares position 1's storage (its bytes are counted there)
    plain = Block("b", 1e-3, 2e-3, X, saved)
    together = dataclasses.replace(plain, same=(0, 1, 1, 3, 4))
    offloads = [d.offload for d in ladder(together, compress=False) if d.mode == "offload"]
    assert offloads and all((1 in o) == (2 in o) for o in offloads)
    assert [d.offload for d in ladder(plain, compress=False) if d.mode == "offload"][0] == (1,)
    assert offloads[0] == (1, 2)


def test_the_profile_records_the_positions_of_one_storage() -> None:
    """``Block.same`` from the profiling step: a block whose forward saves one tensor twice (``x * x`` saves ``x`` as
    both factors) and halves of one tensor (``chunk``)."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            a, b = h.chunk(2, dim=-1)
            return (a.sigmoid() * b).sum() + (x * x).sum()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h = nn.ModuleList([Twice(), Twice()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return sum(b(x) for b in self.h)

    prof = profile(Net(), (torch.randn(4, 8, requires_grad=True),), {})
    b = prof.blocks()[0]
    assert b.same and len(b.same) == len(b.saved)
    groups: dict[int, list[int]] = {}
    for k, r in enumerate(b.same):
        groups.setdefault(r, []).append(k)
    assert any(len(g) > 1 for g in groups.values())
    assert all(b.saved[k] == 0 for g in groups.values() for k in g[1:])  # bytes counted at the first position only
