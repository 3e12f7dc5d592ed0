"""Choosing a decision per block under a byte budget (pure Python, on the model of NOTE [ Step model ]).

# NOTE [ Plan search ]
# 1. Each block has a ladder of options, ordered by the bytes they leave on the device (then by
#    the bytes its backward holds, ``rung_key``): keep;
#    offload its largest saved tensors, more of them on each rung (compressed too, with a codec);
#    recompute keeping the ops that save the most time per byte (NOTE [ Selective recompute ]),
#    on the device or on the host (copied out and back as an offload is, compressed too with a
#    codec); recompute; recompute with its inputs on the host; recompute in two parts
#    (NOTE [ Step model ] Rule 2c), inputs on the device or on the host (not with kept outputs on
#    the host: on an H200 such a plan found none of them prefetched, 131 ms of exposed copies a
#    step where the model predicted none). Every option is simulated with the
#    whole chain (``predict``), so the link's contention and the position of the block
#    (offloading the last blocks cannot be hidden) are priced, not assumed. An offload rung takes every
#    position of a storage it sends (``Block.same``): a storage another position still references stays on
#    the device, so sending one of its views frees nothing (on an H100 the zoo's Mixtral plans that sent
#    each block's largest saved tensor, one half of the experts' gate-and-up output whose other half the
#    block saved too, peaked 0.4-1.2 GiB over their predictions).
# 2. The search walks from "keep everything" down: at each step it takes the one move (one block
#    to a lower rung) that lowers the predicted peak for the least added time per byte saved,
#    until no move lowers it, then (a plateau: the peak sits at one block's backward and moves to the
#    next one's when that block moves) the one option taken by every block whose ladder has it, if
#    that lowers the peak, and on from there. Moves are ranked by the peak without the store's GPU cache (whose
#    size follows the largest block's offload, so one offload alone seldom lowers the full peak);
#    every plan on the path is recorded with its full prediction, cache included. The walk runs
#    once per cap on the bytes one block may send to host (none, a block's inputs, a quarter,
#    half and all of the largest block's saved bytes), since the cache a plan needs grows with that cap:
#    small caps reach low peaks, large ones fast plans. All walks' plans are recorded; the lowest
#    of their peaks is the floor this search reaches.
# 3. For a budget, the answer is the fastest recorded plan whose predicted peak is at most the
#    budget (among equally fast ones, the one moving the fewest bytes over the link). So a plan over the budget is never returned, and a larger budget, which admits every
#    plan a smaller one admits, never gets a slower plan (time is non-increasing in the budget).
# 4. A budget under the floor raises ``PlanError`` naming the floor.
# 5. ``best(budget, family)`` answers within a family of plans (``FAMILIES``: any; no compression;
#    nothing over the host link), for the race of NOTE [ Applying a plan ] Rule 5.
# 6. Revolve over the chain (NOTE [ Revolve over the chain ] in rebuild.py) is a plan of its own, not a rung:
#    every block recomputed (whole, or in parts where every block's ladder has them) with each amount of
#    snapshot memory from one input to all but two (eight amounts for inputs of unequal size), each recorded with its prediction beside the walks'
#    plans. It can reach below the floor of keeping every block's input where nothing may cross the host link,
#    and Rule 3 picks it only where it is the fastest plan that fits. Only where the blocks form a chain, each
#    called with the previous one's first output, unchanged (``Block.chained``, as the profiling step saw them):
#    elsewhere ``checkpoint_chain`` keeps every input from the first break on (NOTE [ Chain of blocks ] Rule 5),
#    and a plan priced as Revolve ran as every block ``Recompute()`` (on an H100, T5's encoder-to-decoder and
#    ConvNeXt's downsampling between stages broke the chain: their floors were Revolve plans that measured 2-5%
#    over their predicted peaks and 50-73% under their predicted steps).
# 7. The policies a user writes in one line are plans of the search too (``simple_policies``), each recorded
#    with its prediction as any other plan is, so Rule 3 may pick one and the floor is at or below each one's
#    predicted peak: keep everything; ``Recompute()`` on every block, and ``Recompute(reentrant=True)`` on every
#    block (unless measured and unable to run; each priced by its own measurement, NOTE [ Mechanism costs ] Rule 13;
#    where reentrant measured faster, each plan and each policy gets a twin with its whole-block recomputations
#    reentrant, named so); ``Recompute(save=...)`` on every block,
#    keeping its matmuls' and attention's outputs (``Block.sac``: the ops torch SAC users save), or where no
#    block has such ops (a CNN) the output of the op its ladder keeps first (Rule 1's most time per byte: a
#    convolution's); ``Recompute()``
#    on every other block, from the first and from the second; Revolve over the chain (``checkpoint_chain``)
#    of whole blocks with each amount of Rule 6. A policy that would recompute a block that may not be
#    (NOTE [ Profiling step ] Rule 7) is left out, and so is ``Recompute(save=...)`` where no block has an op
#    to keep (it would be ``Recompute()``). ``Search.simple`` lists them by name, simplest first; ``best_simple``
#    is the fastest whose predicted peak is within a budget (among equally fast ones, the simpler), or, given
#    what verification measured, ranks those by their measurements (NOTE [ Applying a plan ] Rule 7).
"""
from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping, Sequence

from torchckpt._errors import CheckpointError, format_bytes, format_bytes_apart
from torchckpt.planner.costs import (
    KEEP, RECOMPUTE, RECOMPUTE_HOST, REENTRANT, Block, StepCosts, Decision, Prediction, Terms, balanced_parts, chain_states,
    device_bytes, host_bytes, materialised_bytes, predict, replay, terms, through_reentrant,
)

__all__ = ["FAMILIES", "PlanError", "Search", "ladder", "search", "simple_policies"]


class PlanError(CheckpointError, ValueError):
    """No plan meets the budget (the message names the lowest reachable peak)."""


def _whole(block: Block, chosen: Sequence[int]) -> tuple[int, ...]:
    """``chosen`` positions with every other position of their storages (NOTE [ Plan search ] Rule 1), in order."""
    if not block.same:
        return tuple(sorted(chosen))
    roots = {block.same[k] for k in chosen}
    return tuple(k for k in range(len(block.saved)) if block.same[k] in roots)


def ladder(block: Block, compress: bool, rungs: int = 4, parts: int = 2) -> list[Decision]:
    """A block's options, from the most device bytes to the fewest (NOTE [ Plan search ] Rule 1).

    ``parts``: recomputation in up to this many parts is offered too (cuts balancing the parts' bytes).

    Offload rungs send the block's largest saved tensors, up to about ``1/rungs``, ``2/rungs``, ...
    of its saved bytes, then all of them.
    """
    out = [KEEP]
    order = sorted(range(len(block.saved)), key=lambda k: -block.saved[k])
    total = block.saved_bytes
    if total > 0:
        prefixes: list[tuple[int, ...]] = []
        acc, level = 0, 1
        for j, k in enumerate(order):
            acc += block.saved[k]
            while level <= rungs and acc >= total * level / rungs - 1e-9:
                p = _whole(block, order[: j + 1])
                if not prefixes or prefixes[-1] != p:
                    prefixes.append(p)
                level += 1
        for p in prefixes:
            out.append(Decision("offload", p))
            if compress:
                out.append(Decision("offload", p, compress=True))
    sel = _selective(block, rungs)
    out += sel + [dataclasses.replace(d, host=True) for d in sel]
    if compress:
        out += [dataclasses.replace(d, host=True, compress=True) for d in sel]
    out.append(RECOMPUTE)
    if block.input_bytes:
        out.append(RECOMPUTE_HOST)
    if len(block.saved_at) == len(block.saved) and block.cuts:  # in parts, when the profile says where to cut
        for k in range(2, parts + 1):
            cuts = balanced_parts(block.saved, k, block.cuts)
            if cuts and all(cuts != d.parts for d in out):
                out.append(Decision("recompute", parts=cuts))
                if block.input_bytes:
                    out.append(Decision("recompute", host=True, parts=cuts))
    if not block.recomputable:  # NOTE [ Profiling step ] Rule 7
        out = [d for d in out if d.mode != "recompute"]
    top = rung_key(block, KEEP)
    rest = [d for d in out[1:] if rung_key(block, d) < top]  # others could never lower the peak
    return [KEEP] + sorted(rest, key=lambda d: tuple(-v for v in rung_key(block, d)))  # stable: recompute-host last


def rung_key(block: Block, d: Decision) -> tuple[int, int]:
    """How far down a block's ladder ``d`` is (NOTE [ Plan search ] Rule 1): the bytes it leaves on the device between
    forward and backward, then the bytes its backward holds of its own (a recomputation in parts holds one part)."""
    return device_bytes(block, d), materialised_bytes(block, d) if d.mode == "recompute" else block.saved_bytes


def _selective(block: Block, rungs: int, first: int = 6) -> list[Decision]:
    """Recompute options keeping the ops that save the most time per byte (NOTE [ Plan search ] Rule 1): the first
    ``first`` of them one by one, then up to 1/rungs, 2/rungs, ... of the block's forward time."""
    ops = sorted((o for o in block.ops if o[1] > 0 and o[2] > 0), key=lambda o: -o[2] / o[1])
    total = sum(o[2] for o in ops)
    out: list[Decision] = []
    acc, level, chosen = 0.0, 1, []
    for j, (k, _, sec) in enumerate(ops):
        chosen.append(k)
        acc += sec
        rung = j < first
        while level < rungs and acc >= total * level / rungs:
            rung, level = True, level + 1
        if rung:
            out.append(Decision("recompute", keep=tuple(sorted(chosen))))
    return out


@dataclasses.dataclass(frozen=True)
class Search:
    """The plans the search recorded (NOTE [ Plan search ] Rule 2), keep-everything first."""

    chain: StepCosts
    plans: tuple[tuple[tuple[Decision, ...], Prediction], ...]
    simple: tuple[tuple[str, tuple[Decision, ...], Prediction], ...] = ()  # NOTE [ Plan search ] Rule 7, simplest first

    @property
    def floor(self) -> int:
        """The lowest predicted peak of any recorded plan."""
        return min(p.peak_bytes for _, p in self.plans)

    def best(self, budget: int, family: str = "all") -> tuple[tuple[Decision, ...], Prediction]:
        """The fastest recorded plan whose predicted peak is at most ``budget`` (NOTE [ Plan search ] Rules 3-4), among
        ``family``: ``"all"``, ``"lossless"`` (no compression) or ``"local"`` (nothing crosses the host link)."""
        if family not in FAMILIES:
            raise ValueError(f"torchckpt: Search.best(family=...) is one of {FAMILIES}, got {family!r}.")
        fit = [(d, p) for d, p in self.plans if p.peak_bytes <= budget and _in(family, d, self.chain)]
        if not fit and family != "all":
            raise PlanError(f"torchckpt: no {family} plan fits a budget of {size(budget)}.")
        if not fit:
            asked, floor = format_bytes_apart(budget, self.floor)
            raise PlanError(
                f"torchckpt: no plan fits a budget of {asked}: the lowest peak this model reaches is "
                f"{floor} ({self.floor} bytes a step adds, gradients and the blocks' inputs included); "
                f"pass budget >= {self.floor}, or make the step smaller (batch, sequence length)."
            )
        return min(fit, key=lambda dp: (dp[1].step_s, dp[1].d2h_bytes, -dp[1].peak_bytes))

    def best_simple(self, budget: int, measured: Mapping[tuple[Decision, ...], tuple[int, float]] | None = None,
                    limit: int | None = None, only_measured: bool = False
                    ) -> tuple[str, tuple[Decision, ...], Prediction] | None:
        """The fastest simple policy whose predicted peak is at most ``budget`` (among equally fast ones, the simpler),
        as (name, plan, prediction), or ``None`` if none fits (NOTE [ Plan search ] Rule 7). A policy in ``measured``
        (its peak and step) is judged by those, its peak against ``limit`` (default ``budget``); with
        ``only_measured`` the others are left out (NOTE [ Applying a plan ] Rules 4 and 7)."""
        measured = measured or {}
        top = budget if limit is None else limit
        fit = []
        for k, (_, plan, p) in enumerate(self.simple):
            got = measured.get(plan)
            if got is not None and got[0] <= top:
                fit.append((got[1], k))
            elif got is None and not only_measured and p.peak_bytes <= budget:
                fit.append((p.step_s, k))
        return self.simple[min(fit)[1]] if fit else None

    def simple_name(self, plan: tuple[Decision, ...]) -> str:
        """The name of the simple policy ``plan`` is (NOTE [ Plan search ] Rule 7), or ``""``."""
        return next((name for name, d, _ in self.simple if d == plan), "")


FAMILIES = ("all", "lossless", "local")


def _in(family: str, plan: tuple[Decision, ...], chain: StepCosts) -> bool:
    if family == "lossless":
        return not any(d.compress for d in plan)
    if family == "local":
        return not any(host_bytes(b, d) for b, d in zip(chain.blocks, plan))
    return True


def size(n: float) -> str:
    """``n`` bytes for a message (``torchckpt._errors.format_bytes``)."""
    return format_bytes(n)


def search(chain: StepCosts, rungs: int = 4, lookahead: int = 1) -> Search:
    """Walk the plans from keep-everything down to the floor (NOTE [ Plan search ] Rules 2-3)."""
    blocks = chain.blocks
    options = [ladder(b, chain.codec is not None, rungs) for b in blocks]
    most = max((b.saved_bytes for b in blocks), default=0)
    inputs = max((b.input_bytes for b in blocks), default=0)
    caps = sorted({0, inputs, most // 4, most // 2, most})
    plans: list[tuple[tuple[Decision, ...], Prediction]] = []
    seen: set[tuple[Decision, ...]] = set()
    for cap in caps:
        allowed = [[d for d in opts if host_bytes(b, d) <= cap] for b, opts in zip(blocks, options)]
        for d, p in _walk(chain, allowed, lookahead):
            if d not in seen:
                seen.add(d)
                plans.append((d, p))
    for d, p in _revolve_plans(chain, options, lookahead):
        if d not in seen:
            seen.add(d)
            plans.append((d, p))
    if chain.reentrant:  # NOTE [ Mechanism costs ] Rule 13: each plan's twin, whole blocks recomputed reentrant
        for d in [d for d, _ in plans]:
            twin = through_reentrant(d)
            if twin not in seen:
                seen.add(twin)
                plans.append((twin, predict(chain, twin, lookahead)))
    recorded = dict(plans)
    simple = []
    for name, d in simple_policies(chain):  # NOTE [ Plan search ] Rule 7: candidates as any plan, same model
        if d not in recorded:
            recorded[d] = predict(chain, d, lookahead)
            plans.append((d, recorded[d]))
        simple.append((name, d, recorded[d]))
    return Search(chain, tuple(plans), tuple(simple))


def simple_policies(chain: StepCosts) -> list[tuple[str, tuple[Decision, ...]]]:
    """The one-line policies, by name, simplest first, each as a plan of ``chain`` (NOTE [ Plan search ] Rule 7)."""
    blocks = chain.blocks
    n = len(blocks)
    every = [("every block Recompute()", [RECOMPUTE] * n)]
    if chain.reentrant_runs:  # NOTE [ Mechanism costs ] Rule 13
        every.append(("every block Recompute(reentrant=True)", [REENTRANT] * n))
    if any(b.input_bytes for b in blocks):
        every.append(("every block Recompute(store=...), inputs to host",
                      [RECOMPUTE_HOST if b.input_bytes else RECOMPUTE for b in blocks]))
    if any(b.sac for b in blocks):
        every.append(("every block Recompute(save=matmuls, attention)",
                      [Decision("recompute", keep=b.sac) if b.sac else RECOMPUTE for b in blocks]))
    else:  # no matmul or attention (a CNN): the op each block's ladder keeps first
        tops = [_selective(b, 1, first=1)[:1] for b in blocks]
        if any(tops):
            every.append(("every block Recompute(save=its costliest op per byte)",
                          [t[0] if t else RECOMPUTE for t in tops]))
    for first in (0, 1) if n >= 2 else ():
        names = [b.name for b in blocks[first::2]]
        every.append((f"every other block Recompute() ({', '.join(names[:2])}{', ...' if len(names) > 2 else ''})",
                      [RECOMPUTE if i % 2 == first else KEEP for i in range(n)]))
    sizes = [b.input_bytes for b in blocks]
    for m in _memories(blocks):
        k = m // sizes[0]
        how = (f"Revolve, {k} snapshot{'s' if k > 1 else ''}" if min(sizes) == max(sizes)
               else f"WeightedRevolve, {format_bytes(m)} of snapshots")
        every.append((f"checkpoint_chain ({how})", [dataclasses.replace(RECOMPUTE, revolve=m)] * n))
    out: list[tuple[str, tuple[Decision, ...]]] = [("keep everything", (KEEP,) * n)] if n else []
    if chain.reentrant:  # NOTE [ Mechanism costs ] Rule 13: each policy's reentrant twin beside it, named so
        every = [x for name, plan in every for x in (
            (name, plan), (name.replace("Recompute()", "Recompute(reentrant=True)"), list(through_reentrant(plan))))]
    for name, plan in every:
        if n and all(d.mode != "recompute" or b.recomputable for b, d in zip(blocks, plan)) and all(
                tuple(plan) != d for _, d in out):
            out.append((name, tuple(plan)))
    return out


def _revolve_plans(chain: StepCosts, options: list[list[Decision]],
                   lookahead: int) -> list[tuple[tuple[Decision, ...], Prediction]]:
    """NOTE [ Plan search ] Rule 6: every block recomputed (whole, or in its parts when every block has them) under
    Revolve over the chain, for each number of inputs its snapshots may hold."""
    blocks = chain.blocks
    n = len(blocks)
    memories = _memories(blocks)
    if not memories:
        return []
    firsts = [next((d for d in opts if d.parts and not d.host and not d.keep), RECOMPUTE) for opts in options]
    variants = [[RECOMPUTE] * n] + ([firsts] if all(d.parts for d in firsts) else [])
    out = []
    for m in memories:
        revolve = chain_states(chain, m)
        for v in variants:
            plan = tuple(dataclasses.replace(d, revolve=m) for d in v)
            per = [terms(chain, b, d) for b, d in zip(blocks, plan)]
            out.append((plan, replay(chain, per, lookahead, True, revolve)))
    return out


def _memories(blocks: tuple[Block, ...]) -> list[int]:
    """NOTE [ Plan search ] Rule 6's amounts of snapshot memory for Revolve over the chain (none where it may not
    run)."""
    n = len(blocks)
    if n < 3 or not all(b.recomputable and b.input_bytes > 0 and b.chained for b in blocks):
        return []
    sizes = [b.input_bytes for b in blocks]
    if min(sizes) == max(sizes):
        return [k * sizes[0] for k in range(1, n - 1)]
    lo, hi = sizes[0], sum(sizes[:-1])  # eight amounts: each WeightedRevolve is a dynamic program of its own
    return sorted({lo + (hi - lo) * k // 7 for k in range(8)})


def _walk(chain: StepCosts, options: list[list[Decision]], lookahead: int) -> list[tuple[tuple[Decision, ...], Prediction]]:
    """One greedy walk over ``options`` (each block's ladder, keep first) (NOTE [ Plan search ] Rule 2).

    Lazy greedy: a move's score (added time per byte of peak saved) is kept from when it was last
    simulated; the best stale score is simulated again and taken if it still beats every other
    stale score. When no stale score is left, every move is simulated again before the walk ends.
    """
    blocks = chain.blocks
    nbytes = [[rung_key(b, d) for d in opts] for b, opts in zip(blocks, options)]
    table = [[terms(chain, b, d) for d in opts] for b, opts in zip(blocks, options)]  # each option's terms, once
    pos = [0] * len(blocks)
    cur = [opts[0] for opts in options]
    per = [t[0] for t in table]
    pred = replay(chain, per, lookahead, cache=False)
    plans = [(tuple(cur), replay(chain, per, lookahead))]

    def score(i: int, j: int) -> tuple[float, int] | None:
        per[i] = table[i][j]
        p = replay(chain, per, lookahead, cache=False)
        per[i] = table[i][pos[i]]
        gain = pred.peak_bytes - p.peak_bytes
        return ((p.step_s - pred.step_s) / gain, -p.peak_bytes) if gain > 0 else None

    def moves(i: int) -> list[int]:
        return [j for j in range(pos[i] + 1, len(options[i])) if nbytes[i][j] < nbytes[i][pos[i]]]

    def scan() -> list[tuple[float, int, int, int]]:
        heap = []
        for i in range(len(blocks)):
            for j in moves(i):
                sc = score(i, j)
                if sc is not None:
                    heap.append((sc[0], sc[1], i, j))
        heapq.heapify(heap)
        return heap

    heap = scan()
    while heap:
        _, _, i, j = heapq.heappop(heap)
        if j <= pos[i] or nbytes[i][j] >= nbytes[i][pos[i]]:
            continue
        sc = score(i, j)
        if sc is not None and (not heap or sc <= heap[0][:2]):
            pos[i] = j
            cur[i], per[i] = options[i][j], table[i][j]
            pred = replay(chain, per, lookahead, cache=False)
            plans.append((tuple(cur), replay(chain, per, lookahead)))
            for jj in moves(i):
                s2 = score(i, jj)
                if s2 is not None:
                    heapq.heappush(heap, (s2[0], s2[1], i, jj))
        elif sc is not None:
            heapq.heappush(heap, (sc[0], sc[1], i, j))
        if not heap:
            heap = scan()
        if not heap:  # a plateau: no one block lowers the peak; move every block that has an option at once
            group = _group_move(chain, options, nbytes, table, pos, per, pred, lookahead)
            if group is not None:
                for i, j in group:
                    pos[i] = j
                    cur[i], per[i] = options[i][j], table[i][j]
                pred = replay(chain, per, lookahead, cache=False)
                plans.append((tuple(cur), replay(chain, per, lookahead)))
                heap = scan()
    return plans


def _group_move(chain: StepCosts, options: list[list[Decision]], nbytes: list[list[tuple[int, int]]],
                table: list[list[Terms]], pos: list[int], per: list[Terms], pred: Prediction,
                lookahead: int) -> list[tuple[int, int]] | None:
    """NOTE [ Plan search ] Rule 2's move off a plateau: one option taken by every block whose ladder has it further
    down, the one that lowers the peak for the least added time per byte; ``None`` if none lowers it."""
    best: tuple[tuple[float, int], list[tuple[int, int]]] | None = None
    seen: set[Decision] = set()
    for i0 in range(len(options)):
        for d in options[i0][pos[i0] + 1:]:
            if d in seen:
                continue
            seen.add(d)
            moves = []
            for i, opts in enumerate(options):
                j = next((j for j in range(pos[i] + 1, len(opts)) if opts[j] == d), None)
                if j is not None and nbytes[i][j] < nbytes[i][pos[i]]:
                    moves.append((i, j))
            if len(moves) < 2:
                continue
            trial = list(per)
            for i, j in moves:
                trial[i] = table[i][j]
            p = replay(chain, trial, lookahead, cache=False)
            gain = pred.peak_bytes - p.peak_bytes
            if gain > 0:
                sc = ((p.step_s - pred.step_s) / gain, -p.peak_bytes)
                if best is None or sc < best[0]:
                    best = (sc, moves)
    return None if best is None else best[1]
