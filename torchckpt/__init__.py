"""torchckpt: activation and adjoint checkpointing for PyTorch.

Saved tensors go to recomputation or to a GPU cache backed by pinned host memory,
moved on dedicated CUDA streams and prefetched before backward needs them.

The public names are below; everything else stays importable from its module
(``torchckpt.adjoint.AutoSchedule``, ``torchckpt.memory.HostPool``, ``torchckpt.store.Stats``, ``torchckpt.codecs.TritonQuant``,
``torchckpt.planner.Plan``...); the subpackages ``codecs``, ``planner`` and ``schedules`` are attributes.
"""
from typing import Any

from torchckpt import codecs, planner, schedules
from torchckpt._errors import CheckpointError
from torchckpt.adjoint import checkpointed_loop, checkpointed_scan, run_schedule
from torchckpt.api import checkpoint, checkpoint_chain, default_store, offload
from torchckpt.planner import auto, plan
from torchckpt.policies import Keep, Offload, Policy, Recompute
from torchckpt.store import SnapshotStore, Store

__version__ = "0.1.0"

__all__ = [
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
    "default_store",
    "offload",
    "plan",
    "run_schedule",
]

_MOVED = {  # issue 23: names that left the top level; each stays importable from its module
    "Auto": ("torchckpt.adjoint", "AutoSchedule"),
}


def __getattr__(name: str) -> Any:
    """The names that left the top level, with a FutureWarning naming their home, for one release."""
    if name in _MOVED:
        import importlib
        import warnings
        module, new = _MOVED[name]
        warnings.warn(f"torchckpt: torchckpt.{name} is now {module}.{new}; the old name goes in the next release.",
                      FutureWarning, stacklevel=2)
        return getattr(importlib.import_module(module), new)
    raise AttributeError(f"module 'torchckpt' has no attribute {name!r}")
