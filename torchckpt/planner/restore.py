"""What the planner's own training steps change in a model and its batch, captured and put back.

# NOTE [ Planning leaves no trace ]
# 1. ``plan``, ``plans`` and ``auto`` run steps of the user's model to profile it (NOTE [ Profiling step ]) and to
#    verify plans (NOTE [ Applying a plan ] Rule 4). Around all of them (``untouched``), what such steps change is
#    captured first and put back after, so that training after planning computes what it would have without it,
#    bit for bit:
#    a. every parameter's and every batch leaf tensor's ``.grad``, ``None`` included: set to ``None`` for the
#       planner's steps (a gradient the user holds is never accumulated into) and then put back, the same tensor;
#    b. every buffer's values (batch norm's running statistics and step count), written back in place, and the
#       tensor each module holds under each buffer and parameter name, should a forward rebind one;
#    c. the CPU RNG state and, when CUDA is initialised, every CUDA device's (dropout draws from them);
#    d. each module's ``training`` flag;
#    e. each FSDP2 module resharded (``FSDPModule.reshard()``) first, as a training step leaves it: a forward without
#       backward (NOTE [ Profiling step ] Rule 5) leaves the root's parameters unsharded, and FSDP2 would not know
#       that b. registers the sharded ones again.
# 2. Parameters' values are not copied (a copy would hold a second model on the device while it is profiled): no
#    step of the planner changes them (there is no optimizer step). A forward that writes a parameter in place
#    moves its version counter; that is reported by a warning, as it cannot be put back.
# 3. Everything is put back whether planning returns or raises.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from torchckpt.planner.sharded import fsdp_modules

__all__ = ["ModelState", "untouched"]


class ModelState:
    """The state of ``model`` and of the leaf tensors of its batch that training steps change
    (NOTE [ Planning leaves no trace ] Rule 1).

    Args:
        model: the model.
        batch: what it is called with (the leaf tensors in it that require grad have their ``.grad`` kept).
    """

    def __init__(self, model: nn.Module, batch: Any = ()) -> None:
        mods = list(model.modules())
        leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
        params = list({id(p): p for p in model.parameters()}.values())
        self.grads = [(t, t.grad) for t in params + [t for t in leaves if all(t is not p for p in params)]]
        self.slots = [(m, kind, dict(getattr(m, kind))) for m in mods for kind in ("_parameters", "_buffers")]
        self.buffers = [(b, b.detach().clone()) for b in
                        {id(b): b for m in mods for b in m._buffers.values() if b is not None}.values()]
        self.versions = [(n, p, p._version) for n, p in model.named_parameters()]
        self.training = [(m, m.training) for m in mods]
        self.fsdp = fsdp_modules(model)
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def clear_grads(self) -> None:
        """Set every kept ``.grad`` to ``None``, so that the steps to come allocate their own
        (NOTE [ Planning leaves no trace ] Rule 1a)."""
        for t, _ in self.grads:
            t.grad = None

    def restore(self) -> None:
        """Put everything captured back (NOTE [ Planning leaves no trace ] Rule 1); warn of parameters written in place
        (NOTE [ Planning leaves no trace ] Rule 2)."""
        for m in self.fsdp:  # NOTE [ Planning leaves no trace ] Rule 1e
            m.reshard()
        for m, kind, held in self.slots:
            getattr(m, kind).update(held)
        with torch.no_grad():
            for t, g in self.grads:
                t.grad = g
            for b, saved in self.buffers:
                b.copy_(saved)
        for m, flag in self.training:
            m.training = flag
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        moved = [n for n, p, v in self.versions if p._version != v]
        if moved:
            warnings.warn(f"torchckpt: the planner's steps wrote the parameters {', '.join(moved[:4])}"
                          f"{', ...' if len(moved) > 4 else ''} in place (the model's forward changes them); they are "
                          "not put back. Plan with a forward that leaves its parameters as they are.",
                          RuntimeWarning, stacklevel=4)


@contextlib.contextmanager
def untouched(model: nn.Module, batch: Any = ()) -> Iterator[ModelState]:
    """Run the body with the model's gradients cleared, then put back what training steps change (NOTE [ Planning
    leaves no trace ]).

    Args:
        model: the model the body trains.
        batch: what the body calls it with (its leaf tensors' ``.grad`` are kept too).

    Returns:
        A context manager yielding the captured ``ModelState``.

    Example::

        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
        >>> with untouched(m):
        ...     m(torch.randn(8, 4)).sum().backward()
        >>> m[0].weight.grad is None, int(m[1].num_batches_tracked)
        (True, 0)
    """
    state = ModelState(model, batch)
    try:
        state.clear_grads()
        yield state
    finally:
        state.restore()
