"""Selective recomputation: some ops' outputs are kept from a recomputed block's forward, through a store.

# NOTE [ Selective recompute ]
# ``Recompute(save=...)`` recomputes a block in backward as ``torch.utils.checkpoint`` does, except
# for the ops it names, whose outputs are kept from the forward and handed back to the
# recomputation instead of running the op again (torch's selective activation checkpointing, SAC).
# Torch SAC keeps those outputs in a cache of its own, which no saved-tensor hook sees; here the
# cache goes through a ``Store`` when one is given, so kept outputs can be offloaded like any
# saved tensor.
# 1. Two dispatch modes, one for the forward (``_Keeping``), one for the recomputation
#    (``_Reusing``), count the aten ops they see, leaving out those the checkpoint itself adds
#    in one run and not the other (``SAC_IGNORED_OPS``), so an op has the same position in both
#    runs of a deterministic block. Each recomputation counts from 0 again: the checkpoint stops
#    one as soon as backward has what it needs, and may start another (a second backward).
# 2. An op is kept when its overload is in ``save`` or its position is, unless it writes an
#    argument (an in-place op returns what it wrote: the recomputation must write it again),
#    returns views or memory shared with an input (``chunk``, ``as_strided``, ``unsafe_chunk``:
#    the recomputation must make them from the recomputed input, which later ops may write), or
#    draws from the RNG: the recomputation restores the RNG state at the block's start and draws
#    again, so skipping one random op would shift what every later one draws (dropout masks
#    that differ from the forward's). Nor an op that makes uninitialised memory (``empty``,
#    ``empty_like``, ...: meant to be written, free to make again; on CUDA, ``nn.GRU`` in float64
#    wrote one such output past Rule 4's watch, a CheckpointError the fuzzer found), nor one whose
#    outputs hold no element. An op whose schema is seeded only for a ``dropout_p``
#    argument (the attention kernels) draws nothing when it is 0, and is kept then (a CUDA test
#    checks that the generator does not move). So only ops that return new memory are kept (matmuls,
#    attention, normalisations, pointwise ops). Their outputs are detached
#    as torch SAC detaches them (views keep their version counter), then packed by the store
#    (``Store.pack``: the same identity and version rules as any saved tensor; compressed with
#    ``Recompute(codec=...)``) or, without a store, held with their version.
# 3. The recomputation returns the kept outputs, unpacked, in place of running the op. A kept
#    output modified in place after the forward (a matmul's output that code after the block scales in place)
#    raises, naming the op, with autograd's own check (NOTE [ Saved tensor identity ] Rule 1):
#    it could not stand in for the op. Each kept output is handed back once: a second backward
#    through the block raises, as torch SAC does. (A block recomputed in parts hands it back to
#    each recomputation that passes through its op: NOTE [ Recompute in parts ] Rule 7.)
# 4. A write that bumps no version counter escapes Rule 3: ATen's RNN cells split a matmul's output
#    with ``unsafe_chunk`` and write the pieces in place. So the forward's mode watches every op
#    that writes an argument (its schema says so): a write into the storage of a kept output
#    drops that output, and the recomputation runs the op again, with the writes that follow.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import SAC_IGNORED_OPS

from torchckpt._errors import CheckpointError
from torchckpt.codecs.base import Codec
from torchckpt.store.identity import Kept
from torchckpt.store.saved import Store

__all__ = ["OpCounter", "check_save", "keepable", "selective_contexts"]

Save = frozenset[Any]  # aten OpOverloads and op positions (ints)


def check_save(owner: str, save: object) -> Save | None:
    """``save`` as a frozenset of OpOverloads and positions, or ``None``; a ``torchckpt:`` error otherwise."""
    if save is None:
        return None
    items = list(save) if isinstance(save, Iterable) and not isinstance(save, (str, bytes)) else None
    bad = items is None or any(
        not isinstance(x, torch._ops.OpOverload) and (isinstance(x, bool) or not isinstance(x, int) or x < 0)
        for x in items)
    if bad:
        packet = items is not None and any(isinstance(x, torch._ops.OpOverloadPacket) for x in items)
        hint = " (an op packet: name its overload, e.g. torch.ops.aten.mm.default)" if packet else ""
        raise TypeError(
            f"torchckpt: {owner}(save=...) expects aten op overloads (e.g. torch.ops.aten.mm.default) or op positions "
            f"(ints >= 0), got {save!r}{hint}; pass e.g. save={{torch.ops.aten.mm.default, torch.ops.aten.addmm.default}}."
        )
    return frozenset(items or ())


_UNINITIALISED = frozenset(  # NOTE [ Selective recompute ] Rule 2: their outputs are memory meant to be written, and cost nothing to make again
    getattr(torch.ops.aten, name).default if name != "empty" else torch.ops.aten.empty.memory_format
    for name in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"))


_BY_SCHEMA: dict[Any, tuple[bool, bool, int | None]] = {}  # op -> (may be kept, seeded, dropout_p at): fixed per op


def _by_schema(func: Any) -> tuple[bool, bool, int | None]:
    """What ``func``'s schema says for NOTE [ Selective recompute ] Rule 2, once per op: whether it may be kept (it writes
    no argument, makes no uninitialised memory, returns no alias), whether it draws from the RNG, and the position of
    its ``dropout_p`` argument (``None``: it has none)."""
    got = _BY_SCHEMA.get(func)
    if got is None:
        schema = func._schema
        may = not (func in _UNINITIALISED or schema.is_mutable or any(r.alias_info is not None for r in schema.returns))
        names = [a.name for a in schema.arguments]
        got = _BY_SCHEMA[func] = (may, torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()),
                                  names.index("dropout_p") if "dropout_p" in names else None)
    return got


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}  # op -> (position, name) of the arguments it writes


def _written(func: Any) -> tuple[tuple[int, str], ...]:
    """The arguments ``func``'s schema says it writes, by position and name, once per op (NOTE [ Selective recompute ]
    Rule 4)."""
    got = _WRITES.get(func)
    if got is None:
        got = _WRITES[func] = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                                    if a.alias_info is not None and a.alias_info.is_write)
    return got


def tensors_of(x: Any) -> list[torch.Tensor]:
    """The tensors in an aten op's arguments or outputs (tensors, lists and tuples of them, dicts), in order: what
    ``tree_flatten`` finds there, without its per-node cost (the dispatch modes run this for every op)."""
    if isinstance(x, torch.Tensor):
        return [x]
    out: list[torch.Tensor] = []
    for y in x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ():
        if isinstance(y, torch.Tensor):
            out.append(y)
        elif isinstance(y, (list, tuple, dict)):
            out += tensors_of(y)
    return out


def keepable(func: Any, args: Any, kwargs: Any, out: Any) -> bool:
    """Whether a call's outputs may stand in for running ``func`` again (NOTE [ Selective recompute ] Rule 2): it writes
    no argument, draws nothing from the RNG, makes no uninitialised memory, and returns only new memory (no view, no
    output sharing an input's storage), some of it."""
    return _kept_storages(func, args, kwargs, out) is not None


def _kept_storages(func: Any, args: Any, kwargs: Any, out: Any) -> list[int] | None:
    """The storages of a call's output tensors, in order, where ``keepable`` holds; ``None`` where it does not (the
    forward's mode records them for NOTE [ Selective recompute ] Rule 4 without asking the tensors again)."""
    may, seeded, dropout = _by_schema(func)
    if not may or (seeded and not _no_dropout(func, dropout, args, kwargs)):
        return None
    outs = tensors_of(out)
    if not any(t.numel() for t in outs):  # nothing to keep; zero-size storages share the null address
        return None
    ins = {t.untyped_storage().data_ptr() for t in tensors_of(args)}
    if kwargs:
        ins.update(t.untyped_storage().data_ptr() for t in tensors_of(kwargs))
    ptrs: list[int] = []
    for t in outs:
        p = t.untyped_storage().data_ptr()
        if p in ins:
            return None
        ptrs.append(p)
    return ptrs


def _no_dropout(func: Any, at: int | None, args: Any, kwargs: Any) -> bool:
    """Whether a seeded op draws nothing here: its randomness is a ``dropout_p`` argument (at position ``at``), and it
    is 0 (NOTE [ Selective recompute ] Rule 2: attention kernels, whose schema is seeded for the dropout they may
    apply)."""
    if at is None:
        return False
    p = kwargs["dropout_p"] if "dropout_p" in kwargs else args[at] if at < len(args) else (
        func._schema.arguments[at].default_value)
    return isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0


class OpCounter(TorchDispatchMode):
    """A dispatch mode that numbers the aten ops it sees as NOTE [ Selective recompute ] Rule 1 does and hands each to
    ``op(k, func, ...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.k = 0

    def op(self, k: int, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        return func(*args, **kwargs)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        k = self.k
        self.k += 1
        return self.op(k, func, args, kwargs)


def _detach(x: Any, aliases: bool) -> Any:
    """Torch SAC's detach (NOTE [ Selective recompute ] Rule 2): views detached beneath autograd keep their version counter."""
    if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex() or aliases):
        with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
            x = x.detach()
    return x


class _Slot:
    """One kept output as the cache holds it (a store handle, or ``Kept``)."""

    __slots__ = ("h",)

    def __init__(self, h: Any) -> None:
        self.h = h


_LEAVES = (torch.Tensor, _Slot, int, float, bool, type(None))  # what pytree takes as leaves, among what aten ops return


def _map(f: Any, x: Any) -> Any:
    """``tree_map(f, x)`` over an aten op's outputs or what the cache holds of them: a leaf, or a flat tuple or list of
    leaves, without pytree's per-node cost (the dispatch modes run this for every kept op); anything else through
    ``tree_map``."""
    if isinstance(x, _LEAVES):
        return f(x)
    if type(x) in (tuple, list) and all(isinstance(y, _LEAVES) for y in x):
        return type(x)([f(y) for y in x])
    return tree_map(f, x)


class _Keeping(OpCounter):
    """The forward's mode: run every op, keep the chosen ones' outputs (NOTE [ Selective recompute ] Rules 1-2)."""

    def __init__(self, save: Save, cache: dict[int, Any], kept: set[int], store: Store | None,
                 codec: Codec | None = None) -> None:
        super().__init__()
        self.save, self.cache, self.kept, self.store, self.codec = save, cache, kept, store, codec
        self.where: dict[int, set[int]] = {}  # storage -> positions whose kept outputs live in it

    def put(self, x: torch.Tensor) -> Any:
        return self.store.pack(x, codec=self.codec) if self.store is not None else Kept(x)

    def slot(self, x: Any) -> Any:
        return _Slot(self.put(_detach(x, False))) if isinstance(x, torch.Tensor) else x

    def op(self, k: int, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        if self.where and func._schema.is_mutable:
            self.forget_written(func, args, kwargs)
        if k in self.save or func in self.save:
            ptrs = _kept_storages(func, args, kwargs, out)
            if ptrs is not None:
                self.cache[k] = (func, _map(self.slot, out))
                self.kept.add(k)
                for p in ptrs:
                    self.where.setdefault(p, set()).add(k)
        return out

    def forget_written(self, func: Any, args: Any, kwargs: Any) -> None:
        """NOTE [ Selective recompute ] Rule 4: an op of the forward wrote into a kept output: recompute that op instead
        of keeping it."""
        for i, name in _written(func):
            x = args[i] if i < len(args) else kwargs.get(name)
            if not isinstance(x, torch.Tensor):
                continue
            for k in self.where.pop(x.untyped_storage().data_ptr(), ()):
                self.cache.pop(k, None)
                self.kept.discard(k)


class _Reusing(OpCounter):
    """The recomputation's mode: hand back the kept outputs, run the other ops
    (NOTE [ Selective recompute ] Rules 1, 3)."""

    def __init__(self, cache: dict[int, Any], kept: set[int], store: Store | None) -> None:
        super().__init__()
        self.cache, self.kept, self.store = cache, kept, store

    def __enter__(self) -> _Reusing:
        self.k = 0  # each recomputation counts from the block's first op (an earlier one may have stopped early)
        return super().__enter__()  # type: ignore[no-any-return]

    def get(self, x: Any) -> Any:
        if not isinstance(x, _Slot):
            return x
        h = x.h
        if isinstance(h, Kept):
            return h.get()
        assert self.store is not None
        return self.store.unpack(h)

    def take(self, k: int) -> tuple[Any, Any]:
        """The op and kept outputs of position ``k``, handed back once (NOTE [ Selective recompute ] Rule 3)."""
        return self.cache.pop(k)  # type: ignore[no-any-return]

    def op(self, k: int, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if k in self.cache:
            op, kept = self.take(k)
            try:
                return _map(self.get, kept)
            except RuntimeError as e:
                if "modified by an inplace operation" not in str(e):
                    raise
                raise CheckpointError(
                    f"torchckpt: Recompute(save=...) kept the output of op {k} ({op}) of the block's forward, which was "
                    "then modified in place (by the block itself or later code), so it cannot stand in for the op; leave "
                    f"that op out of save (keep ops whose outputs are not written in place, e.g. mm, addmm, attention)."
                    f" Autograd said: {str(e).splitlines()[0]}"
                ) from e
        if k in self.kept:
            raise CheckpointError(
                "torchckpt: a second backward through a block under Recompute(save=...): the outputs it kept are "
                "handed back once. Run backward once per forward, or recompute the block fully (save=None)."
            )
        return func(*args, **kwargs)


def selective_contexts(save: Save, store: Store | None,
                       codec: Codec | None = None) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The forward's and the recomputation's modes for one call of a block (``context_fn`` of ``checkpoint``)."""
    cache: dict[int, Any] = {}
    kept: set[int] = set()
    return _Keeping(save, cache, kept, store, codec), _Reusing(cache, kept, store)
