"""torchckpt.plan on an H100-class GPU: exact gradients in bf16 and fp32 under the plans of several budgets."""
from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ckpt_models import Block
from torchckpt.planner import PlanError
from torchckpt.planner.calibrate import RECOMPUTE_ALL, REENTRANT_ALL
from torchckpt.planner.verify import _Profiled

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class Stack(nn.Module):
    def __init__(self, d: int, h: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h, p=0.0) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.float().square().mean()


def _grads(m: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(m(x), [x, *m.parameters()]))


def _peak_of_step(m: nn.Module, x: torch.Tensor) -> int:
    """Peak bytes one ``backward()`` step adds to what is allocated before it (as the planner counts)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    m(x).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plans_are_bit_exact_on_the_gpu_and_peak_within_budget(dtype: torch.dtype) -> None:
    # fp32 attention's fused backward is not reproducible run to run; the math kernel is.
    ctx = sdpa_kernel(SDPBackend.MATH) if dtype == torch.float32 else contextlib.nullcontext()
    with ctx:
        _check(dtype)


def _check(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    m = Stack(512, 8, 8).cuda().to(dtype)
    x = torch.randn(4, 512, 512, device="cuda", dtype=dtype, requires_grad=True)
    ref = _grads(m, x)
    assert all(torch.equal(u, v) for u, v in zip(ref, _grads(m, x))), "plain autograd is not reproducible here"
    m.zero_grad(set_to_none=True)
    planner = _Profiled.prepare(m, (x,), {}, None, None, None, None)  # one profile for every budget
    top = planner.plan(1 << 40)
    m.zero_grad(set_to_none=True)
    lo, hi = top.floor_bytes, top.none_peak_bytes
    found = {}
    for f in (0.1, 0.25, 0.5, 0.75):
        b = int(lo + (hi - lo) * f)
        with contextlib.suppress(PlanError):  # verification may find the lowest over its slack
            found[b] = planner.plan(b)
    m.zero_grad(set_to_none=True)
    assert len(found) >= 3, sorted(found)
    modes = set()
    for budget, p in found.items():
        assert p.peak_bytes <= budget
        assert p.measured_peak_bytes is not None and p.measured_peak_bytes <= budget  # verified (NOTE [ Applying a plan ] Rule 4)
        modes |= {b.mode for b in p.blocks}
        a = p.apply(m)
        try:
            for _ in range(2):  # the second step runs on the store's prefetch plan
                got = _grads(m, x)
                assert all(torch.equal(u, v) for u, v in zip(ref, got)), f"budget {budget}"
        finally:
            a.remove()
        a = p.apply(m)  # as a training loop meets it: .grad kept between steps
        try:
            m(x).backward()
            peaks = [_peak_of_step(m, x) for _ in range(3)]
            assert max(peaks) <= budget, (f"measured {peaks} B, verified {p.measured_peak_bytes} B, predicted "
                                          f"{p.peak_bytes} B, budget {budget} B, plan {[b.mode for b in p.blocks]}")
        finally:
            a.remove()
            m.zero_grad(set_to_none=True)
    assert modes - {"keep"}, modes


def test_block_by_block_profiles_give_verified_exact_plans_on_the_gpu() -> None:
    """NOTE [ Profiling step ] Rule 6 on the device: calibrated on the all-recomputed step, verified, exact."""
    torch.manual_seed(0)
    m = Stack(512, 8, 8).cuda().to(torch.bfloat16)
    x = torch.randn(4, 512, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = _grads(m, x)
    planner = _Profiled.prepare(m, (x,), {}, None, None, None, None, by_blocks=True)
    top = planner.plan(1 << 40)
    assert not top.none_measured
    m.zero_grad(set_to_none=True)
    lo, hi = top.floor_bytes, top.none_peak_bytes
    found = {}
    for f in (0.25, 0.5, 0.75):
        b = int(lo + (hi - lo) * f)
        with contextlib.suppress(PlanError):
            found[b] = planner.plan(b)
    assert found
    for budget, p in found.items():
        assert p.measured_peak_bytes is not None and p.measured_peak_bytes <= budget
        a = p.apply(m)
        try:
            assert all(torch.equal(u, v) for u, v in zip(ref, _grads(m, x))), f"budget {budget}"
        finally:
            a.remove()


def test_every_block_backward_working_memory_is_measured() -> None:
    """NOTE [ Profiling step ] Rule 3: each block's backward allocates the gradients of its activations; two hooks
    fire on the tensor between two blocks, and the first one's reset of the peak must not hide the second's."""
    from torchckpt.planner import profile, find_blocks

    torch.manual_seed(0)
    m = Stack(256, 4, 4).cuda()
    x = torch.randn(4, 128, 256, device="cuda", requires_grad=True)
    prof = profile(m, (x,), {}, blocks=find_blocks(m))
    # at least the gradient of the block's input (4 x 128 x 256 fp32) is allocated within each block's backward
    assert all(b >= x.numel() * 4 for b in prof.bwd_bytes), prof.bwd_bytes


def test_recompute_in_parts_at_the_profiled_cuts_holds_one_part_and_is_exact() -> None:
    """NOTE [ Step model ] Rule 2c on the device: every block recomputed in two parts, cut where the profile says
    (between autograd nodes, balanced by bytes), holds one part's recomputed tensors at a time and gives plain
    autograd's gradients, bit for bit."""
    import torchckpt
    from torchckpt.planner.costs import balanced_parts
    from torchckpt.recompute import parts

    torch.manual_seed(0)
    m = Stack(512, 8, 8).cuda().to(torch.bfloat16)
    x = torch.randn(4, 512, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = _grads(m, x)
    assert all(torch.equal(u, v) for u, v in zip(ref, _grads(m, x))), "plain autograd is not reproducible here"
    m.zero_grad(set_to_none=True)
    blk = _Profiled.prepare(m, (x,), {}, None, None, None, None).prof.blocks()[1]
    m.zero_grad(set_to_none=True)
    cuts = balanced_parts(blk.saved, 2, blk.cuts)
    assert cuts, blk
    for name, policy in (("whole", torchckpt.Recompute()), ("parts", torchckpt.Recompute(parts=cuts))):
        for b in m.blocks:
            torchckpt.checkpoint(b, policy=policy)
        try:
            got = _grads(m, x)
            assert all(torch.equal(u, v) for u, v in zip(ref, got)), name
            m.zero_grad(set_to_none=True)
            m(x).backward()
            with parts.measure() as meter:
                m(x).backward()
            m.zero_grad(set_to_none=True)
        finally:
            for b in m.blocks:
                b.__dict__.pop("forward", None)
    # The step's own peak is not the blocks' backward at this size (the two measured within 0.5 MB of each other,
    # either way round, on an H100); the GPT stack's frontier measures it at scale (docs/notes/2026-11-25-planner-frontier.md, run 4).
    assert len(meter.blocks) == len(m.blocks) and meter.recomputations == 2 * len(m.blocks)
    for st in meter.blocks:
        assert st.peak_bytes == max(st.part_bytes) < sum(st.part_bytes), (st.part_bytes, st.peak_bytes)


@pytest.mark.parametrize("d, n", [(512, 8), (1024, 12)])
def test_the_floor_in_parts_is_measured_and_predicts_what_it_measured(d: int, n: int) -> None:
    """NOTE [ Mechanism costs ] Rule 12 on the device: where the search's floor (after Rules 2-11) recomputes blocks in
    parts, planning measures it (``PARTS_FLOOR`` among the measurements) and the calibrated model predicts its peak
    within 0.1%; a stack whose floor has no parts is skipped, saying so."""
    from torchckpt.planner.calibrate import PARTS_FLOOR, calibrate, parts_floor
    from torchckpt.planner.costs import predict
    from torchckpt.planner.optimize import simple_policies

    torch.manual_seed(0)
    m = Stack(d, 8, n).cuda().to(torch.bfloat16)
    x = torch.randn(4, 1024, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    planner = _Profiled.prepare(m, (x,), {}, None, None, None, None)
    bare = planner.prof.chain(planner.link, planner.codec)
    before = calibrate(bare, simple_policies(bare), {k: v for k, v in planner.measured.items() if k != PARTS_FLOOR})
    plan = parts_floor(before)
    if plan is None:
        assert PARTS_FLOOR not in planner.measured
        pytest.skip(f"the search's floor recomputes no block in parts on Stack({d}, 8, {n})")
    peak = planner.measured[PARTS_FLOOR][0]
    assert peak is not None and abs(predict(planner.found.chain, plan).peak_bytes / peak - 1) <= 1e-3


class _Gated(nn.Module):
    """A block scaled by a tensor that needs grad and is none of its own parameters (the parent's): reentrant
    recomputation cannot give it a gradient and raises (NOTE [ Reentrant recompute ])."""

    def __init__(self, d: int, h: int, gate: nn.Parameter) -> None:
        super().__init__()
        self.inner = Block(d, h, p=0.0)
        self._gate = [gate]  # a list: not registered as this block's parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self._gate[0]


class _GatedStack(nn.Module):
    def __init__(self, d: int, h: int, n: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.ones(d))
        self.blocks = nn.ModuleList(_Gated(d, h, self.gate) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.float().square().mean()


def _planned(m: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], _Profiled]:
    """Plain autograd's gradients of ``m`` on ``x``, and ``m`` profiled for planning (the mechanisms measured)."""
    ref = _grads(m, x)
    m.zero_grad(set_to_none=True)
    return ref, _Profiled.prepare(m, (x,), {}, None, None, None, None)


def _exact_under(p: Any, m: nn.Module, x: torch.Tensor, ref: list[torch.Tensor]) -> None:
    """``p`` applied to ``m`` gives ``ref`` bit for bit."""
    m.zero_grad(set_to_none=True)
    a = p.apply(m)
    try:
        assert all(torch.equal(u, v) for u, v in zip(ref, _grads(m, x)))
    finally:
        a.remove()


def test_planning_a_model_reentrant_cannot_run_leaves_it_unmeasured() -> None:
    """NOTE [ Mechanism costs ] Rule 13: every block Recompute(reentrant=True) raises on this model's blocks; the planner
    leaves it unmeasured, makes no plan reentrant, and its plans give plain autograd's gradients."""
    torch.manual_seed(0)
    m = _GatedStack(256, 4, 6).cuda().to(torch.bfloat16)
    x = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref, planner = _planned(m, x)
    assert RECOMPUTE_ALL in planner.measured and REENTRANT_ALL not in planner.measured
    assert not planner.found.chain.reentrant
    p = planner.plan((planner.found.floor + planner.found.plans[0][1].peak_bytes) // 2)
    assert not any(b.reentrant for b in p.blocks) and any(b.mode == "recompute" for b in p.blocks)
    _exact_under(p, m, x, ref)


def test_reentrant_measured_faster_plans_recompute_whole_blocks_through_it_exactly() -> None:
    """NOTE [ Mechanism costs ] Rule 13 on the GPU: both mechanisms measured; where reentrant measured slower no plan is
    reentrant; either way the plan gives plain autograd's gradients bit for bit."""
    torch.manual_seed(0)
    m = Stack(512, 8, 12).cuda().to(torch.bfloat16)
    x = torch.randn(4, 512, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref, planner = _planned(m, x)
    assert RECOMPUTE_ALL in planner.measured and REENTRANT_ALL in planner.measured
    fast = planner.measured[REENTRANT_ALL][1] < planner.measured[RECOMPUTE_ALL][1]
    assert planner.found.chain.reentrant == fast
    p = planner.plan(planner.found.floor + (planner.found.plans[0][1].peak_bytes - planner.found.floor) // 3)
    assert any(b.mode == "recompute" for b in p.blocks)
    if not fast:
        assert not any(b.reentrant for b in p.blocks)
    _exact_under(p, m, x, ref)


def test_the_offloads_host_work_is_measured_predicts_what_it_measured_and_is_exact() -> None:
    """NOTE [ Mechanism costs ] Rule 14 on the GPU: planning measures every block sending its smallest saved tensor;
    the calibrated model predicts that policy's step as measured (or, where it measured under the model's copies, no
    less than them: the term is not below 0); applied, it gives plain autograd's gradients bit for bit."""
    from torchckpt.planner.calibrate import OFFLOAD_ALL, offload_policy
    from torchckpt.planner.costs import predict
    from torchckpt.planner.verify import _make

    torch.manual_seed(0)
    m = Stack(512, 8, 12).cuda().to(torch.bfloat16)
    x = torch.randn(4, 512, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref, planner = _planned(m, x)
    assert OFFLOAD_ALL in planner.measured
    chain = planner.found.chain
    policy = offload_policy(chain)
    assert policy is not None and all(d.mode == "offload" for d in policy)
    measured = planner.measured[OFFLOAD_ALL][1]
    got = predict(chain, policy).step_s
    if sum(b.off_s for b in chain.blocks) >= 0:
        assert got == pytest.approx(measured, rel=1e-3)  # the forward's added time may move a copy's stall a little
    else:
        assert got >= measured
    none = planner.found.plans[0][1]
    p = _make(planner.prof, policy, predict(chain, policy), planner.found.floor, none, none.peak_bytes, planner.link,
              None)
    _exact_under(p, m, x, ref)
