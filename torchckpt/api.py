"""User-facing entry points: ``checkpoint`` (decorator, wrapper, call), ``checkpoint_chain``, ``run`` and ``offload``.

# NOTE [ checkpoint forms ]
``checkpoint(target, *args, policy=None, **kwargs)`` picks its form from ``target`` alone, and
``policy`` never changes the form:

Rule 1. No target, or a policy as target (``checkpoint()``, ``checkpoint(P)``,
        ``checkpoint(policy=P)``): returns a decorator for a function, a module class or a
        module instance. It takes no call arguments.
Rule 2. An ``nn.Module`` subclass (``@checkpoint``, ``@checkpoint(P)``): its ``forward`` runs under
        the policy for every instance; the class is changed in place and returned, so it pickles
        by reference as usual. Decorating it again replaces the policy, with a warning.
Rule 3. An ``nn.Module`` instance and no call arguments (``checkpoint(m)``,
        ``checkpoint(m, policy=P)``, ``checkpoint(m, P)``): wraps that instance and returns it.
        ``state_dict`` keys do not change. Its policy takes the place of one its class was
        decorated with (policies on one module do not nest). Wrapping it again replaces the
        policy, with a warning. The wrapper is an ``_InstanceForward`` in the instance's
        ``__dict__``: it holds the module, the policy and the forward it runs, and pickles and
        deep-copies with the module (a ``Store`` in the policy pickles as its configuration).
Rule 4. Any other callable, and a module with call arguments: calls ``target(*args, **kwargs)``
        under the policy and returns the result, for any number of arguments, zero included:
        the call semantics of ``torch.utils.checkpoint.checkpoint``. So a bare ``@checkpoint``
        on a function would call it; decorate functions with ``@checkpoint()`` or
        ``@checkpoint(P)``. When the call has no arguments and ``target`` cannot be called
        without any, that is the error. ``torch.utils.checkpoint``'s own keywords
        (``use_reentrant``, ``preserve_rng_state``, ...) are not passed to ``target`` either.
Rule 5. A policy is never a call argument: ``checkpoint(target, P)`` means
        ``checkpoint(target, policy=P)``; a policy anywhere else among the arguments, a policy
        given twice, a policy class or a string naming one is an error.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, overload

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from torchckpt._args import found
from torchckpt.policies import Keep, Offload, Policy, Recompute
from torchckpt.schedules import Schedule
from torchckpt.store import SnapshotStats, SnapshotStore, Store, default_store
from torchckpt.recompute.buffers import guarded
from torchckpt.recompute.chain import ChainRuntime, ChainStats
from torchckpt.recompute.mutation import check_recomputed, watched
from torchckpt.recompute.parts import run_in_parts
from torchckpt.recompute.graphed import block_graphs
from torchckpt.recompute.reentrant import run_reentrant
from torchckpt.recompute.selective import selective_contexts

T = TypeVar("T")
_POLICY_TYPES = (Recompute, Offload, Keep)
_POLICY_NAMES = {"recompute": "Recompute()", "offload": "Offload(store)", "keep": "Keep()"}
# torch.utils.checkpoint.checkpoint's keywords: never passed to the block (NOTE [ checkpoint forms ] Rule 4).
_TORCH_KEYWORDS = ("use_reentrant", "context_fn", "determinism_check", "debug", "preserve_rng_state")


def _device_of(args: Iterable[Any]) -> torch.device | None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type != "cpu":
            return a.device
    return None


def _check_keep(where: str, keep: Any) -> list[torch.Tensor]:
    fix = "pass an iterable of tensors, e.g. keep=list(model.buffers())"
    if isinstance(keep, torch.Tensor):
        raise TypeError(f"torchckpt: {where} expects an iterable of tensors, got one Tensor; pass keep=[tensor].")
    if isinstance(keep, nn.Module):
        raise TypeError(f"torchckpt: {where} expects an iterable of tensors, got the module {type(keep).__name__}; {fix}.")
    try:
        items = list(keep)
    except TypeError:
        raise TypeError(f"torchckpt: {where} expects an iterable of tensors, got {type(keep).__name__}; {fix}.") from None
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"torchckpt: {where} expects an iterable of tensors, but item {i} is {type(t).__name__}; {fix}.")
    return items


def offload(store: Store | None = None, *, keep: Iterable[torch.Tensor] = ()) -> torch.autograd.graph.saved_tensors_hooks:
    """A context manager under which every tensor autograd saves goes to ``store``.

    Parameters and other leaves that require grad, tensors in ``keep`` (e.g. buffers) and
    small tensors stay where they are (see ``Store``).

    Args:
        store: the store; ``None``: ``default_store()``.
        keep: tensors whose storages must stay by reference.

    Example::

        >>> import torchckpt
        >>> store = torchckpt.Store(device="cpu", min_bytes=0)
        >>> x = torch.randn(32, 32, requires_grad=True)
        >>> with torchckpt.offload(store):
        ...     loss = x.sin().sum()
        >>> loss.backward()
        >>> bool(torch.equal(x.grad, x.cos()))
        True
    """
    if store is None:
        store = default_store()
    elif not isinstance(store, Store):
        raise TypeError(
            f"torchckpt: offload(store=...) expects a torchckpt.Store or None, got {found(store)}; "
            f"pass {'an instance, e.g. ' if store is Store else ''}store=torchckpt.Store(gpu_bytes=...)"
            f"{', or None for the default store' if store is not Store else ''}."
        )
    return store.hooks(_check_keep("offload(keep=...)", keep))


_OTHER_SAVES: weakref.WeakSet[Offload] = weakref.WeakSet()  # Offload(tensors=, expect=) policies that met another count


def _module_tensors(module: nn.Module | None) -> list[torch.Tensor]:
    if module is None:
        return []
    return [*module.parameters(), *module.buffers()]


def _bad_policy(where: str, policy: Any) -> TypeError:
    expected = f"torchckpt: {where} expects Recompute(), Offload(store) or Keep()"
    if isinstance(policy, str):
        name = _POLICY_NAMES.get(policy.strip().lower().removesuffix("()"), "Offload(store)")
        return TypeError(f"{expected}, got the string {policy!r}; policies are values: pass policy=torchckpt.{name}.")
    if isinstance(policy, type) and issubclass(policy, _POLICY_TYPES):
        return TypeError(f"{expected}, got the class {policy.__name__}; pass an instance: policy=torchckpt.{policy.__name__}().")
    return TypeError(f"{expected}, got {type(policy).__name__} {policy!r}; pass e.g. policy=torchckpt.Recompute().")


def _check_policy(where: str, policy: Any) -> Policy:
    if policy is None:
        return Recompute()
    if not isinstance(policy, _POLICY_TYPES):
        raise _bad_policy(where, policy)
    return policy


def _looks_like_policy(value: Any) -> bool:
    """A string naming a policy, or a policy class: meant as ``policy=``, never a call argument."""
    if isinstance(value, str):
        return value.strip().lower().removesuffix("()") in _POLICY_NAMES
    return isinstance(value, type) and issubclass(value, _POLICY_TYPES)


_hooks_refused: Callable[[], str | None] = getattr(
    torch._C._autograd, "_saved_tensors_hooks_get_disabled_error_message", lambda: None)


def _warn_hooks_refused(policy: Policy) -> None:
    """Inside ``torch.func.grad``/``vjp``/``jacrev``/``hessian`` PyTorch refuses saved-tensor hooks
    (``torch.utils.checkpoint`` raises there too): a block runs as ``Keep()``, which gives the same
    values and gradients and only holds more memory. Python's filters show the warning once per call site."""
    warnings.warn(
        f"torchckpt: {type(policy).__name__}() runs as Keep() inside torch.func.grad/vjp/jacrev/hessian: PyTorch "
        "does not support saved-tensor hooks there. Values and gradients are unchanged; the block's saved tensors "
        "stay on the device. Differentiate with torch.autograd.grad to get the policy's memory savings.",
        stacklevel=3,
    )


def run(policy: Policy, fn: Callable[..., T], *args: Any, module: nn.Module | None = None, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` under ``policy``.

    Args:
        policy: ``Recompute()``, ``Offload(...)`` or ``Keep()``.
        fn: the block.
        module: the module ``fn`` belongs to: its parameters and buffers (and views of
            them) stay by reference.

    Returns:
        Whatever ``fn`` returns (tensors, tuples, non-tensor values).

    Example::

        >>> import torchckpt
        >>> x = torch.randn(4, requires_grad=True)
        >>> torchckpt.api.run(torchckpt.Recompute(), torch.sin, x).sum().backward()
        >>> bool(torch.equal(x.grad, x.detach().cos()))
        True
    """
    if not isinstance(policy, _POLICY_TYPES):
        if isinstance(fn, _POLICY_TYPES) and callable(policy):
            raise TypeError(f"torchckpt: run(policy, fn, *args) takes the policy first; pass run({fn!r}, fn, ...).")
        raise _bad_policy("run(policy, ...)", policy)
    if not callable(fn):
        raise TypeError(f"torchckpt: run(policy, fn, ...) expects a callable fn, got {type(fn).__name__}.")
    if module is not None and not isinstance(module, nn.Module):
        raise TypeError(
            f"torchckpt: run(..., module=...) expects the nn.Module that fn belongs to or None, got {type(module).__name__}."
        )
    if isinstance(policy, Keep) or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    # torch.func.grad and friends (see _warn_hooks_refused); Dynamo cannot trace the check and
    # does not run inside those transforms, so a compiled block skips it (no graph break).
    if not torch.compiler.is_compiling() and _hooks_refused() is not None:
        _warn_hooks_refused(policy)
        return fn(*args, **kwargs)
    if isinstance(policy, Offload):
        store = policy.store if policy.store is not None else default_store(_device_of(args))
        only = None if policy in _OTHER_SAVES else policy.tensors
        hooks = store.hooks(_module_tensors(module), policy.codec, only)
        with hooks:
            out = fn(*args, **kwargs)
        if only is not None and policy.expect is not None and hooks.saved != policy.expect:  # type: ignore[attr-defined]
            _OTHER_SAVES.add(policy)
            warnings.warn(
                f"torchckpt: a block under Offload(tensors=...) saved {hooks.saved} tensors where {policy.expect} "  # type: ignore[attr-defined]
                "were profiled (another input shape, or another branch taken); from now on it offloads every tensor it "
                "saves. Gradients are exact either way; plan again (torchckpt.plan) for this input to get the plan's "
                "memory back.", RuntimeWarning, stacklevel=3)
        return out
    ctx: Any = contextlib.nullcontext()
    if policy.store is not None:
        ctx = policy.store.hooks(_module_tensors(module))
    state = None if torch.compiler.is_compiling() else watched(fn, args, kwargs)  # NOTE [ Mutating forwards ] Rules 2, 7
    fn = guarded(fn, module)  # NOTE [ Buffers written in a forward ]: recomputations leave the buffers as plain autograd
    with ctx:  # the inputs saved at the boundary go to the store
        done = False
        if policy.reentrant and not torch.compiler.is_compiling():  # NOTE [ Reentrant recompute ]
            done, out = run_reentrant(fn, args, kwargs, policy.preserve_rng_state, module,
                                      block_graphs if policy.graphed else None)  # NOTE [ Graphed recompute ]
        if done:  # ran in one node (NOTE [ Reentrant recompute ] Rule 4 leaves some calls to the frame below)
            pass
        elif policy.parts is not None and not torch.compiler.is_compiling():  # NOTE [ Recompute in parts ] Rule 12
            out = run_in_parts(
                fn, args, kwargs, cuts=policy.parts, save=policy.save, store=policy.store, codec=policy.codec,
                preserve_rng_state=policy.preserve_rng_state, determinism_check=policy.determinism_check,
                debug=policy.debug, keep=_module_tensors(module))
        else:
            extra: dict[str, Any] = {}
            if policy.save is not None:  # NOTE [ Selective recompute ]
                extra["context_fn"] = functools.partial(selective_contexts, policy.save, policy.store, policy.codec)
            out = _torch_checkpoint(
                fn,
                *args,
                use_reentrant=False,
                preserve_rng_state=policy.preserve_rng_state,
                determinism_check=policy.determinism_check,
                debug=policy.debug,
                **extra,
                **kwargs,
            )
    if state is not None:  # NOTE [ Mutating forwards ] Rule 2: raises on a change
        check_recomputed(state, out, policy, module if module is not None else fn)
    return out  # type: ignore[no-any-return]


def _unwrapped(forward: Callable[..., Any]) -> Callable[..., Any]:
    return getattr(forward, "_torchckpt_orig", forward)


def _wrap_class(cls: type[nn.Module], policy: Policy) -> type[nn.Module]:
    own = cls.__dict__.get("forward")
    old = getattr(own, "_torchckpt_policy", None)
    if old is policy:
        return cls
    if old is not None:
        warnings.warn(
            f"torchckpt: class {cls.__qualname__} was already decorated with {old!r}; {policy!r} replaces it "
            "(policies on one module do not nest: to nest, checkpoint a submodule).",
            UserWarning,
            stacklevel=3,
        )
    orig = _unwrapped(cls.forward)

    @functools.wraps(orig)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return run(policy, functools.partial(orig, self), *args, module=self, **kwargs)

    forward._torchckpt_orig = orig  # type: ignore[attr-defined]
    forward._torchckpt_policy = policy  # type: ignore[attr-defined]
    cls.forward = forward  # type: ignore[method-assign]
    return cls


class _InstanceForward:
    """The ``forward`` of a module wrapped by ``checkpoint(module, policy=...)`` (NOTE [ checkpoint forms ] Rule 3).

    It lives in the module's ``__dict__`` and refers back to the module, so ``copy.deepcopy`` and
    pickling (which keep the module's identity within one copy) give a copy that runs the copy's
    own parameters under a copy of the policy. ``inner`` is a forward the instance already had
    (set by the user or another library) or ``None``: the class's forward at call time.
    """

    def __init__(self, module: nn.Module, policy: Policy, inner: Callable[..., Any] | None) -> None:
        self.module = module
        self.policy = policy
        self.inner = inner

    @property
    def __wrapped__(self) -> Callable[..., Any]:  # inspect.signature(module.forward) sees the real one
        if self.inner is not None:
            return self.inner
        return types.MethodType(_unwrapped(type(self.module).forward), self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.inner if self.inner is not None else functools.partial(_unwrapped(type(self.module).forward), self.module)
        return run(self.policy, fn, *args, module=self.module, **kwargs)

    def __repr__(self) -> str:
        return f"<forward of {type(self.module).__name__} under {self.policy!r}>"


def _wrap_instance(module: nn.Module, policy: Policy) -> nn.Module:
    current = module.__dict__.get("forward")
    inner = current
    if isinstance(current, _InstanceForward):
        if current.policy is policy and current.module is module:
            return module
        warnings.warn(
            f"torchckpt: this {type(module).__name__} instance was already wrapped with {current.policy!r}; "
            f"{policy!r} replaces it (policies on one module do not nest: to nest, checkpoint a submodule).",
            UserWarning,
            stacklevel=3,
        )
        inner = current.inner
    object.__setattr__(module, "forward", _InstanceForward(module, policy, inner))
    return module


class _ChainForward(_InstanceForward):
    """The ``forward`` of block ``index`` of a ``checkpoint_chain`` (NOTE [ Chain of blocks ] in recompute/chain.py)."""

    def __init__(self, module: nn.Module, policy: Recompute, inner: Callable[..., Any] | None, chain: ChainRuntime,
                 index: int) -> None:
        super().__init__(module, policy, inner)
        self.chain, self.index = chain, index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.inner if self.inner is not None else functools.partial(_unwrapped(type(self.module).forward), self.module)
        fn = guarded(fn, self.module)  # NOTE [ Buffers written in a forward ] Rule 2: the chain's runs again too
        policy = self.policy
        assert isinstance(policy, Recompute)
        if torch.compiler.is_compiling() or _hooks_refused() is not None:  # as run() does: the block alone
            return run(policy, fn, *args, module=self.module, **kwargs)
        return self.chain.call(self.index, fn, args, kwargs,
                               lambda: run(policy, fn, *args, module=self.module, **kwargs), policy.preserve_rng_state)

    def __repr__(self) -> str:
        return f"<forward of {type(self.module).__name__}, block {self.index} of a checkpoint_chain under {self.policy!r}>"


class ChainCheckpoint:
    """A chain of blocks under ``checkpoint_chain``; ``remove()`` puts their forwards back.

    Attributes:
        blocks: the blocks, in order.
        schedule: the schedule the chain follows.
    """

    def __init__(self, blocks: list[nn.Module], chain: ChainRuntime, undo: list[Any]) -> None:
        self.blocks = blocks
        self.schedule = chain.schedule
        self._chain = chain
        self._undo = undo

    @property
    def stats(self) -> ChainStats:
        """What the chain did over its steps: advances run again, the most states held."""
        return self._chain.stats

    def snapshot_stats(self) -> SnapshotStats | None:
        """The ``SnapshotStore``'s counters (host saves, restores, prefetches, hits): the store passed, else the
        latest step's own; ``None`` when no step kept a snapshot off the GPU."""
        return self._chain.snapshot_stats()

    def remove(self) -> None:
        """Put every block's forward back as it was before ``checkpoint_chain``."""
        for mod, prev in reversed(self._undo):
            if prev is None:
                mod.__dict__.pop("forward", None)
            else:
                object.__setattr__(mod, "forward", prev)
        self._undo = []

    def __repr__(self) -> str:
        return f"ChainCheckpoint({len(self.blocks)} blocks, {self.schedule!r})"


def checkpoint_chain(blocks: Sequence[nn.Module], snapshots: int | None = None, *, schedule: Schedule | None = None,
                     policy: Recompute | Sequence[Recompute] | None = None,
                     store: SnapshotStore | None = None) -> ChainCheckpoint:
    """Recompute every block of a chain and keep only some of their inputs: Revolve over the blocks.

    ``checkpoint(block, policy=Recompute())`` on each block keeps every block's input until its
    backward; here only ``snapshots`` inputs stay (block 0's included, as Revolve counts them) and the
    last block's, and backward rebuilds the others by running the blocks again from the nearest one,
    in the order of Griewank and Walther's Revolve, which runs the fewest blocks again for that
    many snapshots (``optimal_forward_steps(n, snapshots) - (n - 1)`` for ``n`` blocks: Revolve's count
    less its forward sweep, which is the model's own calls). The
    blocks must form a chain: called in order once per step, each taking the previous block's
    first output, unchanged, as its first positional argument (HF, timm and ``nn.Sequential``
    layer stacks do); a step that does not keeps its inputs from there on, with a warning
    (NOTE [ Chain of blocks ] in ``recompute/chain.py``). Gradients are those of plain autograd, bit
    for bit, for deterministic blocks.

    A schedule may keep snapshots in host memory or on disk (``Tier.HOST``/``Tier.DISK``:
    ``Multistage(n, gpu_slots=1, host_slots=3)``, ``Revolve(n, s, tier=Tier.HOST)``): those go through a
    ``SnapshotStore``, copied to host behind the computation and prefetched back ahead of their restores
    as the schedule says (exact prefetch, NOTE [ Prefetch setup ]), so the device holds only the GPU-tier
    snapshots, the current state and the store's slots. Every block's input must then have one shape
    and dtype (NOTE [ Chain of blocks ] Rule 8).

    Args:
        blocks: the modules of the chain, in forward order.
        snapshots: how many block inputs to keep (>= 1); the schedule is ``Revolve(len(blocks), snapshots)``.
        schedule: instead of ``snapshots``, any ``torchckpt.schedules`` schedule over ``len(blocks)`` steps
            (e.g. ``WeightedRevolve`` for blocks of unequal cost and size, ``Multistage`` for snapshots on the
            GPU and in host memory); its forward sweep must only save and advance, as Revolve's does.
        policy: the ``Recompute`` each block runs under (or one per block), without a store: ``save=`` and
            ``parts=`` work as for one block. Default ``Recompute()``.
        store: the ``torchckpt.store.SnapshotStore`` for the schedule's off-GPU snapshots (its slots, host
            pool, codec, ``disk=`` directory for ``Tier.DISK``); the chain frees its snapshots after each
            backward and leaves it open. ``None``: each step makes one of 2 slots on the inputs' device
            (with the default store's host pool; ``Tier.DISK`` snapshots then stay in host memory) and closes
            it after its backward.

    Returns:
        A ``ChainCheckpoint``: ``remove()`` undoes it, ``stats`` counts what was run again,
        ``snapshot_stats()`` what the snapshot store did.

    Example::

        >>> import torchckpt
        >>> blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(6)])
        >>> chain = torchckpt.checkpoint_chain(list(blocks), snapshots=2)
        >>> blocks(torch.randn(4, 8, requires_grad=True)).sum().backward()
        >>> chain.stats.advances  # blocks run again: Revolve's optimum less the 5 steps of the forward sweep
        3
        >>> torchckpt.schedules.optimal_forward_steps(6, 2) - 5
        3
        >>> chain.remove()
        >>> from torchckpt.schedules import Multistage  # one snapshot on the device, two in host memory
        >>> chain = torchckpt.checkpoint_chain(list(blocks), schedule=Multistage(6, gpu_slots=1, host_slots=2))
        >>> blocks(torch.randn(4, 8, requires_grad=True)).sum().backward()
        >>> chain.stats.host_saves, chain.snapshot_stats().misses
        (2, 0)
        >>> chain.remove()
    """
    mods = list(blocks) if isinstance(blocks, (list, tuple, nn.ModuleList, nn.Sequential)) else None
    if mods is None or not mods:
        raise TypeError(f"torchckpt: checkpoint_chain(blocks, ...) expects a non-empty list of nn.Module blocks in "
                        f"forward order, got {found(blocks)}; pass e.g. list(model.layers).")
    bad = next((k for k, m in enumerate(mods) if not isinstance(m, nn.Module)), None)
    if bad is not None:
        raise TypeError(f"torchckpt: checkpoint_chain(blocks, ...) expects a non-empty list of nn.Module blocks in "
                        f"forward order, got {found(mods[bad])} at index {bad}; pass modules, e.g. list(model.layers) "
                        "(a function can be wrapped in a module, or checkpointed alone with torchckpt.checkpoint(fn, ...)).")
    if len({id(m) for m in mods}) != len(mods):
        raise ValueError("torchckpt: checkpoint_chain(blocks, ...) got a module twice; a chain runs each block once a "
                         "step: pass each block once.")
    if isinstance(policy, (str, type)):
        raise TypeError(f"torchckpt: checkpoint_chain(policy=...) takes Recompute() without a store, or one per block, "
                        f"got {found(policy)}; policies are values: pass e.g. policy=torchckpt.Recompute().")
    policies = list(policy) if isinstance(policy, Sequence) else [policy if policy is not None else Recompute()] * len(mods)
    if len(policies) != len(mods):
        raise ValueError(f"torchckpt: checkpoint_chain got {len(mods)} blocks and {len(policies)} policies; pass one "
                         "Recompute or one per block.")
    for p in policies:
        if not isinstance(p, Recompute) or p.store is not None:
            raise TypeError(f"torchckpt: checkpoint_chain(policy=...) takes Recompute() without a store (the chain keeps "
                            f"its inputs by its schedule; pass store=SnapshotStore(...) for snapshots off the GPU), "
                            f"got {p!r}.")
    for k, m in enumerate(mods):
        if isinstance(m.__dict__.get("forward"), _InstanceForward):
            raise ValueError(f"torchckpt: block {k} of checkpoint_chain is already checkpointed "
                             f"({m.__dict__['forward']!r}); remove that first (ChainCheckpoint.remove(), Applied.remove()).")
    if snapshots is not None and (isinstance(snapshots, bool) or not isinstance(snapshots, int)):
        raise TypeError(f"torchckpt: checkpoint_chain(snapshots=...) takes an int >= 1 (block inputs kept, block 0's "
                        f"included), got {found(snapshots)}; pass e.g. snapshots=4.")
    if snapshots is not None and snapshots < 1:
        raise ValueError(f"torchckpt: checkpoint_chain(snapshots=...) takes an int >= 1 (block inputs kept, block 0's "
                         f"included), got {snapshots!r}; pass e.g. snapshots=4.")
    chain = ChainRuntime(len(mods), snapshots, schedule, store)
    undo: list[Any] = []
    for k, (m, p) in enumerate(zip(mods, policies)):
        prev = m.__dict__.get("forward")
        undo.append((m, prev))
        object.__setattr__(m, "forward", _ChainForward(m, p, prev, chain, k))
    return ChainCheckpoint(mods, chain, undo)


def _wrap_function(fn: Callable[..., T], policy: Policy) -> Callable[..., T]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> T:
        return run(policy, fn, *args, **kwargs)

    return wrapped


def _decorator(policy: Policy) -> Callable[[Any], Any]:
    def decorate(obj: Any) -> Any:
        if isinstance(obj, type):
            return _wrap_class(_check_module_class(obj), policy)
        if isinstance(obj, nn.Module):
            return _wrap_instance(obj, policy)
        if callable(obj):
            return _wrap_function(obj, policy)
        raise TypeError(
            f"torchckpt: checkpoint(policy) decorates a function, an nn.Module class or an nn.Module, "
            f"got {type(obj).__name__}."
        )

    return decorate


def _check_module_class(cls: type) -> type[nn.Module]:
    if not issubclass(cls, nn.Module):
        raise TypeError(
            f"torchckpt: @checkpoint decorates nn.Module subclasses, got class {cls.__name__}; "
            "decorate its method or call checkpoint(fn, *args, policy=...) instead."
        )
    return cls


def _check_callable_without_arguments(fn: Callable[..., Any]) -> None:
    """NOTE [ checkpoint forms ] Rule 4: ``checkpoint(fn)`` calls ``fn()``; say so when ``fn`` cannot be called that way."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check (some builtins): let the call speak
        return
    try:
        sig.bind()
    except TypeError:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise TypeError(
            f"torchckpt: checkpoint({name}) with no call arguments calls {name}() under the policy, as "
            f"torch.utils.checkpoint.checkpoint does, but {name} takes arguments {sig}. To make a "
            "checkpointed function, decorate it with @torchckpt.checkpoint() or @torchckpt.checkpoint(policy); "
            "to call it, pass its arguments: checkpoint(fn, *args, policy=...)."
        ) from None


def _check_torch_keywords(kwargs: dict[str, Any]) -> None:
    use_reentrant = kwargs.pop("use_reentrant", None)
    if use_reentrant not in (None, False):
        raise ValueError(
            f"torchckpt: checkpoint(..., use_reentrant={use_reentrant!r}): torchckpt runs torch.utils.checkpoint's "
            "non-reentrant path only; pass use_reentrant=False or leave it out."
        )
    given = [k for k in _TORCH_KEYWORDS if k in kwargs]
    if given:
        raise TypeError(
            f"torchckpt: checkpoint(..., {given[0]}=...) is a torch.utils.checkpoint option, not an argument of the "
            "block; set it on the policy instead, e.g. policy=torchckpt.Recompute(preserve_rng_state=False) "
            "(context_fn is not supported)."
        )


@overload
def checkpoint(target: Policy | None = None, *, policy: Policy | None = None) -> Callable[[T], T]: ...
@overload
def checkpoint(target: type[nn.Module], *, policy: Policy | None = None) -> type[nn.Module]: ...
@overload
def checkpoint(target: nn.Module, *, policy: Policy | None = None) -> nn.Module: ...
@overload
def checkpoint(target: Callable[..., T], *args: Any, policy: Policy | None = None, **kwargs: Any) -> T: ...


def checkpoint(target: Any = None, *args: Any, policy: Policy | None = None, **kwargs: Any) -> Any:
    """Apply a checkpoint policy to a module class, a module instance, a function, or one call.

    The form follows from ``target`` (NOTE [ checkpoint forms ]):
        - ``checkpoint()``, ``checkpoint(policy)`` or ``checkpoint(policy=policy)``: a decorator,
          for a function (``@checkpoint(Offload(store))`` above ``def``), a class or an instance.
        - ``@checkpoint`` or ``@checkpoint(policy)`` on an ``nn.Module`` subclass: every instance
          runs ``forward`` under the policy.
        - ``checkpoint(module)``, ``checkpoint(module, policy=...)`` or ``checkpoint(module, policy)``
          with no call arguments: wraps that instance (``state_dict`` keys unchanged) and
          returns it. Wrapping it, or decorating a class, again replaces the policy with a warning.
        - ``checkpoint(fn, *args, policy=..., **kwargs)``, and ``checkpoint(module, *args, ...)``
          with arguments: calls ``fn(*args, **kwargs)`` under the policy, like
          ``torch.utils.checkpoint.checkpoint(fn, *args)``, for any number of arguments, zero
          included. So a bare ``@checkpoint`` on a function would call it: write
          ``@checkpoint()``. To call a module that takes no arguments, use ``checkpoint(module.__call__)``.
    A policy is never a call argument: ``checkpoint(target, policy)`` is ``checkpoint(target, policy=policy)``.
    The default policy is ``Recompute()``.

    Args:
        target: a policy (returns a decorator), a module class, a module, or a callable.
        *args: arguments of the call form.
        policy: ``Recompute()``, ``Offload(store)`` or ``Keep()``; ``None``: ``Recompute()``.
        **kwargs: keyword arguments of the call form.

    Returns:
        A decorator, the decorated class, the wrapped module, or the call's result.

    Example::

        >>> import torchckpt
        >>> lin = torchckpt.checkpoint(torch.nn.Linear(8, 8), policy=torchckpt.Recompute())
        >>> lin(torch.randn(2, 8, requires_grad=True)).sum().backward()
        >>> lin.weight.grad.shape
        torch.Size([8, 8])
        >>> @torchckpt.checkpoint(torchckpt.Recompute())
        ... def block(x):
        ...     return x.sin().exp()
        >>> block(torch.randn(3, requires_grad=True)).shape
        torch.Size([3])
    """
    if target is None or isinstance(target, _POLICY_TYPES):  # NOTE [ checkpoint forms ] Rule 1
        if args or kwargs:
            raise TypeError(
                "torchckpt: checkpoint(policy) returns a decorator and takes no call arguments; "
                "to call a block, pass it first: checkpoint(fn, *args, policy=...)."
            )
        if target is not None and policy is not None:
            raise TypeError("torchckpt: checkpoint(policy, policy=...) got the policy twice; pass it once.")
        return _decorator(_check_policy("checkpoint(policy=...)", target if target is not None else policy))
    if _looks_like_policy(target):
        raise _bad_policy("checkpoint(policy)", target)
    if args and isinstance(args[0], _POLICY_TYPES) and len(args) == 1 and not kwargs:  # NOTE [ checkpoint forms ] Rule 5
        if policy is not None:
            raise TypeError(f"torchckpt: checkpoint(target, {args[0]!r}, policy={policy!r}) got the policy twice; pass it once.")
        policy, args = args[0], ()
    elif len(args) == 1 and not kwargs and _looks_like_policy(args[0]):
        raise _bad_policy("checkpoint(target, policy)", args[0])
    pol = _check_policy("checkpoint(..., policy=...)", policy)
    if isinstance(target, type):  # NOTE [ checkpoint forms ] Rule 2
        if args or kwargs:
            raise TypeError(
                f"torchckpt: checkpoint(cls) decorates the class {target.__name__} and takes no call arguments; "
                "to checkpoint one call, pass an instance: checkpoint(module, *args, policy=...)."
            )
        return _wrap_class(_check_module_class(target), pol)
    if isinstance(target, nn.Module) and not args and not kwargs:  # NOTE [ checkpoint forms ] Rule 3
        return _wrap_instance(target, pol)
    if not callable(target):
        raise TypeError(
            f"torchckpt: checkpoint() expects a policy, an nn.Module class or instance, or a callable, "
            f"got {type(target).__name__}."
        )
    for i, a in enumerate(args):
        if isinstance(a, _POLICY_TYPES):
            raise TypeError(
                f"torchckpt: checkpoint(fn, *args) got the policy {a!r} as call argument {i}; "
                "a policy is never a call argument: pass it as policy=..."
            )
    _check_torch_keywords(kwargs)
    if not args and not kwargs:
        _check_callable_without_arguments(target)
    return run(pol, target, *args, module=target if isinstance(target, nn.Module) else None, **kwargs)  # NOTE [ checkpoint forms ] Rule 4
