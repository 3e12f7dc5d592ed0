"""A lazily pinned host pool: one mmap, touched and registered chunk by chunk in the background.

Pinning a large host buffer up front costs seconds (``cudaHostAlloc`` of 16 GiB: 6.1 s on an
H100 machine). Maurya et al., "Towards Efficient Cache Allocation for High-Frequency
Checkpointing" (HiPC'22) map the buffer with transparent huge pages instead, let flushes
write into unpinned pages at once, touch the rest in a background thread and register the
region once it is touched. ``LazyHostPool`` registers *chunk by chunk* as each becomes touched,
so the first bytes are pinned within milliseconds and most of the pool reaches pinned bandwidth
long before all of it is ready. The native part is csrc/host_pool.cpp.

Known gaps (measured on an H100, benchmarks/host_init.py, docs/results/host_init_h100.json):
with 1 GiB chunks the application's own checkpoint blocking (0.9-1.2 s for a 32 GiB pool)
is about the worker's total ``cudaHostRegister`` time (1.2 s), although almost every flush
went to pinned memory: registration holds up the process's CUDA calls (NOTE [ Lazy host pool ] Rule 9), and with
checkpoints 20 ms apart the paper's whole-region variant blocks less (0.73 s). Smaller chunks
made it worse (128-256 MiB: 2.6-2.8 s), so the default chunk is 1 GiB. On a virtual machine
that hands freed memory back to its host, a pool's first touch costs several times more
(NOTE [ Lazy host pool ] Rule 8).

# NOTE [ Lazy host pool ]
# 1. Same interface and allocation rules as ``HostPool`` (NOTE [ Host pool ] Rule 5: both
#    compose its ``Blocks`` allocator):
#    first-fit over offset-sorted free lists, coalesced on free, ``ALIGN``-aligned, parked
#    blocks with their events, pageable fallback with one warning past the pool's end.
# 2. The pool is one anonymous mmap (``MADV_HUGEPAGE``) cut into chunks: the first of
#    ``first_chunk_bytes``, then doubling up to ``chunk_bytes`` (NOTE [ Native host pool ] Rule 1, csrc/host_pool.cpp).
#    A block never straddles two chunks, so a copy never spans two registrations, nor a
#    registered and an unregistered range. A request larger than the largest chunk is a
#    pageable fallback block (with the one warning).
# 3. A block may be handed out from a chunk that is not registered yet: copies into it then
#    take CUDA's pageable path (staged through the driver's own pinned buffers), which is
#    correct, only slower. ``HostBlock.pinned`` says whether its chunk is registered *now*.
#    The chunk may get registered while such a copy runs; the GPU tests check that data
#    written before, during and after registration reads back bit-exact.
# 4. Registration failures (``RLIMIT_MEMLOCK``, driver limits) never raise: the chunk stays
#    pageable (state FAILED) and the pool warns once.
# 5. ``ahead_bytes`` bounds how far the background thread runs ahead of the highest chunk in
#    use (``None``: the whole pool is touched and registered at once). The memory a pool will
#    touch must fit in the host's available memory: a larger request is refused with a clear
#    error rather than left to the kernel's OOM killer.
# 6. ``close()`` waits for parked copies and for tracked copies (``track_copy``), stops the
#    worker, and drops the pool's own references. The memory is unregistered and unmapped when
#    the last tensor viewing it goes (the native tensor's deleter holds the pool), so a block
#    still held by the caller never points at unmapped memory.
# 7. The stores report every copy to or from the pool (``note_copy``); while the worker runs the
#    sequential strategy, each one is tracked (``track_copy``) so that touching pauses for it.
# 8. First touch can cost far more than the touch itself (on a virtual machine, memory freed
#    a few seconds ago may have gone back to the host and is faulted in again). The stats
#    report ``huge_page_bytes`` (from /proc/self/smaps) so that huge-page fallback and
#    first-touch cost can be told apart.
# 9. Registering holds up the process's other CUDA calls, and costs per byte: an application
#    blocks for about the worker's total registration time, which chunking spreads out but
#    does not remove.
# 10. The default size (``capacity_bytes=None``) is this process's share of the node (NOTE [ Host pool ] Rule 6):
#    half of physical RAM, at most 80% of the memory available now, divided by the processes of the job on this
#    node (``LOCAL_WORLD_SIZE``). Rule 5's check that the memory touched up front fits applies to that share.
# 11. ``settle()`` waits until every chunk the worker is set to reach now (those Rule 5's limit reaches) is registered
#    or failed, and until ``strategy="auto"``'s measurement of the link (``measure_link_profile``, in a thread of its
#    own at the first pool of a device: it registers, copies and unregisters memory of its own) has ended, so that
#    no registration holds up the CUDA calls after it (Rule 9). A measurement of steps that use the
#    pool calls it after a warm-up step, whose blocks moved the limit: on an H100 the planner measured a Qwen2's every
#    block ``Recompute(store=...)`` (512 MiB of inputs on host a step) at 168.6 ms in the first steps that used the
#    process's shared pool, and 157.3 ms in turns a few seconds later (NOTE [ Applying a plan ] Rule 4).
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import threading
import time
import warnings
import weakref
from typing import Any

import torch

from torchckpt._errors import CheckpointError, format_bytes_apart
from torchckpt._native import host_pool_can_register, native_host_pool, native_host_pool_class
from torchckpt.memory.host_pool import ALIGN, Blocks, Chunk, HostBlock, HostPoolBase, HostPoolStats
from torchckpt.memory.link_model import LinkProfile, cached_profile, choose_strategy, measure_link_profile
from torchckpt.memory.sysinfo import (available_memory_bytes, device_index, huge_page_bytes, node_share, page_bytes,
                                      physical_memory_bytes)
from torchckpt.memory.node_lock import default_lock_path

UNTOUCHED, TOUCHED, REGISTERED, FAILED = 0, 1, 2, 3
STRATEGIES = ("auto", "concurrent", "sequential", "whole")
_MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class LazyPoolStats:
    """Progress of a ``LazyHostPool``'s background worker (times in seconds since creation)."""

    capacity_bytes: int
    chunks: int
    touched_chunks: int
    registered_chunks: int
    failed_chunks: int
    touched_bytes: int
    registered_bytes: int
    strategy: str
    touch_s: float
    register_s: float
    lock_wait_s: float
    paused_s: float
    first_registered_s: float | None
    all_registered_s: float | None
    huge_pages: bool
    errors: tuple[str, ...]
    huge_page_bytes: int | None = None  # bytes the kernel backs with huge pages now (None: unknown)


class _LazyChunk(Chunk):
    __slots__ = ("_pool", "_index")

    def __init__(self, buf: torch.Tensor, pool: LazyHostPool, index: int) -> None:
        self._pool = pool
        self._index = index
        super().__init__(buf, False)

    @property  # type: ignore[override]
    def pinned(self) -> bool:
        return self._pool._registered(self._index)

    @pinned.setter
    def pinned(self, value: bool) -> None:
        pass  # derived from the native chunk state


class LazyHostBlock(HostBlock):
    """A ``HostBlock`` whose ``pinned`` says whether its chunk is registered now (see
    NOTE [ Lazy host pool ] Rule 3)."""

    __slots__ = ("_pool",)

    def __init__(self, tensor: torch.Tensor, chunk: int, offset: int, nbytes: int, pool: LazyHostPool) -> None:
        self._pool = pool
        super().__init__(tensor, chunk, offset, nbytes, False)

    @property  # type: ignore[override]
    def pinned(self) -> bool:
        return self.chunk >= 0 and self._pool._registered(self.chunk)

    @pinned.setter
    def pinned(self, value: bool) -> None:
        pass


_live: weakref.WeakSet[LazyHostPool] = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:  # stop workers before the CUDA runtime is torn down
    for p in list(_live):
        try:
            p.close()
        except Exception:
            pass


def _lazy_pool_from_config(kw: dict[str, Any]) -> LazyHostPool:
    """Unpickle a ``LazyHostPool`` (``LazyHostPool.__reduce__``)."""
    return LazyHostPool(**kw)


class LazyHostPool(HostPoolBase):
    """Host memory in one mmap, pinned chunk by chunk by a background thread (NOTE [ Lazy host pool ]).

    Args:
        capacity_bytes: size of the pool (rounded up to the page size). ``None``: half of
            physical RAM, at most 80% of the available memory, divided by the processes of the job
            on this node (``LOCAL_WORLD_SIZE``; NOTE [ Lazy host pool ] Rule 10).
        chunk_bytes: largest chunk (a multiple of the page size). Each registration stalls the
            process's other CUDA calls a while, so fewer, larger chunks block least (1 GiB
            measured best on an H100, docs/benchmarks.md).
        pin: register chunks with CUDA (``None``: when CUDA is available).
        first_chunk_bytes: size of the first chunk; later chunks double up to ``chunk_bytes``.
        strategy: ``"auto"``, ``"concurrent"``, ``"sequential"`` or ``"whole"`` (NOTE [ Lazy pool strategy model ]).
        ahead_bytes: how far the worker may run ahead of the highest chunk in use (``None``: the whole pool).
        node_lock: serialize registrations across the processes of this node (NOTE [ Node registration lock ]).
        device: the CUDA device whose context registers (``None``: the current one).
        touch_threads: threads that touch pages (``None``: up to 8, at most half the CPUs).
        write_rate: expected checkpoint bytes per second, for ``strategy="auto"``.
        register_mode: ``None`` (``"cuda"`` when pinning, else ``"none"``); ``"fake"`` and
            ``"fake_fail"`` stand in for ``cudaHostRegister`` in tests.
        lock_path: the node lock's file (``None``: ``default_lock_path()``).

    Example::

        >>> pool = LazyHostPool(capacity_bytes=8 << 20, chunk_bytes=4 << 20, first_chunk_bytes=1 << 20, pin=False)
        >>> block = pool.alloc(1000)
        >>> block.tensor.numel(), block.chunk
        (1000, 0)
        >>> pool.free(block)
        >>> pool.close()
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        chunk_bytes: int = 1 << 30,
        pin: bool | None = None,
        *,
        first_chunk_bytes: int = 64 * _MiB,
        strategy: str = "auto",
        ahead_bytes: int | None = None,
        node_lock: bool = True,
        device: int | torch.device | None = None,
        touch_threads: int | None = None,
        write_rate: float | None = None,
        register_mode: str | None = None,
        lock_path: str | None = None,
    ) -> None:
        self._init_kw = dict(  # __reduce__: a pool pickles as its configuration
            capacity_bytes=capacity_bytes, chunk_bytes=chunk_bytes, pin=pin, first_chunk_bytes=first_chunk_bytes,
            strategy=strategy, ahead_bytes=ahead_bytes, node_lock=node_lock, device=device,
            touch_threads=touch_threads, write_rate=write_rate, register_mode=register_mode, lock_path=lock_path)
        native_host_pool_class()  # raises, saying how to build it, when the extension lacks the pool
        page = page_bytes()
        for name, v in (("chunk_bytes", chunk_bytes), ("first_chunk_bytes", first_chunk_bytes)):
            if v <= 0 or v % page:
                raise ValueError(
                    f"torchckpt: LazyHostPool {name} must be a positive multiple of the {page}-byte page size, got "
                    f"{v}; pass e.g. {name}={max(1, round(v / _MiB)) if v > 0 else 64} << 20."
                )
        if strategy not in STRATEGIES:
            raise ValueError(f"torchckpt: LazyHostPool strategy must be one of {STRATEGIES}, got {strategy!r}.")
        if ahead_bytes is not None and ahead_bytes < 0:
            raise ValueError(f"torchckpt: ahead_bytes must be >= 0 or None, got {ahead_bytes}.")
        if strategy == "whole" and ahead_bytes is not None:
            raise ValueError("torchckpt: strategy='whole' registers the whole pool at once; pass ahead_bytes=None.")
        avail = available_memory_bytes()
        if capacity_bytes is None:
            # NOTE [ Lazy host pool ] Rule 10: the single-process default, shared among the node's processes
            capacity_bytes = node_share(min(physical_memory_bytes() // 2 or (8 << 30), int(avail * 0.8)))
        capacity_bytes = -(-int(capacity_bytes) // page) * page
        if capacity_bytes <= 0:
            raise ValueError(f"torchckpt: LazyHostPool capacity_bytes must be positive, got {capacity_bytes}.")
        eager = capacity_bytes if ahead_bytes is None else min(capacity_bytes, first_chunk_bytes + ahead_bytes)
        phys = physical_memory_bytes()
        if (phys and capacity_bytes > phys) or eager > avail:
            cap, touch, free, total = format_bytes_apart(capacity_bytes, eager, avail, phys)
            raise CheckpointError(
                f"torchckpt: a LazyHostPool of {cap} (touching {touch} up "
                f"front) does not fit this host: {free} available of {total} physical "
                "memory; pass a smaller capacity_bytes, or ahead_bytes=... to touch only what is used."
            )
        if pin is None:
            pin = torch.cuda.is_available()
        if register_mode is None:
            register_mode = "cuda" if pin else "none"
        if register_mode == "cuda":
            if not torch.cuda.is_available():
                raise CheckpointError(
                    "torchckpt: LazyHostPool(pin=True) needs CUDA to pin memory, but torch.cuda.is_available() is "
                    "False; pass pin=False."
                )
            if not host_pool_can_register():
                raise CheckpointError(
                    "torchckpt: this build of torchckpt._C has no CUDA runtime, so LazyHostPool cannot pin; rebuild "
                    "with a CUDA toolkit (`pip install --no-build-isolation -e .`) or pass pin=False."
                )
            torch.cuda.init()
            dev_index = device_index(device)
        else:
            dev_index = 0 if device is None else device_index(device)
        if touch_threads is None:
            touch_threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        self.capacity_bytes = capacity_bytes
        self.chunk_bytes = int(chunk_bytes)
        self.first_chunk_bytes = int(first_chunk_bytes)
        self.pin = register_mode in ("cuda", "fake")
        self.ahead_bytes = ahead_bytes
        self.device_index = dev_index
        self.write_rate = write_rate
        self.requested_strategy = strategy
        self._blocks = Blocks(capacity_bytes)  # NOTE [ Host pool ] Rules 1-4, over this pool's fixed chunks
        self._lock = self._blocks.lock
        self._warned_errors = False
        self._closed = False
        self._tracking_over = False  # note_copy: the worker is done, no copy needs tracking
        start = "concurrent" if strategy == "auto" else strategy
        self._sequential = start == "sequential"  # the strategy the worker runs, as Python set it
        limit = -1 if ahead_bytes is None else first_chunk_bytes + ahead_bytes
        # how far the worker is set to go (NOTE [ Lazy host pool ] Rule 5)
        self._touch_limit = capacity_bytes if limit < 0 else limit
        self._native = native_host_pool(
            nbytes=capacity_bytes, chunk_bytes=self.chunk_bytes, first_chunk_bytes=self.first_chunk_bytes,
            strategy=start, register_mode=register_mode, node_lock=bool(node_lock),
            lock_path=lock_path if lock_path is not None else default_lock_path(), device=dev_index, huge_pages=True,
            touch_threads=int(touch_threads), populate=True, touch_limit=limit, fake_register_us=2000,
        )
        # The native pool records a lock it could not open as its first error, before any other.
        self._lock_failed = bool(node_lock) and not self._native.lock_active()
        self._base: torch.Tensor | None = self._native.tensor()
        offsets = list(self._native.chunk_offsets())
        sizes = list(self._native.chunk_sizes())
        self._reg = [False] * len(offsets)  # registered chunks, cached (states only move forward)
        self._ends = [o + s for o, s in zip(offsets, sizes)]
        self._max_chunk = max(sizes)
        base = self._base
        self._blocks.chunks = [_LazyChunk(base[o : o + s], self, i) for i, (o, s) in enumerate(zip(offsets, sizes))]
        self._blocks.reserved = capacity_bytes
        self._high_chunk = -1
        self.profile: LinkProfile | None = None
        self._model_thread: threading.Thread | None = None  # measuring the link for strategy="auto"
        _live.add(self)
        if strategy == "auto" and register_mode == "cuda":
            cached = cached_profile(dev_index)
            if cached is not None:
                self._apply_profile(cached)
            else:
                self._model_thread = threading.Thread(target=self._auto, name="torchckpt-lazy-pool-model", daemon=True)
                self._model_thread.start()

    # -- the strategy model ----------------------------------------------------------------
    def __reduce__(self) -> tuple[Any, ...]:
        """A pool pickles as its configuration: unpickling gives a fresh, empty pool."""
        return (_lazy_pool_from_config, (self._init_kw,))

    def _auto(self) -> None:
        # Measure only once the first chunk is registered (or 2 s passed): the measurement
        # registers, touches and copies too, and would compete with the first pinned copy.
        # Polled, so that a close() meanwhile ends the wait at once.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            native = self._native
            if native is None or self._closed:
                return
            if native.state(0) >= REGISTERED or native.done():
                break
            time.sleep(0.002)
        try:
            prof = measure_link_profile(self.device_index)
        except Exception as e:  # the pool works with either strategy: keep "concurrent"
            warnings.warn(f"torchckpt: could not measure the host link for strategy='auto' ({e}); using "
                          "'concurrent'.", RuntimeWarning, stacklevel=2)
            return
        self._apply_profile(prof)

    def _apply_profile(self, prof: LinkProfile) -> None:
        self.profile = prof
        native = self._native
        if native is not None and not self._closed:
            chosen = choose_strategy(prof, self.write_rate)
            try:
                native.set_strategy(chosen)
            except RuntimeError:
                return  # closed meanwhile
            self._sequential = chosen == "sequential"

    # -- HostPoolBase interface ----------------------------------------------------------------
    def alloc(self, nbytes: int) -> HostBlock:
        """A block of ``nbytes`` bytes inside one chunk (pinned once that chunk is registered)."""
        if nbytes <= 0:
            raise ValueError(f"torchckpt: LazyHostPool.alloc needs a positive size, got {nbytes}.")
        need = -(-nbytes // ALIGN) * ALIGN
        self._check_errors()
        with self._lock:
            if self._closed:
                raise CheckpointError("torchckpt: LazyHostPool.alloc after close(); create a new pool.")
            b = self._blocks
            if need > self._max_chunk:  # NOTE [ Lazy host pool ] Rule 2: no chunk can hold it
                return b.pageable(nbytes, f"a request of {nbytes} bytes exceeds the pool's largest chunk "
                                          f"({self._max_chunk} bytes; pass a larger chunk_bytes)")
            hit = b.place(need)  # never grows: the pool is one mapping
            if hit is None:
                return b.pageable(nbytes)
            ci, off = hit
            if ci > self._high_chunk:
                self._high_chunk = ci
                if self.ahead_bytes is not None and self._native is not None:
                    self._touch_limit = self._ends[ci] + self.ahead_bytes
                    self._native.set_touch_limit(self._touch_limit)  # NOTE [ Lazy host pool ] Rule 5
            return LazyHostBlock(b.chunks[ci].buf[off : off + nbytes], ci, off, need, self)

    def free(self, block: HostBlock, event: Any = None) -> None:
        """Return ``block``; ``event`` (a CUDA event or None) marks the end of its last copy."""
        with self._lock:
            self._blocks.free(block, event)

    def stats(self) -> HostPoolStats:
        """Current occupancy; ``reserved_bytes`` counts touched memory, ``pinned_bytes`` registered memory."""
        native = self._native
        with self._lock:
            d = native.stats() if native is not None else {}
            return HostPoolStats(
                reserved_bytes=int(d.get("touched_bytes", 0)),
                pinned_bytes=int(d.get("registered_bytes", 0)),
                in_use_bytes=self._blocks.in_use,
                pageable_in_use_bytes=self._blocks.pageable_in_use,
                chunks=len(self._blocks.chunks),
                chunk_allocations=sum(1 for s in (native.states() if native is not None else []) if s >= TOUCHED),
                pageable_fallbacks=self._blocks.fallbacks,
            )

    def close(self) -> None:
        """Wait for parked and tracked copies, stop the worker, drop the pool (NOTE [ Lazy host pool ] Rule 6)."""
        with self._lock:
            if self._closed:
                return
            self._blocks.reclaim(block=True)
            native = self._native
            if native is not None and not native.wait_copies(60_000):
                warnings.warn("torchckpt: LazyHostPool.close() waited 60 s for tracked copies; closing anyway.",
                              RuntimeWarning, stacklevel=2)
            self._closed = True
            self._blocks.clear()
            self._base = None
            if native is not None:
                native.close()
            self._native = None
        _live.discard(self)

    # -- lazy-pool specifics ---------------------------------------------------------------
    def chunk_states(self) -> list[int]:
        """Each chunk's state: ``UNTOUCHED``, ``TOUCHED``, ``REGISTERED`` or ``FAILED``."""
        return list(self._native.states()) if self._native is not None else []

    def chunk_bounds(self) -> list[tuple[int, int]]:
        """Each chunk's ``(offset, size)`` in bytes."""
        return [(e - c.size, c.size) for e, c in zip(self._ends, self._blocks.chunks)]

    def wait_pinned(self, block: HostBlock, timeout: float | None = None) -> bool:
        """Wait until ``block``'s chunk is registered (or can no longer be); returns ``block.pinned``."""
        if block.chunk < 0 or self._native is None:
            return False
        if not self._registered(block.chunk):
            self._native.wait_registered(block.chunk, -1 if timeout is None else int(timeout * 1e3))
        return self._registered(block.chunk)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until every chunk the worker is set to reach now is registered or failed and the link's measurement
        for ``strategy="auto"`` has ended (NOTE [ Lazy host pool ] Rule 11); ``False`` when ``timeout`` seconds passed
        first (``None``: no limit). Without pinning, ``True`` at once: touching pages holds up no CUDA call."""
        native = self._native
        if native is None or not self.pin:
            return True
        end = None if timeout is None else time.monotonic() + timeout
        model = self._model_thread  # its measurement registers, copies and unregisters pools of its own
        if model is not None:
            model.join(None if end is None else max(0.0, end - time.monotonic()))
            if model.is_alive():
                return False
        limit = self._touch_limit
        for i, (start, _) in enumerate(self.chunk_bounds()):
            if start >= limit:
                break
            if self._registered(i):
                continue
            left = -1 if end is None else max(0, int((end - time.monotonic()) * 1e3))
            if native.wait_registered(i, left) < REGISTERED:
                return False
        return True

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the worker has finished (every chunk registered, failed or left touched)."""
        if self._native is None:
            return True
        return bool(self._native.wait_done(-1 if timeout is None else int(timeout * 1e3)))

    def track_copy(self, stream: Any = None) -> None:
        """Count a copy just issued on ``stream`` as in flight until the stream gets past it.

        The sequential strategy touches only while no tracked copy runs, and ``close()`` waits
        for them (NOTE [ Lazy host pool ] Rule 6). ``stream``: a ``torch.cuda.Stream`` (``None``: the current stream).
        """
        if self._native is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.device_index)
        self._native.track_copy(int(stream.cuda_stream))

    def note_copy(self, stream: Any) -> None:
        """Track a copy just issued on ``stream`` while the sequential strategy needs it
        (NOTE [ Lazy host pool ] Rule 7).

        The stores call this after every copy to or from the pool. Tracking costs a host
        function on the stream, so it happens only while the worker runs "sequential"; under
        any other strategy, or once the worker is done, this is an attribute test.
        """
        native = self._native
        if not self._sequential or native is None or self._tracking_over:
            return  # no native call: this runs for every copy a store makes
        if native.done():
            self._tracking_over = True
        else:
            native.track_copy(int(stream.cuda_stream))

    def begin_copy(self) -> None:
        """Mark a copy as started (pair with ``end_copy``; see ``track_copy``)."""
        if self._native is not None:
            self._native.begin_copy()

    def end_copy(self) -> None:
        """Mark a copy begun with ``begin_copy`` as finished."""
        if self._native is not None:
            self._native.end_copy()

    @property
    def strategy(self) -> str:
        """The strategy the worker runs now (``"auto"`` resolves to one of the others)."""
        return str(self._native.strategy()) if self._native is not None else self.requested_strategy

    def lazy_stats(self, huge_pages: bool = True) -> LazyPoolStats:
        """Progress of the background worker.

        Args:
            huge_pages: also read ``huge_page_bytes`` from /proc/self/smaps (tens of
                milliseconds in a large process; ``False`` leaves it ``None``).
        """
        native = self._native
        if native is None:
            raise CheckpointError("torchckpt: LazyHostPool.lazy_stats() after close().")
        d = native.stats()
        states = list(native.states())
        times = list(native.chunk_times())
        reg_t = [t for t in times[len(states) :] if t >= 0]
        done = all(s >= REGISTERED for s in states)
        return LazyPoolStats(
            capacity_bytes=self.capacity_bytes,
            chunks=len(states),
            touched_chunks=sum(1 for s in states if s >= TOUCHED),
            registered_chunks=sum(1 for s in states if s == REGISTERED),
            failed_chunks=sum(1 for s in states if s == FAILED),
            touched_bytes=int(d["touched_bytes"]),
            registered_bytes=int(d["registered_bytes"]),
            strategy=str(native.strategy()),
            touch_s=float(d["touch_s"]),
            register_s=float(d["register_s"]),
            lock_wait_s=float(d["lock_wait_s"]),
            paused_s=float(d["paused_s"]),
            first_registered_s=min(reg_t) / 1e3 if reg_t and any(s == REGISTERED for s in states) else None,
            all_registered_s=max(reg_t) / 1e3 if done and reg_t else None,
            huge_pages=bool(native.huge_pages()),
            errors=tuple(native.errors()),
            huge_page_bytes=(huge_page_bytes(self._base.data_ptr(), self.capacity_bytes)
                             if huge_pages and self._base is not None else None),
        )

    # -- internals -------------------------------------------------------------------------
    def _registered(self, i: int) -> bool:
        if self._reg[i]:
            return True
        native = self._native
        if native is not None and native.state(i) == REGISTERED:
            self._reg[i] = True
            return True
        return False

    def _check_errors(self) -> None:
        if self._warned_errors or self._native is None:
            return
        errs = list(self._native.errors())
        if errs:
            self._warned_errors = True
            if self._lock_failed:  # errs[0] is the lock's: the pool pins as usual, only unserialized
                advice = ("Set TORCHCKPT_REGISTER_LOCK to a file every process of this node can write, or "
                          "TORCHCKPT_NODE_LOCK=0 (node_lock=False) to register without the lock.")
            else:
                advice = ("Copies into those chunks use pageable memory (slower, same results). Raise the "
                          "locked-memory limit (`ulimit -l`, RLIMIT_MEMLOCK) or use a smaller pool.")
            warnings.warn(f"torchckpt: LazyHostPool: {errs[0]}. {advice}", RuntimeWarning, stacklevel=3)
