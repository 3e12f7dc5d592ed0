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
# 4. We take the smallest m of that interval. Restores are n-1 whatever the split, but
#    saves are not: the smallest m saved fewest (e.g. 9436 instead of 9817 saves for
#    n=10^4, s=100; 52 instead of 60 for n=100, s=5), and every save to a host tier is a
#    device-to-host copy.
# 5. The snapshot of x_a lives in slot s - c (x0 in slot 0); deeper frames use higher
#    slots, so at most s slots are busy. Each snapshot is freed right after its last
#    restore, so the slot is available to a cache or prefetcher as early as possible.
# 6. The construction is an explicit-stack loop (no recursion, no generators), so it
#    handles any s, and packs its actions (NOTE [ Packed schedules ]).
# 7. Once l <= c + 1 (t = 1) the optimal split is m = 1 all the way down: every state
#    a+1 .. a+l-2 is saved on one sweep and the steps are reversed from them. That case is
#    emitted by a flat loop, which is most of the actions.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import comb

from torchckpt.schedules.actions import Tier
from torchckpt.schedules.packed import ADJOINT, END, END_FORWARD, FREE, RESTORE, SAVE, PackedSchedule
from torchckpt.schedules.schedule import check_steps_snapshots_tier, Schedule, check_int

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


def binomial_codes(n_steps: int, snapshots: int) -> list[int]:
    """Revolve, packed (NOTE [ Packed schedules ]); slot k is slot class k.

    Internal to the package (``Revolve`` and ``Multistage`` share it).

    Args:
        n_steps: number of forward steps (>= 1).
        snapshots: slots (>= 1), clamped by the caller to at most ``max(n_steps - 1, 1)``.

    Returns:
        The action codes, the last one ``End()``'s.

    Example::

        >>> len(binomial_codes(3, 1))
        11
    """
    if n_steps == 1:
        return [END_FORWARD, ADJOINT, END]
    s = snapshots
    out: list[int] = [SAVE]  # Save(0) into slot 0.
    put = out.append
    ext = out.extend
    stack: list[tuple[int, int, int]] = []
    push = stack.append
    pop = stack.pop
    a, l, c = 0, n_steps, s
    while True:
        # Reverse steps a .. a+l-1: current state a, x_a in slot s-c (NOTE [ Binomial reversal ] Rule 2).
        while l > c + 1 and c > 1:  # t >= 2 and l >= 3
            # The smallest optimal split m (NOTE [ Binomial reversal ] Rules 3 and 4), inlined: the hot path.
            t, beta = 2, (c + 1) * (c + 2) // 2
            while beta < l:
                t += 1
                beta = beta * (c + t) // t
            m = l - beta * c // (c + t)  # l - beta(c-1, t)
            b_c_t2 = beta * t // (c + t) * (t - 1) // (c + t - 1)  # beta(c, t-2)
            if m < b_c_t2:
                m = b_c_t2
            b = a + m
            if l - m > 1:
                ext((b << 3, (s - c + 1) << 3 | SAVE))  # Advance(a, b), Save(b)
                push((a, m, c))
                a, l, c = b, l - m, c - 1
            else:  # Advance(a, b), Adjoint(b), Restore(a)
                ext((b << 3, ADJOINT, (a * s + s - c) << 3 | RESTORE))
                l = m
        if l > c + 1:  # c == 1: x_a is the only slot left (NOTE [ Binomial reversal ] Rule 2).
            v = (a * s + s - 1) << 3
            for j in range(a + l - 1, a, -1):
                ext((j << 3, ADJOINT, v | RESTORE))  # Advance(a, j), Adjoint(j), Restore(a)
            ext((v | FREE, ADJOINT))
        elif l == 1:  # x_a was restored just before: this was its last use.  # x_a was restored just before: this was its last use.
            ext(((a * s + s - c) << 3 | FREE, ADJOINT))
        else:  # l <= c + 1 (t = 1): keep every state, then reverse them (NOTE [ Binomial reversal ] Rule 7).
            k = s - c - a  # slot of state j
            for j in range(a + 1, a + l - 1):
                ext((j << 3, (j + k) << 3 | SAVE))  # Advance(j-1, j), Save(j)
            ext(((a + l - 1) << 3, ADJOINT))  # Advance(a+l-2, a+l-1), Adjoint(a+l-1)
            for j in range(a + l - 2, a - 1, -1):
                v = (j * s + j + k) << 3
                ext((v | RESTORE, v | FREE, ADJOINT))
        if not stack:
            break
        a, l, c = pop()
        put((a * s + s - c) << 3 | RESTORE)
    # The first Adjoint is Adjoint(n-1), reached after the first sweep (NOTE [ Schedule actions ] Rule 4).
    out.insert(out.index(ADJOINT), END_FORWARD)
    put(END)
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
        check_steps_snapshots_tier(self.n_steps, self.snapshots, self.tier)

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

    def pack(self) -> PackedSchedule:
        """Pack the schedule: O(1) integer work per action; iterate the result for actions."""
        s = self.slots_used
        return PackedSchedule(binomial_codes(self.n_steps, s), (self.tier,) * s)
