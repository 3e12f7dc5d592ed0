"""PyTorch Lightning under the planner: ``Trainer(..., callbacks=[PlanCallback(budget="6GiB")])``.

When training starts the callback calls ``torchckpt.auto`` on the LightningModule (or on its submodule named by
``module=``, the one ``training_step`` calls): the first call of it with gradients enabled, in the first training
step, is profiled and planned (the planner's own steps leave no trace: NOTE [ Planning leaves no trace ]), and every
step runs under the plan; the sanity check's validation runs without gradients and is not planned. When training
ends the plan is taken off. The profile differentiates ``loss_fn`` of that call's output (default: its ``.loss``, a
scalar output itself, or the mean square of the output's tensors): the loss ``training_step`` computes from it
is not seen, and need not be, since the blocks' saved tensors are the same. The weights trained are those of the
same Trainer without the callback, bit for bit (tested on the CPU), except with a lossy ``codec``.

``pytorch_lightning`` is used if installed, else ``lightning.pytorch``; the callback is a ``Callback`` of that one.
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
    from pytorch_lightning import Callback
except ImportError:  # pragma: no cover - the other package name
    try:
        from lightning.pytorch import Callback  # type: ignore[no-redef]
    except ImportError as e:
        raise ImportError("torchckpt: torchckpt.integrations.pl_callback needs PyTorch Lightning (pip install "
                          "pytorch-lightning); without it use torchckpt.auto(model, budget=...) before your own "
                          "training loop.") from e

__all__ = ["PlanCallback"]


class PlanCallback(Callback):  # type: ignore[misc]
    """Plan the LightningModule (or ``getattr(module, name)``) under ``budget`` on its first training call
    (``torchckpt.auto``), and take the plan off when training ends.

    Args:
        budget: device bytes one training step may add (``int`` or e.g. ``"6GiB"``), as for ``torchckpt.plan``.
        module: the attribute of the LightningModule that ``training_step`` calls (e.g. ``"model"``), when it does
            not call the LightningModule itself.
        codec / blocks / loss_fn / verify / progress: as for ``torchckpt.auto``.

    Example::

        trainer = pl.Trainer(max_epochs=1, callbacks=[PlanCallback(budget="6GiB", module="model")])
        trainer.fit(lit_module, loader)
    """

    def __init__(self, budget: int | str, *, module: str | None = None, codec: Codec | None = None,
                 blocks: Sequence[nn.Module] | None = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 verify: bool = True, progress: bool = False) -> None:
        parse_bytes(budget, "PlanCallback(budget=...)")  # a bad budget fails here, not at the first step
        if module is not None and not isinstance(module, str):
            raise TypeError(f"torchckpt: PlanCallback(module=...) names an attribute of the LightningModule (a str, "
                            f"e.g. module='model'), got {type(module).__name__}.")
        self.budget, self.module, self.codec, self.blocks, self.loss_fn = budget, module, codec, blocks, loss_fn
        self.verify, self.progress = verify, progress
        self.auto: AutoPlan | None = None

    @property
    def plan(self) -> Plan | None:
        """The plan, once the first training step has made it."""
        return self.auto.plan if self.auto is not None else None

    def on_train_start(self, trainer: Any, pl_module: nn.Module) -> None:
        target = pl_module if self.module is None else getattr(pl_module, self.module, None)
        if not isinstance(target, nn.Module):
            raise ValueError(f"torchckpt: PlanCallback(module={self.module!r}): the LightningModule has no submodule "
                             "of that name; pass the attribute its training_step calls, or module=None when it "
                             "calls the LightningModule itself.")
        if self.auto is not None:
            self.auto.remove()
        self.auto = auto(target, budget=self.budget, codec=self.codec, blocks=self.blocks, loss_fn=self.loss_fn,
                         verify=self.verify, progress=self.progress)

    def on_train_end(self, trainer: Any, pl_module: nn.Module) -> None:
        if self.auto is not None:
            self.auto.remove()
