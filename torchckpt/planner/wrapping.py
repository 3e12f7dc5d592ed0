"""Swapping a block's forward for the profiling steps (NOTE [ Profiling step ]): each wrapper is installed as the
module's instance ``forward`` and returns its undo."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["first_output", "follows", "swap_forward", "wrap_block", "wrap_call", "wrap_recomputed"]


def swap_forward(mod: nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Give ``mod`` the instance forward ``make(its current forward)`` for the profiling steps; returns the undo."""
    had = "forward" in mod.__dict__
    inner = mod.__dict__.get("forward", None)
    call = inner if inner is not None else type(mod).forward.__get__(mod)
    object.__setattr__(mod, "forward", make(call))

    def undo() -> None:
        if had:
            object.__setattr__(mod, "forward", inner)
        else:
            del mod.__dict__["forward"]

    return undo


def wrap_block(mod: nn.Module, i: int, rec: Any) -> Callable[[], None]:
    """Run ``mod``'s forward inside ``rec.block(i)`` (NOTE [ Profiling step ] Rules 2-3); returns the undo."""

    def make(call: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            with rec.block(i, args, kwargs):
                out = call(*args, **kwargs)
            rec.output(i, out)
            return out
        return forward

    return swap_forward(mod, make)


def wrap_call(mod: nn.Module, enter: Callable[[], Callable[[], None]]) -> Callable[[], None]:
    """Run ``mod``'s forward between ``enter()`` and what it returns (NOTE [ Profiling step ] Rule 5); returns the undo."""

    def make(call: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*a: Any, **kw: Any) -> Any:
            leave = enter()
            try:
                return call(*a, **kw)
            finally:
                leave()
        return forward

    return swap_forward(mod, make)


def wrap_recomputed(mod: nn.Module, i: int, inputs: list[Any] | None, chained: list[bool] | None = None,
                    last: list[tuple[torch.Tensor, int] | None] | None = None) -> Callable[[], None]:
    """Run ``mod`` under ``torch.utils.checkpoint``, recording its inputs into ``inputs[i]``
    (NOTE [ Profiling step ] Rule 6) and into ``chained[i]`` whether its first positional tensor argument is the
    previous block's first output (``last[0]``, where each block puts its own), unchanged (NOTE [ Profiling step ]
    Rule 10); returns the undo."""

    def make(call: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*a: Any, **kw: Any) -> Any:
            if inputs is not None:
                inputs[i] = (a, kw)
            if chained is not None and last is not None:
                chained[i] = i == 0 or follows(a, last)
            out = torch.utils.checkpoint.checkpoint(call, *a, use_reentrant=False, **kw)
            if last is not None:
                last[:] = [first_output(out)]
            return out
        return forward

    return swap_forward(mod, make)


def first_output(out: Any) -> tuple[torch.Tensor, int] | None:
    """A block's first output tensor and its version, as ``checkpoint_chain`` hands it on (NOTE [ Chain of blocks ]
    Rule 5)."""
    first = next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), None)
    return (first, first._version) if first is not None else None


def follows(args: tuple[Any, ...], last: list[tuple[torch.Tensor, int] | None]) -> bool:
    """Whether the first positional tensor of ``args`` is ``last[0]``'s tensor, unchanged (NOTE [ Profiling step ]
    Rule 10)."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    prev = last[0] if last else None
    return first is not None and prev is not None and first is prev[0] and first._version == prev[1]
