"""torchckpt: activation and adjoint checkpointing for PyTorch.

Saved tensors go to recomputation or to a GPU cache backed by pinned host memory,
moved on dedicated CUDA streams and prefetched before backward needs them.
"""
from torchckpt import schedules
from torchckpt._errors import CheckpointError
from torchckpt.adjoint import auto_schedule, checkpointed_loop, run_schedule
from torchckpt.api import checkpoint, default_store, offload, run
from torchckpt.policies import Keep, Offload, Policy, Recompute
from torchckpt.store import GpuCache, HostPool, PrefetchPlan, SnapshotStats, SnapshotStore, Stats, Store

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "GpuCache",
    "HostPool",
    "Keep",
    "Offload",
    "Policy",
    "PrefetchPlan",
    "Recompute",
    "SnapshotStats",
    "SnapshotStore",
    "Stats",
    "Store",
    "auto_schedule",
    "checkpoint",
    "checkpointed_loop",
    "default_store",
    "offload",
    "run",
    "run_schedule",
    "schedules",
]
