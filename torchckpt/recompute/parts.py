"""Recomputation in parts: a block's saved tensors recomputed one part at a time in backward (issue 13).

``Recompute()`` recomputes a block whole: every tensor it saves comes back at once and stays until
the block's backward ends. ``Recompute(parts=...)`` cuts the saved tensors into consecutive parts
and recomputes the block once per part, from the back, so that only one part is held at a time;
the block's early ops run more than once. This is the mechanism, a non-reentrant checkpoint of
its own (``torch.utils.checkpoint`` can neither keep a subset of what it recomputes nor recompute
a block twice in one backward).

# NOTE [ Recompute in parts ]
# 1. Cuts are positions in the order the block's forward saves tensors for backward (0 first,
#    parameters and inputs counted, as ``Offload(tensors=...)`` numbers them). Cuts
#    ``(c1, ..., ck)`` make the parts ``[0, c1), [c1, c2), ..., [ck, N)``. ``Recompute`` checks
#    them (increasing ints > 0, ``check_parts``); each forward checks ``ck < N`` at its end, so
#    that every part holds a tensor (a forward that saves nothing, as with frozen weights and
#    inputs that need no grad, is exempt: there is nothing to recompute).
# 2. Forward: the block's tensor inputs (positional and keyword, at any depth a pytree reaches)
#    are saved by a no-op autograd Function, under the hooks around the call (the policy's store:
#    ``api.run``); non-tensor inputs are held as they are. Under this module's saved-tensor hooks,
#    each tensor the block saves is packed as a *holder*, its position, and nothing else: the
#    forward keeps none of them. The CPU RNG state, the RNG states of the inputs' devices, the
#    autocast state and the device context (``with torch.device(...)``) are captured, as
#    ``torch.utils.checkpoint`` captures them.
# 3. Backward: the first unpack of a holder of part p (in this backward) recomputes part p:
#    the block runs again from its start, on its saved inputs, under the captured RNG,
#    autocast and device state, with grad enabled, under recomputation hooks that count the
#    tensors it saves. The holders of part p that are alive take their recomputed tensor
#    (detached, as torch's checkpoint detaches them); every other tensor is dropped as soon as
#    it is packed: the recomputation's own graph holds a placeholder for it, not the tensor. When
#    the last tensor of part p is packed, an exception stops the recomputation (early stop; the
#    last part's recomputation stops at the block's last saved tensor too). So the recomputed
#    tensors alive at a time are one part's, plus what the block's Python frame holds while it
#    runs (released by the stop). Backward unpacks the last part first: the block runs once per
#    part, the last part's run the longest.
# 4. Each tensor the recomputation saves is checked against the forward's at its position
#    (shape, dtype, device; ``determinism_check="none"`` skips it), and a recomputation that
#    returns before it reaches its part's last tensor saved fewer: both raise ``CheckpointError``
#    (with ``debug=True``, listing the ops of both runs).
# 5. A recomputed tensor is released at its unpack: autograd unpacks each saved tensor once per
#    backward, so this is its last use (torch's checkpoint releases at unpack too, NOTE
#    [ Nestable Checkpoint ] Rule 4). One whose holder dies unused (a backward that reaches only
#    some of the block's inputs) is released with it. A holder unpacked twice in one backward (a
#    custom Function reading ``ctx.saved_tensors`` twice) raises.
# 6. The inputs come from the no-op Function once per backward (one unpack through the store,
#    or through an enclosing checkpoint, which allows one unpack per backward) and are held
#    while some live holder of the block has not been recomputed in that backward.
# 7. ``save=`` (NOTE [ Selective recompute ]): the forward's ``_Keeping`` and every
#    recomputation's ``_Handing`` count ops as NOTE [ Selective recompute ] Rule 1, and each pack records how many ops
#    had run (``K`` of a position), so part p's recomputation runs the ops before ``K`` of its
#    last position, ``K_p``. A kept output of op k is handed back to every recomputation that
#    runs op k (not popped, as a whole recomputation pops it), and released once every part with
#    ``K_p > k`` has been recomputed in the backward: after the last recomputation that needs
#    it. Kept outputs of ops at or after ``K`` of the last part are released at the forward's
#    end (no recomputation reaches them). A second backward (``retain_graph=True``) then finds
#    them gone and raises, as ``Recompute(save=...)`` does.
# 8. A backward is the graph task (or the ``torch.utils.checkpoint.GraphExecGroup``) that
#    unpacks: a second backward through a retained graph recomputes the parts again, as torch's
#    checkpoint does. An unpack outside any backward (reading ``grad_fn._saved_self``)
#    recomputes that holder's part for that one tensor.
# 9. Nesting, as NOTE [ Nestable Checkpoint ] Rules 1-3: a checkpoint inside the block (torch's,
#    ``Recompute()``, ``Recompute(parts=...)``) saves its inputs under this block's hooks, so its
#    recomputation asks this block for them; this block's recomputation runs inner checkpoints as
#    forwards (their frames are dropped with the recomputation). Backward through the block's
#    saved tensors while its forward or a recomputation runs (``torch.autograd.grad`` inside the
#    block, NOTE [ Nestable Checkpoint ] Rule 6) is not supported and raises.
# 10. Measuring (``measure()``): each block call's ``PartsStats`` counts its recomputations and the
#    bytes of recomputed tensors it holds (each storage once; tensors that share an input's, a
#    parameter's or a kept output's storage cost nothing), and their peak.
# 11. Cut between autograd nodes. A node unpacks all it saved when its backward runs (attention:
#    q, k, v, its output, its log-sum-exp), so a cut among one node's tensors makes backward
#    recompute the earlier part while the later part's tensors of that node are still held: the
#    peak is then the earlier part plus those, above the largest part. ``PartsStats.nodes``
#    numbers the node that saved each tensor (saves made while one node is built, as
#    NOTE [ Saved tensor identity ] Rule 2b tells them apart). With cuts where it changes, and a
#    backward that runs the block's nodes in the reverse of their order (a chain with residuals,
#    as a transformer block's, on one device), the recomputed bytes alive at once are the
#    largest part's.
# 12. Under ``torch.compile`` (Dynamo tracing), ``api.run`` hands the block to
#    ``torch.utils.checkpoint`` instead, recomputed whole: Dynamo makes that a checkpoint region.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchckpt._args import part_bytes
from torchckpt._errors import CheckpointError, internal_error
from torchckpt.codecs.base import Codec
from torchckpt.recompute.forward_state import ForwardState
from torchckpt.store.identity import storage_ptrs
from torchckpt.store.saved import Store
from torchckpt.recompute.selective import OpCounter, _Keeping, _Reusing

__all__ = ["PartsMeter", "PartsStats", "check_parts", "measure", "part_bytes", "run_in_parts"]

_ORDER = "positions in the order the block's forward saves tensors for backward (0 first, parameters counted)"


def check_parts(owner: str, parts: object) -> tuple[int, ...] | None:
    """``parts`` as increasing positions > 0, or ``None``; a ``torchckpt:`` error otherwise
    (NOTE [ Recompute in parts ] Rule 1)."""
    if parts is None:
        return None
    fix = "pass e.g. parts=(12, 24) for three parts, or parts=None to recompute the block whole"
    items = list(parts) if isinstance(parts, Iterable) and not isinstance(parts, (str, bytes)) else None
    if items is None or any(isinstance(c, bool) or not isinstance(c, int) for c in items):
        raise TypeError(f"torchckpt: {owner}(parts=...) expects cuts: {_ORDER}, as ints; got {parts!r}; {fix}.")
    if isinstance(parts, (set, frozenset)):
        items.sort()
    if any(c <= 0 for c in items):
        raise ValueError(f"torchckpt: {owner}(parts=...) expects cuts > 0 (a cut at 0 leaves the first part empty), "
                         f"got {parts!r}; {fix}.")
    if any(a >= b for a, b in zip(items, items[1:])):
        raise ValueError(f"torchckpt: {owner}(parts=...) expects increasing cuts (sorted, each once), got {parts!r}; "
                         f"pass parts={tuple(sorted(set(items)))!r}.")
    return tuple(items)


# -- measuring (NOTE [ Recompute in parts ] Rule 10) -----------------------------------------------
@dataclasses.dataclass(eq=False)
class PartsStats:
    """One call of a block under ``Recompute(parts=...)``: what its backward recomputed
    (NOTE [ Recompute in parts ] Rule 10).

    ``sizes``: per saved tensor (pack order), the bytes of new memory a recomputation makes for it:
    its storage's size where it is the first tensor of its part with that storage, 0 where it shares
    an input's, a parameter's or a kept output's storage or an earlier tensor's of its part.
    ``nodes``: per saved tensor, the ordinal of the autograd node that saved it (0 for the first):
    cut where it changes (NOTE [ Recompute in parts ] Rule 11).
    """

    cuts: tuple[int, ...]
    sizes: list[int] = dataclasses.field(default_factory=list)
    nodes: list[int] = dataclasses.field(default_factory=list)  # per saved tensor: the autograd node saving it (NOTE [ Recompute in parts ] Rule 11)
    recomputations: int = 0
    live_bytes: int = 0
    peak_bytes: int = 0
    kept: int = 0  # outputs kept by save= still held (NOTE [ Recompute in parts ] Rule 7)
    meters: tuple[PartsMeter, ...] = ()

    @property
    def part_bytes(self) -> list[int]:
        """Bytes of each part (``part_bytes(sizes, cuts)``): the most that should be alive at once is their largest."""
        return part_bytes(self.sizes, self.cuts) if self.sizes else []

    def _add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        for m in self.meters:
            m.live_bytes += nbytes
            m.peak_bytes = max(m.peak_bytes, m.live_bytes)


@dataclasses.dataclass(eq=False)
class PartsMeter:
    """The ``PartsStats`` of the block calls made under ``measure()``, and their recomputed bytes together."""

    blocks: list[PartsStats] = dataclasses.field(default_factory=list)
    live_bytes: int = 0
    peak_bytes: int = 0

    @property
    def recomputations(self) -> int:
        return sum(b.recomputations for b in self.blocks)


_meters = threading.local()


@contextlib.contextmanager
def measure() -> Iterator[PartsMeter]:
    """Count what blocks under ``Recompute(parts=...)`` called inside recompute in their backward
    (NOTE [ Recompute in parts ] Rule 10).

    The blocks' forwards run inside; their backward may run later, anywhere.

    Example::

        >>> import torchckpt
        >>> from torchckpt.recompute import parts
        >>> x = torch.randn(64, 64, requires_grad=True)
        >>> f = lambda x: x.exp().tanh()  # each saves its result: 16 KiB each
        >>> with parts.measure() as m:
        ...     y = torchckpt.checkpoint(f, x, policy=torchckpt.Recompute(parts=(1,)))
        >>> y.sum().backward()
        >>> m.recomputations, m.blocks[0].part_bytes, m.peak_bytes
        (2, [16384, 16384], 16384)
    """
    m = PartsMeter()
    stack = _meters.__dict__.setdefault("stack", [])
    stack.append(m)
    try:
        yield m
    finally:
        stack.remove(m)


def _new_stats(cuts: tuple[int, ...]) -> PartsStats:
    meters = tuple(getattr(_meters, "stack", ()))
    s = PartsStats(cuts, meters=meters)
    for m in meters:
        m.blocks.append(s)
    return s


# -- the mechanism -------------------------------------------------------------------------------
class _Stop(Exception):
    """NOTE [ Recompute in parts ] Rule 3: the recomputation has packed the last tensor of its part."""


class _Holder:
    """What the forward packs for a saved tensor: its position (NOTE [ Recompute in parts ] Rule 2)."""

    __slots__ = ("i", "__weakref__")

    def __init__(self, i: int) -> None:
        self.i = i


class _Dropped:
    """What a recomputation's own graph holds for each tensor it saves (NOTE [ Recompute in parts ] Rule 3)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<dropped by Recompute(parts=...)>"


_DROPPED = _Dropped()
_NESTED_BACKWARD = (
    "torchckpt: backward through the saved tensors of a block under Recompute(parts=...) while its forward or a "
    "recomputation of it runs (torch.autograd.grad inside the block) is not supported; run this block under "
    "Recompute() (torch.utils.checkpoint supports it), or take the gradient outside the block.")


class _SaveInputs(torch.autograd.Function):
    """Saves the block's tensor inputs for its recomputations (NOTE [ Recompute in parts ] Rule 2); its output is never
    differentiated."""

    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(*tensors)
        return torch.empty((0,))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - its output enters no loss
        raise internal_error("backward reached the input saver of a Recompute(parts=...) block")


class _Handing(_Reusing):
    """The recomputation's mode with ``save=``: kept outputs handed back, not popped
    (NOTE [ Recompute in parts ] Rule 7)."""

    def __init__(self, cache: dict[int, Any], kept: set[int], store: Store | None) -> None:
        super().__init__(cache, kept, store)
        self.handed: set[int] = set()  # storages handed back in this recomputation (not recomputed: NOTE [ Recompute in parts ] Rule 10)

    def take(self, k: int) -> tuple[Any, Any]:
        return self.cache[k]  # type: ignore[no-any-return]

    def get(self, x: Any) -> Any:
        t = super().get(x)
        if isinstance(t, torch.Tensor):
            self.handed.add(_ptr(t))
        return t


class _OpLog(OpCounter):
    """``debug=True``: the ops of one run, as NOTE [ Selective recompute ] Rule 1 counts them
    (NOTE [ Recompute in parts ] Rule 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __enter__(self) -> _OpLog:
        self.ops = []
        self.k = 0
        return super().__enter__()  # type: ignore[no-any-return]

    def op(self, k: int, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        self.ops.append(str(func))
        return func(*args, **kwargs)


def _ptr(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # no storage (sparse, functorch wrappers): never counted
        return 0


def _by_reference(t: torch.Tensor, ptr: int, external: set[int] | frozenset[int]) -> bool:
    """Whether ``t`` costs no memory of its own (NOTE [ Recompute in parts ] Rule 10): no storage, a leaf that requires
    grad (a parameter) or a view of one, or the storage of an input, of a module tensor or of a kept output."""
    if ptr == 0 or ptr in external:
        return True
    if t.requires_grad and t.is_leaf:
        return True
    b = t._base
    return b is not None and b.requires_grad and b.is_leaf


_exec_group: Callable[[], Any] = getattr(torch._C, "_get_graph_exec_group", lambda: None)
_next_node: Callable[[], int] | None = getattr(torch._C._autograd, "_get_sequence_nr", None)


def _backward_id() -> tuple[Any, bool]:
    """The backward an unpack belongs to (NOTE [ Recompute in parts ] Rule 8) and whether it is one (False: an unpack
    outside backward)."""
    group = _exec_group()
    if group is not None:
        return group, True
    gid = torch._C._current_graph_task_id()
    return (object(), False) if gid == -1 else (gid, True)


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.dtype, t.device


def _holder_died(frame_ref: weakref.ReferenceType[_Frame], i: int, _: Any) -> None:
    frame = frame_ref()
    if frame is not None:
        frame.forget(i)


class _Frame:
    """One call of a block under ``Recompute(parts=...)``: what its recomputations need
    (NOTE [ Recompute in parts ] Rules 2-8)."""

    def __init__(self, fn: Callable[..., Any], cuts: tuple[int, ...], flat: list[Any], spec: Any,
                 tensor_at: list[int], check: bool, debug: bool, keeping: _Keeping | None,
                 handing: _Handing | None, keep_ptrs: frozenset[int], preserve_rng_state: bool) -> None:
        self.fn, self.cuts = fn, cuts
        self.leaves = [None if isinstance(x, torch.Tensor) else x for x in flat]
        self.spec, self.tensor_at = spec, tensor_at
        self.check = check
        self.keeping, self.handing = keeping, handing
        self.keep_ptrs = keep_ptrs
        self.external = keep_ptrs | storage_ptrs(x for x in flat if isinstance(x, torch.Tensor))  # NOTE [ Recompute in parts ] Rule 10
        self.fwd_log: _OpLog | None = _OpLog() if debug else None
        self.rec_log: _OpLog | None = _OpLog() if debug else None
        self.saver: torch.Tensor | None = None
        self.holders: list[weakref.ReferenceType[_Holder]] = []
        self.metas: list[tuple[Any, ...]] = []
        self.ops_at: list[int] = []  # ops run when each tensor was packed (NOTE [ Recompute in parts ] Rule 7)
        self.seen: dict[tuple[int, int], StorageWeakRef] = {}  # (part, storage address) saved in the forward
        self.last_node = -1
        self.bounds: list[tuple[int, int]] = []
        self.ops_to: list[int] = []  # per part: K of its last position (NOTE [ Recompute in parts ] Rule 7)
        self.completed = False
        self.inputs: dict[Any, tuple[tuple[Any, ...], dict[str, Any]]] = {}  # NOTE [ Recompute in parts ] Rule 6
        self.vals: dict[Any, dict[int, torch.Tensor]] = {}  # per backward: recomputed, not yet unpacked
        self.used: dict[Any, set[int]] = {}  # per backward: positions unpacked
        self.done: dict[Any, set[int]] = {}  # per backward: parts recomputed
        self.held: dict[tuple[Any, int], int] = {}  # (backward, position) -> storage it holds (0: by reference)
        self.refs: dict[int, list[int]] = {}  # storage -> [holds, bytes]
        self.stats = _new_stats(cuts)
        self.preserve = preserve_rng_state
        self.fwd: ForwardState | None = None

    # -- forward (NOTE [ Recompute in parts ] Rule 2) ------------------------------------------------
    def capture(self, tensors: list[torch.Tensor]) -> None:
        self.fwd = ForwardState(tensors, self.preserve)

    def pack(self, t: torch.Tensor) -> _Holder:
        i = len(self.holders)
        h = _Holder(i)
        self.holders.append(weakref.ref(h, functools.partial(_holder_died, weakref.ref(self), i)))
        if self.check:
            self.metas.append(_meta(t))
        self.ops_at.append(self.keeping.k if self.keeping is not None else 0)
        node = _next_node() if _next_node is not None else i  # the node being built (NOTE [ Recompute in parts ] Rule 11)
        nodes = self.stats.nodes
        nodes.append(0 if i == 0 else nodes[-1] + (node != self.last_node))
        self.last_node = node
        ptr = _ptr(t)
        kept = self.keeping.where.keys() if self.keeping is not None else ()
        nbytes = 0
        if not (_by_reference(t, ptr, self.external) or ptr in kept):
            key = (bisect.bisect_right(self.cuts, i), ptr)
            prev = self.seen.get(key)
            if prev is None or prev.expired():  # a live storage at this address is the same storage
                self.seen[key] = StorageWeakRef(t.untyped_storage())
                nbytes = t.untyped_storage().nbytes()
        self.stats.sizes.append(nbytes)
        return h

    def finish(self) -> None:
        """The forward's end: check the cuts (NOTE [ Recompute in parts ] Rule 1); the parts' bounds and their ``K``
        (NOTE [ Recompute in parts ] Rule 7)."""
        n = len(self.holders)
        self.completed = True
        self.seen, self.external = {}, frozenset()
        if n == 0:
            return
        if self.cuts and self.cuts[-1] >= n:
            raise ValueError(
                f"torchckpt: Recompute(parts={self.cuts!r}) cuts this block's saved tensors at {self.cuts[-1]}, but its "
                f"forward saves {n} tensors (positions 0 to {n - 1}): every cut must be below {n} so that each part "
                f"holds a tensor; pass cuts from the block's profile (torchckpt.plan), e.g. parts=({max(1, n // 2)},).")
        edges = [0, *self.cuts, n]
        self.bounds = list(zip(edges, edges[1:]))
        self.ops_to = [self.ops_at[hi - 1] for _, hi in self.bounds]
        if self.handing is not None:  # NOTE [ Recompute in parts ] Rule 7: no recomputation reaches these
            for k in [k for k in self.handing.cache if k >= self.ops_to[-1]]:
                del self.handing.cache[k]
            self.stats.kept = len(self.handing.cache)

    # -- backward (NOTE [ Recompute in parts ] Rules 3-8) ----------------------------------------------
    def unpack(self, h: _Holder) -> torch.Tensor:
        if not self.completed:
            raise CheckpointError(_NESTED_BACKWARD)
        g, in_backward = _backward_id()
        i = h.i
        used = self.used.setdefault(g, set())
        if i in used:
            raise CheckpointError(
                f"torchckpt: saved tensor {i} of a block under Recompute(parts=...) was unpacked twice in one backward "
                "(a custom Function reading ctx.saved_tensors twice, or two backward calls over the same tensors in one "
                "torch.utils.checkpoint.GraphExecGroup); read saved tensors once per backward.")
        vals = self.vals.get(g)
        if vals is None or i not in vals:
            self.recompute(bisect.bisect_right(self.cuts, i), g, None if in_backward else i)
            vals = self.vals.get(g)
            if vals is None or i not in vals:
                raise internal_error(f"the recomputation of a part did not produce saved tensor {i}")
        t = vals.pop(i)
        used.add(i)
        self.let_go(g, i)
        if not in_backward:
            self.forget_backward(g)
        return t

    def recompute(self, p: int, g: Any, only: int | None) -> None:
        """NOTE [ Recompute in parts ] Rule 3: run the block from its start until part ``p``'s last tensor is packed,
        keeping that part."""
        lo, hi = self.bounds[p]
        args, kwargs = self.args(g)
        external = set(self.keep_ptrs) | storage_ptrs(
            x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor))
        vals = self.vals.setdefault(g, {})
        used = self.used.setdefault(g, set())
        if self.handing is not None:
            self.handing.handed = set()
        count = 0

        def pack(t: torch.Tensor) -> _Dropped:
            nonlocal count
            k = count
            count += 1
            if self.check and k < len(self.metas) and _meta(t) != self.metas[k]:
                raise self.mismatch(
                    f"saved tensor {k} with (shape, dtype, device) {_meta(t)}, where the forward saved {self.metas[k]}")
            if lo <= k < hi and (only is None or k == only) and k not in used and k not in vals:
                h = self.holders[k]()
                if h is not None:
                    self.hold(g, k, t.detach() if t.requires_grad else t, external)
            if k == hi - 1:
                raise _Stop
            return _DROPPED

        def unpack(_: Any) -> torch.Tensor:
            raise CheckpointError(_NESTED_BACKWARD)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack), torch.enable_grad():
                self.replay(args, kwargs)
        except _Stop:
            pass
        else:
            raise self.mismatch(f"{count} tensors before the block's forward returned, where the forward saved "
                                f"{len(self.holders)} (part {p} ends at tensor {hi - 1})")
        self.stats.recomputations += 1
        self.done.setdefault(g, set()).add(p)
        self.release_kept(g)
        if not any(h() is not None and k not in used and k not in vals for k, h in enumerate(self.holders)):
            self.inputs.pop(g, None)  # NOTE [ Recompute in parts ] Rule 6: no part is left to recompute in this backward

    def replay(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Run the block again under the forward's RNG, autocast and device state
        (NOTE [ Recompute in parts ] Rule 3)."""
        assert self.fwd is not None
        with self.fwd.replayed(), self.handing or contextlib.nullcontext(), self.rec_log or contextlib.nullcontext():
            self.fn(*args, **kwargs)

    def mismatch(self, what: str) -> CheckpointError:
        """NOTE [ Recompute in parts ] Rule 4's error."""
        msg = (f"torchckpt: recomputing a block under Recompute(parts=...) saved {what}: the block's forward is not "
               "deterministic (another branch taken, another shape), so its saved tensors cannot be recomputed. Make "
               "it deterministic, or keep this block's tensors (Keep(), Offload(store)).")
        if self.fwd_log is not None and self.rec_log is not None:
            a, b = self.fwd_log.ops, self.rec_log.ops
            first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            msg += (f"\nOps of the forward from {first} on: {a[first:first + 20]}"
                    f"\nOps of the recomputation from {first} on: {b[first:first + 20]}")
        else:
            msg += " Pass Recompute(debug=True) to list the ops of both runs."
        return CheckpointError(msg)

    def args(self, g: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The block's inputs, fetched once per backward (NOTE [ Recompute in parts ] Rule 6)."""
        got = self.inputs.get(g)
        if got is None:
            assert self.saver is not None and self.saver.grad_fn is not None
            leaves = list(self.leaves)
            for j, t in zip(self.tensor_at, self.saver.grad_fn.saved_tensors):  # type: ignore[attr-defined]
                leaves[j] = t
            args, kwargs = tree_unflatten(leaves, self.spec)
            got = self.inputs[g] = (tuple(args), dict(kwargs))
        return got

    def release_kept(self, g: Any) -> None:
        """NOTE [ Recompute in parts ] Rule 7: drop the kept outputs no part left to recompute in this backward runs."""
        if self.handing is None:
            return
        done = self.done[g]
        for k in list(self.handing.cache):
            first = bisect.bisect_right(self.ops_to, k)  # the earliest part whose recomputation runs op k
            if all(q in done for q in range(first, len(self.bounds))):
                del self.handing.cache[k]
        self.stats.kept = len(self.handing.cache)

    # -- what is held (NOTE [ Recompute in parts ] Rules 5, 10) ----------------------------------------
    def hold(self, g: Any, i: int, t: torch.Tensor, external: set[int]) -> None:
        self.vals.setdefault(g, {})[i] = t
        ptr = _ptr(t)
        handed = self.handing.handed if self.handing is not None else ()
        if _by_reference(t, ptr, external) or ptr in handed:
            ptr = 0
        self.held[(g, i)] = ptr
        if ptr:
            ref = self.refs.get(ptr)
            if ref is None:
                ref = self.refs[ptr] = [0, t.untyped_storage().nbytes()]
                self.stats._add(ref[1])
            ref[0] += 1

    def let_go(self, g: Any, i: int) -> None:
        ptr = self.held.pop((g, i), 0)
        ref = self.refs.get(ptr) if ptr else None
        if ref is not None:
            ref[0] -= 1
            if ref[0] == 0:
                del self.refs[ptr]
                self.stats._add(-ref[1])

    def forget(self, i: int) -> None:
        """NOTE [ Recompute in parts ] Rule 5: holder ``i`` died (its graph was freed): release what was recomputed for it."""
        for g, vals in list(self.vals.items()):
            if vals.pop(i, None) is not None:
                self.let_go(g, i)

    def forget_backward(self, g: Any) -> None:
        """NOTE [ Recompute in parts ] Rule 8: an unpack outside backward leaves nothing behind."""
        for i in list(self.vals.pop(g, {})):
            self.let_go(g, i)
        for d in (self.used, self.done, self.inputs):
            d.pop(g, None)


class _Hooks(torch.autograd.graph.saved_tensors_hooks):
    """The forward's hooks (NOTE [ Recompute in parts ] Rule 2)."""

    def __init__(self, frame: _Frame) -> None:
        super().__init__(frame.pack, frame.unpack)


def run_in_parts(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, cuts: tuple[int, ...],
                 save: frozenset[Any] | None = None, store: Store | None = None, codec: Codec | None = None,
                 preserve_rng_state: bool = True, determinism_check: str = "default", debug: bool = False,
                 keep: Iterable[torch.Tensor] = ()) -> Any:
    """Call ``fn(*args, **kwargs)`` so that its backward recomputes its saved tensors in parts (NOTE [ Recompute in
    parts ]); ``api.run`` calls it for ``Recompute(parts=...)``, with the policy's store hooks around it.

    Args:
        fn: the block.
        cuts: the cuts (NOTE [ Recompute in parts ] Rule 1), checked by ``check_parts``.
        save: ops whose outputs are kept from the forward (NOTE [ Selective recompute ]).
        store: where the kept outputs go (``None``: kept by reference).
        codec: compresses the kept outputs on their way through ``store``.
        preserve_rng_state: restore the RNG states before each recomputation.
        determinism_check: ``"default"`` or ``"none"`` (NOTE [ Recompute in parts ] Rule 4).
        debug: list the ops of both runs in a determinism error.
        keep: tensors whose storages a recomputation does not make (the module's parameters and buffers).

    Returns:
        What ``fn`` returns.
    """
    flat, spec = tree_flatten((args, kwargs))
    tensor_at = [j for j, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    tensors = [flat[j] for j in tensor_at]
    keeping = handing = None
    if save is not None:
        cache: dict[int, Any] = {}
        kept: set[int] = set()
        keeping, handing = _Keeping(save, cache, kept, store, codec), _Handing(cache, kept, store)
    frame = _Frame(fn, cuts, flat, spec, tensor_at, determinism_check != "none", debug, keeping, handing,
                   storage_ptrs(keep), preserve_rng_state)
    frame.capture(tensors)
    frame.saver = _SaveInputs.apply(torch.empty((0,), requires_grad=True), *tensors)
    if frame.saver.grad_fn is None:  # grad disabled: nothing will be saved
        return fn(*args, **kwargs)
    with _Hooks(frame), keeping or contextlib.nullcontext(), frame.fwd_log or contextlib.nullcontext():
        out = fn(*args, **kwargs)
    frame.finish()
    fwd = frame.fwd
    assert fwd is not None
    if fwd.preserve and not fwd.had_device and getattr(getattr(torch, fwd.device_type, None), "_initialized",
                                                           False):
        raise CheckpointError(
            f"torchckpt: the block's forward initialised {fwd.device_type} under Recompute(parts=...) with "
            "preserve_rng_state=True, so its RNG state could not be saved for the recomputation; initialise it before "
            "(e.g. torch.cuda.init()), or pass preserve_rng_state=False if the block draws no random numbers there.")
    return out
