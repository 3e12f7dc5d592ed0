"""Multistage: Revolve over GPU, host and disk slots, placed to move the fewest snapshots.

Stumm, P. and Walther, A. (2009), "MultiStage approaches for optimal offline
checkpointing", SIAM J. Sci. Comput. 31(3), 1946-1967, study the same question: the
recomputation of single-level Revolve with the slots of two levels, the slower level
used as little as possible. A third level (disk) is placed the same way, the tiers ranked
fastest first as a multilayer buffer system's autotuner ranks its layers by measured
bandwidth (``AutoSchedule`` measures them: torchckpt/adjoint/auto.py).

# NOTE [ Multi-tier Revolve ]
# 1. The actions are Revolve's with s = gpu_slots + host_slots + disk_slots (NOTE [ Binomial
#    reversal ]), so forward advances are the single-level optimum F(n, s), whatever the tiers.
# 2. Revolve's slots are used like a stack: slot 0 holds x0, and a snapshot taken at
#    recursion depth d goes to slot d. Each slot is one physical location, so a slot's
#    tier is fixed for the whole schedule and the slot limits hold per tier.
# 3. A snapshot in a host slot costs one device-to-host copy per Save and one
#    host-to-device copy per Restore; in a GPU slot, none. So host transfers are the sum,
#    over host slots, of that slot's saves + restores. Counting each slot's saves and
#    restores on the planned schedule and giving the gpu_slots slots with the largest
#    counts to the GPU therefore minimises host transfers among all slot-to-tier
#    assignments (ties go to the shallower slot). Typically those are the deepest slots,
#    which are saved and restored most often and hold each snapshot briefly.
# 4. Three tiers (``disk_slots``): the slots are ranked by their counts, busiest first, and
#    handed out in that order to the tiers in ``ranking`` order (fastest first: GPU, HOST,
#    DISK unless told otherwise), each tier taking as many slots as it has. If a transfer
#    to or from the i-th tier of ``ranking`` costs c_i per snapshot, c_1 <= c_2 <= c_3 (the
#    GPU's is 0), the transfer cost is the sum over the slots of count * c of its tier,
#    and pairing the largest counts with the smallest costs minimises it over all
#    slot-to-tier assignments (rearrangement inequality); Rule 3 is its two-tier case.
#    When fewer slots are needed than the tiers hold (``slots_used``), the slowest tiers
#    go short first.
# 5. Known gap: placing each snapshot (not each slot) by weighted interval scheduling, or
#    choosing among equally fast Revolve splits by transfer cost (H-Revolve, Herrmann and
#    Pallez 2020), can move fewer snapshots; this schedule does neither.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torchckpt.schedules.actions import Tier
from torchckpt.schedules.packed import RESTORE, SAVE, PackedSchedule
from torchckpt.schedules.revolve import binomial_codes, optimal_forward_steps
from torchckpt.schedules.schedule import Schedule, check_int

__all__ = ["Multistage", "place_slots", "slot_traffic"]


def slot_traffic(codes: list[int], n_slots: int) -> list[int]:
    """Saves + restores of each slot class in packed Revolve codes (NOTE [ Multi-tier Revolve ] Rules 3 and 4).

    Args:
        codes: packed actions with one slot class per slot (``binomial_codes``).
        n_slots: number of slot classes.

    Returns:
        Per slot, how many snapshot copies it would cost on the host.

    Example::

        >>> from torchckpt.schedules.revolve import binomial_codes
        >>> slot_traffic(binomial_codes(10, 3), 3)
        [3, 5, 7]
    """
    traffic = [0] * n_slots
    for code in codes:
        op = code & 7
        if op == SAVE:
            traffic[code >> 3] += 1
        elif op == RESTORE:
            traffic[(code >> 3) % n_slots] += 1
    return traffic


_RANKING = (Tier.GPU, Tier.HOST, Tier.DISK)


def place_slots(traffic: list[int], counts: dict[Tier, int], ranking: tuple[Tier, ...] = _RANKING) -> tuple[Tier, ...]:
    """The tier of each slot: busiest slots to the fastest tiers (NOTE [ Multi-tier Revolve ] Rules 3 and 4).

    Args:
        traffic: per slot, its saves + restores (``slot_traffic``).
        counts: slots each tier holds; their sum must be at least ``len(traffic)``.
        ranking: the tiers, fastest first.

    Returns:
        Per slot, its tier.

    Example::

        >>> place_slots([3, 5, 7], {Tier.GPU: 1, Tier.HOST: 1, Tier.DISK: 1})
        (Tier.DISK, Tier.HOST, Tier.GPU)
    """
    order = sorted(range(len(traffic)), key=lambda k: (-traffic[k], k))  # ties: the shallower slot
    tiers: list[Tier | None] = [None] * len(traffic)
    i = 0
    for tier in ranking:
        for k in order[i : i + counts.get(tier, 0)]:
            tiers[k] = tier
        i += counts.get(tier, 0)
    if i < len(traffic):
        raise ValueError(f"torchckpt: {len(traffic)} slots but the tiers hold {i}; pass counts that hold every slot.")
    return tuple(t for t in tiers if t is not None)


@dataclass(frozen=True, slots=True)
class Multistage(Schedule):
    """Revolve over GPU, host and disk slots, the busiest slots on the fastest tier (NOTE [ Multi-tier Revolve ]).

    Args:
        n_steps: number of forward steps to reverse (>= 1).
        gpu_slots: snapshot slots in GPU memory (>= 0).
        host_slots: snapshot slots in host memory (>= 0).
        disk_slots: snapshot slots on disk (>= 0; gpu_slots + host_slots + disk_slots >= 1).
        ranking: the three tiers, fastest first (NOTE [ Multi-tier Revolve ] Rule 4); the default suits a disk tier
            behind host memory. ``AutoSchedule`` ranks them by measured bandwidth.

    Returns:
        A schedule; iterate it for its actions.

    Example::

        >>> m = Multistage(100, gpu_slots=2, host_slots=3)
        >>> m.forward_steps, m.slot_tiers
        (316, (Tier.HOST, Tier.HOST, Tier.HOST, Tier.GPU, Tier.GPU))
        >>> Multistage(100, gpu_slots=1, host_slots=2, disk_slots=2).slot_tiers
        (Tier.DISK, Tier.DISK, Tier.HOST, Tier.HOST, Tier.GPU)
    """

    n_steps: int
    gpu_slots: int
    host_slots: int
    disk_slots: int = 0
    ranking: tuple[Tier, ...] = _RANKING
    _tiers: tuple[Tier, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        check_int("n_steps", self.n_steps, 1, "pass the number of forward steps to reverse")
        check_int("gpu_slots", self.gpu_slots, 0, "pass how many snapshots fit on the GPU")
        check_int("host_slots", self.host_slots, 0,
                  "pass how many snapshots fit in host memory")
        check_int("disk_slots", self.disk_slots, 0, "pass how many snapshots fit on disk")
        if self.gpu_slots + self.host_slots + self.disk_slots < 1:
            raise ValueError(
                "torchckpt: Multistage needs at least one snapshot slot (for x0), found "
                "gpu_slots=0, host_slots=0 and disk_slots=0; pass gpu_slots >= 1 or host_slots >= 1."
            )
        ranking = tuple(self.ranking) if isinstance(self.ranking, (tuple, list)) else self.ranking
        if not (isinstance(ranking, tuple) and len(ranking) == len(_RANKING)
                and all(isinstance(t, Tier) for t in ranking) and set(ranking) == set(_RANKING)):
            raise ValueError(
                f"torchckpt: Multistage(ranking=...) must name each of Tier.GPU, Tier.HOST and Tier.DISK once, "
                f"fastest first; found {self.ranking!r}; pass e.g. ranking=(Tier.GPU, Tier.HOST, Tier.DISK)."
            )
        object.__setattr__(self, "ranking", ranking)
        s = self.slots_used
        traffic = slot_traffic(binomial_codes(self.n_steps, s), s)
        object.__setattr__(self, "_tiers", place_slots(traffic, dict(self.capacity), ranking))

    @property
    def slots_used(self) -> int:
        """Slots Revolve actually needs: ``min(gpu + host + disk, max(n_steps - 1, 1))``."""
        return min(self.gpu_slots + self.host_slots + self.disk_slots, max(self.n_steps - 1, 1))

    @property
    def slot_tiers(self) -> tuple[Tier, ...]:
        """Tier of each Revolve slot, x0's slot first (NOTE [ Multi-tier Revolve ] Rules 3 and 4)."""
        return self._tiers

    @property
    def capacity(self) -> Mapping[Tier, int]:
        """``{Tier.GPU: gpu_slots, Tier.HOST: host_slots, Tier.DISK: disk_slots}``."""
        return {Tier.GPU: self.gpu_slots, Tier.HOST: self.host_slots, Tier.DISK: self.disk_slots}

    @property
    def forward_steps(self) -> int:
        """Forward advances: single-level Revolve's optimum with all slots (NOTE [ Multi-tier Revolve ] Rule 1)."""
        return optimal_forward_steps(self.n_steps, self.gpu_slots + self.host_slots + self.disk_slots)

    def pack(self) -> PackedSchedule:
        """Pack the schedule; iterate the result for actions."""
        return PackedSchedule(binomial_codes(self.n_steps, self.slots_used), self._tiers)
