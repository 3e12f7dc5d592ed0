"""Prefetch planning from a recorded trace: a dry run of the GPU cache.

# NOTE [ Prefetch from a recorded trace ]
# This is the Prefetch Setup Algorithm of GPUZIP (Maltempi et al., 2025) applied to the
# order in which autograd packs, unpacks and releases saved tensors, instead of to a
# checkpoint schedule.
# 1. A step's trace is the sequence of events PACK(i, nbytes), UNPACK(i), RELEASE(i), where
#    i numbers the step's entries in pack order. A step begins at the first pack made while
#    no entry of the store is alive (the graph of the previous step has been freed).
# 2. The dry run replays the trace through a ``Cache`` with the store's budget, with
#    exactly the rules the runtime applies: a pack evicts LRU victims until it fits, then is
#    inserted (one larger than the free budget is evicted at once); an unpack of a resident
#    entry is a hit; of an absent one, a load on demand (a miss, admitted the same way);
#    a release removes the entry.
# 3. After each unpack and each release from the first unpack on (a release frees bytes, so
#    a prefetch can start then rather than at the next unpack), the dry run walks the future
#    unpacks in order. An entry already resident is *scheduled*: pinned, so that eviction
#    cannot take it before its use. An absent one is prefetched if it fits in the free budget
#    (inserted pinned); the walk stops at the first one that does not fit, so prefetches are
#    issued in order of use, each at the earliest event after which its bytes are free.
#    If it does not fit but unpinned resident entries could make room, those are evicted,
#    furthest next use first: being unpinned, each is used after the candidate (the
#    "aggressive" prefetching of Cao, Felten, Karlin and Li, SIGMETRICS 1995). Entries with no
#    later use, and entries unpacked since the last release (the node using them may still
#    hold them), are never chosen: evicting them would free nothing.
# 4. The result maps trace position -> actions: an entry id i >= 0 (pin it if resident, else
#    start its host-to-device copy) or ~i (evict entry i). The runtime executes them
#    verbatim with the same cache rules, so the runtime's hits are the dry run's hits.
# 5. Write-back from the second step on: only entries the dry run evicts at some point
#    (``writes``) are copied to host at pack; the others never leave the GPU. An entry
#    evicted without a host copy (the runtime left the plan) is copied at eviction.
# 6. From the second step on, the runtime compares each event with the planned trace; on the
#    first difference it stops following the plan for the rest of the step (write-through,
#    loads on demand: still exact) and plans again from the new trace.
"""
from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from torchckpt.schedules.cache import Cache

PACK, UNPACK, RELEASE = 0, 1, 2
Event = tuple[int, int, int]  # (kind, entry id, nbytes or 0)


@dataclasses.dataclass(frozen=True)
class TracePrefetch:
    """What the dry run decided and predicts for a trace (see NOTE [ Prefetch from a recorded trace ]).

    Attributes:
        trace: the events planned for.
        actions: trace position -> entry ids to schedule (pin if resident, else prefetch).
        writes: entries evicted at some point, which need a host copy (NOTE [ Prefetch from a recorded trace ] Rule 5).
        cache_hits: unpacks served by an entry resident since its pack.
        prefetch_hits: unpacks served by a prefetch.
        misses: unpacks that must load on demand.
        peak_bytes: most bytes resident at once.
    """

    trace: tuple[Event, ...]
    actions: dict[int, tuple[int, ...]]
    writes: frozenset[int]
    cache_hits: int
    prefetch_hits: int
    misses: int
    peak_bytes: int

    @property
    def pack_sizes(self) -> tuple[int, ...]:
        return tuple(n for kind, _, n in self.trace if kind == PACK)

    @property
    def unpack_ids(self) -> tuple[int, ...]:
        return tuple(i for kind, i, _ in self.trace if kind == UNPACK)


def prefetch_from_trace(trace: Sequence[Event], budget_bytes: int, lookahead: int = 256) -> TracePrefetch:
    """Dry-run the GPU cache over ``trace`` and derive prefetch actions.

    Args:
        trace: PACK/UNPACK/RELEASE events of one step.
        budget_bytes: the GPU cache budget the runtime uses.
        lookahead: most future unpacks examined after each event.

    Returns:
        The plan, with the hits and misses it predicts.

    Example::

        >>> t = [(PACK, 0, 10), (PACK, 1, 10), (PACK, 2, 10), (UNPACK, 2, 0), (RELEASE, 2, 0),
        ...      (UNPACK, 1, 0), (RELEASE, 1, 0), (UNPACK, 0, 0), (RELEASE, 0, 0)]
        >>> p = prefetch_from_trace(t, budget_bytes=20)
        >>> p.actions, sorted(p.writes), p.misses
        ({3: (1,), 4: (0,)}, [0], 0)
    """
    sizes: dict[int, int] = {}
    unpacks = [i for kind, i, _ in trace if kind == UNPACK]
    uses: dict[int, list[int]] = {}
    for n, i in enumerate(unpacks):
        uses.setdefault(i, []).append(n)

    def next_use(i: int, after: int) -> int:
        u = uses.get(i, ())
        n = bisect.bisect_right(u, after)  # type: ignore[arg-type]
        return u[n] if n < len(u) else len(unpacks)
    cache: Cache[int] = Cache(budget_bytes)
    prefetched: set[int] = set()
    released: set[int] = set()
    writes: set[int] = set()
    actions: dict[int, tuple[int, ...]] = {}
    hits = pf_hits = misses = 0
    k = -1  # unpacks seen
    nxt = 0  # next position in ``unpacks`` the walk has not scheduled

    in_use: set[int] = set()  # unpacked since the last release: the node using them still runs

    def evict(extra: int) -> None:
        for v in cache.victims(extra):
            cache.remove(v)
            writes.add(v)  # type: ignore[arg-type]

    for pos, (kind, i, nbytes) in enumerate(trace):
        if kind == PACK:
            sizes[i] = nbytes
            evict(nbytes)
            if cache.fits(nbytes):
                cache.insert(i, nbytes)
            else:  # larger than the free budget: evicted at once
                writes.add(i)
        elif kind == RELEASE:
            cache.remove(i)
            released.add(i)
            prefetched.discard(i)
            in_use.clear()
        else:
            k += 1
            if i in cache:
                if i in prefetched:
                    pf_hits += 1
                    prefetched.discard(i)
                else:
                    hits += 1
                cache.touch(i)
            else:
                misses += 1
                evict(sizes.get(i, 0))
                if cache.fits(sizes.get(i, 0)):
                    cache.insert(i, sizes.get(i, 0))
            in_use.add(i)
        if kind == PACK or k < 0:
            continue
        # NOTE [ Prefetch from a recorded trace ] Rule 3: schedule the next unpacks in order while their bytes fit.
        nxt = max(nxt, k + 1)
        chosen: list[int] = []
        while nxt < len(unpacks) and nxt <= k + lookahead:
            j = unpacks[nxt]
            if j in released or j not in sizes:
                break
            if j in cache:
                cache.pin(j)
            else:
                short = cache.used + sizes[j] - cache.capacity
                if short > 0:  # NOTE [ Prefetch from a recorded trace ] Rule 3: make room from entries used after j, if they suffice
                    # Entries with no later use are about to be released: wait for that instead.
                    later = [(next_use(v, nxt), v) for v in cache.unpinned()]  # type: ignore[arg-type]
                    spare = [v for u, v in sorted(later, key=lambda p: -p[0]) if u < len(unpacks) and v not in in_use]
                    if sum(cache.size(v) for v in spare) < short:
                        break
                    for v in spare:
                        if short <= 0:
                            break
                        short -= cache.size(v)
                        cache.remove(v)
                        writes.add(v)  # type: ignore[arg-type]
                        chosen.append(~v)  # type: ignore[operator]
                cache.insert(j, sizes[j], pinned=True)
                prefetched.add(j)
            chosen.append(j)
            nxt += 1
        if chosen:
            actions[pos] = tuple(chosen)
    return TracePrefetch(tuple(trace), actions, frozenset(writes), hits, pf_hits, misses, cache.peak)
