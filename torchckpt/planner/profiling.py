"""Finding a model's chain of blocks and measuring one training step of it.

# NOTE [ Profiling step ]
# 1. The chain is the instances of one module class, in the order the model registers them:
#    classes with two or more outermost instances that have submodules (plain containers, such
#    as ``nn.ModuleList``, and leaf layers, such as ``nn.Linear``, are not blocks). Among the
#    classes whose instances hold within 10% of the most parameters any class holds (and at least
#    half the model's), the one with the most instances: transformer layers rather than their MLPs,
#    ResNet's blocks across all stages rather than the stages. Without such a class (blocks that
#    are themselves ``nn.Sequential``), the children of the container whose children hold the
#    most parameters. ``blocks=`` overrides it. Blocks of one class whose parameters have the same
#    shapes share a ``kind``.
# 2. One step runs as plain autograd would (every saved tensor stays where it is), with a
#    saved-tensor hook that only records: for each block, every tensor its forward saves, in order
#    (the position ``Offload(tensors=...)`` counts), its storage and size; tensors saved outside the
#    blocks count as ``other``. Parameters, views of them and leaves that require grad stay by
#    reference under any plan and are left out of the bytes; a storage saved twice counts once, in
#    the first block that saved it. Each saved tensor's storage and each block's inputs' are numbered, so
#    that the step model counts a storage several blocks reference once (NOTE [ Shared storages ]).
# 3. Times come from CUDA events on the device (``time.perf_counter`` on the CPU): a block's
#    forward between its forward's start and end; its backward from the gradient's arrival at its
#    output to its arrival at its input (the previous block's output). On the device, a block's
#    backward working memory is the allocator's peak between those two points minus what was
#    allocated at the first (the peak statistic is reset there; the step's own peak is carried
#    over), and what was allocated when it began is kept too (``Profile.bwd_start_bytes``: the
#    backward's own calibration, NOTE [ Step model ] Rule 4). The step is run ``warmup`` times
#    first, unmeasured, so allocator and kernel caches are warm.
# 4. The no-checkpointing peak is the device's peak allocated bytes over the profiled step minus
#    what was allocated when it started (parameters, optimiser state): a budget counts what a step
#    adds. Every step of the planner (profiling, measuring, verifying) starts with the parameters'
#    ``.grad`` set to ``None``, as a training loop's ``zero_grad()`` leaves them, so the gradients the
#    step allocates count (the user's are put back after planning: NOTE [ Planning leaves no trace ]);
#    before, steps that accumulated into gradients left in place peaked up to a model's gradient bytes
#    under the same plan in a loop (ViT-L on an H200: 1.17 GiB measured where 0.71 was verified). The host link is measured each way with pinned
#    64 MiB copies, once per process and device.
# 5. A last forward (no backward) times each aten op inside each block, counting ops as
#    ``Recompute(save=...)`` does (``OpCounter``, NOTE [ Selective recompute ] Rule 1), and sizes
#    the outputs of those it could keep (``keepable``, NOTE [ Selective recompute ] Rule 2): the candidates a recomputed
#    block may keep. Timing each op alone adds the launch gap the timer itself opens around it (the ops
#    of a Llama layer summed to 13% more than its forward, those of the GPT block to 4-40% more,
#    by machine), about the same for every op, so it weighs on small ops and hardly on a matmul.
#    The costs the optimiser reads are the op times less one gap each (none below zero), the gap
#    chosen so that they sum to the block's forward time of the profiling step. The same forward
#    records, for each tensor a block saves, how many of the block's ops had run when it was saved
#    (``Profile.saved_after``), so the time up to each saved tensor is known: what recomputing a
#    block's first parts costs (NOTE [ Step model ] Rule 2c). A forward that saves another number of
#    tensors than the profiled step leaves it unknown, and the block is not offered in parts.
# 6. When the plain step does not fit on the device (``torch.cuda.OutOfMemoryError``), the step
#    runs with every block under ``torch.utils.checkpoint`` instead, recording what is saved outside
#    the blocks and each block's inputs; then each block runs alone on its inputs, forward and
#    backward, and is recorded as in Rules 2-3 and 5 (``profile_blocks``). The chain is then
#    calibrated on that step's peak, with every block recomputed (``StepCosts.calibrated_on``), and
#    the no-checkpointing figures are predictions. Not where ranks plan together (NOTE [ One plan for all ranks ] Rule 7).
# 7. A block whose forward changes state that a recomputation would change again (what it is called
#    with, such as a KV cache it appends to, or its modules' attributes; ``Profile.mutates`` says what) is
#    never offered recomputation: NOTE [ Mutating forwards ] Rule 5 in recompute/mutation.py. A block whose
#    forward writes its own buffers (batch norm's running statistics in training: a buffer's version moves
#    during the profiled forward; ``Profile.writes_buffers``) may be recomputed: ``Recompute`` puts the
#    buffers back around every recomputation, so they end the step as plain autograd leaves them
#    (NOTE [ Buffers written in a forward ]).
# 8. What the model's forward, the loss or the backward raises in a step (a batch or a loss the model does not take)
#    comes out as ``StepRaised``, naming which of the three, with the exception as its ``__cause__``; the planner's
#    entry points raise it as an error naming their call, chained to it. torchckpt's own errors and running out of
#    device memory (Rule 6) pass through as they are.
# 9. Times vary between steps and processes by a few percent, and a plan decided on one noisy time differs
#    from a plan decided on another; and Rule 2's hooks (Python per saved tensor) and Rule 7's watch (a walk of
#    each block's state) slow the step they record: a ResNet-152 step of 70 ms took 153 ms recorded, on an H100.
#    So the times come from ``repeats`` (3) more steps that record times only (Rule 3's marks and gradient
#    hooks, per block; no saved-tensor hook, nothing watched), after the recorded one: each block's forward
#    and backward, the forward's and the step's time are their medians; the op-timing forward of Rule 5 runs as
#    many times, and each op's time is its median. Blocks that run the same computation (one ``kind``, the
#    same input bytes, saved tensors and ops) then share the median of their times (``Profile.blocks``): the
#    search sees identical layers as identical, and breaks ties between them by position alone.
# 10. The step also records whether each block was called with the previous block's first output, unchanged, as
#    its first positional tensor argument (``Profile.chained``, ``Block.chained``), as ``checkpoint_chain`` checks
#    its blocks (NOTE [ Chain of blocks ] Rule 5): only blocks that all are may be planned as Revolve over the chain
#    (NOTE [ Plan search ] Rule 6). T5's decoder blocks take the decoder's embeddings, not the encoder's output;
#    timm's ConvNeXt downsamples between its stages' blocks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import statistics
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from torchckpt._errors import CheckpointError
from torchckpt.planner.blocks import block_kind, find_blocks
from torchckpt.planner.costs import RECOMPUTE, Block, StepCosts, CodecCost, Link
from torchckpt.planner.measure import Clock
from torchckpt.planner.op_timing import SAC_OPS, OpCost, OpTimer, less_gaps, median_ops
from torchckpt.planner.shared import shared_of
from torchckpt.planner.sharded import ParamStorages
from torchckpt.planner.wrapping import first_output, follows, wrap_block, wrap_call, wrap_recomputed
from torchckpt.recompute.mutation import CallState, module_state

__all__ = ["OpCost", "Profile", "SAC_OPS", "SavedTensor", "StepRaised", "profile", "profile_blocks"]

@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One tensor a block's forward saved (NOTE [ Profiling step ] Rule 2).

    Attributes:
        position: its position among the block's saved tensors (``Offload(tensors=...)``).
        nbytes: bytes of the storage span it keeps alive; 0 when it stays by reference under any
            plan (a parameter, a view of one) or its storage was counted before.
        shape / dtype: as saved.
        why_zero: ``""``, ``"parameter"`` or ``"shared"``.
        storage: which storage it is, numbered in the step's order (NOTE [ Shared storages ] Rule 2); ``-1``: not
            followed (a parameter's, or not recorded).
    """

    position: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    why_zero: str = ""
    storage: int = -1


@dataclasses.dataclass(frozen=True)
class Profile:
    """What one measured step says about a model (NOTE [ Profiling step ])."""

    names: tuple[str, ...]
    kinds: tuple[str, ...]
    saved: tuple[tuple[SavedTensor, ...], ...]
    input_bytes: tuple[int, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    bwd_bytes: tuple[int, ...]
    ops: tuple[tuple[OpCost, ...], ...]
    other_saved_bytes: int
    other_fwd_s: float
    other_bwd_s: float
    step_s: float
    peak_none: int
    device: str
    by_blocks: bool = False
    bwd_start_bytes: tuple[int, ...] = ()
    saved_after: tuple[tuple[int, ...], ...] = ()
    writes_buffers: tuple[bool, ...] = ()
    mutates: tuple[str, ...] = ()  # NOTE [ Profiling step ] Rule 7: what each block's forward changed besides its outputs ("": nothing)
    chained: tuple[bool, ...] = ()  # NOTE [ Profiling step ] Rule 10: each block called with the previous one's output
    input_storages: tuple[tuple[tuple[int, int], ...], ...] = ()  # NOTE [ Shared storages ] Rule 2: (storage, bytes)

    def to_json(self) -> str:
        """The profile as JSON (``Profile.from_json`` reads it back): plan again offline, or inspect what was measured."""
        return json.dumps(dataclasses.asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> Profile:
        d = json.loads(text)
        d["saved"] = tuple(tuple(SavedTensor(**{**t, "shape": tuple(t["shape"])}) for t in b) for b in d["saved"])
        d["ops"] = tuple(tuple(OpCost(**o) for o in b) for b in d["ops"])
        d["saved_after"] = tuple(tuple(b) for b in d.get("saved_after", ()))
        d["input_storages"] = tuple(tuple((s, nb) for s, nb in b) for b in d.get("input_storages", ()))
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return Profile(**fields)

    def blocks(self) -> list[Block]:
        out = []
        fwd_s, bwd_s, op_s = self._pooled()  # NOTE [ Profiling step ] Rule 9
        shared = shared_of([[(t.storage, t.nbytes) for t in sv] for sv in self.saved], self.input_storages) if len(
            self.input_storages) == len(self.names) else [()] * len(self.names)  # NOTE [ Shared storages ] Rule 2
        for i, name in enumerate(self.names):
            secs = less_gaps(op_s[i], fwd_s[i])  # NOTE [ Profiling step ] Rule 5
            ops = tuple((o.position, o.nbytes, t) for o, t in zip(self.ops[i], secs) if o.nbytes > 0)
            after = self.saved_after[i] if i < len(self.saved_after) else ()
            at: tuple[float, ...] = ()
            cuts: tuple[int, ...] = ()
            if len(after) == len(self.saved[i]) and [o.position for o in self.ops[i]] == list(range(len(secs))):
                cum = [0.0]
                for t in secs:
                    cum.append(cum[-1] + t)
                at = tuple(cum[min(a, len(secs))] for a in after)  # NOTE [ Profiling step ] Rule 5: the time up to each saved tensor
                # A node saves its inputs before its op runs (count k) and its outputs after (k + 1): tensors two
                # counts apart or more were saved by different nodes (NOTE [ Step model ] Rule 2c).
                cuts = tuple(c for c in range(1, len(after)) if after[c] >= after[c - 1] + 2)
            fixed = i < len(self.mutates) and bool(self.mutates[i])  # NOTE [ Profiling step ] Rule 7: never recomputed
            sac = tuple(o.position for o in self.ops[i] if o.op in SAC_OPS and o.nbytes > 0)  # NOTE [ Plan search ] Rule 7
            first: dict[int, int] = {}  # NOTE [ Plan search ] Rule 1: positions of one storage offload together
            same = tuple(first.setdefault(t.storage, k) if t.storage >= 0 else k for k, t in enumerate(self.saved[i]))
            out.append(Block(name, fwd_s[i], bwd_s[i], self.input_bytes[i],
                             tuple(s.nbytes for s in self.saved[i]), self.kinds[i], self.bwd_bytes[i], ops, at, cuts,
                             recomputable=not fixed, sac=sac,
                             chained=self.chained[i] if len(self.chained) == len(self.names) else True,
                             shared=shared[i], same=same if any(r != k for k, r in enumerate(same)) else ()))
        return out

    def _pooled(self) -> tuple[list[float], list[float], list[list[float]]]:
        """Each block's forward, backward and op times, the median of its group's: blocks of one kind with the same
        input bytes, saved tensors and ops (NOTE [ Profiling step ] Rule 9)."""
        groups: dict[Any, list[int]] = {}
        for i in range(len(self.names)):
            key = (self.kinds[i], self.input_bytes[i], tuple(t.nbytes for t in self.saved[i]),
                   tuple((o.op, o.nbytes) for o in self.ops[i]))
            groups.setdefault(key, []).append(i)
        fwd, bwd = list(self.fwd_s), list(self.bwd_s)
        ops = [[o.seconds for o in b] for b in self.ops]
        for members in groups.values():
            if len(members) < 2:
                continue
            f, b = statistics.median([self.fwd_s[i] for i in members]), statistics.median([self.bwd_s[i] for i in members])
            per_op = [statistics.median([self.ops[i][k].seconds for i in members]) for k in range(len(self.ops[members[0]]))]
            for i in members:
                fwd[i], bwd[i], ops[i] = f, b, list(per_op)
        return fwd, bwd, ops

    def chain(self, link: Link, codec: CodecCost | None = None) -> StepCosts:
        """The costs the optimiser reads (``Block.saved`` lists the positions with bytes, in order).

        ``peak_none`` is the measured no-checkpointing peak, or with ``by_blocks`` (NOTE [ Profiling step ] Rule 6) the
        measured peak of the step with every block recomputed; the chain is calibrated on it.
        """
        blocks = self.blocks()
        if self.by_blocks:
            return StepCosts.calibrated_on(blocks, [RECOMPUTE] * len(blocks), self.peak_none, self.other_saved_bytes,
                                       self.other_fwd_s, self.other_bwd_s, link, codec)
        return StepCosts.calibrated(blocks, self.peak_none, self.other_saved_bytes, self.other_fwd_s, self.other_bwd_s,
                                link, codec, self.bwd_start_bytes)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif hasattr(x, "to_tuple"):  # transformers' ModelOutput
        yield from _tensors(x.to_tuple())


def _first_grad_tensor(x: Any) -> torch.Tensor | None:
    return next((t for t in _tensors(x) if t.requires_grad and t.is_floating_point()), None)


class _Recorder:
    """Saved-tensor hooks that record and change nothing (NOTE [ Profiling step ] Rule 2), and the per-block timing
    hooks (NOTE [ Profiling step ] Rule 3)."""

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]], params: ParamStorages, clock: Clock,
                 light: bool = False) -> None:
        self.light = light  # NOTE [ Profiling step ] Rule 9: times only: no saved-tensor hooks, no state watched
        self.blocks = blocks
        self.params = params
        self.clock = clock
        self.current: int | None = None
        self.seen: set[int] = set()
        self.storages: dict[int, tuple[int, StorageWeakRef]] = {}  # NOTE [ Shared storages ] Rule 2: by address
        self.numbered = 0
        self.input_storages: list[tuple[tuple[int, int], ...]] = [() for _ in blocks]
        self.saved: list[list[SavedTensor]] = [[] for _ in blocks]
        self.other = 0
        self.inputs = [0] * len(blocks)
        self.fwd: list[tuple[Any, Any]] = [(None, None)] * len(blocks)
        self.grad_at_out: list[Any] = [None] * len(blocks)
        self.grad_at_in: list[Any] = [None] * len(blocks)
        self.bwd_start = [0] * len(blocks)  # bytes allocated when the block's backward began (CUDA)
        self.bwd_bytes = [0] * len(blocks)
        self.running: dict[int, int] = {}  # blocks whose backward runs: the allocator's peak since it began
        self.peak = 0  # the step's peak, carried over the resets below
        self.keep_sample = False
        self.sample: torch.Tensor | None = None
        self.writes_buffers = [False] * len(blocks)  # NOTE [ Profiling step ] Rule 7: blocks whose forward writes their buffers
        self.mutates = [""] * len(blocks)  # NOTE [ Profiling step ] Rule 7: what else each block's forward changed
        self.chained = [True] * len(blocks)  # NOTE [ Profiling step ] Rule 10: called with the previous block's output
        self.last: list[tuple[torch.Tensor, int] | None] = [None]  # the previous block's first output, its version

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        i = self.current
        why = ""
        nbytes = st.nbytes()
        if st in self.params or (t.requires_grad and t.is_leaf):  # NOTE [ Sharded parameters ] Rule 1
            why, nbytes = "parameter", 0
        elif ptr in self.seen:
            why, nbytes = "shared", 0
        else:
            self.seen.add(ptr)
        storage = self.storage(st) if why != "parameter" else -1
        if i is None:
            self.other += nbytes
        else:
            if self.keep_sample and nbytes and t.is_floating_point() and (
                    self.sample is None or t.numel() > self.sample.numel()):
                self.sample = t.detach()
            self.saved[i].append(SavedTensor(len(self.saved[i]), nbytes, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                             why, storage))
        return t

    def storage(self, st: torch.UntypedStorage) -> int:
        """The storage's number (NOTE [ Shared storages ] Rule 2): one per storage alive at once; an address freed and
        allocated again is a new storage."""
        got = self.storages.get(st.data_ptr())
        if got is None or got[1].expired():
            got = self.storages[st.data_ptr()] = (self.numbered, StorageWeakRef(st))
            self.numbered += 1
        return got[0]

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @contextlib.contextmanager
    def block(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
        x = _first_grad_tensor((args, kwargs))
        if x is not None:
            x.register_hook(lambda g: self._at(self.grad_at_in, i))
        if self.light:
            start = self.clock.mark()
            try:
                yield
            finally:
                self.fwd[i] = (start, self.clock.mark())
            return
        ins = [st for st in (t.untyped_storage() for t in _tensors((args, kwargs))) if st not in self.params]
        self.inputs[i] = sum(st.nbytes() for st in ins)
        self.input_storages[i] = tuple((self.storage(st), st.nbytes()) for st in ins if st.nbytes())
        self.chained[i] = i == 0 or follows(args, self.last)  # NOTE [ Profiling step ] Rule 10
        outer, self.current = self.current, i
        bufs = list(self.blocks[i][1].buffers()) if i < len(self.blocks) else []
        versions = [b._version for b in bufs]
        state = (CallState.of(None, args, kwargs), module_state(self.blocks[i][1])) if i < len(self.blocks) else ()
        start = self.clock.mark()
        try:
            yield
        finally:
            self.fwd[i] = (start, self.clock.mark())
            self.current = outer
            if any(b._version != v for b, v in zip(bufs, versions)):  # NOTE [ Profiling step ] Rule 7
                self.writes_buffers[i] = True
            changed = "; ".join(st.describe(w) for st in state for w in [st.changes()] if w)
            if changed:  # NOTE [ Profiling step ] Rule 7: NOTE [ Mutating forwards ] Rule 5
                self.mutates[i] = changed

    def output(self, i: int, out: Any) -> None:
        if not self.light:
            self.last[:] = [first_output(out)]
        y = _first_grad_tensor(out)
        if y is not None:
            y.register_hook(lambda g: self._at(self.grad_at_out, i))

    def _at(self, where: list[Any], i: int) -> None:
        if where[i] is not None:
            return
        where[i] = self.clock.mark()
        if self.clock.cuda:  # NOTE [ Profiling step ] Rule 3: each block's backward working memory, from the allocator's peak
            top = torch.cuda.max_memory_allocated()  # since the last reset, which may have been a moment ago
            self.peak = max(self.peak, top)
            for j in self.running:  # another block's hook on the same tensor may reset the peak first: keep it
                self.running[j] = max(self.running[j], top)
            now = torch.cuda.memory_allocated()
            if where is self.grad_at_out:
                self.bwd_start[i] = now
                self.running[i] = now
            elif i in self.running:
                self.bwd_bytes[i] = max(0, self.running.pop(i) - self.bwd_start[i])
            torch.cuda.reset_peak_memory_stats()


def _loss_of(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    if isinstance(out, torch.Tensor) and out.numel() == 1 and out.requires_grad:
        return out
    ts = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
    if not ts:
        raise ValueError("torchckpt: the model's output holds no tensor that requires grad; pass loss_fn=... (a function "
                         "of the output returning a scalar to differentiate).")
    return sum((t.float().square().mean() for t in ts), torch.zeros((), device=ts[0].device))


def _setup(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]] | None,
           loss_fn: Callable[[Any], torch.Tensor] | None) -> tuple[list[tuple[str, nn.Module]], ParamStorages,
                                                                   torch.device, Clock, Callable[[Any], torch.Tensor]]:
    """What both ways of profiling start from: the chain, the storages of parameters and buffers, the device, a
    clock, the loss."""
    chain = list(blocks) if blocks is not None else find_blocks(model)
    params = ParamStorages(model)
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    return chain, params, device, Clock(device), loss_fn if loss_fn is not None else _loss_of


class StepRaised(CheckpointError):
    """``where`` in a profiling step (the model's forward, the loss, the backward) raised ``error``
    (NOTE [ Profiling step ] Rule 8)."""

    def __init__(self, where: str, error: Exception) -> None:
        super().__init__(f"torchckpt: {where} raised {type(error).__name__} in a profiling step: {error}")
        self.where, self.error = where, error


def _step(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss_of: Callable[[Any], torch.Tensor],
          rec: _Recorder | None, clock: Clock, wraps: list[Callable[[], None]]) -> None:
    """One step, recorded by ``rec`` when given (the output held through backward, as training code holds it), then
    the blocks' forwards put back (``wraps``: their undos). What the model, the loss or the backward raises comes as
    ``StepRaised`` (NOTE [ Profiling step ] Rule 8)."""
    where = "the model's forward"
    model.zero_grad(set_to_none=True)  # NOTE [ Profiling step ] Rule 4: the step allocates its gradients
    try:
        ctx = (torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack) if rec is not None and not rec.light
               else contextlib.nullcontext())
        with ctx:
            out = model(*args, **kwargs)
            where = "the loss of the model's output"
            loss = loss_of(out)
        if rec is not None:
            rec.fwd_end = clock.mark()  # type: ignore[attr-defined]
        where = "the backward of the loss"
        loss.backward()
    except torch.cuda.OutOfMemoryError:  # NOTE [ Profiling step ] Rule 6
        raise
    except Exception as e:
        if isinstance(e, StepRaised) or str(e).startswith("torchckpt:"):
            raise
        raise StepRaised(where, e) from e
    finally:
        for undo in wraps:
            undo()


def profile(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
            blocks: Sequence[tuple[str, nn.Module]] | None = None,
            loss_fn: Callable[[Any], torch.Tensor] | None = None, warmup: int = 1,
            keep_sample: list[torch.Tensor] | None = None, repeats: int = 3) -> Profile:
    """Run and measure one step of ``model(*args, **kwargs)`` (NOTE [ Profiling step ]); gradients are left in place.

    Args:
        model: the model.
        args / kwargs: an example batch.
        blocks: the chain, ``(name, module)`` in forward order (default: ``find_blocks``).
        loss_fn: output -> scalar (default: the output's ``.loss``, the output if it is a scalar, else the
            mean square of its tensors).
        warmup: unmeasured steps first.
        keep_sample: if a list, the largest tensor a block saved is appended to it (to measure a codec on).
        repeats: measured steps and op-timing forwards, whose median times count (NOTE [ Profiling step ] Rule 9).
    """
    chain, params, device, clock, loss_of = _setup(model, blocks, loss_fn)

    def step(rec: _Recorder | None) -> None:
        wraps = [wrap_block(mod, i, rec) for i, (_, mod) in enumerate(chain)] if rec is not None else []
        _step(model, args, kwargs, loss_of, rec, clock, wraps)

    try:
        for _ in range(warmup):
            step(None)
    except torch.cuda.OutOfMemoryError:  # NOTE [ Profiling step ] Rule 6: the plain step does not fit
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        from torchckpt.planner.ranks import together  # (ranks reads this module)
        if together(model):  # NOTE [ One plan for all ranks ] Rule 7: not on one rank alone
            raise
        warnings.warn("torchckpt: the model's step does not fit on the device without checkpointing; profiling it block "
                      "by block, under recomputation (the no-checkpointing figures in the plan are predictions).",
                      RuntimeWarning, stacklevel=3)
        return profile_blocks(model, args, kwargs, blocks=chain, loss_fn=loss_fn, warmup=warmup,
                              keep_sample=keep_sample)
    start_bytes = _start(model, clock, device)
    rec = _Recorder(chain, params, clock)
    rec.keep_sample = keep_sample is not None
    _timed(step, rec, clock)
    rec.last[:] = [None]  # NOTE [ Profiling step ] Rule 10: the last block's output is not held past its step
    if clock.cuda:
        peak = max(rec.peak, torch.cuda.max_memory_allocated(device)) - start_bytes
    else:
        peak = _cpu_peak(model, rec)
    if keep_sample is not None and rec.sample is not None:
        keep_sample.append(rec.sample)
    runs = [_timed(step, _Recorder(chain, params, clock, light=True), clock) for _ in range(repeats)]  # NOTE [ Profiling step ] Rule 9
    fwd = [statistics.median([r[0][i] for r in runs]) for i in range(len(chain))]
    bwd = [statistics.median([r[1][i] for r in runs]) for i in range(len(chain))]
    fwd_total, step_s = statistics.median([r[2] for r in runs]), statistics.median([r[3] for r in runs])
    op_runs = [_op_costs(model, chain, args, kwargs, clock) for _ in range(repeats)]
    ops, after = median_ops([r[0] for r in op_runs]), op_runs[0][1]  # NOTE [ Profiling step ] Rule 9
    return Profile(
        names=tuple(nm for nm, _ in chain), kinds=tuple(block_kind(m) for _, m in chain),
        saved=tuple(tuple(s) for s in rec.saved), input_bytes=tuple(rec.inputs),
        fwd_s=tuple(fwd), bwd_s=tuple(bwd), bwd_bytes=tuple(rec.bwd_bytes), ops=ops, other_saved_bytes=rec.other,
        other_fwd_s=max(0.0, fwd_total - sum(fwd)), other_bwd_s=max(0.0, step_s - fwd_total - sum(bwd)),
        step_s=step_s, peak_none=int(peak), device=str(device),
        bwd_start_bytes=tuple(b - start_bytes for b in rec.bwd_start) if clock.cuda and all(
            s is not None for s in rec.grad_at_out) else (),
        saved_after=after, writes_buffers=tuple(rec.writes_buffers), mutates=tuple(rec.mutates),
        chained=tuple(rec.chained), input_storages=tuple(rec.input_storages),
    )


def _start(model: nn.Module, clock: Clock, device: torch.device) -> int:
    """The measured step's start (NOTE [ Profiling step ] Rule 4): gradients set to ``None`` first, the allocator's peak
    reset, and what is allocated then (0 on the CPU)."""
    model.zero_grad(set_to_none=True)
    clock.sync()
    if not clock.cuda:
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _timed(step: Callable[[_Recorder], None], rec: _Recorder,
           clock: Clock) -> tuple[list[float], list[float], float, float]:
    """One recorded step's times: each block's forward and backward, the forward's, the step's
    (NOTE [ Profiling step ] Rule 3)."""
    t0 = clock.mark()
    step(rec)
    t1 = clock.mark()
    clock.sync()
    bwd = [clock.between(a, b) if a is not None and b is not None else 0.0
           for a, b in zip(rec.grad_at_out, rec.grad_at_in)]
    return ([clock.between(a, b) for a, b in rec.fwd], bwd, clock.between(t0, rec.fwd_end),  # type: ignore[attr-defined]
            clock.between(t0, t1))


def profile_blocks(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                   blocks: Sequence[tuple[str, nn.Module]] | None = None,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None, warmup: int = 1,
                   keep_sample: list[torch.Tensor] | None = None) -> Profile:
    """``profile`` for a step that fits only with its blocks recomputed (NOTE [ Profiling step ] Rule 6).

    The step runs with every block under ``torch.utils.checkpoint`` (what is saved outside the
    blocks, the step's time and peak, each block's inputs); then each block runs alone on its
    recorded inputs, forward and backward, recorded as ``profile`` records a block. The
    parameters' ``.grad`` are those of the whole step; the blocks' own runs leave none.
    """
    chain, params, device, clock, loss_of = _setup(model, blocks, loss_fn)
    n = len(chain)
    inputs: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [None] * n

    chained: list[bool] = [True] * n  # NOTE [ Profiling step ] Rule 10
    last: list[tuple[torch.Tensor, int] | None] = [None]

    def step(rec: _Recorder | None) -> None:
        wraps = [wrap_recomputed(mod, i, inputs if rec is not None else None, chained, last if rec is not None else None)
                 for i, (_, mod) in enumerate(chain)]
        _step(model, args, kwargs, loss_of, rec, clock, wraps)

    for _ in range(warmup):
        step(None)
    start_bytes = _start(model, clock, device)
    rec = _Recorder(chain, params, clock)  # nothing sets rec.current: it records what the step saves outside the blocks
    t0 = clock.mark()
    step(rec)
    t1 = clock.mark()
    last[:] = [None]
    clock.sync()
    peak = (torch.cuda.max_memory_allocated(device) - start_bytes) if clock.cuda else None
    fwd_total = clock.between(t0, rec.fwd_end)  # type: ignore[attr-defined]
    step_s = clock.between(t0, t1)

    grads = [(p, p.grad) for p in model.parameters()]
    for p, _ in grads:
        p.grad = None
    per: list[_Recorder] = []
    ops: list[tuple[OpCost, ...]] = []
    after: list[tuple[int, ...]] = []
    try:
        for i, (name, mod) in enumerate(chain):
            got = inputs[i]
            if got is None:
                raise ValueError(f"torchckpt: block {name} did not run in the model's forward; pass blocks=[...] that it "
                                 "runs, in order.")
            a, kw = _leaves(got)
            r = _Recorder([chain[i]], params, clock)
            r.keep_sample = keep_sample is not None
            with torch.autograd.graph.saved_tensors_hooks(r.pack, r.unpack):
                with r.block(0, a, kw):
                    out = mod(*a, **kw)
                r.output(0, out)
            outs = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            clock.sync()
            del out, outs
            timer = OpTimer(1, clock)
            timer.current = 0
            with timer:
                mod(*a, **kw)
            clock.sync()
            ops.append(tuple(OpCost(k, nm, nb, clock.between(x, y)) for k, nm, nb, x, y in timer.raw[0]))
            after.append(tuple(timer.packs[0]))
            per.append(r)
            inputs[i] = None
    finally:
        for p, g in grads:
            p.grad = g
    if keep_sample is not None:
        best = max((r.sample for r in per if r.sample is not None), key=lambda t: t.numel(), default=None)
        if best is not None:
            keep_sample.append(best)
    fwd = [clock.between(*r.fwd[0]) for r in per]
    bwd = [clock.between(r.grad_at_out[0], r.grad_at_in[0]) if r.grad_at_out[0] is not None
           and r.grad_at_in[0] is not None else 0.0 for r in per]
    saved = [[dataclasses.replace(t, storage=-1) for t in r.saved[0]] for r in per]  # NOTE [ Shared storages ] Rule 4
    if peak is None:  # the CPU: the gradients, the inputs kept, the largest block's saved tensors
        grads_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        peak = grads_bytes + rec.other + sum(r.inputs[0] for r in per) + max(
            (sum(t.nbytes for t in sv) for sv in saved), default=0)
    return Profile(
        names=tuple(nm for nm, _ in chain), kinds=tuple(block_kind(m) for _, m in chain),
        saved=tuple(tuple(sv) for sv in saved), input_bytes=tuple(r.inputs[0] for r in per),
        fwd_s=tuple(fwd), bwd_s=tuple(bwd), bwd_bytes=tuple(r.bwd_bytes[0] for r in per), ops=tuple(ops),
        other_saved_bytes=rec.other, other_fwd_s=max(0.0, fwd_total - sum(fwd)),
        other_bwd_s=max(0.0, step_s - fwd_total - sum(fwd) - sum(bwd)), step_s=step_s, peak_none=int(peak),
        device=str(device), by_blocks=True, saved_after=tuple(after),
        writes_buffers=tuple(r.writes_buffers[0] for r in per), mutates=tuple(r.mutates[0] for r in per),
        chained=tuple(chained),
    )


def _leaves(got: tuple[tuple[Any, ...], dict[str, Any]]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A block's recorded inputs as fresh leaves (same values; ``requires_grad`` as recorded)."""

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.requires_grad and not x.is_leaf:  # an activation: a view of a fresh leaf, so not a "parameter"
                return x.detach().requires_grad_(True).view_as(x)
            return x.detach().requires_grad_(x.requires_grad)
        return x

    a, kw = got
    return tuple(leaf(x) for x in a), {k: leaf(v) for k, v in kw.items()}


def _op_costs(model: nn.Module, chain: Sequence[tuple[str, nn.Module]], args: tuple[Any, ...],
              kwargs: dict[str, Any], clock: Clock) -> tuple[tuple[tuple[OpCost, ...], ...], tuple[tuple[int, ...], ...]]:
    """One more forward, each block's aten ops timed (NOTE [ Profiling step ] Rule 5), and how many ops each block had
    run as each of its saved tensors was saved; the graph is dropped, nothing is differentiated."""
    timer = OpTimer(len(chain), clock)
    model.zero_grad(set_to_none=True)  # NOTE [ Profiling step ] Rule 4, as every step of the planner
    undo = []

    def enter(i: int) -> Callable[[], None]:
        timer.current, timer.k = i, 0

        def leave() -> None:
            timer.current = None
        return leave

    for i, (_, mod) in enumerate(chain):
        undo.append(wrap_call(mod, functools.partial(enter, i)))
    try:
        with timer:
            out = model(*args, **kwargs)
        del out
    finally:
        for u in undo:
            u()
    clock.sync()
    return (tuple(tuple(OpCost(k, name, nb, clock.between(a, b)) for k, name, nb, a, b in ops) for ops in timer.raw),
            tuple(tuple(p) for p in timer.packs))


def _cpu_peak(model: nn.Module, rec: _Recorder) -> int:
    """On the CPU there is no allocator peak: the gradients plus every saved byte."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return grads + sum(s.nbytes for b in rec.saved for s in b) + rec.other
