"""The one model of a GPU cache: LRU ranking, pins and capacity, for dry runs and runtimes alike.

# NOTE [ Cache model ]
# Both GPUZIP caches are this class: the training store's cache of saved tensors (capacity
# in bytes; the runtime in store/saved.py and the dry run of schedules/trace.py) and the
# snapshot cache of an adjoint (capacity in slots, every snapshot of size 1; the dry runs of
# schedules/prefetch.py and the runtime in store/snapshots.py). A runtime and its dry run
# replay the same events on it, so they rank, evict and pin identically.
# 1. Bookkeeping only: keys are ranked least- to most-recently used in an ordered dict
#    (O(1) to move a key; no tensor data moves to change rank), and their sizes are counted
#    against ``capacity``. Residency itself is a reference held by the runtime.
# 2. A key can be pinned, once per future use: a prefetched entry awaiting its use. Eviction
#    never takes a pinned key, so a prefetch is never wasted by evicting it before its use.
#    ``use`` ends one pin (a snapshot's Restore); ``touch`` ends them all (an unpack).
# 3. ``victims(extra)`` names, least recently used first, the unpinned keys to evict so that
#    ``extra`` more fit; ``admit`` evicts them and inserts. ``can_take(size)`` says whether
#    that can succeed (free capacity plus unpinned sizes suffice).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Cache"]

K = TypeVar("K", bound=Hashable)


class Cache(Generic[K]):
    """LRU ranking, pins and capacity accounting of a GPU cache (NOTE [ Cache model ]).

    Args:
        capacity: most units the resident entries may occupy (bytes, or slots with every
            entry of size 1); >= 0.

    Example::

        >>> c = Cache(100)
        >>> c.insert("a", 60); c.insert("b", 30)
        >>> c.victims(20)
        ['a']
        >>> slots = Cache(2)
        >>> slots.admit(1), slots.admit(2), slots.admit(3)
        ([], [], [1])
    """

    __slots__ = ("capacity", "used", "peak", "_rank", "_pins", "_pinned_size")

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(
                f"torchckpt: a GPU cache's capacity must be an int >= 0, got {capacity!r}; "
                "pass gpu_bytes=0 to send every offloaded tensor straight to host memory."
            )
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self._rank: OrderedDict[K, int] = OrderedDict()  # key -> size, LRU first
        self._pins: dict[K, int] = {}  # key -> pins (> 0)
        self._pinned_size = 0  # sum of the sizes of pinned keys

    def __contains__(self, key: K) -> bool:
        return key in self._rank

    def __len__(self) -> int:
        return len(self._rank)

    @property
    def pinned(self) -> int:
        """How many resident keys hold a pin."""
        return len(self._pins)

    def is_pinned(self, key: K) -> bool:
        """Whether ``key`` holds a pin."""
        return key in self._pins

    def size(self, key: K) -> int:
        """Size of resident ``key``."""
        return self._rank[key]

    def fits(self, size: int) -> bool:
        """Whether ``size`` more fit without evicting anything."""
        return self.used + size <= self.capacity

    def can_take(self, size: int = 1) -> bool:
        """Whether ``admit`` of ``size`` can succeed: free capacity plus unpinned entries suffice
        (NOTE [ Cache model ] Rule 3)."""
        return self.capacity - self._pinned_size >= size  # free + unpinned = capacity - pinned

    def insert(self, key: K, size: int = 1, pinned: bool = False) -> None:
        """Add ``key`` as most recently used, evicting nothing (the caller evicts ``victims``)."""
        self._rank[key] = size
        self.used += size
        if self.used > self.peak:
            self.peak = self.used
        if pinned:
            self.pin(key)

    def admit(self, key: K, size: int = 1) -> list[K]:
        """Make ``key`` most recently used, inserting it after evicting ``victims(size)``.

        Returns the evicted keys (none when ``key`` was resident). The caller checked ``can_take``.
        """
        rank = self._rank
        if key in rank:
            rank.move_to_end(key)
            return []
        out: list[K] = []
        if self.used + size > self.capacity:  # else ``victims(size)`` is empty: no call to find it
            out = self.victims(size)
            for v in out:
                self.remove(v)
        rank[key] = size  # ``insert``, inline
        self.used += size
        if self.used > self.peak:
            self.peak = self.used
        return out

    def pin(self, key: K) -> None:
        """Add one pin to resident ``key`` (NOTE [ Cache model ] Rule 2); a key not resident is left alone."""
        if key in self._rank:
            count = self._pins.get(key, 0)
            if count == 0:
                self._pinned_size += self._rank[key]
            self._pins[key] = count + 1

    def use(self, key: K) -> bool:
        """One use of ``key``: a hit makes it most recently used; one pin ends (NOTE [ Cache model ] Rule 2). Returns the hit."""
        hit = key in self._rank
        if hit:
            self._rank.move_to_end(key)
        count = self._pins.get(key, 0)
        if count == 1:
            del self._pins[key]
            self._pinned_size -= self._rank[key]
        elif count > 1:
            self._pins[key] = count - 1
        return hit

    def touch(self, key: K) -> None:
        """Mark resident ``key`` most recently used and end all its pins."""
        self._rank.move_to_end(key)
        if self._pins.pop(key, 0):
            self._pinned_size -= self._rank[key]

    def remove(self, key: K) -> bool:
        """Forget ``key`` if resident; returns whether it was pinned (a prefetch wasted)."""
        size = self._rank.pop(key, None)
        if size is None:
            return False
        self.used -= size
        if self._pins.pop(key, 0):
            self._pinned_size -= size
            return True
        return False

    def unpinned(self) -> list[K]:
        """Resident keys that eviction may take, least recently used first."""
        return [k for k in self._rank if k not in self._pins]

    def victims(self, extra: int = 0) -> list[K]:
        """Unpinned keys, LRU first, whose removal brings usage to the capacity with ``extra`` more
        (NOTE [ Cache model ] Rule 3).

        Fewer (all unpinned keys) when even that does not suffice; the caller removes them.
        """
        over = self.used + extra - self.capacity
        out: list[K] = []
        if over <= 0:
            return out
        for key, size in self._rank.items():
            if key in self._pins:
                continue
            out.append(key)
            over -= size
            if over <= 0:
                break
        return out
