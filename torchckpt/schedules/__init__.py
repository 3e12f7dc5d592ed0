"""Checkpoint schedules in pure Python (no torch): actions, planners, dry runs.

A schedule is an iterable of small immutable actions (``Advance``, ``Save``, ``Restore``,
``Adjoint``, ...) that two executors understand: ``simulate`` here and the runtime in
``torchckpt.adjoint``. See NOTE [ Schedule actions ] in ``actions.py``.
"""
from torchckpt.schedules.actions import (
    Action,
    Adjoint,
    Advance,
    End,
    EndForward,
    Free,
    Prefetch,
    Restore,
    Save,
    Tier,
)
from torchckpt.schedules.multistage import Multistage
from torchckpt.schedules.packed import PackedSchedule
from torchckpt.schedules.prefetch import (
    CacheStats,
    PrefetchedSchedule,
    PrefetchStream,
    flush_positions,
    plan_flushes,
    plan_prefetch,
    simulate_cache,
)
from torchckpt.schedules.revolve import Revolve, optimal_forward_steps, repetition_number
from torchckpt.schedules.schedule import Schedule
from torchckpt.schedules.simulate import SimResult, simulate
from torchckpt.schedules.spill import Spill, greedy_spill, plan_spill, spill_time
from torchckpt.schedules.uniform import Uniform
from torchckpt.schedules.weighted import WeightedRevolve
from torchckpt.schedules.zcut import ZCut, zcut_cost

__all__ = [
    "Action",
    "Adjoint",
    "Advance",
    "CacheStats",
    "End",
    "EndForward",
    "Free",
    "Multistage",
    "PackedSchedule",
    "Prefetch",
    "PrefetchStream",
    "PrefetchedSchedule",
    "Restore",
    "Revolve",
    "Save",
    "Schedule",
    "SimResult",
    "Spill",
    "Tier",
    "Uniform",
    "WeightedRevolve",
    "ZCut",
    "flush_positions",
    "greedy_spill",
    "optimal_forward_steps",
    "plan_flushes",
    "plan_prefetch",
    "plan_spill",
    "repetition_number",
    "simulate",
    "simulate_cache",
    "spill_time",
    "zcut_cost",
]
