"""torchckpt.plan on CPU models: finding the chain, the profile, plans that keep gradients bit-exact, JSON."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt import Offload
from torchckpt.memory.factory import shared_host_pool
from torchckpt.planner import Decision, Link, Plan, PlanError, find_blocks, plan, plans, profile
from torchckpt.planner.verify import _make
from torchckpt.planner.costs import Prediction
from torchckpt.planner.rebuild import states
from torchckpt.schedules import optimal_forward_steps

D = 64


class Blk(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x)))))


class Net(nn.Module):
    def __init__(self, n: int = 5, p: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.h = nn.ModuleList([Blk(p) for _ in range(n)])
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.h:
            x = b(x)
        return self.out(x)


def _grads(m: nn.Module, x: torch.Tensor, seed: int = 0) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return list(torch.autograd.grad(m(x).square().mean(), list(m.parameters())))


def test_find_blocks_takes_the_largest_repeated_container() -> None:
    m = Net()
    assert [n for n, _ in find_blocks(m)] == [f"h.{i}" for i in range(5)]
    stages = nn.Sequential(nn.Linear(D, D), nn.Sequential(Blk(), Blk()), nn.Sequential(Blk(), Blk(), Blk()))
    assert [n for n, _ in find_blocks(stages)] == ["1.0", "1.1", "2.0", "2.1", "2.2"]  # across stages, in order
    nested = nn.ModuleList([nn.Sequential(Blk(), nn.ReLU()) for _ in range(3)])  # Blk inside a plain container
    assert [n for n, _ in find_blocks(nested)] == ["0.0", "1.0", "2.0"]
    seqs = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(3)])  # blocks that are containers
    assert [n for n, _ in find_blocks(seqs)] == ["0", "1", "2"]
    with pytest.raises(ValueError, match="torchckpt: found no chain of blocks.*blocks="):
        find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Conv1d(4, 4, 1)))  # leaf layers are not blocks


def test_profile_records_saved_tensors_in_order_and_leaves_parameters_out() -> None:
    m = Net(3)
    x = torch.randn(32, D)
    prof = profile(m, (x,), {})
    assert prof.names == ("h.0", "h.1", "h.2") and len(set(prof.kinds)) == 1
    for saved in prof.saved:
        assert [s.position for s in saved] == list(range(len(saved)))
        assert any(s.why_zero == "parameter" and s.nbytes == 0 for s in saved)
        assert sum(s.nbytes for s in saved) > 0
    assert all(f > 0 for f in prof.fwd_s) and all(b > 0 for b in prof.bwd_s)
    assert prof.input_bytes[0] == 32 * D * 4


def _forced(m: nn.Module, x: torch.Tensor, decisions: list[Decision]) -> Plan:
    prof = profile(m, (x,), {})
    pred = Prediction(0, 1.0, 0.0, 0.0, 0, 0, "")
    return _make(prof, decisions, pred, 0, pred, 1 << 40, Link(1e9, 1e9), None)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_every_decision_gives_plain_autograd_gradients_bit_for_bit(p: float) -> None:
    """NOTE [ Applying a plan ] Rule 3, with dropout (the RNG) and each mode: keep, recompute, offload all, offload some."""
    torch.manual_seed(1)
    m = Net(5, p)
    x = torch.randn(16, D, requires_grad=False)
    ref = _grads(m, x)
    prof = profile(m, (x,), {})
    some = tuple(k for k, s in enumerate(prof.saved[3]) if s.nbytes)[::2]
    allk = tuple(k for k, s in enumerate(prof.saved[2]) if s.nbytes)
    mm = tuple(o.position for o in prof.ops[0] if o.op in ("aten.addmm.default", "aten.mm.default"))
    assert len(mm) == 2  # fc1, fc2
    pl = _forced(m, x, [Decision("recompute", keep=mm), Decision("recompute"), Decision("offload", allk),
                        Decision("offload", some), Decision("recompute", host=True)])
    assert pl.blocks[0].keep_ops == mm and pl.blocks[0].keep_bytes > 0
    applied = pl.apply(m)
    try:
        got = _grads(m, x)
        assert applied.store is not None and applied.store.stats().offloaded > 0
    finally:
        applied.remove()
    again = pl.apply(m)  # NOTE [ Applying a plan ] Rule 2: each store made for a plan takes the process's shared pool
    try:
        assert again.store is not None and again.store is not applied.store
        assert again.store.host is applied.store.host is shared_host_pool(pin=False)
        assert all(torch.equal(a, b) for a, b in zip(ref, _grads(m, x)))
    finally:
        again.remove()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert all(torch.equal(a, b) for a, b in zip(ref, _grads(m, x)))  # removed: plain again
    assert all("forward" not in blk.__dict__ for blk in m.h)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_a_plan_recomputing_through_reentrant_gives_plain_autograd_gradients_bit_for_bit(p: float) -> None:
    """NOTE [ Mechanism costs ] Rule 13's plans: whole blocks recomputed through Recompute(reentrant=True) beside
    Recompute(), Recompute(save=...) and kept blocks, with dropout; applied and removed."""
    torch.manual_seed(1)
    m = Net(5, p)
    x = torch.randn(16, D)
    ref = _grads(m, x)
    prof = profile(m, (x,), {})
    mm = tuple(o.position for o in prof.ops[2] if o.op in ("aten.addmm.default", "aten.mm.default"))
    reentrant = Decision("recompute", reentrant=True)
    pl = _forced(m, x, [reentrant, Decision("recompute"), Decision("recompute", keep=mm), reentrant, Decision("keep")])
    assert [b.reentrant for b in pl.blocks] == [True, False, False, True, False]
    assert Plan.from_json(pl.to_json()).blocks == pl.blocks  # saved and loaded with it
    applied = pl.apply(m)
    try:
        assert [getattr(getattr(blk.__dict__.get("forward"), "policy", None), "reentrant", False)
                for blk in m.h] == [True, False, False, True, False]
        got = _grads(m, x)
    finally:
        applied.remove()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert all("forward" not in blk.__dict__ for blk in m.h)


def test_plans_at_budgets_between_floor_and_peak_are_exact_and_within_budget() -> None:
    torch.manual_seed(2)
    m = Net(6)
    x = torch.randn(64, D)
    ref = _grads(m, x)
    from torchckpt.planner.verify import _Profiled

    slow = Link(2e8, 2e8)  # a slow link makes recomputation win some blocks
    planner = _Profiled.prepare(m, (x,), {}, None, None, None, slow)  # one profile: CPU times vary between two
    top = planner.plan(1 << 40)
    assert [b.mode for b in top.blocks] == ["keep"] * 6
    modes = set()
    for frac in (0.0, 0.3, 0.6, 0.9):
        budget = int(top.floor_bytes + (top.none_peak_bytes - top.floor_bytes) * frac)
        p = planner.plan(budget)
        assert p.peak_bytes <= budget
        modes |= {b.mode for b in p.blocks}
        a = p.apply(m)
        try:
            assert all(torch.equal(u, v) for u, v in zip(ref, _grads(m, x)))
        finally:
            a.remove()
    assert "recompute" in modes


def test_budget_below_the_floor_names_it() -> None:
    m = Net(3)
    with pytest.raises(PlanError, match=r"^torchckpt: no plan fits a budget of .* lowest peak"):
        plan(m, torch.randn(8, D), budget="1KiB")
    with pytest.raises(ValueError, match="torchckpt:"):
        plan(m, torch.randn(8, D), budget="lots")


def test_plan_json_round_trip(tmp_path) -> None:
    m = Net(3)
    x = torch.randn(8, D)
    p = plan(m, x, budget=1 << 40)
    assert Plan.from_json(p.to_json()) == p
    f = tmp_path / "plan.json"
    p.save(str(f))
    assert Plan.load(str(f)) == p
    assert "h.0" in p.summary()


def test_plan_rejects_blocks_of_another_model_and_a_non_codec() -> None:
    m = Net(3)
    with pytest.raises(ValueError, match="plan\\(blocks=...\\) must be submodules"):
        plan(m, torch.randn(8, D), budget=1 << 40, blocks=[nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="plan\\(codec=...\\)"):
        plan(m, torch.randn(8, D), budget=1 << 40, codec="q4")


def test_offload_tensors_argument_is_checked() -> None:
    with pytest.raises(TypeError, match="Offload\\(tensors=...\\)"):
        Offload(tensors=[-1])
    assert Offload(tensors=[0, 2]).tensors == frozenset({0, 2})


def test_offload_of_chosen_positions_moves_only_those() -> None:
    store = torchckpt.Store(device="cpu", min_bytes=0)
    m = Blk()
    x = torch.randn(16, D, requires_grad=True)
    ref = torch.autograd.grad(m(x).sum(), [x])
    prof = profile(nn.Sequential(m, Blk()), (x,), {})
    first = next(k for k, s in enumerate(prof.saved[0]) if s.nbytes)
    wrapped = torchckpt.checkpoint(m, policy=Offload(store, tensors={first}))
    got = torch.autograd.grad(wrapped(x).sum(), [x])
    assert torch.equal(ref[0], got[0])
    assert store.stats().offloaded == 1


def test_verification_plans_again_for_the_excess_then_gives_up() -> None:
    """NOTE [ Applying a plan ] Rule 4 with a stand-in for the measured step (the CPU has no allocator peak)."""
    from torchckpt.planner.verify import _REPLANS, _Profiled

    m = Net(6)
    x = torch.randn(64, D)
    prof = profile(m, (x,), {})
    seen: list[int] = []

    def over_by(extra: int):
        def step(p: Plan) -> tuple[int, float]:
            seen.append(p.peak_bytes)
            return p.peak_bytes + extra, p.step_time
        return step

    ok = _Profiled(prof, Link(2e8, 2e8), None, over_by(0))
    hi = ok.found.plans[0][1].peak_bytes
    budget = (ok.found.floor + hi) // 2
    budget += max(budget // 100, min(2 << 20, budget // 10)) + 1  # the slack of NOTE [ Applying a plan ] Rule 4
    assert ok.plan(budget).measured_peak_bytes <= budget
    seen.clear()
    extra = (hi - ok.found.floor) // 6  # a step peaks a little above each prediction: planned again, lower
    p = _Profiled(prof, Link(2e8, 2e8), None, over_by(extra))._verified(budget, "all")[0]
    assert p.measured_peak_bytes <= budget and p.budget == budget
    assert len(seen) >= 2 and seen == sorted(seen, reverse=True)
    seen.clear()
    with pytest.raises(PlanError, match="when measured"):
        _Profiled(prof, Link(2e8, 2e8), None, over_by(hi)).plan(budget)
    assert 1 <= len(seen) <= _REPLANS + 1 and seen[-1] == ok.found.floor  # the floor's plan, tried last
    # a plan over by more than the room down to the floor: the floor's plan is tried and, measured within, returned
    floor = ok.found.floor
    near = next(p.peak_bytes for _, p in sorted(ok.found.plans, key=lambda dp: dp[1].peak_bytes) if p.peak_bytes > floor)
    tight = near + max(near // 100, min(2 << 20, near // 10)) + 1  # its best plan is above the floor, which fits

    def over_unless_floor(p: Plan) -> tuple[int, float]:
        seen.append(p.peak_bytes)
        return p.peak_bytes + (0 if p.peak_bytes == floor else 4 * (near - floor) + (1 << 20)), p.step_time

    seen.clear()
    got = _Profiled(prof, Link(2e8, 2e8), None, over_unless_floor)._verified(tight, "all")[0]
    assert seen[0] > floor and seen[-1] == floor and got.measured_peak_bytes == floor


class BNBlk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.drop = nn.Linear(D, D), nn.BatchNorm1d(D), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.bn(self.fc(x))))


def test_auto_plans_on_the_first_step_and_leaves_no_trace() -> None:
    """The first step under auto computes what plain autograd computes: .grad, batch-norm statistics, RNG put back."""
    import copy

    torch.manual_seed(3)
    base = nn.Sequential(nn.Linear(D, D), *[BNBlk() for _ in range(6)], nn.Linear(D, 2))
    x = torch.randn(64, D)
    probe = copy.deepcopy(base)
    top = plans(probe, x, budgets=[1 << 40], loss_fn=lambda y: y.square().mean())[1 << 40]
    budget = (top.floor_bytes + top.none_peak_bytes) // 2
    plain, planned = copy.deepcopy(base), copy.deepcopy(base)
    a = torchckpt.auto(planned, budget=budget, loss_fn=lambda y: y.square().mean())
    assert a.plan is None
    for step in range(3):
        torch.manual_seed(100 + step)
        plain(x).square().mean().backward()
        torch.manual_seed(100 + step)
        planned(x).square().mean().backward()
        assert a.plan is not None and any(b.mode != "keep" for b in a.plan.blocks)
        for (n, p), q in zip(plain.named_parameters(), planned.parameters()):
            assert torch.equal(p.grad, q.grad), (step, n)
        for (n, b), c in zip(plain.named_buffers(), planned.buffers()):
            assert torch.equal(b, c), (step, n)
    a.remove()
    assert all("forward" not in m.__dict__ for m in planned.modules())


def test_auto_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="torchckpt: auto"):
        torchckpt.auto(lambda x: x, budget=1 << 30)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="torchckpt:"):
        torchckpt.auto(Net(), budget="some")


def test_profiled_op_positions_are_those_recompute_save_counts() -> None:
    """NOTE [ Profiling step ] Rule 5: the positions of the profile name the same ops under Recompute(save=...)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    m = Net(3)
    x = torch.randn(16, D)
    prof = profile(m, (x,), {})
    blk = m.h[1]
    mm = frozenset(o.position for o in prof.ops[1] if o.op == "aten.addmm.default")
    assert len(mm) == 2

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            Count.n += str(func) == "aten.addmm.default"
            return func(*args, **(kwargs or {}))

    h = torch.randn(16, D, requires_grad=True)
    with Count():
        torchckpt.api.run(torchckpt.Recompute(save=mm), blk, h, module=blk).sum().backward()
    assert Count.n == 2  # the forward's two; the recomputation ran none


class Branchy(nn.Module):
    """Saves one more tensor for batches above 8 rows: another input shape, other saved tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        return y * torch.sigmoid(y) if x.shape[0] > 8 else y


def test_another_count_of_saved_tensors_warns_once_and_offloads_all() -> None:
    import warnings

    store = torchckpt.Store(device="cpu", min_bytes=0, gpu_bytes=0)
    blk = Branchy()
    small, big = torch.randn(8, D, requires_grad=True), torch.randn(16, D, requires_grad=True)
    prof = profile(nn.Sequential(blk, Branchy()), (small,), {})
    first = next(k for k, s in enumerate(prof.saved[0]) if s.nbytes)
    pol = torchckpt.Offload(store, tensors={first}, expect=len(prof.saved[0]))
    wrapped = torchckpt.checkpoint(copy.deepcopy(blk), policy=pol)
    plain = copy.deepcopy(blk)
    offloaded = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in (small, big, big):
            ref = torch.autograd.grad(plain(x).sum(), [x])
            before = store.stats().offloaded
            got = torch.autograd.grad(wrapped(x).sum(), [x])
            offloaded.append(store.stats().offloaded - before)
            assert torch.equal(ref[0], got[0])  # exact whatever the count
    msgs = [str(c.message) for c in caught if "profiled" in str(c.message)]
    assert len(msgs) == 1 and msgs[0].startswith("torchckpt:"), msgs
    assert offloaded[0] == 1 and offloaded[2] > offloaded[0], offloaded  # then every tensor it saves
    with pytest.raises(TypeError, match=r"Offload\(expect=...\)"):
        torchckpt.Offload(expect=-1)


def test_profiling_block_by_block_records_what_the_plain_step_records() -> None:
    """NOTE [ Profiling step ] Rule 6: the same saved tensors and inputs, the step's own gradients, exact plans."""
    from torchckpt.planner.verify import _Profiled
    from torchckpt.planner.profiling import profile_blocks

    torch.manual_seed(4)
    m = Net(4)
    x = torch.randn(32, D)
    plain = profile(m, (x,), {})
    m.zero_grad(set_to_none=True)
    ref = [g.clone() for g in torch.autograd.grad(m(x).square().mean(), list(m.parameters()))]
    blocks = profile_blocks(m, (x,), {}, warmup=0)
    assert blocks.by_blocks and not plain.by_blocks
    alone = [[dataclasses.replace(t, storage=-1) for t in sv] for sv in plain.saved]  # storages: no block sees another's
    assert [list(sv) for sv in blocks.saved] == alone and blocks.input_bytes == plain.input_bytes
    assert [o.op for o in blocks.ops[1]] == [o.op for o in plain.ops[1]]
    for p, g in zip(m.parameters(), ref):  # one step's gradients: the blocks' own runs left none
        assert torch.equal(p.grad, g)
    m.zero_grad(set_to_none=True)
    planner = _Profiled(blocks, Link(2e8, 2e8), None, lambda p: None)
    top = planner.plan(1 << 40)
    assert not top.none_measured and "predicted" in top.summary()
    p = planner.plan((top.floor_bytes + top.none_peak_bytes) // 2)
    a = p.apply(m)
    try:
        assert all(torch.equal(u, v) for u, v in zip(_grads(m, x), _grads(m, x)))
        torch.manual_seed(0)
        assert all(torch.equal(u, v) for u, v in zip(ref, torch.autograd.grad(m(x).square().mean(),
                                                                               list(m.parameters()))))
    finally:
        a.remove()


def test_a_step_that_does_not_fit_is_profiled_block_by_block() -> None:
    """NOTE [ Profiling step ] Rule 6's trigger: the plain step raises the allocator's out-of-memory error (raised here
    by the model)."""

    class Tight(Net):
        fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.fail:
                self.fail = False
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (raised by the test)")
            return super().forward(x)

    m = Tight(3)
    with pytest.warns(RuntimeWarning, match="torchckpt: the model's step does not fit"):
        prof = profile(m, (torch.randn(16, D),), {})
    assert prof.by_blocks and len(prof.saved) == 3


def test_progress_says_each_phase(capsys: pytest.CaptureFixture[str]) -> None:
    plan(Net(3), torch.randn(8, D), budget=1 << 40, progress=True)
    err = capsys.readouterr().err
    assert "torchckpt: profiling one step of Net: 3 blocks (h.0 ... h.2)" in err
    assert "torchckpt: searched" in err
    plan(Net(3), torch.randn(8, D), budget=1 << 40)
    assert capsys.readouterr().err == ""


def test_verification_returns_the_fastest_measured_family() -> None:
    """NOTE [ Applying a plan ] Rule 5: when the measured steps say the copies cost more than predicted, the best
    plan that moves nothing over the host link wins the race."""
    from torchckpt.planner.costs import host_bytes
    from torchckpt.planner.verify import _Profiled

    m = Net(6)
    x = torch.randn(64, D)
    prof = profile(m, (x,), {})
    measured: list[tuple[int, float]] = []

    def step(p: Plan) -> tuple[int, float]:  # a link far slower than the model thought
        moves = any(b.host_bytes for b in p.blocks)
        measured.append((p.peak_bytes, p.step_time * (5 if moves else 1)))
        return measured[-1]

    planner = _Profiled(prof, Link(1e13, 1e13), None, step)  # the model: copies are free
    chain = planner.found.chain
    budgets = [pred.peak_bytes * 10 // 9 + 1 for _, pred in planner.found.plans]  # room for NOTE [ Applying a plan ] Rule 4's slack
    moving = [b for b in budgets if any(host_bytes(blk, d) for blk, d in zip(chain.blocks, planner.found.best(b)[0]))]
    local = [b for b in moving if _fits_local(planner, b)]
    assert local, "no budget where the best plan moves bytes and a local plan fits"
    measured.clear()
    budget = local[0]
    p = planner.plan(budget)
    assert not any(b.host_bytes for b in p.blocks)
    limit = budget - max(budget // 100, min(2 << 20, budget // 10))  # NOTE [ Applying a plan ] Rule 4's slack
    assert p.measured_step_time == min(t for peak, t in measured if peak <= limit) and len(measured) >= 2


def _fits_local(planner, budget: int) -> bool:  # noqa: ANN001
    try:
        planner.found.best(budget, "local")
    except PlanError:
        return False
    return True


def test_blocks_that_write_their_buffers_are_recomputed_with_their_statistics_kept() -> None:
    """NOTE [ Profiling step ] Rule 7, NOTE [ Buffers written in a forward ]: a block whose forward writes batch norm's
    running statistics may be recomputed (Recompute puts them back around the recomputation): the plan at the lowest
    budget recomputes them, and a step under it leaves the statistics and gradients of plain autograd, bit for bit."""
    import copy

    from torchckpt.planner.optimize import ladder
    from torchckpt.planner.verify import _Profiled

    torch.manual_seed(4)
    base = nn.Sequential(nn.Linear(D, D), *[BNBlk() for _ in range(4)], nn.Linear(D, 2))
    x = torch.randn(64, D)
    planner = _Profiled.prepare(copy.deepcopy(base), (x,), {}, None, None, lambda y: y.square().mean(), None)
    assert planner.prof.writes_buffers == (True,) * 4
    for b in planner.prof.blocks():
        assert b.recomputable and any(d.mode == "recompute" for d in ladder(b, compress=False))
    low = planner.plan(planner.found.floor)
    assert any(b.mode == "recompute" for b in low.blocks)
    plain, planned = copy.deepcopy(base), copy.deepcopy(base)
    a = low.apply(planned)
    try:
        for _ in range(2):
            torch.manual_seed(7)
            plain(x).square().mean().backward()
            torch.manual_seed(7)
            planned(x).square().mean().backward()
    finally:
        a.remove()
    for (n, b), c in zip(plain.named_buffers(), planned.buffers()):
        assert torch.equal(b, c), n
    for (n, p), q in zip(plain.named_parameters(), planned.parameters()):
        assert torch.equal(p.grad, q.grad), n
    eval_only = copy.deepcopy(base).eval()  # in eval mode nothing is written: recomputation is offered again
    prof = _Profiled.prepare(eval_only, (x,), {}, None, None, lambda y: y.square().mean(), None).prof
    assert prof.writes_buffers == (False,) * 4


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_a_plan_with_revolve_over_the_chain_is_exact_and_runs_what_the_model_counts(p: float) -> None:
    """NOTE [ Applying a plan ] Rule 1: every block through checkpoint_chain, Revolve's schedule as planned."""
    torch.manual_seed(1)
    m = Net(7, p)
    x = torch.randn(16, D)
    ref = _grads(m, x)
    prof = profile(m, (x,), {})
    size = prof.input_bytes[0]
    pl = _forced(m, x, [Decision("recompute", revolve=2 * size)] * 7)
    assert pl.revolve == 2 * size and repr(pl.schedule()) == "Revolve(n_steps=7, snapshots=2, tier=Tier.GPU)"
    assert "Revolve(n_steps=7, snapshots=2" in pl.summary()
    assert all(b.device_bytes == 0 for b in pl.blocks)  # the inputs are the chain's to keep
    assert Plan.from_json(pl.to_json()) == pl
    applied = pl.apply(m)
    try:
        got = _grads(m, x)
        assert applied.chain is not None
        st_ = states(prof.fwd_s, prof.input_bytes, 2 * size)
        assert applied.chain.stats.advances == st_.advances == optimal_forward_steps(7, 2) - 6
        assert applied.chain.stats.peak_state_bytes == max(st_.fwd)
    finally:
        applied.remove()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert all("forward" not in blk.__dict__ for blk in m.h)


def test_measured_step_time_never_rises_with_the_budget() -> None:
    """NOTE [ Applying a plan ] Rule 6: a larger budget whose own plan measures slower gets a faster plan verified
    for a smaller budget, when that plan's measured peak fits."""
    from torchckpt.planner.verify import _decisions, _Profiled

    m = Net(6)
    x = torch.randn(64, D)
    prof = profile(m, (x,), {})
    slow: set[tuple] = set()

    def step(p: Plan) -> tuple[int, float]:  # every plan measures as predicted, except those made slow
        return p.peak_bytes, p.step_time * (3 if _decisions(p) in slow else 1)

    planner = _Profiled(prof, Link(1e10, 1e10), None, step)
    peaks = sorted({pred.peak_bytes for _, pred in planner.found.plans})
    small, large = peaks[len(peaks) // 2] * 10 // 9 + 1, peaks[-1] * 10 // 9 + 1
    first = planner.plan(small)
    slow.update(planner.found.best(large, family)[0] for family in ("all", "lossless", "local"))
    assert _decisions(first) not in slow
    second = planner.plan(large)
    assert first.measured_step_time is not None and second.measured_step_time is not None
    assert second.measured_step_time <= first.measured_step_time and second.budget == large
    # the smaller budget's plan, which measured faster, or (NOTE [ Applying a plan ] Rule 9) a candidate measured
    # faster still in turns with it
    assert second.blocks == first.blocks or (second.turns and second.turns[0].step_time <= first.measured_step_time)
    slow.clear()
    third = _Profiled(prof, Link(1e10, 1e10), None, step).plan(large)  # alone: its own plan, faster still
    assert third.measured_step_time is not None and third.measured_step_time <= first.measured_step_time


def test_profiling_leaves_no_tensor_behind() -> None:
    """The op-timing forward of the profile is never differentiated; its pack hook returned each tensor, so every
    saved output held its own grad_fn, a cycle the collector cannot see: a whole step of activations leaked with
    each profile (found on an H100: a Llama's frontier ran out of memory at its third profile)."""
    import gc

    class Tanh(nn.Module):  # tanh saves its output: the identity pack hook made that output hold its grad_fn
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.lin(x).tanh()

    torch.manual_seed(0)
    m = nn.Sequential(*[Tanh() for _ in range(3)])
    x = torch.randn(16, D)
    _grads(m, x)
    gc.collect()
    before = {id(t) for t in gc.get_objects() if isinstance(t, torch.Tensor)}
    profile(m, (x,), {})
    m.zero_grad(set_to_none=True)
    gc.collect()
    new = [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and id(t) not in before
           and not isinstance(t, nn.Parameter)]
    assert not new, [tuple(t.shape) for t in new[:8]]
