"""Adjoints of time-stepping loops driven by checkpoint schedules.

``checkpointed_scan`` (loop.py) differentiates ``carry, y = step(carry, xs[k])`` over k through
autograd, with ``checkpointed_loop`` (``state = step(state)`` n times) its special case; ``run_schedule`` (run.py) drives hand-written forward and adjoint steps (for example
seismic reverse time migration). Both run the schedule through the one executor (NOTE [ Executor ],
schedules/execute.py); ``AutoSchedule`` (auto.py) sizes a schedule from a store's budgets (``Auto`` before:
a deprecated alias for one release).
"""
from typing import Any as _Any

from torchckpt.adjoint.auto import AutoSchedule, auto_schedule
from torchckpt.adjoint.loop import checkpointed_loop, checkpointed_scan
from torchckpt.adjoint.run import run_schedule

__all__ = ["AutoSchedule", "auto_schedule", "checkpointed_loop", "checkpointed_scan", "run_schedule"]


def __getattr__(name: str) -> _Any:
    """``Auto``, the old name of ``AutoSchedule``: a deprecated alias for one release."""
    if name == "Auto":
        import warnings
        warnings.warn("torchckpt: Auto is now torchckpt.adjoint.AutoSchedule (it sizes an adjoint schedule; "
                      "torchckpt.auto plans a model); the old name goes in the next release.", FutureWarning,
                      stacklevel=2)
        return AutoSchedule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
