"""``Auto``: a schedule sized from a store's budgets, decided when the loop starts."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from torchckpt._errors import CheckpointError
from torchckpt.codecs.base import Codec, Packed
from torchckpt.codecs.blob import Blob
from torchckpt.schedules import Multistage, Revolve, Tier, Uniform
from torchckpt.schedules.schedule import Schedule

__all__ = ["Auto", "auto_schedule"]


@dataclass(frozen=True)
class Auto:
    """``checkpointed_loop(schedule=Auto())``: size the schedule from the store's budgets.

    Revolve (or ``Uniform`` with ``kind=Uniform``) over as many snapshots as the store's GPU
    budget (beyond the cache slots) and host pool hold (``auto_schedule``). With a
    ``Store(codec=...)`` a snapshot counts at the compressed size of the initial state plus
    ``margin`` (a variable-rate codec's later states may compress worse): compression buys
    snapshots, hence less recomputation.

    Args:
        kind: ``Revolve`` (default) or ``Uniform``.
        margin: headroom on the compressed size of the first state (>= 0).

    Example::

        >>> Auto().resolve(100, snapshot_bytes=1 << 20, gpu_bytes=8 << 20, host_bytes=0, slots=4)
        Revolve(n_steps=100, snapshots=4, tier=Tier.GPU)
    """

    kind: type[Revolve] | type[Uniform] = Revolve
    margin: float = 0.25

    def __post_init__(self) -> None:
        if self.kind not in (Revolve, Uniform):
            raise TypeError(f"torchckpt: Auto(kind=...) takes Revolve or Uniform, got {self.kind!r}.")
        if not isinstance(self.margin, (int, float)) or isinstance(self.margin, bool) or not self.margin >= 0:
            raise ValueError(f"torchckpt: Auto(margin=...) must be a number >= 0, got {self.margin!r}; e.g. margin=0.25.")

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

    def resolve(self, n_steps: int, snapshot_bytes: int, gpu_bytes: int, host_bytes: int, slots: int) -> Schedule:
        """The schedule for these budgets (``auto_schedule``)."""
        return auto_schedule(n_steps, snapshot_bytes, gpu_bytes, host_bytes, slots, kind=self.kind)


def auto_schedule(n_steps: int, snapshot_bytes: int, gpu_bytes: int, host_bytes: int, slots: int = 4,
                  kind: type[Revolve] | type[Uniform] = Revolve) -> Schedule:
    """The schedule ``Auto`` picks: Revolve over as many snapshots as the budgets hold.

    GPU snapshots get what the GPU budget holds beyond ``slots`` cache slots; host snapshots
    what the host budget holds. With room for every step on the GPU nothing is recomputed.
    ``kind=Uniform`` sizes a ``Uniform`` schedule instead (``Auto(kind=Uniform)``):
    as many snapshots as the tier with more room holds (GPUZIP: Uniform gains from more snapshots).

    Args:
        n_steps: loop length.
        snapshot_bytes: bytes of one state.
        gpu_bytes: GPU memory the snapshots may use (cache slots included).
        host_bytes: host memory the snapshots may use.
        slots: GPU cache slots in front of the host tier.
        kind: ``Revolve`` (default) or ``Uniform``.

    Returns:
        ``Revolve`` (one tier), ``Multistage`` (GPU and host) or, with ``kind=Uniform``, ``Uniform``.
    """
    if snapshot_bytes <= 0:
        raise ValueError(f"torchckpt: snapshot_bytes must be > 0, got {snapshot_bytes}.")
    if kind not in (Revolve, Uniform):
        raise TypeError(f"torchckpt: auto_schedule(kind=...) takes Revolve or Uniform, got {kind!r}.")
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
    if host == 0:
        if gpu == 0:
            raise CheckpointError(
                f"torchckpt: no room for even one snapshot of {snapshot_bytes} bytes (GPU budget {gpu_bytes}, "
                f"host budget {host_bytes}); give the Store a larger gpu_bytes or HostPool capacity."
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
