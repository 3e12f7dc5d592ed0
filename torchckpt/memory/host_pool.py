"""Host memory for offloaded tensors: pinned chunks reused across steps.

# NOTE [ Host pool ]
# 1. Memory comes in chunks of ``chunk_bytes`` (a power of two, 256 MiB by default) that
#    are pinned once and kept for the life of the pool: steady-state training does no
#    ``cudaHostAlloc`` per step. A request larger than a chunk gets a chunk of its own,
#    rounded up to a power of two (PyTorch's pinned allocator rounds that way too).
# 2. A block never straddles two chunks. Inside a chunk, first-fit over an offset-sorted
#    free list, coalesced on free; offsets are aligned to ``ALIGN`` bytes.
# 3. A block freed while a copy may still read or write it is parked with the event
#    that copy recorded; it rejoins the free list once the event has completed. When no
#    free span fits but parked blocks hold enough bytes, the allocation waits for their
#    events (oldest first) rather than grow: the host thread may run far ahead of the GPU,
#    and growing then would size the pool by that lead instead of by the working set.
# 4. The pool is capped (``capacity_bytes``, half of physical RAM by default). Past the
#    cap, blocks are plain pageable tensors (copies are then slower, results identical)
#    and the pool warns once. If even pageable memory cannot be had, allocation raises
#    ``CheckpointError``: never a silently wrong gradient.
# 5. The lazily pinned native pool (its own issue) implements this same interface:
#    ``alloc(nbytes) -> HostBlock``, ``free(block, event)``, ``stats()``, ``close()``.
"""
from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any

import torch

from torchckpt._errors import CheckpointError, internal_error
from torchckpt._native import touch_pages
from torchckpt.memory.sysinfo import physical_memory_bytes

ALIGN = 512
_DEFAULT_CHUNK = 256 << 20


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class HostBlock:
    """A span of host memory holding one offloaded tensor's bytes.

    ``tensor`` is a flat ``uint8`` CPU tensor of exactly ``nbytes`` bytes.
    """

    __slots__ = ("tensor", "chunk", "offset", "nbytes", "pinned")

    def __init__(self, tensor: torch.Tensor, chunk: int, offset: int, nbytes: int, pinned: bool):
        self.tensor = tensor
        self.chunk = chunk  # index into the pool's chunks, -1 for a pageable fallback block
        self.offset = offset
        self.nbytes = nbytes
        self.pinned = pinned

    def __repr__(self) -> str:
        return f"HostBlock(chunk={self.chunk}, offset={self.offset}, nbytes={self.nbytes}, pinned={self.pinned})"


@dataclasses.dataclass(frozen=True)
class HostPoolStats:
    """A snapshot of a host pool's occupancy, in bytes."""

    reserved_bytes: int
    pinned_bytes: int
    in_use_bytes: int
    pageable_in_use_bytes: int
    chunks: int
    chunk_allocations: int
    pageable_fallbacks: int


class _Chunk:
    __slots__ = ("buf", "size", "free", "pinned")

    def __init__(self, buf: torch.Tensor, pinned: bool):
        self.buf = buf
        self.size = buf.numel()
        self.free: list[tuple[int, int]] = [(0, self.size)]  # (offset, size), sorted by offset
        self.pinned = pinned

    def take(self, n: int) -> int | None:
        for i, (off, size) in enumerate(self.free):
            if size >= n:
                if size == n:
                    del self.free[i]
                else:
                    self.free[i] = (off + n, size - n)
                return off
        return None

    def give(self, off: int, n: int) -> None:
        free = self.free
        lo, hi = 0, len(free)
        while lo < hi:
            mid = (lo + hi) // 2
            if free[mid][0] < off:
                lo = mid + 1
            else:
                hi = mid
        free.insert(lo, (off, n))
        # Coalesce with the right neighbour, then the left one (see Rule 2).
        if lo + 1 < len(free) and free[lo][0] + free[lo][1] == free[lo + 1][0]:
            free[lo] = (off, n + free[lo + 1][1])
            del free[lo + 1]
        if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == free[lo][0]:
            free[lo - 1] = (free[lo - 1][0], free[lo - 1][1] + free[lo][1])
            del free[lo]


class HostPool:
    """Host memory for offloaded tensors, pinned in large chunks reused across steps.

    Args:
        capacity_bytes: most bytes of pooled host memory; past it, blocks fall back to
            pageable memory with one warning. ``None``: half of physical RAM.
        chunk_bytes: size of each pinned chunk (a power of two, at least 1 MiB).
        pin: pin the chunks (``True`` needs CUDA). ``None``: pin when CUDA is available.

    Example::

        >>> pool = HostPool(capacity_bytes=64 << 20, chunk_bytes=1 << 20, pin=False)
        >>> block = pool.alloc(1000)
        >>> block.tensor.numel()
        1000
        >>> pool.free(block)
        >>> pool.stats().in_use_bytes
        0
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        chunk_bytes: int = _DEFAULT_CHUNK,
        pin: bool | None = None,
    ) -> None:
        if chunk_bytes < (1 << 20) or chunk_bytes & (chunk_bytes - 1):
            raise ValueError(
                f"torchckpt: HostPool chunk_bytes must be a power of two of at least 1 MiB, got {chunk_bytes}; "
                "pass e.g. chunk_bytes=256 << 20."
            )
        if capacity_bytes is None:
            capacity_bytes = physical_memory_bytes() // 2 or (8 << 30)
        if capacity_bytes < 0:
            raise ValueError(f"torchckpt: HostPool capacity_bytes must be >= 0, got {capacity_bytes}.")
        if pin is None:
            pin = torch.cuda.is_available()
        if pin and not torch.cuda.is_available():
            raise CheckpointError(
                "torchckpt: HostPool(pin=True) needs CUDA to pin memory, but torch.cuda.is_available() is False; "
                "pass pin=False (or leave pin=None)."
            )
        self.capacity_bytes = int(capacity_bytes)
        self.chunk_bytes = int(chunk_bytes)
        self.pin = bool(pin)
        self._chunks: list[_Chunk] = []
        self._parked: list[tuple[HostBlock, Any]] = []  # freed blocks whose last copy may still run
        self._lock = threading.Lock()
        self._reserved = 0
        self._in_use = 0
        self._pageable_in_use = 0
        self._chunk_allocations = 0
        self._fallbacks = 0
        self._warned = False

    def __deepcopy__(self, memo: dict[int, Any]) -> HostPool:
        return self  # pinned memory is a shared resource

    def __reduce__(self) -> tuple[Any, ...]:
        """A pool pickles as its configuration: unpickling gives a fresh, empty pool."""
        return (HostPool, (self.capacity_bytes, self.chunk_bytes, self.pin))

    # -- allocation -------------------------------------------------------------------
    def alloc(self, nbytes: int) -> HostBlock:
        """A block of ``nbytes`` bytes (pinned if the pool pins and is under its cap)."""
        if nbytes <= 0:
            raise ValueError(f"torchckpt: HostPool.alloc needs a positive size, got {nbytes}.")
        need = _round_up(nbytes, ALIGN)
        with self._lock:
            hit = self._place(need)
            if hit is not None:
                ci, off = hit
                chunk = self._chunks[ci]
                self._in_use += need
                return HostBlock(chunk.buf[off : off + nbytes], ci, off, need, chunk.pinned)
            return self._pageable(nbytes)

    def free(self, block: HostBlock, event: Any = None) -> None:
        """Return ``block``; ``event`` (a CUDA event or None) marks the end of its last copy."""
        with self._lock:
            if block.chunk < 0:
                self._pageable_in_use -= block.nbytes
                block.tensor = torch.empty(0, dtype=torch.uint8)
                return
            if event is not None and not event.query():
                self._parked.append((block, event))
                return
            self._release(block)

    def stats(self) -> HostPoolStats:
        """Current occupancy (parked blocks count as in use)."""
        with self._lock:
            return HostPoolStats(
                reserved_bytes=self._reserved,
                pinned_bytes=sum(c.size for c in self._chunks if c.pinned),
                in_use_bytes=self._in_use,
                pageable_in_use_bytes=self._pageable_in_use,
                chunks=len(self._chunks),
                chunk_allocations=self._chunk_allocations,
                pageable_fallbacks=self._fallbacks,
            )

    def note_copy(self, stream: Any) -> None:
        """Hear of a copy just issued on ``stream`` to or from this pool (``LazyHostPool`` uses it)."""
        return None

    def close(self) -> None:
        """Wait for parked copies and drop every chunk (blocks handed out become invalid)."""
        with self._lock:
            self._reclaim(block=True)
            self._chunks.clear()
            self._reserved = 0
            self._in_use = 0

    # -- internals ----------------------------------------------------------------------
    def _place(self, need: int) -> tuple[int, int] | None:
        """(chunk, offset) of ``need`` free bytes, waiting for parked blocks and growing as Rule 3
        says; ``None`` when the pool cannot hold it. Called with the lock held."""
        self._reclaim(block=False)
        hit = self._take(need)
        while hit is None and self._parked and sum(b.nbytes for b, _ in self._parked) >= need:
            blk, ev = self._parked.pop(0)  # Rule 3: wait for the oldest, then try again
            ev.synchronize()
            self._release(blk)
            hit = self._take(need)
        if hit is None and self._reserved + self._grow_size(need) <= self.capacity_bytes:
            self._grow(need)
            hit = self._take(need)
        if hit is None and self._parked:
            # At the cap: wait for parked blocks rather than go pageable (Rule 3).
            self._reclaim(block=True)
            hit = self._take(need)
        return hit

    def _grow_size(self, need: int) -> int:
        return self.chunk_bytes if need <= self.chunk_bytes else _next_pow2(need)

    def _grow(self, need: int) -> None:
        size = self._grow_size(need)
        try:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as e:  # cudaHostAlloc refused: stay correct, go pageable (Rule 4)
            self._warn(f"pinning a {size >> 20} MiB chunk failed ({e})")
            return
        self._chunks.append(_Chunk(buf, self.pin))
        self._reserved += size
        self._chunk_allocations += 1

    def _take(self, need: int) -> tuple[int, int] | None:
        for ci, chunk in enumerate(self._chunks):
            off = chunk.take(need)
            if off is not None:
                return ci, off
        return None

    def _release(self, block: HostBlock) -> None:
        if block.chunk >= len(self._chunks):
            raise internal_error("host block freed twice or after close()")
        self._chunks[block.chunk].give(block.offset, block.nbytes)
        self._in_use -= block.nbytes
        block.tensor = torch.empty(0, dtype=torch.uint8)

    def _reclaim(self, block: bool) -> None:
        keep = []
        for blk, ev in self._parked:
            if block:
                ev.synchronize()
                self._release(blk)
            elif ev.query():
                self._release(blk)
            else:
                keep.append((blk, ev))
        self._parked = keep

    def _pageable(self, nbytes: int) -> HostBlock:
        self._warn(f"the host pool reached its cap of {self.capacity_bytes / 2**30:.2f} GiB")
        try:
            t = torch.empty(nbytes, dtype=torch.uint8)
        except RuntimeError as e:
            raise CheckpointError(
                f"torchckpt: host memory exhausted: could not allocate {nbytes} bytes for an offloaded tensor "
                f"({e}). Give the GPU cache a larger budget (Store(gpu_bytes=...)), offload fewer blocks, or use "
                "Recompute() for some of them."
            ) from e
        touch_pages(t)  # copies into untouched pageable pages are ~10x slower (csrc/ops.cpp)
        self._fallbacks += 1
        self._pageable_in_use += nbytes
        return HostBlock(t, -1, 0, nbytes, False)

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"torchckpt: {why}; further offloaded tensors use pageable host memory (slower copies, "
                "same results). Pass HostPool(capacity_bytes=...) to raise the cap.",
                RuntimeWarning,
                stacklevel=4,
            )
