"""torchckpt: activation and adjoint checkpointing for PyTorch.

Saved tensors go to recomputation or to a GPU cache backed by pinned host memory,
moved on dedicated CUDA streams and prefetched before backward needs them.

The public names are below; everything else stays importable from its module
(``torchckpt.memory.HostPool``, ``torchckpt.store.Stats``, ``torchckpt.codecs.TritonQuant``,
``torchckpt.planner.Plan``...).
"""
from torchckpt import codecs, planner, schedules
from torchckpt._errors import CheckpointError
from torchckpt.adjoint import Auto, checkpointed_loop, checkpointed_scan, run_schedule
from torchckpt.api import checkpoint, checkpoint_chain, default_store, offload
from torchckpt.planner import auto, plan
from torchckpt.policies import Keep, Offload, Policy, Recompute
from torchckpt.store import SnapshotStore, Store

__version__ = "0.1.0"

__all__ = [
    "Auto",
    "CheckpointError",
    "Keep",
    "Offload",
    "Policy",
    "Recompute",
    "SnapshotStore",
    "Store",
    "auto",
    "checkpoint",
    "checkpoint_chain",
    "checkpointed_loop",
    "checkpointed_scan",
    "codecs",
    "default_store",
    "offload",
    "plan",
    "planner",
    "run_schedule",
    "schedules",
]
