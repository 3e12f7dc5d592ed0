"""Adjoints of time-stepping loops driven by checkpoint schedules.

``checkpointed_scan`` (loop.py) differentiates ``carry, y = step(carry, xs[k])`` over k through
autograd, with ``checkpointed_loop`` (``state = step(state)`` n times) its special case; ``run_schedule`` (run.py) drives hand-written forward and adjoint steps (for example
seismic reverse time migration). Both run the schedule through one executor (execute.py);
``Auto`` (auto.py) sizes a schedule from a store's budgets.
"""
from torchckpt.adjoint.auto import Auto, auto_schedule
from torchckpt.adjoint.loop import checkpointed_loop, checkpointed_scan
from torchckpt.adjoint.run import run_schedule

__all__ = ["Auto", "auto_schedule", "checkpointed_loop", "checkpointed_scan", "run_schedule"]
