"""FSDP2 (``fully_shard``) as the profile sees it: which saved tensors are parameters, and which sharded models the
planner takes.

# NOTE [ Sharded parameters ]
# 1. Under FSDP2 a module's registered parameters are DTensors holding this rank's shard; its forward and backward
#    run on unsharded parameters that FSDP2 all-gathers into them first (``FSDPParam._unsharded_param``, a plain
#    ``nn.Parameter``, swapped onto the module) and frees after (its storage resized to 0; the next all-gather fills
#    that same storage again, at another address). A tensor a block saves that is one of them or a view of one is a
#    parameter to the profile, as a plain parameter is (NOTE [ Profiling step ] Rule 2): FSDP2 holds or gathers it
#    again for backward, so it is never counted as an activation, offloaded or recomputed.
# 2. They are recognised by their storage object (``UntypedStorage._cdata``, which ``resize_`` keeps), not by its
#    data pointer, which moves with every all-gather. Each ``FSDPParam`` makes its unsharded parameter at its first
#    all-gather (the profile's unmeasured warm-up step) and keeps it; those not made yet are looked for again at the
#    next tensor that is not a known parameter.
# 3. What FSDP2 allocates in a step (the all-gather and reduce-scatter buffers, the unsharded parameters and
#    gradients) is allocated on the rank: on CUDA the allocator's peak over the profiled step counts it
#    (NOTE [ Profiling step ] Rule 4), and the step model is calibrated on that peak, so a budget is per rank and
#    includes them. On the CPU, where the peak is estimated from the gradients and the saved bytes, they are not.
# 4. A parameter that was a DTensor before ``fully_shard`` (tensor parallelism, 2-D meshes) or one no
#    ``fully_shard`` placed stays a DTensor in the forward: the profile cannot read its storage, and the planner
#    refuses the model (``unsupported``).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["ParamStorages", "fsdp_modules", "unsupported"]


def fsdp_modules(model: nn.Module) -> list[Any]:
    """The modules of ``model`` that ``fully_shard`` wrapped (``FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without torch.distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _fsdp_params(model: nn.Module) -> Iterator[Any]:
    """The ``FSDPParam`` of every parameter ``fully_shard`` placed in ``model``."""
    for m in fsdp_modules(model):
        group = m._get_fsdp_state()._fsdp_param_group
        if group is not None:
            yield from group.fsdp_params


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without torch.distributed
        return False
    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """``t``, or this rank's shard of a DTensor."""
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def unsupported(model: nn.Module) -> str:
    """What makes ``model``'s sharding one the profile cannot read (NOTE [ Sharded parameters ] Rule 4), or ``""``."""
    placed = set()
    for fp in _fsdp_params(model):
        if getattr(fp, "is_dtensor", False):
            return "a parameter that was a DTensor before fully_shard (tensor parallelism, a 2-D mesh)"
        placed.add(id(fp.sharded_param))  # type: ignore[attr-defined]
    bad = next((n for n, p in model.named_parameters() if _is_dtensor(p) and id(p) not in placed), None)
    return f"the DTensor parameter {bad}, which no fully_shard placed (tensor parallelism)" if bad is not None else ""


class ParamStorages:
    """The storages of ``model``'s parameters and buffers, FSDP2's unsharded parameters among them
    (NOTE [ Sharded parameters ] Rules 1-2): ``storage in ParamStorages(model)``.

    Example::

        >>> m = torch.nn.Linear(4, 4)
        >>> s = ParamStorages(m)
        >>> m.weight.t().untyped_storage() in s, torch.ones(4).untyped_storage() in s
        (True, False)
    """

    def __init__(self, model: nn.Module) -> None:
        self.ptrs = {_local(t).untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self._pending = list(_fsdp_params(model))  # NOTE [ Sharded parameters ] Rule 2: no unsharded parameter yet
        self._unsharded: set[int] = set()

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        if storage.data_ptr() in self.ptrs:
            return True
        if self._pending:
            made = [fp for fp in self._pending if hasattr(fp, "_unsharded_param")]
            self._unsharded |= {fp._unsharded_param.untyped_storage()._cdata for fp in made}  # type: ignore[attr-defined]
            self._pending = [fp for fp in self._pending if not hasattr(fp, "_unsharded_param")]
        return storage._cdata in self._unsharded
