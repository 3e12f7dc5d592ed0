"""What the planner's own mechanisms cost, measured on the device and put into the step model (pure Python).

# NOTE [ Mechanism costs ]
# 1. The step model (NOTE [ Step model ]) prices a recomputation as the block's forward run again. The
#    mechanisms add work of their own that depends on the model, not only on its FLOPs: ``Recompute()``'s
#    saved-tensor hooks and frame per tensor, ``Recompute(save=...)``'s dispatch mode, which runs Python for
#    every op of the block in both sweeps (large on models of many small ops: an RMSNorm or rotary embedding
#    written in Python), and the frames that keep a recomputation's tensors alive. So after the profiling step,
#    on the device, the planner measures four of the simple policies (NOTE [ Plan search ] Rule 7): keep
#    everything (plain autograd), every block ``Recompute()``, every block ``Recompute(save=matmuls,
#    attention)`` (where no block has those ops, a CNN's: ``save=`` the op each block's ladder keeps first, so
#    that the dispatch mode is measured on every model: ResNet-152's plans that kept convolutions' outputs
#    measured 216-272 ms on an H100 where the step model, with no such term, said 75-85 ms), every block
#    ``Recompute(store=...)``: each as verification measures a plan (a step, then the median time and largest peak;
#    NOTE [ Applying a plan ] Rule 4), of as many timed steps as last about 0.8 s of the plain step, three to nine
#    (``calibration_steps``): a host-bound model's recomputing steps spread widely (on an H100, ConvNeXt-B's every
#    block ``Recompute()`` took 126-195 ms in eight steps in a row), and with the median of three the same policies
#    measured 6-11% apart while planning and in the zoo's rows a minute before (Mixtral, ViT-L, ConvNeXt-B,
#    ResNet-152; within 1.3% on a Llama of 135 ms steps). Where that is six steps or more, they run in rounds of
#    three (``calibration_rounds``: each policy applied again, a step, then three timed; every policy's first round,
#    then every second), and a policy's time is the median of its rounds' medians: the host's slower spells, which
#    last seconds to minutes, then fall on every policy alike instead of on whichever ran during one, so the
#    policies' differences, which price every mechanism, hold better than their level. A 7B decoder's three steps
#    stay one round (the planner's time). A policy that cannot run (out of memory, no block may be
#    recomputed) is left unmeasured and its terms stay 0. Every block ``Recompute(reentrant=True)`` is measured too, right after
#    every block ``Recompute()``: Rule 13 prices each by its own.
# 2. Keep everything: its measured time less the predicted one goes to the time outside the blocks
#    (``StepCosts.other_bwd_s``, then ``other_fwd_s``, neither below 0; what is still to take off scales every
#    block's forward and backward alike): what the profiling step's timing left in its times is gone from the
#    prediction of every plan alike.
# 3. Every block ``Recompute()``: its measured time less the predicted one (after Rule 2), spread over the
#    blocks in proportion to the tensors each saves (the hooks' work is per tensor), is each block's
#    ``Block.rec_s``, added to every recomputation of it that keeps no op's output (whole or in parts).
#    Its measured peak less the predicted one is ``StepCosts.rec_bytes``, added to what such a recomputed
#    block holds in its backward; solved again while the predicted peak stays in a backward (where it acts).
#    A recomputation in parts (NOTE [ Step model ] Rule 2c) holds another frame, which no measured policy
#    runs: it gets these terms (and Rules 4-5's) only where they add bytes (on an H100, ConvNeXt-B's floor, in
#    parts, peaked 0.29 GiB over its prediction with Rule 3's -0.41 GiB, 0.12 GiB under it without).
# 4. Every block ``Recompute(save=...)``: the same after Rule 3, spread in proportion to each block's
#    keepable ops (the dispatch mode's work is per op), ``Block.keep_rec_s`` and ``StepCosts.keep_rec_bytes``,
#    for recomputations that keep ops' outputs.
# 5. Every block ``Recompute(store=...)`` (its inputs to host, the plans near the floor): the same after
#    Rules 3-4, spread evenly over the blocks that send inputs (the store's work is per block), is
#    ``Block.host_rec_s`` and ``StepCosts.host_rec_bytes``, added for a recomputed block whose inputs (and kept
#    outputs) go to host, on top of Rule 3's or Rule 4's: the store's Python, its GPU cache, copies that share
#    the device with compute. The time is priced in the block's forward, where nothing waits for a copy back
#    (in the backward a stall would absorb it), and not below 0: sending a block's inputs to host does not make
#    its recomputation cheaper, and a policy measured under its prediction with no cost of its own says that
#    something else was mismeasured or mispredicted, not that the blocks got cheaper. (On an H100, ResNet-152's
#    policy measured 184.5 ms, under every block ``Recompute()``'s 198.4 in the same rounds: a host-bound step's
#    spread. A first form took such a negative term off the sending blocks' recomputation so that the policy
#    predicted what it measured; every mixed plan sending some inputs then paid it: on the zoo's ResNet-152 profile
#    of cbe9b15, plans sending 15 and 11 blocks' inputs were predicted 10.3% and 19.2% under what verification
#    measured, with the term at 0 5.1% and 14.9% under; benchmarks/replan.py's calibration, offline.) Where it is
#    above 0 it is solved so that the policy predicts what it measured (Rule 16).
# 6. So the measured policies predict what they measured, and a mixed plan pays each mechanism, per block,
#    what it cost on this model. The measurements are kept: verification (NOTE [ Applying a plan ] Rules 4-7)
#    reuses them instead of running those plans again.
# 7. Not measured yet: compression (verification's race of families, NOTE [ Applying a plan ] Rule 5, measures
#    those plans instead). Offloading a block's own saved tensors is Rule 14's. On the CPU nothing is measured (no
#    verification there either): the costs are the model's alone.
# 8. Revolve over the chain (``checkpoint_chain``, the plans at the floor): runs blocks again without grad to
#    rebuild an input, and a block's forward holds its working tensors while it runs, which the model's states
#    do not count (on an H100 the floors of ViT-L, T5 and ResNet-152 peaked 0.41-0.55 GiB over their
#    predictions, so the lowest budgets were refused at verification). So the planner measures one more simple
#    policy where the search has them: the Revolve plan with the fewest snapshots whose predicted step is
#    within 1.5 times every block ``Recompute()``'s (a floor plan itself can take ten steps' time), and what
#    its peak measured beyond its prediction (after Rules 2-5, whose ``rec_bytes`` a Revolve plan's blocks hold
#    too) is ``StepCosts.revolve_bytes``, held through the backward of every Revolve plan (in its rebuilds and
#    its blocks' backward alike). On T5 Rule 3 alone had taken 0.45 GiB off every Revolve plan's peak, and
#    the floor plan peaked 0.47 GiB over its prediction.
# 9. Every other block ``Recompute()`` (from the first block): a recomputation whose next block was kept starts
#    while that block's backward kernels are queued, so its host work (hooks, Python, launches) runs beside them;
#    Rule 3's cost was measured with every block recomputed, where it does not. (On an H100 the step model over-
#    predicted every other block by 7.6% on ConvNeXt-B and under-predicted it by 5.4% on T5 after Rules 2-5.) So
#    that plan is measured too, and what it costs beyond its prediction after Rules 2-8, spread over the blocks in
#    proportion to the tensors each saves (as Rule 3), is each block's ``Block.alone_s``, added to its
#    recomputation wherever the next block is not recomputed (the last block's, followed by the work after the
#    chain in every plan, stays Rule 3's, so every block ``Recompute()`` still predicts what it measured).
# 10. The floor's plan, the Revolve plan with the fewest snapshots (where it is not Rule 8's), is measured too, for
#    its peak, in few steps (its recomputation is quadratic: 3.3 times a plain step on ViT-L, 4.6 on T5): as many as
#    last about Rule 1's 0.8 s by its predicted step, one to three (``floor_steps``; Rule 11 prices every Revolve
#    plan's rebuilds from its time, and across the zoo's H100 runs the median of seven steps of such a plan measured
#    0.64-1.38 times a single step of it: ViT-L's floor 168.6 ms in one step, 151.4 in its row; a 7B decoder's 2.3 s
#    floor stays one step), never more while they spread (Rule 12's plan likewise). With
#    fewer snapshots the peak fell far less than the model's states say (on an H100, ViT-L's 1-snapshot plan peaked
#    at 1.33 GiB and its 3-snapshot plan at 1.35, where the model calibrated on the 3-snapshot plan said 1.28 for
#    the floor, so a budget of 1.03 times the floor was refused; T5's floor 3.15 against 3.17, said 3.08). What it
#    peaked beyond its prediction is Rule 8's term at its snapshot memory; between the two plans' memories the term
#    is linear in the memory (``StepCosts.revolve_slope``), above Rule 8's plan it stays Rule 8's, so both measured
#    plans predict what they measured and no other plan is extrapolated past what was measured.
# 11. Revolve's rebuilds run blocks again without grad, from Python, once per block an input is rebuilt through:
#    on a model of short kernels that host work is the step (on an H100, ResNet-152's floor plan, 50 blocks under
#    Revolve, measured 1.39 s where its blocks' forward times said 0.93). So what the measured Revolve plan with the
#    fewest snapshots (Rule 10's, else Rule 8's) took beyond its prediction after Rules 2-10, as a fraction of its
#    rebuilds' predicted time, scales every Revolve plan's rebuilds (``StepCosts.revolve_scale``, not below -0.9):
#    the plan with the most rebuilding gives the most signal. Where Rule 8's plan (more snapshots) was measured too,
#    the same fraction from it (after the floor's) holds at and above its memory (``StepCosts.revolve_scale_at``),
#    and between the two plans' memories the fraction is linear in the memory, as Rule 10's bytes are, so both
#    measured plans predict what they measured. One fraction had not fitted both: on an H100, ViT-L's 6-snapshot plan
#    measured 149.5 ms where the fraction from its 1-snapshot plan (396.4 ms, predicted exactly) said 133.9, and the
#    zoo's plan at 1.03 times the floor, with that snapshot memory, measured 163-168 ms in four of six measurements
#    (148-150 in two) where it said 145-149; with both fractions it says 160-168. The extra time is not all in the
#    rebuilds (a 6-snapshot plan rebuilds little), so beyond what was measured no plan is extrapolated: each end's
#    fraction holds past it.
# 12. A recomputation in parts holds a frame no measured policy runs (NOTE [ Step model ] Rule 2c), and what it holds
#    beyond the model differs with the model and either way: on an H100 ConvNeXt-B's floor plans, recomputing stage-0
#    blocks in parts, peaked at 1.99 GiB against 1.89-1.90 predicted (their parts saved nothing), so the budget of
#    1.03 times that floor was refused; the floors of ResNet-152 and ViT-L, in parts, peaked 4.5% and 5.9% under their
#    predictions. So where the search's floor plan (after Rules 2-11) recomputes a block in parts, it is measured too,
#    for its peak, in Rule 10's few steps (``PARTS_FLOOR``), and what it peaked beyond its prediction is
#    ``StepCosts.parts_bytes``, added to what every block recomputed in parts holds in its backward: solved while the
#    predicted peak is in a backward, and lowered only while it lies at a block recomputed in parts (where the term
#    acts), so the measured plan predicts what it measured and no other plan's peak falls without its parts.
# 13. Whole-block recomputation has two mechanisms: ``Recompute()`` (torch's non-reentrant frame,
#    whose saved-tensor hooks run in the forward) and ``Recompute(reentrant=True)`` (the forward without grad in one
#    node of ours: NOTE [ Reentrant recompute ]). What tells them apart is the host's time, which the step model does
#    not price, and it differs with the model (on an H100, every block reentrant measured 1.08-1.24x faster than
#    every block ``Recompute()`` on ConvNeXt-B, T5 and ResNet-152 in recompute_overhead.py's turns, 0.97-1.21x in
#    policy_drift.py's series); and reentrant holds a little more in a block's backward (the recomputed graph whole
#    until its gradients are taken: T5's every block 3.19 GiB against 3.13). So each mechanism is priced by its own
#    measurement: Rule 3's terms come from every block ``Recompute()``, and every block
#    ``Recompute(reentrant=True)``'s the same way give ``Block.reent_s`` and ``StepCosts.reent_bytes`` (its time and
#    peak beyond the prediction after Rules 2-3, by tensors), for ``Decision(reentrant=True)``. Where the reentrant
#    policy measured faster, the chain is ``StepCosts.reentrant``: the policies measured after those two (Rules 4-12)
#    are measured with each whole-block recomputation reentrant (``through_reentrant``), and the search records each
#    plan and its twin so made (NOTE [ Plan search ] Rule 7), so that the faster twin is taken where it fits and the
#    plain one where only it fits (the floor stays at or below every block ``Recompute()``'s peak). A block recomputed
#    keeping ops, in parts, by Revolve, or with its inputs on host keeps its own mechanism (reentrant takes none of
#    those). Where reentrant cannot run (a block reading a tensor that needs grad from outside its arguments raises,
#    or it ran out of memory where ``Recompute()`` did not), it is left unmeasured and no plan uses it
#    (``StepCosts.reentrant_runs``).
# 14. Offloading a block's own saved tensors (``Offload(store, tensors=...)``) runs a saved-tensor hook on every
#    tensor the block saves, in both sweeps, and the store's Python, a GPU-cache eviction and a copy for each tensor
#    it sends: host work a host-bound step pays in full, which the model's copies over the link do not count (on an
#    H100, ResNet-152's plans offloading one tensor in each of 9, 27 and 26 Bottlenecks measured 18, 37 and 36 ms over
#    their predictions, 1.3-2.0 ms a block, with keep everything at 77 ms: the hooks alone 0.7 ms a block, with the
#    store's cache holding everything 0.9; benchmarks/diag_offload.py). So one more policy is measured
#    (``offload_policy``, ``OFFLOAD_ALL``): every block sending its smallest saved tensor through the store
#    ``Plan.apply`` makes, so that next to nothing crosses the link and what the policy took beyond its prediction
#    after Rules 2-13 is the host's work alone. (A first form sent each block's first offload rung, a quarter of its
#    bytes: on the H100 the model's copies of that traffic, 2-3.5 GiB a step, over-predicted its stall on ResNet-152
#    and a Llama, so the term came out below 0 and hid the host's work.) Spread over the blocks in proportion to the
#    tensors each saves (the hooks' work is per tensor), it is each block's ``Block.off_s``, added to the forward of
#    every block that offloads (not below 0); the copies stay the link model's. On the H100 it measured 0.54 ms a
#    block on ResNet-152 (27 ms over the prediction for 50 blocks). The first form's term (12.4 ms over Mixtral's 12
#    blocks) took offloads out of every Mixtral plan, whose offloading plans had measured 11-30% over their
#    predictions in verification before.
# 15. The byte terms (Rules 3-5, 8, 10, 12-13) act in backwards, so each is solved while its plan's predicted peak lies
#    in a backward. A plan predicted to peak in its forward that measured more than 3% over that prediction held the
#    excess in a backward the model under-counts: the term is raised to the least value at which the plan predicts
#    its measured peak (``_raise_to``, by bisection: a term only adds bytes, so the predicted peak does not fall as
#    it grows), and left where no value does (no backward of the plan pays it). On an H100, T5's floor plan (its
#    encoder blocks recomputed in parts, their inputs to host) was predicted 2.73 GiB at the end of its forward and
#    peaked at 3.15 in its backward; Rule 12 left its term at 0, the search's floor stayed 2.73 and the zoo's budget of
#    1.03 times it was refused after two plans peaked at 3.15. Offline on that run's profile the term is 0.48 GiB and
#    the floor 3.13, under every block ``Recompute()``'s measured 3.14. Within 3% the forward's own prediction may be
#    what missed: ConvNeXt-B's floor plan of the same run measured 1.894 GiB against 1.884 predicted at the end of
#    its forward, and raising a backward to meet it would have put the term at 0.14 GiB and its floor 0.1 GiB higher.
# 16. The time terms of Rules 3-5 and 13 are solved so that each policy predicts what it measured (Rule 6): the
#    excess over the prediction without the term where that meets it, else bisected (``_solve_time``). A policy that
#    sends tensors to host needs it: time added to a sending block's forward lets copies that stalled that forward run
#    beside it, so the predicted step rises by less than the time added. On an H100, ResNet-152's every block
#    ``Recompute(store=...)`` measured 317.7 ms; without its term the model said 255.0 with 31.7 ms of stall, and the
#    excess (62.7 ms) spread over the sending blocks' forwards left it at 289.2 (the stall down to 3.2 ms), 9% under
#    what it measured, in every plan sending inputs likewise; solved, the term is 93.1 ms and the policy predicts 317.7
#    (offline on that run's profile; ``benchmarks/replay_trials.py`` showed it). Of the stored profiles' plans only
#    ResNet-152's and ConvNeXt-B's that send inputs to host move (that run's 3.92 GiB plan 172.6 to 173.6 ms).
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torchckpt.planner.costs import KEEP, Block, Decision, StepCosts, chain_states, predict, through_reentrant
from torchckpt.planner.optimize import _whole, search

__all__ = ["EVERY_OTHER", "HOST_ALL", "KEEP_ALL", "KEEP_OPS_ALL", "KEEP_TOP_ALL", "MEASURED", "OFFLOAD_ALL",
           "RECOMPUTE_ALL", "REENTRANT_ALL", "as_measured", "calibrate", "floor_policy", "measure_policies",
           "offload_policy", "reentrant_faster", "revolve_policy"]

KEEP_ALL = "keep everything"
RECOMPUTE_ALL = "every block Recompute()"
KEEP_OPS_ALL = "every block Recompute(save=matmuls, attention)"
KEEP_TOP_ALL = "every block Recompute(save=its costliest op per byte)"  # where no block has a matmul (NOTE [ Plan search ] Rule 7)
HOST_ALL = "every block Recompute(store=...), inputs to host"
REENTRANT_ALL = "every block Recompute(reentrant=True)"  # NOTE [ Mechanism costs ] Rule 13
EVERY_OTHER = "every other block Recompute() ("  # the start of the name of the plan from the first block (NOTE [ Mechanism costs ] Rule 9)
PARTS_FLOOR = "the search's floor plan, in parts"  # NOTE [ Mechanism costs ] Rule 12
OFFLOAD_ALL = "every block Offload(its smallest saved tensor)"  # NOTE [ Mechanism costs ] Rule 14
MEASURED = (KEEP_ALL, RECOMPUTE_ALL, REENTRANT_ALL, KEEP_OPS_ALL, KEEP_TOP_ALL, HOST_ALL)  # NOTE [ Mechanism costs ] Rule 1, in the order it uses them

Measured = tuple[int | None, float]  # (peak bytes or None where not measured, seconds)
_TOLERANCE = 1000  # a peak within 1/1000 of the measured one is solved (NOTE [ Mechanism costs ] Rule 3)
_FORWARD_MISS = 0.03  # NOTE [ Mechanism costs ] Rule 15: a measured peak this far over a forward's predicted one
_TIME_TOL, _BRACKET, _BISECT = 1e-4, 40, 60  # NOTE [ Mechanism costs ] Rule 16: a policy's time solved to 0.01%


def measure_policies(policies: Sequence[tuple[str, tuple[Decision, ...]]],
                     step: Callable[[str, tuple[Decision, ...]], Measured | None],
                     chain: StepCosts | None = None, rounds: int = 1) -> dict[str, Measured]:
    """NOTE [ Mechanism costs ] Rule 1: ``step(name, plan)`` for each of ``MEASURED`` among ``policies`` (the search's
    simple policies), by name, then (given the ``chain`` they are plans of) the Revolve plans of NOTE [ Mechanism costs ]
    Rules 8 and 10, every other block (NOTE [ Mechanism costs ] Rule 9) and ``offload_policy``'s (NOTE [ Mechanism
    costs ] Rule 14, by ``OFFLOAD_ALL``); a policy whose step returns ``None`` (it
    could not run) is left out. The floor's plan (NOTE [ Mechanism costs ] Rule 10) is measured in one to three steps
    (``floor_steps``): the caller knows it by its name, ``floor_policy``'s.

    ``rounds`` > 1: every policy measured that many times, in rounds (each policy once per round, in the order above),
    the two recomputations' rounds (NOTE [ Mechanism costs ] Rule 13) before the others', whose form follows the faster
    of them; each policy's largest peak and the median of its rounds' times. The floor's plan runs once."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"torchckpt: measure_policies(rounds=...) is an int >= 1, got {rounds!r}.")
    by_name = dict(policies)
    names = [name for name in MEASURED if name in by_name]
    revolve = revolve_policy(chain, policies) if chain is not None else None
    floor = floor_policy(chain, policies) if chain is not None and revolve is not None else None
    other = next((name for name in by_name if name.startswith(EVERY_OTHER)), None) if chain is not None else None
    offload = offload_policy(chain) if chain is not None else None
    if offload is not None:  # NOTE [ Mechanism costs ] Rule 14
        by_name[OFFLOAD_ALL] = offload
    order = names + [n for n in (revolve, floor, other, OFFLOAD_ALL if offload is not None else None) if n]
    split = max((order.index(n) + 1 for n in (RECOMPUTE_ALL, REENTRANT_ALL) if n in order), default=0)
    out: dict[str, Measured] = {}
    for group in (order[:split], order[split:]):
        fast = reentrant_faster(out)  # NOTE [ Mechanism costs ] Rule 13: after the two recomputations, never between
        got: dict[str, list[Measured]] = {name: [] for name in group}
        failed: set[str] = set()
        for r in range(rounds):
            for name in group:
                if name in failed or (r and name == floor):
                    continue
                plan = by_name[name]
                if fast and name not in (RECOMPUTE_ALL, REENTRANT_ALL):
                    plan = through_reentrant(plan)
                m = step(name, plan)
                if m is None:
                    failed.add(name)
                else:
                    got[name].append(m)
        for name, ms in got.items():
            if ms and name not in failed:
                peaks = [p for p, _ in ms if p is not None]
                out[name] = (max(peaks) if peaks else None, statistics.median(t for _, t in ms))
    return out


def reentrant_faster(measured: Mapping[str, Measured]) -> bool:
    """NOTE [ Mechanism costs ] Rule 13: every block ``Recompute(reentrant=True)`` measured faster than every block
    ``Recompute()`` (both measured)."""
    return REENTRANT_ALL in measured and RECOMPUTE_ALL in measured and measured[REENTRANT_ALL][1] < measured[RECOMPUTE_ALL][1]


def offload_policy(chain: StepCosts) -> tuple[Decision, ...] | None:
    """NOTE [ Mechanism costs ] Rule 14: every block sending its smallest saved tensor (of a storage it saves; every
    position of that storage, NOTE [ Plan search ] Rule 1), uncompressed; keep where it saves none. ``None`` where no
    block saves one."""
    plan = []
    for b in chain.blocks:
        sizes = [(n, k) for k, n in enumerate(b.saved) if n > 0]
        plan.append(Decision("offload", _whole(b, [min(sizes)[1]])) if sizes else KEEP)
    return tuple(plan) if any(d.mode == "offload" for d in plan) else None


def revolve_policy(chain: StepCosts, policies: Sequence[tuple[str, tuple[Decision, ...]]],
                   lookahead: int = 1) -> str | None:
    """NOTE [ Mechanism costs ] Rule 8: the name of the Revolve plan among ``policies`` with the fewest snapshots whose
    predicted step is within 1.5 times every block ``Recompute()``'s (``None``: none)."""
    by_name = dict(policies)
    if RECOMPUTE_ALL not in by_name:
        return None
    limit = 1.5 * predict(chain, by_name[RECOMPUTE_ALL], lookahead).step_s
    fits = [(p.peak_bytes, name) for name, plan in policies if plan and plan[0].revolve
            for p in (predict(chain, plan, lookahead),) if p.step_s <= limit]
    return min(fits)[1] if fits else None


def floor_policy(chain: StepCosts, policies: Sequence[tuple[str, tuple[Decision, ...]]],
                 lookahead: int = 1) -> str | None:
    """NOTE [ Mechanism costs ] Rule 10: the name of the Revolve plan among ``policies`` with the fewest snapshots
    (the lowest predicted peak), where it is not NOTE [ Mechanism costs ] Rule 8's (``None``: none, or the same)."""
    fits = [(plan[0].revolve, name) for name, plan in policies if plan and plan[0].revolve]
    if not fits:
        return None
    name = min(fits)[1]
    return None if name == revolve_policy(chain, policies, lookahead) else name


def as_measured(policies: Sequence[tuple[str, tuple[Decision, ...]]],
                measured: Mapping[str, Measured]) -> dict[str, tuple[Decision, ...]]:
    """The simple ``policies`` by name as ``measure_policies`` ran them: where the reentrant recomputation measured
    faster, every one after the two recomputations with its whole-block recomputations reentrant (NOTE [ Mechanism
    costs ] Rule 13)."""
    fast = reentrant_faster(measured)
    return {name: through_reentrant(plan) if fast and name not in (RECOMPUTE_ALL, REENTRANT_ALL) else plan
            for name, plan in policies}


def calibrate(chain: StepCosts, policies: Sequence[tuple[str, tuple[Decision, ...]]],
              measured: Mapping[str, Measured], lookahead: int = 1) -> StepCosts:
    """``chain`` with the mechanisms' measured costs (NOTE [ Mechanism costs ] Rules 2-14): ``measured`` holds what
    ``measure_policies`` measured of ``policies`` (``simple_policies(chain)``)."""
    fast = reentrant_faster(measured)
    plans = as_measured(policies, measured)
    runs = REENTRANT_ALL not in plans or REENTRANT_ALL in measured or RECOMPUTE_ALL not in measured
    chain = dataclasses.replace(chain, reentrant=fast, reentrant_runs=runs)
    if KEEP_ALL in measured and KEEP_ALL in plans:  # NOTE [ Mechanism costs ] Rule 2
        chain = _other_time(chain, measured[KEEP_ALL][1] - predict(chain, plans[KEEP_ALL], lookahead).step_s)
    rules = ((RECOMPUTE_ALL, "rec_s", "rec_bytes", _tensors), (REENTRANT_ALL, "reent_s", "reent_bytes", _tensors),
             (KEEP_OPS_ALL, "keep_rec_s", "keep_rec_bytes", _ops), (KEEP_TOP_ALL, "keep_rec_s", "keep_rec_bytes", _ops),
             (HOST_ALL, "host_rec_s", "host_rec_bytes", _one))
    for name, field, bytes_field, weight in rules:  # NOTE [ Mechanism costs ] Rules 3-5 and 13
        if name not in measured or name not in plans:
            continue
        plan = plans[name]
        mine = [i for i, d in enumerate(plan) if d.mode == "recompute" and (
            d.host if field == "host_rec_s" else d.reentrant if field == "reent_s" else
            bool(d.keep) == (field == "keep_rec_s") and not d.reentrant)]
        if not mine:
            continue
        peak, seconds = measured[name]
        w = [weight(chain.blocks[i]) for i in mine]
        chain = _solve_time(chain, plan, seconds, field, dict(zip(mine, w)), lookahead,
                            least=0.0 if field == "host_rec_s" else None)  # NOTE [ Mechanism costs ] Rule 5: not below 0
        if peak is not None:
            chain = _solve_bytes(chain, plan, peak, bytes_field, lookahead)
    revolves = sorted(((plans[name][0].revolve, peak, name) for name, (peak, _) in measured.items()
                       if peak is not None and name in plans and plans[name] and plans[name][0].revolve), reverse=True)
    if revolves:  # NOTE [ Mechanism costs ] Rule 8: the Revolve plan measured (the one with most snapshots)
        at, peak, name = revolves[0]
        chain = dataclasses.replace(_solve_bytes(chain, plans[name], peak, "revolve_bytes", lookahead), revolve_at=at)
    if len(revolves) > 1 and revolves[-1][0] < revolves[0][0]:  # NOTE [ Mechanism costs ] Rule 10: and the floor's
        low, peak, name = revolves[-1]
        there = _solve_bytes(dataclasses.replace(chain, revolve_at=0), plans[name], peak, "revolve_bytes", lookahead)
        chain = dataclasses.replace(chain, revolve_slope=(chain.revolve_bytes - there.revolve_bytes) / (at - low))
    if revolves:  # NOTE [ Mechanism costs ] Rule 11: the rebuilds' time, from the plan with the most of it
        low, _, name = revolves[-1]
        rebuild = sum(chain_states(chain, low).extra_s)
        if rebuild > 0:
            extra = measured[name][1] - predict(chain, plans[name], lookahead).step_s
            chain = dataclasses.replace(chain, revolve_scale=max(-0.9, extra / rebuild), revolve_low=low)
    if len(revolves) > 1 and revolves[-1][0] < revolves[0][0] and chain.revolve_low == revolves[-1][0]:
        at, _, name = revolves[0]  # NOTE [ Mechanism costs ] Rule 11: and from NOTE [ Mechanism costs ] Rule 8's plan
        rebuild = sum(chain_states(chain, at).extra_s)
        if rebuild > 0:
            flat = dataclasses.replace(chain, revolve_scale_at=0.0)
            extra = measured[name][1] - predict(flat, plans[name], lookahead).step_s
            chain = dataclasses.replace(chain, revolve_scale_at=max(-0.9, extra / rebuild))
    other = next((name for name in measured if name.startswith(EVERY_OTHER) and name in plans), None)
    if other is not None:  # NOTE [ Mechanism costs ] Rule 9
        plan = plans[other]
        extra = measured[other][1] - predict(chain, plan, lookahead).step_s
        mine = [i for i, d in enumerate(plan[:-1]) if d.mode == "recompute" and plan[i + 1].mode != "recompute"]
        per = extra / sum(_tensors(chain.blocks[i]) for i in mine) if mine else 0.0
        chain = dataclasses.replace(chain, blocks=tuple(dataclasses.replace(b, alone_s=per * _tensors(b))
                                                        for b in chain.blocks))
    offload = offload_policy(chain) if OFFLOAD_ALL in measured else None
    if offload is not None:  # NOTE [ Mechanism costs ] Rule 14: offloads' host work, per tensor saved
        extra = measured[OFFLOAD_ALL][1] - predict(chain, offload, lookahead).step_s
        per = extra / sum(_tensors(chain.blocks[i]) for i, d in enumerate(offload) if d.mode == "offload")
        chain = dataclasses.replace(chain, blocks=tuple(dataclasses.replace(b, off_s=per * _tensors(b))
                                                        for b in chain.blocks))
    parts = parts_floor(chain) if measured.get(PARTS_FLOOR, (None, 0.0))[0] is not None else None
    if parts is not None:  # NOTE [ Mechanism costs ] Rule 12
        chain = calibrate_parts(chain, parts, int(measured[PARTS_FLOOR][0] or 0), lookahead)
    return chain


def parts_floor(chain: StepCosts) -> tuple[Decision, ...] | None:
    """NOTE [ Mechanism costs ] Rule 12: the search's plan of the lowest predicted peak (of equal peaks, the faster)
    when it recomputes a block in parts, else ``None``."""
    found = search(chain)
    plan = min(found.plans, key=lambda dp: (dp[1].peak_bytes, dp[1].step_s))[0]
    return plan if any(d.parts for d in plan) else None


def _solve_time(chain: StepCosts, plan: tuple[Decision, ...], seconds: float, field: str, weights: dict[int, float],
                lookahead: int, least: float | None = None) -> StepCosts:
    """NOTE [ Mechanism costs ] Rules 3-5 and 13: ``field`` on the blocks of ``weights`` (a total spread in proportion
    to them) at which ``plan`` predicts its measured ``seconds``, not below ``least`` in all where given: the excess
    over the prediction without the term where that meets it (each such term adds its time to the step), else bisected
    (time added to a forward lets copies that stalled it run beside it, so the step rises by less: NOTE [ Mechanism
    costs ] Rule 16)."""
    total = sum(weights.values())

    def at(t: float) -> StepCosts:
        def term(i: int) -> dict[str, Any]:
            return {field: t * weights[i] / total}

        return dataclasses.replace(chain, blocks=tuple(
            dataclasses.replace(b, **term(i)) if i in weights else b for i, b in enumerate(chain.blocks)))

    def miss(t: float) -> float:
        return predict(at(t), plan, lookahead).step_s - seconds

    t = seconds - predict(at(0.0), plan, lookahead).step_s
    if least is not None and t <= least:  # NOTE [ Mechanism costs ] Rule 5: measured under the prediction without it
        return at(t)  # kept as measured, priced at ``least``
    off = miss(t)
    if abs(off) <= seconds * _TIME_TOL:
        return at(t)
    step = abs(off)
    lo, hi = (t, t + step) if off < 0 else (t - step, t)
    if least is not None:
        lo = max(least, lo)
    for _ in range(_BRACKET):  # the prediction does not fall as a term grows: widen until the two sides bracket it
        if off < 0 and miss(hi) < 0:
            lo, hi, step = hi, hi + 2 * step, 2 * step
        elif off > 0 and miss(lo) > 0 and not (least is not None and lo <= least):
            hi, lo, step = lo, lo - 2 * step, 2 * step
            lo = max(least, lo) if least is not None else lo
        else:
            break
    for _ in range(_BISECT):
        if hi - lo <= seconds * _TIME_TOL / 100:
            break
        mid = (lo + hi) / 2
        if miss(mid) < 0:
            lo = mid
        else:
            hi = mid
    return at(hi if miss(hi) <= -miss(lo) else lo)


def calibrate_parts(chain: StepCosts, plan: tuple[Decision, ...], peak: int, lookahead: int = 1) -> StepCosts:
    """NOTE [ Mechanism costs ] Rule 12 on ``chain`` (calibrated by NOTE [ Mechanism costs ] Rules 2-11): the
    ``parts_bytes`` under which ``plan`` (``parts_floor``'s) predicts its measured ``peak``, lowered only while a block
    in parts holds the peak."""
    return _solve_bytes(chain, plan, peak, "parts_bytes", lookahead, lower_at=lambda i: bool(plan[i].parts))


def _other_time(chain: StepCosts, extra: float) -> StepCosts:
    """NOTE [ Mechanism costs ] Rule 2: ``extra`` seconds (keep everything's measured step less its predicted one) on
    the time outside the blocks, backward's then forward's, none below 0; what is still to take off scales every
    block's forward and backward."""
    bwd = max(0.0, chain.other_bwd_s + extra)
    extra -= bwd - chain.other_bwd_s
    fwd = max(0.0, chain.other_fwd_s + extra)
    extra -= fwd - chain.other_fwd_s
    chain = dataclasses.replace(chain, other_fwd_s=fwd, other_bwd_s=bwd)
    inside = sum(b.fwd_s + b.bwd_s for b in chain.blocks)
    if extra < 0 and inside > 0:
        f = max(0.0, 1 + extra / inside)
        chain = dataclasses.replace(chain, blocks=tuple(dataclasses.replace(b, fwd_s=b.fwd_s * f, bwd_s=b.bwd_s * f)
                                                        for b in chain.blocks))
    return chain


def _one(b: Block) -> float:
    return 1.0


def _tensors(b: Block) -> float:
    return float(max(1, len(b.saved)))


def _ops(b: Block) -> float:
    return float(max(1, len(b.ops)))


def _solve_bytes(chain: StepCosts, plan: tuple[Decision, ...], peak: int, field: str, lookahead: int,
                 lower_at: Callable[[int], bool] | None = None) -> StepCosts:
    """NOTE [ Mechanism costs ] Rule 3: the ``field`` (``rec_bytes``, ``keep_rec_bytes``, ...) under which ``plan``
    predicts its measured ``peak``, while the predicted peak lies in a backward (where the term acts); with
    ``lower_at``, lowered only while the backward of a block it accepts holds the peak (NOTE [ Mechanism costs ]
    Rule 12). Where the predicted peak lies in the forward and more than 3% under the measured one, a backward held
    the excess: the least ``field`` that raises a backward to it (``_raise_to``, NOTE [ Mechanism costs ] Rule 15)."""
    for _ in range(4):
        p = predict(chain, plan, lookahead)
        miss = peak - p.peak_bytes
        if abs(miss) <= peak // _TOLERANCE:
            break
        if not p.at.startswith("backward"):
            if miss > peak * _FORWARD_MISS:
                chain = _raise_to(chain, plan, peak, field, lookahead)
            break
        if miss < 0 and lower_at is not None and not lower_at(int(p.at.split()[1])):
            break
        chain = dataclasses.replace(chain, **{field: getattr(chain, field) + miss})
    return chain


def _raise_to(chain: StepCosts, plan: tuple[Decision, ...], peak: int, field: str, lookahead: int) -> StepCosts:
    """NOTE [ Mechanism costs ] Rule 15: the least ``field`` (raised, to within ``peak // _TOLERANCE``) at which
    ``plan``'s predicted peak reaches the measured ``peak``, by bisection (a term adds bytes to backwards, so the
    predicted peak does not fall as it grows); ``chain`` as it was where ``peak`` more bytes do not reach it (no
    backward of ``plan`` pays the term)."""
    base = getattr(chain, field)
    tol = max(1, peak // _TOLERANCE)

    def reaches(more: int) -> bool:
        return predict(dataclasses.replace(chain, **{field: base + more}), plan, lookahead).peak_bytes >= peak - tol

    lo, hi = 0, peak
    if not reaches(hi):
        return chain
    while hi - lo > tol:
        mid = (lo + hi) // 2
        if reaches(mid):
            hi = mid
        else:
            lo = mid
    return dataclasses.replace(chain, **{field: base + hi})
