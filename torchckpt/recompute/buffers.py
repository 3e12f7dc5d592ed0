"""The buffers a block's forward writes (batch norm's running statistics), kept as plain autograd leaves them.

# NOTE [ Buffers written in a forward ]
# 1. A recomputation runs a block's forward again, and a forward that writes its module's buffers in place
#    (batch norm in training updates ``running_mean``, ``running_var`` and ``num_batches_tracked``) writes them
#    again: with ``torch.utils.checkpoint`` the statistics move twice a step, and a forward that reads a buffer
#    after writing it recomputes from the wrong value. ``BufferGuard`` wraps the block's function for one
#    call and its recomputations: the call clones the module's buffers before running, and after it keeps
#    the clones of the written ones (the others are dropped at once): those whose version moved, and the
#    running statistics of batch norm (and instance norm with running statistics) in training, whose kernels
#    write them without moving their version (``native_batch_norm``'s schema does not mark them written).
# 2. Each recomputation (``torch.utils.checkpoint``'s, each part of ``Recompute(parts=...)``, each run of
#    ``checkpoint_chain``) first notes the written buffers' values (as the forward left them, or as the
#    step has them since), puts the values the forward started from back, runs, then puts the noted values
#    back. So the recomputation computes what the forward computed, and the buffers end the step as they
#    would without torchckpt: batch norm's statistics move once a step (tested bit for bit against plain
#    autograd, with every form of ``Recompute`` and with ``checkpoint_chain``).
# 3. The writes go through ``.data``, which bumps no version counter: autograd's check on the tensors the
#    block saved (NOTE [ Saved tensor identity ] Rule 1) sees the buffers as the forward left them. They run
#    with every dispatch mode set aside, so ``Recompute(save=...)``'s op count (NOTE [ Selective recompute ]
#    Rule 1) does not see them.
# 4. Only the buffers of the ``module`` handed to ``api.run`` (the wrapped block's) are guarded, and only
#    written in place: a buffer rebound to a new tensor is not seen (the planner's profile watches for that,
#    NOTE [ Mutating forwards ] Rule 5). Nothing is done while Dynamo traces, for a module without buffers, or
#    without grad (nothing is recomputed).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["BufferGuard", "guarded"]


class BufferGuard:
    """``fn`` for one forward of ``module`` and its recomputations (NOTE [ Buffers written in a forward ])."""

    __slots__ = ("always", "buffers", "calls", "fn", "written")

    def __init__(self, fn: Callable[..., Any], buffers: list[torch.Tensor],
                 always: frozenset[int] = frozenset()) -> None:
        # always: ids of the buffers written without moving their version (NOTE [ Buffers written in a forward ] Rule 1)
        self.fn, self.buffers, self.always = fn, buffers, always
        self.calls = 0
        self.written: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, its value when the forward began)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:  # NOTE [ Buffers written in a forward ] Rule 1: the forward
            with _disable_current_modes(), torch.no_grad():
                before = [(b, b._version, b.detach().clone()) for b in self.buffers]
            out = self.fn(*args, **kwargs)
            self.written = [(b, v) for b, seen, v in before if b._version != seen or id(b) in self.always]
            return out
        if not self.written:
            return self.fn(*args, **kwargs)
        with _disable_current_modes(), torch.no_grad():  # NOTE [ Buffers written in a forward ] Rules 2-3
            now = [b.detach().clone() for b, _ in self.written]
            for b, v in self.written:
                b.data.copy_(v)
        try:
            return self.fn(*args, **kwargs)
        finally:
            with _disable_current_modes(), torch.no_grad():
                for (b, _), v in zip(self.written, now):
                    b.data.copy_(v)


def guarded(fn: Callable[..., Any], module: nn.Module | None) -> Callable[..., Any]:
    """``fn`` under a new ``BufferGuard`` for ``module``'s buffers, or ``fn`` itself where there is nothing to guard
    (NOTE [ Buffers written in a forward ] Rule 4)."""
    if module is None or isinstance(fn, BufferGuard) or torch.compiler.is_compiling():
        return fn
    buffers = [b for b in module.buffers() if b is not None]
    if not buffers:
        return fn
    always = frozenset(id(b) for m in module.modules() if isinstance(m, _NormBase) and m.training
                       and m.track_running_stats for b in (m.running_mean, m.running_var) if b is not None)
    return BufferGuard(fn, buffers, always)
