"""What a training step costs under a plan: the measured costs of a chain of blocks, and a timeline model.

Pure Python (no torch): the optimiser and its tests run on synthetic costs.

# NOTE [ Step model ]
# A step is the forward of a chain of blocks, then its backward in reverse order. Each block
# saves tensors for backward; a decision per block says where they live in between:
# ``keep`` (on the device), ``recompute`` (only the block's inputs are kept; the block's forward
# runs again right before its backward, as ``torch.utils.checkpoint`` does) or ``offload``
# (a chosen subset of its saved tensors is copied to host memory, optionally compressed; the rest
# is kept). ``predict`` replays the step on one compute stream and one copy engine per direction:
# 1. Forward: block i computes for ``fwd_s`` (plus the compression of what it offloads); at its end
#    its offloaded bytes queue on the device-to-host engine (FIFO, ``Link.d2h`` bytes/s of wire
#    bytes, i.e. after compression). An offloaded tensor occupies the device until its copy ends.
# 1b. The store's GPU cache (Rule 3) evicts only entries whose copy to host has ended (NOTE [ Store ]
#    Rule 3): when the bytes not yet copied exceed it, the compute stream waits for the oldest
#    copies (a stall in the forward). Without the cache (``predict(cache=False)``), nothing waits.
# 2. Backward: the work outside the blocks (the head, the loss) runs first, and frees what it
#    saved (``other_saved_bytes`` count in the forward only), then block i's
#    backward, ``bwd_s``, plus ``fwd_s`` again if recomputed, plus decompression. The copy back of
#    block i is issued when the backward of block i + ``lookahead`` starts (at the end of the
#    forward for the last blocks), on the host-to-device engine (FIFO), never before its
#    device-to-host copy ended; block i waits for it (a stall).
# 2b. A recomputed block may keep some ops' outputs (``Decision.keep``): they stay on the device
#    from its forward to its backward, or go to host with its inputs (``Decision.host``: copied as
#    an offload is, Rules 1-2, compressed with ``Decision.compress``), and its recomputation takes
#    its forward time less theirs.
# 2c. A recomputed block may be recomputed in parts (``Decision.parts``: cuts among its saved
#    tensors, in the order its forward saves them; ``Recompute(parts=...)``): its backward
#    materialises one part at a time, so it holds the largest part's bytes (and its inputs and kept
#    outputs, throughout) instead of all its saved bytes, but the first recomputation runs the whole
#    forward, whose Python frame may keep every tensor it made alive until it returns (before the
#    backward's working memory, ``bwd_bytes``, is allocated): the block's peak is the larger of the
#    two (on an H100 a model that left this out predicted 98.7 MiB where a small GPT stack peaked at
#    124.2 MiB: most likely its attention's q, k, v and output, which the block's frame still
#    references while the MLP runs), and the recomputation runs the block's forward once to its end and once more
#    for each earlier part, from the block's start to that part's last saved tensor
#    (``Block.saved_at``: the forward's time up to each saved tensor). Cuts fall only between
#    tensors that two different autograd nodes saved (``Block.cuts``): a node's backward unpacks
#    everything it saved at once, so a cut inside one node's tensors would hold two parts together.
# 3. Device memory counts the activations only: tensors kept, inputs of recomputed blocks
#    (unless they go to host too), offloaded tensors until their copy to host ends, then again
#    from the start of their copy back to the end of their block's backward; a recomputed block
#    holds all its saved tensors from its recomputation to the end of its backward, and every
#    block's backward adds its measured working memory (``Block.bwd_bytes``). The store's
#    GPU cache (``cache_bytes``: room for the block in use and the one prefetched) keeps the
#    most recent offloaded tensors resident up to its size, so offloaded bytes count at least
#    ``min(cache, offloaded bytes not yet used)`` in both sweeps. ``peak`` is the largest sum, sampled at
#    every block boundary of both sweeps, plus ``StepCosts.fixed_bytes``: what a step adds besides
#    saved tensors (gradients allocated during backward, the transient working memory at the
#    no-checkpointing peak). Memory allocated before the step (parameters, optimiser state) is
#    not counted: a budget is what one step may add.
# 4. ``fixed_bytes`` is chosen so that keeping every block predicts the measured
#    no-checkpointing peak (``StepCosts.calibrated``), or, for a step that only fits with its blocks
#    recomputed, so that recomputing every block predicts that step's measured peak
#    (``StepCosts.calibrated_on``). What the forward's end holds besides saved tensors (the loss's
#    temporaries) is gone by the blocks' backward, so when the profiling step measured what was
#    allocated as each block's backward began, the backward gets its own fixed bytes: those
#    allocations less the saved bytes of the blocks not yet through backward, each block's own
#    (Rule 6), and ``fixed_bytes`` calibrates the forward's peak alone.
# 5. A plan whose blocks carry ``Decision.revolve`` recomputes every block and keeps only the inputs
#    Revolve over the chain keeps (NOTE [ Revolve over the chain ] in rebuild.py): those inputs are not
#    in the blocks' kept bytes; the states it holds are added at every sample of both sweeps, and the
#    blocks it runs again before a block's backward add their forward time there (and their inputs
#    to the memory while they run).
# 6. What no decision changes in the backward grows as the backward goes: each block's backward allocates
#    its parameters' gradients (every step starts with them ``None``, NOTE [ Profiling step ] Rule 4) and
#    they stay to the step's end, so the blocks that run backward last see the gradients of every block
#    after them. So Rule 4's backward bytes are per block (``StepCosts.bwd_fixed_at``), each sampled at
#    its own block's backward, not the most of them over the chain: that most is the first block's, and
#    at the last block's backward, where a plan that keeps blocks peaks, it counted gradients not yet
#    allocated there (on an H100, 0.53 GiB of ViT-L/16's and 0.61 GiB of T5's). The measured
#    corrections of NOTE [ Mechanism costs ] Rules 3-5 and 8 had absorbed that excess on the plans they
#    were measured on, and carried it, with the opposite sign, to every recomputed block of a mixed plan.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torchckpt._args import part_bytes
from torchckpt.planner.rebuild import States, states
from torchckpt.planner.shared import Ref, corrections, refs

__all__ = ["Block", "StepCosts", "CodecCost", "Decision", "Link", "Prediction", "Terms", "balanced_parts", "cache_bytes",
           "chain_states",
           "device_bytes", "host_bytes", "kept_bytes", "materialised_bytes", "part_bytes", "parts_seconds",
           "recompute_seconds", "replay", "predict", "split_bytes", "terms", "through_reentrant"]


@dataclasses.dataclass(frozen=True)
class Link:
    """Host link bandwidth, bytes per second, each direction (measured on the device)."""

    d2h: float
    h2d: float

    def __post_init__(self) -> None:
        if not (self.d2h > 0 and self.h2d > 0):
            raise ValueError(f"torchckpt: Link bandwidths must be > 0 bytes/s, got d2h={self.d2h}, h2d={self.h2d}.")


@dataclasses.dataclass(frozen=True)
class CodecCost:
    """A codec's measured ratio and throughputs (bytes of input per second), and whether it is lossy.

    Args:
        name: how ``explain`` names it.
        ratio: input bytes over wire bytes (>= 1 makes it worth sending).
        compress: input bytes compressed per second, on the compute stream's device.
        decompress: input bytes decompressed per second.
        lossy: the gradients are within the codec's stated bound, not bit-exact.
        bound: the bound, in words (e.g. ``"|err| <= 1e-2 * max|x| per block"``); ``""`` if lossless.
    """

    name: str
    ratio: float
    compress: float
    decompress: float
    lossy: bool
    bound: str = ""


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of the chain, as measured.

    Args:
        name: the module's qualified name.
        fwd_s: forward time.
        bwd_s: backward time.
        input_bytes: bytes of the block's tensor inputs (what a recomputed block keeps).
        saved: bytes of each tensor the block saves for backward, parameters and views of them
            left out (they stay by reference whatever the plan), each storage counted once.
        kind: blocks with the same kind have the same structure (their decisions can be shared).
        bwd_bytes: the most bytes its backward allocates beyond what was allocated when it
            started (gradients of its activations, temporaries).
        ops: ``(position, bytes, seconds)`` of the forward's ops a recomputation may keep
            instead of running again (NOTE [ Selective recompute ]).
        saved_at: for each saved tensor, the forward's time from the block's start to the end of
            the op that saved it (NOTE [ Step model ] Rule 2c); ``()``: not measured (no recomputation in parts).
        cuts: the positions a recomputation in parts may cut at (NOTE [ Step model ] Rule 2c): where the tensors before
            and after cannot have been saved by one autograd node (a node's backward unpacks all it saved at once).
        recomputable: ``False`` for a block whose forward changes state a recomputation would change again
            (NOTE [ Profiling step ] Rule 7):
            its options are keep and offload only.
        sac: positions among ``ops`` of its matmuls and attention ops, those torch SAC users save: what the simple
            policy ``Recompute(save=...)`` on every block keeps (NOTE [ Plan search ] Rule 7).
        rec_s: what ``Recompute()`` costs this block beyond running its forward again (saved-tensor hooks, the
            recomputation's frame), measured (NOTE [ Mechanism costs ] Rule 3); may be negative.
        keep_rec_s: the same for ``Recompute(save=...)`` (its dispatch mode runs Python per op; NOTE [ Mechanism
            costs ] Rule 4).
        reent_s: the same for ``Recompute(reentrant=True)`` (NOTE [ Mechanism costs ] Rule 13).
        host_rec_s: what sending a recomputed block's inputs (and kept outputs) to host costs it beyond the model's
            copies, measured (NOTE [ Mechanism costs ] Rule 5); priced in the forward (not below 0).
        off_s: what offloading some of this block's saved tensors costs it beyond the model's copies (the saved-tensor
            hooks on every tensor it saves, the store's work for a tensor it sends), measured (NOTE [ Mechanism
            costs ] Rule 14); priced in the forward (not below 0).
        alone_s: what a recomputation of this block costs beyond those where the next block is kept (its
            backward's kernels queued, the recomputation's host work runs beside them), measured (NOTE [ Mechanism
            costs ] Rule 9); may be negative.
        chained: whether its first positional tensor argument was the previous block's first output, unchanged
            (``checkpoint_chain`` may hand it on: NOTE [ Chain of blocks ] Rule 5; NOTE [ Plan search ] Rule 6).
        shared: the storages it references that another block references too (NOTE [ Shared storages ]), each as
            ``(storage, bytes, position)``: ``position`` among ``saved`` where it saved it (``saved`` holds its bytes
            there only if it saved it first), ``-1`` where it took it as an input (its bytes are in ``input_bytes``).
        same: for each saved tensor, the first of this block's positions that references its storage (its own where
            none before it does); ``()`` where no two do or the profile did not record storages. An offload moves every
            position of a storage or none (NOTE [ Plan search ] Rule 1).
    """

    name: str
    fwd_s: float
    bwd_s: float
    input_bytes: int
    saved: tuple[int, ...]
    kind: str = ""
    bwd_bytes: int = 0
    ops: tuple[tuple[int, int, float], ...] = ()
    saved_at: tuple[float, ...] = ()
    cuts: tuple[int, ...] = ()
    recomputable: bool = True
    sac: tuple[int, ...] = ()
    rec_s: float = 0.0
    keep_rec_s: float = 0.0
    host_rec_s: float = 0.0
    alone_s: float = 0.0
    reent_s: float = 0.0
    off_s: float = 0.0
    chained: bool = True
    shared: tuple[tuple[int, int, int], ...] = ()
    same: tuple[int, ...] = ()

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved)


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """A step's measured costs: its blocks in forward order and everything else.

    Args:
        blocks: the chain, forward order.
        fixed_bytes: device bytes that no decision changes (see NOTE [ Step model ] Rule 3).
        other_saved_bytes: bytes saved outside the blocks (embedding, head, loss), always kept.
        other_fwd_s / other_bwd_s: time outside the blocks in each sweep.
        link: the host link.
        codec: the codec offloads may use (``None``: offloads are uncompressed).
        bwd_fixed_bytes: device bytes that no decision changes during the backward, when measured
            (NOTE [ Step model ] Rule 4); ``None``: ``fixed_bytes``. With ``bwd_fixed_at``, the most of those.
        bwd_fixed_at: the same for each block's backward, when measured (NOTE [ Step model ] Rule 6); ``()``:
            ``bwd_fixed_bytes`` at every block.
        rec_bytes / keep_rec_bytes: measured bytes a block recomputed by ``Recompute()`` / ``Recompute(save=...)``
            holds in its backward beyond what the model counts (NOTE [ Mechanism costs ] Rules 3-4); may be negative.
        host_rec_bytes: the same for a recomputed block whose inputs went to host, added to those (NOTE [ Mechanism
            costs ] Rule 5).
        reent_bytes: the same for a block recomputed by ``Recompute(reentrant=True)`` (NOTE [ Mechanism costs ] Rule 13).
        revolve_bytes: measured bytes a plan of Revolve over the chain holds in its backward (rebuilding inputs and
            running blocks' backward) beyond what the model counts (NOTE [ Mechanism costs ] Rule 8); may be negative.
        revolve_at / revolve_slope: the snapshot memory at which ``revolve_bytes`` was measured, and how much it
            changes per byte of snapshot memory below that, down to the floor's (NOTE [ Mechanism costs ] Rule 10).
        revolve_scale: what Revolve's rebuilds (blocks run again without grad) cost beyond their blocks' forward
            times, as a fraction of those (NOTE [ Mechanism costs ] Rule 11); may be negative, not below -0.9.
        revolve_low / revolve_scale_at: the snapshot memory of the plan ``revolve_scale`` was measured on, and the
            fraction measured on the plan at ``revolve_at`` (``None``: not measured); linear between the two memories,
            each one's beyond them (NOTE [ Mechanism costs ] Rule 11).
        parts_bytes: measured bytes a block recomputed in parts holds in its backward beyond what the model counts
            (NOTE [ Mechanism costs ] Rule 12); may be negative.
        reentrant: ``Recompute(reentrant=True)`` measured faster than ``Recompute()`` on this model (NOTE [ Mechanism
            costs ] Rule 13): the search records each plan's twin with its whole-block recomputations reentrant.
        reentrant_runs: ``False`` where every block ``Recompute(reentrant=True)`` was measured and could not run (it
            raised, or ran out of memory where ``Recompute()`` did not): no plan recomputes through it.
    """

    blocks: tuple[Block, ...]
    fixed_bytes: int
    other_saved_bytes: int
    other_fwd_s: float
    other_bwd_s: float
    link: Link
    codec: CodecCost | None = None
    bwd_fixed_bytes: int | None = None
    rec_bytes: int = 0
    keep_rec_bytes: int = 0
    host_rec_bytes: int = 0
    reent_bytes: int = 0
    revolve_bytes: int = 0
    revolve_at: int = 0
    revolve_slope: float = 0.0
    revolve_scale: float = 0.0
    revolve_low: int = 0
    revolve_scale_at: float | None = None
    bwd_fixed_at: tuple[int, ...] = ()
    parts_bytes: int = 0
    reentrant: bool = False
    reentrant_runs: bool = True

    def bwd_fixed(self, i: int) -> int:
        """Device bytes that no decision changes while block ``i``'s backward runs (NOTE [ Step model ] Rules 4, 6)."""
        if self.bwd_fixed_at:
            return self.bwd_fixed_at[i]
        return self.fixed_bytes if self.bwd_fixed_bytes is None else self.bwd_fixed_bytes

    def revolve_offset(self, memory: int) -> int:
        """``revolve_bytes`` for a Revolve plan of ``memory`` bytes of snapshots (NOTE [ Mechanism costs ] Rules
        8 and 10): measured at ``revolve_at``, linear below it, the same above."""
        if memory >= self.revolve_at or not self.revolve_slope:
            return self.revolve_bytes
        return self.revolve_bytes + int(self.revolve_slope * (memory - self.revolve_at))

    def rebuild_scale(self, memory: int) -> float:
        """The fraction Revolve's rebuilds cost beyond their blocks' forward times in a plan of ``memory`` bytes of
        snapshots (NOTE [ Mechanism costs ] Rule 11)."""
        hi = self.revolve_scale_at
        if hi is None or memory <= self.revolve_low or self.revolve_at <= self.revolve_low:
            return self.revolve_scale
        if memory >= self.revolve_at:
            return hi
        return self.revolve_scale + (hi - self.revolve_scale) * (memory - self.revolve_low) / (
            self.revolve_at - self.revolve_low)

    @staticmethod
    def calibrated(blocks: Sequence[Block], peak_none: int, other_saved_bytes: int, other_fwd_s: float,
                   other_bwd_s: float, link: Link, codec: CodecCost | None = None,
                   bwd_start: Sequence[int] = ()) -> StepCosts:
        """A chain whose keep-everything peak is ``peak_none``, the measured no-checkpointing peak
        (NOTE [ Step model ] Rule 4).

        ``bwd_start``: what was allocated when each block's backward began in that step, if measured; it
        calibrates the backward on its own (NOTE [ Step model ] Rule 4).
        """
        if len(bwd_start) != len(blocks) or not blocks:
            return StepCosts.calibrated_on(blocks, [KEEP] * len(blocks), peak_none, other_saved_bytes, other_fwd_s,
                                       other_bwd_s, link, codec)
        held, each = 0, []
        for b, at in zip(blocks, bwd_start):  # NOTE [ Step model ] Rule 6: each block's own
            held += b.saved_bytes
            each.append(max(0, at - held))
        bare = StepCosts(tuple(blocks), 0, other_saved_bytes, other_fwd_s, other_bwd_s, link, codec, max(each),
                         bwd_fixed_at=tuple(each))
        fixed = max(0, peak_none - predict(bare, [KEEP] * len(blocks)).fwd_peak_bytes)
        return dataclasses.replace(bare, fixed_bytes=fixed)

    @staticmethod
    def calibrated_on(blocks: Sequence[Block], plan: Sequence[Decision], peak: int, other_saved_bytes: int,
                      other_fwd_s: float, other_bwd_s: float, link: Link, codec: CodecCost | None = None) -> StepCosts:
        """A chain whose prediction for ``plan`` is ``peak``, that plan's measured peak (NOTE [ Step model ] Rule 4)."""
        bare = StepCosts(tuple(blocks), 0, other_saved_bytes, other_fwd_s, other_bwd_s, link, codec)
        return dataclasses.replace(bare, fixed_bytes=max(0, peak - predict(bare, plan).peak_bytes))


@dataclasses.dataclass(frozen=True)
class Decision:
    """Where one block's saved tensors live between forward and backward (NOTE [ Step model ]).

    Args:
        mode: ``"keep"``, ``"recompute"`` or ``"offload"``.
        offload: for ``"offload"``, indices into ``Block.saved`` of the tensors sent to host (the
            others are kept).
        compress: offloaded tensors (for ``"recompute"`` with ``host``, the kept ops' outputs) go
            through the chain's codec.
        host: for ``"recompute"``, what the block keeps (its inputs and the outputs of the ``keep``
            ops) goes to host memory and is copied back for its backward: nothing of the block
            stays on the device in between.
        keep: for ``"recompute"``, positions of ops (``Block.ops``) whose outputs are kept from
            the forward (on the device, or on the host with ``host``) instead of being computed again.
        parts: for ``"recompute"``, cuts among the block's saved tensors (positions in
            ``Block.saved``, increasing, > 0): its backward recomputes and holds one part at a time
            (NOTE [ Step model ] Rule 2c).
        revolve: for ``"recompute"`` on the device, > 0: the block's input is kept or rebuilt by Revolve over
            the chain whose snapshots hold at most this many bytes (NOTE [ Step model ] Rule 5); every block of the plan has it.
        reentrant: for ``"recompute"`` of the whole block (no ``keep``, ``parts`` or ``revolve``): through
            ``Recompute(reentrant=True)`` (NOTE [ Reentrant recompute ]), priced by its own measured terms
            (``Block.reent_s``, ``StepCosts.reent_bytes``: NOTE [ Mechanism costs ] Rule 13).
    """

    mode: str
    offload: tuple[int, ...] = ()
    compress: bool = False
    host: bool = False
    keep: tuple[int, ...] = ()
    parts: tuple[int, ...] = ()
    revolve: int = 0
    reentrant: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("keep", "recompute", "offload"):
            raise ValueError(f"torchckpt: Decision(mode=...) is 'keep', 'recompute' or 'offload', got {self.mode!r}.")
        if self.mode != "offload" and self.offload:
            raise ValueError("torchckpt: only Decision(mode='offload') takes offload=....")
        if self.compress and not (self.mode == "offload" or (self.host and self.keep)):
            raise ValueError("torchckpt: compress=True takes Decision(mode='offload') or Decision(mode='recompute', "
                             "host=True, keep=...) (the kept outputs are compressed).")
        if (self.host or self.keep or self.parts) and self.mode != "recompute":
            raise ValueError("torchckpt: only Decision(mode='recompute') takes host=True, keep=... and parts=....")
        if self.revolve and (self.mode != "recompute" or self.host):
            raise ValueError("torchckpt: Decision(revolve=...) takes Decision(mode='recompute') without host=True.")
        if any(not a < b for a, b in zip((0,) + self.parts, self.parts)):
            raise ValueError(f"torchckpt: Decision(parts=...) takes increasing positions > 0, got {self.parts!r}.")
        if self.reentrant and (self.mode != "recompute" or self.keep or self.parts or self.revolve):
            raise ValueError("torchckpt: Decision(reentrant=True) takes Decision(mode='recompute') of the whole block "
                             "(no keep=, parts= or revolve=).")


KEEP = Decision("keep")
RECOMPUTE = Decision("recompute")
RECOMPUTE_HOST = Decision("recompute", host=True)
REENTRANT = Decision("recompute", reentrant=True)


def through_reentrant(plan: Sequence[Decision]) -> tuple[Decision, ...]:
    """``plan`` with each whole-block recomputation on the device (no ``keep``, ``parts``, ``revolve``, ``host`` or
    ``compress``) through ``Recompute(reentrant=True)`` (NOTE [ Mechanism costs ] Rule 13)."""
    return tuple(dataclasses.replace(d, reentrant=True) if d.mode == "recompute" and not (
        d.keep or d.parts or d.revolve or d.host or d.compress) else d for d in plan)


def split_bytes(mode: str, host: bool, saved: int, offloaded: int, inputs: int, kept: int,
                chained: bool = False) -> tuple[int, int]:
    """(bytes left on the device, bytes sent to host before compression) between a block's forward and backward,
    for a decision's ``mode`` and ``host``: its saved bytes, the offloaded ones, its inputs' and its kept ops'
    (NOTE [ Step model ] Rules 2b, 3); ``chained``: its input is Revolve's to keep (NOTE [ Step model ] Rule 5). The one
    home of this arithmetic for the model and for ``BlockPlan``."""
    if mode == "keep":
        return saved, 0
    if mode == "recompute" and chained:
        return kept, 0
    if mode == "recompute":
        return (0, inputs + kept) if host else (inputs + kept, 0)
    return saved - offloaded, offloaded


def _split(block: Block, d: Decision) -> tuple[int, int]:
    return split_bytes(d.mode, d.host, block.saved_bytes, sum(block.saved[k] for k in d.offload), block.input_bytes,
                       kept_bytes(block, d) if d.keep else 0, bool(d.revolve))


def device_bytes(block: Block, d: Decision) -> int:
    """Bytes ``d`` leaves of ``block`` on the device between its forward and its backward
    (NOTE [ Step model ] Rules 2b, 3)."""
    return _split(block, d)[0]


def kept_bytes(block: Block, d: Decision) -> int:
    """Bytes of the outputs of the ops ``d`` keeps from a recomputed block's forward (NOTE [ Step model ] Rule 2b)."""
    chosen = set(d.keep)
    return sum(nb for k, nb, _ in block.ops if k in chosen)


def materialised_bytes(block: Block, d: Decision) -> int:
    """Bytes a recomputed block holds at once in its backward besides its working memory (NOTE [ Step model ] Rule 2c):
    all its saved tensors; in parts, the largest part and, besides it, its inputs and kept outputs (held through all its
    parts; counted apart even where the part holds them too), but no less than its saved bytes less its working memory:
    the first recomputation runs the whole forward, whose frame may hold every tensor it made until it returns,
    before the backward's working memory is allocated."""
    if not d.parts:
        return block.saved_bytes
    held = max(part_bytes(block.saved, d.parts)) + block.input_bytes + (kept_bytes(block, d) if d.keep else 0)
    return max(held, block.saved_bytes - block.bwd_bytes)


def parts_seconds(block: Block, d: Decision) -> float:
    """What recomputing in parts adds: the forward again up to each earlier part's last saved tensor
    (NOTE [ Step model ] Rule 2c)."""
    if not d.parts or len(block.saved_at) != len(block.saved):
        return 0.0
    return sum(block.saved_at[c - 1] for c in d.parts)


def recompute_seconds(block: Block, d: Decision) -> float:
    """The time a recomputed block's recomputation takes (NOTE [ Step model ] Rules 2b, 2c)."""
    chosen = set(d.keep)
    return max(0.0, block.fwd_s - sum(sec for k, _, sec in block.ops if k in chosen)) + parts_seconds(block, d)


def balanced_parts(saved: Sequence[int], k: int, allowed: Sequence[int] | None = None) -> tuple[int, ...]:
    """Cuts of ``saved`` into at most ``k`` consecutive parts whose largest is smallest (the fewest parts that reach
    it, then the earliest cuts), cutting only at ``allowed`` positions (``None``: anywhere); ``()`` when no cut
    makes the largest part smaller than the whole."""
    n = len(saved)
    ok = sorted({c for c in (range(1, n) if allowed is None else allowed) if 0 < c < n})
    k = min(k, len(ok) + 1)
    if k < 2:
        return ()
    pre = [0]
    for b in saved:
        pre.append(pre[-1] + b)
    ends = ok + [n]  # where a part may end
    inf = float("inf")
    # best[j][e]: the smallest largest part of saved[:ends[e]] in j parts; cut[j][e] the end index before the last
    best = [[inf] * len(ends) for _ in range(k + 1)]
    cut = [[-1] * len(ends) for _ in range(k + 1)]
    for e, end in enumerate(ends):
        best[1][e] = pre[end]
    for j in range(2, k + 1):
        for e, end in enumerate(ends):
            for m in range(e):
                v = max(best[j - 1][m], pre[end] - pre[ends[m]])
                if v < best[j][e]:
                    best[j][e], cut[j][e] = v, m
    last = len(ends) - 1
    j = min(range(1, k + 1), key=lambda jj: (best[jj][last], jj))
    out, e = [], last
    while j > 1:
        e = cut[j][e]
        out.append(ends[e])
        j -= 1
    return tuple(sorted(out))


def host_bytes(block: Block, d: Decision) -> int:
    """Bytes ``d`` sends of ``block`` to host memory (before compression)."""
    return _split(block, d)[1]


def cache_bytes(offloaded: Sequence[int], lookahead: int = 1) -> int:
    """The GPU cache a plan's store gets: ``lookahead + 1`` times the most bytes one block offloads
    (NOTE [ Step model ] Rule 3)."""
    return (lookahead + 1) * max(offloaded, default=0)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What ``predict`` predicts for one plan.

    Attributes:
        peak_bytes: device bytes at the peak, ``fixed_bytes`` included.
        step_s: forward plus backward, recomputation and stalls included.
        recompute_s: time spent recomputing.
        stall_s: time the compute stream waited for copies: to host, for room in the store's
            GPU cache (forward), and back (backward).
        d2h_bytes / h2d_bytes: bytes over the link each way (after compression).
        at: where the peak is: ``"forward i"`` or ``"backward i"`` (block index).
        fwd_peak_bytes: the forward sweep's peak.
    """

    peak_bytes: int
    step_s: float
    recompute_s: float
    stall_s: float
    d2h_bytes: int
    h2d_bytes: int
    at: str
    fwd_peak_bytes: int = 0


def predict(chain: StepCosts, plan: Sequence[Decision], lookahead: int = 1, cache: bool = True) -> Prediction:
    """Replay one step of ``chain`` under ``plan`` (one decision per block) on the model of NOTE [ Step model ].

    ``cache=False`` leaves the store's GPU cache out of the memory (NOTE [ Step model ] Rule 3): what the plan's
    decisions alone free, which the search ranks moves by (NOTE [ Plan search ] Rule 2).
    """
    n = len(chain.blocks)
    if len(plan) != n:
        raise ValueError(f"torchckpt: a plan needs one decision per block: {n} blocks, {len(plan)} decisions.")
    if len({d.revolve for d in plan}) > 1:
        raise ValueError("torchckpt: Decision(revolve=...) is the chain's: every block of a plan has the same "
                         "(NOTE [ Step model ] Rule 5).")
    return replay(chain, [terms(chain, b, d) for b, d in zip(chain.blocks, plan)], lookahead, cache,
                  chain_states(chain, plan[0].revolve) if n and plan[0].revolve else None)


def chain_states(chain: StepCosts, memory: int) -> States:
    """What Revolve over ``chain``'s blocks with ``memory`` bytes of snapshots holds and runs again
    (NOTE [ Step model ] Rule 5)."""
    return states([b.fwd_s for b in chain.blocks], [b.input_bytes for b in chain.blocks], memory)


Terms = tuple[int, int, int, float, float, int, bool, bool, tuple[Ref, ...]]


def terms(chain: StepCosts, b: Block, d: Decision) -> Terms:
    """What ``predict`` needs of one block's decision: (bytes kept on the device, offloaded, over the link,
    compression time, decompression and recomputation time, bytes its backward materialises, recomputed, with
    host, its references to storages other blocks reference too: NOTE [ Shared storages ]). The search computes
    them once per option (NOTE [ Plan search ])."""
    codec = chain.codec
    kept, off = _split(b, d)
    wire, extra_f, extra_b = off, 0.0, 0.0
    rec = d.mode == "recompute"
    if rec:  # NOTE [ Mechanism costs ]: what the mechanism itself costs, as measured
        extra_b = max(0.0, recompute_seconds(b, d) + (b.keep_rec_s if d.keep else b.reent_s if d.reentrant else b.rec_s))
        if d.host:  # in the forward, where the store's work starts and no copy back is waited for; not below 0
            extra_f = max(0.0, b.host_rec_s)  # NOTE [ Mechanism costs ] Rule 5
    elif d.mode == "offload":  # NOTE [ Mechanism costs ] Rule 14: hooks and store, in the forward
        extra_f = max(0.0, b.off_s)
    if d.compress and codec is not None:
        squeezed = kept_bytes(b, d) if rec else off  # Decision.compress
        wire = off - squeezed + int(squeezed / codec.ratio)
        extra_f += squeezed / codec.compress
        extra_b += squeezed / codec.decompress
    held = kept
    if rec:
        extra = [chain.keep_rec_bytes if d.keep else chain.reent_bytes if d.reentrant else chain.rec_bytes,
                 chain.host_rec_bytes if d.host else 0]
        if d.parts:  # NOTE [ Mechanism costs ] Rule 3: measured on whole recomputations; in parts, never less
            extra = [max(0, e) for e in extra] + [chain.parts_bytes]  # NOTE [ Mechanism costs ] Rule 12
        held = max(materialised_bytes(b, d) + sum(extra), kept, 0)
    shared = refs(b.shared, b.saved, d.mode, d.offload, d.host, bool(d.parts)) if b.shared and not d.revolve else ()
    return kept, off, wire, extra_f, extra_b, held, rec, d.host, shared


def replay(chain: StepCosts, per: Sequence[Terms], lookahead: int = 1, cache: bool = True,
           revolve: States | None = None) -> Prediction:
    """``predict`` on each block's ``terms`` (and, for a plan with Revolve over the chain, its ``chain_states``)."""
    blocks = chain.blocks
    n = len(blocks)
    d2h_bw, h2d_bw = chain.link.d2h, chain.link.h2d
    kept = [t[0] for t in per]  # bytes on the device from the block's forward to its backward
    off = [t[1] for t in per]  # bytes offloaded (device-side size)
    wire = [t[2] for t in per]  # bytes over the link each way
    extra_f = [t[3] for t in per]  # compression time in the forward
    extra_b = [t[4] for t in per]  # decompression / recomputation time in the backward
    for i in range(n):  # NOTE [ Mechanism costs ] Rule 9: a recomputation after a kept block's backward
        if per[i][6] and blocks[i].alone_s and i < n - 1 and not per[i + 1][6]:
            extra_b[i] = max(0.0, extra_b[i] + blocks[i].alone_s)
    base = chain.fixed_bytes + chain.other_saved_bytes
    revolve_bytes = chain.revolve_offset(revolve.memory) if revolve else 0
    scale = chain.rebuild_scale(revolve.memory) if revolve else 0.0
    once = corrections([t[8] for t in per]) if revolve is None else None  # NOTE [ Shared storages ] Rules 2-3
    room = cache_bytes(off, lookahead) if cache else 0
    offloaded = 0  # offloaded bytes so far (forward), or still to be used (backward)
    # Forward (NOTE [ Step model ] Rule 1): d2h[i] is when block i's copy to host ends.
    t = chain.other_fwd_s
    free = 0.0
    d2h = [0.0] * n
    resident = 0  # kept bytes so far
    queue: list[tuple[float, int]] = []  # (end of copy, bytes), in issue order: ends never decrease (FIFO)
    head = 0
    flying = 0  # bytes of copies not yet ended
    stall = 0.0
    peak, at = base, 0  # at: the block index, forward (>= 0) or backward (-1 - index)
    for i in range(n):
        t += blocks[i].fwd_s + extra_f[i]
        resident += kept[i]
        if wire[i]:
            start = max(t, free)
            free = d2h[i] = start + wire[i] / d2h_bw
            queue.append((d2h[i], off[i]))
            flying += off[i]
        else:
            d2h[i] = t
        offloaded += off[i]
        while head < len(queue) and (queue[head][0] <= t or (room and flying > room)):
            if queue[head][0] > t:  # NOTE [ Step model ] Rule 1b: the store evicts only what reached the host: compute waits
                stall += queue[head][0] - t
                t = queue[head][0]
            flying -= queue[head][1]
            head += 1
        mem = base + resident + max(flying, min(room, offloaded)) + (revolve.fwd[i] if revolve else 0) + (
            once[0][i] if once else 0)
        if mem > peak:
            peak, at = mem, i
    fwd_peak = peak
    # Backward (NOTE [ Step model ] Rule 2): the work outside the blocks (head, loss) runs first and frees what it saved.
    t += chain.other_bwd_s
    bases = [chain.bwd_fixed(i) for i in range(n)]  # NOTE [ Step model ] Rule 6: what each block's backward sees
    h2d_free = 0.0
    ready = [0.0] * n
    issued = [False] * n
    issued_bytes = 0  # offloaded bytes on the device again (issued copies back of blocks not yet done)
    nxt = n - 1  # the next block whose copy back may be issued (they are issued in backward order)
    recompute = 0.0
    for i in range(n - 1, -1, -1):
        while nxt >= 0 and nxt >= i - lookahead:  # at the start of block i + lookahead's backward (NOTE [ Step model ] Rule 2)
            if wire[nxt]:
                issued[nxt] = True
                issued_bytes += off[nxt]
                h2d_free = ready[nxt] = max(t, h2d_free, d2h[nxt]) + wire[nxt] / h2d_bw
            nxt -= 1
        back = max(issued_bytes, min(room, offloaded))
        if wire[i] and ready[i] > t:
            stall += ready[i] - t
            t = ready[i]
        pi = per[i]
        rec, host, materialised = pi[6], pi[7], pi[5]
        base = bases[i]
        if rec:
            recompute += extra_b[i]
        if revolve is not None:  # NOTE [ Step model ] Rule 5: the blocks run again to rebuild this block's input, then the states held
            mem = base + resident + back + revolve.rebuild[i] + revolve_bytes
            if mem > peak:
                peak, at = mem, -1 - i
            rebuild = revolve.extra_s[i] * (1 + scale)  # NOTE [ Mechanism costs ] Rule 11
            t += rebuild
            recompute += rebuild
        mem = base + resident - kept[i] + materialised + back + blocks[i].bwd_bytes + (
            revolve.bwd[i] + revolve_bytes if revolve else 0)
        if rec and host:
            mem -= min(off[i], back)  # its inputs and kept outputs, back, are part of what it materialises
        if once:
            mem += once[1][i]
        if mem > peak:
            peak, at = mem, -1 - i
        t += blocks[i].bwd_s + extra_b[i]
        resident -= kept[i]
        offloaded -= off[i]
        if issued[i]:
            issued_bytes -= off[i]
        off[i] = 0
    where = f"forward {at}" if at >= 0 else f"backward {-1 - at}"
    return Prediction(peak, t, recompute, stall, sum(wire), sum(wire), where, fwd_peak)
