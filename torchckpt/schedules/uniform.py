"""Uniform: evenly spaced snapshots; each adjoint step recomputes from the nearest one.

The simplest schedule, and one of the three that GPUZIP (Maltempi et al., 2025) caches
and prefetches (with Revolve and zCut).

# NOTE [ Uniform checkpointing ]
# Conventions of NOTE [ Schedule actions ].
# 1. With s slots the forward sweep saves the states 0, k, 2k, ... up to n-2, with
#    k = ceil((n-1)/s), so at most s snapshots are held (state n-1 is the current state at
#    ``EndForward`` and needs none).
# 2. Adjoint step i < n-1 restores the snapshot p = k*floor(i/k) and advances i - p steps.
#    The snapshot is freed at its last use (i == p).
# 3. Forward advances: (n-1) + sum over i < n-1 of (i mod k), about n*(1 + k/2): cheap in
#    memory traffic, expensive in recomputation; Revolve with the same s is never worse.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torchckpt.schedules.actions import Tier
from torchckpt.schedules.packed import PackedSchedule, PackedBuilder
from torchckpt.schedules.schedule import check_steps_snapshots_tier, Schedule

__all__ = ["Uniform"]


@dataclass(frozen=True, slots=True)
class Uniform(Schedule):
    """Evenly spaced snapshots; reverse recomputes from the nearest (NOTE [ Uniform checkpointing ]).

    Args:
        n_steps: number of forward steps to reverse (>= 1).
        snapshots: snapshot slots, the one holding x0 included (>= 1).
        tier: where the snapshots are kept.

    Returns:
        A schedule; iterate it for its actions.

    Example::

        >>> Uniform(8, 2).interval
        4
    """

    n_steps: int
    snapshots: int
    tier: Tier = Tier.GPU

    def __post_init__(self) -> None:
        check_steps_snapshots_tier(self.n_steps, self.snapshots, self.tier)

    @property
    def interval(self) -> int:
        """Steps between snapshots, ``k`` of NOTE [ Uniform checkpointing ] Rule 1 (at least 1)."""
        return max(1, -(-(self.n_steps - 1) // self.snapshots))

    @property
    def capacity(self) -> Mapping[Tier, int]:
        """``{tier: snapshots}``."""
        return {self.tier: self.snapshots}

    def pack(self) -> PackedSchedule:
        """Pack the schedule; iterate the result for actions."""
        n, k = self.n_steps, self.interval
        b = PackedBuilder((self.tier,))
        for p in range(0, n - 1, k):  # NOTE [ Uniform checkpointing ] Rule 1
            if p:
                b.advance(p)
            b.save()
        if n > 1:
            b.advance(n - 1)
        b.end_forward()
        b.adjoint()  # Adjoint(n-1) from the current state.
        for i in range(n - 2, -1, -1):  # NOTE [ Uniform checkpointing ] Rule 2
            p = i - i % k
            b.restore(p)
            if i > p:
                b.advance(i)
            else:
                b.free(p)
            b.adjoint()
        return b.build()
