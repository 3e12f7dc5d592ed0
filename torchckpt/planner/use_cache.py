"""The planner and forwards that change state besides their outputs (NOTE [ Mutating forwards ] in recompute/mutation.py).

Two things: transformers' ``use_cache`` turned off for training forwards while the planner runs its steps and
while a plan is applied (NOTE [ Mutating forwards ] Rule 6), as ``gradient_checkpointing_enable()`` does; and the
warning ``plan`` gives for blocks the profiling step saw change state, which it never recomputes
(NOTE [ Mutating forwards ] Rule 5).
"""
from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["UseCacheOff", "use_cache_owners", "warn_mutating"]

_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()  # NOTE [ Mutating forwards ] Rule 6: configs (else modules) whose use_cache was turned off


def _use_cache_at(mod: nn.Module) -> int | None:
    """``mod.forward``'s ``use_cache`` argument: its position (-1: keyword only), or ``None`` when it takes none."""
    try:
        params = list(inspect.signature(mod.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for k, p in enumerate(params):
        if p.name == "use_cache":
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and all(
                    q.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                    for q in params[:k]):
                return k
            return -1 if p.kind is inspect.Parameter.KEYWORD_ONLY or p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD \
                else None
    return None


def use_cache_owners(model: nn.Module, blocks: Sequence[nn.Module] | None = None) -> list[tuple[nn.Module, int]]:
    """NOTE [ Mutating forwards ] Rule 6: the modules of ``model`` with ``config.use_cache`` and a ``use_cache``
    argument that hold one of ``blocks`` (any, when ``None``), with that argument's position (-1: by keyword only)."""
    want = None if blocks is None else {id(b) for b in blocks}
    out = []
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is None or not hasattr(cfg, "use_cache"):
            continue
        at = _use_cache_at(mod)
        if at is None:
            continue
        if want is not None and not any(id(m) in want for m in mod.modules()):
            continue
        out.append((mod, at))
    return out


def _warn_once(mod: nn.Module, cfg: Any) -> None:
    key: Any = cfg
    try:
        weakref.ref(cfg)
        hash(cfg)
    except TypeError:  # a config that cannot be weakly referenced or hashed: once per module instead
        key = mod
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(
        f"torchckpt: {type(mod).__name__} runs training forwards with use_cache=False while torchckpt plans it or a "
        "plan is applied to it: recomputing a block would append its keys and values to the cache a second time "
        "(transformers' gradient_checkpointing_enable() does the same). The cache stays on in evaluation and "
        "without grad (generation); set model.config.use_cache = False to silence this "
        "(NOTE [ Mutating forwards ] Rule 6).", UserWarning, stacklevel=2)


class UseCacheOff:
    """Forward pre-hooks that turn ``use_cache`` off for training forwards (NOTE [ Mutating forwards ] Rule 6).

    A module in training mode called with grad enabled and ``use_cache`` true (passed, or ``config.use_cache``
    when not passed or ``None``) is called with ``use_cache=False`` instead, as transformers'
    ``merge_with_config_defaults`` does under gradient checkpointing; the first time for a config, a warning.

    Args:
        model: the model.
        blocks: the planned blocks: only modules holding one are hooked (``None``: every module with a config).

    Example::

        >>> import types, warnings
        >>> class LM(torch.nn.Module):
        ...     config = types.SimpleNamespace(use_cache=True)
        ...     def forward(self, x, use_cache=None):
        ...         return self.config.use_cache if use_cache is None else use_cache
        >>> lm = LM()
        >>> off = UseCacheOff(lm)
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     lm(torch.ones(1)), lm(torch.ones(1), use_cache=True)
        (False, False)
        >>> with torch.no_grad():
        ...     lm(torch.ones(1))
        True
        >>> off.remove()
        >>> lm(torch.ones(1))
        True
    """

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module] | None = None) -> None:
        owners = use_cache_owners(model, blocks)
        self.at = {id(mod): at for mod, at in owners}
        self.handles = [mod.register_forward_pre_hook(functools.partial(_turn_off, at), with_kwargs=True)
                        for mod, at in owners]

    def adjust(self, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        """What the hook on ``mod`` returns for this call (for a call whose pre-hooks ran before the hooks were
        added: ``auto``'s first call); ``None``: the call as it is."""
        at = self.at.get(id(mod))
        return None if at is None or not self.handles else _turn_off(at, mod, args, kwargs)

    def remove(self) -> None:
        """Take the hooks off."""
        for h in self.handles:
            h.remove()
        self.handles = []


def _turn_off(at: int, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The pre-hook (NOTE [ Mutating forwards ] Rule 6): ``use_cache`` at position ``at`` (-1: keyword only) made
    ``False``, or ``None``."""
    if not (mod.training and torch.is_grad_enabled()):
        return None
    cfg = getattr(mod, "config", None)
    if 0 <= at < len(args) and args[at] is not None:
        if not args[at]:
            return None
        args = (*args[:at], False, *args[at + 1:])
    elif kwargs.get("use_cache") is not None:
        if not kwargs["use_cache"]:
            return None
        kwargs = {**kwargs, "use_cache": False}
    elif getattr(cfg, "use_cache", False):
        kwargs = {**kwargs, "use_cache": False}
    else:
        return None
    _warn_once(mod, cfg)
    return args, kwargs


def warn_mutating(names: Sequence[str], what: Sequence[str]) -> None:
    """NOTE [ Mutating forwards ] Rule 5: say which blocks the profiling step saw change state (``what[i]``: what block
    i changed, ``""``: nothing), and that the plan never recomputes them."""
    found = [(n, w) for n, w in zip(names, what) if w]
    if not found:
        return
    listed = "; ".join(f"{n}: {w}" for n, w in found[:3]) + (f"; and {len(found) - 3} more blocks" if len(found) > 3
                                                               else "")
    warnings.warn(
        f"torchckpt: the forward of {len(found)} of {len(names)} blocks changes state besides its outputs ({listed}). "
        "A recomputation would change it a second time, so the plan keeps or offloads these blocks and never "
        "recomputes them; a budget below what that allows raises PlanError. If the forward should not change that "
        "state in training (a KV cache: use_cache=False), change the model and plan again "
        "(NOTE [ Mutating forwards ] Rule 5).", UserWarning, stacklevel=3)
