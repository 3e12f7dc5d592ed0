"""``auto``: plan a model on its first training call, then run every step under the plan."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from torchckpt._args import parse_bytes
from torchckpt.codecs.base import Codec
from torchckpt.planner.checks import check_args
from torchckpt.planner.plan import Applied, Plan
from torchckpt.planner.profiling import _leaves
from torchckpt.planner.verify import _Profiled
from torchckpt.planner.restore import untouched

__all__ = ["AutoPlan", "auto"]


class AutoPlan:
    """What ``auto`` returns: the plan once the first step has made it (``plan``), and ``remove()``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.plan: Plan | None = None
        self.applied: Applied | None = None
        self._hook: Any = None

    def remove(self) -> None:
        """Stop planning (if the first step has not come) or take the plan off the model."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.applied is not None:
            self.applied.remove()
            self.applied = None


def auto(model: nn.Module, *, budget: int | str, codec: Codec | None = None, blocks: Sequence[nn.Module] | None = None,
         loss_fn: Callable[[Any], torch.Tensor] | None = None, verify: bool = True, progress: bool = False) -> AutoPlan:
    """Plan ``model`` on its first training step, then run every step under the plan.

    The first call of ``model`` with gradients enabled is profiled and planned as ``plan`` does
    (its own steps, on that call's arguments), then the call goes on under the plan. Those extra
    steps leave no trace: the parameters' and the arguments' ``.grad``, the model's buffers (batch
    norm statistics) and the RNG states are put back as they were, so the first step computes
    what it would have without ``auto``. Arguments as for ``plan`` (``progress``: print each phase
    of that planning to stderr).

    Returns:
        An ``AutoPlan``: ``.plan`` once made, ``.remove()``.

    Example::

        >>> import torch, torchckpt
        >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4)])
        >>> a = torchckpt.auto(model, budget=10**9)
        >>> model(torch.randn(32, 64)).square().mean().backward()
        >>> [b.mode for b in a.plan.blocks]
        ['keep', 'keep', 'keep', 'keep']
    """
    check_args("auto", model, None, codec, blocks, loss_fn, None, verify, progress)
    nbytes = parse_bytes(budget, "auto(budget=...)")
    handle = AutoPlan(model)

    def first_call(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        if not torch.is_grad_enabled():
            return None
        handle._hook.remove()
        handle._hook = None
        # the planner's steps start from this call's inputs: the caller's graph before them is differentiated once,
        # by this step
        a, kw = _leaves((args, kwargs))
        with untouched(model, (a, kw)):  # NOTE [ Planning leaves no trace ]
            planned = _Profiled.prepare(model, a, kw, codec, blocks, loss_fn, None, verify, progress=progress, call="auto")
            handle.plan = planned.plan(nbytes)
        handle.applied = handle.plan.apply(model, codec=codec)
        return handle.applied.cache_off(mod, args, kwargs)  # NOTE [ Mutating forwards ] Rule 6: this call too

    # first: before the hooks of FSDP2 (which gathers the root's parameters) and the user's, which the planner's steps
    # run as a training call does
    handle._hook = model.register_forward_pre_hook(first_call, with_kwargs=True, prepend=True)
    return handle
