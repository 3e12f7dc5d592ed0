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
# 5. Ranks fail together where they can. Every exchange of the planner is one ``all_gather_object``, and the work
#    between two exchanges is each rank's own (the arguments checked, the profile's bookkeeping, the link and codec
#    measured, ``combine``, the search, the calibration, the plans made and compared). A rank that raises there
#    (``failing_together``) sends its failure at the next exchange instead of its figures; the exchanges are all the
#    same collective, so its failure meets the exchange the others wait in, and every rank raises the same
#    ``torchckpt:`` error naming the rank, what it was doing and what it raised (chained to its own exception on the
#    failing rank); where every rank failed, each raises its own. The exchanges: the profiles (Rule 2), before and
#    after each step the ranks run together (Rules 4 and 6), and once at the end of ``plan``, ``plans`` and each of
#    ``auto``'s phases, so that no rank returns into training while another failed after the last one. Nested
#    phases exchange once, in the outermost. A ``plans`` budget that raises ``PlanError`` raises it on every rank
#    alike (it is decided on agreed figures) and is not exchanged.
# 6. A step the ranks run together (the profiling step, each step that measures a plan) runs the model's own
#    collectives, and starts only after an exchange found every rank ready (Rule 5). A failure inside it (out of
#    device memory, the model raising on one rank's batch) cannot be agreed on: the other ranks have gone on into
#    collectives of the model that this rank will not enter (FSDP2 all-gathers each block's parameters in its
#    forward: a rank that runs out in block 5 has entered five all-gathers while the others wait in the sixth; DDP
#    all-reduces in the backward), and an exchange there would meet a collective of the model of another size (a
#    hang, or garbage). So the failing rank raises at once, without a collective, a ``torchckpt:`` error naming its
#    rank, the step and (out of memory) its device's memory, which says that the other ranks, unless they failed
#    alike, wait in the model's collectives until the process group's timeout (``init_process_group(timeout=...)``;
#    NCCL's watchdog then ends them) or until this process ends (gloo's peers then get a closed connection, and
#    ``torchrun`` ends the other workers when one fails). It does not abort the communicator: torch 2.11's
#    ``_abort_process_group`` is private, documented as experimental and NCCL-only, and aborting one rank's NCCL
#    communicator does not wake the kernels its peers wait in. A rank whose step fails in a collective
#    (``torch.distributed.DistError``: a peer gone, a timeout) says that another rank probably failed first.
# 7. So the plain profiling step's fallback when it runs out of memory (NOTE [ Profiling step ] Rule 6) is not taken
#    when the ranks plan together: the rank that ran out cannot learn whether the others did without an exchange that
#    may meet their step's collectives, and a rank profiling block by block alone runs other collectives than the
#    others. It raises as Rule 6 says (on every rank, each at once, where the step fits on none). Likewise a measured
#    policy that runs out of memory is not left unmeasured on one rank (NOTE [ Mechanism costs ] Rule 1) but raised.
#    What does not hold yet: a model whose plain step does not fit is not planned together; plan it before it is
#    wrapped, on one process with the per-rank batch (Rule 1: alone, the fallback applies), save the plan and apply it
#    on every rank.
# 8. Not agreed: ``auto``'s checks of its arguments (at the call, before any exchange), what runs after the planning of
#    ``auto``'s first call (``Plan.apply``), and exceptions that are not ``Exception`` (``KeyboardInterrupt``).
# 9. The host link is measured by every rank at once (``ready``: one exchange, then each rank measures), so that
#    the ranks of one node copy together and each rank's figure is the link under their shared traffic, as in a
#    data-parallel step that offloads (Rule 2 then takes the lowest). The exchange is the planner's own, so a rank
#    that failed before it fails every rank there (Rule 5). A link measured earlier in the process is reused as it is.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from torchckpt._errors import CheckpointError, format_bytes
from torchckpt.planner.costs import CodecCost, Link
from torchckpt.planner.plan import Plan
from torchckpt.planner.profiling import Profile

__all__ = ["RanksFailed", "agree", "agreed", "combine", "failing_together", "ready", "stepping", "together"]

Step = Callable[[Plan], "tuple[int, float] | None"]
_D = TypeVar("_D", Link, CodecCost)


def together(model: nn.Module | None) -> bool:
    """Whether ``model``'s ranks plan together (NOTE [ One plan for all ranks ] Rule 1)."""
    if not (isinstance(model, nn.Module) and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1):
        return False
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    return any(isinstance(m, (DistributedDataParallel, FSDPModule)) for m in model.modules())


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class RanksFailed(CheckpointError):
    """A failure of ranks planning together, raised where no rank exchanges anything more about it (NOTE [ One plan
    for all ranks ] Rules 5-6)."""


@dataclasses.dataclass(frozen=True)
class _Failure:
    """What a rank sends at an exchange when it raised since the last one (NOTE [ One plan for all ranks ] Rule 5)."""

    rank: int
    doing: str
    error: str


def _exchange(obj: Any, call: str) -> list[Any]:
    """Every rank's ``obj``, or, where a rank sent a failure instead, the error naming it on every rank (NOTE [ One
    plan for all ranks ] Rule 5)."""
    got = _gather(obj)
    failed = [g for g in got if isinstance(g, _Failure)]
    if failed:
        raise RanksFailed(_agreed_words(call, failed))
    return got


def _agreed_words(call: str, failed: Sequence[_Failure]) -> str:
    ranks = ", ".join(str(f.rank) for f in failed)
    what = "; ".join(f"rank {f.rank} raised {f.error} while {f.doing}" for f in failed)
    return (f"torchckpt: {call}(model, ...) plans a DDP or FSDP2 model on every rank together (NOTE [ One plan for all "
            f"ranks ] Rule 5), and {what}; so every rank raises this error rather than wait for rank{'s' * (len(failed) > 1)} "
            f"{ranks}. Fix what rank {failed[0].rank} raised (its own traceback, chained to this error on that rank, has "
            f"the cause), then call {call} again on every rank.")


_phases = [0]  # phases entered, not yet left (NOTE [ One plan for all ranks ] Rule 5: the outermost exchanges)


@contextlib.contextmanager
def failing_together(model: nn.Module | None, call: str, doing: str) -> Iterator[None]:
    """Run one rank's share of ``call`` so that, when the ranks plan together, a failure on some rank raises on every
    rank, and an exchange at the end finds every rank done (NOTE [ One plan for all ranks ] Rule 5); ``doing`` says
    what it does, in errors."""
    if _phases[0] or not together(model):
        yield
        return
    _phases[0] += 1
    try:
        try:
            yield
        finally:
            _phases[0] -= 1
    except RanksFailed:
        raise
    except Exception as e:
        got = _gather(_Failure(dist.get_rank(), doing, _error_words(e)))
        failed = [g for g in got if isinstance(g, _Failure)]
        if len(failed) < len(got):
            raise RanksFailed(_agreed_words(call, failed)) from e
        raise  # every rank failed: each raises its own
    _exchange(None, call)


def ready(model: nn.Module, call: str) -> None:
    """When the ranks plan together, return once every rank has come here (one exchange; NOTE [ One plan for all
    ranks ] Rule 9); a rank that failed before fails every rank here (NOTE [ One plan for all ranks ] Rule 5)."""
    if together(model):
        _exchange(None, call)


@contextlib.contextmanager
def stepping(model: nn.Module, call: str, what: str, oom_fix: str) -> Iterator[None]:
    """Run a step every rank runs together, once every rank is ready; a failure inside it is raised on this rank at
    once, with no collective (NOTE [ One plan for all ranks ] Rule 6). ``what`` names the step and ``oom_fix`` what to
    do when it runs out of device memory, in errors."""
    if not together(model):
        yield
        return
    _exchange(None, call)
    try:
        yield
    except RanksFailed:
        raise
    except Exception as e:
        rank = dist.get_rank()
        lost = _collective_error(e)
        if lost is not None:
            why = (f"one of the model's collectives failed ({_error_words(lost)}): another rank probably failed in "
                   "this step first (its own error says why), or the ranks' steps ran different collectives")
        else:
            why = f"it raised {_error_words(e)}"
            if isinstance(e, torch.OutOfMemoryError):
                why += f" (rank {rank}'s device: {_memory_words()}); {oom_fix}"
        raise RanksFailed(
            f"torchckpt: {call}(model, ...) plans a DDP or FSDP2 model on every rank together (NOTE [ One plan for all "
            f"ranks ] Rule 6), and on rank {rank} {what} failed: {why}. A failure inside a step the ranks run together "
            f"cannot be agreed on: the other ranks, unless theirs failed alike, wait in the model's own collectives "
            f"until the process group's timeout (init_process_group(timeout=...)) or until this process ends.") from e


_LOST = ("Connection closed by peer", "Connection reset by peer", "Timed out", "NCCL communicator", "ncclRemoteError")


def _collective_error(e: BaseException) -> BaseException | None:
    """The failed collective in ``e``'s chain of causes (``torch.distributed.DistError``, or a ``RuntimeError`` of
    gloo's or NCCL's transport, which DDP's reducer raises as it is), if any."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, dist.DistError) or (isinstance(x, RuntimeError) and any(w in str(x) for w in _LOST)):
            return x
        x = x.__cause__ or x.__context__
    return None


def _error_words(e: BaseException) -> str:
    """``e`` in a line: its type, message (at most 400 characters) and where it was raised."""
    text = " ".join(str(e).split())
    text = text[len("torchckpt: "):] if text.startswith("torchckpt: ") else text
    if len(text) > 400:
        text = text[:400] + " ..."
    tb = traceback.extract_tb(e.__traceback__)
    at = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} in {tb[-1].name})" if tb else ""
    return f"{type(e).__name__}: {text}{at}"


def _memory_words() -> str:
    """The current CUDA device's memory, for an out-of-memory error (its total, free, and the most allocated)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return "not a CUDA device"
    dev = torch.cuda.current_device()
    try:
        free, total = torch.cuda.mem_get_info(dev)
    except RuntimeError:
        return f"cuda:{dev}"
    return (f"cuda:{dev}, {format_bytes(total)} in all, {format_bytes(free)} free now, at most "
            f"{format_bytes(torch.cuda.max_memory_allocated(dev))} allocated by PyTorch at once (since its peak was "
            f"last reset)")


def agree(model: nn.Module, call: str, prof: Profile, link: Link,
          codec: CodecCost | None) -> tuple[Profile, Link, CodecCost | None]:
    """This rank's profile, link and codec cost, or, when the ranks plan together, those every rank plans on
    (NOTE [ One plan for all ranks ] Rule 2); ``call`` names the entry point in errors."""
    if not together(model):
        return prof, link, codec
    got = _exchange((prof, link, codec), call)
    codecs = [g[2] for g in got]
    return (combine([g[0] for g in got], call, dist.get_rank()), _lowest([g[1] for g in got]),
            None if any(c is None for c in codecs) else _lowest(codecs))


def agreed(model: nn.Module, call: str = "plan") -> Callable[[Step], Step]:
    """Decorate a step that measures a plan (its peak bytes and seconds, or ``None``) so that, when the ranks plan
    together, it starts once every rank is ready (NOTE [ One plan for all ranks ] Rule 6) and every rank gets the
    largest peak and the longest time of any rank (NOTE [ One plan for all ranks ] Rule 4)."""

    def wrap(step: Step) -> Step:
        if not together(model):
            return step

        @functools.wraps(step)
        def run(p: Plan) -> tuple[int, float] | None:
            with stepping(model, call, "a step under a plan, measured to verify it",
                          "the plan's step does not fit beside what is allocated on this rank: pass a smaller budget"):
                mine = step(p)
            got = _exchange(mine, call)
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
