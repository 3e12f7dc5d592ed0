"""What a block's forward changes besides its outputs, which recomputing the block would change again.

A recomputation runs a block's forward a second time, in backward. Whatever the forward changes other than
the tensors it returns, it changes again: a KV cache gets every token twice (transformers' ``DynamicCache``
appends in ``update``), a list passed in gets a second item, a counter counts twice. Gradients may still come
out right (a cache read by SDPA's causal kernel) while the state is silently wrong, or backward fails in the
middle of autograd with a shape error (the same cache read by eager attention, whose mask no longer fits).
``torch.utils.checkpoint`` has the same effect and says nothing; transformers' own gradient checkpointing
turns ``use_cache`` off in training, with a warning.

# NOTE [ Mutating forwards ]
# 1. The *state of a call* is what can be reached from the objects a block is called with, other than the
#    tensors passed directly (autograd's version check already guards those): the positional and keyword
#    arguments, and the arguments and keywords a ``functools.partial`` block binds (transformers passes its
#    layers' keyword arguments that way). Lists, dicts and sets count by identity, length and items; tuples
#    by their items; other objects with a ``__dict__`` by identity and attributes; tensors inside any of
#    these by identity and version (an in-place write, e.g. a static cache's ``index_copy_``); numbers,
#    strings, devices, dtypes and enums by value; modules, classes and functions by identity only. The walk
#    goes ``DEPTH`` levels down and takes at most ``LIMIT`` entries (``DynamicCache.layers[i].keys`` is 3).
# 2. ``Recompute`` (``api.run``, so every block a policy, ``checkpoint_chain`` or a plan recomputes) takes the
#    state of the call before and after the block's first forward, with grad enabled and not while Dynamo
#    traces (the walk itself is ``torch.compiler.disable``d, so a block that runs eagerly around compiled
#    code adds no graph break); when it changed and an output requires grad (a backward that recomputes can follow),
#    it raises ``CheckpointError`` right away, in the forward, naming what changed: the change happened once,
#    as without checkpointing, and the recomputation that would repeat it never runs. Never a wrong gradient,
#    a shape error inside backward, or a cache holding tokens twice. For a transformers ``Cache`` the message
#    says to pass ``use_cache=False`` for training forwards (or set ``model.config.use_cache = False``).
#    Preventing the second change instead (recomputing on a copy of the state as it was) would need a copy
#    of every object a block is handed at every call, and cannot undo an in-place write: not done.
# 3. ``Offload`` and ``Keep`` run the forward once: nothing is checked, and a cache fills as without
#    torchckpt. Without grad (generation) no policy does anything, and nothing is checked.
# 4. What ``Recompute`` does not watch: the block's own attributes (a rotary table built lazily on the first
#    call is set once, and would be a false alarm) and global state. The planner, which sees a whole step, does
#    watch those (Rule 5). The block's buffers written in place (BatchNorm's running statistics) it puts back
#    around every recomputation: NOTE [ Buffers written in a forward ].
# 5. The planner's profiling step (NOTE [ Profiling step ] Rule 7) takes, around each block's forward of the
#    measured step (after the warmup step, so that state built once on the first call is built already), the
#    state of the call (Rule 1) and that of the block's modules: every attribute of each module other than
#    ``nn.Module``'s own bookkeeping (parameters, buffers, submodules, hooks, ``training``, a wrapped
#    ``forward``), walked as in Rule 1, tensor attributes included. A block that changed any is never offered recomputation, so it is kept or offloaded and runs its forward once; ``plan`` warns once per
#    profile, naming the blocks and what changed. A budget that needs those blocks recomputed gets
#    ``PlanError`` with the floor, as any budget under the floor does.
# 6. transformers' ``use_cache`` (planner/use_cache.py): a module of the model with ``config.use_cache`` and a
#    ``use_cache`` argument that holds a planned block runs with ``use_cache=False`` in training forwards
#    (the module in training mode and grad enabled, whatever the call or the config asks), during the
#    planner's own steps and while a plan is applied (``Plan.apply``, ``auto``); ``Applied.remove()`` ends it.
#    A warning says so, once per config: the semantics of transformers' ``gradient_checkpointing_enable()``
#    (``merge_with_config_defaults``). So the profiled step has no cache (Rule 5 finds nothing to refuse)
#    and no plan recomputes a block that appends to one. ``auto``'s first call, whose pre-hooks ran before
#    the plan was applied, is turned off too. Evaluation and no-grad forwards keep the cache, as in
#    transformers; a recomputed block handed it in evaluation with grad enabled raises by Rule 2.
# 7. A call whose every root (Rule 1: each argument, keyword and ``functools.partial`` binding) is a tensor, a value
#    or an object counted by identity only (a module's ``forward`` called with tensors: its one binding is the
#    module) is not walked: the walk would leave the tensors out and give each other root a token that depends on
#    the object alone (its value, or its id), and the state holds the same objects before and after the forward, so
#    it cannot change. ``watched`` returns ``None`` for it, and Rule 2's check has nothing to compare.
"""
from __future__ import annotations

import enum
import functools
import inspect
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from torchckpt._errors import CheckpointError
from torchckpt.recompute.buffers import BufferGuard

__all__ = ["DEPTH", "LIMIT", "CallState", "check_recomputed", "is_transformers_cache", "module_state", "watched"]

DEPTH = 4  # NOTE [ Mutating forwards ] Rule 1: levels walked below an argument
LIMIT = 4096  # NOTE [ Mutating forwards ] Rule 1: entries taken per state
_VALUES = (int, float, complex, str, bytes, bool, type(None), torch.device, torch.dtype, enum.Enum)
_OPAQUE = (nn.Module, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType,
           functools.partial)
_FIXED = (torch.Tensor, *_VALUES, *_OPAQUE)  # NOTE [ Mutating forwards ] Rule 7: roots whose token never changes
# NOTE [ Mutating forwards ] Rule 5: nn.Module's own bookkeeping (what a fresh Module holds), the forward a wrapper
# installs, torch.compile's.
_MODULE_OWN = frozenset(vars(nn.Module()).keys()) | {"forward", "_compiled_call_impl"}


def is_transformers_cache(x: Any) -> bool:
    """``x`` is a transformers ``Cache`` (``DynamicCache``, ``StaticCache``, ...), found without importing transformers."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(x).__mro__)


class _Walk:
    """NOTE [ Mutating forwards ] Rule 1: ``path -> token`` for everything reachable from some roots."""

    def __init__(self) -> None:
        self.out: dict[str, tuple[Any, ...]] = {}
        self.seen: set[int] = set()

    def root(self, path: str, x: Any) -> None:
        self.walk(path, x, 0)

    def walk(self, path: str, x: Any, depth: int) -> None:
        out = self.out
        if len(out) >= LIMIT:
            return
        if isinstance(x, torch.Tensor):
            out[path] = ("tensor", id(x), x._version)
            return
        if isinstance(x, _VALUES):
            out[path] = ("value", x)
            return
        if isinstance(x, _OPAQUE) or depth >= DEPTH or id(x) in self.seen:
            out[path] = ("object", id(x))
            return
        self.seen.add(id(x))
        if isinstance(x, tuple):
            out[path] = ("tuple", len(x))
            for k, v in enumerate(x):
                self.walk(f"{path}[{k}]", v, depth + 1)
        elif isinstance(x, list):
            out[path] = ("list", id(x), len(x))
            for k, v in enumerate(x):
                self.walk(f"{path}[{k}]", v, depth + 1)
        elif isinstance(x, dict):
            out[path] = ("dict", id(x), len(x))
            for key, v in list(x.items()):
                name = repr(key) if isinstance(key, (str, int)) else f"<{type(key).__name__} at {id(key):#x}>"
                self.walk(f"{path}[{name}]", v, depth + 1)
        elif isinstance(x, (set, frozenset)):
            out[path] = ("set", id(x), len(x), frozenset(id(v) for v in x))
        else:
            try:
                attrs = vars(x)
            except TypeError:  # no __dict__ (slots, C types): its identity only
                attrs = None
            out[path] = ("object", id(x))
            if isinstance(attrs, dict):
                for key, v in list(attrs.items()):
                    self.walk(f"{path}.{key}", v, depth + 1)


def _changed(before: dict[str, tuple[Any, ...]], after: dict[str, tuple[Any, ...]]) -> list[str]:
    """The paths whose token differs, outermost first (a path inside a changed one is left out)."""
    if before == after:  # the common case, in one comparison: no token differs (tuples compare item by item either way)
        return []
    paths = sorted((p for p in before.keys() | after.keys() if before.get(p) != after.get(p)),
                   key=lambda p: (p.count(".") + p.count("["), p))
    out: list[str] = []
    for p in paths:
        if not any(p.startswith(q) and p[len(q)] in ".[" for q in out if len(p) > len(q)):
            out.append(p)
    return out


def _call_roots(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """NOTE [ Mutating forwards ] Rule 1: the objects a call hands the block, tensors passed directly left out."""
    if isinstance(fn, BufferGuard):  # NOTE [ Buffers written in a forward ]: the block's own function
        fn = fn.fn
    while isinstance(fn, functools.partial):
        yield from ((f"bound argument {k}", a) for k, a in enumerate(fn.args))
        yield from ((k, v) for k, v in fn.keywords.items())
        fn = fn.func
    yield from ((f"argument {k}", a) for k, a in enumerate(args))
    yield from kwargs.items()


def _fixed(roots: Iterable[Any]) -> bool:
    """Every object of ``roots`` has a token that never changes (NOTE [ Mutating forwards ] Rule 7)."""
    for x in roots:
        if not isinstance(x, _FIXED):
            return False
    return True


@torch.compiler.disable  # as CallState.of: run eagerly inside a compiled region, it hands Dynamo no frame
def watched(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallState | None:
    """``CallState.of(fn, args, kwargs)`` for ``check_recomputed``, or ``None`` where the state of the call cannot
    change (NOTE [ Mutating forwards ] Rule 7). Looks at the roots ``_call_roots`` would give, and walks nothing."""
    f = fn.fn if isinstance(fn, BufferGuard) else fn
    while isinstance(f, functools.partial):
        if not (_fixed(f.args) and _fixed(f.keywords.values())):
            return CallState.of(fn, args, kwargs)
        f = f.func
    if _fixed(args) and _fixed(kwargs.values()):
        return None
    return CallState.of(fn, args, kwargs)


class CallState:
    """The state of one call (NOTE [ Mutating forwards ] Rule 1), taken again by ``changes()`` to compare.

    Args:
        roots: ``(name, object)`` pairs, or a function giving them anew each time the state is taken (attributes,
            which the forward may rebind).
        tensors: watch tensors among ``roots`` too; ``False``: leave them out (a call's tensor arguments: autograd
            checks those).

    Example::

        >>> cache = []
        >>> state = CallState.of(len, (torch.ones(2), cache), {})
        >>> cache.append(1)
        >>> state.changes()
        ['argument 1']
    """

    def __init__(self, roots: Iterable[tuple[str, Any]] | Callable[[], Iterable[tuple[str, Any]]],
                 tensors: bool = False) -> None:
        self.source = roots if callable(roots) else None
        self.tensors = tensors
        self.roots = self._roots(roots() if callable(roots) else roots)
        self.before = self._take()
        self.fn: Any = None  # names positional arguments in messages

    def _roots(self, roots: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        return [(name, x) for name, x in roots if self.tensors or not isinstance(x, torch.Tensor)]

    @staticmethod
    @torch.compiler.disable  # NOTE [ Mutating forwards ] Rule 2: a block that runs eagerly around compiled code; Dynamo never traces the walk
    def of(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallState:
        """The state of calling ``fn(*args, **kwargs)`` (``fn``'s ``functools.partial`` bindings included)."""
        state = CallState(list(_call_roots(fn, args, kwargs)))
        state.fn = fn
        return state

    def _take(self) -> dict[str, tuple[Any, ...]]:
        w = _Walk()
        for name, x in self.roots:
            w.root(name, x)
        return w.out

    def changes(self) -> list[str]:
        """What changed since the state was taken: paths such as ``cache.layers[0].keys``, outermost first."""
        if self.source is not None:
            self.roots = self._roots(self.source())
        elif not self.roots:
            return []
        return _changed(self.before, self._take())

    def _root(self, path: str) -> str | None:
        return next((n for n, _ in self.roots if path == n or path.startswith((f"{n}.", f"{n}["))), None)

    def describe(self, paths: list[str], most: int = 3) -> str:
        """``paths`` for a message, grouped by the object each starts from, with its type."""
        groups: dict[str | None, list[str]] = {}
        for p in paths:
            groups.setdefault(self._root(p), []).append(p)
        kinds = {n: type(x).__name__ for n, x in self.roots}
        parts = []
        for name, ps in groups.items():
            shown = ", ".join(ps[:most]) + (f" and {len(ps) - most} more" if len(ps) > most else "")
            if name is None:
                parts.append(shown)
            else:
                parts.append(f"{self._named(name)} ({kinds[name]})" + ("" if ps == [name] else f": {shown}"))
        return "; ".join(parts)

    def _named(self, root: str) -> str:
        """``argument k`` as ``argument k `name```, when the block's signature names it."""
        if self.fn is None or not root.startswith("argument "):
            return root
        try:
            params = [p for p in inspect.signature(self.fn).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            return root
        k = int(root.removeprefix("argument "))
        return f"{root} `{params[k].name}`" if k < len(params) else root

    def any_cache(self, paths: list[str]) -> bool:
        """Some changed path starts at a transformers ``Cache``."""
        names = {self._root(p) for p in paths}
        return any(is_transformers_cache(x) for n, x in self.roots if n in names)


def module_state(block: nn.Module) -> CallState:
    """The state of ``block``'s modules: their attributes other than ``nn.Module``'s own
    (NOTE [ Mutating forwards ] Rule 5)."""
    mods = list(block.named_modules())

    def roots() -> list[tuple[str, Any]]:  # read again each time: the forward may rebind an attribute
        return [(f"{name}.{key}" if name else key, v) for name, m in mods for key, v in vars(m).items()
                if key not in _MODULE_OWN]
    return CallState(roots, tensors=True)  # a tensor attribute written in place is a change


def _name(block: Any) -> str:
    if isinstance(block, nn.Module):
        return f"a block ({type(block).__name__})"
    while isinstance(block, functools.partial):
        block = block.func
    name = getattr(block, "__qualname__", None)
    return f"a block ({name})" if isinstance(name, str) else "a block"


@torch.compiler.disable  # as CallState.of
def check_recomputed(state: CallState | None, out: Any, policy: Any, block: Any = None) -> None:
    """NOTE [ Mutating forwards ] Rule 2: raise when the block's first forward changed the state of its call and a
    backward may recompute it.

    Args:
        state: the state taken before the forward (``None``: not watched).
        out: what the forward returned.
        policy: the block's ``Recompute`` (for the message).
        block: the block's module or function (for the message).
    """
    if state is None:
        return
    what = state.changes()
    if not what:
        return
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(out)[0]):
        return  # nothing to differentiate: no recomputation follows
    example = ""
    if state.any_cache(what):
        example = " (a KV cache would hold every token twice, and attention over it would see the wrong keys)"
        fix = ("This is transformers' KV cache: pass use_cache=False for training forwards (or set "
               "model.config.use_cache = False; transformers' gradient_checkpointing_enable() forces the same, and "
               "torchckpt.plan/auto do it for you), or run the block under Offload(store) or Keep(), which run its "
               "forward once.")
    else:
        fix = ("Keep that update out of the recomputed block (return the new value instead), or run the block under "
               "Offload(store) or Keep(), which run its forward once.")
    raise CheckpointError(
        f"torchckpt: {_name(block)} under {type(policy).__name__}() changed what it was called with during its forward: "
        f"{state.describe(what)}. Its recomputation in backward would run the forward again and change it a second "
        f"time{example}. {fix} "
        "(NOTE [ Mutating forwards ] Rule 2)")
