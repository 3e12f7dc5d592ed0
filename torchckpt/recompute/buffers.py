"""The buffers a block's forward writes (batch norm's running statistics), kept as plain autograd leaves them.

# NOTE [ Buffers written in a forward ]
# 1. A recomputation runs a block's forward again, and a forward that writes its module's buffers in place
#    (batch norm in training updates ``running_mean``, ``running_var`` and ``num_batches_tracked``) writes them
#    again: with ``torch.utils.checkpoint`` the statistics move twice a step, and a forward that reads a buffer
#    after writing it recomputes from the wrong value. ``BufferGuard`` wraps the block's function for one
#    call and its recomputations: the call clones the module's buffers before running, and after it keeps
#    the clones of the written ones (the others are dropped at once): those whose version moved. Batch norm's
#    kernels write the running statistics without moving their version (``native_batch_norm``'s schema does
#    not mark them written); torch's own batch and instance norms in training (their stock ``forward``, which
#    reads none of those buffers for its output: it normalises with the batch's statistics) have their three
#    buffers handled by Rule 2's second half alone, with no clone at the call: a ResNet block's call then
#    copies nothing. Other norms in training (subclasses with a ``forward`` of their own, timm's
#    ``BatchNormAct2d``) count as written whatever their versions say.
# 2. Each recomputation (``torch.utils.checkpoint``'s, each part of ``Recompute(parts=...)``, each run of
#    ``checkpoint_chain``) first notes the values of the written buffers (as the forward left them, or as the step has
#    them since), puts the values the forward started from back into them, runs, then puts the noted values back,
#    with one foreach copy each way (on the CPU, the noting clones each buffer: ``_copies``). Rule 1's norm
#    statistics are not copied: for the recomputation's run, each of those norms' ``_buffers`` entries is a fresh
#    tensor of its shape (``torch.empty_like``; ``num_batches_tracked`` a zero on the CPU, which the stock ``forward``
#    only counts up and reads with ``float()``), which the recomputation's kernels write, then the module's own
#    tensors are put back. A stock norm in training normalises with the batch's statistics and reads its running ones
#    only to update them (and may save them for a backward in training, which does not read them), so the
#    recomputation computes what the forward computed. On an H100 the copies each way had cost ResNet-152
#    (``torch.utils.checkpoint`` on every Bottleneck, batch 128) about 0.65 ms a block: 462 small kernels and as many
#    copies a step from the host, on a step the host bounds (``benchmarks/recompute_overhead.py --ablate``). So the
#    buffers end the step as they would without torchckpt: batch norm's statistics move once a step (tested bit for
#    bit against plain autograd, with every form of ``Recompute`` and with ``checkpoint_chain``).
# 3. The writes go through ``.data``, which bumps no version counter: autograd's check on the tensors the
#    block saved (NOTE [ Saved tensor identity ] Rule 1) sees the buffers as the forward left them. They run
#    with every dispatch mode set aside, so ``Recompute(save=...)``'s op count (NOTE [ Selective recompute ]
#    Rule 1) does not see them.
# 4. Only the buffers of the ``module`` handed to ``api.run`` (the wrapped block's) are guarded, and only
#    written in place: a buffer rebound to a new tensor is not seen (the planner's profile watches for that,
#    NOTE [ Mutating forwards ] Rule 5). Nothing is done while Dynamo traces, for a module without buffers, or
#    without grad (nothing is recomputed).
# 5. The walk of Rule 4 (every submodule, each one's buffers, its norm flags) is kept per module, so that a call
#    pays a comparison instead of a walk. It is kept as positions among the module's buffers, in walk order, and
#    as the key of what the walk read: for each module reached, its ``_modules`` and ``_buffers`` (values by id,
#    ``None`` included, and lengths) and its type; for each norm, ``training``, ``track_running_stats``, the names
#    of its buffers and its class's ``forward``. A call computes the key again from the modules walked (held by weak
#    reference: one gone ends the kept walk) and walks again where it differs, so a buffer added, removed or
#    replaced, a submodule added or removed, a norm switched between training and evaluation or to
#    ``track_running_stats`` walks again. The guard's tensors are read from the ``_buffers`` dicts as they are at
#    the call, at the kept positions: what the walk finds depends on the tensors only through which positions hold
#    the same one, which equal ids at the call tell, so an id another tensor held earlier cannot make it guard a
#    tensor the module no longer has. A norm whose statistics are not its buffers of those names (a subclass's
#    attributes) is walked at every call. The kept walk holds no module and no tensor, and goes with its module.
"""
from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Callable
from itertools import chain
from operator import attrgetter
from typing import Any

import torch
from torch import nn
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch.nn.modules.batchnorm import SyncBatchNorm, _BatchNorm, _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["BufferGuard", "guarded"]


_STOCK_NORMS = (_BatchNorm.forward, SyncBatchNorm.forward, _InstanceNorm.forward)  # NOTE [ Buffers written in a forward ] Rule 1
_STATS = ("running_mean", "running_var", "num_batches_tracked")


class _Aside:
    """Grad off and every dispatch mode set aside (NOTE [ Buffers written in a forward ] Rule 3): what
    ``with _disable_current_modes(), torch.no_grad():`` does, without entering ``_disable_current_modes`` (which
    pops and pushes back nothing) where no mode is on."""

    __slots__ = ("grad", "modes")

    def __enter__(self) -> None:
        self.modes = _disable_current_modes() if (torch._C._len_torch_dispatch_stack()
                                                  or _len_torch_dispatch_stack_pre_dispatch()) else None
        if self.modes is not None:
            self.modes.__enter__()
        self.grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: Any) -> None:
        torch._C._set_grad_enabled(self.grad)
        if self.modes is not None:
            self.modes.__exit__(*exc)


class BufferGuard:
    """``fn`` for one forward of a module and its recomputations (NOTE [ Buffers written in a forward ]).

    Args:
        fn: the block's function.
        buffers: the module's buffers cloned at the call (NOTE [ Buffers written in a forward ] Rule 1).
        norms: the running statistics of torch's own norms in training, as ``(the norm's _buffers, name)``: each
            recomputation runs with fresh tensors in their place (NOTE [ Buffers written in a forward ] Rule 2).
        unseen: ids of ``buffers`` written without moving their version: the running statistics of other norms
            (subclasses with their own ``forward``) in training.
    """

    __slots__ = ("buffers", "calls", "fn", "norms", "unseen", "written")

    def __init__(self, fn: Callable[..., Any], buffers: list[torch.Tensor], norms: list[tuple[dict[str, Any], str]],
                 unseen: frozenset[int] = frozenset()) -> None:
        self.fn, self.buffers, self.norms, self.unseen = fn, buffers, norms, unseen
        self.calls = 0
        self.written: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, its value when the forward began)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:  # NOTE [ Buffers written in a forward ] Rule 1: the forward
            if not self.buffers:
                return self.fn(*args, **kwargs)
            with _Aside():
                seen = [b._version for b in self.buffers]
                before = _copies(self.buffers)
            out = self.fn(*args, **kwargs)
            self.written = [(b, v) for b, s, v in zip(self.buffers, seen, before)
                            if b._version != s or id(b) in self.unseen]
            return out
        written, norms = self.written, self.norms
        if not written and not norms:
            return self.fn(*args, **kwargs)
        with _Aside():  # NOTE [ Buffers written in a forward ] Rules 2-3
            if written:
                now = _copies([b for b, _ in written])
                torch._foreach_copy_([b.data for b, _ in written], [v for _, v in written])
            own = [d[n] for d, n in norms]
            for (d, n), t in zip(norms, _scratch(own)):
                d[n] = t
        try:
            return self.fn(*args, **kwargs)
        finally:
            for (d, n), t in zip(norms, own):
                d[n] = t
            if written:
                with _Aside():
                    torch._foreach_copy_([b.data for b, _ in written], now)


def _scratch(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a recomputation's norms write instead of ``ts`` (NOTE [ Buffers written in a forward ] Rule 2): a fresh
    tensor like each; for the 0-dim count (``num_batches_tracked``) a zero on the CPU, which the stock ``forward``
    counts up and may read with ``float()``: no launch, no synchronization, never a division by zero. All are made
    before any is put in place."""
    return [torch.empty_like(t) if t.dim() or t.is_floating_point()
            else torch.scalar_tensor(0, dtype=t.dtype)  # torch.zeros((), dtype=...) less its shape parsing
            for t in ts]


def _copies(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``ts``, bit for bit: on a device in one foreach launch per dtype and device (times one: -0.0 and NaNs
    kept); on the CPU, where foreach ops run tensor by tensor anyway, ``clone`` (less host time than the
    multiplication). Called with grad off (``_Aside``): the copies record no graph."""
    if ts[0].is_cpu:
        return [t.clone() for t in ts]
    return list(torch._foreach_mul(ts, 1))


_BUFFERS, _DICTS = attrgetter("_buffers"), attrgetter("_modules", "_buffers")
_FLAGS, _FORWARD = attrgetter("training", "track_running_stats"), attrgetter("forward")
_DEREF = weakref.ref.__call__


def _key(mods: list[nn.Module], dicts: list[dict[str, Any]], norms: list[nn.Module]) -> tuple[Any, ...]:
    """What a walk of ``mods`` reads (NOTE [ Buffers written in a forward ] Rule 5): ``dicts`` their ``_modules`` and
    ``_buffers`` in turn, ``norms`` the norms among them."""
    key = (tuple(map(id, chain.from_iterable(map(dict.values, dicts)))), tuple(map(len, dicts)), tuple(map(type, mods)))
    if not norms:
        return key
    return (*key, tuple(map(_FLAGS, norms)), tuple(chain.from_iterable(map(_BUFFERS, norms))),
            tuple(map(_FORWARD, map(type, norms))))


class _Walk:
    """Where ``guarded`` found a module's buffers and norm statistics, by position among its buffers, and what it read
    to find them (NOTE [ Buffers written in a forward ] Rule 5). Holds no module and no tensor.

    Args:
        mods: the modules walked, by weak reference (the module first).
        key: ``_key`` of the walk.
        norms: positions of the norms among ``mods``.
        rest: positions of the buffers cloned at the call, among the modules' buffers in order.
        stats: the norms' statistics, as (the norm's position among ``mods``, the buffer's name).
        unseen: as ``BufferGuard``'s.
    """

    __slots__ = ("key", "mods", "norms", "rest", "stats", "unseen")

    def __init__(self, mods: tuple[weakref.ref[nn.Module], ...], key: tuple[Any, ...], norms: list[int],
                 rest: list[int], stats: list[tuple[int, str]], unseen: frozenset[int]) -> None:
        self.mods, self.key, self.norms, self.rest, self.stats, self.unseen = mods, key, norms, rest, stats, unseen

    def found(self, module: nn.Module) -> tuple[list[torch.Tensor], list[tuple[dict[str, Any], str]]] | None:
        """``(buffers, norms)`` of ``module`` as they are now (``BufferGuard``'s), or ``None`` where the walk no longer
        holds."""
        try:
            mods: list[Any] = list(map(_DEREF, self.mods))  # a module gone is None: ``_DICTS`` raises below
            if mods[0] is not module:
                return None
            dicts = list(chain.from_iterable(map(_DICTS, mods)))
            if _key(mods, dicts, [mods[k] for k in self.norms] if self.norms else []) != self.key:
                return None
        except (AttributeError, TypeError):  # a module gone (None), or a dict that is no dict: walk again
            return None
        if not self.rest and not self.stats:
            return [], []
        flat = list(chain.from_iterable(map(dict.values, dicts[1::2]))) if self.rest else []
        return [flat[i] for i in self.rest], [(dicts[2 * k + 1], n) for k, n in self.stats]


def _walk(module: nn.Module) -> tuple[_Walk | None, list[torch.Tensor], list[tuple[dict[str, Any], str]], frozenset[int]]:
    """One walk of ``module``'s modules (NOTE [ Buffers written in a forward ] Rules 1, 4): its buffers cloned at the
    call, its norms' statistics (``BufferGuard``'s ``norms``), the ids of ``unseen`` ones, and the walk to keep
    (``None``: walk at every call)."""
    mods = list(module.modules())
    bufs = list(map(_BUFFERS, mods))
    norms: dict[int, torch.Tensor] = {}
    slots: list[tuple[int, str]] = []  # (position among mods, name) of each statistic in ``norms``
    unseen: set[int] = set()
    buffers: dict[int, torch.Tensor] = {}
    kept = True  # each norm statistic is its buffer of that name (NOTE [ Buffers written in a forward ] Rule 5)
    held = Counter(id(b) for b in chain.from_iterable(map(dict.values, bufs)) if b is not None)
    for k, (m, own) in enumerate(zip(mods, bufs)):
        if not own:
            continue
        if isinstance(m, _NormBase) and m.training and m.track_running_stats:
            named = (m.running_mean, m.running_var, m.num_batches_tracked)
            theirs = all(b is own.get(n) for b, n in zip(named, _STATS))
            kept = kept and theirs
            stats = [(b, n) for b, n in zip(named, _STATS) if b is not None]
            if type(m).forward in _STOCK_NORMS and theirs and all(held[id(b)] == 1 for b, _ in stats):
                norms.update((id(b), b) for b, _ in stats)
                slots.extend((k, n) for _, n in stats)
            else:  # a statistic that is no buffer of its name, or one another module holds too, cannot be swapped: copied
                unseen.update(id(b) for b, _ in stats)
                buffers.update((id(b), b) for b, _ in stats)
        buffers.update((id(b), b) for b in own.values() if b is not None)
    rest = [b for k, b in buffers.items() if k not in norms]
    found = rest, [(bufs[k], n) for k, n in slots], frozenset(unseen)
    if not kept:
        return None, *found
    try:  # a TorchScript module's ``_modules`` is no dict: walked at every call
        dicts = list(chain.from_iterable(map(_DICTS, mods)))
        flat = list(chain.from_iterable(map(dict.values, dicts[1::2])))
        refs = (weakref.ref(module, functools.partial(_forget, key=id(module))), *map(weakref.ref, mods[1:]))
    except TypeError:
        return None, *found
    at: dict[int, int] = {}  # a buffer's first position in ``flat``
    for i, b in enumerate(flat):
        if b is not None:
            at.setdefault(id(b), i)
    where = [k for k, m in enumerate(mods) if isinstance(m, _NormBase)]
    key = _key(mods, dicts, [mods[k] for k in where])
    return _Walk(refs, key, where, [at[id(b)] for b in rest], slots, found[2]), *found


# id(module) -> its walk, dropped with the module (NOTE [ Buffers written in a forward ] Rule 5)
_WALKS: dict[int, _Walk] = {}


def _forget(ref: weakref.ref[nn.Module], key: int) -> None:
    """Drop the walk of a module gone (its id may be another module's next)."""
    walk = _WALKS.get(key)
    if walk is not None and walk.mods[0] is ref:
        del _WALKS[key]


def guarded(fn: Callable[..., Any], module: nn.Module | None) -> Callable[..., Any]:
    """``fn`` under a new ``BufferGuard`` for ``module``'s buffers, or ``fn`` itself where there is nothing to guard
    (NOTE [ Buffers written in a forward ] Rules 4-5)."""
    if module is None or isinstance(fn, BufferGuard) or torch.compiler.is_compiling():
        return fn
    walk = _WALKS.get(id(module))
    got = walk.found(module) if walk is not None else None
    if walk is None or got is None:
        walk, buffers, norms, unseen = _walk(module)
        if walk is not None:
            _WALKS[id(module)] = walk
    else:
        (buffers, norms), unseen = got, walk.unseen
    if not buffers and not norms:
        return fn
    return BufferGuard(fn, buffers, norms, unseen)
