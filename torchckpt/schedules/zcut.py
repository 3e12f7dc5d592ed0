"""ZCut: two-level checkpointing, segment boundaries forward, whole segments in reverse.

The zCut schedule that GPUZIP (Maltempi et al., 2025) caches and prefetches; the
two-level idea is the sqrt(n) checkpointing of Chen et al. (2016), "Training deep nets
with sublinear memory cost".

# NOTE [ ZCut checkpointing ]
# Conventions of NOTE [ Schedule actions ]. Segment length L, boundaries b_j = j*L for
# j < S = ceil(n/L); the last segment has n - (S-1)*L steps.
# 1. Forward: save every boundary up to state n-2, and every state of the last segment up
#    to n-2 (that segment is reversed first, so it is kept on the first sweep).
# 2. Reverse, last segment first: the last segment straight from its saved states; every
#    other segment: restore its boundary, advance through it saving each inner state
#    b_j+1 .. b_j+L-2, reach b_j+L-1, then adjoint steps down to b_j, each from its state
#    (the current one, or a restore that frees the snapshot).
# 3. Forward advances: (n-1) + (S-1)*(L-1), below 2n whatever L.
#    Peak snapshots: max(S + len_last - 2, S - 1 + max(L-2, 0)) (the second term only when
#    S >= 2): boundaries still held plus one segment's states.
# 4. By default L minimises the peak (about 2*sqrt(n) slots, L near sqrt(n)); among equal
#    peaks, the fewest advances. With ``memory_slots`` L is the one with the fewest
#    advances whose peak fits (ties: smaller peak, then longer segments). ``segment``
#    fixes L (and, with ``memory_slots`` too, must fit it).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from math import isqrt

from torchckpt.schedules.actions import Tier
from torchckpt.schedules.packed import PackedSchedule, PackedBuilder
from torchckpt.schedules.schedule import Schedule, check_int

__all__ = ["ZCut", "zcut_cost"]


def zcut_cost(n_steps: int, segment: int) -> tuple[int, int]:
    """Forward advances and peak snapshots of ZCut with a given segment length (NOTE [ ZCut checkpointing ] Rule 3).

    Args:
        n_steps: number of forward steps (>= 1).
        segment: segment length L (>= 1).

    Returns:
        ``(forward_steps, peak_snapshots)``.

    Example::

        >>> zcut_cost(100, 10)
        (180, 18)
    """
    n, length = n_steps, segment
    s = -(-n // length)
    last = n - (s - 1) * length
    peak = s + last - 2
    if s >= 2:
        peak = max(peak, s - 1 + max(length - 2, 0))
    return (n - 1) + (s - 1) * (length - 1), peak


def _choose_segment(n: int, memory_slots: int | None) -> int:
    """NOTE [ ZCut checkpointing ] Rule 4."""
    if memory_slots is None:
        lengths = range(1, min(n, 2 * isqrt(n) + 2) + 1)  # the optimum is near sqrt(n)
        return min(lengths, key=lambda length: (*zcut_cost(n, length)[::-1], length))
    best_fit: tuple[int, int, int] | None = None
    least_peak = None
    for length in range(1, n + 1):
        fwd, peak = zcut_cost(n, length)
        if least_peak is None or peak < least_peak:
            least_peak = peak
        if peak <= memory_slots:
            key = (fwd, peak, -length)
            if best_fit is None or key < best_fit:
                best_fit = key
    if best_fit is None:
        raise ValueError(
            f"torchckpt: ZCut({n}, memory_slots={memory_slots}) cannot fit: expected "
            f"memory_slots >= {least_peak} (the smallest peak of any segment length for "
            f"{n} steps), found {memory_slots}; pass memory_slots >= {least_peak}, or use "
            "Revolve, which reverses any number of steps with any number of slots."
        )
    return -best_fit[2]


@dataclass(frozen=True, slots=True)
class ZCut(Schedule):
    """Two-level checkpointing: boundaries forward, whole segments in reverse (NOTE [ ZCut checkpointing ]).

    Args:
        n_steps: number of forward steps to reverse (>= 1).
        segment: segment length; by default chosen by NOTE [ ZCut checkpointing ] Rule 4.
        memory_slots: most snapshots held at once; picks the segment (NOTE [ ZCut checkpointing ] Rule 4).
        tier: where the snapshots are kept.

    Returns:
        A schedule; iterate it for its actions.

    Example::

        >>> z = ZCut(100)
        >>> z.segment_length, z.capacity[Tier.GPU]
        (10, 18)
    """

    n_steps: int
    segment: int | None = None
    memory_slots: int | None = None
    tier: Tier = Tier.GPU
    _length: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        n = check_int("n_steps", self.n_steps, 1, "pass the number of forward steps to reverse")
        if self.memory_slots is not None:
            check_int("memory_slots", self.memory_slots, 0,
                      "pass how many snapshots may be held at once, or None")
        if not isinstance(self.tier, Tier):
            raise TypeError(
                f"torchckpt: tier must be a Tier, found {type(self.tier).__name__} "
                f"{self.tier!r}; pass e.g. Tier.GPU or Tier.HOST."
            )
        if self.segment is None:
            length = _choose_segment(n, self.memory_slots)
        else:
            length = check_int("segment", self.segment, 1,
                               "pass a segment length in steps, or None to choose it")
            length = min(length, n)
            peak = zcut_cost(n, length)[1]
            if self.memory_slots is not None and peak > self.memory_slots:
                raise ValueError(
                    f"torchckpt: ZCut({n}, segment={self.segment}) holds {peak} snapshots "
                    f"at its peak, expected at most memory_slots={self.memory_slots}; pass "
                    "segment=None to choose a length that fits, or more memory_slots."
                )
        object.__setattr__(self, "_length", length)

    @property
    def segment_length(self) -> int:
        """The segment length L in use."""
        return self._length

    @property
    def capacity(self) -> Mapping[Tier, int]:
        """``{tier: peak snapshots}`` (NOTE [ ZCut checkpointing ] Rule 3)."""
        return {self.tier: zcut_cost(self.n_steps, self._length)[1]}

    @property
    def forward_steps(self) -> int:
        """Forward advances of this schedule (NOTE [ ZCut checkpointing ] Rule 3)."""
        return zcut_cost(self.n_steps, self._length)[0]

    def pack(self) -> PackedSchedule:
        """Pack the schedule; iterate the result for actions."""
        n, length = self.n_steps, self._length
        b = PackedBuilder((self.tier,))
        last = (n - 1) // length * length  # first state of the last segment
        # NOTE [ ZCut checkpointing ] Rule 1: boundaries, then every state of the last segment, up to state n-2.
        for p in range(0, n - 1):
            if p % length == 0 or p >= last:
                if p:
                    b.advance(p)
                b.save()
        if n > 1:
            b.advance(n - 1)
        b.end_forward()
        b.adjoint()
        for j in range(n - 2, last - 1, -1):
            b.restore(j)
            b.free(j)
            b.adjoint()
        # NOTE [ ZCut checkpointing ] Rule 2: the other segments, last first.
        for start in range(last - length, -1, -length):
            end = start + length  # exclusive
            b.restore(start)
            for j in range(start + 1, end - 1):
                b.advance(j)
                b.save()
            if length > 1:
                b.advance(end - 1)
                b.adjoint()
                for j in range(end - 2, start, -1):
                    b.restore(j)
                    b.free(j)
                    b.adjoint()
                b.restore(start)
            b.free(start)
            b.adjoint()
        return b.build()
