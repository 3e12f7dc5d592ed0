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
#    ``checkpoint_chain``) first notes the values of the written buffers and of Rule 1's norm buffers (as the
#    forward left them, or as the step has them since), puts the values the forward started from back into
#    the written ones, runs, then puts the noted values back, with one foreach copy each way. So the
#    recomputation computes what the forward computed, and the buffers end the step as they would without
#    torchckpt: batch norm's statistics move once a step (tested bit for bit against plain autograd, with
#    every form of ``Recompute`` and with ``checkpoint_chain``).
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
from torch.nn.modules.batchnorm import SyncBatchNorm, _BatchNorm, _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["BufferGuard", "guarded"]


_STOCK_NORMS = (_BatchNorm.forward, SyncBatchNorm.forward, _InstanceNorm.forward)  # NOTE [ Buffers written in a forward ] Rule 1


class BufferGuard:
    """``fn`` for one forward of a module and its recomputations (NOTE [ Buffers written in a forward ]).

    Args:
        fn: the block's function.
        buffers: the module's buffers cloned at the call (NOTE [ Buffers written in a forward ] Rule 1).
        norms: the running statistics of torch's own norms in training, restored after each recomputation only.
        unseen: ids of ``buffers`` written without moving their version: the running statistics of other norms
            (subclasses with their own ``forward``) in training.
    """

    __slots__ = ("buffers", "calls", "fn", "norms", "unseen", "written")

    def __init__(self, fn: Callable[..., Any], buffers: list[torch.Tensor], norms: list[torch.Tensor],
                 unseen: frozenset[int] = frozenset()) -> None:
        self.fn, self.buffers, self.norms, self.unseen = fn, buffers, norms, unseen
        self.calls = 0
        self.written: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, its value when the forward began)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:  # NOTE [ Buffers written in a forward ] Rule 1: the forward
            if not self.buffers:
                return self.fn(*args, **kwargs)
            with _disable_current_modes(), torch.no_grad():
                seen = [b._version for b in self.buffers]
                before = _copies(self.buffers)
            out = self.fn(*args, **kwargs)
            self.written = [(b, v) for b, s, v in zip(self.buffers, seen, before)
                            if b._version != s or id(b) in self.unseen]
            return out
        held = [b for b, _ in self.written] + self.norms
        if not held:
            return self.fn(*args, **kwargs)
        with _disable_current_modes(), torch.no_grad():  # NOTE [ Buffers written in a forward ] Rules 2-3
            now = _copies(held)
            if self.written:
                torch._foreach_copy_([b.data for b, _ in self.written], [v for _, v in self.written])
        try:
            return self.fn(*args, **kwargs)
        finally:
            with _disable_current_modes(), torch.no_grad():
                torch._foreach_copy_([b.data for b in held], now)


def _copies(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``ts``, bit for bit (times one: -0.0 and NaNs kept), in one foreach launch per dtype and device."""
    return list(torch._foreach_mul([t.detach() for t in ts], 1))


def guarded(fn: Callable[..., Any], module: nn.Module | None) -> Callable[..., Any]:
    """``fn`` under a new ``BufferGuard`` for ``module``'s buffers, or ``fn`` itself where there is nothing to guard
    (NOTE [ Buffers written in a forward ] Rule 4)."""
    if module is None or isinstance(fn, BufferGuard) or torch.compiler.is_compiling():
        return fn
    norms: dict[int, torch.Tensor] = {}
    unseen: set[int] = set()
    buffers: dict[int, torch.Tensor] = {}  # one walk of the modules (a block's call pays it: NOTE [ Buffers written in a forward ] Rule 4)
    for m in module.modules():
        own = m._buffers
        if not own:
            continue
        if isinstance(m, _NormBase) and m.training and m.track_running_stats:
            stats = [b for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
            if type(m).forward in _STOCK_NORMS:
                norms.update((id(b), b) for b in stats)
            else:
                unseen.update(id(b) for b in stats)
        buffers.update((id(b), b) for b in own.values() if b is not None)
    if not buffers:
        return fn
    rest = [b for k, b in buffers.items() if k not in norms]
    return BufferGuard(fn, rest, list(norms.values()), frozenset(unseen))
