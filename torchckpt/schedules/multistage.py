"""Multistage: Revolve over GPU and host slots, placed to move the fewest snapshots.

Stumm, P. and Walther, A. (2009), "MultiStage approaches for optimal offline
checkpointing", SIAM J. Sci. Comput. 31(3), 1946-1967, study the same question: the
recomputation of single-level Revolve with the slots of two levels, the slower level
used as little as possible.

# NOTE [ Two-tier Revolve ]
# 1. The actions are Revolve's with s = gpu_slots + host_slots (NOTE [ Binomial reversal ]),
#    so forward advances are the single-level optimum F(n, s), whatever the tiers.
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
# 4. Known gap: placing each snapshot (not each slot) by weighted interval scheduling, or
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

__all__ = ["Multistage", "slot_traffic"]


def slot_traffic(codes: list[int], n_slots: int) -> list[int]:
    """Saves + restores of each slot class in packed Revolve codes (Rule 3).

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


@dataclass(frozen=True, slots=True)
class Multistage(Schedule):
    """Revolve over GPU and host slots, with the busiest slots on the GPU (NOTE [ Two-tier Revolve ]).

    Args:
        n_steps: number of forward steps to reverse (>= 1).
        gpu_slots: snapshot slots in GPU memory (>= 0).
        host_slots: snapshot slots in host memory (>= 0; gpu_slots + host_slots >= 1).

    Returns:
        A schedule; iterate it for its actions.

    Example::

        >>> m = Multistage(100, gpu_slots=2, host_slots=3)
        >>> m.forward_steps, m.slot_tiers
        (316, (Tier.HOST, Tier.HOST, Tier.HOST, Tier.GPU, Tier.GPU))
    """

    n_steps: int
    gpu_slots: int
    host_slots: int
    _tiers: tuple[Tier, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        check_int("n_steps", self.n_steps, 1, "pass the number of forward steps to reverse")
        check_int("gpu_slots", self.gpu_slots, 0, "pass how many snapshots fit on the GPU")
        check_int("host_slots", self.host_slots, 0,
                  "pass how many snapshots fit in host memory")
        if self.gpu_slots + self.host_slots < 1:
            raise ValueError(
                "torchckpt: Multistage needs at least one snapshot slot (for x0), found "
                "gpu_slots=0 and host_slots=0; pass gpu_slots >= 1 or host_slots >= 1."
            )
        s = self.slots_used
        traffic = slot_traffic(binomial_codes(self.n_steps, s), s)
        busiest = sorted(range(s), key=lambda k: (-traffic[k], k))[: self.gpu_slots]
        gpu = set(busiest)
        object.__setattr__(
            self, "_tiers", tuple(Tier.GPU if k in gpu else Tier.HOST for k in range(s))
        )

    @property
    def slots_used(self) -> int:
        """Slots Revolve actually needs: ``min(gpu + host, max(n_steps - 1, 1))``."""
        return min(self.gpu_slots + self.host_slots, max(self.n_steps - 1, 1))

    @property
    def slot_tiers(self) -> tuple[Tier, ...]:
        """Tier of each Revolve slot, x0's slot first (Rule 3)."""
        return self._tiers

    @property
    def capacity(self) -> Mapping[Tier, int]:
        """``{Tier.GPU: gpu_slots, Tier.HOST: host_slots}``."""
        return {Tier.GPU: self.gpu_slots, Tier.HOST: self.host_slots}

    @property
    def forward_steps(self) -> int:
        """Forward advances: single-level Revolve's optimum with all slots (Rule 1)."""
        return optimal_forward_steps(self.n_steps, self.gpu_slots + self.host_slots)

    def pack(self) -> PackedSchedule:
        """Pack the schedule; iterate the result for actions."""
        return PackedSchedule(binomial_codes(self.n_steps, self.slots_used), self._tiers)
