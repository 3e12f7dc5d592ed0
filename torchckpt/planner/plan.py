"""A plan: a decision per block and per saved tensor, its JSON, and applying it to the model (``plan()`` and
``plans()``, which make one, are in planner/verify.py, where NOTE [ Applying a plan ] Rules 4-8's verification runs).

# NOTE [ Applying a plan ]
# 1. ``Plan.apply(model)`` wraps each planned block with the policy its decision names, through
#    ``torchckpt.checkpoint(block, policy=...)``: ``Recompute()`` (``Recompute(save=..., parts=...)``
#    for kept ops and a recomputation in parts), or ``Offload(store, codec,
#    tensors=positions)`` for an offload, where ``positions`` are the block's saved tensors (by
#    the order its forward saves them, NOTE [ Profiling step ] Rule 2) the plan sends to host; kept
#    blocks are left as they are. A plan with Revolve over the chain (``Plan.revolve``, NOTE [ Revolve over
#    the chain ]) recomputes every block through ``torchckpt.checkpoint_chain(blocks, schedule=plan.schedule(),
#    policy=[Recompute(save=..., parts=...) per block])``. ``Applied.remove()`` puts the blocks' forwards back.
# 2. Offloads (and what blocks recomputed with ``host`` keep, their inputs and kept ops' outputs,
#    through ``Recompute(store=...)``) go through one ``Store`` made for the plan unless one is passed,
#    whose GPU cache holds two blocks' offloaded bytes, the block whose backward runs and the next
#    one, prefetched (``cache_bytes``; NOTE [ Step model ] Rules 2-3 with ``lookahead=1``). Its host memory is the
#    process's shared pool (``shared_host_pool``), not a pool of its own: a new lazily pinned pool touches and
#    registers its memory in the background during the first steps that use it, and a registration holds up the
#    process's CUDA calls (NOTE [ Lazy host pool ] Rule 9), so each of the planner's measurements of an offloading
#    policy, made through a plan applied for it (a warm-up step and three or more timed), ran on a pool still being
#    pinned, and so did the first steps of the plan applied after planning. On an H100 the floor plans of Llama,
#    Qwen2 and Mixtral (the inputs of 13 of 16, 16 of 16 and 12 of 12 blocks on host) measured 182.6-188.5,
#    162.1-172.4 and 166.6 ms while planning and 172.7, 157.4 and 152.9 ms in the zoo's rows of the same process (two
#    warm-up steps, the median of seven), where their plans that sent nothing to host measured within 1.2% of their
#    rows (not everywhere: GPT-NeoX's floor, every block's inputs on host, measured 137.6-143.3 ms while planning and
#    143.3 in its row; ResNet-152's plan with inputs on host 145.2-158.7 against 175.3 ms, on a model whose steps vary
#    20-40%). With one shared pool what one measurement pinned is pinned for the next and for training. Measured
#    after (H100): Mixtral's floor 125.8 ms while planning and 122.9 in its row; Qwen2's 168.6 at the pool's first
#    measurement, 157.3 in turns seconds later and 157.7 in its row: the first steps on the pool still ran beside
#    its worker registering the chunks they had reached, hence Rule 4's settle.
# 3. Every decision moves a saved tensor through the store or recomputes it exactly, so gradients
#    are those of plain autograd whatever the plan, except with a lossy codec, which ``explain``
#    and ``Plan.lossy`` state with its bound. If a block saves another number of tensors than
#    profiled (``Offload(expect=...)``), it warns once and offloads all of them from then on.
# 4. A plan is checked on the device before it is returned (``verify=True``; planner/verify.py): steps run under
#    it, after the allocator's cached blocks are released (``torch.cuda.empty_cache()``: the steps of other plans
#    leave blocks of other sizes behind; on an H200 the planner's measurements of ResNet-152 plans were 25-57%
#    slower than the same plans measured in the same process after emptying the cache), one that builds the
#    store's prefetch plan, then the wait for the store's host pool to settle (``settle()``, at most ``_SETTLE_S``:
#    its registrations hold up the process's CUDA calls, NOTE [ Lazy host pool ] Rule 11), then ``_VERIFY_STEPS``
#    whose largest peak is kept and whose median time is the
#    plan's, and while those times spread over 10% (largest over smallest), more steps, up to ``_VERIFY_MOST``
#    (``more_steps``; a rank alone: ranks planning together run the same steps): on an H100 host, eight steps in a
#    row of every block ``Recompute()`` on ConvNeXt-B took 126-195 ms where keeping everything took 81-82 ms, so
#    the median of three was at times a slow step's (the planner measured 182.4 ms in one process, 131.2 in
#    another; ``benchmarks/policy_drift.py``). A peak must leave a slack of 1% of the budget, and at least 2 MiB
#    (10% of budgets under 20 MiB): the allocator's peak varies a little with what ran before. Over that, the plan
#    is made again for its prediction less the excess (for the floor's plan where that is below the floor: a plan nearer the floor may fit where its
#    excess says it would not; on an H100 ViT-L's plan at 1.03x its floor had peaked 2.3% over its prediction and
#    the floor's plan was never tried), up to ``_REPLANS`` times; then the fastest simple policy measured while
#    planning (NOTE [ Mechanism costs ]) whose measured peak is within the budget less the slack is returned (on an
#    H100 ConvNeXt-B's search plan at the floor peaked 3.5% over 1.03x the floor, where every block
#    ``Recompute(store=...)`` had measured at the floor), and without one ``PlanError`` says what was measured. So a
#    returned plan's measured peak is within its budget, whatever NOTE [ Step model ] left out.
# 5. The step model is least sure of the copies (how the store's cache and the codec's kernels share
#    the device with compute), so verification races the best plan of each family (``FAMILIES``:
#    any plan; without compression; with nothing over the host link), each verified as in Rule 4,
#    and returns the one whose measured step (the median of the verification steps) is fastest.
#    Families whose best plan was already measured are not run again.
# 6. Plans for several budgets from one profile (``plans``, or ``plan`` called again on one ``_Profiled``) keep
#    the measured step time from rising with the budget too: a budget whose own verified plan measured slower
#    than one verified for another budget, whose measured peak is within this budget's slack, gets that plan
#    (measurements of one plan differ by a few percent between steps; the model's predictions are monotone
#    by NOTE [ Plan search ] Rule 3, the measurements need this). Where the two measured within 3% of each other,
#    they run in turns as Rule 9 runs them, within 1% decided as in Rule 8 (on an H100, ConvNeXt-B's plan for 7.79
#    GiB, predicted 95.1 ms and measured 94.3, gave way to the 4.92 GiB plan measured 93.2 and predicted 104.5, which
#    measured 102-105 ms in turns after, where every other block measured 95; when the two were measured once more
#    each, one after the other, one of three processes planning GPT-NeoX for 9.84 GiB returned its 7.75 GiB plan,
#    which measured 130.8 ms in turns after against 126.3 and 128.0 for the 9.84 GiB plan the other two returned: a
#    second figure measured after the first carries the host's drift as much as the first).
# 7. The policies a user writes in one line are measured too, not only predicted (NOTE [ Plan search ] Rule 7):
#    beside the plan Rule 5 returns, verification runs the fastest simple policy for the budget, once, as in Rule 4
#    but never made again: one measured while planning (NOTE [ Mechanism costs ]) ranks by its measured step if its
#    measured peak is within the budget less Rule 4's slack, the others by their predictions if their predicted peak
#    is within the budget (on an H100 the zoo's MoE took a plan of 120.7 ms at 8.5 GiB: the policy ranked by its
#    prediction, every other block from the second, measured 151.8 ms, where every other block from the first had
#    measured 116.9 while planning and 101 ms in the zoo). At most one more verification per budget, none when that
#    policy is the plan or was measured already (its figures are taken from there). The simple policy is returned
#    instead of the plan when its measured peak is within the budget less Rule 4's slack and its measured step is
#    no slower than the plan's (equal: the simpler, which it is). ``Plan.simple`` names the simple policy a plan
#    is (``""``: none); ``Plan.measurements`` records what was measured for its budget (the plan, then the simple
#    policy), which ``explain()`` prints ("measured: plan 118.2 ms, every block Recompute() 119.0 ms: kept the
#    plan"). Both survive ``to_json``; a plan written before them loads with none. Rule 6 then compares budgets on what
#    this rule returned; a plan it takes from another budget keeps the record of the budget it was verified for.
# 8. Medians of three steps differ by a few percent between runs of one plan, so Rule 7 alone let two processes
#    planning one model return different plans (on an H100, a ViT-L: the plan in two processes, every other
#    block in the third, 5% slower when measured after). When the plan's and the simple policy's measured steps
#    are within 3% of each other, both are measured again (as Rule 4, the plan first) and each is taken as the
#    mean of its two medians; still within 1%, the simple policy: the measurement cannot tell the two apart, and
#    the simple policy runs fewer mechanisms (no store, no copies sharing the device with compute), whose costs
#    the model is least sure of (on an H100 the GPT stack's 12 GiB plan, five blocks' kept outputs on host,
#    measured 173.4 ms against every block ``Recompute(save=...)``'s 172.6 while planning, and 176.6 against
#    167.2 in the frontier's rows of one process; the model had decided for the plan). The choice is the same in
#    every process. ``Plan.measurements`` records the means.
# 9. Rules 6-8 compare figures measured at different times: a simple policy while planning, a plan for another
#    budget, this budget's plan now. On a busy host one policy's medians moved 20-40% within a run (on an H100 the
#    zoo's MoE took, at 8.5 and 10.1 GiB, the 6.88 GiB plan measured 107.4 ms for its own budget over every other
#    block measured 133.2 ms while planning; in turns after, 114.7 against 109.7 ms). So last, the returned plan and
#    the fastest other candidate measured within the budget (its measured peak within the budget less Rule 4's
#    slack; any measured plan or simple policy), if its figure is within ``_RIVAL`` (30%) of the plan's and the two
#    were not both measured for this budget, run in turns, ``_TURNS`` (3) each, the plan first, each turn as
#    Rule 4; each is taken as the median of its turns' medians, and the faster returned (a rival whose peak went
#    over the budget less the slack is not); within 1% as in Rule 8: a simple policy over a plan of the search,
#    and between two of a kind the faster prediction (the model's figures are the same in every process,
#    NOTE [ Profiling step ] Rule 9). The medians replace the
#    two's earlier figures for later budgets. ``Plan.turns`` records them, the one returned first; ``explain()``
#    prints them. A rival taken has no Rule 7 record (``Plan.measurements`` is empty): it was not this budget's plan.
# 10. Each process's step model is calibrated on its own measurements, which differ by several percent between
#    processes on a host-bound model, so plans of other shapes predicted a few percent apart change rank from one
#    process to the next, and verification measured only the one its process ranked first (on an H100, ConvNeXt-B at
#    4.9 GiB in three processes: two returned the plan recomputing the first 23 blocks, predicted 100.3 and 106.8 ms
#    there, the third one recomputing every other block of the middle stages, predicted 98.3 ms, which measured 104.1
#    ms in turns against 96.7 and 98.4). So before Rule 9, unless the plan keeps every block, verification measures
#    (as Rule 4) the search's fastest plan within the budget predicted within ``_NEAR`` (5%) of the plan's prediction
#    whose blocks' modes differ from the plan's in a quarter of the blocks (two at least), unless measured before;
#    where its measured peak is within the budget less the slack and its step more than 1% under the plan's, the two
#    run in turns as Rule 9 runs them and the faster is taken. Rule 9 then runs as before.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from torch import nn

from torchckpt._args import check_module, found
from torchckpt.api import ChainCheckpoint, checkpoint, checkpoint_chain
from torchckpt.codecs.base import Codec
from torchckpt.memory.factory import shared_host_pool
from torchckpt.planner.costs import cache_bytes, split_bytes
from torchckpt.planner.rebuild import schedule as revolve_schedule
from torchckpt.planner.checks import check_codec
from torchckpt.planner.use_cache import UseCacheOff
from torchckpt.planner.profiling import SavedTensor
from torchckpt.policies import Offload, Recompute
from torchckpt.store import Store

__all__ = ["Applied", "BlockPlan", "Measurement", "Plan"]

_FORMAT = 3


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """One block's decision and what the model predicts for it.

    Attributes:
        name: the block's qualified name in the model.
        mode: ``"keep"``, ``"recompute"`` or ``"offload"``.
        offload: positions of the saved tensors sent to host (``"offload"`` only).
        compress: the offloaded tensors (recomputed with ``host``: the kept outputs) go through the plan's codec.
        host: (``"recompute"``) what the block keeps (its inputs, the kept ops' outputs) goes to host.
        keep_ops: (``"recompute"``) positions of the forward's ops whose outputs are kept instead of
            computed again (``Recompute(save=...)``).
        tensors: the block's saved tensors as profiled.
        input_bytes: bytes of its inputs.
        fwd_s / bwd_s: measured forward and backward time.
        keep_bytes: bytes of the kept ops' outputs.
        keep_names: the kept ops, by name.
        keep_s: the kept ops' measured time (what the recomputation saves).
        parts: (``"recompute"``) cuts among the saved tensors: the block is recomputed in parts, one held
            at a time (``Recompute(parts=...)``, NOTE [ Step model ] Rule 2c).
        parts_s: the time the recomputation of the earlier parts adds (each reruns the forward to its end).
        revolve: (``"recompute"``) > 0: the block's input is kept or rebuilt by Revolve over the chain, whose
            snapshots hold at most this many bytes (``torchckpt.checkpoint_chain``; NOTE [ Revolve over the chain ]).
        revolve_s: the forward time of the blocks Revolve runs again right before this block's backward.
        reentrant: (``"recompute"``) through ``Recompute(reentrant=True)`` (NOTE [ Reentrant recompute ]).
    """

    name: str
    mode: str
    offload: tuple[int, ...]
    compress: bool
    host: bool
    keep_ops: tuple[int, ...]
    tensors: tuple[SavedTensor, ...]
    input_bytes: int
    fwd_s: float
    bwd_s: float
    keep_bytes: int = 0
    keep_names: tuple[str, ...] = ()
    keep_s: float = 0.0
    parts: tuple[int, ...] = ()
    parts_s: float = 0.0
    revolve: int = 0
    revolve_s: float = 0.0
    reentrant: bool = False

    @property
    def saved_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def device_bytes(self) -> int:
        """Bytes this block leaves on the device between its forward and backward."""
        return self._split()[0]

    @property
    def host_bytes(self) -> int:
        """Bytes this block sends to host (before compression)."""
        return self._split()[1]

    def _split(self) -> tuple[int, int]:
        return split_bytes(self.mode, self.host, self.saved_bytes, sum(self.tensors[k].nbytes for k in self.offload),
                           self.input_bytes, self.keep_bytes, bool(self.revolve))


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A plan verification measured for a budget (NOTE [ Applying a plan ] Rule 7).

    Attributes:
        what: ``"plan"``, the search's plan (after the race of NOTE [ Applying a plan ] Rule 5), or the name of the
            simple policy measured beside it (NOTE [ Plan search ] Rule 7).
        step_time: its measured step, seconds (the median of the verification steps).
        peak_bytes: its measured peak.
        fits: its measured peak was within the budget less NOTE [ Applying a plan ] Rule 4's slack.
    """

    what: str
    step_time: float
    peak_bytes: int
    fits: bool = True


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to do with every block's saved tensors for one model and batch shape (``torchckpt.plan``).

    Attributes:
        budget: the budget planned for, bytes of device memory.
        blocks: one ``BlockPlan`` per block of the chain, forward order.
        peak_bytes: the predicted peak device memory of a step (at most ``budget``).
        step_time: the predicted step time, seconds.
        none_peak_bytes / none_step_time: no checkpointing, as measured on the profiling step.
        floor_bytes: the lowest peak the search reached for this model.
        codec: the codec offloads may use (``repr``), or ``None``.
        lossy / bound: whether the plan compresses with a lossy codec (gradients then within its
            bound, not bit-exact), and that codec's bound in words.
        link: the measured host link, bytes/s each way.
        device: where the profiling step ran.
        measured_peak_bytes: the peak of a step run under the plan when it was made (CUDA; ``None``
            on the CPU, which has no allocator statistics, or with ``verify=False``).
        measured_step_time: the median time of those steps (seconds; ``None`` when not measured).
        none_measured: the no-checkpointing figures were measured (``False``: predicted, for a step
            that only fits with its blocks recomputed; NOTE [ Profiling step ] Rule 6).
        simple: the simple policy this plan is (NOTE [ Plan search ] Rule 7), e.g. ``"every block Recompute()"``;
            ``""`` if none.
        measurements: what verification measured for the budget: the plan, then the best simple policy that fits
            (NOTE [ Applying a plan ] Rule 7); ``()`` when not measured.
        turns: the plan and its rival measured in turns, each the median of its turns (NOTE [ Applying a plan ]
            Rule 9): the one returned first; ``()`` when none ran.
    """

    budget: int
    blocks: tuple[BlockPlan, ...]
    peak_bytes: int
    step_time: float
    none_peak_bytes: int
    none_step_time: float
    floor_bytes: int
    codec: str | None
    lossy: bool
    bound: str
    link: tuple[float, float]
    device: str
    measured_peak_bytes: int | None = None
    none_measured: bool = True
    measured_step_time: float | None = None
    simple: str = ""
    measurements: tuple[Measurement, ...] = ()
    turns: tuple[Measurement, ...] = ()

    # -- reading ----------------------------------------------------------------------------
    def explain(self, file: Any = None, *, verbose: bool = False) -> None:
        """Print the plan (``summary``): one row per block with its decision, bytes, cost and prefetch point.

        Args:
            file: where to print (default: ``sys.stdout``); ``summary()`` returns the same text.
            verbose: also the kept ops, the parts, and every tensor sent to host (small ones summed per block).
        """
        print(self.summary(verbose=verbose), file=file)

    def __str__(self) -> str:
        return self.summary()

    def summary(self, *, verbose: bool = False) -> str:
        """What ``explain`` prints, as a string: a header, then one row per block (``verbose``: and per tensor)."""
        from torchckpt.planner.explain import summary
        return summary(self, verbose)

    @property
    def revolve(self) -> int:
        """Bytes the snapshots of Revolve over the chain may hold (0: every recomputed block keeps its input)."""
        return self.blocks[0].revolve if self.blocks else 0

    def schedule(self) -> Any:
        """The schedule Revolve over the chain follows (NOTE [ Revolve over the chain ] Rule 2), or ``None``."""
        if not self.revolve:
            return None
        return revolve_schedule([b.fwd_s for b in self.blocks], [b.input_bytes for b in self.blocks], self.revolve)

    def to_json(self) -> str:
        """The plan as JSON (``Plan.from_json`` reads it back)."""
        d = dataclasses.asdict(self)
        d["format"] = _FORMAT
        return json.dumps(d, indent=1)

    @staticmethod
    def from_json(text: str) -> Plan:
        """Read a plan written by ``to_json``."""
        d = json.loads(text)
        if d.pop("format", None) != _FORMAT:
            raise ValueError(f"torchckpt: this plan was written in another format; plan the model again (format {_FORMAT}).")
        blocks = tuple(BlockPlan(**{**b, "offload": tuple(b["offload"]), "keep_ops": tuple(b["keep_ops"]),
                                    "keep_names": tuple(b.get("keep_names", ())), "parts": tuple(b.get("parts", ())),
                                    "tensors": tuple(SavedTensor(**{**t, "shape": tuple(t["shape"])}) for t in b["tensors"])})
                       for b in d.pop("blocks"))
        measurements = tuple(Measurement(**m) for m in d.pop("measurements", ()))  # NOTE [ Applying a plan ] Rule 7
        turns = tuple(Measurement(**m) for m in d.pop("turns", ()))  # NOTE [ Applying a plan ] Rule 9
        return Plan(blocks=blocks, measurements=measurements, turns=turns, **{**d, "link": tuple(d["link"])})

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @staticmethod
    def load(path: str) -> Plan:
        with open(path) as f:
            return Plan.from_json(f.read())

    # -- applying ---------------------------------------------------------------------------
    def apply(self, model: nn.Module, store: Store | None = None, codec: Codec | None = None) -> Applied:
        """Make every later step of ``model`` follow this plan (NOTE [ Applying a plan ]).

        While it is applied, a transformers model's training forwards run with ``use_cache=False``, with a warning
        (NOTE [ Mutating forwards ] Rule 6): a recomputed block would append to the KV cache a second time.

        Args:
            model: the model planned (its blocks are found by name).
            store: the store offloads go through (default: one made for the plan, NOTE [ Applying a plan ] Rule 2).
            codec: the codec for compressed offloads (the one passed to ``plan``; needed when the
                plan was loaded from JSON and compresses).
        """
        check_module("Plan.apply(model, ...)", model, "pass the model this plan was made for: plan.apply(model)")
        if store is not None and not isinstance(store, Store):
            raise TypeError(f"torchckpt: Plan.apply(store=...) expects a torchckpt.Store or None, got {found(store)}; "
                            "pass None for a store made for the plan, or e.g. store=torchckpt.Store(gpu_bytes=1 << 30).")
        check_codec("Plan.apply(codec=...)", codec)
        if any(b.compress for b in self.blocks) and codec is None:
            raise ValueError(f"torchckpt: this plan compresses with {self.codec}; pass the codec: plan.apply(model, "
                             "codec=...).")
        mods = []
        for b in self.blocks:
            try:
                mods.append(model.get_submodule(b.name))
            except AttributeError as e:
                raise ValueError(f"torchckpt: the model has no block {b.name!r} of this plan; apply a plan to the model "
                                 "it was made for.") from e
        if store is None and any(b.host_bytes for b in self.blocks):
            first = next(iter(model.parameters()), None)
            dev = first.device if first is not None else torch.device(self.device)
            store = Store(device=dev, gpu_bytes=cache_bytes([b.host_bytes for b in self.blocks]), min_bytes=0,
                          host=shared_host_pool(pin=dev.type == "cuda", device=dev))  # NOTE [ Applying a plan ] Rule 2
        undo = []
        off = UseCacheOff(model, mods)  # NOTE [ Mutating forwards ] Rule 6: no KV cache in training forwards
        if self.revolve:  # NOTE [ Revolve over the chain ]: every block recomputed, inputs by the schedule
            chain = checkpoint_chain(mods, schedule=self.schedule(), policy=[
                Recompute(save=frozenset(b.keep_ops) if b.keep_ops else None, parts=b.parts or None)
                for b in self.blocks])
            return Applied(self, store, [], chain, off)
        for b, mod in zip(self.blocks, mods):
            if b.mode == "keep":
                continue
            had, prev = "forward" in mod.__dict__, mod.__dict__.get("forward")
            policy: Any = Recompute(store=store if b.host else None, save=frozenset(b.keep_ops) if b.keep_ops else None,
                                    codec=codec if b.compress else None,
                                    parts=b.parts or None, reentrant=b.reentrant) if b.mode == "recompute" else (
                Offload(store, codec if b.compress else None, tensors=frozenset(b.offload), expect=len(b.tensors)))
            checkpoint(mod, policy=policy)
            undo.append((mod, had, prev))
        return Applied(self, store, undo, cache_off=off)


class Applied:
    """A plan in force on a model; ``remove()`` puts the blocks back as they were."""

    def __init__(self, plan: Plan, store: Store | None, undo: list[tuple[nn.Module, bool, Any]],
                 chain: ChainCheckpoint | None = None, cache_off: UseCacheOff | None = None) -> None:
        self.plan = plan
        self.store = store
        self._undo = undo
        self.chain = chain
        self._cache_off = cache_off  # NOTE [ Mutating forwards ] Rule 6

    def cache_off(self, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        """``use_cache`` turned off for a call of ``mod`` already under way (NOTE [ Mutating forwards ] Rule 6)."""
        return self._cache_off.adjust(mod, args, kwargs) if self._cache_off is not None else None

    def remove(self) -> None:
        if self._cache_off is not None:
            self._cache_off.remove()
            self._cache_off = None
        if self.chain is not None:
            self.chain.remove()
            self.chain = None
        for mod, had, prev in reversed(self._undo):
            if had:
                object.__setattr__(mod, "forward", prev)
            else:
                mod.__dict__.pop("forward", None)
        self._undo = []
