"""One plan for every rank of a data-parallel model (DDP, FSDP2): what the ranks measured, gathered and combined, so
that ``plan``, ``plans`` and ``auto`` return the same plan on each.

# NOTE [ One plan for all ranks ]
# 1. A model under DDP or ``fully_shard`` communicates in its step, so its ranks run their steps together. When
#    ``torch.distributed`` is initialised with more than one rank and the model holds a ``DistributedDataParallel`` or
#    an FSDP2 module, ``plan``, ``plans`` and ``auto`` are collective: every rank calls them with its own batch (as it
#    runs a training step), they exchange what they measured over the default process group (gloo or NCCL), and every
#    rank returns the same plan: the same blocks recomputed, offloaded and kept, so that no rank's step waits on
#    another's at each collective. A model under neither (one planned before it is wrapped) is planned by the rank
#    that calls, alone.
# 2. Each rank profiles its own batch (NOTE [ Profiling step ]); the profiles, the links and the codec costs are
#    gathered (``all_gather_object``) and combined (``combine``): each block's and each op's bytes and times are the
#    largest any rank measured (a data-parallel step goes at its slowest rank's pace, and every rank's step must fit
#    the budget), the link's and the codec's speeds and the codec's ratio the lowest. Each rank keeps its own device
#    name. The search is deterministic, so on the same figures every rank finds the same plans.
# 3. Profiles of another shape (other blocks, another number of tensors saved or ops run by a block, a step profiled
#    block by block on some ranks only) are a ``torchckpt:`` error on every rank: the ranks' batches differ in shape,
#    or the forward takes another branch on some ranks. A block whose ops had run another number of times when a
#    tensor was saved on some rank is not offered in parts (as when one profile does not know it).
# 4. Each step the planner measures under a plan (verification, NOTE [ Applying a plan ] Rule 4; NOTE [ Mechanism
#    costs ], on CUDA) runs on every rank together, and its measurement is the largest peak and the longest time of
#    any rank's; a step one rank did not measure is not measured on any. Every decision taken on measurements is so
#    the same on every rank.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist
from torch import nn

from torchckpt.planner.costs import CodecCost, Link
from torchckpt.planner.plan import Plan
from torchckpt.planner.profiling import Profile

__all__ = ["agree", "agreed", "combine", "together"]

Step = Callable[[Plan], "tuple[int, float] | None"]
_D = TypeVar("_D", Link, CodecCost)


def together(model: nn.Module) -> bool:
    """Whether ``model``'s ranks plan together (NOTE [ One plan for all ranks ] Rule 1)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    return any(isinstance(m, (DistributedDataParallel, FSDPModule)) for m in model.modules())


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def agree(model: nn.Module, call: str, prof: Profile, link: Link,
          codec: CodecCost | None) -> tuple[Profile, Link, CodecCost | None]:
    """This rank's profile, link and codec cost, or, when the ranks plan together, those every rank plans on
    (NOTE [ One plan for all ranks ] Rule 2); ``call`` names the entry point in errors."""
    if not together(model):
        return prof, link, codec
    got = _gather((prof, link, codec))
    codecs = [g[2] for g in got]
    return (combine([g[0] for g in got], call, dist.get_rank()), _lowest([g[1] for g in got]),
            None if any(c is None for c in codecs) else _lowest(codecs))


def agreed(model: nn.Module) -> Callable[[Step], Step]:
    """Decorate a step that measures a plan (its peak bytes and seconds, or ``None``) so that, when the ranks plan
    together, every rank gets the largest peak and the longest time of any rank (NOTE [ One plan for all ranks ]
    Rule 4)."""

    def wrap(step: Step) -> Step:
        if not together(model):
            return step

        @functools.wraps(step)
        def run(p: Plan) -> tuple[int, float] | None:
            got = _gather(step(p))
            if any(g is None for g in got):
                return None
            return max(g[0] for g in got), max(g[1] for g in got)

        return run

    return wrap


def _lowest(items: Sequence[_D]) -> _D:
    """The first of ``items`` with each float field the lowest of any (speeds, ratios: NOTE [ One plan for all
    ranks ] Rule 2)."""
    return dataclasses.replace(items[0], **{f.name: min(getattr(x, f.name) for x in items)
                                            for f in dataclasses.fields(items[0])
                                            if isinstance(getattr(items[0], f.name), float)})


def _shape(p: Profile) -> tuple[Any, ...]:
    return p.names, p.kinds, p.by_blocks, tuple(len(s) for s in p.saved), tuple(tuple(o.op for o in b) for b in p.ops)


def combine(profiles: Sequence[Profile], call: str = "plan", rank: int = 0) -> Profile:
    """One profile from each rank's (NOTE [ One plan for all ranks ] Rules 2-3): bytes and times the largest of any
    rank's, ``rank``'s device.

    Example::

        >>> from torchckpt.planner.profiling import SavedTensor
        >>> a = Profile(names=("0",), kinds=("Linear",), saved=((SavedTensor(0, 64, (4, 4), "float32"),),),
        ...             input_bytes=(64,), fwd_s=(1e-3,), bwd_s=(2e-3,), bwd_bytes=(0,), ops=((),), other_saved_bytes=0,
        ...             other_fwd_s=0.0, other_bwd_s=0.0, step_s=3e-3, peak_none=128, device="cuda:0")
        >>> b = dataclasses.replace(a, fwd_s=(2e-3,), peak_none=100, device="cuda:1")
        >>> c = combine([a, b], rank=1)
        >>> c.fwd_s, c.peak_none, c.device
        ((0.002,), 128, 'cuda:1')
    """
    first = profiles[0]
    for r, p in enumerate(profiles):
        if _shape(p) != _shape(first):
            raise ValueError(
                f"torchckpt: {call}(model, ...) plans a DDP or FSDP2 model on every rank together (NOTE [ One plan for "
                f"all ranks ]), and rank {r}'s profiling step differs from rank 0's: {_difference(first, p)}. Pass "
                f"every rank a batch of the shapes it trains on, the same on every rank (the forward must run the same "
                f"ops and save the same number of tensors in each block on every rank).")

    def most(get: Callable[[Profile], Any]) -> Any:
        return max(get(p) for p in profiles)

    def each(get: Callable[[Profile], Sequence[Any]]) -> tuple[Any, ...]:
        return tuple(max(v) for v in zip(*(get(p) for p in profiles)))

    n = len(first.names)
    saved = tuple(tuple(max((p.saved[i][k] for p in profiles), key=lambda s: s.nbytes)
                        for k in range(len(first.saved[i]))) for i in range(n))
    ops = tuple(tuple(dataclasses.replace(o, nbytes=max(p.ops[i][k].nbytes for p in profiles),
                                          seconds=max(p.ops[i][k].seconds for p in profiles))
                      for k, o in enumerate(first.ops[i])) for i in range(n))
    after: tuple[tuple[int, ...], ...] = ()
    if all(len(p.saved_after) == n for p in profiles):  # NOTE [ One plan for all ranks ] Rule 3: unknown where they differ
        after = tuple(first.saved_after[i] if all(p.saved_after[i] == first.saved_after[i] for p in profiles) else ()
                      for i in range(n))
    starts = [p.bwd_start_bytes for p in profiles]
    return dataclasses.replace(
        first, saved=saved, ops=ops, input_bytes=each(lambda p: p.input_bytes), fwd_s=each(lambda p: p.fwd_s),
        bwd_s=each(lambda p: p.bwd_s), bwd_bytes=each(lambda p: p.bwd_bytes),
        other_saved_bytes=most(lambda p: p.other_saved_bytes), other_fwd_s=most(lambda p: p.other_fwd_s),
        other_bwd_s=most(lambda p: p.other_bwd_s), step_s=most(lambda p: p.step_s),
        peak_none=most(lambda p: p.peak_none), device=profiles[rank].device,
        bwd_start_bytes=each(lambda p: p.bwd_start_bytes) if all(len(s) == n for s in starts) else (),
        saved_after=after,
        writes_buffers=tuple(any(w) for w in zip(*(p.writes_buffers for p in profiles))),
        mutates=tuple(next((m for m in ms if m), "") for ms in zip(*(p.mutates for p in profiles))))


def _difference(a: Profile, b: Profile) -> str:
    """Where profile ``b`` first differs from ``a`` in shape, in words."""
    if (a.names, a.kinds) != (b.names, b.kinds):
        return f"it ran the blocks {', '.join(b.names)} where rank 0 ran {', '.join(a.names)}"
    if a.by_blocks != b.by_blocks:
        return "one of them was profiled block by block (its step did not fit on the device without checkpointing)"
    for name, x, y, xo, yo in zip(a.names, a.saved, b.saved, a.ops, b.ops):
        if len(x) != len(y):
            return f"block {name} saved {len(y)} tensors where rank 0's saved {len(x)}"
        if [o.op for o in xo] != [o.op for o in yo]:
            return f"block {name} ran {len(yo)} ops where rank 0's ran {len(xo)}, or others"
    return "another shape"
