"""WeightedRevolve: optimal persistent checkpointing of steps of unequal cost and size.

Beaumont, O., Eyraud-Dubois, L., Herrmann, J., Joly, A. and Shilova, A. (2019), "Optimal
checkpointing for heterogeneous chains: how to train deep neural networks with limited
memory", arXiv:1911.13214 (the rotor dynamic program). Simplified here: only the snapshots'
memory is constrained, and an adjoint step's own recorded evaluation costs nothing extra
(NOTE [ Schedule actions ] Rule 3). With equal costs and sizes it is Revolve.

Known gaps: the plan is O(n^3 * M) time and O(n^2 * M) memory (NOTE [ Weighted reversal ] Rule 6), so it suits chains
of tens to a few hundred steps; for long uniform chains use Revolve. Memory is discretised
(NOTE [ Weighted reversal ] Rule 3): with a coarse unit the schedule is optimal for the rounded sizes, not the exact ones.

# NOTE [ Weighted reversal ]
# Conventions of NOTE [ Schedule actions ]; state i is the input of step i, of
# ``state_bytes[i]`` bytes; step i costs ``step_costs[i]``; F(a, k) = sum(step_costs[a:k]).
# 1. C(a, b, m) is the least advance cost that reverses steps a .. b-1 when x_a is current
#    and held in a slot, with m memory units free besides it. C(a, a+1, m) = 0 (``Adjoint(a)``).
#    Otherwise the least of
#    (i)  F(a, b-1) + C(a, b-1, m): advance to b-1 and reverse that step from the current
#         state, unsaved (the last step of a segment needs no snapshot, as in Revolve);
#    (ii) F(a, k) + C(k, b, m - u_k) + C(a, k, m) for a < k < b-1 with u_k <= m: advance
#         to k, save x_k, reverse k .. b-1 above it, restore x_a, reverse a .. k-1.
#    The schedule reverses 0 .. n-1 with x0 saved and m = M, and costs C(0, n, M). On small
#    chains no schedule, persistent or not, does better (the tests search them all).
# 2. With equal costs and sizes (unit = size, Rule 3) C depends on b - a and m only, and is
#    Revolve's recursion with c = m + 1 slots; option (i) is Revolve's split m = l - 1.
#    With s = memory // size slots its advances are ``optimal_forward_steps(n, s)``.
# 3. Units: only states 1 .. n-2 are ever saved besides x0. When those are all of one size,
#    the unit is that size (exact Revolve). Otherwise it is their gcd, unless that leaves
#    more than ``_MAX_UNITS`` units of budget; then ceil(budget / _MAX_UNITS). Sizes round
#    UP to units, the free budget ``memory - state_bytes[0]`` DOWN, so the snapshots never
#    hold more than ``memory`` bytes. M is capped at the units of all saveable states, and
#    is all of them when their bytes fit (holding every state is then exactly feasible).
# 4. Snapshots form a stack: x_k is saved above x_a and freed before x_a is restored. So a
#    snapshot's slot is its depth (one slot class per depth, as Revolve), and each is freed
#    right after its last restore, just before the ``Adjoint`` of its own step.
# 5. Ties (cost equal to the bit, the same float sums are recomputed when emitting): option
#    (i) first, then the smallest k, as NOTE [ Binomial reversal ] Rule 4 takes the smallest split.
# 6. Planning fills C bottom-up over segment length, one list over m per (a, b): about
#    n^3 * (M+1) / 6 additions in list comprehensions (n = 64, M = 128: ~5.6 * 10^6). A
#    schedule plans once, on first use, and keeps the plan (``_plan``).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from numbers import Real

from torchckpt._errors import internal_error
from torchckpt.schedules.actions import Tier
from torchckpt.schedules.packed import PackedBuilder, PackedSchedule
from torchckpt.schedules.schedule import Schedule, check_int

__all__ = ["WeightedRevolve"]

_MAX_UNITS = 128  # NOTE [ Weighted reversal ] Rule 3
_ADVANCE, _SAVE, _RESTORE, _FREE, _ADJOINT, _END_FORWARD = range(6)


@dataclass(frozen=True, slots=True)
class _Plan:
    """What planning found: the actions as (op, state, slot) and their figures."""

    ops: tuple[tuple[int, int, int], ...]
    cost: float
    forward_steps: int
    slots: int
    peak_bytes: int
    unit: int


def _memory_units(sizes: tuple[int, ...], memory: int) -> tuple[int, list[int], int]:
    """NOTE [ Weighted reversal ] Rule 3: the unit, each state's size in units (rounded up), and the budget M."""
    n = len(sizes)
    inner = sizes[1:n - 1]
    free = memory - sizes[0]
    need = sum(inner)
    nonzero = [s for s in inner if s]
    if not nonzero:
        unit = 1
    elif len(set(inner)) == 1:
        unit = inner[0]
    else:
        unit = math.gcd(*nonzero)
        budget = min(free, need)
        if budget // unit > _MAX_UNITS:
            unit = -(-budget // _MAX_UNITS)
    units = [-(-s // unit) for s in sizes]
    total = sum(units[1:n - 1])
    return unit, units, total if free >= need else min(free // unit, total)


def _cost_table(prefix: list[float], units: list[int], budget: int) -> list[list[list[float]]]:
    """NOTE [ Weighted reversal ] Rule 1 bottom-up: ``table[a][b][m]`` = C(a, b, m) for b > a
    (NOTE [ Weighted reversal ] Rule 6)."""
    n = len(prefix) - 1
    zero = [0.0] * (budget + 1)
    table = [[zero] * (n + 1) for _ in range(n)]
    for length in range(2, n + 1):
        for a in range(n - length + 1):
            b = a + length
            row = table[a]
            f = prefix[b - 1] - prefix[a]
            best = [f + c for c in row[b - 1]]  # option (i)
            for k in range(a + 1, b - 1):  # option (ii)
                uk = units[k]
                if uk > budget:
                    continue
                f = prefix[k] - prefix[a]
                best[uk:] = [o if o <= (c := f + x + y) else c
                             for o, x, y in zip(best[uk:], table[k][b], row[k][uk:])]
            row[b] = best
    return table


def _plan(costs: tuple[float, ...], sizes: tuple[int, ...], memory: int) -> _Plan:
    """Plan the schedule: the cost table, then the actions along its optimal choices."""
    n = len(costs)
    if n == 1:
        return _Plan(((_END_FORWARD, 0, 0), (_ADJOINT, 0, 0)), 0.0, 0, 0, 0, 1)
    unit, units, budget = _memory_units(sizes, memory)
    prefix = [0.0, *accumulate(costs)]
    table = _cost_table(prefix, units, budget)
    ops: list[tuple[int, int, int]] = [(_SAVE, 0, 0)]
    held = [0]  # the stack of snapshots (NOTE [ Weighted reversal ] Rule 4); slot = index
    held_bytes = peak_bytes = sizes[0]
    slots = 1
    steps = 0
    first = True
    todo: list[tuple[int, int, int]] = [(0, n, budget)]  # (a, b, m); b < 0: Restore(a)
    while todo:
        a, b, m = todo.pop()
        if b < 0:
            ops.append((_RESTORE, a, held.index(a)))
            continue
        if b - a == 1:  # x_a was just restored, its last use (NOTE [ Weighted reversal ] Rule 4)
            held.pop()
            held_bytes -= sizes[a]
            ops += ((_FREE, a, len(held)), (_ADJOINT, a, 0))
            continue
        want = table[a][b][m]
        row = table[a]
        if prefix[b - 1] - prefix[a] + row[b - 1][m] == want:  # option (i), NOTE [ Weighted reversal ] Rule 5
            ops.append((_ADVANCE, b - 1, 0))
            steps += b - 1 - a
            if first:
                ops.append((_END_FORWARD, 0, 0))
                first = False
            ops += ((_ADJOINT, b - 1, 0), (_RESTORE, a, held.index(a)))
            todo.append((a, b - 1, m))
            continue
        for k in range(a + 1, b - 1):
            uk = units[k]
            if uk <= m and prefix[k] - prefix[a] + table[k][b][m - uk] + row[k][m] == want:
                break
        else:
            raise internal_error(f"WeightedRevolve found no choice reaching C({a}, {b}, {m}) = {want}")
        ops += ((_ADVANCE, k, 0), (_SAVE, k, len(held)))
        steps += k - a
        held.append(k)
        held_bytes += sizes[k]
        slots = max(slots, len(held))
        peak_bytes = max(peak_bytes, held_bytes)
        todo += ((a, k, m), (a, -1, 0), (k, b, m - uk))
    return _Plan(tuple(ops), table[0][n][budget], steps, slots, peak_bytes, unit)


@dataclass(frozen=True, slots=True)
class WeightedRevolve(Schedule):
    """Fewest-cost persistent checkpointing of unequal steps under a byte budget.

    See NOTE [ Weighted reversal ]. For equal costs and sizes its forward advances equal
    ``optimal_forward_steps(n_steps, memory // size)``.

    Args:
        step_costs: forward cost of each step i = 0 .. n-1 (e.g. seconds), each > 0.
        state_bytes: bytes of each state i = 0 .. n-1 (the input of step i), each >= 0.
        memory: bytes the snapshots may hold at once, x0's included (>= state_bytes[0]).
        tier: where the snapshots are kept.

    Returns:
        A schedule; iterate it for its actions. It plans on first use (NOTE [ Weighted reversal ] Rule 6).

    Example::

        >>> from torchckpt.schedules import simulate
        >>> w = WeightedRevolve([1, 1, 5, 1, 1, 1], [4, 4, 4, 16, 4, 4], memory=12)
        >>> w.forward_cost, w.slots_used, w.peak_bytes, simulate(w).forward_steps
        (15.0, 3, 12, 7)
        >>> simulate(WeightedRevolve([1.0] * 100, [8] * 100, memory=40)).forward_steps
        316
    """

    step_costs: tuple[float, ...]
    state_bytes: tuple[int, ...]
    memory: int
    tier: Tier = Tier.GPU
    n_steps: int = field(init=False, repr=False, compare=False, default=0)
    _plan: _Plan | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        costs, sizes = self.step_costs, self.state_bytes
        for name, seq in (("step_costs", costs), ("state_bytes", sizes)):
            if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
                raise TypeError(f"torchckpt: {name} must be a sequence, found {type(seq).__name__} "
                                f"{seq!r}; pass a list or tuple with one entry per step.")
        if len(costs) < 1 or len(sizes) != len(costs):
            raise ValueError(f"torchckpt: WeightedRevolve expected len(step_costs) == len(state_bytes) "
                             f">= 1, found {len(costs)} and {len(sizes)}; pass one cost and one state "
                             "size per forward step.")
        for i, c in enumerate(costs):
            if isinstance(c, bool) or not isinstance(c, Real):
                raise TypeError(f"torchckpt: step_costs[{i}] must be a number, found {type(c).__name__} "
                                f"{c!r}; pass each step's forward cost, e.g. its time in seconds.")
            if not 0 < float(c) < math.inf:
                raise ValueError(f"torchckpt: step_costs[{i}] must be finite and > 0, found {c!r}; "
                                 "pass each step's forward cost, e.g. its time in seconds.")
        sizes = tuple(check_int(f"state_bytes[{i}]", s, 0, "pass the size in bytes of each state")
                      for i, s in enumerate(sizes))
        check_int("memory", self.memory, 0, "pass the bytes the snapshots may hold at once")
        if self.memory < sizes[0]:
            raise ValueError(f"torchckpt: memory={self.memory} cannot hold x0: expected memory >= "
                             f"state_bytes[0] = {sizes[0]}, found {self.memory}; pass memory >= {sizes[0]} "
                             "(state 0 must fit).")
        if not isinstance(self.tier, Tier):
            raise TypeError(f"torchckpt: tier must be a Tier, found {type(self.tier).__name__} "
                            f"{self.tier!r}; pass e.g. Tier.GPU or Tier.HOST.")
        object.__setattr__(self, "step_costs", tuple(float(c) for c in costs))
        object.__setattr__(self, "state_bytes", sizes)
        object.__setattr__(self, "n_steps", len(costs))

    def _planned(self) -> _Plan:
        plan = self._plan
        if plan is None:
            plan = _plan(self.step_costs, self.state_bytes, self.memory)
            object.__setattr__(self, "_plan", plan)
        return plan

    @property
    def forward_cost(self) -> float:
        """The optimum C(0, n, M): total cost of the advances (NOTE [ Weighted reversal ] Rule 1)."""
        return self._planned().cost

    @property
    def forward_steps(self) -> int:
        """Forward step evaluations by the advances of this schedule."""
        return self._planned().forward_steps

    @property
    def slots_used(self) -> int:
        """Most snapshots held at once (0 for one step: no snapshot is needed)."""
        return self._planned().slots

    @property
    def peak_bytes(self) -> int:
        """Most snapshot bytes held at once (at most ``memory``, NOTE [ Weighted reversal ] Rule 3)."""
        return self._planned().peak_bytes

    @property
    def memory_unit(self) -> int:
        """Bytes per memory unit of the plan (NOTE [ Weighted reversal ] Rule 3)."""
        return self._planned().unit

    @property
    def capacity(self) -> Mapping[Tier, int]:
        """``{tier: slots_used}``."""
        return {self.tier: self.slots_used}

    def pack(self) -> PackedSchedule:
        """Pack the planned actions (slot class = depth, NOTE [ Weighted reversal ] Rule 4); iterate the result for actions."""
        plan = self._planned()
        b = PackedBuilder((self.tier,) * max(plan.slots, 1))
        for op, state, slot in plan.ops:
            if op == _ADVANCE:
                b.advance(state)
            elif op == _SAVE:
                b.save(slot)
            elif op == _RESTORE:
                b.restore(state, slot)
            elif op == _FREE:
                b.free(state, slot)
            elif op == _ADJOINT:
                b.adjoint()
            else:
                b.end_forward()
        return b.build()
