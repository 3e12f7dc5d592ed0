"""The codec side of ``SnapshotStore``: snapshots held compressed, in slots sized from their blobs.

``SnapshotStore`` (store/snapshots.py, NOTE [ Snapshot store ] Rules 8-9) takes these methods from ``CodecSide``:
compressing a snapshot at save, decoding it at restore (into fresh tensors or the caller's, NOTE [ Snapshot store ]
Rule 11), writing it into a slot, and sizing or growing the slots from the blobs.

# NOTE [ Snapshot sizes ]
# With ``SnapshotStore(defer_sizes=True)`` a save with a codec reads no size back to the host: the
# host does not wait for the device at a save, so the device keeps the work queued behind it
# (issue 26). Off by default (Rule 7): each save then compresses exactly (Rule 4).
# 1. The save compresses with ``Codec.compress_deferred`` on the compute stream (NOTE [ Codec
#    streams ] Rule 3) and copies the sizes of all the snapshot's tensors, in one copy, to a
#    pinned row on the mover's sizes stream (NOTE [ Mover ] Rule 6), with an event. Until it is
#    settled (Rule 2) the snapshot is *unsized*: it holds the deferred buffers (of the codec's
#    worst case, about the snapshot's own size), a ``Tier.GPU`` one in ``_packs``, an off-GPU one
#    beside the slot it was given (not written yet), and a restore decodes them as they are, on
#    the compute stream, with the sizes read on the device.
# 2. Each action first settles the unsized snapshots whose sizes are on the host (their event
#    has completed: ``query``, no wait), oldest first. ``Codec.settle`` gives the exact Packed
#    (``compress``'s bytes); a GPU-tier snapshot keeps trimmed copies; an off-GPU one is settled on
#    the sizes stream after the save's event (``Mover.on_sizes``) and written
#    into its slot (``Mover.place``, on the sizes stream: NOTE [ Mover ] Rule 6) after the save's
#    event, the slot's fill and flush events as they were at the save, and flushed from there to a
#    host block of its exact blob size on the offload stream after that write: neither waits for
#    the compute stream's later work, so the flush overlaps the steps queued since, and the
#    write does not queue behind other flushes. The write's event is the slot's fill and flush
#    event until the flush (restores wait for it; a fill, or a later snapshot's write, into the
#    slot come after it). So a save of an off-GPU snapshot makes the compute stream wait for
#    nothing (no save wait, NOTE [ Snapshot store ] Rule 3).
# 3. The host waits for a size (``Event.synchronize``) only when it must: for the oldest when
#    more than ``sizes_in_flight`` snapshots are unsized (2 by default: this bounds the deferred memory), for one
#    whose slot is taken by another (eviction flushes it), and in ``stats``. Each such event was
#    recorded at an earlier save, and the device still holds the work queued after it, so its
#    queue does not empty; ``stats().size_waits`` counts the waits that found an event not done.
# 4. ``compress`` (exact sizes, read back at once) is every save's without ``defer_sizes``, and
#    with it keeps the cases that need the size at the save: ``peers=`` (its plan splits
#    snapshots by size, collectively, at the save) and a save that finds every slot pinned
#    (straight to host), as well as the first snapshot (compressed once by ``calibrate`` to size
#    the slots). Then no snapshot is unsized and Rules 1-3 do not apply. With ``defer_sizes``, a
#    codec that defers nothing (Identity, ZFP) is settled at its save. On the CPU sizes are on
#    the host at once: the same bookkeeping runs and a snapshot is settled at the next action
#    (``_sized`` is the tests' seam to delay it).
# 5. Whether a restore decodes the deferred buffers, the slot or a host block, it gets the same
#    bits: ``decompress`` of ``compress``'s Packed (the codecs' tests and the store's compare).
#    Stats count a snapshot's packed bytes when it is settled; one freed or saved again while
#    unsized is still settled in its turn, only to count them (its buffers kept until then).
# 6. Why sizes read back late rather than slots sized from the codec's bound: TritonQuant's and
#    Bitcomp's worst case is about the snapshot's own size (every block raw; ``bitcompMaxBuflen``),
#    so bound-sized slots would turn no compression ratio into more slots, and a flush of a
#    bound-sized slot moves more than the compressed bytes. Offsets kept on the device (a bump
#    allocator) would not remove the read-back either: a device-to-host copy takes its length on
#    the host. Reading the sizes back late pays the worst case only for the few snapshots in
#    flight (Rule 3's bound, in PyTorch's caching allocator, outside ``gpu_bytes``), while slots,
#    host blocks and the link carry compressed bytes only, as before.
# 7. Why ``defer_sizes`` is off by default: it trades a host wait per save for more host work
#    per save (``compress_deferred``'s raw-block buffers, the sizes' copy, the settle, the slot
#    write on the sizes stream), and on an H100 the trade lost (before the raw blocks' ranking
#    on the device was removed from ``compress_deferred``: not measured since). In
#    ``benchmarks/adjoint_codecs.py`` (256^3 RTM, quant4a), measured at the parent of 2ffed5d
#    (docs/results/adjoint_codecs_deferred_h100/): the host synchronisations fell from about
#    1960 to 15 (Revolve) and 54 (zCut), but the runs took 2.408 s (Revolve) and 1.438 s (zCut),
#    the device idle 79% and 72% of the traced runs, bound by the host; the exact path had
#    measured 0.936 s and 0.948 s, in another run at an older commit (docs/benchmarks.md).
#    ``adjoint_codecs.py --sizes exact,deferred`` measures both in one run: on an H200 at commit a094d75
#    (docs/results/adjoint_codecs_h200/) deferred sizes were faster with Bitcomp (zCut 0.849 s against 0.905,
#    Revolve 0.944 against 1.083) and slower with quant4a (zCut 2.065 s against 0.932, Revolve 1.305 against
#    1.268), so the default stays off.
# 8. A settled snapshot's deferred buffers go back to the codec's ``scratch`` (NOTE [ Codec streams ]
#    Rule 5; TritonQuant lends its raw rows, NOTE [ Block quantization ] Rule 7), so that a save takes
#    one freed at an earlier save instead of allocating and freeing its worst case every time. They
#    are given back with the events after their last uses: one recorded where ``settle`` ran, right
#    after it (the sizes stream, which waited for the save's event, for an off-GPU snapshot; the
#    compute stream for a ``Tier.GPU`` one or a dropped one), and, for an off-GPU snapshot that a
#    restore decoded while unsized, one recorded on the compute stream after that decode. The
#    settled Packed views none of them; the store never decodes the deferred form again. ``close``
#    clears the scratch's idle buffers; an unsized snapshot dropped by ``close`` gives nothing back.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from torchckpt.codecs.base import Codec, Deferred, Packed
from torchckpt.codecs.blob import Blob
from torchckpt.store.snapshot_graphs import SaveGraphs
from torchckpt.store.snapshot_slots import Layout, Slots

__all__ = ["CodecSide"]

_MAX_UNSIZED = 2  # SnapshotStore(sizes_in_flight=...)'s default (NOTE [ Snapshot sizes ] Rule 3)


def _identity(tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], ...]:
    """What makes a compression of ``tensors`` reusable: the same memory, unchanged since (version)."""
    return tuple((t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.device) for t in tensors)


def _own(p: Packed) -> Packed:
    """``p`` with every buffer that views a larger one copied into its own, so the larger one's memory can go."""
    bufs = tuple(b if b.untyped_storage().nbytes() == b.nbytes else b.clone() for b in p.buffers)
    return Packed(bufs if isinstance(p.data, tuple) else bufs[0], p.meta)


@dataclasses.dataclass(slots=True, eq=False)
class _Unsized:
    """A snapshot saved with its sizes still on the device (NOTE [ Snapshot sizes ] Rule 1)."""

    n: int | None  # None: freed or saved again, kept only to count its packed bytes (NOTE [ Snapshot sizes ] Rule 5)
    defs: list[Deferred]
    row: torch.Tensor | None  # the pinned row its sizes come back in (None: in ``rows``)
    sized: Any  # the event after which they are there (None on the CPU)
    # what its slot's write waits for: the compute stream's event at the save (the compression is queued before it),
    # the slot's fill event (a prefetch into it may still be running) and flush event (a flush of what it held may
    # still read it) as they were at the save; for a Tier.GPU snapshot the first only
    after: tuple[Any, Any, Any]
    slot: int | None  # its slot (None: a Tier.GPU snapshot)
    flush: bool
    used: Any = None  # an off-GPU one's: the compute stream's event after a restore decoded it (NOTE [ Snapshot sizes ] Rule 8)
    entry: int | None = None  # its buffers' entry in the ring of captured saves (NOTE [ Captured saves ] Rules 2-3)
    rows: list[torch.Tensor] | None = None  # its graphs' rows of sizes (NOTE [ Captured saves ] Rule 7)


class CodecSide:
    """The codec methods of ``SnapshotStore``, over the store's state (declared here, set by the store)."""

    device: torch.device
    cuda: bool
    codec: Codec | None
    slot_margin: float
    _c: dict[str, Any]
    _mover: Any
    _layout: Layout | None
    _slots: Slots
    _blobs: dict[int, Blob]
    _packs: dict[int, list[Packed]]
    _save_views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]]
    _first: tuple[tuple[tuple[Any, ...], ...], list[Packed]] | None
    _warned_grow: bool
    _unsized: dict[int, _Unsized]
    _sizing: collections.deque[_Unsized]
    _rows: list[torch.Tensor]
    _fill_ev: list[Any]
    _flush_ev: list[Any]
    _fill_of: list[int | None]
    _dirty: set[int]
    graphs: bool
    sizes_in_flight: int
    _graphs: SaveGraphs | None

    def _flush(self, n: int, s: int, after: Any = None) -> None:  # SnapshotStore's
        raise NotImplementedError

    # -- sizes on the device (NOTE [ Snapshot sizes ]) ----------------------------------------------------------------
    def _save_deferred(self, n: int, tensors: Sequence[torch.Tensor], s: int | None, flush: bool) -> None:
        """Compress snapshot ``n`` with its sizes left on the device, for slot ``s`` (``None``: ``Tier.GPU``)
        (NOTE [ Snapshot sizes ] Rules 1, 3-4)."""
        assert self.codec is not None
        first, self._first = self._first, None
        entry = None
        rows: list[torch.Tensor] | None = None
        if first is not None and first[0] == _identity(tensors):
            defs = [Deferred(p) for p in first[1]]  # the first snapshot, compressed once by calibrate
        elif self.graphs and s is not None:  # NOTE [ Captured saves ] Rules 1-3
            if self._graphs is None:
                self._graphs = SaveGraphs(self.codec, self.device, self.sizes_in_flight + 1)
            entry = self._graphs.entry()
            owner = self._graphs.owner[entry]
            if owner is not None:
                self._settle(owner)
            defs, rows = self._graphs.compress(entry, tensors)
            self._c["graph_saves"] += rows is not None
            self._c["graph_captures"] = self._graphs.captures
            self._c["graph_retries"] = self._graphs.retries
        else:
            defs = [self.codec.compress_deferred(t.detach()) for t in tensors]
        self._c["raw_bytes"] += sum(d.packed.orig_nbytes for d in defs)
        sizes = [d.sizes for d in defs if d.sizes is not None]
        vals = None if not sizes or rows is not None else sizes[0] if len(sizes) == 1 else torch.cat(sizes)
        saved = self._mover.record()  # the compression (and the sizes' cat, or their copies into rows) before it
        after = (saved, None, None) if s is None else (saved, self._fill_ev[s], self._flush_ev[s])
        if not sizes:  # nothing deferred: settled at its save (NOTE [ Snapshot sizes ] Rule 4)
            packs = [d.packed for d in defs]
            self._c["packed_bytes"] += sum(p.nbytes for p in packs)
            self._keep(n, packs, s, after, flush)
            if entry is not None and s is not None:  # NOTE [ Captured saves ] Rule 3
                self._graphs.release(entry, self._fill_ev[s])  # type: ignore[union-attr]
            return
        if vals is None:  # NOTE [ Captured saves ] Rule 7: the graphs copied the sizes into their rows
            row, sized = None, saved
        else:
            last = self._rows[-1] if self._rows else None
            row = self._rows.pop() if last is not None and last.numel() == vals.numel() and last.dtype == vals.dtype \
                else torch.empty(vals.numel(), dtype=vals.dtype, pin_memory=self.cuda)
            sized = self._mover.read_back(row, vals, after=saved)
        if s is None:
            self._packs[n] = [d.packed for d in defs]
        rec = _Unsized(n, defs, row, sized, after, s, flush, entry=entry, rows=rows)
        if entry is not None:
            self._graphs.owner[entry] = rec  # type: ignore[union-attr]
        self._unsized[n] = rec
        self._sizing.append(rec)
        while len(self._sizing) > self.sizes_in_flight:
            self._settle(self._sizing[0])

    def _sized(self, rec: _Unsized) -> bool:
        """Whether ``rec``'s sizes are on the host (the CPU tests replace it to keep snapshots unsized longer)."""
        return rec.sized is None or bool(rec.sized.query())

    def _settle_ready(self) -> None:
        """Settle the unsized snapshots whose sizes are on the host, oldest first (NOTE [ Snapshot sizes ] Rule 2)."""
        while self._sizing and self._sized(self._sizing[0]):
            self._settle(self._sizing[0], ready=True)

    def _settle_all(self) -> None:
        while self._sizing:
            self._settle(self._sizing[0])

    def _settle(self, rec: _Unsized, ready: bool = False) -> None:
        """Read ``rec``'s sizes (waiting only if they are not on the host yet; ``ready``: found there already) and keep
        its snapshot's exact form: trimmed copies (``Tier.GPU``), or its slot written and flushed (NOTE [ Snapshot
        sizes ] Rules 2-3)."""
        assert self.codec is not None
        if self._sizing[0] is rec:
            self._sizing.popleft()
        else:
            self._sizing.remove(rec)
        n = rec.n
        if n is not None:
            del self._unsized[n]
        if not ready and not self._sized(rec):
            self._c["size_waits"] += 1
            if rec.sized is not None:
                rec.sized.synchronize()  # an event of an earlier save (NOTE [ Snapshot sizes ] Rule 3)
        if rec.row is None:  # NOTE [ Captured saves ] Rule 7
            assert rec.rows is not None
            vals: list[int] = [v for r in rec.rows for v in r.tolist()]
        else:
            vals = rec.row.tolist()
            self._rows.append(rec.row)
        packs, i, scratch = [], 0, self.codec.scratch
        # an off-GPU snapshot's settle runs where its place will (NOTE [ Mover ] Rule 6), a Tier.GPU one's here
        # a captured save's buffers are the graphs' own, which outlive the mover's work (NOTE [ Captured saves ] Rule 8)
        owned = rec.entry is not None
        where = self._mover.on_sizes(rec.after[0], () if owned else (b for d in rec.defs for b in d.packed.buffers)) \
            if n is not None and rec.slot is not None else contextlib.nullcontext()
        with where:
            for d in rec.defs:
                k = 0 if d.sizes is None else d.sizes.numel()
                packs.append(self.codec.settle(d, vals[i:i + k]))
                i += k
            # where the settle ran: its last reads of the deferred buffers are before (NOTE [ Snapshot sizes ] Rule 8)
            lend = scratch is not None and rec.entry is None  # graphs own theirs (NOTE [ Captured saves ] Rule 2)
            done = self._mover.record() if lend else None
        if lend and scratch is not None:  # NOTE [ Snapshot sizes ] Rule 8
            scratch.give((b for d in rec.defs for b in d.packed.buffers), (done, rec.used))
        self._c["packed_bytes"] += sum(p.nbytes for p in packs)
        if n is not None:  # the sizes stream waited for the save's event above (on_sizes): the write waits for the rest
            self._keep(n, packs, rec.slot, (None, rec.after[1], rec.after[2]), rec.flush, owned)
        if rec.entry is not None:  # NOTE [ Captured saves ] Rule 3: read last by the slot's write (or the compute stream)
            assert self._graphs is not None
            self._graphs.release(rec.entry, self._fill_ev[rec.slot] if n is not None and rec.slot is not None else None)

    def _keep(self, n: int, packs: list[Packed], s: int | None, after: tuple[Any, Any, Any], flush: bool,
              owned: bool = False) -> None:
        """Keep snapshot ``n``'s exact form: trimmed copies (``s`` is ``None``: ``Tier.GPU``), or slot ``s`` written
        after the events ``after`` and flushed (NOTE [ Snapshot sizes ] Rule 2); ``owned``: see ``Mover.place``."""
        if s is None:
            self._packs[n] = [_own(p) for p in packs]
            return
        blob = Blob(packs)
        self._blobs[n] = blob
        grown = self._ensure_room(s, blob.nbytes)  # a new buffer is allocated on the compute stream: after it
        ev = self._mover.place(self._slots[s], blob, packs, after, after_all=grown, owned=owned)
        self._fill_ev[s] = self._flush_ev[s] = ev
        self._fill_of[s] = None
        if flush:
            self._flush(n, s, after=ev)
        else:
            self._dirty.add(n)

    def _drop_unsized(self, n: int) -> None:
        """Forget unsized snapshot ``n`` (freed, or saved again): it is settled in its turn only to count its packed
        bytes (NOTE [ Snapshot sizes ] Rule 5)."""
        rec = self._unsized.pop(n, None)
        if rec is not None:
            rec.n = None

    def _first_blob(self, tensors: Sequence[torch.Tensor], packs: Sequence[Packed] | None) -> int:
        """Compress the first snapshot once (or take ``packs``, its compression), kept for its save; the slot size it
        asks for: its blob times ``1 + slot_margin`` (NOTE [ Snapshot store ] Rule 9)."""
        if packs is None:
            packs = self._compress(tensors, count=False)
        self._first = (_identity(tensors), list(packs))
        return int(Blob(list(packs)).nbytes * (1.0 + self.slot_margin))

    def _compress(self, tensors: Sequence[torch.Tensor], count: bool = True) -> list[Packed]:
        assert self.codec is not None
        first, self._first = self._first, None
        if first is not None and count and first[0] == _identity(tensors):
            packs = first[1]  # the first snapshot, compressed once by calibrate
        else:
            packs = [self.codec.compress(t.detach()) for t in tensors]
        if count:
            self._c["raw_bytes"] += sum(p.orig_nbytes for p in packs)
            self._c["packed_bytes"] += sum(p.nbytes for p in packs)
        return packs

    def _decompress(self, packs: Sequence[Packed], outs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """``packs`` decoded into fresh tensors, or straight into ``outs`` (NOTE [ Snapshot store ] Rules 8, 11)."""
        assert self.codec is not None
        if outs is None:
            return [self.codec.decompress(p) for p in packs]
        return [self.codec.decompress(p, out=o) for p, o in zip(packs, outs)]

    def _views(self, n: int, flat: torch.Tensor, outs: list[torch.Tensor] | None = None,
               s: int | None = None) -> list[torch.Tensor]:
        """Snapshot ``n``'s tensors from a slot (or a loaded buffer): views, or decompressed
        (NOTE [ Snapshot store ] Rule 8), from its deferred buffers while it is unsized (NOTE [ Snapshot sizes ]
        Rule 1); written into ``outs`` when given (NOTE [ Snapshot store ] Rule 11). ``s``: ``flat`` is that slot's
        buffer (NOTE [ Slot views ])."""
        if self.codec is not None:
            rec = self._unsized.get(n)
            if rec is not None:
                got = self._decompress([d.packed for d in rec.defs], outs)
                if self.codec.scratch is not None:  # after the buffers' last read here (NOTE [ Snapshot sizes ] Rule 8)
                    rec.used = self._mover.record()
                return got
            return self._decompress(self._blobs[n].read(flat), outs)
        if s is None:
            assert self._layout is not None
            views = self._layout.views(flat)
            return views if outs is None else self._copy_into(views, outs)
        kept = self._kept_views(s, flat)  # NOTE [ Slot views ] Rules 1-2
        return [v.view_as(v) for v in kept] if outs is None else self._copy_into(kept, outs)

    @staticmethod
    def _copy_into(src: Sequence[torch.Tensor], outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """One copy of each of ``src`` into ``outs`` (NOTE [ Snapshot store ] Rule 11)."""
        for o, v in zip(outs, src):
            o.copy_(v)
        return outs

    def _fill_flat(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], packs: list[Packed] | None,
                   blob: Blob | None, s: int | None = None) -> None:  # s: the slot, its views kept with its buffer
        if packs is not None and blob is not None:
            blob.write(flat, packs)
            return
        assert self._layout is not None
        for dst, src in zip(self._kept_views(s, flat) if s is not None else self._layout.views(flat), tensors):
            dst.copy_(src)

    def _kept_views(self, s: int, flat: torch.Tensor) -> list[torch.Tensor]:
        """The views of the snapshot's tensors in slot ``s``'s buffer ``flat``, made once per buffer
        (NOTE [ Slot views ])."""
        kept = self._save_views.get(s)
        if kept is None or kept[0] is not flat:
            assert self._layout is not None
            kept = self._save_views[s] = (flat, self._layout.views(flat))
        return kept[1]

    def _ensure_room(self, s: int, nbytes: int) -> bool:
        """Grow slot ``s`` to ``nbytes`` when a blob does not fit (NOTE [ Snapshot store ] Rule 9); whether it grew."""
        old = self._slots[s]
        if nbytes <= old.numel():
            return False
        self._mover.keep_alive(old)  # the old buffer may still be read by a flush or written by a fill
        self._slots[s] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._c["slot_grows"] += 1
        if not self._warned_grow:
            self._warned_grow = True
            warnings.warn(
                f"torchckpt: a compressed snapshot of {nbytes} bytes did not fit its slot of {old.numel()} bytes; "
                "the slot grew (GPU memory beyond the store's budget). Pass SnapshotStore(slot_bytes=...) or a "
                "larger slot_margin, or a codec setting with a steadier ratio.",
                RuntimeWarning, stacklevel=4,
            )
        return True

