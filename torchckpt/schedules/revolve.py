"""Revolve: the binomial checkpoint schedule with the fewest forward advances.

Griewank, A. and Walther, A. (2000), "Algorithm 799: revolve: an implementation of
checkpointing for the reverse or adjoint mode of computational differentiation",
ACM TOMS 26(1), 19-45, doi:10.1145/347837.347846.

# NOTE [ Binomial reversal ]
# Conventions are those of NOTE [ Schedule actions ] (actions.py): the forward sweep stops
# at state n-1, an adjoint step includes its own recorded forward evaluation, and ``s``
# counts every snapshot slot, the one holding x0 included.
# 1. Let beta(c, t) = C(c+t, t): the most steps c slots can reverse with every step
#    advanced at most t times. For n steps and s slots, t = min{t : beta(s, t) >= n} and the
#    least number of forward advances is F(n, s) = t*n - beta(s+1, t-1)
#    = t*n - C(s+t, s+1) (``optimal_forward_steps``).
# 2. ``reverse(a, l, c)`` reverses steps a .. a+l-1 with c slots, x_a being in one of them
#    and current. For l == 1 it is ``Adjoint(a)``. For c == 1 it advances from x_a to each
#    of a+l-1, ..., a+1 in turn (restoring x_a in between): l(l-1)/2 advances. Otherwise it
#    advances m steps, saves x_{a+m} (unless l-m == 1: the last step needs no snapshot),
#    runs reverse(a+m, l-m, c-1), restores x_a and runs reverse(a, m, c).
# 3. F(., c) is convex and piecewise linear with slope t on (beta(c, t-1), beta(c, t)], so
#    m + F(m, c) + F(l-m, c-1) is minimal exactly when F(., c) has slope t-1 at m and
#    F(., c-1) has slope t at l-m: m in [max(beta(c, t-2), l - beta(c-1, t)),
#    min(beta(c, t-1), l - beta(c-1, t-1))]. The interval is never empty and every m in it
#    reaches F(l, c). The split is computed, not searched: O(t) integer operations.
# 4. We take the largest m of that interval: among optimal splits it keeps the part
#    reversed with fewer slots (the c-1 branch) shortest, which gave the fewest saves and
#    restores in our measurements.
# 5. The snapshot of x_a lives in slot s - c (x0 in slot 0); deeper frames use higher
#    slots, so at most s slots are busy. Each snapshot is freed right after its last
#    restore, so the slot is available to a cache or prefetcher as early as possible.
# 6. The construction is an explicit-stack loop (no recursion, no generators), so it
#    handles any s and plans 10^5 steps in a few tens of milliseconds.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import comb

from torchckpt.schedules.actions import (
    Action,
    Adjoint,
    Advance,
    End,
    EndForward,
    Free,
    Restore,
    Save,
    Tier,
)
from torchckpt.schedules.schedule import Schedule, check_int

__all__ = ["Revolve", "optimal_forward_steps", "repetition_number"]


def repetition_number(n_steps: int, snapshots: int) -> int:
    """The least t with C(snapshots + t, t) >= n_steps (Revolve's repetition number).

    Args:
        n_steps: number of forward steps (>= 1).
        snapshots: snapshot slots, x0's included (>= 1).

    Returns:
        t, the most times any step is advanced by an optimal schedule.

    Example::

        >>> repetition_number(100, 5)
        4
    """
    check_int("n_steps", n_steps, 1, "pass the number of time steps")
    check_int("snapshots", snapshots, 1, "pass the number of snapshot slots, x0's included")
    t, beta = 0, 1
    while beta < n_steps:
        t += 1
        beta = beta * (snapshots + t) // t
    return t


def optimal_forward_steps(n_steps: int, snapshots: int) -> int:
    """Least number of forward advances that reverses ``n_steps`` with ``snapshots`` slots.

    Counts as NOTE [ Binomial reversal ] Rule 1 says: t*n - C(s+t, s+1).

    Args:
        n_steps: number of forward steps (>= 1).
        snapshots: snapshot slots, x0's included (>= 1).

    Returns:
        The optimum, which ``Revolve(n_steps, snapshots)`` attains.

    Example::

        >>> optimal_forward_steps(100, 5), optimal_forward_steps(10000, 100)
        (316, 24747)
    """
    t = repetition_number(n_steps, snapshots)
    return t * n_steps - comb(snapshots + t, snapshots + 1)


def _split(l: int, c: int) -> int:
    """Optimal first advance m for reversing l >= 2 steps with c >= 2 slots (Rules 3, 4)."""
    t, beta = 1, c + 1  # beta = beta(c, t)
    while beta < l:
        t += 1
        beta = beta * (c + t) // t
    b_c_t1 = beta * t // (c + t)  # beta(c, t-1)
    b_c1_t1 = b_c_t1 * c // (c + t - 1)  # beta(c-1, t-1)
    return min(b_c_t1, l - b_c1_t1)


def binomial_actions(n_steps: int, snapshots: int, slot_tiers: Sequence[object]) -> list[Action]:
    """Build the Revolve actions; snapshot slot k is placed in ``slot_tiers[k]``.

    Internal to the package (``Revolve`` and ``Multistage`` share it).

    Args:
        n_steps: number of forward steps (>= 1).
        snapshots: slots (>= 1), already clamped to at most ``max(n_steps - 1, 1)``.
        slot_tiers: tier of each slot index, ``len >= snapshots``.

    Returns:
        The actions, ending with ``End()``.

    Example::

        >>> len(binomial_actions(3, 1, [Tier.GPU]))
        11
    """
    out: list[Action] = []
    put = out.append
    s = snapshots
    if n_steps == 1:
        return [EndForward(), Adjoint(0), End()]
    put(Save(0, slot_tiers[0]))
    stack: list[tuple[int, int, int]] = []
    a, l, c = 0, n_steps, s
    while True:
        # Reverse steps a .. a+l-1, current state a, x_a in slot s-c (Rule 2).
        while l > 1 and c > 1:
            m = _split(l, c)
            b = a + m
            put(Advance(a, b))
            if l - m > 1:
                put(Save(b, slot_tiers[s - c + 1]))
                stack.append((a, m, c))
                a, l, c = b, l - m, c - 1
            else:
                put(Adjoint(b))
                tier = slot_tiers[s - c]
                put(Restore(a, tier))
                if m == 1:
                    put(Free(a, tier))
                l = m
        if l == 1:
            put(Adjoint(a))
        else:  # c == 1: x_a is the only slot left.
            tier = slot_tiers[s - 1]
            restore = Restore(a, tier)
            for k in range(a + l - 1, a + 1, -1):
                put(Advance(a, k))
                put(Adjoint(k))
                put(restore)
            put(Advance(a, a + 1))
            put(Adjoint(a + 1))
            put(restore)
            put(Free(a, tier))
            put(Adjoint(a))
        if not stack:
            break
        a, l, c = stack.pop()
        tier = slot_tiers[s - c]
        put(Restore(a, tier))
        if l == 1:
            put(Free(a, tier))
    # The first Adjoint is Adjoint(n-1), reached after the first sweep (actions.py Rule 4).
    for i, act in enumerate(out):
        if type(act) is Adjoint:
            out.insert(i, EndForward())
            break
    put(End())
    return out


@dataclass(frozen=True, slots=True)
class Revolve(Schedule):
    """Optimal binomial checkpointing (Griewank & Walther): fewest forward advances.

    See NOTE [ Binomial reversal ]. Forward advances equal
    ``optimal_forward_steps(n_steps, snapshots)``.

    Args:
        n_steps: number of forward steps to reverse (>= 1).
        snapshots: snapshot slots, including the one holding x0 (>= 1).
        tier: where the snapshots are kept.

    Returns:
        A schedule; iterate it for its actions.

    Example::

        >>> from torchckpt.schedules import simulate
        >>> simulate(Revolve(100, 5)).forward_steps
        316
    """

    n_steps: int
    snapshots: int
    tier: Tier = Tier.GPU

    def __post_init__(self) -> None:
        check_int("n_steps", self.n_steps, 1, "pass the number of forward steps to reverse")
        check_int(
            "snapshots", self.snapshots, 1,
            "pass how many snapshot slots may be used, the one holding x0 included",
        )
        if not isinstance(self.tier, Tier):
            raise TypeError(
                f"torchckpt: tier must be a Tier, found {type(self.tier).__name__} "
                f"{self.tier!r}; pass e.g. Tier.GPU or Tier.HOST."
            )

    @property
    def slots_used(self) -> int:
        """Slots the schedule actually needs: ``min(snapshots, max(n_steps - 1, 1))``."""
        return min(self.snapshots, max(self.n_steps - 1, 1))

    @property
    def capacity(self) -> Mapping[Tier, int]:
        """``{tier: snapshots}``."""
        return {self.tier: self.snapshots}

    @property
    def forward_steps(self) -> int:
        """The forward advances this schedule performs (the optimum)."""
        return optimal_forward_steps(self.n_steps, self.snapshots)

    def actions(self) -> list[Action]:
        """All actions, in order, ending with ``End()``."""
        s = self.slots_used
        return binomial_actions(self.n_steps, s, [self.tier] * s)
