"""Planning a model: one profile and its search, then each budget's plan verified on the device (``plan``,
``plans``; ``auto`` through them).

NOTE [ Applying a plan ] Rules 4-8 (planner/plan.py, beside what a plan applies) say what verification does; this is
their code: the measured steps, the plans made again over the budget, the race of families, the simple policy
measured beside the plan, and the mechanisms measured once after the profile (NOTE [ Mechanism costs ]).
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from torchckpt._args import found, parse_bytes
from torchckpt._errors import CheckpointError, format_bytes_apart
from torchckpt.codecs.base import Codec
from torchckpt.planner.blocks import find_blocks
from torchckpt.planner.calibrate import (PARTS_FLOOR, calibrate, calibrate_parts, floor_policy, measure_policies,
                                         parts_floor)
from torchckpt.planner.checks import check_args, rejected
from torchckpt.planner.costs import CodecCost, Decision, Link, Prediction, StepCosts, parts_seconds, predict
from torchckpt.planner.measure import measure_codec, measure_link
from torchckpt.planner.optimize import FAMILIES, PlanError, search, simple_policies, size
from torchckpt.planner.plan import BlockPlan, Measurement, Plan
from torchckpt.planner.profiling import Profile, StepRaised, _loss_of, profile, profile_blocks
from torchckpt.planner.ranks import agree, agreed, failing_together, ready, stepping, together
from torchckpt.planner.rebuild import states
from torchckpt.planner.restore import untouched
from torchckpt.planner.trials import Trial
from torchckpt.planner.use_cache import UseCacheOff, warn_mutating

__all__ = ["plan", "plans"]

_REPLANS = 3  # NOTE [ Applying a plan ] Rule 4: plans made again after a measured step over the budget
_SETTLE_S = 30.0  # NOTE [ Applying a plan ] Rule 4: at most this long for a store's host pool to settle
_VERIFY_STEPS = 3  # NOTE [ Applying a plan ] Rule 4: measured steps, after one that builds the store's prefetch plan
_SPREAD, _VERIFY_MOST = 0.10, 9  # NOTE [ Applying a plan ] Rule 4: more steps, up to this many, while they spread over 10%
_CALIBRATE_S = 0.8  # NOTE [ Mechanism costs ] Rule 1: a measured policy's timed steps last about this long of plain steps
_CLOSE, _TIE = 0.03, 0.01  # NOTE [ Applying a plan ] Rule 8: measured steps this close are measured again; then a tie
_RIVAL, _TURNS = 0.30, 3  # NOTE [ Applying a plan ] Rule 9: a rival measured at another time this close runs in turns
_NEAR = 0.05  # NOTE [ Applying a plan ] Rule 10: another shape of plan predicted this close is measured too
_SLACK_DIV, _SLACK_MIN = 100, 2 << 20  # NOTE [ Applying a plan ] Rule 4: a measured peak leaves 1% of the budget, 2 MiB (10% below 20 MiB)


def plan(model: nn.Module, *example_args: Any, budget: int | str, codec: Codec | None = None,
         blocks: Sequence[nn.Module] | None = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
         link: Link | None = None, verify: bool = True, progress: bool = False, **example_kwargs: Any) -> Plan:
    """Profile one step of ``model`` on an example batch and plan its saved tensors under ``budget``.

    The step runs once unmeasured and once measured, as plain autograd (NOTE [ Profiling step ]),
    then once more forward only, to time each op. These steps, and those that verify the plan,
    leave no trace (NOTE [ Planning leaves no trace ]): the parameters' and the batch's ``.grad``
    (``None`` included), the buffers (batch-norm statistics), the CPU and CUDA RNG states and each
    module's training mode are put back, so training after ``plan(...)`` and ``apply`` trains the
    weights it would without torchckpt, bit for bit. Plan a model with no torchckpt policy on its
    blocks: the profile measures what runs. Then the search of NOTE [ Plan search ]
    picks, per block, keep / recompute / offload of chosen tensors (compressed when ``codec`` is
    given), with the fastest predicted step whose predicted peak is at most ``budget``. On CUDA,
    with ``verify``, two steps then run under the plan and the second one's peak is measured; if
    it is over the budget, the plan is made again for the budget less the excess (NOTE [ Applying
    a plan ] Rule 4).

    Args:
        model: the model; its chain of blocks is found (``find_blocks``) unless ``blocks`` is given.
        *example_args / **example_kwargs: a batch of the shape training will use.
        budget: device bytes one step may add to what is allocated when it starts (parameters
            and optimizer state are not counted; gradients allocated during the step are): an
            int or a string such as ``"6GiB"``.
        codec: a ``torchckpt.codecs.Codec`` offloads may use (lossy ones say so in ``explain()``).
        blocks: the blocks to plan, in forward order.
        loss_fn: output -> scalar loss (default: the output's ``.loss``, else the mean square of its tensors).
        link: host link bandwidths (default: measured on the model's device).
        verify: measure a step under the plan and plan again if it is over (CUDA).
        progress: print each phase (profiling, search, each verification) to stderr.

    Returns:
        A ``Plan``; ``plan.apply(model)`` puts it in force.

    Raises:
        PlanError: ``budget`` is below the lowest peak reachable (the message names it), or
            verification found every plan that fits the prediction over the budget.
        TypeError / ValueError: an argument of another kind than expected, checked at the call (the
            message says what to pass), among them a batch that does not fit ``model.forward``'s
            parameters, or one dict of its keyword arguments (pass ``**batch``).
        CheckpointError: the model (or ``loss_fn``) raised in the profiling step; the model's own
            exception is chained (``__cause__``).

    Example::

        >>> import torch, torchckpt
        >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4)])
        >>> p = torchckpt.plan(model, torch.randn(32, 64, requires_grad=True), budget=10**9)
        >>> [b.mode for b in p.blocks]
        ['keep', 'keep', 'keep', 'keep']
    """
    with failing_together(model, "plan", "planning"):  # NOTE [ One plan for all ranks ] Rule 5
        check_args("plan", model, (example_args, example_kwargs), codec, blocks, loss_fn, link, verify, progress)
        nbytes = parse_bytes(budget, "plan(budget=...)")
        with untouched(model, (example_args, example_kwargs)):  # NOTE [ Planning leaves no trace ]
            return _Profiled.prepare(model, example_args, example_kwargs, codec, blocks, loss_fn, link, verify,
                                    progress=progress, call="plan").plan(nbytes)


def plans(model: nn.Module, *example_args: Any, budgets: Sequence[int | str], codec: Codec | None = None,
          blocks: Sequence[nn.Module] | None = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
          link: Link | None = None, verify: bool = True, progress: bool = False,
          **example_kwargs: Any) -> dict[int, Plan]:
    """``plan`` for several budgets from one profiling step: ``{budget in bytes: Plan}``.

    Budgets under the lowest reachable peak, or for which verification found no plan within
    them, are left out (``plan`` raises for them); the arguments are those of ``plan``, checked
    as ``plan`` checks them, and ``budgets`` a non-empty list. As with ``plan``, the model is left
    as it was found: ``.grad``, buffers, RNG states and training modes are put back.

    Example::

        >>> import torch
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> ps = plans(model, torch.randn(32, 64, requires_grad=True), budgets=[1, "1GiB"])
        >>> list(ps)
        [1073741824]
    """
    with failing_together(model, "plans", "planning"):  # NOTE [ One plan for all ranks ] Rule 5
        check_args("plans", model, (example_args, example_kwargs), codec, blocks, loss_fn, link, verify, progress)
        if not isinstance(budgets, (list, tuple)) or not budgets:
            raise TypeError(f"torchckpt: plans(budgets=...) expects a non-empty list of byte counts, got "
                            f"{found(budgets)}; pass e.g. budgets=['2GiB', '4GiB'] (plan(model, ..., budget=...) plans "
                            "one).")
        sizes = [parse_bytes(b, "plans(budgets=...)") for b in budgets]
        out = {}
        with untouched(model, (example_args, example_kwargs)):  # NOTE [ Planning leaves no trace ]
            p = _Profiled.prepare(model, example_args, example_kwargs, codec, blocks, loss_fn, link, verify,
                                 progress=progress, call="plans")
            for b in sizes:
                try:
                    out[b] = p.plan(b)
                except PlanError:  # on every rank alike (NOTE [ One plan for all ranks ] Rule 5)
                    continue
    return out


def _on_tie(best: Plan, other: Plan) -> bool:
    """Whether ``other`` is taken over ``best`` when their measured steps are within ``_TIE`` (NOTE [ Applying a plan ]
    Rules 8-9): a simple policy over a plan of the search, else the faster prediction."""
    if bool(other.simple) != bool(best.simple):
        return bool(other.simple)
    return other.step_time < best.step_time


class _Profiled:
    """One profiling step and its search, planned for any budget."""

    def __init__(self, prof: Profile, link: Link, codec: CodecCost | None,
                 step: Callable[[Plan], tuple[int, float] | None], chain: StepCosts | None = None,
                 memo: dict[tuple[Decision, ...], tuple[int, float]] | None = None) -> None:
        self.prof, self.link, self.codec = prof, link, codec
        self.found = search(chain if chain is not None else prof.chain(link, codec))
        self.memo = memo if memo is not None else {}  # NOTE [ Mechanism costs ] Rule 6: plans measured, kept
        self.verified: list[Plan] = []  # NOTE [ Applying a plan ] Rule 6: the plans returned so far, measured
        self.fresh: set[tuple[Decision, ...]] = set()  # NOTE [ Applying a plan ] Rule 9: measured for this budget
        self.say: Callable[[str], None] = _quiet
        self.measured: dict[str, tuple[int | None, float]] = {}  # NOTE [ Mechanism costs ]: by policy name, as measured
        self.trials: list[Trial] = []  # every plan measured, in order: what an offline study re-predicts

        def timed(p: Plan) -> tuple[int, float] | None:
            """``step``: steps run under ``p``, their largest peak and median time (``None``: not measured), kept."""
            got = step(p)
            if got is not None:
                self.trials.append(Trial("verification", _decisions(p), got[0], got[1]))
            return got

        self._step = timed
        self._ranks: tuple[nn.Module | None, str] = (None, "plan")  # the model and call (NOTE [ One plan for all ranks ])

    @staticmethod
    def prepare(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], codec: Codec | None,
                blocks: Sequence[nn.Module] | None, loss_fn: Callable[[Any], torch.Tensor] | None,
                link: Link | None, verify: bool = True, by_blocks: bool = False, progress: bool = False,
                call: str = "plan") -> _Profiled:
        """Profile ``model`` and search; ``call`` (``plan``, ``plans``, ``auto``, which checked the arguments) names
        the entry point in errors."""
        with failing_together(model, call, "profiling"):  # NOTE [ One plan for all ranks ] Rule 5
            planned = _Profiled._prepare(model, args, kwargs, codec, blocks, loss_fn, link, verify, by_blocks, progress,
                                         call)
        planned._ranks = (model, call)
        return planned

    @staticmethod
    def _prepare(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], codec: Codec | None,
                 blocks: Sequence[nn.Module] | None, loss_fn: Callable[[Any], torch.Tensor] | None,
                 link: Link | None, verify: bool, by_blocks: bool, progress: bool, call: str) -> _Profiled:
        named = None
        if blocks is not None:
            names = {id(m): n for n, m in model.named_modules()}
            named = [(names[id(b)], b) for b in blocks]
        chain_mods = named if named is not None else find_blocks(model)
        sample: list[torch.Tensor] = []
        say = _say if progress else _quiet
        say(f"profiling one step of {type(model).__name__}: {len(chain_mods)} blocks "
            f"({chain_mods[0][0]} ... {chain_mods[-1][0]})")
        t0 = time.perf_counter()
        how = profile_blocks if by_blocks else profile  # by_blocks: as if the plain step did not fit (tests)
        off = UseCacheOff(model, [m for _, m in chain_mods])  # NOTE [ Mutating forwards ] Rule 6
        try:
            with stepping(model, call, "the profiling step (plain autograd, every saved tensor kept)", _NO_FIT):
                try:  # NOTE [ One plan for all ranks ] Rules 6-7
                    prof = how(model, args, kwargs, blocks=chain_mods, loss_fn=loss_fn,
                               keep_sample=sample if codec is not None else None)
                except StepRaised as e:  # NOTE [ Profiling step ] Rule 8
                    raise rejected(call, model, args, kwargs, e) from e.error
        finally:
            off.remove()
        warn_mutating(prof.names, prof.mutates)  # NOTE [ Mutating forwards ] Rule 5
        say(f"profiled in {time.perf_counter() - t0:.1f} s: step {prof.step_s * 1e3:.1f} ms, peak {size(prof.peak_none)}"
            + (" (every block recomputed: the plain step did not fit)" if prof.by_blocks else ""))
        if link is None:
            ready(model, call)  # NOTE [ One plan for all ranks ] Rule 9: every rank measures the link at once
        ln = link if link is not None else measure_link(torch.device(prof.device))
        ccost = measure_codec(codec, sample[0]) if codec is not None and sample else None
        prof, ln, ccost = agree(model, call, prof, ln, ccost)  # NOTE [ One plan for all ranks ] Rule 2
        say(f"host link {ln.d2h / 1e9:.1f} GB/s to host, {ln.h2d / 1e9:.1f} GB/s back"
            + (" (given)" if link is not None else " (measured)"))  # NOTE [ Tier bandwidths ] Rule 4
        loss_of = loss_fn if loss_fn is not None else _loss_of
        measuring = verify and torch.device(prof.device).type == "cuda"

        reps = [_VERIFY_STEPS]  # NOTE [ Mechanism costs ] Rule 10: fewer for the floor's plan (``floor_steps``)
        extend = [True]  # NOTE [ Applying a plan ] Rule 4's more steps; not in NOTE [ Mechanism costs ] Rule 1's rounds
        alone = not together(model)  # NOTE [ Applying a plan ] Rule 4: ranks planning together run as many steps

        @agreed(model, call)  # NOTE [ One plan for all ranks ] Rules 4 and 6
        def step(p: Plan) -> tuple[int, float] | None:
            if not measuring:
                return None
            torch.cuda.empty_cache()  # NOTE [ Applying a plan ] Rule 4: from the allocator state a training run starts in
            a = p.apply(model, codec=codec)
            try:
                model.zero_grad(set_to_none=True)  # NOTE [ Profiling step ] Rule 4
                out = model(*args, **kwargs)
                loss_of(out).backward()
                del out
                if a.store is not None:  # NOTE [ Applying a plan ] Rule 4: no registration of its host pool in the timed steps
                    a.store.host.settle(timeout=_SETTLE_S)

                def one() -> tuple[int, float]:
                    model.zero_grad(set_to_none=True)  # NOTE [ Profiling step ] Rule 4
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    start = torch.cuda.memory_allocated()
                    t0 = time.perf_counter()
                    out = model(*args, **kwargs)  # held through backward, as in the profiling step
                    loss_of(out).backward()
                    del out
                    torch.cuda.synchronize()
                    return int(torch.cuda.max_memory_allocated() - start), time.perf_counter() - t0

                return measured_steps(one, reps[0], alone and extend[0])
            except CheckpointError:
                if not any(b.reentrant for b in p.blocks):
                    raise
                model.zero_grad(set_to_none=True)
                return None  # NOTE [ Mechanism costs ] Rule 13: reentrant cannot run this model's blocks: unmeasured
            finally:
                a.remove()

        chain = prof.chain(ln, ccost)
        memo: dict[tuple[Decision, ...], tuple[int, float]] = {}
        measured: dict[str, tuple[int | None, float]] = {}
        forms: dict[str, tuple[Decision, ...]] = {}  # each measured policy's plan, by name
        if measuring:  # NOTE [ Mechanism costs ]: the mechanisms' own costs, measured
            policies = simple_policies(chain)
            keep_all = predict(chain, policies[0][1])
            floor = floor_policy(chain, policies)
            rounds = calibration_rounds(prof.step_s)

            def policy_step(name: str, decisions: tuple[Decision, ...]) -> tuple[int, float] | None:
                if prof.by_blocks and not any(d.mode == "recompute" for d in decisions):
                    return None  # NOTE [ Profiling step ] Rule 6: keeping everything does not fit
                t1 = time.perf_counter()
                # NOTE [ Mechanism costs ] Rules 10 and 12: one to three steps for these (their time grows quadratically)
                at_floor = name in (floor, PARTS_FLOOR)
                pred = predict(chain, decisions)
                reps[0] = floor_steps(pred.step_s) if at_floor else calibration_steps(prof.step_s) // rounds
                extend[0] = rounds == 1 and not at_floor
                try:
                    got = step(_make(prof, decisions, pred, 0, keep_all, 0, ln, ccost))
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    return None
                finally:
                    reps[0], extend[0] = _VERIFY_STEPS, True
                if got is not None:
                    memo[decisions] = got
                    forms[name] = decisions
                    say(f"measured {name}: {size(got[0])}, {got[1] * 1e3:.1f} ms ({time.perf_counter() - t1:.1f} s)")
                return got

            measured = measure_policies(policies, policy_step, chain, rounds)
            if rounds > 1:  # NOTE [ Mechanism costs ] Rule 1: each policy's rounds, as verification reuses them
                for name, (peak, seconds) in measured.items():
                    if peak is not None:
                        memo[forms[name]] = (peak, seconds)
                say(f"measured in {rounds} rounds: " + ", ".join(
                    f"{n} {t * 1e3:.1f} ms" for n, (_, t) in measured.items() if n != floor))
            chain = calibrate(chain, policies, measured)
            parts = parts_floor(chain)  # NOTE [ Mechanism costs ] Rule 12: the search's floor, in parts, measured
            got = policy_step(PARTS_FLOOR, parts) if parts is not None else None
            if parts is not None and got is not None:
                measured[PARTS_FLOOR] = got
                chain = calibrate_parts(chain, parts, got[0])
        planned = _Profiled(prof, ln, ccost, step, chain, memo)
        planned.measured = measured
        planned.trials = [Trial(name, forms[name], peak, seconds) for name, (peak, seconds) in measured.items()
                          if peak is not None and name in forms]
        planned.say = say
        say(f"searched {len(planned.found.plans)} plans; lowest predicted peak {size(planned.found.floor)}")
        return planned

    def plan(self, budget: int) -> Plan:
        """The plan for ``budget``, verified, the fastest measured of the families' best and the best simple policy
        (NOTE [ Applying a plan ] Rules 4-7)."""
        model, call = self._ranks  # NOTE [ One plan for all ranks ] Rule 5
        with failing_together(model, call, f"planning for a budget of {size(budget)}"):
            return self._plan(budget)

    def _plan(self, budget: int) -> Plan:
        self.fresh = set()
        try:
            best, tried = self._verified(budget, "all")
        except PlanError:  # NOTE [ Applying a plan ] Rule 4: a simple policy measured within the budget, if any
            simple = self._measured_simple(budget)
            if simple is None:
                raise
            peak, seconds = simple.measured_peak_bytes or 0, simple.measured_step_time or 0.0
            self.say(f"budget {size(budget)}: no plan of the search fits when measured; {simple.simple} measured "
                     f"{size(peak)}, {seconds * 1e3:.1f} ms: took it")
            best, tried = simple, {}
        if best.measured_step_time is None:
            return best
        times = [f"all {best.measured_step_time * 1e3:.1f} ms"]
        for family in FAMILIES[1:]:
            try:
                if self.found.best(budget, family)[0] in tried:
                    continue
                p, more = self._verified(budget, family)
            except PlanError:
                continue
            tried |= more
            assert p.measured_step_time is not None and best.measured_step_time is not None
            times.append(f"{family} {p.measured_step_time * 1e3:.1f} ms")
            if p.measured_step_time < best.measured_step_time:
                best = p
        if len(times) > 1:
            self.say(f"budget {size(budget)}: measured the best plan of each family: {', '.join(times)}")
        best = self._or_simple(budget, best, tried)  # NOTE [ Applying a plan ] Rule 7, before NOTE [ Applying a plan ] Rule 6
        limit = budget - _slack(budget)
        for p in self.verified:  # NOTE [ Applying a plan ] Rule 6: a plan verified for a smaller budget that fits this one and measured faster
            assert p.measured_peak_bytes is not None and p.measured_step_time is not None
            assert best.measured_step_time is not None
            if p.measured_peak_bytes <= limit and p.measured_step_time < best.measured_step_time:
                best = self._faster(budget, best, p)
        other = self._contender(budget, best)  # NOTE [ Applying a plan ] Rule 10
        if other is not None:
            best = self._race(budget, best, other)
        best = self._turns(budget, best)  # NOTE [ Applying a plan ] Rule 9
        self.verified.append(best)
        return best

    def _contender(self, budget: int, best: Plan) -> tuple[Decision, ...] | None:
        """NOTE [ Applying a plan ] Rule 10: the search's fastest plan within ``budget``, predicted within ``_NEAR`` of
        ``best``'s prediction, whose blocks' modes differ from ``best``'s in a quarter of them (two at least), measured
        for this budget unless it was before (none where ``best`` keeps every block); returned where it measured within
        the budget less the slack and faster than ``best`` by more than ``_TIE``, else ``None``."""
        mine, ours = _decisions(best), best.measured_step_time
        assert ours is not None
        n = len(mine)
        if all(d.mode == "keep" for d in mine):
            return None
        found = [(p.step_s, k, d) for k, (d, p) in enumerate(self.found.plans)
                 if p.peak_bytes <= budget and p.step_s <= best.step_time * (1 + _NEAR) and d not in self.memo
                 and sum(a.mode != b.mode for a, b in zip(d, mine)) >= max(2, n // 4)]
        if not found:
            return None
        d = min(found)[2]
        got = self.step(self._candidate(d, predict(self.found.chain, d), budget), d)
        if got is None or got[0] > budget - _slack(budget) or got[1] >= ours * (1 - _TIE):
            return None
        return d

    def _candidate(self, decisions: tuple[Decision, ...], pred: Prediction, budget: int) -> Plan:
        """The plan of the search's ``decisions`` (predicted ``pred``) for ``budget``, named if it is a simple policy."""
        return dataclasses.replace(_make(self.prof, decisions, pred, self.found.floor, self.found.plans[0][1], budget,
                                         self.link, self.codec), simple=self.found.simple_name(decisions))

    def _timed(self, p: Plan) -> tuple[int, float] | None:
        """``p`` measured now (NOTE [ Applying a plan ] Rule 4), marked as measured for this budget
        (NOTE [ Applying a plan ] Rule 9)."""
        got = self._step(p)
        self.fresh.add(_decisions(p))
        return got

    def _turns(self, budget: int, best: Plan) -> Plan:
        """NOTE [ Applying a plan ] Rule 9: ``best`` (measured) and the fastest other measured candidate within the
        budget, where the two figures were not both measured for this budget and are within ``_RIVAL``, measured in
        ``_TURNS`` turns each (``best`` first); the faster median is returned, within ``_TIE`` the faster prediction."""
        ours = best.measured_step_time
        assert ours is not None
        mine, limit = _decisions(best), budget - _slack(budget)
        rivals = sorted((seconds, k, d) for k, (d, (peak, seconds)) in enumerate(self.memo.items())
                        if d != mine and peak <= limit and seconds <= ours * (1 + _RIVAL)
                        and not (d in self.fresh and mine in self.fresh))
        if not rivals:
            return best
        return self._race(budget, best, rivals[0][2])

    def _race(self, budget: int, best: Plan, d: tuple[Decision, ...]) -> Plan:
        """``best`` (measured) and the plan of ``d`` (measured), in ``_TURNS`` turns each (``best`` first); the faster
        median is returned, within ``_TIE`` as NOTE [ Applying a plan ] Rule 8 decides (NOTE [ Applying a plan ]
        Rules 9-10)."""
        mine, limit = _decisions(best), budget - _slack(budget)
        name = self.found.simple_name(d)
        rival = self._candidate(d, predict(self.found.chain, d), budget)
        runs: tuple[list[tuple[int, float]], list[tuple[int, float]]] = ([], [])
        for _ in range(_TURNS):
            for p, got in zip((best, rival), runs):
                m = self._step(p)
                if m is None:
                    return best
                got.append(m)
        (pa, ta), (pb, tb) = ((max(x[0] for x in r), sorted(x[1] for x in r)[len(r) // 2]) for r in runs)
        self.memo[mine] = (max(pa, self.memo.get(mine, (0, 0.0))[0]), ta)
        self.memo[d] = (max(pb, self.memo.get(d, (0, 0.0))[0]), tb)
        self.fresh.update((mine, d))  # both measured for this budget now (NOTE [ Applying a plan ] Rule 9)
        fits = pb <= limit
        tie = abs(ta - tb) <= min(ta, tb) * _TIE
        took = fits and (_on_tie(best, rival) if tie else tb < ta)
        what = best.simple or "plan"
        other = name or "another plan of the search"
        self.say(f"budget {size(budget)}: in {_TURNS} turns each, {what} measured {ta * 1e3:.1f} ms and {other} "
                 f"{tb * 1e3:.1f} ms{'' if fits else f' at {size(pb)}, over the budget'}: "
                 + (f"took {other}" if took else f"kept {what}"))
        ma, mb = Measurement(what, ta, pa, pa <= limit), Measurement(other, tb, pb, fits)
        if took:
            return dataclasses.replace(rival, measured_peak_bytes=pb, measured_step_time=tb, turns=(mb, ma))
        return dataclasses.replace(best, measured_step_time=ta, turns=(ma, mb))

    def _faster(self, budget: int, best: Plan, p: Plan) -> Plan:
        """NOTE [ Applying a plan ] Rule 6: ``best`` (this budget's, measured) or ``p`` (verified for another budget,
        measured faster, its peak within this one's), whichever measures faster; figures within 3% of each other run
        in turns (``_race``), and within 1% there are decided as NOTE [ Applying a plan ] Rule 8 decides."""
        ours, theirs = best.measured_step_time, p.measured_step_time
        assert ours is not None and theirs is not None
        asked, other = format_bytes_apart(budget, p.budget)
        close = ours - theirs <= theirs * _CLOSE and p.blocks != best.blocks
        self.say(f"budget {asked}: the plan verified for {other} fits and measured "
                 f"{theirs * 1e3:.1f} against {ours * 1e3:.1f} ms: " + ("the two in turns" if close else "took it"))
        if close:
            return self._race(budget, best, _decisions(p))
        return dataclasses.replace(p, budget=budget, measured_step_time=theirs)

    def step(self, p: Plan, decisions: tuple[Decision, ...]) -> tuple[int, float] | None:
        """``p`` (whose decisions are ``decisions``) measured, or what measuring it gave before (NOTE [ Mechanism costs ]
        Rule 5)."""
        if decisions not in self.memo:
            got = self._step(p)
            self.fresh.add(decisions)
            if got is None:
                return None
            self.memo[decisions] = got
        return self.memo[decisions]

    def _or_simple(self, budget: int, best: Plan,
                   tried: dict[tuple[Decision, ...], tuple[int, float] | None]) -> Plan:
        """NOTE [ Applying a plan ] Rule 7: ``best`` (measured) or the best simple policy that fits ``budget``, whichever
        measures faster (equal: the simple one), with what was measured; ``tried``: what this budget measured so far."""
        assert best.measured_step_time is not None and best.measured_peak_bytes is not None
        mine = Measurement("plan", best.measured_step_time, best.measured_peak_bytes)
        found = self.found.best_simple(budget, self.memo, budget - _slack(budget))
        if found is None or found[0] == best.simple:
            return dataclasses.replace(best, measurements=(mine,))
        name, decisions, pred = found
        p = self._candidate(decisions, pred, budget)
        got = tried[decisions] if decisions in tried else self.step(p, decisions)  # at most one more verification
        if got is None:
            return dataclasses.replace(best, measurements=(mine,))
        peak, seconds = got
        theirs = Measurement(name, seconds, peak, peak <= budget - _slack(budget))
        ours = best.measured_step_time
        took = theirs.fits and seconds <= ours
        if theirs.fits and abs(seconds - ours) <= min(seconds, ours) * _CLOSE:  # NOTE [ Applying a plan ] Rule 8
            a, b = self._timed(best), self._timed(p)
            if a is not None and b is not None:
                ours, seconds = (ours + a[1]) / 2, (seconds + b[1]) / 2
                best = dataclasses.replace(best, measured_step_time=ours)
                mine, theirs = dataclasses.replace(mine, step_time=ours), dataclasses.replace(theirs, step_time=seconds)
                tie = abs(seconds - ours) <= min(seconds, ours) * _TIE
                took = _on_tie(best, p) if tie else seconds < ours
        self.say(f"budget {size(budget)}: measured the plan {ours * 1e3:.1f} ms and {name} "
                 f"{seconds * 1e3:.1f} ms{'' if theirs.fits else f' at {size(peak)}, over the budget'}: "
                 + (f"took {name}" if took else "kept the plan"))
        if took:
            best = dataclasses.replace(p, measured_peak_bytes=peak, measured_step_time=seconds)
        return dataclasses.replace(best, measurements=(mine, theirs))

    def _measured_simple(self, budget: int) -> Plan | None:
        """NOTE [ Applying a plan ] Rule 4: the fastest simple policy measured while planning whose measured peak is
        within ``budget`` less the slack, as a measured plan, or ``None``."""
        found = self.found.best_simple(budget, self.memo, budget - _slack(budget), only_measured=True)
        if found is None:
            return None
        name, decisions, pred = found
        peak, seconds = self.memo[decisions]
        return dataclasses.replace(self._candidate(decisions, pred, budget), measured_peak_bytes=peak,
                                   measured_step_time=seconds)

    def _verified(self, budget: int, family: str) -> tuple[Plan, dict[tuple[Decision, ...], tuple[int, float] | None]]:
        """The fastest plan of ``family`` whose measured peak is within ``budget`` (NOTE [ Applying a plan ] Rule 4),
        and the plans tried, with what each measured."""
        target = budget
        measured: int | None = None
        tried: dict[tuple[Decision, ...], tuple[int, float] | None] = {}
        for _ in range(_REPLANS + 1):
            decisions, pred = self.found.best(target, family)
            p = self._candidate(decisions, pred, budget)
            got = tried[decisions] = self.step(p, decisions)
            if got is None:
                return p, tried
            measured, seconds = got
            asked, predicted, peaked = format_bytes_apart(budget, pred.peak_bytes, measured)
            self.say(f"budget {asked} ({family}): predicted {predicted}, {pred.step_s * 1e3:.1f} ms; "
                     f"measured {peaked}, {seconds * 1e3:.1f} ms")
            p = dataclasses.replace(p, measured_peak_bytes=measured, measured_step_time=seconds)
            limit = budget - _slack(budget)
            if measured <= limit:
                return p, tried
            target = min(target, pred.peak_bytes) - (measured - limit) - (measured - limit) // 16 - 1
            if target < self.found.floor:
                if pred.peak_bytes <= self.found.floor:
                    break
                target = self.found.floor  # NOTE [ Applying a plan ] Rule 4: the floor's plan, once, before refusing
        assert measured is not None
        asked, predicted, peaked, floor = format_bytes_apart(budget, pred.peak_bytes, measured, self.found.floor)
        raise PlanError(
            f"torchckpt: no plan fits a budget of {asked} when measured: the last one predicted "
            f"{predicted} and peaked at {peaked}; the lowest predicted peak is "
            f"{floor}. Pass a larger budget (e.g. budget={measured})."
        )


_NO_FIT = ("when the ranks plan together this step must fit on every rank: a rank alone cannot profile block by block "
           "(NOTE [ One plan for all ranks ] Rule 7). Free device memory for planning (plan before the optimizer's "
           "state is allocated), or plan the model before it is wrapped in DDP or fully_shard, on one process with the "
           "per-rank batch (alone, a step that does not fit is profiled block by block), save the plan "
           "(plan.save('plan.json')) and apply it on every rank (Plan.load('plan.json').apply(model))")


def measured_steps(one: Callable[[], tuple[int, float]], reps: int, alone: bool = True) -> tuple[int, float]:
    """NOTE [ Applying a plan ] Rule 4: ``one()`` (a measured step: its peak bytes and seconds) ``reps`` times, then again
    while ``more_steps`` says so (``alone``: not for ranks planning together); the largest peak and the median time."""
    peaks: list[int] = []
    times: list[float] = []
    while len(times) < reps or (alone and more_steps(times, reps)):
        peak, seconds = one()
        peaks.append(peak)
        times.append(seconds)
    return max(peaks), sorted(times)[len(times) // 2]


def calibration_steps(step_s: float) -> int:
    """NOTE [ Mechanism costs ] Rule 1: the timed steps of a measured policy, for a model whose plain step takes
    ``step_s``: as many as last about ``_CALIBRATE_S`` of plain steps, from ``_VERIFY_STEPS`` to ``_VERIFY_MOST``.

    Example::

        >>> calibration_steps(0.395), calibration_steps(0.135), calibration_steps(0.079)
        (3, 6, 9)
    """
    return max(_VERIFY_STEPS, min(_VERIFY_MOST, math.ceil(_CALIBRATE_S / max(step_s, 1e-9))))


def floor_steps(step_s: float) -> int:
    """NOTE [ Mechanism costs ] Rules 10 and 12: the timed steps of the floor's plan, predicted to take ``step_s``: as
    many as last about ``_CALIBRATE_S``, from 1 to ``_VERIFY_STEPS``.

    Example::

        >>> floor_steps(2.3), floor_steps(0.37), floor_steps(0.17)
        (1, 2, 3)
    """
    return max(1, min(_VERIFY_STEPS, int(_CALIBRATE_S / max(step_s, 1e-9))))


def calibration_rounds(step_s: float) -> int:
    """NOTE [ Mechanism costs ] Rule 1: the rounds a measured policy's ``calibration_steps`` run in, ``_VERIFY_STEPS``
    timed steps each.

    Example::

        >>> calibration_rounds(0.395), calibration_rounds(0.135), calibration_rounds(0.079)
        (1, 2, 3)
    """
    return max(1, calibration_steps(step_s) // _VERIFY_STEPS)


def more_steps(times: Sequence[float], reps: int) -> bool:
    """NOTE [ Applying a plan ] Rule 4: whether a plan measured ``reps`` steps or more, whose ``times`` so far spread over
    ``_SPREAD`` (largest over smallest, less 1), runs another step: up to ``_VERIFY_MOST``, and never where one step was
    asked for (a plan measured for its peak alone).

    Example::

        >>> more_steps([0.130, 0.195, 0.127], 3), more_steps([0.081, 0.082, 0.081], 3), more_steps([0.1] * 8 + [0.2], 3)
        (True, False, False)
    """
    return 1 < reps <= len(times) < _VERIFY_MOST and max(times) > min(times) * (1.0 + _SPREAD)


def _slack(budget: int) -> int:
    """NOTE [ Applying a plan ] Rule 4's slack: 1% of the budget, at least 2 MiB (10% of budgets under 20 MiB)."""
    return max(budget // _SLACK_DIV, min(_SLACK_MIN, budget // 10))


def _make(prof: Profile, decisions: Sequence[Decision], pred: Prediction, floor: int, none: Prediction, budget: int,
          link: Link, codec: Any) -> Plan:
    chain_blocks = prof.blocks() if any(d.parts for d in decisions) else []
    again = states(prof.fwd_s, prof.input_bytes, decisions[0].revolve).extra_s if decisions and decisions[0].revolve \
        else [0.0] * len(decisions)
    blocks = tuple(BlockPlan(prof.names[i], d.mode, d.offload, d.compress, d.host, d.keep, prof.saved[i],
                             prof.input_bytes[i], prof.fwd_s[i], prof.bwd_s[i],
                             keep_bytes=sum(o.nbytes for o in prof.ops[i] if o.position in set(d.keep)),
                             keep_names=tuple(o.op for o in prof.ops[i] if o.position in set(d.keep)),
                             keep_s=sum(o.seconds for o in prof.ops[i] if o.position in set(d.keep)),
                             parts=d.parts, parts_s=parts_seconds(chain_blocks[i], d) if d.parts else 0.0,
                             revolve=d.revolve, revolve_s=again[i], reentrant=d.reentrant)
                   for i, d in enumerate(decisions))
    return Plan(budget=budget, blocks=blocks, peak_bytes=pred.peak_bytes, step_time=pred.step_s,
                none_peak_bytes=none.peak_bytes, none_step_time=none.step_s, floor_bytes=floor,
                none_measured=not prof.by_blocks,
                codec=codec.name if codec is not None else None,
                lossy=bool(codec is not None and codec.lossy and any(d.compress for d in decisions)),
                bound=codec.bound if codec is not None else "", link=(link.d2h, link.h2d), device=prof.device)


def _decisions(p: Plan) -> tuple[Decision, ...]:
    """The search's decisions ``p`` was made from (``_make``'s inverse), the key of ``_Profiled.memo``."""
    return tuple(Decision(b.mode, b.offload, b.compress, b.host, b.keep_ops, b.parts, b.revolve, b.reentrant)
                 for b in p.blocks)


def _say(msg: str) -> None:
    print(f"torchckpt: {msg}", file=sys.stderr, flush=True)


def _quiet(msg: str) -> None:
    pass
