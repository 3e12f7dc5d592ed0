"""The store: where the tensors autograd saves go, and how they come back.

# NOTE [ Store ]
# 1. ``pack`` (a saved-tensors pack hook) keeps by reference what moving would not free or
#    cannot move (NOTE [ Saved tensor identity ] Rule 4: leaves that require grad and views
#    of them, as a linear layer's ``weight.t()``; other devices, layouts and subclasses;
#    tensors under ``min_bytes``), the tensors named by the caller (a wrapped module's
#    parameters and buffers), and tensors saved while a backward pass runs (a Recompute
#    block re-running an Offload block inside it: that graph is used once, at once). The
#    rest become *entries*. Kept or moved, every saved tensor's version is checked at
#    unpack as plain autograd checks it (NOTE [ Saved tensor identity ] Rule 1).
# 2. An entry holds a byte span of a storage. If the saved tensor covers at least half of
#    its storage, the span is the whole storage and the entry is shared by later saves of the
#    same view family at the same version whose bytes cannot have changed unseen (NOTE
#    [ Saved tensor identity ] Rule 2): several views are moved once, and a view saved after
#    an in-place change gets an entry of its own. Otherwise the span is just the bytes the
#    view reaches. Unpack rebuilds the view with the same dtype, size, stride, offset within
#    the span and value bits (conj, neg): gradients are bit-identical to plain autograd.
# 3. Every copy goes through the mover (NOTE [ Mover ], store/streams.py); the GPU cache is
#    the ``Cache`` of NOTE [ Cache model ] in bytes. An entry's device-to-host copy starts at
#    pack, on the offload stream, after the compute stream (every entry in a step without a
#    plan; from then on only the ones the plan will evict, NOTE [ Prefetch from a recorded
#    trace ] Rule 5). The saved tensor
#    itself stays in the GPU cache (zero-copy) while the budget allows. Evicting an entry
#    makes the compute stream wait on its copy's event, then drops the reference: the
#    caching allocator hands the memory out again in compute-stream order, so no later
#    kernel touches it before the copy has read it, and the host never blocks. This bounds
#    GPU memory in the forward when the host link is slower than compute.
# 4. Unpack of a resident entry returns a view of the GPU copy (a cache hit, or a prefetch
#    hit when a prefetch brought it back: the compute stream waits on that copy's event).
#    Unpack of an evicted entry loads it on demand on the prefetch stream and the compute
#    stream waits on its event. Never a device-wide synchronize.
# 5. A host-to-device buffer is allocated on the compute stream, and the prefetch stream
#    waits for the compute stream before writing it, so the caching allocator's reuse is
#    always stream-ordered. Dropping a loaded buffer makes its allocation stream wait on
#    its copy first.
# 6. An entry dies when the last handle to it does (autograd frees saved variables after
#    use): its GPU copy leaves the cache and its host block returns to the pool, parked
#    behind the last copy that touched it.
# 7. Prefetch follows NOTE [ Prefetch from a recorded trace ] (schedules/trace.py).
# 8. ``device="cpu"`` simulates the two tiers with CPU tensors and synchronous copies: the
#    placement, eviction and prefetch logic is the same code, so CPU tests exercise it.
# 9. Compression (``Store(codec=...)``, or ``Offload(codec=...)`` for one block): an entry
#    whose span is whole elements of a dtype the codec supports is compressed on the offload
#    stream right before its device-to-host copy, and the copy moves the compressed bytes
#    (one ``Blob``); a load copies them back on the prefetch stream and decompresses there,
#    into a buffer allocated on the compute stream (Rule 5), before the event unpack waits
#    on. The GPU cache still holds entries at their full size (the saved tensor itself while
#    resident); the host pool holds the compressed size. With a lossy codec, gradients are
#    those of the block's saved tensors as the codec returns them (its guarantee, stated in
#    ``codec.guarantee``), not bit-exact. Entries of other dtypes are copied as they are.
#    Views of one storage with different dtypes get entries of their own when a codec is set.
# 10. A step ends when its last entry is released. Graphs that overlap (an evaluation loop
#    without ``torch.no_grad()`` keeps the previous output alive into the next forward) never
#    release everything; the trace then stops growing at ``_trace_limit()`` records, the plan
#    is dropped, and recording resumes once every entry has been released.
# 11. With ``disk=``, an entry the host pool has no room for under its cap goes to a file
#    instead, written behind, read back at its load (ahead of it on the plan), deleted when the
#    entry dies or at ``close()``: NOTE [ Spill to disk ] (store/saved_disk.py).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from torchckpt._errors import CheckpointError, internal_error
from torchckpt._args import check_flag, check_host, parse_bytes
from torchckpt.codecs.base import Codec
from torchckpt.store.streams import Mover, nvtx_range
from torchckpt.codecs.blob import Blob
from torchckpt.schedules.cache import Cache
from torchckpt.memory import DiskTier, HostBlock, HostPoolBase, make_host_pool
from torchckpt.schedules.trace import PACK, RELEASE, UNPACK, TracePrefetch, prefetch_from_trace
from torchckpt.store.saved_disk import DiskSpill
from torchckpt.store.identity import (Coverage, Kept, LiveShares, Version, keep_reason, rebuild, root_ref, storage_ptrs,
                                       value_bits)
from torchckpt.store.stats import Stats

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def _in_backward() -> bool:
    """Whether the calling thread is running a backward pass (False if torch cannot tell)."""
    return _graph_task_id is not None and _graph_task_id() != -1


_TRACE_MIN = 1 << 16  # NOTE [ Store ] Rule 10: records a step may hold at least before the trace stops
_STAT_FIELDS = [f for f in Stats.__dataclass_fields__ if f not in ("host", "gpu_peak_bytes", "disk", "min_bytes")]


class _Entry:
    __slots__ = (
        "id", "nbytes", "gpu", "base_off", "host", "d2h", "h2d", "h2d_stream",
        "prefetched", "refs", "key", "codec", "dtype", "blob", "version", "root", "cover", "disk",
    )

    def __init__(self, eid: int, nbytes: int, gpu: torch.Tensor, base_off: int, key: Any, version: Version,
                 root: Any) -> None:
        self.id = eid
        self.nbytes = nbytes
        self.gpu: torch.Tensor | None = gpu  # uint8 tensor whose storage holds the span
        self.base_off = base_off  # byte offset of the span inside gpu's storage
        self.host: HostBlock | None = None
        self.d2h: Any = None
        self.h2d: Any = None
        self.h2d_stream: Any = None
        self.prefetched = False
        self.refs = 0
        self.key = key
        self.codec: Codec | None = None  # NOTE [ Store ] Rule 9
        self.dtype: torch.dtype = torch.uint8
        self.blob: Blob | None = None  # where the compressed buffers sit in the host block
        self.version = version  # NOTE [ Saved tensor identity ] Rule 1
        self.root = root  # weak reference to the view family's root (NOTE [ Saved tensor identity ] Rule 2a), or None
        self.cover: Coverage | None = None  # what later saves may share it (NOTE [ Saved tensor identity ] Rule 2b)
        self.disk: Any = None  # its file's key on the disk tier, once spilled (NOTE [ Store ] Rule 11)


class _Handle:
    """What a saved-tensor slot holds instead of the tensor: an entry and a view into it."""

    __slots__ = ("store", "entry", "dtype", "size", "stride", "rel", "bits", "__weakref__")

    def __init__(self, store: Store, entry: _Entry, t: torch.Tensor, rel: int) -> None:
        self.store = store
        self.entry = entry
        self.dtype = t.dtype
        self.size = t.shape
        self.stride = t.stride()
        self.rel = rel  # byte offset of the view's first element inside the span
        self.bits = value_bits(t)  # NOTE [ Saved tensor identity ] Rule 3
        entry.refs += 1

    def __del__(self) -> None:
        try:
            self.store._drop(self.entry)
        except Exception:  # interpreter shutdown; nothing to give back then
            pass


class _Hooks(torch.autograd.graph.saved_tensors_hooks):
    """The store's saved-tensor hooks, with a ``torchckpt:`` error where PyTorch refuses them.

    ``saved`` counts the tensors packed under them when they route only some (``Store.hooks(only=...)``).
    """

    saved = 0

    def __enter__(self) -> None:
        try:
            super().__enter__()
        except RuntimeError as e:
            if "support saved tensor hooks" not in str(e):
                raise
            raise CheckpointError(
                "torchckpt: a Store cannot run under torch.func.grad, vjp, jacrev or hessian: PyTorch does not support "
                "saved-tensor hooks inside them (torch.utils.checkpoint cannot run there either). Run this code "
                "outside the transform (torch.autograd.grad), or without torchckpt.offload() there; a block wrapped "
                "with a policy runs as Keep() under these transforms, with a warning."
            ) from e


def _store_from_config(config: dict[str, Any]) -> Store:
    """Unpickle a ``Store`` (``Store.__reduce__``)."""
    return Store(**config)


class Store(DiskSpill):
    """A GPU cache backed by a host pool (and a disk tier), fed by autograd's saved-tensor hooks.

    Args:
        device: the device whose tensors are offloaded (``"cuda"``, ``"cuda:1"``, or ``"cpu"``
            to simulate both tiers with CPU tensors). ``None``: the current CUDA device if
            CUDA is available, else ``"cpu"``.
        gpu_bytes: GPU cache budget in bytes: how much offloaded data may stay resident on
            the device (just-saved tensors and prefetched ones). ``0`` sends every tensor
            straight to host and waits for each copy before going on.
        host: the host pool; ``None``: ``make_host_pool()``, the lazily pinned native pool on a
            GPU machine with the extension built (else ``HostPool``).
        min_bytes: tensors with fewer bytes are kept where they are.
        prefetch: plan prefetches from the first step's trace (``False``: load on demand).
        timing: time late prefetches and loads with CUDA events (for ``stats()``).
        codec: a ``torchckpt.codecs.Codec`` that compresses what crosses to host memory
            (NOTE [ Store ] Rule 9), and the snapshots of adjoint loops run with this store.
            A lossy codec changes gradients within its guarantee. ``None``: no compression.
        disk: a directory (the store makes a ``torchckpt.memory.DiskTier`` there and closes it in
            ``close()``) or a ``DiskTier``: tensors the host pool has no room for under its cap go
            to files there (NOTE [ Spill to disk ]), and adjoint loops run with this store may keep
            snapshots there (``AutoSchedule``). ``None``: host memory only.

    Example::

        >>> store = Store(device="cpu", gpu_bytes=1 << 20, min_bytes=0)
        >>> x = torch.randn(64, 64, requires_grad=True)
        >>> with store.hooks():
        ...     y = (x.exp() * 2).sum()
        >>> y.backward()
        >>> store.stats().offloaded
        1
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        gpu_bytes: int | str | None = None,
        host: HostPoolBase | None = None,
        min_bytes: int | str = 1 << 20,
        prefetch: bool = True,
        timing: bool = True,
        codec: Codec | None = None,
        disk: str | os.PathLike[str] | DiskTier | None = None,
    ) -> None:
        self._config = dict(device=device, gpu_bytes=gpu_bytes, host=host, min_bytes=min_bytes, prefetch=prefetch,
                            timing=timing, codec=codec,
                            disk=os.path.dirname(disk.root) if isinstance(disk, DiskTier) else disk)
        check_flag("Store", "prefetch", prefetch)
        check_flag("Store", "timing", timing)
        check_host("Store", host)
        if not isinstance(device, (str, torch.device, type(None))):
            raise TypeError(f"torchckpt: Store(device=...) expects 'cuda', 'cuda:N', 'cpu' or None, got {device!r}.")
        if isinstance(device, str):
            try:
                device = torch.device(device)
            except RuntimeError:
                raise ValueError(
                    f"torchckpt: Store(device={device!r}) is not a device; pass 'cuda', 'cuda:N' or 'cpu' "
                    "(or None for the current CUDA device)."
                ) from None
        if gpu_bytes is not None:
            gpu_bytes = parse_bytes(gpu_bytes, "Store(gpu_bytes=...)")
        min_bytes = parse_bytes(min_bytes, "Store(min_bytes=...)")
        if codec is not None and not isinstance(codec, Codec):
            raise TypeError(
                f"torchckpt: Store(codec=...) expects a torchckpt.codecs.Codec or None, got {type(codec).__name__}; "
                "pass e.g. codec=torchckpt.codecs.TritonQuant(bits=8, mode='rel', bound=1e-2)."
            )
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"torchckpt: Store(device={str(device)!r}) needs CUDA, but torch.cuda.is_available() is False; "
                    "pass device='cpu' to simulate the store on the CPU."
                )
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        elif device.type != "cpu":
            raise ValueError(f"torchckpt: Store supports 'cuda' and 'cpu' devices, got {str(device)!r}; pass 'cuda' or 'cpu'.")
        if gpu_bytes is None:
            gpu_bytes = (1 << 30) if device.type == "cuda" else (64 << 20)
        self.device = device
        self.cache: Cache[int] = Cache(gpu_bytes)
        self.host = host if host is not None else make_host_pool(pin=device.type == "cuda")
        self._mover = Mover(device, timing, self.host)
        self.min_bytes = int(min_bytes)
        self.prefetch = bool(prefetch)
        self.codec = codec
        self._lock = threading.RLock()
        self._live = 0
        self._next_id = 0
        self._entries: dict[int, _Entry] = {}
        self._by_storage: dict[tuple[Any, ...], tuple[_Entry, StorageWeakRef]] = {}
        self._trace: list[tuple[int, int, int]] = []
        self._tracing = True  # NOTE [ Store ] Rule 10
        self._last_trace_len = 0
        self._plan: TracePrefetch | None = None
        self._on_plan = False
        self._shares = LiveShares()  # NOTE [ Saved tensor identity ] Rule 2c
        self._timings: list[tuple[str, Any, Any]] = []
        self._c: dict[str, Any] = dict.fromkeys(_STAT_FIELDS, 0)
        self._c.update(late_wait_s=0.0, miss_wait_s=0.0, eviction_wait_s=0.0)
        self._disk_init(disk)  # NOTE [ Store ] Rule 11 (made last: nothing above can fail and leave its directory behind)

    # -- public --------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> Store:
        return self  # a store is a shared resource (streams, pools): copies of a model share it

    def __reduce__(self) -> tuple[Any, ...]:
        """A store pickles as its configuration: unpickling gives a fresh, empty store with the same settings.

        Its host pool pickles the same way when one was given (``HostPool.__reduce__``).
        Nothing saved in the store travels: pickle a model between steps, not during one.
        """
        return (_store_from_config, (self._config,))

    def __repr__(self) -> str:
        """The store's settings as ``Store(...)`` takes them, e.g.
        ``Store(device='cpu', gpu_bytes='64MiB', min_bytes='1MiB', codec=None, disk=None)``; ``prefetch``,
        ``timing`` and ``host`` appear when they are not the defaults (a given pool by its type and capacity)."""
        def arg(n: int) -> str:  # exact, and readable where a unit divides it
            for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
                if n and n % (1 << k) == 0:
                    return repr(f"{n >> k}{unit}")
            return str(n)

        c = self._config
        args = [f"device={str(self.device)!r}", f"gpu_bytes={arg(self.cache.capacity)}", f"min_bytes={arg(self.min_bytes)}"]
        args += [f"{k}={c[k]!r}" for k in ("prefetch", "timing") if c[k] is not True]
        if c["host"] is not None:
            cap = getattr(self.host, "capacity_bytes", None)
            args.append(f"host={type(self.host).__name__}(capacity_bytes={'None' if cap is None else arg(cap)}, ...)")
        args += [f"codec={self.codec!r}", f"disk={c['disk']!r}"]
        return f"Store({', '.join(args)})"

    def hooks(self, keep: Iterable[torch.Tensor] = (), codec: Codec | None = None,
              only: frozenset[int] | None = None) -> torch.autograd.graph.saved_tensors_hooks:
        """A context manager routing every tensor autograd saves through this store.

        Args:
            keep: tensors (e.g. a module's buffers) whose storages stay by reference.
            codec: compress with this codec instead of the store's (NOTE [ Store ] Rule 9).
            only: route only the tensors saved at these positions (0 for the first tensor saved
                under this context); the others are kept by reference (NOTE [ Store ] Rule 1), and the hooks'
                ``saved`` counts them all. ``None``: route all (nothing counted).
        """
        keep_ptrs = storage_ptrs(keep)
        c = codec if codec is not None else self.codec
        if only is None:
            return _Hooks(lambda t: self.pack(t, keep_ptrs, c), self.unpack)

        def pack(t: torch.Tensor) -> Any:
            k = hooks.saved
            hooks.saved = k + 1
            if k in only:
                return self.pack(t, keep_ptrs, c)
            self._c["packed"] += 1
            self._c["kept"] += 1
            self._c["kept_bytes"] += t.numel() * t.element_size()
            return Kept(t)

        hooks = _Hooks(pack, self.unpack)
        return hooks

    def stats(self) -> Stats:
        """Counters so far; waits for the timing events of finished work (not on the hot path)."""
        with self._lock:
            self._resolve_timings(block=True)
            c = dict(self._c)
            if self._live == 0 and (self._trace or not self._tracing):  # the step has ended; no pack has closed it yet
                c["steps"] += 1
            return Stats(**c, gpu_peak_bytes=self.cache.peak, host=self.host.stats(), disk=self._disk_stats(),
                         min_bytes=self.min_bytes)

    def reset_stats(self) -> None:
        """Zero the counters (the plan and the pools are kept)."""
        with self._lock:
            self._resolve_timings(block=True)
            self._c = dict.fromkeys(_STAT_FIELDS, 0)
            self._c.update(late_wait_s=0.0, miss_wait_s=0.0, eviction_wait_s=0.0)
            self.cache.peak = self.cache.used

    @property
    def plan(self) -> TracePrefetch | None:
        """The prefetch plan in force (``None`` before the first step has finished)."""
        return self._plan

    # -- hooks ---------------------------------------------------------------------------
    def pack(self, t: torch.Tensor, keep_ptrs: frozenset[int] = frozenset(), codec: Codec | None = None) -> Any:
        """Saved-tensor pack hook: a handle, or a version-checked reference when ``t`` is kept
        (NOTE [ Store ] Rule 1)."""
        c = self._c
        c["packed"] += 1
        reason = "backward" if _in_backward() else keep_reason(t, self.device, self.min_bytes)
        if reason is None and keep_ptrs and t.untyped_storage().data_ptr() in keep_ptrs:
            reason = "caller"
        if reason is not None:
            nbytes = t.numel() * t.element_size()
            c["kept"] += 1
            c["kept_bytes"] += nbytes
            if reason == "small":
                c["small"] += 1
                c["small_bytes"] += nbytes
            return Kept(t)
        storage = t.untyped_storage()
        sptr = storage.data_ptr()
        es = t.element_size()
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        lo = int(t.storage_offset()) * es
        span = int(extent) * es
        whole = 2 * span >= storage.nbytes()
        with self._lock, nvtx_range("torchckpt.pack"):
            self._poll_disk(raise_errors=True)  # NOTE [ Store ] Rule 11
            if self._live == 0 and (self._trace or not self._tracing):
                self._finish_step()
            if codec is not None and not codec.supports(t.dtype):
                codec = None
            root: Any = None
            if whole:  # NOTE [ Saved tensor identity ] Rule 2
                rid, root = root_ref(t)
                key: Any = (sptr, rid, t._version) if codec is None else (sptr, rid, t._version, t.dtype)
                found = self._by_storage.get(key)
                if (found is not None and found[0].refs > 0 and not found[1].expired()
                        and found[0].root() is root() and found[0].cover is not None
                        and (found[0].cover.admits(t, lo, span) or self._share_live(found[0], sptr))):
                    c["deduplicated"] += 1
                    return _Handle(self, found[0], t, lo)
                lo, span = 0, storage.nbytes()
            else:
                key = None
            src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, lo, (span,), (1,))
            e = _Entry(self._next_id, span, src, lo, key, Version(t), root)
            if key is not None:
                e.cover = Coverage(t, int(t.storage_offset()) * es, int(extent) * es)
            if codec is not None and span % es == 0 and lo % es == 0:
                e.codec, e.dtype = codec, t.dtype
            self._next_id += 1
            self._entries[e.id] = e
            if key is not None:
                self._by_storage[key] = (e, StorageWeakRef(storage))
            self._live += 1
            h = _Handle(self, e, t, int(t.storage_offset()) * es - lo)
            self._record(PACK, e.id, span)
            if not self._on_plan or e.id in self._plan.writes:  # type: ignore[union-attr]
                if self._on_plan and e.id in self._shares.last:  # NOTE [ Saved tensor identity ] Rule 2c
                    self._shares.deferred.add(e.id)
                else:
                    self._write(e)
            self._admit(e)
            return h

    def unpack(self, h: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the saved tensor, from the GPU cache or brought back.

        Raises autograd's own error if the saved tensor was modified in place after it was
        saved (NOTE [ Saved tensor identity ] Rule 1).
        """
        if type(h) is Kept:
            return h.get()
        e: _Entry = h.entry
        e.version.check()
        c = self._c
        with self._lock, nvtx_range("torchckpt.unpack"):
            self._poll_disk(raise_errors=True)  # NOTE [ Store ] Rule 11
            pos = self._record(UNPACK, e.id, 0)
            if e.gpu is not None:
                if e.id in self.cache:
                    self.cache.touch(e.id)
                if e.prefetched:
                    e.prefetched = False
                    c["prefetch_hits"] += 1
                    need = self._mover.wait(e.h2d)
                    if need is not None:
                        self._timings.append(("late", need, e.h2d))
                elif e.h2d is not None:
                    self._mover.wait(e.h2d)
                    c["cache_hits"] += 1
                else:
                    c["cache_hits"] += 1
                gpu = e.gpu
            else:
                c["misses"] += 1
                t0 = time.perf_counter()
                self._make_room(e.nbytes)  # before allocating the buffer: the budget is real memory
                gpu = self._load(e)
                need = self._mover.wait(e.h2d)
                if need is not None:
                    self._timings.append(("miss", need, e.h2d))
                elif not self._mover.cuda:
                    c["miss_wait_s"] += time.perf_counter() - t0
                if self.cache.fits(e.nbytes):
                    self.cache.insert(e.id, e.nbytes)
                else:  # larger than the free budget: the view returned holds it, the cache does not
                    self._drop_gpu(e)
            if self._on_plan:
                self._run_actions(pos)
            return rebuild(gpu.untyped_storage(), (e.base_off + h.rel) // h.dtype.itemsize, h.dtype, h.size,
                           h.stride, h.bits, self.device)

    # -- internals -----------------------------------------------------------------------
    def _record(self, kind: int, eid: int, nbytes: int) -> int:
        """Append to the trace; check the step against the plan (NOTE [ Prefetch from a recorded trace ] Rule 6).

        Returns the record's position, or -1 while the trace is off (NOTE [ Store ] Rule 10).
        """
        if not self._tracing:
            return -1
        n = len(self._trace)
        if n >= max(_TRACE_MIN, 4 * self._last_trace_len):  # NOTE [ Store ] Rule 10: graphs overlap, no step ends
            self._tracing, self._trace = False, []
            self._plan, self._on_plan = None, False
            self._c["trace_overflows"] += 1
            return -1
        self._trace.append((kind, eid, nbytes))
        if self._on_plan:
            planned = self._plan.trace if self._plan is not None else ()
            if n >= len(planned) or planned[n] != (kind, eid, nbytes):
                self._on_plan = False
                self._c["plan_divergences"] += 1
        return n

    def _share_live(self, e: _Entry, sptr: int) -> bool:
        """NOTE [ Saved tensor identity ] Rule 2c: whether a later save that ``e``'s coverage does not admit may share
        it, ``e``'s GPU copy being the live storage at ``sptr``; if ``e`` was written to host, it is written again,
        after this save, into the same host block."""
        if e.codec is not None or e.disk is not None or e.gpu is None or e.gpu.untyped_storage().data_ptr() != sptr:
            return False
        if self._shares.share(e.id):  # a deferred entry's last share
            self._write(e)
        elif e.host is not None:
            e.d2h = self._mover.to_host(e.host.tensor, e.gpu, None)  # after the last copy: one offload stream, in order
            self._c["offloaded"] += 1
            self._c["offloaded_bytes"] += e.nbytes
        return True

    def _write(self, e: _Entry) -> None:
        """Start the entry's device-to-host copy (its GPU copy must be present); to disk past the pool's cap."""
        assert e.gpu is not None
        alloc = self._alloc_for(e)  # NOTE [ Store ] Rule 11: a host block, or a staging buffer for the disk
        if e.codec is not None:
            e.host, e.blob, e.d2h = self._mover.to_host_packed(e.codec, e.gpu.view(e.dtype), alloc)
            self._c["compressed"] += 1
            self._c["compressed_bytes"] += e.blob.nbytes
        else:
            e.host = alloc(e.nbytes)
            e.d2h = self._mover.to_host(e.host.tensor, e.gpu, None)
        if e.disk is not None:
            self._spill(e)
        self._c["offloaded"] += 1
        self._c["offloaded_bytes"] += e.nbytes

    def _load(self, e: _Entry) -> torch.Tensor:
        if e.disk is not None:
            src = self._disk_source(e)  # NOTE [ Store ] Rule 11
        elif e.host is None:
            raise internal_error(f"entry {e.id} has neither a GPU nor a host copy")
        else:
            src = e.host.tensor
        if e.codec is not None and e.blob is not None:
            buf, ev, stream = self._mover.to_device_packed(e.codec, e.blob, src, e.nbytes, e.dtype, e.d2h)
            e.gpu, e.base_off, e.h2d, e.h2d_stream = buf, 0, ev, stream
            self._c["loaded_bytes"] += src.numel()
            return buf
        buf, ev, stream = self._mover.to_device(src, e.nbytes, e.d2h)
        e.gpu, e.base_off, e.h2d, e.h2d_stream = buf, 0, ev, stream
        self._c["loaded_bytes"] += e.nbytes
        return buf

    def _run_actions(self, pos: int) -> None:
        plan = self._plan
        if plan is None:
            return
        if self.disk is not None:
            self._read_ahead(pos)  # NOTE [ Store ] Rule 11
        for j in plan.actions.get(pos, ()):
            if j < 0:  # make room for the next prefetch (NOTE [ Prefetch from a recorded trace ] Rule 3)
                v = self._entries.get(~j)
                if v is not None and ~j in self.cache:
                    self.cache.remove(~j)
                    self._evict(v)
                continue
            e = self._entries.get(j)
            if e is None:
                continue
            if e.gpu is not None:
                self.cache.pin(j)
            elif self.cache.fits(e.nbytes):
                self._load(e)
                e.prefetched = True
                self.cache.insert(j, e.nbytes, pinned=True)
            else:  # the runtime left the dry run's cache state: stop following the plan
                self._on_plan = False
                self._c["plan_divergences"] += 1
                return

    def _make_room(self, nbytes: int) -> None:
        """Evict LRU entries until ``nbytes`` more fit (or only pinned entries are left)."""
        for v in self.cache.victims(nbytes):
            e = self._entries[v]  # type: ignore[index]
            self.cache.remove(v)
            self._evict(e)

    def _admit(self, e: _Entry) -> None:
        """Rank a just-saved entry in the cache, evicting first; one that cannot fit is evicted at once."""
        self._make_room(e.nbytes)
        if self.cache.fits(e.nbytes):
            self.cache.insert(e.id, e.nbytes)
        else:
            self._evict(e)

    def _evict(self, e: _Entry) -> None:
        """Drop the GPU copy of ``e`` (already out of the cache's ranking), writing it first if needed."""
        c = self._c
        if e.host is None and e.disk is None:  # not written yet (NOTE [ Store ] Rule 3; the plan did not foresee this eviction)
            self._write(e)
        if e.d2h is not None and not e.d2h.query():
            c["eviction_waits"] += 1
            need = self._mover.wait(e.d2h)  # NOTE [ Store ] Rule 3: the compute stream waits, not the host
            if need is not None:
                self._timings.append(("evict", need, e.d2h))
        self._drop_gpu(e)
        c["evictions"] += 1

    def _drop_gpu(self, e: _Entry) -> None:
        if e.h2d is not None and e.h2d_stream is not None:
            e.h2d_stream.wait_event(e.h2d)  # NOTE [ Store ] Rule 5
        e.gpu = None
        e.h2d = None
        e.h2d_stream = None
        e.prefetched = False

    def _drop(self, e: _Entry) -> None:
        with self._lock:
            e.refs -= 1
            if e.refs > 0:
                return
            pos = self._record(RELEASE, e.id, 0)
            self.cache.remove(e.id)
            last = e.h2d if e.h2d is not None else e.d2h
            if e.gpu is not None:
                self._drop_gpu(e)
            if e.host is not None:
                self.host.free(e.host, last)
                e.host = None
            if e.disk is not None:
                self._poll_disk(raise_errors=False)
                self._forget_disk(e)  # NOTE [ Store ] Rule 11
            self._entries.pop(e.id, None)
            if e.key is not None and self._by_storage.get(e.key, (None,))[0] is e:
                del self._by_storage[e.key]
            self._live -= 1
            if self._live < 0:
                raise internal_error("more entries released than created")
            if self._on_plan:
                self._run_actions(pos)

    def _finish_step(self) -> None:
        trace = tuple(self._trace)
        self._trace = []
        self._c["steps"] += 1
        self._next_id = 0
        self._shares.step()  # NOTE [ Saved tensor identity ] Rule 2c
        self._resolve_timings(block=False)
        if not self._tracing:  # the trace overflowed (NOTE [ Store ] Rule 10): start afresh, with no plan
            self._tracing = True
            return
        self._last_trace_len = len(trace)
        if not self.prefetch or not any(kind == UNPACK for kind, _, _ in trace):
            self._plan, self._on_plan = None, False
            return
        if self._plan is None or self._plan.trace != trace:
            self._plan = prefetch_from_trace(trace, self.cache.capacity)
            self._c["plans"] += 1
        self._on_plan = True

    def _resolve_timings(self, block: bool) -> None:
        keep = []
        c = self._c
        for kind, need, done in self._timings:
            if block:  # both ends: need is on the compute stream, done on a copy stream
                need.synchronize()
                done.synchronize()
            elif not (done.query() and need.query()):
                keep.append((kind, need, done))
                continue
            late = need.elapsed_time(done) / 1e3
            if late > 0:
                if kind == "late":
                    c["late_prefetches"] += 1
                    c["late_wait_s"] += late
                elif kind == "evict":
                    c["eviction_wait_s"] += late
                else:
                    c["miss_wait_s"] += late
        self._timings = keep

    def _set_delay(self, fn: Callable[[str, Any], None] | None) -> None:
        """Test hook: ``fn(kind, stream)`` runs on the copy stream right before each copy."""
        self._mover.delay = fn


_stores: dict[torch.device, Store] = {}
_stores_lock = threading.Lock()


def default_store(device: str | torch.device | None = None) -> Store:
    """The store ``Offload()`` and ``offload()`` use when given none: one per device, made on first use.

    Args:
        device: ``None``: the current CUDA device if CUDA is available, else ``"cpu"``
            (a simulated store, for tests and demos).

    Returns:
        The process-wide default ``Store`` for that device.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _stores_lock:
        if device not in _stores:
            _stores[device] = Store(device)
        return _stores[device]
