"""``AutoSchedule``: a schedule sized from a store's budgets, decided when the loop starts.

# NOTE [ Auto schedule ]
# 1. Snapshots the budgets hold: GPU ones what the GPU budget holds beyond the ``slots``
#    cache slots, host ones what the host pool's cap holds, disk ones (with a disk tier:
#    ``Store(disk=...)`` / ``SnapshotStore(disk=...)``) what ``AutoSchedule(disk_bytes=...)`` holds,
#    by default half the free space of the tier's file system when the loop starts. With a
#    codec a snapshot counts at its compressed size plus ``margin``.
# 2. Revolve over the GPU alone when it holds every step; else Revolve over GPU and host
#    (``Multistage``). The disk is used only when GPU and host together hold fewer than the
#    n_steps - 1 slots that make every step advance once: then ``Multistage`` over the three
#    tiers. A disk snapshot passes through a host block on its way to and from its file (NOTE
#    [ Snapshot disk tier ] Rules 1-2), so ``slots`` snapshots' worth of the host budget stay free
#    for those in flight (room, not a bound: a burst of disk saves faster than the disk takes
#    them can pass the pool's cap, whose blocks then go pageable), and the disk gets as many
#    slots as close the gap to n_steps - 1 (and it holds). The disk is used only if that adds slots, so the forward advances drop to
#    F(n, gpu + host' + disk), fewer than Revolve over GPU and host alone (NOTE [ Binomial
#    reversal ]).
# 3. The tiers are ranked by bandwidth (NOTE [ Multi-tier Revolve ] Rule 4: the busiest slots
#    on the fastest tier): ``AutoSchedule(bandwidths=...)`` if given, else measured the first time the
#    disk is needed, once per process (NOTE [ Tier bandwidths ], memory/bandwidth.py). Ties, and
#    no rates at all (``auto_schedule`` without ``bandwidths``), rank host above disk.
# 4. ``kind=Uniform`` sizes one tier, GPU or host, whichever holds more; it never uses the disk.
# 5. Known gap: the disk slots are used whenever GPU and host are short; whether a disk round
#    trip beats recomputing the steps it saves (it needs the step's time, which ``AutoSchedule`` does not
#    know) is not weighed. On a slow disk, pass ``AutoSchedule(disk_bytes=0)`` or a smaller budget.
"""
from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from torchckpt._errors import CheckpointError
from torchckpt.codecs.base import Codec, Packed
from torchckpt.codecs.blob import Blob
from torchckpt.memory import DiskTier, HostPoolBase
from torchckpt.memory.bandwidth import tier_bandwidths
from torchckpt.schedules import Multistage, Revolve, Tier, Uniform
from torchckpt.schedules.schedule import Schedule

__all__ = ["AutoSchedule", "auto_schedule"]


def _check_bandwidths(where: str, bw: object) -> Mapping[Tier, float] | None:
    if bw is None:
        return None
    if not isinstance(bw, Mapping) or set(bw) != {Tier.HOST, Tier.DISK} or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in bw.values()):
        raise ValueError(f"torchckpt: {where}(bandwidths=...) must map Tier.HOST and Tier.DISK to positive rates in "
                         f"bytes/s, got {bw!r}; pass e.g. bandwidths={{Tier.HOST: 20e9, Tier.DISK: 2e9}}, or None "
                         "to measure them.")
    return MappingProxyType({t: float(v) for t, v in bw.items()})


@dataclass(frozen=True)
class AutoSchedule:
    """``checkpointed_loop(schedule=AutoSchedule())``: size the schedule from the store's budgets (NOTE [ Auto schedule ]).

    Revolve (or ``Uniform`` with ``kind=Uniform``) over as many snapshots as the store's GPU
    budget (beyond the cache slots) and host pool hold (``auto_schedule``); with a disk tier
    (the store's ``disk=``) and GPU and host short, ``Multistage`` over GPU, host and disk, the
    busiest slots on the fastest tier by measured bandwidth. With a ``Store(codec=...)`` a
    snapshot counts at the compressed size of the initial state plus ``margin`` (a
    variable-rate codec's later states may compress worse): compression buys snapshots, hence
    less recomputation.

    Args:
        kind: ``Revolve`` (default) or ``Uniform``.
        margin: headroom on the compressed size of the first state (>= 0).
        disk_bytes: what disk snapshots may take (bytes); ``None``: half the free space of the
            disk tier's file system. ``0`` keeps the schedule off the disk.
        bandwidths: ``{Tier.HOST: ..., Tier.DISK: ...}`` round-trip rates in bytes/s that rank
            the tiers (NOTE [ Tier bandwidths ] Rule 1); ``None``: measured when the disk is needed.

    Example::

        >>> AutoSchedule().resolve(100, snapshot_bytes=1 << 20, gpu_bytes=8 << 20, host_bytes=0, slots=4)
        Revolve(n_steps=100, snapshots=4, tier=Tier.GPU)
        >>> AutoSchedule(bandwidths={Tier.HOST: 20e9, Tier.DISK: 2e9}).resolve(
        ...     100, 1 << 20, gpu_bytes=6 << 20, host_bytes=6 << 20, slots=4, disk_bytes=10 << 20).capacity
        {Tier.GPU: 2, Tier.HOST: 2, Tier.DISK: 10}
    """

    kind: type[Revolve] | type[Uniform] = Revolve
    margin: float = 0.25
    disk_bytes: int | None = None
    bandwidths: Mapping[Tier, float] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in (Revolve, Uniform):
            raise TypeError(f"torchckpt: AutoSchedule(kind=...) takes Revolve or Uniform, got {self.kind!r}.")
        if not isinstance(self.margin, (int, float)) or isinstance(self.margin, bool) or not self.margin >= 0:
            raise ValueError(f"torchckpt: AutoSchedule(margin=...) must be a number >= 0, got {self.margin!r}; e.g. margin=0.25.")
        if self.disk_bytes is not None and (not isinstance(self.disk_bytes, int) or isinstance(self.disk_bytes, bool)
                                            or self.disk_bytes < 0):
            raise ValueError(f"torchckpt: AutoSchedule(disk_bytes=...) must be an int >= 0 (bytes) or None, got "
                             f"{self.disk_bytes!r}; pass e.g. disk_bytes=100 << 30, or None for half the free space.")
        object.__setattr__(self, "bandwidths", _check_bandwidths("AutoSchedule", self.bandwidths))

    def snapshot_bytes(self, flat: list[torch.Tensor], codec: Codec | None) -> int:
        """Bytes one snapshot of ``flat`` takes: as it is, or compressed by ``codec`` plus ``margin``."""
        return self.estimate(flat, codec)[0]

    def estimate(self, flat: list[torch.Tensor], codec: Codec | None) -> tuple[int, list[Packed] | None]:
        """``snapshot_bytes`` and, with a codec, the compression it made (for the first save to reuse)."""
        if codec is None:
            return sum(t.numel() * t.element_size() for t in flat), None
        with torch.no_grad():
            packs = [codec.compress(t.detach()) for t in flat]
        return int(Blob(packs).nbytes * (1.0 + self.margin)), packs

    def resolve(self, n_steps: int, snapshot_bytes: int, gpu_bytes: int, host_bytes: int, slots: int,
                disk: DiskTier | None = None, host: HostPoolBase | None = None, device: torch.device | None = None,
                disk_bytes: int | None = None) -> Schedule:
        """The schedule for these budgets (``auto_schedule``; NOTE [ Auto schedule ]).

        Args:
            n_steps, snapshot_bytes, gpu_bytes, host_bytes, slots: as for ``auto_schedule``.
            disk: the store's disk tier (``None``, or closed: no disk, whatever ``AutoSchedule(disk_bytes=...)`` says).
            host, device: the store's host pool and device, for measuring the host link (NOTE [ Auto schedule ] Rule 3).
            disk_bytes: the disk budget, overriding ``AutoSchedule(disk_bytes=...)`` and the tier's free space.

        Returns:
            A schedule.
        """
        if disk is not None and disk.closed:
            disk = None
        if disk_bytes is not None:
            room = disk_bytes
        elif disk is None:
            room = 0  # no tier: AutoSchedule(disk_bytes=...) has nothing to spend
        else:
            room = self.disk_bytes if self.disk_bytes is not None else shutil.disk_usage(disk.root).free // 2
        bw = self.bandwidths
        if bw is None and self.kind is Revolve and _disk_slots(
                n_steps, snapshot_bytes, gpu_bytes, host_bytes, slots, room)[1] > 0:
            bw = self._measure(disk, host, device, snapshot_bytes)
        return auto_schedule(n_steps, snapshot_bytes, gpu_bytes, host_bytes, slots, kind=self.kind,
                             disk_bytes=room, bandwidths=bw)

    @staticmethod
    def _measure(disk: DiskTier | None, host: HostPoolBase | None, device: torch.device | None,
                 nbytes: int) -> Mapping[Tier, float] | None:
        """NOTE [ Auto schedule ] Rule 3: the tiers' rates, measured (cached once per process), or ``None`` with nothing
        to measure."""
        if disk is None or host is None:
            return None
        return tier_bandwidths(device if device is not None else torch.device("cpu"), host, disk, nbytes)


def _disk_slots(n_steps: int, snapshot_bytes: int, gpu_bytes: int, host_bytes: int, slots: int,
                disk_bytes: int) -> tuple[int, int]:
    """NOTE [ Auto schedule ] Rule 2: (host slots, disk slots), the disk's closing the gap to n_steps - 1 slots
    ((host, 0) when GPU and host hold enough)."""
    gpu = max(0, gpu_bytes // snapshot_bytes - slots)
    host = host_bytes // snapshot_bytes
    need = max(n_steps - 1, 1)
    if gpu >= n_steps or gpu + host >= need or disk_bytes < snapshot_bytes:
        return host, 0
    kept = max(0, host - slots)  # room for the disk snapshots in flight
    disk = min(disk_bytes // snapshot_bytes, need - gpu - kept)
    return (kept, disk) if kept + disk > host else (host, 0)  # the disk only if it adds slots


def auto_schedule(n_steps: int, snapshot_bytes: int, gpu_bytes: int, host_bytes: int, slots: int = 4,
                  kind: type[Revolve] | type[Uniform] = Revolve, disk_bytes: int = 0,
                  bandwidths: Mapping[Tier, float] | None = None) -> Schedule:
    """The schedule ``AutoSchedule`` picks: Revolve over as many snapshots as the budgets hold (NOTE [ Auto schedule ]).

    GPU snapshots get what the GPU budget holds beyond ``slots`` cache slots; host snapshots
    what the host budget holds; disk snapshots, only when those two hold fewer than
    ``n_steps - 1``, what closes the gap and ``disk_bytes`` holds (the host then keeps
    ``slots`` snapshots' worth free for disk snapshots in flight). With room for every step on
    the GPU nothing is recomputed. ``kind=Uniform`` sizes a ``Uniform`` schedule instead
    (``AutoSchedule(kind=Uniform)``): as many snapshots as the tier with more room holds (GPUZIP:
    Uniform gains from more snapshots), GPU or host.

    Args:
        n_steps: loop length.
        snapshot_bytes: bytes of one state.
        gpu_bytes: GPU memory the snapshots may use (cache slots included).
        host_bytes: host memory the snapshots may use.
        slots: GPU cache slots in front of the host tier.
        kind: ``Revolve`` (default) or ``Uniform``.
        disk_bytes: disk space the snapshots may use (0: no disk tier).
        bandwidths: ``{Tier.HOST: ..., Tier.DISK: ...}`` round-trip bytes/s ranking the two
            (NOTE [ Auto schedule ] Rule 3); ``None``: host above disk.

    Returns:
        ``Revolve`` (one tier), ``Multistage`` (GPU and host, and disk when they are short) or,
        with ``kind=Uniform``, ``Uniform``.

    Example::

        >>> auto_schedule(100, 1, gpu_bytes=6, host_bytes=7, slots=4, disk_bytes=1000)
        Multistage(n_steps=100, gpu_slots=2, host_slots=3, disk_slots=94, ranking=(Tier.GPU, Tier.HOST, Tier.DISK))
    """
    if snapshot_bytes <= 0:
        raise ValueError(f"torchckpt: snapshot_bytes must be > 0, got {snapshot_bytes}.")
    if kind not in (Revolve, Uniform):
        raise TypeError(f"torchckpt: auto_schedule(kind=...) takes Revolve or Uniform, got {kind!r}.")
    if isinstance(disk_bytes, bool) or not isinstance(disk_bytes, int) or disk_bytes < 0:
        raise ValueError(f"torchckpt: auto_schedule(disk_bytes=...) must be an int >= 0 (bytes), got {disk_bytes!r}.")
    bw = _check_bandwidths("auto_schedule", bandwidths)
    gpu = max(0, gpu_bytes // snapshot_bytes - slots)
    host = host_bytes // snapshot_bytes
    if kind is Uniform:
        if gpu == 0 and host == 0:
            raise CheckpointError(
                f"torchckpt: no room for even one snapshot of {snapshot_bytes} bytes (GPU budget {gpu_bytes}, "
                f"host budget {host_bytes}); give the Store a larger gpu_bytes or HostPool capacity."
            )
        tier = Tier.GPU if gpu >= min(host, n_steps) else Tier.HOST
        return Uniform(n_steps, min(n_steps, gpu if tier is Tier.GPU else host), tier=tier)
    if gpu >= n_steps:
        return Revolve(n_steps, n_steps, tier=Tier.GPU)
    host_slots, disk = _disk_slots(n_steps, snapshot_bytes, gpu_bytes, host_bytes, slots, disk_bytes)
    if disk > 0:
        ranking = (Tier.GPU, Tier.HOST, Tier.DISK)
        if bw is not None and bw[Tier.DISK] > bw[Tier.HOST]:  # NOTE [ Auto schedule ] Rule 3: ties rank host first
            ranking = (Tier.GPU, Tier.DISK, Tier.HOST)
        return Multistage(n_steps, gpu_slots=gpu, host_slots=host_slots, disk_slots=disk, ranking=ranking)
    if host == 0:
        if gpu == 0:
            raise CheckpointError(
                f"torchckpt: no room for even one snapshot of {snapshot_bytes} bytes (GPU budget {gpu_bytes}, "
                f"host budget {host_bytes}, disk budget {disk_bytes}); give the Store a larger gpu_bytes or "
                "HostPool capacity, or a disk tier (Store(disk=...))."
            )
        return Revolve(n_steps, gpu, tier=Tier.GPU)
    return Multistage(n_steps, gpu_slots=gpu, host_slots=min(host, n_steps - gpu))


def _snapshot_bytes(flat: list[torch.Tensor], codec: Codec | None, margin: float = 0.25) -> int:
    """Bytes one snapshot of ``flat`` takes: as it is, or compressed by ``codec`` (with a margin).

    With a codec the estimate comes from compressing the initial state once: a variable-rate
    codec's later states may compress worse (NOTE [ Snapshot store ] Rule 9), hence the margin.
    """
    if codec is None:
        return sum(t.numel() * t.element_size() for t in flat)
    with torch.no_grad():
        packs = [codec.compress(t.detach()) for t in flat]
    return int(Blob(packs).nbytes * (1.0 + margin))
