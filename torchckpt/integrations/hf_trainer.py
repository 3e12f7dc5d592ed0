"""transformers' ``Trainer`` under the planner: ``Trainer(..., callbacks=[PlanCallback(budget="6GiB")])``.

The callback calls ``torchckpt.auto`` on the model when training begins: the first training step is profiled and
planned (its own steps leave no trace: NOTE [ Planning leaves no trace ]) and every step runs under the plan; when
training ends the plan is taken off, so evaluation and generation afterwards run the model as it was. The plan
turns transformers' ``use_cache`` off for training forwards, as ``gradient_checkpointing_enable()`` does
(NOTE [ Mutating forwards ] Rule 6). Gradients are those of the same Trainer without the callback, bit for bit
(tested on the CPU), except with a lossy ``codec``.

transformers' own switch, ``gradient_checkpointing_enable()`` (``activation_checkpointing_enable()`` in 5.x),
runs ``torch.utils.checkpoint`` on every layer: leave it off with this callback (the planner decides per layer).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from torchckpt._args import parse_bytes
from torchckpt.codecs.base import Codec
from torchckpt.planner import AutoPlan, Plan, auto

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the module is for transformers' users
    raise ImportError("torchckpt: torchckpt.integrations.hf_trainer needs transformers and accelerate "
                      "(pip install transformers accelerate); without them use torchckpt.auto(model, budget=...) "
                      "before your own training loop.") from e

__all__ = ["PlanCallback"]


class PlanCallback(TrainerCallback):  # type: ignore[misc]
    """Plan the Trainer's model under ``budget`` on its first training step (``torchckpt.auto``), and take the plan
    off when training ends.

    Args:
        budget: device bytes one training step may add (``int`` or e.g. ``"6GiB"``), as for ``torchckpt.plan``.
        codec / blocks / loss_fn / verify / progress: as for ``torchckpt.auto``. ``loss_fn`` maps the model's
            output to the scalar the profile differentiates (default: its ``.loss``, which the model computes when
            the batch holds ``labels``).

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[PlanCallback(budget="6GiB")])
        trainer.train()
        trainer.callback_handler.callbacks[-1].plan.explain()
    """

    def __init__(self, budget: int | str, *, codec: Codec | None = None, blocks: Sequence[nn.Module] | None = None,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None, verify: bool = True,
                 progress: bool = False) -> None:
        parse_bytes(budget, "PlanCallback(budget=...)")  # a bad budget fails here, not at the first step
        self.budget, self.codec, self.blocks, self.loss_fn = budget, codec, blocks, loss_fn
        self.verify, self.progress = verify, progress
        self.auto: AutoPlan | None = None

    @property
    def plan(self) -> Plan | None:
        """The plan, once the first training step has made it."""
        return self.auto.plan if self.auto is not None else None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError("torchckpt: PlanCallback needs the Trainer's model in on_train_begin; pass it to "
                            "Trainer(model=...) rather than model_init=... with a callback that replaces it.")
        if self.auto is not None:  # a second train() on one Trainer: plan its first step again
            self.auto.remove()
        self.auto = auto(model, budget=self.budget, codec=self.codec, blocks=self.blocks, loss_fn=self.loss_fn,
                         verify=self.verify, progress=self.progress)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.auto is not None:
            self.auto.remove()
