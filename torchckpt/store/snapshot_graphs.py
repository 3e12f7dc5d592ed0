"""A save's compression captured as CUDA graphs and replayed, for ``SnapshotStore(graphs=True)``.

# NOTE [ Captured saves ]
# On a host-bound adjoint (issue 26: the RTM's compressed runs leave the device idle half the time while the host
# runs the store's Python and the codec's launches) a save's compression can be one graph launch per tensor instead
# of the codec's Python and its kernel launches. ``SnapshotStore(defer_sizes=True, graphs=True)``:
# 1. Applies to a save to an off-GPU tier whose sizes are left on the device (NOTE [ Snapshot sizes ] Rule 1), on
#    CUDA, with a codec that says its ``compress_deferred`` can be captured (``Codec.capturable``: TritonQuant's
#    Triton kernels, Bitcomp). Elsewhere the save is the eager one of NOTE [ Snapshot sizes ]: a ``Tier.GPU``
#    snapshot (it keeps its buffers), the first snapshot (compressed once by ``calibrate``), ``peers=``, every slot
#    pinned. Each distinct state tensor (its address, shape, strides, dtype) gets graphs of its own, so the state
#    must stay at a few addresses from save to save (updated in place, or swapped between buffers as a wave
#    equation's two time levels are); a tensor beyond ``KEYS`` addresses per entry (or twice the snapshot's tensors,
#    if more) is compressed eagerly (the same bits, Rule 5) and the store warns once.
# 2. A ring of ``len(ring)`` entries, one more than the snapshots that may be unsized at once (NOTE [ Snapshot
#    sizes ] Rule 3); an entry holds one graph per distinct tensor, whose outputs (the deferred buffers: codes, block
#    parameters, raw rows, sizes) are its own memory, and the save that used it last. Memory: the codec's worst case
#    (about the tensor's size) per distinct tensor per entry: with a state of two buffers, the deferred buffers of as
#    many snapshots as the eager path's scratch holds in flight (NOTE [ Snapshot sizes ] Rule 8).
# 3. A replay overwrites its entry's buffers, so it comes after every read of them: a restore's decode of the
#    unsized snapshot and a dropped snapshot's settle run on the compute stream before it (stream order); the settle
#    and the slot's write of a kept one run on the sizes stream (NOTE [ Mover ] Rule 6), and the compute stream waits
#    for that write's event, on the device, before the replay. The entry's last save is settled before (the ring is
#    longer than the unsized bound, so this waits for nothing the bound would not).
# 4. Capture: on the ring's own stream, after one eager ``compress_deferred`` of the same tensor there (Triton's
#    compilation and nvCOMP's plan for that stream are made outside the capture), capture errors local to the thread,
#    each graph with its own memory pool. A capture that fails raises ``CheckpointError`` naming the codec: nothing
#    falls back silently.
# 5. A replay runs the kernels the eager call launches, on the same input, into buffers of the same sizes: the same
#    bits (the CUDA tests compare every restore with the eager store's). ``stats().graph_saves`` counts the saves
#    whose compression was replayed, ``graph_captures`` the graphs captured.
# 6. Memory of destroyed graphs: a closed store's graphs leave their pools' memory cached in the caching allocator,
#    which gives it back to the driver at ``torch.cuda.empty_cache()`` or when an allocation outside any capture
#    fails, never while a capture is under way; so after many stores a capture can run out of GPU memory with most
#    of it cached (found on an H100: adjoint_codecs' seventieth store, 66.9 GiB cached in destroyed graphs' pools). A
#    capture that runs out of memory is abandoned, the cache emptied once (outside the capture) and the capture
#    tried again; a second failure raises ``CheckpointError``. ``stats().graph_retries`` counts the tries again.
# 7. The sizes come back in the graph: each graph that leaves sizes on the device also copies them, in the capture,
#    into a pinned row of its own, so a save whose every tensor was replayed reads nothing back on the mover's sizes
#    stream (no ``torch.cat`` of the sizes, no copy, stream switch or event of its own; NOTE [ Snapshot sizes ] Rule
#    1): its sizes are on the host once the compute stream's event after the replays has completed. A row is
#    overwritten by its graph's next replay, which comes after the entry's last save is settled (Rule 3), that is
#    after its rows were read. A save with a tensor compressed eagerly (Rule 1) reads its sizes back as before.
# 8. A replayed save's buffers live as long as the ring, which the store drops at ``close`` after draining the
#    mover's streams: the settle and the slot's write on the sizes stream read them with no ``record_stream`` (4 per
#    snapshot of two tensors), and the write waits for the save's event once, where the settle's switch to the sizes
#    stream waited for it (NOTE [ Mover ] Rule 6).
# 9. Each graph captures into a ``torch.cuda.MemPool`` of its own, and ``close`` (the store's, after draining the
#    mover's streams) drops the graphs and their buffers first, then the pools, whose end empties their cached
#    blocks: the ring's memory goes back to the driver at ``close``. With the pools of ``capture_begin``'s own
#    handles, a destroyed graph's memory stayed reserved until ``empty_cache`` or an allocation failure (Rule 6): on
#    an H100 the RTM's runs of ``adjoint_codecs.py`` reserved about 1.8 GiB more with each store (11.2 to 25.8 GiB
#    over 28 stores). Giving cached blocks back synchronises the device (``cudaFree``), once per ``close`` of a store
#    that captured. A store left to the garbage collector without ``close`` keeps the old behaviour (Rule 6).
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from torchckpt._errors import CheckpointError
from torchckpt._streams import current, index
from torchckpt.codecs.base import Codec, Deferred

__all__ = ["SaveGraphs", "KEYS", "check_graphs"]

KEYS = 4  # distinct state tensors an entry captures graphs for (NOTE [ Captured saves ] Rule 1)


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


def check_graphs(device: torch.device, codec: Codec | None, defer_sizes: bool) -> None:
    """``SnapshotStore(graphs=True)``'s requirements (NOTE [ Captured saves ] Rule 1)."""
    if device.type != "cuda" or codec is None or not defer_sizes:
        raise ValueError("torchckpt: SnapshotStore(graphs=True) replays a codec's deferred compression as CUDA graphs: "
                         "it needs device='cuda', a codec and defer_sizes=True (got device="
                         f"{str(device)!r}, codec={type(codec).__name__ if codec is not None else None}, "
                         f"defer_sizes={defer_sizes}); pass graphs=False otherwise.")
    if not codec.capturable(device):
        raise ValueError(f"torchckpt: SnapshotStore(graphs=True): {type(codec).__name__}'s compression cannot be "
                         f"captured as a CUDA graph on {device}; pass graphs=False, or a TritonQuant (with triton) or "
                         "Bitcomp codec.")


class SaveGraphs:
    """The ring of captured compressions (NOTE [ Captured saves ] Rules 2-4).

    Args:
        codec: the store's codec (``capturable`` on ``device``).
        device: a CUDA device.
        entries: ring entries (>= 2).
    """

    def __init__(self, codec: Codec, device: torch.device, entries: int) -> None:
        self.codec = codec
        self.device = device
        # per entry, per tensor key: the graph, its outputs, its row of sizes (NOTE [ Captured saves ] Rule 7)
        self._graphs: list[dict[tuple[Any, ...], tuple[Any, Deferred, torch.Tensor | None]]] = [
            {} for _ in range(entries)]
        self._free: list[Any] = [None] * entries  # per entry: the event after which its buffers may be overwritten
        self.owner: list[Any] = [None] * entries  # per entry: the unsized record of the save that used it last
        self._next = 0
        self._stream = torch.cuda.Stream(device)
        self._idx = index(device)
        self._warm: dict[tuple[Any, ...], tuple[int, torch.dtype] | None] = {}  # per key: its sizes' numel and dtype
        self._warned = False
        self._pools: list[Any] = []  # each graph's MemPool, dropped after the graphs (NOTE [ Captured saves ] Rule 9)
        self.captures = 0
        self.retries = 0  # captures tried again after emptying the allocator's cache (NOTE [ Captured saves ] Rule 6)

    def entry(self) -> int:
        """The next entry of the ring (the caller settles its ``owner`` first: NOTE [ Captured saves ] Rule 3)."""
        i = self._next
        self._next = (i + 1) % len(self._graphs)
        return i

    def compress(self, i: int, tensors: Sequence[torch.Tensor]) -> tuple[list[Deferred], list[torch.Tensor] | None]:
        """Each of ``tensors`` compressed by entry ``i``'s graph for it (captured at its first use), on the current
        stream after the entry's last reader (NOTE [ Captured saves ] Rules 1, 3); and, when every one was a replay,
        the pinned rows their sizes come back in, in order (NOTE [ Captured saves ] Rule 7), else ``None`` (some
        were eager)."""
        cur = current(self._idx)  # NOTE [ Cheap streams ] Rule 1
        if self._free[i] is not None:
            cur.wait_event(self._free[i])
            self._free[i] = None
        graphs = self._graphs[i]
        most = max(KEYS, 2 * len(tensors))  # NOTE [ Captured saves ] Rule 1: two buffers per tensor, swapped
        out: list[Deferred] = []
        rows: list[torch.Tensor] | None = []
        for t in tensors:
            k = _key(t)  # the replay reads the memory the capture read: no detached view made per save
            got = graphs.get(k)
            if got is None and len(graphs) >= most:
                self._warn()
                out.append(self.codec.compress_deferred(t.detach()))
                rows = None
                continue
            if got is None:
                got = graphs[k] = self._capture(t.detach(), k, cur)
            got[0].replay()
            out.append(got[1])
            if rows is not None and got[2] is not None:
                rows.append(got[2])
        return out, rows

    def close(self) -> None:
        """Drop the graphs and their buffers, then their pools, which give their cached memory back (NOTE [ Captured
        saves ] Rule 9); the caller has made the compute stream wait for every reader of the buffers and holds none."""
        n = len(self._graphs)
        self._graphs = [{} for _ in range(n)]
        self._free = [None] * n
        self.owner = [None] * n
        self._pools.clear()

    def release(self, i: int, after: Any) -> None:
        """Entry ``i``'s buffers are read last by the work before the event ``after`` (``None``: by the compute
        stream's work, which a replay follows anyway)."""
        self._free[i] = after
        self.owner[i] = None

    def _capture(self, t: torch.Tensor, k: tuple[Any, ...], cur: Any) -> tuple[Any, Deferred, torch.Tensor | None]:
        s = self._stream
        s.wait_stream(cur)
        with torch.cuda.stream(s):
            if k not in self._warm:  # NOTE [ Captured saves ] Rule 4: compiled kernels and the codec's plan for this stream, made eagerly
                w = self.codec.compress_deferred(t)
                self._warm[k] = None if w.sizes is None else (w.sizes.numel(), w.sizes.dtype)
            spec = self._warm[k]
            # NOTE [ Captured saves ] Rule 7: the row the graph copies its sizes into
            row = None if spec is None else torch.empty(spec[0], dtype=spec[1], pin_memory=True)
            got = self._record(t, row)
            if got is None:  # NOTE [ Captured saves ] Rule 6: out of memory during the capture
                torch.cuda.empty_cache()  # outside a capture: destroyed graphs' pools go back to the driver
                self.retries += 1
                got = self._record(t, row, last=True)
        cur.wait_stream(s)
        self.captures += 1
        assert got is not None
        return got[0], got[1], row

    def _record(self, t: torch.Tensor, row: torch.Tensor | None, last: bool = False) -> tuple[Any, Deferred] | None:
        """One capture of the codec's ``compress_deferred(t)`` on the current (ring's) stream, its sizes copied into
        the pinned ``row`` (NOTE [ Captured saves ] Rule 7); ``None`` if it ran out of GPU memory and this is not
        the ``last`` try (NOTE [ Captured saves ] Rules 4, 6)."""
        g = torch.cuda.CUDAGraph()
        pool = torch.cuda.MemPool()  # on the ring's stream's device (NOTE [ Captured saves ] Rule 9)
        handle: Any = pool.id  # a pool id as capture_begin takes it (typed there as graph_pool_handle's)
        try:
            g.capture_begin(pool=handle, capture_error_mode="thread_local")
            try:
                d = self.codec.compress_deferred(t)
                if d.sizes is not None and row is not None and row.shape == d.sizes.shape:
                    row.copy_(d.sizes, non_blocking=True)  # NOTE [ Captured saves ] Rule 7
                elif d.sizes is not None or row is not None:
                    raise CheckpointError(
                        f"torchckpt: internal error: {type(self.codec).__name__}.compress_deferred left sizes of "
                        "another shape in a capture than eagerly on the same tensor; please report it.")
            finally:
                g.capture_end()
        except Exception as e:  # noqa: BLE001 - any failure of the capture is the codec's
            oom = isinstance(e, torch.cuda.OutOfMemoryError) or isinstance(e.__context__, torch.cuda.OutOfMemoryError)
            if oom and not last:
                return None  # the failed graph (and its pool) goes with this frame, before the cache is emptied
            hint = (" even after emptying the caching allocator's cache: free GPU memory, pass a smaller "
                    "sizes_in_flight, or" if oom else ";")
            raise CheckpointError(
                f"torchckpt: SnapshotStore(graphs=True) could not capture {type(self.codec).__name__}'s "
                f"compress_deferred as a CUDA graph ({type(e).__name__}: {e}){hint} pass graphs=False."
            ) from e
        self._pools.append(pool)
        return g, d

    def _warn(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                "torchckpt: SnapshotStore(graphs=True) saw more state tensors at distinct addresses than it captures "
                f"(at least {KEYS}, or two per tensor of a snapshot); "
                "the others are compressed without a graph (the same bits, more host time). Keep the state in "
                "the same buffers from step to step (update them in place) to replay graphs.",
                RuntimeWarning, stacklevel=5,
            )
