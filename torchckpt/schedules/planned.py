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
#    actions at the same positions as a second ``PrefetchStream``, without planning (and checking,
#    ``_CacheFollower``) them twice. Memory beyond the schedule's packed ints is those records, the
#    snapshots alive and the cache's slots.
# 3. A packed schedule whose slot classes are all ``Tier.GPU`` has no action the cache sees (NOTE [ Snapshot
#    cache ] Rule 1): planning would insert no prefetch and flush no Save, so ``start`` skips its pass over the
#    schedule (it read every action three times: the scout, the stream and the write-back) and the stream is
#    the schedule's actions as they are.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from torchckpt._errors import CheckpointError
from torchckpt.schedules.actions import Action, Prefetch, Save, Tier
from torchckpt.schedules.packed import PackedSchedule
from torchckpt.schedules.prefetch import PrefetchStream, flush_positions
from torchckpt.schedules.schedule import Schedule

__all__ = ["Planned"]

_TIERS = tuple(Tier)  # a prefetch's tiers, packed as their index here (NOTE [ Planned stream ] Rule 2)


class Planned:
    """A schedule's actions as the executor consumes them (NOTE [ Planned stream ]).

    Iterating yields ``(position, action)``; positions count the planned stream (prefetches
    included). The same iterator continues where a previous loop over it stopped, so a forward
    sweep and a backward sweep can share it. Nothing holds the planned actions: ``start`` reads
    the schedule once to plan the write-back (one bit per action), and the stream plans the
    prefetches again as it is read (``PrefetchStream``).

    Args:
        actions: the schedule's actions, readable more than once (a ``PackedSchedule``, a list).
        prefetch: insert prefetches (``False``: restores load on demand).
    """

    def __init__(self, actions: Iterable[Action], prefetch: bool) -> None:
        self._acts = actions
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
            return Planned(schedule.pack(), prefetch)
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
        rest = self._rest() if not self._prefetch else self._recorded(self._rest())
        for f in flush_positions(rest, slots):
            f += self._i0
            if f >> 3 >= len(bits):
                bits.extend(bytes((f >> 3) + 1 - len(bits)))
            bits[f >> 3] |= 1 << (f & 7)

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
        pfs = self._prefetches()
        nxt, pf = next(pfs, (-1, None))
        k = self._i0 + 1
        for m, a in enumerate(it, self._i0 + 1):
            while m == nxt:
                yield k, pf  # type: ignore[misc]
                k += 1
                nxt, pf = next(pfs, (-1, None))
            yield k, a
            k += 1

    def __iter__(self) -> Iterator[tuple[int, Action]]:
        return self._it


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
