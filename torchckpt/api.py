"""User-facing entry points: ``checkpoint`` (decorator, wrapper, call) and ``offload``."""
from __future__ import annotations

import contextlib
import functools
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from torchckpt.policies import Keep, Offload, Policy, Recompute
from torchckpt.store import Store

T = TypeVar("T")
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


def _device_of(args: Iterable[Any]) -> torch.device | None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type != "cpu":
            return a.device
    return None


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
        raise TypeError(f"torchckpt: offload(store=...) expects a torchckpt.Store, got {type(store).__name__}.")
    return store.hooks(keep)


def _module_tensors(module: nn.Module | None) -> list[torch.Tensor]:
    if module is None:
        return []
    return [*module.parameters(), *module.buffers()]


def run(policy: Policy, fn: Callable[..., T], *args: Any, module: nn.Module | None = None, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` under ``policy``.

    Args:
        policy: ``Recompute()``, ``Offload(...)`` or ``Keep()``.
        fn: the block.
        module: the module ``fn`` belongs to: its parameters and buffers (and views of
            them) stay by reference.

    Returns:
        Whatever ``fn`` returns (tensors, tuples, non-tensor values).
    """
    if isinstance(policy, Keep) or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if isinstance(policy, Offload):
        store = policy.store or default_store(_device_of(args))
        with store.hooks(_module_tensors(module), policy.codec):
            return fn(*args, **kwargs)
    if isinstance(policy, Recompute):
        ctx: Any = contextlib.nullcontext()
        if policy.store is not None:
            ctx = policy.store.hooks(_module_tensors(module))
        with ctx:  # the inputs saved at the boundary go to the store
            return _torch_checkpoint(  # type: ignore[return-value]
                fn,
                *args,
                use_reentrant=False,
                preserve_rng_state=policy.preserve_rng_state,
                determinism_check=policy.determinism_check,
                debug=policy.debug,
                **kwargs,
            )
    raise TypeError(
        f"torchckpt: policy must be Recompute(), Offload(...) or Keep(), got {policy!r}; "
        "policies are values: pass policy=torchckpt.Offload() rather than a string."
    )


def _check_policy(policy: Any) -> Policy:
    if policy is None:
        return Recompute()
    if not isinstance(policy, (Recompute, Offload, Keep)):
        raise TypeError(
            f"torchckpt: policy must be Recompute(), Offload(...) or Keep(), got {policy!r}; "
            "policies are values: pass policy=torchckpt.Offload() rather than a string."
        )
    return policy


def _wrap_class(cls: type[nn.Module], policy: Policy) -> type[nn.Module]:
    orig = getattr(cls.forward, "_torchckpt_orig", cls.forward)

    @functools.wraps(orig)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return run(policy, functools.partial(orig, self), *args, module=self, **kwargs)

    forward._torchckpt_orig = orig  # type: ignore[attr-defined]
    forward._torchckpt_policy = policy  # type: ignore[attr-defined]
    cls.forward = forward  # type: ignore[method-assign]
    return cls


def _instance_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # A bound method stored on the instance: copy.deepcopy rebinds it to the copy, which then
    # runs with its own parameters and policy.
    orig = self.__dict__["_torchckpt_orig"]
    return run(self.__dict__["_torchckpt_policy"], orig.__get__(self), *args, module=self, **kwargs)


def _wrap_instance(module: nn.Module, policy: Policy) -> nn.Module:
    cls_forward = type(module).forward
    object.__setattr__(module, "_torchckpt_orig", getattr(cls_forward, "_torchckpt_orig", cls_forward))
    object.__setattr__(module, "_torchckpt_policy", policy)
    object.__setattr__(module, "forward", types.MethodType(_instance_forward, module))
    return module


def _wrap_function(fn: Callable[..., T], policy: Policy) -> Callable[..., T]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> T:
        return run(policy, fn, *args, **kwargs)

    return wrapped


@overload
def checkpoint(target: Policy | None = None, *, policy: Policy | None = None) -> Callable[[T], T]: ...
@overload
def checkpoint(target: type[nn.Module], *, policy: Policy | None = None) -> type[nn.Module]: ...
@overload
def checkpoint(target: nn.Module, *, policy: Policy | None = None) -> nn.Module: ...
@overload
def checkpoint(target: Callable[..., T], *args: Any, policy: Policy | None = None, **kwargs: Any) -> T: ...


def checkpoint(target: Any = None, *args: Any, policy: Policy | None = None, **kwargs: Any) -> Any:
    """Apply a checkpoint policy to a module class, a module instance, or one call.

    Forms:
        - ``@checkpoint`` or ``@checkpoint(Offload(store))`` on an ``nn.Module`` subclass:
          every instance runs ``forward`` under the policy.
        - ``checkpoint(module, policy=...)`` (or ``checkpoint(module, policy)``): wraps that instance (its ``state_dict`` keys are
          unchanged) and returns it.
        - ``checkpoint(fn, *args, policy=..., **kwargs)``: calls ``fn`` under the policy, like
          ``torch.utils.checkpoint.checkpoint(fn, *args)``.
        - ``@checkpoint`` / ``@checkpoint(policy)`` on a function, or ``checkpoint(fn)`` with no
          arguments: returns ``fn`` wrapped to run under the policy.
    The default policy is ``Recompute()``.

    Args:
        target: a policy (returns a decorator), a module class, a module, or a callable.
        *args: arguments of the call form.
        policy: the policy when ``target`` is not one.
        **kwargs: keyword arguments of the call form.

    Returns:
        The decorated class, the wrapped module, or the call's result.

    Example::

        >>> import torchckpt
        >>> lin = torchckpt.checkpoint(torch.nn.Linear(8, 8), policy=torchckpt.Recompute())
        >>> lin(torch.randn(2, 8, requires_grad=True)).sum().backward()
        >>> lin.weight.grad.shape
        torch.Size([8, 8])
    """
    if target is None or isinstance(target, (Recompute, Offload, Keep)):
        if args or kwargs:
            raise TypeError("torchckpt: checkpoint(policy) takes no call arguments; use checkpoint(fn, *args, policy=...).")
        pol = _check_policy(target if target is not None else policy)
        return lambda obj: checkpoint(obj, policy=pol)
    if policy is None and len(args) == 1 and not kwargs and isinstance(args[0], (Recompute, Offload, Keep)):
        policy, args = args[0], ()  # checkpoint(module, Offload(store)): a policy is never a call argument
    pol = _check_policy(policy)
    if isinstance(target, type):
        if not issubclass(target, nn.Module):
            raise TypeError(f"torchckpt: @checkpoint decorates nn.Module subclasses, got class {target.__name__}.")
        if args or kwargs:
            raise TypeError("torchckpt: decorating a class takes no call arguments.")
        return _wrap_class(target, pol)
    if isinstance(target, nn.Module) and not args and not kwargs:
        return _wrap_instance(target, pol)
    if callable(target) and not args and not kwargs:  # @checkpoint on a function: decorate it
        return _wrap_function(target, pol)
    if not callable(target):
        raise TypeError(
            f"torchckpt: checkpoint() expects a policy, an nn.Module class or instance, or a callable, "
            f"got {type(target).__name__}."
        )
    return run(pol, target, *args, **kwargs)
