"""Snapshots of a time-stepping loop's state, held for a checkpoint schedule.

# NOTE [ Snapshot store ]
# The runtime of NOTE [ Snapshot cache ] (schedules/prefetch.py): the same ``Cache`` ranks the
# slots and holds the pins; the memory is real and every copy goes through the mover
# (NOTE [ Mover ], store/streams.py). Its disk tier is NOTE [ Snapshot disk tier ]
# (store/snapshot_disk.py), its peers NOTE [ Snapshot peer tier ] (store/snapshot_peer.py); its codec side (Rules 8-9)
# is store/snapshot_codec.py.
# 1. A snapshot is a tuple of tensors (a wave equation carries u_t and u_{t-1}); every
#    snapshot of one loop has the same layout (shapes, dtypes), checked at each save.
# 2. ``Tier.GPU`` snapshots are device copies held by reference. Off-GPU snapshots
#    (``Tier.HOST``; DISK too, as HOST without ``disk=``, NOTE [ Snapshot disk tier ] Rule 1) live in the host pool and
#    pass through ``slots`` device slots, each one flat buffer allocated once for the loop: a save
#    copies the state into a slot on the compute stream and the slot is flushed to host on
#    the offload stream; a restore that hits reads the slot.
# 3. Every slot remembers three events: its last flush (device-to-host), its last fill
#    (host-to-device) and its last use on the compute stream. Overwriting a slot waits on
#    the events of whatever may still read or write it: a save waits (GPU-side) for the
#    slot's flush, as GPUZIP's SAVE does (with a codec and ``defer_sizes`` the slot is written
#    later, on a side stream after that flush: NOTE [ Snapshot sizes ] Rule 2); a prefetch on the
#    prefetch stream waits for the slot's flush and last use, and for the snapshot's own flush
#    to host.
# 4. A restore waits on the slot's fill event (compute stream), never on the device. A
#    restore that misses fills a slot on demand; with no slot available (every slot pinned:
#    the runtime left the plan) it copies straight from host into fresh tensors.
# 5. ``restore`` returns views of the slot (or of the GPU-tier copy): the caller copies them
#    into its own buffers before the next action touches that snapshot and must not modify
#    them. Events recorded after the caller's copy make the slot's reuse safe.
# 6. Write-back: a save may skip its flush (``flush=False``, decided by ``plan_flushes``);
#    such a snapshot is flushed when it is evicted from its slot, before the slot is reused.
# 7. On the CPU (``device="cpu"``) streams and events are absent and copies synchronous: the
#    same bookkeeping runs, which is what the CPU tests check.
# 8. With a ``codec``, every snapshot is held compressed, in every tier: a GPU-tier snapshot
#    is its ``Packed`` buffers; an off-GPU one is a *blob* (the packed buffers of its tensors
#    laid end to end, ``Blob``) in a slot and in a host block of the blob's size. Compression
#    runs on the compute stream at save (after what produced the state, NOTE [ Codec
#    streams ]), its sizes read back there, or with ``defer_sizes`` left on the device
#    until later (NOTE [ Snapshot sizes ]); decompression at restore, on the compute stream
#    after the slot's fill event, into fresh tensors. The copies move only compressed bytes.
# 9. Slots then hold ``slot_bytes`` each: given, or calibrated on the first snapshot as its
#    blob size times ``1 + slot_margin`` (a variable-rate codec's later snapshots may be
#    larger). ``gpu_bytes`` (instead of ``slots``) makes the slot count follow: as many slots
#    as the budget holds, so a codec's ratio turns into more slots (GPUZIP). A blob larger
#    than its slot grows that slot (a new buffer; the old one is released behind its
#    streams): the result stays exact to the codec's guarantee, GPU memory exceeds the
#    budget by the difference, ``stats().slot_grows`` counts it and the store warns once.
# 10. The slots are one range of device memory from ``arena_slots`` (memory/device_arena.py): on
#    a GPU with the native extension, a CUDA virtual-memory arena whose first slot is mapped
#    at once and the rest in the background (a slot's first use waits for its own range only);
#    elsewhere one ``torch.empty``. ``TORCHCKPT_DEVICE_CACHE=caching`` forces the latter. Arena
#    memory is outside PyTorch's caching allocator: ``device_bytes()`` reports it.
# 11. ``restore(n, tier, out=...)`` writes snapshot ``n`` into the caller's tensors (its shapes and
#    dtypes on the store's device, contiguous, not requiring grad, not overlapping) on the compute
#    stream: a codec decodes straight into them (``Codec.decompress(p, out=...)``); otherwise the
#    slot's, the GPU-tier copy's or the host block's bytes are copied in once (Rule 5's copy). The
#    store's own memory is never lent; a peer-tier restore decodes, then copies. The store records
#    the slot's use (``after_use`` is a no-op) and bumps ``out``'s versions (autograd flags an ``out`` it saved).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from torchckpt._args import check_flag, check_host
from torchckpt._errors import CheckpointError, internal_error
from torchckpt.codecs.base import Codec, Packed
from torchckpt.store.streams import Mover, nvtx_range
from torchckpt.schedules.actions import Tier
from torchckpt.schedules.cache import Cache
from torchckpt.codecs.blob import Blob
from torchckpt.memory.device_arena import DeviceArena, arena_slots
from torchckpt.memory import DiskTier, HostBlock, HostPoolBase, make_host_pool
from torchckpt.store.snapshot_codec import _MAX_UNSIZED, CodecSide
from torchckpt.store.snapshot_disk import DiskSide
from torchckpt.store.snapshot_graphs import check_graphs
from torchckpt.store.snapshot_peer import PeerSide, PeerSpill
from torchckpt.store.snapshot_slots import ALIGN, Layout, Slots
from torchckpt.store.stats import SnapshotStats

_store_ids = itertools.count()  # names a store's files in a DiskTier it may share (NOTE [ Snapshot disk tier ] Rule 1)


def _check_device(device: object) -> torch.device:
    """``SnapshotStore``'s device: given, a CPU or CUDA device (CUDA with an index)."""
    if device is None:
        raise TypeError("torchckpt: SnapshotStore needs the device of the state it holds, found none; pass it "
                        "first, e.g. SnapshotStore('cuda', gpu_bytes=...) or SnapshotStore('cpu', ...) to simulate on "
                        "the CPU.")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"torchckpt: SnapshotStore(device=...) expects 'cuda', 'cuda:N' or 'cpu', got "
                        f"{type(device).__name__} {device!r}.")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"torchckpt: SnapshotStore(device={device!r}) is not a device; pass 'cuda', 'cuda:N' or "
                         "'cpu'.") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"torchckpt: SnapshotStore supports 'cuda' and 'cpu', got {str(dev)!r}; pass 'cuda' or 'cpu'.")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"torchckpt: SnapshotStore(device={str(dev)!r}) needs CUDA, but torch.cuda.is_available() is "
                         "False; pass device='cpu' to simulate.")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class SnapshotStore(CodecSide, DiskSide, PeerSide):
    """Holds a schedule's snapshots: GPU tier on the device, other tiers via device slots and a host pool.

    Args:
        device: where the state lives (``"cuda"``/``"cuda:N"``, or ``"cpu"`` to simulate); required.
        slots: device slots in front of the host tier (GPUZIP's cache; >= 1, 2+ to overlap).
        host: the host pool (``None``: ``make_host_pool()``, lazily pinned where it can be).
        timing: time late prefetches and waits with CUDA events.
        codec: a ``torchckpt.codecs.Codec`` holding every snapshot compressed (NOTE [ Snapshot
            store ] Rules 8, 9); restores then give the codec's guarantee, not bit-exactness
            (unless the codec is lossless). ``None``: snapshots are stored as they are.
        gpu_bytes: instead of ``slots``, a byte budget for the slots: their number is fixed at
            the first snapshot (``calibrate``) as ``gpu_bytes // slot_bytes``.
        slot_bytes: bytes of one slot (with a codec: the compressed room per snapshot);
            ``None``: the snapshot's size, or with a codec its first blob times ``1 + slot_margin``.
        slot_margin: headroom of a calibrated compressed slot (>= 0).
        disk: where ``Tier.DISK`` snapshots go (NOTE [ Snapshot disk tier ] Rules 1-3): a directory
            (an NVMe path in practice; the store makes a ``DiskTier`` there and closes it), or a
            ``torchckpt.memory.DiskTier``. ``None``: DISK snapshots are held as HOST ones.
        peers: a ``PeerSpill`` (store/snapshot_peer.py): ``Tier.HOST`` snapshots split between host memory and
            other ranks' spare memory by the group's plan, every rank calling the store's actions in the same
            order (NOTE [ Snapshot peer tier ] Rules 1-6). ``None``: host memory only.
        defer_sizes: with a codec, leave each save's compressed sizes on the device and read them back at a
            later action, so that no save makes the host wait for the device (NOTE [ Snapshot sizes ]). Off by
            default: each save reads its sizes back at once, which measured faster (NOTE [ Snapshot sizes ] Rule 7).
        graphs: with ``defer_sizes`` on CUDA and a codec that can be captured (TritonQuant, Bitcomp), replay each
            off-GPU save's compression as a CUDA graph per state tensor (NOTE [ Captured saves ]): less host time
            per save, the same bits; the state should stay in the same buffers from save to save.
        sizes_in_flight: with ``defer_sizes``, the snapshots whose sizes may be on the device at once (>= 1): the host
            waits for the oldest's beyond them (NOTE [ Snapshot sizes ] Rule 3). Each holds the codec's worst case
            (about the snapshot's size) outside ``gpu_bytes``; more lets the host run further ahead of the device.

    The store is a context manager: leaving the ``with`` block (also by an exception) calls ``close()``.

    Example::

        >>> from torchckpt.memory import HostPool
        >>> s = SnapshotStore("cpu", slots=2, host=HostPool(chunk_bytes=1 << 20, pin=False))
        >>> s.save(0, Tier.HOST, [torch.arange(4.0)])
        >>> s.restore(0, Tier.HOST)[0]
        tensor([0., 1., 2., 3.])
    """

    def __init__(self, device: str | torch.device | None = None, slots: int | None = None,
                 host: HostPoolBase | None = None, timing: bool = True, codec: Codec | None = None,
                 gpu_bytes: int | None = None, slot_bytes: int | None = None, slot_margin: float = 0.25,
                 disk: str | os.PathLike[str] | DiskTier | None = None, peers: PeerSpill | None = None,
                 defer_sizes: bool = False, graphs: bool = False, sizes_in_flight: int = _MAX_UNSIZED) -> None:
        device = _check_device(device)
        if slots is not None and gpu_bytes is not None:
            raise ValueError("torchckpt: SnapshotStore takes slots= or gpu_bytes=, not both; pass one of them.")
        if gpu_bytes is None and slots is None:
            slots = 4
        if slots is not None and (not isinstance(slots, int) or isinstance(slots, bool) or slots < 1):
            raise ValueError(f"torchckpt: SnapshotStore needs slots >= 1 (2 or more to overlap copies), got {slots!r}.")
        for name, value in (("gpu_bytes", gpu_bytes), ("slot_bytes", slot_bytes)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"torchckpt: SnapshotStore({name}=...) must be a positive int (bytes), got {value!r}; "
                                 f"pass e.g. {name}={256 << 20} or None.")
        if isinstance(slot_margin, bool) or not isinstance(slot_margin, (int, float)) or not slot_margin >= 0:
            raise ValueError(f"torchckpt: SnapshotStore(slot_margin=...) must be a number >= 0, got {slot_margin!r}; "
                             "pass e.g. slot_margin=0.25.")
        check_host("SnapshotStore", host)
        check_flag("SnapshotStore", "timing", timing)
        check_flag("SnapshotStore", "defer_sizes", defer_sizes)
        check_flag("SnapshotStore", "graphs", graphs)
        if isinstance(sizes_in_flight, bool) or not isinstance(sizes_in_flight, int) or sizes_in_flight < 1:
            raise ValueError(f"torchckpt: SnapshotStore(sizes_in_flight=...) must be an int >= 1 (snapshots whose "
                             f"sizes may be on the device at once), got {sizes_in_flight!r}; pass e.g. 2.")
        if codec is not None and not isinstance(codec, Codec):
            raise TypeError(
                f"torchckpt: SnapshotStore(codec=...) expects a torchckpt.codecs.Codec, got {type(codec).__name__}; "
                "pass e.g. codec=torchckpt.codecs.TritonQuant(bits=8, mode='rel', bound=1e-3)."
            )
        if graphs:  # NOTE [ Captured saves ] Rule 1
            check_graphs(device, codec, defer_sizes)
        if disk is not None and not isinstance(disk, (str, os.PathLike, DiskTier)):
            raise TypeError(f"torchckpt: SnapshotStore(disk=...) expects a directory path or a "
                            f"torchckpt.memory.DiskTier, got {type(disk).__name__} {disk!r}; pass e.g. "
                            "disk='/mnt/nvme/scratch', or None to hold Tier.DISK snapshots in host memory.")
        self.device = device
        self.cuda = device.type == "cuda"
        self.timing = timing and self.cuda
        self.host = host if host is not None else make_host_pool(pin=self.cuda)
        self.codec = codec
        self.defer_sizes = defer_sizes  # NOTE [ Snapshot sizes ] Rules 4, 7
        self.graphs = graphs  # NOTE [ Captured saves ]
        self.sizes_in_flight = sizes_in_flight  # NOTE [ Snapshot sizes ] Rule 3
        self._graphs = None  # its ring, made at the first save it applies to
        self.gpu_bytes = gpu_bytes
        self.slot_margin = float(slot_margin)
        self._slot_bytes = slot_bytes
        self.nslots: int = slots if slots is not None else 0  # 0 until calibrate() (gpu_bytes=)
        self._rank: Cache[int] = Cache(max(self.nslots, 1))
        self._layout: Layout | None = None
        self._blobs: dict[int, Blob] = {}  # off-GPU snapshot -> its blob layout (with a codec)
        self._packs: dict[int, list[Packed]] = {}  # GPU-tier snapshots, compressed (with a codec)
        self._warned_grow = False
        self._save_views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # slot -> (its buffer, save's views)
        self._first: tuple[tuple[tuple[Any, ...], ...], list[Packed]] | None = None  # calibrate's compression
        self._unsized = {}  # saved, sizes still on the device (NOTE [ Snapshot sizes ])
        self._sizing = collections.deque()  # those and the ones dropped since, oldest first
        self._rows = []  # pinned rows the sizes come back in, free
        self._slots = Slots()
        self._arena: DeviceArena | None = None
        self._slot_of: dict[int, int] = {}
        self._free_slots: list[int] = []
        self._flush_ev: list[Any] = []  # per slot: last device-to-host copy out of it
        self._fill_ev: list[Any] = []  # per slot: last host-to-device copy into it
        self._use_ev: list[Any] = []  # per slot: last compute-stream access
        self._on_host: dict[int, tuple[HostBlock, Any]] = {}  # step -> (block, its flush event)
        self._gpu: dict[int, list[torch.Tensor]] = {}
        self._prefetched: set[int] = set()
        self._dirty: set[int] = set()  # in a slot, not on host (write-back)
        self._timings: list[tuple[str, Any, Any]] = []
        self._pending_use: int | None = None
        self._c: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SnapshotStats) if f.name != "disk"}
        self._mover = Mover(device, self.timing, self.host)
        self._peer_init(peers)  # NOTE [ Snapshot peer tier ] Rules 1-6
        # NOTE [ Snapshot disk tier ] Rules 1-3: the disk tier (made last: nothing above can fail and leave its directory behind).
        self._own_disk = disk is not None and not isinstance(disk, DiskTier)
        self.disk: DiskTier | None = disk if disk is None or isinstance(disk, DiskTier) else DiskTier(disk)
        self._uid = next(_store_ids)
        self._disk_ns: set[int] = set()  # off-GPU snapshots saved to Tier.DISK
        self._writing: dict[int, Future[None]] = {}  # write under way; its source is the host block
        self._on_disk: set[int] = set()  # written completely
        self._reading: dict[int, Future[Any]] = {}  # a prefetch's read into the host block, not collected
        self._into_slot: set[int] = set()  # of those, the reads straight into the slot (NOTE [ Snapshot disk tier ] Rule 6)

    # -- actions -------------------------------------------------------------------------
    def save(self, n: int, tier: Tier, tensors: Sequence[torch.Tensor], flush: bool = True) -> None:
        """Snapshot ``tensors`` (the state at step ``n``) into ``tier``.

        ``flush=False`` (write-back, NOTE [ Write-back ]) skips the copy to host unless the
        snapshot is later evicted from its slot, which then flushes it first.
        """
        tensors = list(tensors)
        self._check(tensors)
        c = self._c
        c["saves"] += 1
        with nvtx_range("torchckpt.save", n):
            if self._sizing:
                self._drop_unsized(n)  # a save of n again replaces it
                self._settle_ready()  # NOTE [ Snapshot sizes ] Rule 2
            # NOTE [ Snapshot sizes ] Rule 4: the exact compress unless sizes may stay on the device
            deferred = self.defer_sizes and self.codec is not None and self.peers is None
            if tier is Tier.GPU:
                if self.codec is None:
                    self._gpu[n] = [t.detach().clone() for t in tensors]
                elif deferred:
                    self._save_deferred(n, tensors, None, True)
                else:
                    self._packs[n] = self._compress(tensors)
                return
            c["host_saves"] += 1
            self._poll()
            self._drop_disk(n)  # a save of n again replaces its file
            if tier is Tier.DISK and self.disk is not None:
                self._disk_ns.add(n)
            if deferred and self._rank.can_take():  # NOTE [ Snapshot sizes ] Rules 1-2: the slot is written when settled
                self._blobs.pop(n, None)
                s = self._take_slot(n)
                old_host = self._on_host.pop(n, None)
                if old_host is not None:
                    self.host.free(old_host[0], old_host[1])
                self._save_deferred(n, tensors, s, flush)
                return
            packs = self._compress(tensors) if self.codec is not None else None
            lay = self._layout
            assert lay is not None
            blob = Blob(packs) if packs is not None else None
            size = blob.nbytes if blob is not None else lay.nbytes
            if blob is not None:
                self._blobs[n] = blob
            self._peer_begin(n, tier, size, split=flush or not self._rank.can_take())  # NOTE [ Snapshot peer tier ] Rules 1, 3
            if not self._rank.can_take():  # every slot pinned: straight to host (NOTE [ Snapshot store ] Rule 4)
                flat = torch.empty(size, dtype=torch.uint8, device=self.device)
                self._fill_flat(flat, tensors, packs, blob)
                if self._peer_end(n, flat, None):  # to a peer instead (NOTE [ Snapshot peer tier ] Rule 4)
                    return
                block = self.host.alloc(size)
                ev = self._to_host(block.tensor, flat)
                self._on_host[n] = (block, ev)
                self._write_behind(n)
                if self.cuda:
                    self._mover.current().wait_event(ev)  # flat must outlive the copy
                return
            s = self._take_slot(n)
            if self.cuda and self._flush_ev[s] is not None and not self._flush_ev[s].query():
                c["save_waits"] += 1
                need = self._wait(self._flush_ev[s])
                if need is not None:
                    self._timings.append(("save", need, self._flush_ev[s]))
            self._ensure_room(s, size)
            slot = self._slots[s]
            self._fill_flat(slot, tensors, packs, blob, s)
            self._use_ev[s] = self._record()
            old = self._on_host.pop(n, None)
            if old is not None:
                self.host.free(old[0], old[1])
            if self._peer_end(n, slot, s):  # sent to a peer: that was its flush (NOTE [ Snapshot peer tier ] Rule 4)
                return
            if flush:
                self._flush(n, s)
            else:
                self._dirty.add(n)

    def prefetch(self, n: int, src: Tier, dst: Tier) -> None:
        """Start bringing snapshot ``n`` into a slot (or pin it where it is) ahead of its restore."""
        if src is dst:
            if n in self._slot_of:
                self._rank.pin(n)
            return
        self._poll()
        if self._sizing:
            self._settle_ready()  # NOTE [ Snapshot sizes ] Rule 2
        fetched = self._peer_take("prefetch", n, src)  # NOTE [ Snapshot peer tier ] Rules 1, 5
        if n in self._slot_of:
            self._rank.pin(n)
            return
        on_disk = n not in self._on_host and n in self._on_disk
        if n not in self._on_host and not on_disk and fetched is None and n not in self._peer_of:
            raise CheckpointError(f"torchckpt: Prefetch({n}) of a snapshot that was never saved to host.")
        if not self._rank.can_take():
            return  # every slot pinned: the restore will load on demand
        with nvtx_range(f"torchckpt.prefetch {n}"):
            s = self._take_slot(n)
            self._rank.pin(n)
            if fetched is not None:
                self._peer_fill(s, n, fetched, on_compute=False)
            elif on_disk:  # NOTE [ Snapshot disk tier ] Rules 2, 6: read ahead (into a host block, or the slot)
                self._read_ahead(n, s)
            else:
                self._fill(s, n)
            self._prefetched.add(n)
            self._c["prefetches"] += 1

    def restore(self, n: int, tier: Tier, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Snapshot ``n`` of ``tier``, valid on the current stream; written into ``out`` when given.

        Args:
            n, tier: the step and tier the snapshot was saved at.
            out: the caller's tensors to restore into (NOTE [ Snapshot store ] Rule 11), one per
                tensor of the snapshot (its shape and dtype, on the store's device, contiguous, not
                requiring grad); a codec decodes straight into them. ``None``: views of a slot or of
                the stored snapshot (with a codec, fresh tensors) to copy, not modify, then call
                ``after_use`` (NOTE [ Snapshot store ] Rule 5).

        Returns:
            ``out`` as a list, or the views.

        Example::

            >>> from torchckpt.memory import HostPool
            >>> s = SnapshotStore("cpu", slots=1, host=HostPool(chunk_bytes=1 << 20, pin=False))
            >>> s.save(0, Tier.HOST, [torch.arange(4.0)])
            >>> state = [torch.zeros(4)]
            >>> s.restore(0, Tier.HOST, out=state)[0] is state[0], state[0]
            (True, tensor([0., 1., 2., 3.]))
        """
        if out is None:
            return self._restore(n, tier, None)
        outs = self._check_out(n, tier, out)
        got = self._restore(n, tier, outs)
        self.after_use()  # NOTE [ Snapshot store ] Rule 11: the store's own reads of the slot end here
        torch.autograd.graph.increment_version(outs)  # kernels that wrote through a pointer did not
        return got

    def _restore(self, n: int, tier: Tier, outs: list[torch.Tensor] | None) -> list[torch.Tensor]:
        c = self._c
        c["restores"] += 1
        with nvtx_range("torchckpt.restore", n):
            if self._sizing:
                self._settle_ready()  # NOTE [ Snapshot sizes ] Rule 2
            if tier is Tier.GPU:
                if n in self._packs:
                    return self._decompress(self._packs[n], outs)
                if n not in self._gpu:
                    raise CheckpointError(f"torchckpt: Restore({n}, GPU) of a snapshot that was never saved.")
                return self._gpu[n] if outs is None else self._copy_into(self._gpu[n], outs)  # NOTE [ Snapshot store ] Rule 11: copied
            self._poll()
            if n in self._reading:
                self._finish_read(n)  # NOTE [ Snapshot disk tier ] Rule 2: the restore waits for its prefetch's read
            fetched = self._peer_take("restore", n, tier)  # NOTE [ Snapshot peer tier ] Rules 1, 5
            hit = self._rank.use(n)
            if hit:
                s = self._slot_of[n]
                c["hits"] += 1
                if n in self._prefetched:
                    self._prefetched.discard(n)
                    c["prefetch_hits"] += 1
                    need = self._wait(self._fill_ev[s])
                    if need is not None:
                        self._timings.append(("late", need, self._fill_ev[s]))
                elif self._fill_ev[s] is not None:
                    self._wait(self._fill_ev[s])
                views = self._views(n, self._slots[s], outs, s)
                self._use_ev[s] = None  # the caller's copy comes after: see _after_use
                self._pending_use = s
                return views
            if fetched is not None:
                got = self._peer_restore(n, fetched)
                return got if outs is None else self._copy_into(got, outs)  # NOTE [ Snapshot store ] Rule 11: a copy
            if n not in self._on_host and n in self._on_disk:
                self._load(n)  # NOTE [ Snapshot disk tier ] Rule 2
            if n not in self._on_host:
                raise CheckpointError(f"torchckpt: Restore({n}, HOST) of a snapshot that was never saved.")
            c["misses"] += 1
            t0 = time.perf_counter()
            if self._rank.can_take():
                s = self._take_slot(n)
                ev = self._fill(s, n)
                need = self._wait(ev)
                if need is not None:
                    self._timings.append(("miss", need, ev))
                elif not self.cuda:
                    c["miss_wait_s"] += time.perf_counter() - t0
                self._pending_use = s
                self._release_host(n)
                return self._views(n, self._slots[s], outs, s)
            block, ev = self._on_host[n]
            if ev is not None:
                self._wait(ev)
            c["bytes_to_device"] += block.tensor.numel()
            if outs is not None and self.codec is None:  # NOTE [ Snapshot store ] Rule 11: host to device straight into out
                got = self._views(n, block.tensor, outs)
            else:
                got = self._views(n, block.tensor.to(self.device), outs)  # synchronous from the caller's view
            self._release_host(n)
            return got

    def free(self, n: int, tier: Tier) -> None:
        """Release snapshot ``n`` of ``tier`` (a disk snapshot's file too, NOTE [ Snapshot disk tier ] Rule 3)."""
        if tier is not Tier.GPU:
            self._poll()
        if self._sizing:
            self._drop_unsized(n)
            self._settle_ready()  # NOTE [ Snapshot sizes ] Rule 2
        self._peer_free(n, tier)  # NOTE [ Snapshot peer tier ] Rules 1, 6
        self._free(n, tier)

    def _free(self, n: int, tier: Tier) -> None:
        self._drop_unsized(n)
        if tier is Tier.GPU:
            self._gpu.pop(n, None)
            self._packs.pop(n, None)
            return
        self._drop_disk(n)
        self._blobs.pop(n, None)
        self._rank.remove(n)
        self._prefetched.discard(n)
        self._dirty.discard(n)
        s = self._slot_of.pop(n, None)
        if s is not None:
            self._free_slots.append(s)
        old = self._on_host.pop(n, None)
        if old is not None:
            filled = s is not None and self._fill_of[s] == n  # the slot was filled from this block
            self.host.free(old[0], self._fill_ev[s] if filled else old[1])  # type: ignore[index]

    def after_use(self) -> None:
        """Mark the end of the caller's reads of the views ``restore`` returned (NOTE [ Snapshot store ] Rule 5)."""
        s = self._pending_use
        if s is not None:
            self._use_ev[s] = self._record()
            self._pending_use = None

    def stats(self) -> SnapshotStats:
        """Counters so far (waits for the sizes still on the device, NOTE [ Snapshot sizes ] Rule 3, for pending
        timing events, and for the disk tier's jobs: NOTE [ Snapshot disk tier ] Rule 3)."""
        self._settle_all()
        if self.disk is not None:
            self.disk.wait()
            self._poll()
        for kind, need, done in self._timings:
            done.synchronize()
            need.synchronize()
            late = need.elapsed_time(done) / 1e3
            if late > 0:
                key = {"late": "late_wait_s", "miss": "miss_wait_s", "save": "save_wait_s"}[kind]
                self._c[key] += late
                if kind == "late":
                    self._c["late_prefetches"] += 1
        self._timings = []
        return SnapshotStats(**self._c, disk=self.disk.stats() if self.disk is not None else None)

    def close(self) -> None:
        """Free every snapshot and the slots (waits for copies in flight); delete the disk files
        (NOTE [ Snapshot disk tier ] Rule 3).

        With ``peers=`` this is collective, as every action is: it drops the store's peer copies
        (NOTE [ Snapshot peer tier ] Rule 6); ranks that were not all closing raise after the local part is done.
        """
        err = self._peer_close()
        for n in self._closing():  # queued reads cancelled first (NOTE [ Snapshot disk tier ] Rule 5)
            self._free(n, Tier.HOST)
        self._gpu.clear()
        self._packs.clear()
        self._unsized.clear()
        self._sizing.clear()
        if self.codec is not None and self.codec.scratch is not None:
            self.codec.scratch.clear()  # NOTE [ Snapshot sizes ] Rule 8
        self._mover.drain()
        if self._graphs is not None:  # after the mover's reads of its buffers (NOTE [ Captured saves ] Rules 8-9)
            self._graphs.close()
            self._graphs = None
        self._save_views.clear()  # they hold the slots' memory
        self._slots.release()
        self._slots = Slots()
        if self._arena is not None:
            self._arena.close()  # the memory goes back once no view of it is left
            self._arena = None
        if self.disk is not None and self._own_disk:
            self.disk.close()
        if err is not None:
            raise err

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self._peer_abandon()  # NOTE [ Snapshot peer tier ] Rule 2: the other ranks may not be closing
        self.close()

    def device_bytes(self) -> int:
        """Device memory the slots hold (arena memory is not in ``torch.cuda.memory_allocated()``)."""
        if self._arena is not None:
            return int(self._arena.mapped_bytes)
        return len(self._slots) * (self._slot_bytes or 0)

    # -- internals -----------------------------------------------------------------------
    def _check(self, tensors: list[torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("torchckpt: a snapshot needs at least one tensor.")
        for t in tensors:
            if t.device != self.device:
                raise ValueError(
                    f"torchckpt: snapshot tensor on {t.device}, store on {self.device}; "
                    "create the SnapshotStore on the state's device."
                )
        if self._layout is None:
            self.calibrate(tensors)
        elif tuple((t.shape, t.dtype) for t in tensors) != self._layout.meta:
            raise ValueError(
                "torchckpt: a SnapshotStore holds snapshots of one layout, fixed by its first save: expected "
                f"{[(tuple(s), d) for s, d in self._layout.meta]}, got {[(tuple(t.shape), t.dtype) for t in tensors]}. "
                "Every snapshot of a loop has the same shapes and dtypes; a loop (or scan) with another state needs a "
                "SnapshotStore of its own (or pass a Store, which makes one per loop)."
            )

    def calibrate(self, tensors: Sequence[torch.Tensor], packs: Sequence[Packed] | None = None) -> int:
        """Fix the snapshot layout, the slot size and the slot count from one snapshot; returns the slot count.

        Called by the first ``save``; ``run_schedule`` calls it before planning when the store
        was given ``gpu_bytes`` (the plan needs the slot count). With a codec this compresses
        ``tensors`` once to measure the blob (NOTE [ Snapshot store ] Rule 9), or uses ``packs``,
        their compression made by the caller; a ``save`` of the same, unchanged tensors reuses it.
        """
        tensors = list(tensors)
        if self._layout is not None:
            return self.nslots
        first = self._first_blob(tensors, packs) if self.codec is not None else None
        if not tensors:
            raise ValueError("torchckpt: a snapshot needs at least one tensor.")
        lay = Layout(tensors)
        nb = self._slot_bytes
        if nb is None:
            nb = first if first is not None else lay.nbytes
        nb = (nb + ALIGN - 1) // ALIGN * ALIGN
        if self.codec is None and nb < lay.nbytes:
            raise ValueError(f"torchckpt: slot_bytes={nb} is smaller than one snapshot ({lay.nbytes} bytes) "
                             "and there is no codec; pass slot_bytes=None.")
        if self.gpu_bytes is not None:
            self.nslots = max(1, self.gpu_bytes // nb)
            self._rank = Cache(self.nslots)
        self._layout = lay
        self._slot_bytes = nb
        use_vmm = False if os.environ.get("TORCHCKPT_DEVICE_CACHE", "auto") == "caching" else None
        self._arena, slots = arena_slots(self.device, self.nslots, nb, use_vmm=use_vmm)  # NOTE [ Snapshot store ] Rule 10
        self._slots = Slots(slots)
        self._free_slots = list(range(self.nslots - 1, -1, -1))
        self._flush_ev = [None] * self.nslots
        self._fill_ev = [None] * self.nslots
        self._use_ev = [None] * self.nslots
        self._fill_of: list[int | None] = [None] * self.nslots
        return self.nslots

    @property
    def slot_bytes(self) -> int | None:
        """Bytes of one slot (``None`` before the first snapshot fixed it)."""
        return self._slot_bytes

    def _check_out(self, n: int, tier: Tier, out: object) -> list[torch.Tensor]:
        """``restore``'s ``out``, checked against the snapshots' layout (NOTE [ Snapshot store ] Rule 11)."""
        outs: list[Any] = list(out) if isinstance(out, (list, tuple)) else [out]
        lay = self._layout
        if lay is None:
            raise CheckpointError(f"torchckpt: Restore({n}, {tier.name}) of a snapshot that was never saved.")
        ok = isinstance(out, (list, tuple)) and len(outs) == len(lay.meta) and all(
            isinstance(o, torch.Tensor) and o.shape == sh and o.dtype == dt and o.device == self.device
            and o.is_contiguous() and not o.requires_grad for o, (sh, dt) in zip(outs, lay.meta))
        spans = sorted((o.data_ptr(), o.data_ptr() + o.nbytes) for o in outs if o.numel()) if ok and len(outs) > 1 else []
        if not ok or any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
            got = [f"{tuple(o.shape)} {o.dtype} {o.device}{'' if o.is_contiguous() else ' non-contiguous'}"
                   f"{' requires grad' if o.requires_grad else ''}" if isinstance(o, torch.Tensor) else type(o).__name__
                   for o in outs]
            raise ValueError(f"torchckpt: SnapshotStore.restore({n}, {tier.name}, out=...) needs a list of one tensor per "
                             f"tensor of the snapshot, of its shape and dtype on {self.device}, contiguous, not requiring "
                             f"grad (a .detach() shares the memory) and overlapping no other: expected "
                             f"{[(tuple(sh), dt) for sh, dt in lay.meta]}, got {'overlapping ' if ok else ''}{got}. Pass "
                             "the state's own tensors in that order (e.g. out=[u, u_prev]), or out=None for views to copy.")
        return outs

    def _flush(self, n: int, s: int, after: Any = None) -> None:
        """Copy the snapshot in slot ``s`` (step ``n``) to a host block on the offload stream, after the compute
        stream's work so far and the slot's last write off it (its fill event: NOTE [ Snapshot sizes ] Rule 2), or
        with ``after`` (the event of that write) after that only."""
        lay = self._layout
        assert lay is not None
        size = self._blobs[n].nbytes if self.codec is not None else lay.nbytes
        block = self.host.alloc(size)
        ev = self._to_host(block.tensor, self._slots[s], after, self._fill_ev[s])
        self._flush_ev[s] = ev
        self._on_host[n] = (block, ev)
        self._dirty.discard(n)
        self._write_behind(n)

    def _take_slot(self, n: int) -> int:
        evicted = self._rank.admit(n)
        if n in self._slot_of:
            return self._slot_of[n]
        if evicted:
            (old,) = evicted
            if old in self._unsized:
                self._settle(self._unsized[old])  # its flush needs its size (NOTE [ Snapshot sizes ] Rule 3)
            if old in self._dirty:  # written back only now: the new content waits for it (NOTE [ Snapshot store ] Rule 3)
                self._flush(old, self._slot_of[old])
            s = self._slot_of.pop(old)
        elif self._free_slots:
            s = self._free_slots.pop()
        else:
            raise internal_error("snapshot cache has neither a free slot nor a victim")
        self._slot_of[n] = s
        return s

    def _fill(self, s: int, n: int) -> Any:
        block, flushed = self._on_host[n]
        k = block.tensor.numel()
        grown = self._ensure_room(s, k)
        slot = self._slots[s]
        self._c["bytes_to_device"] += k
        # NOTE [ Snapshot store ] Rule 3; with no record of the slot's last use, or a new buffer: after everything so far.
        ev = self._mover.fill(slot if slot.numel() == k else slot[:k], block.tensor,
                              (flushed, self._flush_ev[s], self._use_ev[s]), after_all=self._use_ev[s] is None or grown)
        self._fill_ev[s] = ev
        self._fill_of[s] = n
        return ev

    def _to_host(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None, written: Any = None) -> Any:
        """``src``'s first bytes to host ``dst``: after ``after`` only, or after the compute stream and ``written``."""
        k = dst.numel()
        self._c["bytes_to_host"] += k
        if src.numel() != k:  # a slice costs host time (NOTE [ Slot views ]): only where it cuts
            src = src[:k]
        if after is None:
            return self._mover.to_host(dst, src, written)
        return self._mover.to_host(dst, src, after, after_compute=False)

    def _record(self) -> Any:
        return self._mover.record()

    def _wait(self, ev: Any) -> Any:
        """The compute stream waits on ``ev``; returns a timing event marking when it started to."""
        return self._mover.wait(ev)
