"""Host memory for offloaded tensors: pinned chunks reused across steps.

# NOTE [ Host pool ]
# 1. Memory comes in chunks of ``chunk_bytes`` (a power of two, 256 MiB by default) that
#    are pinned once and kept for the life of the pool: steady-state training does no
#    ``cudaHostAlloc`` per step. A request larger than a chunk gets a chunk of its own,
#    rounded up to a power of two (PyTorch's pinned allocator rounds that way too).
# 2. A block never straddles two chunks. Inside a chunk, first-fit by offset (the lowest free
#    span that fits), coalesced on free; offsets are aligned to ``ALIGN`` bytes. The free spans
#    are a treap ordered by offset whose nodes also hold the largest span beneath them, so
#    finding that span and updating the spans after a take or a free cost O(log spans), not a
#    scan of the spans: a long-lived pool whose churn leaves many small holes stays as cheap
#    per allocation as a fresh one. Blocks go exactly where a scan of an offset-sorted list
#    would put them (tests/memory/test_host_pool_churn.py checks both against such a list).
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
import random
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


class _Span:
    """A free span, a node of its chunk's treap (see ``Chunk``)."""

    __slots__ = ("off", "size", "mx", "pri", "l", "r")

    def __init__(self, off: int, size: int, pri: float) -> None:
        self.off = off
        self.size = size
        self.mx = size  # the largest span in this subtree
        self.pri = pri
        self.l: _Span | None = None
        self.r: _Span | None = None


def _pull(t: _Span) -> None:
    m = t.size
    if t.l is not None and t.l.mx > m:
        m = t.l.mx
    if t.r is not None and t.r.mx > m:
        m = t.r.mx
    t.mx = m


def _merge(a: _Span | None, b: _Span | None) -> _Span | None:
    """One treap of ``a`` and ``b``, every span of ``a`` below every span of ``b``."""
    if a is None:
        return b
    if b is None:
        return a
    if a.pri > b.pri:
        a.r = _merge(a.r, b)
        _pull(a)
        return a
    b.l = _merge(a, b.l)
    _pull(b)
    return b


def _split(t: _Span | None, off: int) -> tuple[_Span | None, _Span | None]:
    """``t``'s spans below ``off`` and those from ``off`` on, as two treaps."""
    if t is None:
        return None, None
    if t.off < off:
        t.r, rest = _split(t.r, off)
        _pull(t)
        return t, rest
    rest, t.l = _split(t.l, off)
    _pull(t)
    return rest, t


def _fix(path: list[_Span]) -> None:
    """Recompute ``mx`` from the end of ``path`` up, stopping where it no longer changes."""
    for t in reversed(path):
        old = t.mx
        _pull(t)
        if t.mx == old:
            break


class Chunk:
    """One chunk's free spans (NOTE [ Host pool ] Rule 2).

    The spans are a treap ordered by offset in which each node also holds the largest span under it (``mx``): the
    lowest-offset span of at least ``n`` bytes is one walk down from the root, and a span's change is one walk
    back up. Two maps, by start and by end, find a freed block's free neighbours at once.
    """

    __slots__ = ("buf", "size", "pinned", "_root", "_start", "_end", "_rng")

    def __init__(self, buf: torch.Tensor, pinned: bool):
        self.buf = buf
        self.size = buf.numel()
        self.pinned = pinned
        self._root: _Span | None = None
        self._start: dict[int, _Span] = {}  # offset -> the free span starting there
        self._end: dict[int, _Span] = {}  # end -> the free span ending there
        self._rng = random.Random(0)  # treap priorities: the tree's shape only, never where a block goes
        if self.size:
            self._insert(_Span(0, self.size, self._rng.random()))

    @property
    def free(self) -> list[tuple[int, int]]:
        """The free spans as ``(offset, size)``, sorted by offset (a copy: for stats and tests)."""
        return sorted((off, t.size) for off, t in self._start.items())

    def take(self, n: int) -> int | None:
        """The offset of the lowest free span of at least ``n`` bytes, its first ``n`` bytes taken; ``None`` when
        no span fits (NOTE [ Host pool ] Rule 2: O(depth), about log2 of the number of free spans)."""
        root = self._root
        if root is None or root.mx < n:
            return None
        t: _Span = root
        path: list[_Span] = []
        while True:
            path.append(t)
            if t.l is not None and t.l.mx >= n:
                t = t.l
            elif t.size >= n:
                break
            elif t.r is not None:  # mx >= n: the right subtree holds it
                t = t.r
            else:
                raise internal_error("host pool free-span tree lost its largest span")
        off = t.off
        del self._start[off]
        if t.size > n:
            t.off = off + n  # still between its neighbours: the order holds
            t.size -= n
            self._start[off + n] = t
            _fix(path)
        else:
            del self._end[off + n]
            self._replace(path, _merge(t.l, t.r))
        return off

    def give(self, off: int, n: int) -> None:
        """Return ``n`` bytes at ``off``, coalesced with free neighbours on both sides (NOTE [ Host pool ] Rule 2)."""
        start, end = self._start, self._end
        if off in start or off + n in end:
            raise internal_error(f"host pool span at {off} (+{n}) freed while free")
        right = start.pop(off + n, None)
        left = end.pop(off, None)
        if right is not None:
            path = self._path(right.off)
            if left is not None:  # both: the left span absorbs the block and the right span
                self._replace(path, _merge(right.l, right.r))
                end[right.off + right.size] = left
                left.size += n + right.size
                _fix(self._path(left.off))
            else:
                start[off] = right
                right.off = off
                right.size += n
                _fix(path)
        elif left is not None:
            left.size += n
            end[off + n] = left
            _fix(self._path(left.off))
        else:
            self._insert(_Span(off, n, self._rng.random()))

    def _path(self, off: int) -> list[_Span]:
        """The nodes from the root down to the span at ``off``."""
        path = []
        t = self._root
        while t is not None:
            path.append(t)
            if t.off == off:
                return path
            t = t.l if off < t.off else t.r
        raise internal_error(f"host pool free span at {off} missing from its tree")

    def _replace(self, path: list[_Span], sub: _Span | None) -> None:
        """Put ``sub`` where ``path[-1]`` was."""
        if len(path) == 1:
            self._root = sub
            return
        parent = path[-2]
        if parent.l is path[-1]:
            parent.l = sub
        else:
            parent.r = sub
        _fix(path[:-1])

    def _insert(self, node: _Span) -> None:
        self._start[node.off] = node
        self._end[node.off + node.size] = node
        path = []
        t = self._root
        while t is not None and t.pri > node.pri:
            path.append(t)
            t = t.l if node.off < t.off else t.r
        node.l, node.r = _split(t, node.off)
        _pull(node)
        if not path:
            self._root = node
            return
        if node.off < path[-1].off:
            path[-1].l = node
        else:
            path[-1].r = node
        _fix(path)


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

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until no background work of this pool can hold up the process's CUDA calls; ``True`` when none is
        left (NOTE [ Lazy host pool ] Rule 11). A pool pinned when it allocates has none."""
        return True

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
