"""Every rank's overflow and spare memory, exchanged once, and the peer-spill plan all ranks compute alike.

# NOTE [ Capacity exchange ]
# 1. One collective: every rank of the group contributes ``(overflow, spare, host bandwidth, peer row)`` with a
#    single ``torch.distributed.all_gather_object``; nothing home-made for networking (DESIGN.md).
# 2. Every rank then runs the same pure-Python planner (``plan_spill``, or ``greedy_spill`` when asked) on the
#    same gathered lists, so every rank holds the same ``Spill`` with no second round (NOTE [ Peer spill ]).
#    Indices in the plan are ranks *within the group*, in group order.
# 3. A rank's peer row is its bandwidth to each rank of the group in bytes/s (0 for itself or no link). When it
#    is not given, every other rank gets ``DEFAULT_PEER_BANDWIDTH``: a placeholder (NVLink-class, 100 GB/s) until
#    the peer links are measured; pass measured rows for real plans.
# 4. Arguments are checked locally before the collective, and the gathered rows are checked by every rank alike
#    after it, so a bad argument raises on every rank (the planner's own check) rather than leaving one waiting.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from torchckpt._errors import CheckpointError
from torchckpt.schedules.spill import Spill, greedy_spill, plan_spill

__all__ = ["DEFAULT_PEER_BANDWIDTH", "SpillPlan", "exchange"]

DEFAULT_PEER_BANDWIDTH = 100e9
"""Bytes/s assumed to each peer when no row is given: a placeholder until measured
(NOTE [ Capacity exchange ] Rule 3)."""


@dataclasses.dataclass(frozen=True)
class SpillPlan:
    """The group's spill plan and this rank's place in it (NOTE [ Capacity exchange ]).

    Attributes:
        spill: the split of every rank's overflow, indexed by rank within the group.
        rank: this rank's index within the group.
        overflow: every rank's overflow bytes, as gathered.
        spare: every rank's spare bytes, as gathered.
    """

    spill: Spill
    rank: int
    overflow: tuple[int, ...]
    spare: tuple[int, ...]

    @property
    def to_host(self) -> float:
        """Bytes this rank sends to host memory."""
        return self.spill.to_host[self.rank]

    @property
    def to_peer(self) -> tuple[float, ...]:
        """Bytes this rank sends to each rank of the group."""
        return self.spill.to_peer[self.rank]

    @property
    def from_peer(self) -> tuple[float, ...]:
        """Bytes each rank of the group sends to this rank."""
        return tuple(row[self.rank] for row in self.spill.to_peer)


def _require_initialized(what: str) -> None:
    """Raise the torchckpt error for a collective called before ``init_process_group``."""
    if not (dist.is_available() and dist.is_initialized()):
        raise CheckpointError(f"torchckpt: {what} is a collective over torch.distributed, but no process group is "
                              "initialized; call torch.distributed.init_process_group(...) on every rank first.")


def exchange(overflow_bytes: int, spare_bytes: int, host_bandwidth: float,
             peer_bandwidth: Sequence[float] | None = None, *, group: Any = None,
             greedy: bool = False) -> SpillPlan:
    """Gather every rank's capacity and compute the group's spill plan (collective;
    NOTE [ Capacity exchange ] Rules 1-2).

    Args:
        overflow_bytes: bytes this rank's cache must move off.
        spare_bytes: bytes this rank can take from peers.
        host_bandwidth: this rank's host-link bandwidth, bytes/s (> 0).
        peer_bandwidth: this rank's bandwidth to each rank of the group, bytes/s (0 for itself or no link);
            ``None``: ``DEFAULT_PEER_BANDWIDTH`` to every other rank (a placeholder, NOTE [ Capacity exchange ] Rule 3).
        group: the process group; ``None``: the world.
        greedy: plan with ``greedy_spill`` instead of the min-time ``plan_spill``.

    Returns:
        The same ``SpillPlan`` on every rank, with this rank's index in the group.

    Example::

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> plan = exchange(8 << 30, 0, host_bandwidth=50e9)  # one rank: everything goes to host
        >>> plan.rank, round(plan.to_host) == 8 << 30, plan.to_peer
        (0, True, (0.0,))
        >>> dist.destroy_process_group()
    """
    _require_initialized("exchange")
    if isinstance(overflow_bytes, bool) or not isinstance(overflow_bytes, int) or overflow_bytes < 0:
        raise ValueError(f"torchckpt: exchange needs overflow_bytes as an int >= 0, got {overflow_bytes!r}.")
    if isinstance(spare_bytes, bool) or not isinstance(spare_bytes, int) or spare_bytes < 0:
        raise ValueError(f"torchckpt: exchange needs spare_bytes as an int >= 0, got {spare_bytes!r}.")
    if not host_bandwidth > 0:
        raise ValueError(f"torchckpt: exchange needs host_bandwidth in bytes/s > 0, got {host_bandwidth!r}.")
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if peer_bandwidth is None:
        row = [0.0 if j == rank else DEFAULT_PEER_BANDWIDTH for j in range(n)]
    else:
        row = [float(b) for b in peer_bandwidth]
        if len(row) != n or any(b < 0 for b in row):
            raise ValueError(f"torchckpt: exchange needs peer_bandwidth as one bandwidth >= 0 per rank of the group "
                             f"({n}), got {list(peer_bandwidth)!r}; pass 0 for this rank and for peers with no link.")
        row[rank] = 0.0
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, (overflow_bytes, spare_bytes, float(host_bandwidth), row), group=group)
    overflow = [int(g[0]) for g in gathered]
    spare = [int(g[1]) for g in gathered]
    host = [g[2] for g in gathered]
    peer = [g[3] for g in gathered]
    spill = (greedy_spill if greedy else plan_spill)(overflow, spare, host, peer)
    return SpillPlan(spill, rank, tuple(overflow), tuple(spare))
