"""What the stores count: ``Stats`` (``Store``) and ``SnapshotStats`` (``SnapshotStore``)."""
from __future__ import annotations

import dataclasses

from torchckpt._errors import format_bytes, format_bytes_apart
from torchckpt.memory import DiskStats, HostPoolStats


@dataclasses.dataclass(frozen=True)
class Stats:
    """What a store did since it was created (or since ``Store.reset_stats``).

    Times are seconds. On CUDA, ``late_wait_s`` and ``miss_wait_s`` come from device events:
    how long after the compute stream reached an unpack its tensor's host-to-device copy
    finished. ``eviction_wait_s`` is host time spent waiting for a device-to-host copy so
    that its GPU copy could be evicted (forward-side back-pressure). On CPU (the simulated
    store) copies are synchronous and the times are host times of those copies.

    Attributes:
        steps: completed steps (a step ends when all its entries are released).
        packed: tensors autograd saved through this store.
        kept: saved tensors kept by reference (parameters, buffers, small, other device).
        kept_bytes: their bytes.
        small / small_bytes: of them, those kept for being under the store's ``min_bytes``, and their bytes.
        deduplicated: saves served by an existing entry (another view of one storage).
        offloaded: entries copied device-to-host.
        offloaded_bytes: bytes of the entries copied device-to-host (before compression).
        compressed: of those entries, how many went through a codec.
        compressed_bytes: what the codec made of them (the bytes that crossed the link).
        loaded_bytes: bytes copied host-to-device (prefetches and loads on demand).
        cache_hits: unpacks served by a tensor resident since it was saved.
        prefetch_hits: unpacks served by a prefetch.
        late_prefetches: prefetches whose copy ended after the unpack needed it.
        late_wait_s: total lateness of those prefetches.
        misses: unpacks that loaded on demand.
        miss_wait_s: time the compute stream waited for those loads.
        evictions: entries evicted from the GPU cache.
        eviction_waits: evictions that had to wait for their device-to-host copy.
        eviction_wait_s: host time spent in those waits.
        plans: prefetch plans made.
        plan_divergences: steps whose trace left the plan (prefetch stopped for that step).
        trace_overflows: times the trace stopped because no step ended (overlapping graphs,
            NOTE [ Store ] Rule 10); no prefetch plan until every entry is released.
        gpu_peak_bytes: most bytes resident in the GPU cache at once.
        host: the host pool's occupancy.
        spilled / spilled_bytes: of the entries copied to host, those written to the disk tier
            instead, the host pool being at its cap (``Store(disk=...)``, NOTE [ Spill to disk ]),
            and the bytes written (compressed, with a codec).
        disk: the disk tier's counters since it was made (``Store(disk=...)``), else ``None``.
        min_bytes: the store's ``min_bytes`` (``Store(min_bytes=...)``).
    """

    steps: int = 0
    packed: int = 0
    kept: int = 0
    kept_bytes: int = 0
    small: int = 0
    small_bytes: int = 0
    deduplicated: int = 0
    offloaded: int = 0
    offloaded_bytes: int = 0
    compressed: int = 0
    compressed_bytes: int = 0
    loaded_bytes: int = 0
    cache_hits: int = 0
    prefetch_hits: int = 0
    late_prefetches: int = 0
    late_wait_s: float = 0.0
    misses: int = 0
    miss_wait_s: float = 0.0
    evictions: int = 0
    eviction_waits: int = 0
    eviction_wait_s: float = 0.0
    plans: int = 0
    plan_divergences: int = 0
    trace_overflows: int = 0
    spilled: int = 0
    spilled_bytes: int = 0
    gpu_peak_bytes: int = 0
    host: HostPoolStats | None = None
    disk: DiskStats | None = None
    min_bytes: int = 0

    @property
    def exposed_transfer_s(self) -> float:
        """Transfer time not hidden behind compute: late prefetches, loads on demand, eviction waits."""
        return self.late_wait_s + self.miss_wait_s + self.eviction_wait_s

    @property
    def unpacks(self) -> int:
        return self.cache_hits + self.prefetch_hits + self.misses

    def summary(self) -> str:
        """One line for logs and progress output; when tensors were saved but none moved, it says why.

        Example::

            >>> line = Stats(packed=3, kept=3, kept_bytes=3072).summary()
            >>> line[line.index("moved none"):line.index(":", line.index("moved none"))]
            'moved none of the 3 saved tensors (3.00 KiB)'
        """
        offloaded, loaded = format_bytes_apart(self.offloaded_bytes, self.loaded_bytes)
        line = (
            f"offloaded {offloaded} in {self.offloaded} tensors, "
            f"loaded {loaded}; unpacks: {self.cache_hits} cache hits, "
            f"{self.prefetch_hits} prefetch hits ({self.late_prefetches} late, {self.late_wait_s * 1e3:.1f} ms), "
            f"{self.misses} misses ({self.miss_wait_s * 1e3:.1f} ms); exposed transfer "
            f"{self.exposed_transfer_s * 1e3:.1f} ms"
        )
        small = ""
        if self.small:
            small = (f"; {self.small} of them ({format_bytes(self.small_bytes)}) under the store's min_bytes of "
                     f"{format_bytes(self.min_bytes)}: Store(min_bytes=0) moves small tensors too")
        if self.kept and self.kept == self.packed:  # every tensor the store was given stayed where it was
            return (f"{line}; moved none of the {self.kept} saved tensors ({format_bytes(self.kept_bytes)}): parameters, "
                    "buffers, other devices' tensors and tensors under the store's min_bytes stay where they are"
                    + small)
        if self.kept:
            return f"{line}; kept {self.kept} saved tensors ({format_bytes(self.kept_bytes)}) where they were{small}"
        return line


@dataclasses.dataclass(frozen=True)
class SnapshotStats:
    """What a snapshot store did. Times in seconds; on CUDA from device events.

    Attributes:
        saves: snapshots saved (all tiers); host_saves: of them, to an off-GPU tier.
        restores: snapshots restored; hits: off-GPU restores served by a slot; prefetch_hits: of them, those a
            copying prefetch brought into the slot (the others found the snapshot still there).
        prefetches: host-to-device prefetch copies; late_prefetches / late_wait_s: those that
            ended after the restore needed them, and by how much in total.
        misses: off-GPU restores loaded on demand; miss_wait_s: the compute stream's wait for them.
        save_waits / save_wait_s: saves that had to wait for their slot's previous flush.
        bytes_to_host / bytes_to_device: bytes copied each way.
        raw_bytes / packed_bytes: with a codec, the bytes of the snapshots saved and of their
            compressed form (both 0 without one); slot_grows: slots grown past ``slot_bytes``
            (NOTE [ Snapshot store ] Rule 9); size_waits: times the host waited for a compressed size that
            was not on the host yet (``defer_sizes``, NOTE [ Snapshot sizes ] Rule 3; a save never does).
        graph_saves / graph_captures: saves whose compression was a CUDA graph replayed, and the graphs captured
            (``SnapshotStore(graphs=True)``, NOTE [ Captured saves ]; both 0 without); graph_retries:
            captures that ran out of GPU memory and were made again after emptying the allocator's cache
            (NOTE [ Captured saves ] Rule 6).
        peer_saves / peer_bytes_sent: snapshots (and their bytes) this rank sent to peers instead of host
            (``SnapshotStore(peers=...)``, NOTE [ Snapshot peer tier ] Rules 1-6; all peer counters 0 without);
            peer_fetches / peer_bytes_fetched: of them, taken back (at a prefetch, or on demand at a restore,
            which then also counts as a miss); peer_drops: peer copies dropped unread (freed, saved again
            elsewhere, closed); peer_held_bytes: bytes of this store's copies its peers hold now.
        peer_actions: actions agreed with the other ranks (one metadata gather each,
            NOTE [ Snapshot peer tier ] Rule 1); peer_rounds: ``PeerTier`` rounds entered (its own part possibly empty);
            peer_wait_s: host time in both.
        disk: the disk tier's counters (``SnapshotStore(disk=...)``, NOTE [ Snapshot disk tier ] Rule 1),
            else ``None``.
    """

    saves: int = 0
    host_saves: int = 0
    restores: int = 0
    hits: int = 0
    prefetch_hits: int = 0
    prefetches: int = 0
    late_prefetches: int = 0
    late_wait_s: float = 0.0
    misses: int = 0
    miss_wait_s: float = 0.0
    save_waits: int = 0
    save_wait_s: float = 0.0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    raw_bytes: int = 0
    packed_bytes: int = 0
    slot_grows: int = 0
    size_waits: int = 0
    graph_saves: int = 0
    graph_captures: int = 0
    graph_retries: int = 0
    peer_saves: int = 0
    peer_bytes_sent: int = 0
    peer_fetches: int = 0
    peer_bytes_fetched: int = 0
    peer_drops: int = 0
    peer_held_bytes: int = 0
    peer_actions: int = 0
    peer_rounds: int = 0
    peer_wait_s: float = 0.0
    disk: DiskStats | None = None

    @property
    def ratio(self) -> float:
        """Compression ratio of the snapshots saved (1.0 without a codec)."""
        return self.raw_bytes / self.packed_bytes if self.packed_bytes else 1.0

    @property
    def hit_rate(self) -> float:
        """Off-GPU restores served by a slot, as a fraction (1.0 when there were none)."""
        n = self.hits + self.misses
        return self.hits / n if n else 1.0

    @property
    def exposed_transfer_s(self) -> float:
        """Transfer time not hidden: late prefetches, loads on demand, save waits, waits for disk reads."""
        disk = self.disk.read_wait_s if self.disk is not None else 0.0
        return self.late_wait_s + self.miss_wait_s + self.save_wait_s + disk
