"""What autograd saved: which tensors can move, how their identity and version are checked.

# NOTE [ Saved tensor identity ]
# A saved tensor must come back as autograd saved it: same values, same metadata bits, same
# version check. Saved-tensor hooks take three things off autograd's hands, and these rules
# give them back.
# 1. Version check. Plain autograd raises at unpack when a saved tensor was modified in place
#    after it was saved. With hooks set, ``SavedVariable::unpack`` skips that check, so the
#    store checks itself: every saved tensor, moved or kept by reference, carries its version
#    at save time and a *version alias*, a tensor that shares the saved tensor's version
#    counter but none of its memory (``detach()`` shares the counter; assigning ``.data``
#    swaps the storage for an empty one and keeps the counter). Unpack raises autograd's own
#    error (same type, same text) when the counter moved, whether the entry is resident,
#    evicted or compressed.
# 2. Sharing an entry. Two saves may share one copy only if they are provably the same bytes
#    at the same moment: the same storage, the same version counter, the same version, and
#    bytes that nothing can have written in between unseen.
#    a. A storage alone is not enough: ``unsafe_chunk`` and ``unsafe_split`` (ATen's LSTM and
#       GRU cells split their gates with them), ``.data`` and ``set_`` make tensors that share
#       a storage but count versions independently, so two of them can sit at the same version
#       while one was written in between. The counter is identified by the *family root*: a
#       view shares its counter with its ``_base`` (the root of the view chain), a tensor that
#       is not a view is its own root. The root is held by weak reference; PyTorch keeps a
#       tensor's Python object for as long as the tensor lives, so a live weak reference names
#       one counter. Different roots never share an entry, even when they do share a counter
#       (``detach()``): a lost deduplication, never a wrong value.
#    b. A counter alone is not enough either: a write through ``.data`` (torchdiffeq's
#       Runge-Kutta step fills its stage buffer ``k`` with ``k.data[..., i] = f`` and saves
#       ``k[..., :i + 1]`` after each write) moves no counter. An entry copies a whole storage,
#       so a later save of bytes its creator did not read may find them changed. A later save
#       shares the entry only if (``Coverage.admits``) it is made while the same autograd node
#       is being built (the same thread and the same next sequence number: no op ran in
#       between, as when ``scaled_dot_product_attention`` saves q, k and v of one ``unbind``),
#       or its bytes lie within the creator's own elements (the same view, or inside a
#       creator that covers its byte range densely). Bytes a saved tensor reads are its own:
#       writing them after the save, even unseen, changes plain autograd's result as well.
#    c. A later save that b does not admit still shares the entry while the entry's GPU copy
#       is the live storage (resident since its save, uncompressed, not on disk): until it is
#       evicted, unpack reads that storage as plain autograd does, and an entry already copied
#       to host is copied again after this save, into the same host block (the offload stream
#       runs copies in order), so that the host copy holds every sharer's bytes as of its save
#       (the earlier saves' bytes are their own, so the later copy serves them too). From the
#       second step on, an entry the plan will write that had such shares in the last step is
#       written at its last share instead of at its save (written at its eviction should that
#       come first), so its storage crosses the link once. Without
#       it two halves of one storage saved by different nodes took two whole-storage entries
#       (Mixtral's experts: SiLU saves the gate half of the fused gate/up projection, the
#       product saves the up half): twice the storage in the GPU cache and over the link, so
#       the cache evicted what the planner's step model (one storage, one size) kept resident.
# 3. Metadata. Unpack rebuilds dtype, size, stride and storage offset from the handle, then
#    the bits that change values: ``_neg_view()`` for the neg bit, ``conj()`` for the conj bit
#    (complex models, FFT layers). The rebuilt tensor has a fresh version counter: Rule 1
#    checks the original one.
# 4. What stays by reference, and why (``keep_reason``): tensors that moving would not free
#    or cannot move. Leaves that require grad, parameters and views of them; tensors on
#    another device; non-strided layouts, quantized and nested tensors, zero tensors (forward
#    AD), tensor subclasses and functorch's wrappers (``torch.func`` transforms: their storage
#    is not accessible), and tensors under ``min_bytes``.
# 5. What a pack hook returns never holds the saved tensor's graph. Autograd keeps the packed
#    value inside the ``grad_fn`` that saved it; a packed value that holds an op's output (tanh,
#    GELU and softmax save their outputs), or a view of one through ``_base``, holds that
#    ``grad_fn`` in turn: a reference cycle through C++ that Python's collector cannot see, so
#    a graph never followed by a backward (evaluation with grad enabled, a dropped loss, an
#    exception) is never freed. A tensor kept by reference is therefore held ``detach()``ed
#    (same storage, same version counter, same metadata bits, no ``grad_fn``, no ``_base``);
#    autograd re-attaches the graph at unpack itself (``SavedVariable::unpack`` builds the
#    variable from the data with its own edge). The name and output number of the op that
#    made it are kept for Rule 1's error. functorch's wrappers stay as they are.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

_is_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
_is_batched = getattr(getattr(torch._C, "_functorch", None), "is_batchedtensor", lambda t: False)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def keep_reason(t: torch.Tensor, device: torch.device, min_bytes: int) -> str | None:
    """Why ``t`` must stay by reference (NOTE [ Saved tensor identity ] Rule 4), or ``None`` if the store may move it."""
    if type(t) not in _PLAIN:
        return "subclass"
    if _is_functorch_wrapped is not None and (_is_functorch_wrapped(t) or _is_batched(t)):
        return "functorch"
    if t.device != device:
        return "device"
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        return "layout"
    if t._is_zerotensor():
        return "zerotensor"
    if t.numel() * t.element_size() < max(min_bytes, 1):
        return "small"
    if isinstance(t, torch.nn.Parameter) or (t.requires_grad and t.is_leaf):
        return "leaf"
    b = t._base
    if b is not None and (isinstance(b, torch.nn.Parameter) or (b.requires_grad and b.is_leaf)):
        return "leaf"
    return None


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    """The data pointers of the storages of ``tensors`` that have one (functorch's wrappers do not)."""
    ptrs = set()
    for t in tensors:
        if _is_functorch_wrapped is not None and (_is_functorch_wrapped(t) or _is_batched(t)):
            continue
        ptrs.add(t.untyped_storage().data_ptr())
    return frozenset(ptrs)


_next_node = getattr(torch._C._autograd, "_get_sequence_nr", None)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its byte range exactly (no gaps, no overlap)."""
    expect = 1
    for size, stride in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n != 1), key=lambda p: p[1]):
        if stride != expect:
            return False
        expect *= size
    return True


class Coverage:
    """What a shared entry's creator guarantees about the bytes a later save reads
    (NOTE [ Saved tensor identity ] Rule 2b)."""

    __slots__ = ("moment", "geometry", "lo", "hi")

    def __init__(self, t: torch.Tensor, lo: int, span: int) -> None:
        self.moment = _moment()
        self.geometry = (t.storage_offset(), t.shape, t.stride(), t.element_size())
        self.lo, self.hi = (lo, lo + span) if _dense(t) else (0, -1)

    def admits(self, t: torch.Tensor, lo: int, span: int) -> bool:
        """Whether a save of ``t`` (bytes ``lo`` to ``lo + span``) may share the creator's entry."""
        if self.lo <= lo and lo + span <= self.hi:
            return True
        if self.moment is not None and self.moment == _moment():
            return True
        return self.geometry == (t.storage_offset(), t.shape, t.stride(), t.element_size())


class LiveShares:
    """NOTE [ Saved tensor identity ] Rule 2c's bookkeeping in a store: the shares made per entry id this step and
    the last, and the entries whose write waits for their last share."""

    __slots__ = ("now", "last", "deferred")

    def __init__(self) -> None:
        self.now: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.deferred: set[int] = set()

    def step(self) -> None:
        """A new step: this step's shares become the last step's."""
        self.last, self.now, self.deferred = self.now, {}, set()

    def share(self, eid: int) -> bool:
        """Count a share of entry ``eid``; whether it is a deferred entry's last, as the last step had (then it is
        deferred no more: the caller writes it)."""
        n = self.now[eid] = self.now.get(eid, 0) + 1
        if eid in self.deferred and n >= self.last.get(eid, 0):
            self.deferred.discard(eid)
            return True
        return False


def _moment() -> tuple[int, int] | None:
    """The autograd node being built on this thread, as (thread, next sequence number)."""
    return None if _next_node is None else (threading.get_ident(), _next_node())


def family_root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose version counter ``t`` shares through views (NOTE [ Saved tensor identity ] Rule 2)."""
    b = t._base
    return t if b is None else b


def _modified(t: torch.Tensor, sizes: tuple[int, ...], grad_fn: str | None, output_nr: int, now: int,
              saved: int) -> RuntimeError:
    """Plain autograd's error for a saved tensor modified in place (the text of ``SavedVariable::unpack``)."""
    origin = "" if grad_fn is None else f", which is output {output_nr} of {grad_fn},"
    hint = (
        " Hint: the backtrace further above shows the operation that failed to compute its gradient. "
        "The variable in question was changed in there or anywhere later. Good luck!"
        if torch.is_anomaly_enabled() else
        " Hint: enable anomaly detection to find the operation that failed to compute its gradient, "
        "with torch.autograd.set_detect_anomaly(True, check_nan=False)."
    )
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{t.type()} [{', '.join(map(str, sizes))}]]{origin} is at version {now}; "
        f"expected version {saved} instead.{hint}"
    )


def _origin(t: torch.Tensor) -> str | None:
    gf = t.grad_fn
    return None if gf is None else type(gf).__name__


class Version:
    """A saved tensor's version at save time and a memory-free alias of its counter
    (NOTE [ Saved tensor identity ] Rule 1)."""

    __slots__ = ("alias", "saved", "grad_fn", "output_nr", "sizes")

    def __init__(self, t: torch.Tensor) -> None:
        alias = t.detach()
        alias.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self.alias = alias
        self.saved = t._version
        self.grad_fn = _origin(t)
        self.output_nr = t.output_nr
        self.sizes = tuple(t.shape)

    def check(self) -> None:
        """Raise autograd's error if the saved tensor was modified in place since it was saved."""
        now = self.alias._version
        if now != self.saved:
            raise _modified(self.alias, self.sizes, self.grad_fn, self.output_nr, now, self.saved)


class Kept:
    """A saved tensor kept by reference, with its version check (NOTE [ Saved tensor identity ] Rules 1 and 5)."""

    __slots__ = ("tensor", "version", "grad_fn", "output_nr")

    def __init__(self, t: torch.Tensor) -> None:
        self.version = t._version
        if t.grad_fn is not None or t._base is not None:  # NOTE [ Saved tensor identity ] Rule 5: never hold the saved tensor's graph
            self.grad_fn, self.output_nr = _origin(t), t.output_nr
            if not (_is_functorch_wrapped is not None and (_is_functorch_wrapped(t) or _is_batched(t))):
                t = t.detach()
        else:
            self.grad_fn, self.output_nr = None, 0
        self.tensor = t

    def get(self) -> torch.Tensor:
        """The tensor, or autograd's error if it was modified in place since it was saved."""
        t = self.tensor
        now = t._version
        if now != self.version:
            grad_fn = self.grad_fn if self.grad_fn is not None else _origin(t)
            output_nr = self.output_nr if self.grad_fn is not None else t.output_nr
            raise _modified(t, tuple(t.shape), grad_fn, output_nr, now, self.version)
        return t


def rebuild(storage: torch.UntypedStorage, offset: int, dtype: torch.dtype, size: torch.Size,
            stride: tuple[int, ...], bits: int, device: torch.device) -> torch.Tensor:
    """The saved tensor's view of ``storage``, with the neg and conj bits of ``bits``
    (NOTE [ Saved tensor identity ] Rule 3)."""
    out = torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)
    if bits & NEG:
        out = out._neg_view()
    if bits & CONJ:
        out = out.conj()
    return out


CONJ, NEG = 1, 2


def value_bits(t: torch.Tensor) -> int:
    """The metadata bits that change ``t``'s values (NOTE [ Saved tensor identity ] Rule 3)."""
    return (CONJ if t.is_conj() else 0) | (NEG if t.is_neg() else 0)


def root_ref(t: torch.Tensor) -> tuple[int, Any]:
    """``(id, weak reference)`` of ``t``'s family root (NOTE [ Saved tensor identity ] Rule 2)."""
    r = family_root(t)
    return id(r), weakref.ref(r)
