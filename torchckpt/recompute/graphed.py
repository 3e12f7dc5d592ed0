"""``Recompute(graphed=True)``: the reentrant recomputation (reentrant.py) whose backward replays a CUDA graph.

# NOTE [ Graphed recompute ]
# 1. Under ``Recompute(reentrant=True)`` a block's backward runs its forward again in Python and takes the gradients
#    op by op: a few hundred microseconds of host work a block, which on a model whose step the host bounds (many
#    small blocks, many small ops: ResNet-152's Bottlenecks, ConvNeXt's) the device waits for. Here that backward,
#    the recomputation and its gradients, is captured once as one CUDA graph per block and call signature (Rule 2)
#    and replayed: the backward then costs the host the copies of its inputs into the graph's buffers, one launch
#    and the copies of the gradients out. The forward is the reentrant one (no grad, no hook), run eagerly.
# 2. A graph serves the calls of its signature: the tensors' shapes, strides, dtypes, devices, ``requires_grad`` and
#    16-byte alignment; the non-tensor arguments and the call's structure (immutable values only: None, bools,
#    numbers, strings, dtypes, devices, and tuples of them; another value and the block recomputes eagerly); which
#    outputs got a gradient and its layout; which inputs autograd asks for; autocast; the addresses of the module's
#    parameters and buffers; the backends' flags that choose kernels (TF32, reduced-precision reductions,
#    deterministic algorithms, cuDNN's benchmark and determinism, the attention backends enabled). Another signature
#    is another graph, up to ``MAX_KEYS`` per block; past that the block recomputes eagerly
#    (``stats()['eager_keys']``).
# 3. A signature's first backward runs eagerly, so a call made once pays no capture. At its second: the backward
#    runs eagerly on the graph's own input buffers (on the capture stream, under a dispatch mode that watches every
#    op), is captured, and is replayed; the replay's gradients are compared with the eager run's bit for bit (one
#    synchronisation per capture; a replay that moves the device's generator counts as a draw, its state put back).
#    The module's parameters are taken through aliases made on the capture stream (``_run``): their own gradient
#    accumulators belong to the forward's stream, and a gradient handed to one from another stream makes that stream
#    wait on it, which a capture cannot record. The signature recomputes eagerly from then on (its reason in
#    ``stats()``) where: an op synchronises (a value read on the host, an output whose shape depends on the data, a
#    tensor copied between host and device); an op draws random numbers and the forward's generator state was not
#    kept (``preserve_rng_state=False``; Rule 8); an op reads a tensor, on the device or the host, that is not one
#    of the call's, a parameter or a buffer of the module, nor made during the backward (a view of it or an op
#    writing it in place makes nothing), and that is still alive after it (a graph would read it at the address it
#    had at the capture, whatever the module holds later: transformers' checkpointing hook binds a layer's rotary
#    tables in the function it hands over, new each step; before views were told apart from new memory a replay of
#    Llama's layers read the capture's tables and gave a wrong gradient, caught by tests/test_zoo.py on the H100); a
#    tensor is not dense (an expanded gradient); the block writes buffers in its forward that NOTE [ Buffers written
#    in a forward ] Rule 2 puts back around each recomputation (a norm of its own ``forward``, a buffer whose
#    version moved): those copies read the values the forward started from, cloned anew at each call, which a graph
#    would read where the capture's call left them (torch's own norms are not among them: their statistics are
#    written to fresh tensors, made in the capture); or the replay differs from the eager run. That step's gradients
#    are then the eager backward's, run again as ``Recompute(reentrant=True)``.
# 4. Memory: the graphs' inputs and outputs are buffers kept per device and shared by every graphed block, one per
#    role (argument, incoming gradient, argument's or parameter's gradient), layout and position in a call, so
#    blocks of one shape share them; the gradients are copied out of them after each replay (``clone``, same
#    strides), before any other replay. Each graph's intermediates live in one private memory pool per device shared
#    by all graphs (captured one after another, replayed one at a time on the backward's stream, each reading only
#    buffers it writes first; a graph captured and then not used is kept until ``clear()``: the pool dies with the
#    last graph in it, and torch's allocator asserts at a capture into a dead pool, so a capture after every graph
#    went, with their modules, takes a new pool). The allocator's peak does not count a replay's intermediates:
#    ``pool_bytes()`` says what the pool holds, ``held_bytes()`` the pool and the buffers; ``clear()`` lets every
#    graph, buffer and pool go.
# 5. What a capture bakes in beside Rule 2's signature: the Python values the forward reads other than its arguments
#    (a module's float attribute changed later is not seen), and Python side effects of a recomputation run at the
#    capture only. A block whose forward reads Python state that changes from step to step must not be graphed, nor
#    one whose forward communicates (FSDP's all-gathers in its hooks): a capture that fails leaves the process's
#    CUDA RNG unusable (Rule 7). One backward at a time per device (the buffers are shared).
# 6. Not graphed (the backward recomputes eagerly as ``Recompute(reentrant=True)``, the same values): a second order
#    (grad mode on in the backward), tensors off CUDA or on several devices, a call with no module (a function
#    checkpointed alone), under ``torch.compile`` (api.run) and while a stream capture is under way.
# 7. A capture that fails after Rule 3's checks leaves torch's allocator routing the capture stream's allocations to
#    the pool (``CUDAGraph.capture_end`` raises before it ends that): ``_record`` ends it, warns, and turns captures
#    off for the process (every block recomputes eagerly, the same values) until ``clear()``.
# 8. Random draws (an op tagged ``nondeterministic_seeded``, unless its dropout probability is 0 or it is not
#    training): a graph captured with them reads the device generator's seed and offset at each replay and moves the
#    offset by what it draws. Each replay of such a graph runs with the device generator set to the state the
#    block's forward started from (``ForwardState``, as the eager recomputation sets it), and the step's state put
#    back after: the same masks as the forward's (checked at the capture with the rest, Rule 3), the step's RNG
#    stream untouched.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch._prims_common
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchckpt.recompute.buffers import BufferGuard
from torchckpt.recompute.reentrant import gradients

__all__ = ["BlockGraphs", "block_graphs", "clear", "held_bytes", "pool_bytes", "stats"]

MAX_KEYS = 4  # signatures captured per block (NOTE [ Graphed recompute ] Rule 2)
_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
_STATS: Counter[str] = Counter()
_OFF: list[str] = []  # why captures are off in this process (a capture failed: NOTE [ Graphed recompute ] Rule 7)
_SYNC_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


def stats() -> dict[str, int]:
    """Counts since the process began or ``clear()``: ``captures``, ``replays``, ``eager`` (backwards run eagerly),
    and for each signature left eager, its reason (NOTE [ Graphed recompute ] Rule 3)."""
    return dict(_STATS)


class _Device:
    """One device's capture stream, memory pool and shared buffers (NOTE [ Graphed recompute ] Rule 4)."""

    __slots__ = ("buffers", "entries", "index", "kept", "pool", "stream")

    def __init__(self, index: int) -> None:
        self.index = index
        with torch.cuda.device(index):
            # one pool id for every graph of the device (torch.cuda.MemPool shared by graphs, the graphs then let go
            # before it, tripped an assertion of torch's host allocator at the next pool's first capture on the H100)
            self.pool: Any = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream()
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        # graphs captured and then not used (NOTE [ Graphed recompute ] Rule 3's checks after the capture): kept
        # until clear(), since the pool dies with the last graph in it, and a later capture into a dead pool fails
        # torch's allocator assertion (use_count > 0), as it did on the H100 when the first graph of T5's pool was
        # dropped
        self.kept: list[Any] = []
        self.entries: weakref.WeakSet[_Entry] = weakref.WeakSet()  # the graphs in use (they go with their modules)

    def buffer(self, role: str, t: torch.Tensor, slot: int) -> torch.Tensor:
        key = (role, t.shape, t.stride(), t.dtype, slot)
        got = self.buffers.get(key)
        if got is None:
            got = self.buffers[key] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return got


_DEVICES: dict[int, _Device] = {}
_BLOCKS: weakref.WeakKeyDictionary[nn.Module, BlockGraphs] = weakref.WeakKeyDictionary()


def clear() -> None:
    """Let every block's graphs go, then the shared buffers and the pools (NOTE [ Graphed recompute ] Rule 4), and
    let captures be tried again after one failed (NOTE [ Graphed recompute ] Rule 7)."""
    for b in list(_BLOCKS.values()):
        b.entries.clear()
    _BLOCKS.clear()
    for d in _DEVICES.values():
        d.buffers.clear()
        d.kept.clear()
    _DEVICES.clear()
    _STATS.clear()
    _OFF.clear()


def pool_bytes() -> int:
    """Bytes the graphs' private pools hold on every device (their intermediates; NOTE [ Graphed recompute ] Rule 4)."""
    ids = {tuple(d.pool) for d in _DEVICES.values()}
    if not ids:
        return 0
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) in ids)


def held_bytes() -> int:
    """Bytes the graphs hold beyond the tensors the allocator counts at a replay: the shared buffers and the pools
    (NOTE [ Graphed recompute ] Rule 4)."""
    return sum(t.untyped_storage().nbytes() for d in _DEVICES.values() for t in d.buffers.values()) + pool_bytes()


def block_graphs(module: nn.Module) -> BlockGraphs:
    """The graphs of ``module``'s backward (kept while the module lives)."""
    got = _BLOCKS.get(module)
    if got is None:
        got = _BLOCKS[module] = BlockGraphs(module)
    return got


def _dense(t: torch.Tensor) -> bool:
    return bool(torch._prims_common.is_non_overlapping_and_dense_or_false(t))


def _plain(x: Any) -> bool:
    if isinstance(x, tuple):
        return all(_plain(y) for y in x)
    return isinstance(x, _PLAIN)


def _flags() -> tuple[Any, ...]:
    """The backends' flags that choose kernels (NOTE [ Graphed recompute ] Rule 2)."""
    b = torch.backends.cuda
    m = b.matmul
    c = torch.backends.cudnn
    return (m.allow_tf32, m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction,
            c.allow_tf32, c.benchmark, c.deterministic, torch.are_deterministic_algorithms_enabled(),
            b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled())


class _Reads(TorchDispatchMode):
    """Watches a backward's ops: random draws, and tensors read that the backward did not make (NOTE [ Graphed
    recompute ] Rule 3)."""

    def __init__(self, allowed: set[tuple[str, int]]) -> None:
        super().__init__()
        self.allowed = allowed
        self.made: set[tuple[str, int]] = set()
        self.read: dict[tuple[str, int], tuple[StorageWeakRef, tuple[int, ...]]] = {}
        self.random: str | None = None
        self.sync: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.random is None and _draws(func, args, kwargs):
            self.random = str(func)
        if self.sync is None and (any(tag in func.tags for tag in _SYNC_TAGS)
                                  or func is torch.ops.aten._local_scalar_dense.default):
            self.sync = str(func)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if self.sync is None and any(t.is_cuda for t in ins) and any(t.device.type == "cpu" and t.dim() for t in ins):
            self.sync = f"{func} (a host tensor into a device op)"
        for t in ins:
            s = t.untyped_storage()
            k = (str(t.device), s.data_ptr())
            if s.nbytes() and k not in self.made and k not in self.allowed and k not in self.read:
                self.read[k] = (StorageWeakRef(s), tuple(t.shape))
        out = func(*args, **kwargs)
        held = {(str(t.device), t.untyped_storage().data_ptr()) for t in ins}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                if self.sync is None and t.device.type == "cpu" and any(x.is_cuda for x in ins):
                    self.sync = f"{func} (a device tensor to the host)"
                k = (str(t.device), t.untyped_storage().data_ptr())
                if k not in held:  # a view or an in-place result is its input's memory, not made here
                    self.made.add(k)
        return out

    def outside(self) -> list[tuple[int, ...]]:
        """Shapes of the tensors read before anything made their memory, neither allowed, and alive still."""
        return [shape for ref, shape in self.read.values() if not ref.expired()]


def _draws(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether an op tagged ``nondeterministic_seeded`` draws here: not where its dropout probability (``dropout_p``,
    ``p``) is 0 or ``train`` is False (attention without dropout, dropout in evaluation)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for i, a in enumerate(func._schema.arguments):
        if a.name in ("dropout_p", "p", "train"):
            v = args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
            if (a.name == "train" and v is False) or (a.name != "train" and isinstance(v, (int, float)) and v == 0):
                return False
    return True


def _storages(ts: Sequence[torch.Tensor | None]) -> set[tuple[str, int]]:
    return {(str(t.device), t.untyped_storage().data_ptr()) for t in ts if t is not None}


class _Entry:
    """One captured backward: its graph, the buffers it reads (arguments, incoming gradients) and writes (the
    gradients, ``None`` where the eager backward gave none)."""

    __slots__ = ("__weakref__", "args", "draws", "graph", "grads", "outs")

    def __init__(self, graph: Any, args: list[torch.Tensor], grads: list[torch.Tensor | None],
                 outs: list[torch.Tensor | None], draws: int | None) -> None:
        self.graph, self.args, self.grads, self.outs, self.draws = graph, args, grads, outs, draws

    def replay(self, saved: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
               state: Any) -> list[torch.Tensor | None]:
        for b, t in zip(self.args, saved):
            b.copy_(t)
        for gb, g in zip(self.grads, grads):
            if gb is not None and g is not None:
                gb.copy_(g)
        if self.draws is None:
            self.graph.replay()
        else:  # NOTE [ Graphed recompute ] Rule 8: the forward's generator state for the replay, then the step's back
            now = torch.cuda.get_rng_state(self.draws)
            torch.cuda.set_rng_state(state.device_states[state.devices.index(self.draws)], self.draws)
            self.graph.replay()
            torch.cuda.set_rng_state(now, self.draws)
        _STATS["replays"] += 1
        return [None if o is None else o.clone() for o in self.outs]


def _like(b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Buffer ``b`` as the input ``t``: requiring grad as it does, a leaf where it is one, else a view."""
    v = b.detach().requires_grad_(t.requires_grad)
    return v if t.is_leaf or not t.requires_grad else v.view_as(v)


def _run(call: Any, mod: nn.Module, args: list[torch.Tensor], saved: Sequence[torch.Tensor],
         params: Sequence[torch.Tensor], ins: list[torch.Tensor | None], need: tuple[bool, ...],
         rng: bool) -> list[torch.Tensor | None]:
    """The eager backward on the graph's buffers (``args``, ``ins``), the module's parameters that require grad
    taken through aliases made on the current (capture) stream (NOTE [ Graphed recompute ] Rule 3): the
    parameters' own gradient accumulators belong to the forward's stream, and a gradient handed to one from the
    capture stream makes that stream wait, which a capture cannot record. Each buffer stands for its input as a
    leaf where the input is one and as a view where not, as the eager recomputation takes them (autocast caches a
    leaf's cast: NOTE [ Reentrant recompute ] Rule 8)."""
    with torch.enable_grad():  # a view made without grad would not carry it
        views = tuple(_like(b, t) for b, t in zip(args, saved))
    alias = {id(p): p.detach().requires_grad_(True) for p in params}
    names = {n: alias[id(p)] for n, p in mod.named_parameters(remove_duplicate=False) if id(p) in alias}
    with _reparametrize_module(mod, names):
        return gradients(call, views, [alias[id(p)] for p in params], ins, need, rng=rng)


def _record(call: Any, mod: nn.Module, args: list[torch.Tensor], saved: Sequence[torch.Tensor],
            params: Sequence[torch.Tensor], ins: list[torch.Tensor | None], need: tuple[bool, ...],
            outs: list[torch.Tensor | None], dev: _Device) -> Any:
    """The capture of ``_run`` (its gradients copied into ``outs``) on the current stream, or why it failed. A failed
    capture leaves torch's allocator routing this stream's allocations to the pool: that is ended here, and captures
    are off for the process from then on (NOTE [ Graphed recompute ] Rule 7)."""
    if not dev.kept and not dev.entries:  # every graph of the pool gone (modules freed): the pool with them
        dev.pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    dev.kept.append(graph)  # until it is known good (NOTE [ Graphed recompute ] Rule 4): the pool lives while it does
    pool = dev.pool
    began = ended = False
    try:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        began = True
        try:
            got = _run(call, mod, args, saved, params, ins, need, rng=False)
            for o, g in zip(outs, got):
                if o is None or g is None:
                    if (o is None) != (g is None):
                        raise RuntimeError("the capture's gradients are not the eager run's")
                    continue
                o.copy_(g)
            del got
        finally:
            graph.capture_end()
            ended = True
    except Exception as e:  # noqa: BLE001 - any failure turns captures off (NOTE [ Graphed recompute ] Rule 7)
        if began and not ended:  # capture_end raised before it ended the routing (ended twice breaks the allocator)
            with contextlib.suppress(Exception):
                torch._C._cuda_endAllocateToPool(dev.index, pool)
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        _OFF.append(why)
        warnings.warn(
            f"torchckpt: Recompute(graphed=True): a capture failed ({why}); blocks recompute eagerly from now on in "
            "this process (the same values at the host's cost). Please report it with the block's code; "
            "torchckpt.recompute.graphed.clear() lets captures be tried again.", RuntimeWarning, stacklevel=6)
        return f"eager: capture failed ({why})"
    dev.kept.remove(graph)
    return graph


class BlockGraphs:
    """One block's captured backwards by signature (NOTE [ Graphed recompute ] Rules 2-3): an ``_Entry``, a count of
    eager runs before the capture, or the reason the signature stays eager."""

    __slots__ = ("__weakref__", "entries", "module", "warned")

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)
        self.entries: dict[tuple[Any, ...], _Entry | int | str] = {}
        self.warned = False

    def _key(self, call: Any, saved: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
             grads: Sequence[torch.Tensor | None], need: tuple[bool, ...]) -> tuple[Any, ...] | None:
        mod = self.module()
        if mod is None:
            return None
        dev = None
        ts: list[tuple[Any, ...] | None] = []
        for t in (*saved, *grads):
            if t is None:
                ts.append(None)
                continue
            if t.device.type != "cuda" or (dev is not None and t.device != dev):
                return None
            dev = t.device
            ts.append((t.shape, t.stride(), t.dtype, t.requires_grad, t.data_ptr() % 16 == 0))
        if dev is None or not all(_plain(x) for x in call.leaves):
            return None
        a_dev, a_cpu = call.state.autocast
        auto = (None if a_dev is None else (a_dev["enabled"], a_dev["dtype"], a_dev["cache_enabled"]),
                a_cpu["enabled"], a_cpu["dtype"])
        key = (dev.index, tuple(ts), need, call.spec, tuple(call.leaves), auto, _flags(),
               tuple(p.data_ptr() for p in params), tuple(b.data_ptr() for b in mod.buffers()))
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def backward(self, call: Any, saved: tuple[torch.Tensor, ...], params: tuple[torch.Tensor, ...],
                 grads: tuple[torch.Tensor | None, ...], need: tuple[bool, ...]) -> list[torch.Tensor | None] | None:
        """The gradients by a replay, or ``None``: the caller runs the backward eagerly (NOTE [ Graphed recompute ]
        Rules 3, 6)."""
        key = self._key(call, saved, params, grads, need)
        if key is None or torch.cuda.is_current_stream_capturing():
            _STATS["eager"] += 1
            return None
        got = self.entries.get(key)
        if isinstance(got, _Entry):
            return got.replay(saved, grads, call.state)
        if got is None:
            if len(self.entries) >= MAX_KEYS:
                _STATS["eager"] += 1
                _STATS["eager_keys"] += 1
                if not self.warned:
                    self.warned = True
                    warnings.warn(
                        f"torchckpt: Recompute(graphed=True): a block was called with more than {MAX_KEYS} signatures "
                        "(shapes, layouts, arguments, parameter addresses); further ones recompute eagerly, the same "
                        "values at the host's cost. Keep the block's inputs and parameters the same from step to step.",
                        RuntimeWarning, stacklevel=4)
                return None
            self.entries[key] = 1
            _STATS["eager"] += 1
            return None
        if isinstance(got, str) or _OFF:
            _STATS["eager"] += 1
            return None
        entry = self._capture(call, saved, params, grads, need, key[0])
        if isinstance(entry, str):
            self.entries[key] = entry
            _STATS[entry] += 1
            _STATS["eager"] += 1
            return None
        self.entries[key] = entry[0]
        return entry[1]

    def _capture(self, call: Any, saved: tuple[torch.Tensor, ...], params: tuple[torch.Tensor, ...],
                 grads: tuple[torch.Tensor | None, ...], need: tuple[bool, ...],
                 index: int) -> tuple[_Entry, list[torch.Tensor | None]] | str:
        """NOTE [ Graphed recompute ] Rule 3's capture: the entry and this backward's gradients (the replay's), or why
        the signature stays eager."""
        mod = self.module()
        if mod is None:
            return "module gone"
        if not all(_dense(t) for t in saved) or not all(g is None or _dense(g) for g in grads):
            return "eager: a tensor not dense"
        if isinstance(call.fn, BufferGuard) and call.fn.written:  # NOTE [ Graphed recompute ] Rule 3
            return "eager: writes buffers its recomputation puts back (a replay would read the capture's copies)"
        dev = _DEVICES.get(index)
        if dev is None:
            dev = _DEVICES[index] = _Device(index)
        slots: Counter[tuple[Any, ...]] = Counter()

        def buffer(role: str, t: torch.Tensor) -> torch.Tensor:
            k = (role, t.shape, t.stride(), t.dtype)
            slots[k] += 1
            return dev.buffer(role, t, slots[k] - 1)

        args = [buffer("arg", t) for t in saved]
        ins = [None if g is None else buffer("grad", g) for g in grads]
        for b, t in zip(args, saved):
            b.copy_(t)
        for gb, g in zip(ins, grads):
            if gb is not None and g is not None:
                gb.copy_(g)
        allowed = _storages([*args, *ins, *params, *mod.parameters(), *mod.buffers()])
        cur = torch.cuda.current_stream(index)
        s = dev.stream
        s.wait_stream(cur)
        try:
            with torch.cuda.stream(s):
                reads = _Reads(allowed)
                with reads:  # the eager backward on the graph's buffers, watched (NOTE [ Graphed recompute ] Rule 3)
                    warm = _run(call, mod, args, saved, params, ins, need, rng=True)
                draws = None
                if reads.random is not None:  # NOTE [ Graphed recompute ] Rule 8
                    st = call.state
                    if not (st.preserve and st.had_device and index in st.devices):
                        return f"eager: random draws without the forward's generator state ({reads.random})"
                    draws = index
                if reads.sync is not None:
                    return f"eager: synchronises ({reads.sync})"
                far = reads.outside()
                if far:
                    return f"eager: reads tensors outside the call, its parameters and buffers (shapes {far[:3]})"
                if not all(w is None or _dense(w) for w in warm):
                    return "eager: a gradient not dense"
                outs = [None if w is None else buffer("out", w) for w in warm]
                graph = _record(call, mod, args, saved, params, ins, need, outs, dev)  # failed: kept in dev.kept
                if isinstance(graph, str):
                    return graph
        finally:
            cur.wait_stream(s)
        entry = _Entry(graph, args, ins, outs, draws)
        dev.entries.add(entry)
        _STATS["captures"] += 1
        rng = torch.cuda.get_rng_state(index)
        result = entry.replay(saved, grads, call.state)
        if not torch.equal(torch.cuda.get_rng_state(index), rng):  # the graph moved the generator: a draw after all
            torch.cuda.set_rng_state(rng, index)
            dev.kept.append(graph)
            return "eager: random draws (the replay moved the generator)"
        same = all((r is None and w is None) or (r is not None and w is not None and r.stride() == w.stride()
                                                   and torch.equal(r, w)) for r, w in zip(result, warm))
        for w in warm:
            if w is not None:
                w.record_stream(cur)
        if not same:
            dev.kept.append(graph)
            return "eager: the replay differs from the eager run" + (" (random draws)" if draws is not None else "")
        return entry, result
