"""The stores: where saved tensors (``Store``) and snapshots (``SnapshotStore``) live between
forward and backward: a GPU cache in front of a host pool, with prefetch planned by a dry run.

``saved.py`` holds ``Store`` (saved-tensor hooks), ``snapshots.py`` ``SnapshotStore`` (a
schedule's snapshots), ``streams.py`` the mover both use for every device/host copy,
``identity.py`` the rules that make an unpacked tensor the one autograd saved, ``stats.py``
what the stores count, ``lend.py`` the one place a run gets its ``SnapshotStore``; ``PeerSpill``
(``snapshot_peer.py``) is what ``SnapshotStore(peers=...)`` takes. Block recomputation lives in
``torchckpt.recompute``, above this package.
"""
from torchckpt.store.saved import Store, default_store
from torchckpt.store.snapshot_peer import PeerSpill
from torchckpt.store.snapshots import SnapshotStore
from torchckpt.store.stats import SnapshotStats, Stats

__all__ = ["PeerSpill", "SnapshotStats", "SnapshotStore", "Stats", "Store", "default_store"]
