"""The action stream an executor reads: a schedule's actions with prefetches and write-back planned as it goes.

# NOTE [ Planned stream ]
# The executors (``checkpointed_loop``'s and ``run_schedule``'s, NOTE [ Executor ];
# ``checkpoint_chain``'s, NOTE [ Chain of blocks ]) read a schedule through ``Planned``.
# 1. ``Planned`` is the action stream: the schedule's actions once, and, unless
#    ``prefetch=False``, with prefetches inserted by ``plan_prefetch`` so that every off-GPU
#    restore has its copy started ahead of time (GPUZIP's Prefetch Setup), and the write-back
#    decided by ``plan_flushes``. Both need the snapshot store's slot count, which a store
#    sized by bytes or holding a codec knows only from the first snapshot; nothing is cached
#    before the first Save (only Advances precede it), so the stream yields up to the first
#    Save unplanned, and the driver's first ``save`` calls ``Planned.start(slots)``, which
#    plans the rest.
# 2. Planning streams: no list of planned actions is built. ``start`` reads the schedule once,
#    planned by ``PrefetchStream``, to decide the write-back (NOTE [ Write-back ] Rule 3; one bit
#    per action) and records each prefetch that stream inserts where it inserts it (two varints,
#    about three bytes per prefetch: how many schedule actions after the previous prefetch it comes,
#    with its tiers, then its step). The stream the
#    executor reads is then the schedule's actions with those prefetches merged back in: the same
#    actions at the same positions as a second ``PrefetchStream``, without planning (and checking) them
#    twice. Memory beyond the schedule's packed ints is those records, the snapshots alive and the cache's
#    slots.
# 3. A packed schedule whose slot classes are all ``Tier.GPU`` has no action the cache sees (NOTE [ Snapshot
#    cache ] Rule 1): planning would insert no prefetch and flush no Save, so ``start`` skips its pass over the
#    schedule (it read every action three times: the scout, the stream and the write-back) and the stream is
#    the schedule's actions as they are.
# 4. For a packed schedule ``start`` reads no action object: ``_plan_packed`` reads the codes (NOTE [ Packed
#    schedules ]) and plans both in one ``CacheReplay`` (NOTE [ Cache replay ]), where Rule 2's two passes (the
#    stream's own check of its plan, then the write-back's replay of that stream) replayed two caches of one size
#    that were always in the same state. Only the cache's events are visited: off-GPU Saves, Restores and Frees,
#    the replay asked for prefetches at each and right after the one before (NOTE [ Cache replay ] Rule 2); it
#    places every prefetch where ``PrefetchStream`` does and flushes the Saves ``flush_positions`` does
#    (tests/schedules/test_planned_equivalence.py). A list of actions still goes through Rule 2's passes, which
#    drive the same ``CacheReplay``.
# 5. Schedules are values (NOTE [ Schedules are values ]): what ``Planned.of`` packs and what ``start`` plans from a
#    schedule depend on it, the slot count and ``prefetch`` alone. So the last ``_KEPT`` schedules run keep, per
#    slot count and ``prefetch``, their prefetch records and write-back bits (a bit an action and a few bytes a
#    prefetch; not the packed actions, an int an action, which packing again makes in a tenth of the time): a run
#    of the same schedule again (an optimisation loop differentiating the same simulation each iteration) reads
#    them instead of planning again, which took 5 ms of a 1000-step schedule's run on this repository's CPU. A
#    schedule that does not hash (a field holding a list) is planned every time.
"""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator

from torchckpt._errors import CheckpointError
from torchckpt.schedules.actions import Action, Prefetch, Save, Tier
from torchckpt.schedules.packed import ADVANCE, FREE, RESTORE, SAVE, PackedSchedule
from torchckpt.schedules.prefetch import PrefetchStream, flush_positions
from torchckpt.schedules.replay import CacheReplay, off_gpu_restores
from torchckpt.schedules.schedule import Schedule

__all__ = ["Planned"]

_TIERS = tuple(Tier)  # a prefetch's tiers, packed as their index here (NOTE [ Planned stream ] Rule 2)
_KEPT = 8  # NOTE [ Planned stream ] Rule 5: schedules whose plans are kept
_kept: OrderedDict[Hashable, dict[tuple[int, bool], tuple[bytes, bytes]]] = OrderedDict()
_kept_lock = threading.Lock()


def _plans_of(schedule: Schedule) -> dict[tuple[int, bool], tuple[bytes, bytes]] | None:
    """The plans made of ``schedule`` (its prefetch records and write-back bits by slot count and ``prefetch``), kept
    for the last ``_KEPT`` schedules run (NOTE [ Planned stream ] Rule 5); ``None`` for a schedule that does not
    hash."""
    with _kept_lock:
        try:
            made = _kept.get(schedule)
        except TypeError:  # it does not hash
            return None
        if made is None:
            made = _kept[schedule] = {}
            while len(_kept) > _KEPT:
                _kept.popitem(last=False)
        else:
            _kept.move_to_end(schedule)
        return made


class Planned:
    """A schedule's actions as the executor consumes them (NOTE [ Planned stream ]).

    Iterating yields ``(position, action)``; positions count the planned stream (prefetches
    included). The same iterator continues where a previous loop over it stopped, so a forward
    sweep and a backward sweep can share it. Nothing holds the planned actions: ``start`` plans
    the write-back (one bit per action) and the prefetches (a few bytes each), and the stream
    merges those prefetches back into the schedule's actions as they are read.

    Args:
        actions: the schedule's actions, readable more than once (a ``PackedSchedule``, a list).
        prefetch: insert prefetches (``False``: restores load on demand).
    """

    def __init__(self, actions: Iterable[Action], prefetch: bool,
                 _plans: dict[tuple[int, bool], tuple[bytes, bytes]] | None = None) -> None:
        self._acts = actions
        self._made = _plans  # NOTE [ Planned stream ] Rule 5: plans of these actions made before, by slot count
        self._prefetch = prefetch
        self._i0 = next((i for i, a in enumerate(actions) if type(a) is Save), -1)
        # NOTE [ Planned stream ] Rule 3: nothing to plan where no slot class is off the GPU
        self._plans = not (isinstance(actions, PackedSchedule) and all(t is Tier.GPU for t in actions.tiers))
        self._slots: int | None = None
        self._flushes = bytearray()
        self._pf = bytearray()  # NOTE [ Planned stream ] Rule 2: the prefetches, ``_varint``s
        self._it = self._stream()

    @staticmethod
    def of(schedule: Iterable[Action], prefetch: bool) -> Planned:
        """The stream of a schedule (packed once, so that reading it again does not plan it again) or a list."""
        if isinstance(schedule, Schedule):
            return Planned(schedule.pack(), prefetch, _plans_of(schedule))  # NOTE [ Planned stream ] Rule 5
        return Planned(schedule if isinstance(schedule, (list, tuple, PackedSchedule)) else list(schedule), prefetch)

    def _rest(self) -> Iterator[Action]:
        """A fresh read of the planned actions from the first Save on."""
        slots = self._slots
        assert slots is not None
        if not self._prefetch:
            return itertools.islice(self._acts, self._i0, None)
        return iter(PrefetchStream(_From(self._acts, self._i0), slots))

    def start(self, slots: int) -> None:
        """Plan from the first Save on for a cache of ``slots`` slots (once, and only with a Save; later calls do
        nothing)."""
        if self._slots is not None or self._i0 < 0:
            return
        self._slots = slots
        if not self._plans:  # NOTE [ Planned stream ] Rule 3
            return
        bits = self._flushes
        acts = self._acts
        made = self._made.get((slots, self._prefetch)) if self._made is not None else None
        if made is not None:  # NOTE [ Planned stream ] Rule 5: planned before
            self._pf[:], bits[:] = made
            return
        if isinstance(acts, PackedSchedule):  # NOTE [ Planned stream ] Rule 4
            _plan_packed(acts, self._i0, slots, self._prefetch, self._pf, bits)
            if self._made is not None:
                self._made[(slots, self._prefetch)] = (bytes(self._pf), bytes(bits))
            return
        rest = self._rest() if not self._prefetch else self._recorded(self._rest())
        for f in flush_positions(rest, slots):
            _set_bit(bits, f + self._i0)

    def _recorded(self, planned: Iterator[Action]) -> Iterator[Action]:
        """``planned``, noting each prefetch and the schedule position it precedes (NOTE [ Planned stream ] Rule 2)."""
        pf, tier = self._pf, _TIERS.index
        k = len(_TIERS)
        m = last = self._i0  # m: position in the schedule of the next action that is not a prefetch
        for a in planned:
            if a.__class__ is Prefetch:
                _varint(pf, ((m - last) * k + tier(a.src)) * k + tier(a.dst))  # type: ignore[attr-defined]
                _varint(pf, a.n)  # type: ignore[attr-defined]
                last = m
            else:
                m += 1
            yield a

    def _prefetches(self) -> Iterator[tuple[int, Prefetch]]:
        """The recorded prefetches: (the schedule position each precedes, the prefetch) (NOTE [ Planned stream ]
        Rule 2)."""
        buf, tiers = self._pf, _TIERS
        k = len(tiers)
        p, end, at = 0, len(buf), self._i0
        while p < end:
            v, p = _read_varint(buf, p)
            n, p = _read_varint(buf, p)
            v, dst = divmod(v, k)
            v, src = divmod(v, k)
            at += v
            yield at, Prefetch(n, tiers[src], tiers[dst])

    def flush(self, i: int) -> bool:
        """Whether the Save at position ``i`` copies its snapshot to host now (NOTE [ Write-back ])."""
        return (i >> 3) < len(self._flushes) and bool(self._flushes[i >> 3] >> (i & 7) & 1)

    def _stream(self) -> Iterator[tuple[int, Action]]:
        it = iter(self._acts)
        if self._i0 < 0:  # no Save: nothing to plan
            yield from enumerate(it)
            return
        for i, a in enumerate(itertools.islice(it, self._i0 + 1)):
            yield i, a
        if self._slots is None:
            raise CheckpointError("torchckpt: the first Save was not executed before the actions after it "
                                  "(internal: the driver's save must call Planned.start)")
        # ``it`` goes on after the first Save, as it is where nothing was planned (NOTE [ Planned stream ] Rule 3)
        if not self._prefetch or not self._plans:
            yield from enumerate(it, self._i0 + 1)
            return
        # NOTE [ Planned stream ] Rule 2: the recorded prefetches merged back in (none precedes the first Save:
        # nothing is saved before it)
        m = k = self._i0 + 1  # m: the schedule's position, k: the stream's
        for at, pf in self._prefetches():
            if at > m:  # the actions before this prefetch, with no Python step of ours per action
                yield from zip(itertools.count(k), itertools.islice(it, at - m))
                k += at - m
                m = at
            yield k, pf
            k += 1
        yield from zip(itertools.count(k), it)

    def __iter__(self) -> Iterator[tuple[int, Action]]:
        return self._it


def _set_bit(bits: bytearray, f: int) -> None:
    """Set bit ``f`` of ``bits``, growing it as needed (a Save that flushes, NOTE [ Planned stream ] Rule 2)."""
    if f >> 3 >= len(bits):
        bits.extend(bytes((f >> 3) + 1 - len(bits)))
    bits[f >> 3] |= 1 << (f & 7)


def _varint(buf: bytearray, v: int) -> None:
    """Append ``v >= 0`` to ``buf``, seven bits a byte, low bits first (a set high bit: more bytes follow)."""
    while v >= 128:
        buf.append(v & 127 | 128)
        v >>= 7
    buf.append(v)


def _read_varint(buf: bytearray, p: int) -> tuple[int, int]:
    """The ``_varint`` at ``buf[p]`` and the position after it."""
    v = shift = 0
    while True:
        b = buf[p]
        p += 1
        v |= (b & 127) << shift
        shift += 7
        if b < 128:
            return v, p


class _From:
    """The actions of ``acts`` from position ``i0`` on, readable more than once."""

    __slots__ = ("acts", "i0")

    def __init__(self, acts: Iterable[Action], i0: int) -> None:
        self.acts, self.i0 = acts, i0

    def __iter__(self) -> Iterator[Action]:
        return itertools.islice(self.acts, self.i0, None)


def _plan_packed(acts: PackedSchedule, i0: int, slots: int, prefetch: bool, pf: bytearray, bits: bytearray) -> None:
    """Plan the prefetches and the write-back of a packed schedule from its first Save (at ``i0``) on, in one
    replay of the snapshot cache (NOTE [ Planned stream ] Rule 4, NOTE [ Cache replay ]).

    Each prefetch is appended to ``pf`` as ``Planned._recorded`` notes it, and each Save to flush sets its stream
    position's bit in ``bits``; ``prefetch=False`` plans the write-back of the actions as they are.
    """
    tiers = acts.tiers
    kc = len(tiers)
    off = [t is not Tier.GPU for t in tiers]

    def flush(f: int) -> None:
        _set_bit(bits, f)

    if not prefetch:  # the write-back alone: restores may miss, Saves may find every slot pinned
        follow: CacheReplay[int] = CacheReplay(slots, flush)
        for r, op, n, _ in _cache_events(acts.codes, kc, off, i0):
            if op == SAVE:
                follow.save(n, r + i0)
            elif op == RESTORE:
                follow.restore(n, r + i0)
            else:
                follow.free(n)
        return

    # one read of the codes for both: the scout runs ahead of the replay to the next restore, the tee holds between
    events, scout = itertools.tee(_cache_events(acts.codes, kc, off, i0))
    replay: CacheReplay[int] = CacheReplay(slots, flush, off_gpu_restores(scout, tiers.__getitem__))
    place, placed, save, restore, free = replay.place, replay.placed, replay.save, replay.restore, replay.free
    tier_ix = [_TIERS.index(t) for t in tiers]
    nt = len(_TIERS)
    gpu = _TIERS.index(Tier.GPU)
    npf = 0  # prefetches planned so far
    last_pf = i0  # the schedule position of the last one (NOTE [ Planned stream ] Rule 2)

    def record() -> None:
        nonlocal npf, last_pf
        for i, n, k in placed:
            _varint(pf, ((i + i0 - last_pf) * nt + (gpu if k is None else tier_ix[k])) * nt + gpu)
            _varint(pf, n)
            last_pf = i + i0
        npf += len(placed)
        placed.clear()

    last = -1  # the position of the last event
    for r, op, n, _ in events:
        # NOTE [ Cache replay ] Rule 2: nothing changed between right after the last event and this one
        if r > last + 1 and place(last + 1):
            record()
        if place(r):
            record()
        if op == SAVE:
            save(n, r + i0 + npf)
        elif op == RESTORE:
            restore(n, r)
        else:
            free(n)
        last = r
    if last + 1 < len(acts.codes) - i0 and place(last + 1):
        record()
    replay.done()


def _cache_events(codes: list[int], kc: int, off: list[bool], i0: int) -> Iterator[tuple[int, int, int, int]]:
    """``(position from i0, op, step, slot class)`` of each off-GPU Save, Restore and Free at or after ``i0``
    (NOTE [ Packed schedules ]), read from the codes."""
    cur = 0
    for i, code in enumerate(codes):
        op = code & 7
        if op == ADVANCE:
            cur = code >> 3
        elif op == SAVE:
            k = code >> 3
            if off[k] and i >= i0:
                yield i - i0, op, cur, k
        elif op == RESTORE:
            cur, k = divmod(code >> 3, kc)
            if off[k] and i >= i0:
                yield i - i0, op, cur, k
        elif op == FREE:
            n, k = divmod(code >> 3, kc)
            if off[k] and i >= i0:
                yield i - i0, op, n, k
