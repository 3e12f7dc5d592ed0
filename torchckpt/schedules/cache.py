"""Which offloaded tensors stay resident on the GPU: a byte budget ranked LRU.

# NOTE [ GPU cache ]
# 1. The cache does bookkeeping only: it ranks keys least- to most-recently used in an
#    ordered dict (moving a key is O(1); no tensor data ever moves to change rank) and
#    counts their bytes against ``budget_bytes``.
# 2. Residency is a reference. For training activations the cached copy *is* the tensor
#    autograd saved (zero-copy); a restored tensor is the buffer its host-to-device copy
#    filled. Memory comes from PyTorch's caching allocator, so the budget bounds what
#    torchckpt holds on the GPU beyond what the model itself holds.
# 3. A key can be pinned: a prefetched tensor awaiting its use, which eviction must skip
#    (a prefetch is never wasted by evicting it before use).
# 4. ``victims(extra)`` names, LRU first, the unpinned keys to evict so that ``extra`` more
#    bytes fit. The store evicts them; evicting one whose device-to-host copy is still in
#    flight waits on that copy's event first (the SAVE-waits-on-slot rule of GPUZIP).
# 5. The same class serves the dry run (schedules/trace.py): runtime and plan rank identically.
"""
from __future__ import annotations

from collections import OrderedDict


class GpuCache:
    """LRU ranking and byte accounting of GPU-resident entries.

    Args:
        budget_bytes: most bytes the resident entries may occupy (>= 0).

    Example::

        >>> c = GpuCache(100)
        >>> c.insert("a", 60); c.insert("b", 30)
        >>> list(c.victims(20))
        ['a']
    """

    __slots__ = ("budget_bytes", "used_bytes", "_rank", "_pinned", "peak_bytes")

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(
                f"torchckpt: the GPU cache budget must be >= 0 bytes, got {budget_bytes}; "
                "pass gpu_bytes=0 to send every offloaded tensor straight to host memory."
            )
        self.budget_bytes = int(budget_bytes)
        self.used_bytes = 0
        self.peak_bytes = 0
        self._rank: OrderedDict[object, int] = OrderedDict()
        self._pinned: set[object] = set()

    def __contains__(self, key: object) -> bool:
        return key in self._rank

    def __len__(self) -> int:
        return len(self._rank)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit without evicting anything."""
        return self.used_bytes + nbytes <= self.budget_bytes

    def insert(self, key: object, nbytes: int, pinned: bool = False) -> None:
        """Add ``key`` as most recently used (the caller evicts ``victims`` afterwards)."""
        self._rank[key] = nbytes
        self.used_bytes += nbytes
        if self.used_bytes > self.peak_bytes:
            self.peak_bytes = self.used_bytes
        if pinned:
            self._pinned.add(key)

    def pin(self, key: object) -> None:
        """Protect resident ``key`` from eviction until it is touched (Rule 3)."""
        if key in self._rank:
            self._pinned.add(key)

    def touch(self, key: object) -> None:
        """Mark ``key`` most recently used and unpin it (its prefetch has been used)."""
        self._rank.move_to_end(key)
        self._pinned.discard(key)

    def remove(self, key: object) -> None:
        """Forget ``key`` if it is resident."""
        nbytes = self._rank.pop(key, None)
        if nbytes is not None:
            self.used_bytes -= nbytes
            self._pinned.discard(key)

    def size(self, key: object) -> int:
        """Bytes of resident ``key``."""
        return self._rank[key]

    def unpinned(self) -> list[object]:
        """Resident keys that eviction may take, LRU first."""
        return [k for k in self._rank if k not in self._pinned]

    def victims(self, extra: int = 0) -> list[object]:
        """Unpinned keys, LRU first, whose removal brings usage to the budget with ``extra`` more (Rule 4).

        Fewer (all unpinned keys) when even that does not suffice; the caller removes them.
        """
        over = self.used_bytes + extra - self.budget_bytes
        out: list[object] = []
        if over <= 0:
            return out
        for key, nbytes in self._rank.items():
            if key in self._pinned:
                continue
            out.append(key)
            over -= nbytes
            if over <= 0:
                break
        return out
