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
# 4. The pool is capped (``capacity_bytes``; by default this process's share of half of physical RAM,
#    Rule 6). Past the
#    cap, blocks are plain pageable tensors (copies are then slower, results identical)
#    and the pool warns once. If even pageable memory cannot be had, allocation raises
#    ``CheckpointError``: never a silently wrong gradient.
# 5. Rules 2-4 are ``Blocks``, the allocator both pools compose: ``HostPool`` grows it by
#    pinned chunks, ``LazyHostPool`` (lazy_pool.py) gives it the chunks of one mapping. Both
#    are ``HostPoolBase``: ``alloc(nbytes) -> HostBlock``, ``free(block, event)``,
#    ``stats()``, ``note_copy(stream)``, ``close()``.
# 6. The default cap (``capacity_bytes=None``, as the stores' default pool has it) is this process's share of the
#    node: the single-process default from the node's figures (half of physical RAM here; ``LazyHostPool``'s, also at
#    most 80% of the available memory) divided by the processes of the job on this node, so that the pools of a
#    node's ranks together ask for what one process alone would. Those are counted by ``local_ranks`` (sysinfo.py),
#    from ``LOCAL_WORLD_SIZE`` (torchrun and torch.distributed.elastic set it); where it is not set the process counts
#    as alone (1), with one warning when torch.distributed runs several ranks: the ranks on a node are not asked, as
#    a gather when a pool is made, which need not be on every rank at the same moment, could hang. A malformed
#    ``LOCAL_WORLD_SIZE`` (not a positive integer) is a ``torchckpt:`` error saying what to set. A given
#    ``capacity_bytes`` is never divided.
"""
from __future__ import annotations

import abc
import dataclasses
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torchckpt._errors import CheckpointError, format_bytes, internal_error
from torchckpt._native import touch_pages
from torchckpt.memory.sysinfo import node_share, physical_memory_bytes

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


class Chunk:
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
        # Coalesce with the right neighbour, then the left one (see NOTE [ Host pool ] Rule 2).
        if lo + 1 < len(free) and free[lo][0] + free[lo][1] == free[lo + 1][0]:
            free[lo] = (off, n + free[lo + 1][1])
            del free[lo + 1]
        if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == free[lo][0]:
            free[lo - 1] = (free[lo - 1][0], free[lo - 1][1] + free[lo][1])
            del free[lo]


class Blocks:
    """First-fit blocks over a list of chunks, parked blocks and the pageable fallback (NOTE [ Host pool ] Rules 2-4).

    Not thread-safe by itself: the owning pool holds ``lock`` around every call.

    Args:
        capacity_bytes: the owner's cap, named in the one warning past it.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.chunks: list[Chunk] = []
        self.parked: list[tuple[HostBlock, Any]] = []  # freed blocks whose last copy may still run
        self.lock = threading.Lock()
        self.reserved = 0
        self.in_use = 0
        self.pageable_in_use = 0
        self.chunk_allocations = 0
        self.fallbacks = 0
        self._warned = False

    def place(self, need: int, grow: Callable[[int], bool] | None = None) -> tuple[int, int] | None:
        """(chunk, offset) of ``need`` free bytes, waiting for parked blocks and calling ``grow(need)`` (which
        adds a chunk and says whether it did) as NOTE [ Host pool ] Rule 3 says; ``None`` when the chunks cannot hold it."""
        self.reclaim(block=False)
        hit = self.take(need)
        while hit is None and self.parked and sum(b.nbytes for b, _ in self.parked) >= need:
            blk, ev = self.parked.pop(0)  # NOTE [ Host pool ] Rule 3: wait for the oldest, then try again
            ev.synchronize()
            self.release(blk)
            hit = self.take(need)
        if hit is None and grow is not None and grow(need):
            hit = self.take(need)
        if hit is None and self.parked:
            # At the cap: wait for parked blocks rather than go pageable (NOTE [ Host pool ] Rule 3).
            self.reclaim(block=True)
            hit = self.take(need)
        if hit is not None:
            self.in_use += need
        return hit

    def take(self, need: int) -> tuple[int, int] | None:
        for ci, chunk in enumerate(self.chunks):
            off = chunk.take(need)
            if off is not None:
                return ci, off
        return None

    def free(self, block: HostBlock, event: Any = None) -> None:
        """Return ``block``; ``event`` (a CUDA event or None) marks the end of its last copy."""
        if block.chunk < 0:
            self.pageable_in_use -= block.nbytes
            block.tensor = torch.empty(0, dtype=torch.uint8)
            return
        if event is not None and not event.query():
            self.parked.append((block, event))
            return
        self.release(block)

    def release(self, block: HostBlock) -> None:
        if block.chunk >= len(self.chunks):
            raise internal_error("host block freed twice or after close()")
        self.chunks[block.chunk].give(block.offset, block.nbytes)
        self.in_use -= block.nbytes
        block.tensor = torch.empty(0, dtype=torch.uint8)

    def reclaim(self, block: bool) -> None:
        keep = []
        for blk, ev in self.parked:
            if block:
                ev.synchronize()
                self.release(blk)
            elif ev.query():
                self.release(blk)
            else:
                keep.append((blk, ev))
        self.parked = keep

    def clear(self) -> None:
        """Wait for parked copies and drop every chunk (blocks handed out become invalid)."""
        self.reclaim(block=True)
        self.chunks.clear()
        self.reserved = 0
        self.in_use = 0

    def pageable(self, nbytes: int, why: str | None = None) -> HostBlock:
        """A plain pageable block past the cap (NOTE [ Host pool ] Rule 4), with the one warning."""
        self.warn(why or f"the host pool reached its cap of {format_bytes(self.capacity_bytes)}")
        try:
            t = torch.empty(nbytes, dtype=torch.uint8)
        except RuntimeError as e:
            raise CheckpointError(
                f"torchckpt: host memory exhausted: could not allocate {nbytes} bytes for an offloaded tensor "
                f"({e}). Give the GPU cache a larger budget (Store(gpu_bytes=...)), offload fewer blocks, or use "
                "Recompute() for some of them."
            ) from e
        touch_pages(t)  # copies into untouched pageable pages are ~10x slower (csrc/ops.cpp)
        self.fallbacks += 1
        self.pageable_in_use += nbytes
        return HostBlock(t, -1, 0, nbytes, False)

    def warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"torchckpt: {why}; further offloaded tensors use pageable host memory (slower copies, "
                "same results). Pass HostPool(capacity_bytes=...) to raise the cap.",
                RuntimeWarning,
                stacklevel=5,
            )


class HostPoolBase(abc.ABC):
    """What the stores use of a host pool (NOTE [ Host pool ] Rule 5)."""

    capacity_bytes: int
    pin: bool

    @abc.abstractmethod
    def alloc(self, nbytes: int) -> HostBlock:
        """A block of ``nbytes`` bytes."""

    @abc.abstractmethod
    def free(self, block: HostBlock, event: Any = None) -> None:
        """Return ``block``; ``event`` (a CUDA event or None) marks the end of its last copy."""

    @abc.abstractmethod
    def stats(self) -> HostPoolStats:
        """Current occupancy."""

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for parked copies and give the memory back (blocks handed out become invalid)."""

    def note_copy(self, stream: Any) -> None:
        """Hear of a copy just issued on ``stream`` to or from this pool (NOTE [ Mover ] Rule 3)."""
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> HostPoolBase:
        return self  # pinned memory is a shared resource


class HostPool(HostPoolBase):
    """Host memory for offloaded tensors, pinned in large chunks reused across steps.

    Args:
        capacity_bytes: most bytes of pooled host memory; past it, blocks fall back to
            pageable memory with one warning. ``None``: half of physical RAM divided by the processes of
            the job on this node (``LOCAL_WORLD_SIZE``; NOTE [ Host pool ] Rule 6).
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
            capacity_bytes = node_share(physical_memory_bytes() // 2 or (8 << 30))  # NOTE [ Host pool ] Rule 6
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
        self._blocks = Blocks(self.capacity_bytes)

    def __reduce__(self) -> tuple[Any, ...]:
        """A pool pickles as its configuration: unpickling gives a fresh, empty pool."""
        return (HostPool, (self.capacity_bytes, self.chunk_bytes, self.pin))

    def alloc(self, nbytes: int) -> HostBlock:
        """A block of ``nbytes`` bytes (pinned if the pool pins and is under its cap)."""
        if nbytes <= 0:
            raise ValueError(f"torchckpt: HostPool.alloc needs a positive size, got {nbytes}.")
        need = _round_up(nbytes, ALIGN)
        b = self._blocks
        with b.lock:
            hit = b.place(need, self._grow)
            if hit is not None:
                ci, off = hit
                chunk = b.chunks[ci]
                return HostBlock(chunk.buf[off : off + nbytes], ci, off, need, chunk.pinned)
            return b.pageable(nbytes)

    def free(self, block: HostBlock, event: Any = None) -> None:
        """Return ``block``; ``event`` (a CUDA event or None) marks the end of its last copy."""
        with self._blocks.lock:
            self._blocks.free(block, event)

    def stats(self) -> HostPoolStats:
        """Current occupancy (parked blocks count as in use)."""
        b = self._blocks
        with b.lock:
            return HostPoolStats(
                reserved_bytes=b.reserved,
                pinned_bytes=sum(c.size for c in b.chunks if c.pinned),
                in_use_bytes=b.in_use,
                pageable_in_use_bytes=b.pageable_in_use,
                chunks=len(b.chunks),
                chunk_allocations=b.chunk_allocations,
                pageable_fallbacks=b.fallbacks,
            )

    def close(self) -> None:
        """Wait for parked copies and drop every chunk (blocks handed out become invalid)."""
        with self._blocks.lock:
            self._blocks.clear()

    def _grow(self, need: int) -> bool:
        """Add a pinned chunk for ``need`` bytes if the cap allows (NOTE [ Host pool ] Rules 1 and 4); whether one was added."""
        size = self.chunk_bytes if need <= self.chunk_bytes else _next_pow2(need)
        b = self._blocks
        if b.reserved + size > self.capacity_bytes:
            return False
        try:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as e:  # cudaHostAlloc refused: stay correct, go pageable (NOTE [ Host pool ] Rule 4)
            b.warn(f"pinning a {format_bytes(size)} chunk failed ({e})")
            return False
        b.chunks.append(Chunk(buf, self.pin))
        b.reserved += size
        b.chunk_allocations += 1
        return True
