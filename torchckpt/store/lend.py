"""The one place a run (an adjoint loop or scan, ``run_schedule``, a step of ``checkpoint_chain``) gets the
``SnapshotStore`` its snapshots go to.

# NOTE [ Lending a snapshot store ]
# 1. A ``SnapshotStore`` passed by the caller is used as it is (its device, slots, host pool, codec, disk tier,
#    peers): the run neither owns nor closes it.
# 2. A training ``Store`` lends its settings: a new ``SnapshotStore`` on the store's device with the run's slots,
#    the store's host pool, codec and disk tier (``Tier.DISK`` snapshots go to files there, NOTE [ Snapshot
#    store ]). The run owns it and closes it when it ends (or when it is dropped without a backward).
# 3. No store: a new ``SnapshotStore`` on the run's device with the run's slots and the process's shared host pool
#    (``shared_host_pool``: touched and registered once per process, not once per run); no codec, no disk tier
#    (``Tier.DISK`` snapshots then stay in host memory). The run owns it.
"""
from __future__ import annotations

import torch

from torchckpt.memory import shared_host_pool
from torchckpt.store.saved import Store
from torchckpt.store.snapshots import SnapshotStore

__all__ = ["lend_snapshot_store"]


def lend_snapshot_store(store: Store | SnapshotStore | None, device: torch.device,
                        slots: int) -> tuple[SnapshotStore, bool]:
    """The ``SnapshotStore`` a run keeps its snapshots in, and whether the run owns it (NOTE [ Lending a
    snapshot store ]).

    Args:
        store: the caller's ``SnapshotStore`` (used as is), a training ``Store`` (whose device, host pool, codec
            and disk tier the new store takes), or ``None``.
        device: the run's device (where its states live), used when ``store`` is ``None``.
        slots: the device slots of a store made here.

    Returns:
        ``(snapshot_store, owned)``: ``owned`` is True when the run made it and must close it.

    Example::

        >>> import torch
        >>> from torchckpt.store import Store
        >>> train = Store("cpu")
        >>> snaps, owned = lend_snapshot_store(train, torch.device("cpu"), slots=2)
        >>> owned, snaps.host is train.host, snaps.calibrate([torch.zeros(4)])
        (True, True, 2)
        >>> snaps.close()
    """
    if isinstance(store, SnapshotStore):
        return store, False
    if isinstance(store, Store):
        return SnapshotStore(store.device, slots=slots, host=store.host, codec=store.codec, disk=store.disk), True
    if store is not None:
        raise TypeError(f"torchckpt: expected a torchckpt.Store, a torchckpt.SnapshotStore or None for the snapshots, "
                        f"got {type(store).__name__}; pass one of those.")
    host = shared_host_pool(pin=device.type == "cuda", device=device)
    return SnapshotStore(device, slots=slots, host=host), True
