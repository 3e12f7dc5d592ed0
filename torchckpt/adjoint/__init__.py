"""Adjoints of time-stepping loops driven by checkpoint schedules.

``checkpointed_loop`` differentiates ``state = step(state)`` repeated n times through
autograd; ``run_schedule`` drives hand-written forward and adjoint steps (for example
seismic reverse time migration) with a schedule of ``torchckpt.schedules``.
"""
from torchckpt.adjoint.run import auto_schedule, checkpointed_loop, run_schedule

__all__ = ["auto_schedule", "checkpointed_loop", "run_schedule"]
