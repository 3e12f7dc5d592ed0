"""Each aten op of a block's forward timed and sized (NOTE [ Profiling step ] Rule 5): what the planner weighs
when it keeps ops' outputs instead of recomputing them (``Recompute(save=...)``)."""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from torchckpt._errors import internal_error
from torchckpt.planner.measure import Clock
from torchckpt.recompute.selective import OpCounter, keepable

__all__ = ["OpCost", "OpTimer", "SAC_OPS", "less_gaps", "median_ops"]

# NOTE [ Plan search ] Rule 7: the ops whose outputs torch SAC users save (matmuls, attention), by overload name
SAC_OPS = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
    "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
})



@dataclasses.dataclass(frozen=True)
class OpCost:
    """One aten op of a block's forward (NOTE [ Profiling step ] Rule 5).

    Attributes:
        position: its position among the block's ops, as ``Recompute(save=...)`` counts them.
        op: the op overload's name.
        nbytes: bytes of its outputs when ``Recompute(save=...)`` could keep them (``keepable``),
            else 0 (views, outputs sharing an input's memory, in-place and random ops).
        seconds: its time.
    """

    position: int
    op: str
    nbytes: int
    seconds: float



def _never_unpacked(_: Any) -> torch.Tensor:  # pragma: no cover - the op-timing forward is never differentiated
    raise internal_error("the op-timing forward was differentiated")


class OpTimer(OpCounter):
    """Times each aten op of each block's forward and sizes its new outputs (NOTE [ Profiling step ] Rule 5)."""

    def __init__(self, n: int, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.current: int | None = None
        self.raw: list[list[tuple[int, str, int, Any, Any]]] = [[] for _ in range(n)]
        self.packs: list[list[int]] = [[] for _ in range(n)]  # per block: ops dispatched as each tensor was saved

    def pack(self, t: torch.Tensor) -> None:
        # Keep nothing: this forward is never differentiated, and a pack hook that returns the tensor itself makes
        # each saved output hold its own grad_fn, a cycle through the autograd graph that Python's collector cannot
        # see: the whole forward's graph leaked with every profile (one step of activations on the device).
        if self.current is not None:
            self.packs[self.current].append(self.k)
        return None

    def __enter__(self) -> OpTimer:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _never_unpacked)
        self._hooks.__enter__()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._hooks.__exit__(*exc)

    def op(self, k: int, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        i = self.current
        if i is None:
            return func(*args, **kwargs)
        a = self.clock.mark()
        out = func(*args, **kwargs)
        b = self.clock.mark()
        nbytes = 0
        if keepable(func, args, kwargs, out):  # what Recompute(save=...) could keep
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
            nbytes = sum(storages.values())
        self.raw[i].append((k, str(func), nbytes, a, b))
        return out


def median_ops(runs: Sequence[tuple[tuple[OpCost, ...], ...]]) -> tuple[tuple[OpCost, ...], ...]:
    """The first run's ops, each with its median time over the runs that went through the block's ops alike
    (NOTE [ Profiling step ] Rule 9)."""
    out = []
    for i, mine in enumerate(runs[0]):
        alike = [r[i] for r in runs if [o.op for o in r[i]] == [o.op for o in mine]]
        out.append(tuple(dataclasses.replace(o, seconds=statistics.median([r[k].seconds for r in alike]))
                         for k, o in enumerate(mine)))
    return tuple(out)


def less_gaps(seconds: Sequence[float], total: float) -> list[float]:
    """Op times less the gap the timer opened around each (NOTE [ Profiling step ] Rule 5): the same amount off every op
    (none below 0), chosen so that they sum to the block's measured forward ``total``; unchanged when they already fit in it."""
    if sum(seconds) <= total or not seconds:
        return list(seconds)
    lo, hi = 0.0, max(seconds)
    for _ in range(60):  # bisection on the gap: sum(max(0, s - gap)) falls as the gap grows
        gap = (lo + hi) / 2
        if sum(max(0.0, t - gap) for t in seconds) > total:
            lo = gap
        else:
            hi = gap
    return [max(0.0, t - hi) for t in seconds]
