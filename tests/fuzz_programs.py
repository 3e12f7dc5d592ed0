"""Random programs for the differential fuzzer (tests/test_fuzz.py): building and running them,
the policy/store settings and the comparison with plain autograd (the vocabulary of ops and the
interpreter state: tests/fuzz_vocab.py).

A ``Program`` is a few leaf inputs that require grad and a list of ``Op`` values applied to a
growing list of tensors; every tensor left at the end enters a scalar loss. An op names its
operands by position from the end of that list (``a``, ``b``, taken modulo its length) and
carries one small integer ``k`` that picks its variant, so every draw is a valid program and
hypothesis shrinks it freely. ``repr(program)`` is Python you can paste back::

    from fuzz_programs import *
    check(Program(...), device="cpu")              # every setting
    check(Program(...), settings=[Setting("ctx", "evicted")])

# NOTE [ Fuzzer semantics ]
# 1. Ops never fail on the tensors they get: each shapes its operands to what it needs with
#    ``take`` (a view of the flattened prefix; repeated when too short) and ``fp`` (the real
#    view of a complex tensor, cast to the program's dtype when needed).
# 2. An in-place op acts on a clone instead when plain autograd would refuse it or when it
#    would break a rule of checkpointing rather than of the store: the target is a leaf or a
#    view of one, an output of chunk/split/unbind or a view of one, a tensor whose storage
#    has such views, a tensor with internal overlap (expand, overlapping as_strided), or a
#    tensor whose storage was made before the current segment (a checkpointed function must
#    not modify its inputs). This depends only on the program and on the interpreter's state
#    at the segment's start, so every run, recomputations included, executes the same ops.
# 3. An in-place op that would modify a tensor autograd has saved also acts on a clone, unless
#    the op is marked ``clobber=True`` (drawn rarely; the ``clobber`` op always modifies what it
#    just saved). ``resolve`` finds those ops with a probe run of plain autograd that watches
#    the version counter and the bytes of every saved tensor. So most programs are valid, and
#    the invalid ones are deliberate: plain autograd raises "one of the variables needed for
#    gradient computation has been modified by an inplace operation", and so must every store
#    setting. An op that changes a saved tensor's bytes *without* bumping its version counter
#    (an in-place op on an ``unsafe_chunk`` piece of a tensor saved whole) always acts on a
#    clone: plain autograd then silently uses the new bytes while a copy holds the old ones;
#    that is the documented hazard of ``unsafe_chunk``, outside what any store can promise.
# 4. A setting runs the program's segments (``Program.cuts``) under a layout of policies. Its
#    *twin* is the same layout with each store replaced by reference hooks (``Hooks(None)``):
#    saved tensors kept by reference, their version checked at unpack as plain autograd does,
#    i.e. a perfect store. Offload(store) and offload(store) become those hooks,
#    Recompute(store=s) becomes Recompute() inside them. The twin is the reference for the
#    setting, bit for bit, errors included: inside a Recompute block torch.utils.checkpoint
#    recomputes, so a tensor modified there after it was saved raises nothing, in the twin
#    and in the setting alike. Each twin is checked against plain autograd: bit for bit when
#    it has no Recompute block (errors included); with one, only when plain autograd
#    succeeds, and gradients within ``RECOMPUTE_TOL``: torch.utils.checkpoint may add a
#    tensor's gradient contributions in another order than plain autograd does.
# 5. A setting with a store runs the program ``steps`` times with that one store: the first
#    step records the trace, later ones follow the prefetch plan made from it. Each step builds
#    fresh leaves and parameters (same seed) and seeds the RNG the same way (dropout).
# 6. ``rec_save`` recomputes with Recompute(save=SAVE_OPS): matmul outputs are kept, not run
#    again. A program that writes such an output in place later makes that twin raise
#    (NOTE [ Selective recompute ] Rule 3) where plain autograd runs; that twin is then not
#    compared with plain autograd, but its setting is compared with it, errors included.
# 7. ``SAVE_OPS`` holds the attention kernels too: with ``dropout_p=0`` they draw nothing and are
#    kept (NOTE [ Selective recompute ] Rule 2). Half of the ``sdpa`` variants apply a dropout to
#    the result, so a recomputation whose RNG replay goes wrong around a kept kernel draws another
#    mask: its gradients leave plain autograd's by far more than ``RECOMPUTE_TOL``, and a full
#    recomputation's (the twin ``Recompute()``, whose key ``rec_save`` shares) bit for bit.
# 8. ``rec_save_all_codec`` (in ``default_settings``) and ``rec_save_codec`` send the kept
#    outputs through the store compressed (``Recompute(codec=Identity())``): their twin is that
#    of ``rec_save_all`` and ``rec_save`` (no store, no codec), compared bit for bit: the identity
#    codec is lossless.
# 9. ``rec_parts``, ``rec_parts_store`` and ``rec_parts_save`` recompute each segment in parts
#    (``Recompute(parts=...)``, NOTE [ Recompute in parts ]): a probe run of the segment (RNG
#    forked) counts the tensors it saves, N, and the cuts make one to three parts of them. Their
#    twins are those of ``rec``, ``rec_store`` and ``rec_save``: a recomputation in parts must give
#    torch's whole recomputation's bits. A program that modifies a saved tensor in place (plain
#    autograd raises) is not compared with its twin there: a part's recomputation stops at the
#    part's last saved tensor, before writes a whole recomputation replays, and neither result is
#    defined.
# 10. ``chain*`` settings run the segments as the blocks of ``torchckpt.checkpoint_chain`` (NOTE [ Chain of
#    blocks ]): each segment is an nn.Module ``Block`` whose forward takes ``(state, *rest)`` and puts the state
#    back at its position among the values, so the segment computes what it computes elsewhere. In the chain
#    form the state is block j-1's first output (block 0's: the first leaf) and ``rest`` every other value so
#    far, each tensor reaching the block once: a chain, whose other arguments are the earlier values. The
#    ``loose`` form calls block j with every value in order (the first leaf is every block's "state"): not a
#    chain from block 1 on, and the chain must warn, keep those inputs and still give the bits. The ``break``
#    form runs the chain form but, before one block b >= 1, bumps the state's version
#    (``torch.autograd.graph.increment_version``: the bytes and the graph stay; only a state alone in its
#    storage, see ``ChainRun._drive``) or hands the block ``state.view_as(state)`` instead, in the twin too:
#    the step leaves the chain there. ``ChainRun`` derives
#    from the program's seed the snapshots (1..n for n segments), which block breaks and how, and in
#    ``chain_mixed`` a policy per block: ``Recompute()``, ``Recompute(save=SAVE_OPS)``,
#    ``Recompute(save=ALL_POSITIONS)`` or ``Recompute(parts=...)`` (cuts from a probe forward of the blocks, RNG
#    forked, as in Rule 9). The twin is the same blocks, called the same way, each under
#    ``torchckpt.api.run(policy)`` without the chain (a parts block: ``Recompute()``, Rule 9); the setting must
#    give its bits, errors included. A twin whose version bump made it raise the version error (a checkpoint
#    saved a tensor sharing the state's version counter) is not compared with plain autograd, which has no
#    bump. The setting also checks the chain's own account: the chain form never leaves the chain, the loose
#    and break forms always do (``ChainStats.broken``). The chain form runs two steps on one installed chain,
#    the others one; ``remove()`` runs when the setting is done (``ChainRun.close``, in a ``finally``).
# 11. After its steps, every setting runs the program's forward once more and drops it without a backward (a dropped
#    loss, evaluation with grad enabled, ``forward_only``): once the last strong reference is gone, every tensor
#    it took or made (leaves, parameters, values) must be dead and the setting's store, if any, must hold no
#    entry. A pack hook that returns what holds an op's output (tanh, GELU and softmax save their outputs) holds
#    that op's ``grad_fn``: a cycle through C++ the collector never frees (NOTE [ Saved tensor identity ] Rule 5),
#    which a backward would have broken. What the fuzzer's own hooks keep holds no graph either: the probes of
#    Rules 3 and 9 keep nothing, and the reference hooks of Rule 4 hold a saved non-leaf ``detach()``ed, as the
#    store does. A ``chain*`` setting checks with its chain still installed: the chain keeps nothing of a forward
#    past the forward's graph. When the last step's backward raised, a trivial backward runs first: PyTorch keeps
#    the nodes a failed backward left queued (and what they hold) until the next backward on that thread.
#    Tensors that plain autograd's own forward leaves alive too are not the setting's: a tensor saved and then
#    modified in place (a ``clobber`` program) has a new ``grad_fn`` whose graph reaches the node that saved it,
#    which holds it: a cycle through C++ in plain autograd itself (found with seed 7: batch norm's input, then
#    written in place; ``Keep()``, which runs the block as plain autograd, left the same five tensors alive).
# 12. ``rec_reentrant`` runs each segment under ``Recompute(reentrant=True)`` (``Reent``), with the program's
#    parameters handed to ``api.run`` as a module's: the node takes them as inputs, as it takes a layer's own
#    parameters, instead of refusing them as a closure's tensors (NOTE [ Reentrant recompute ] Rule 4). It is
#    its own twin and, like every Recompute setting, is compared with plain autograd within ``RECOMPUTE_TOL`` and
#    not where plain autograd raises (the recomputation saves only the segment's inputs).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import random
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import torchckpt
from torchckpt import Keep, Offload, Recompute
from torchckpt.codecs import Identity

VERSION_PHRASE = "modified by an inplace operation"
# torch.utils.checkpoint can sum a tensor's gradient contributions in another order than plain
# autograd (ulp-level differences): a Recompute twin's gradients are checked against plain
# autograd to this fraction of their largest magnitude, the setting against its twin bit for bit.
RECOMPUTE_TOL = 1e-2
CAP = 192  # elements: an op output longer than this is cut to a prefix view
SHAPES = ((4, 6), (3, 8), (2, 3, 4), (12,), (6, 4), (8,), (2, 8), (5, 4))
DTYPES = ("float32", "float64")
from fuzz_vocab import (  # noqa: F401  (re-exported: `from fuzz_programs import *` reproduces a failure)
    CAP, Ctx, DTYPES, INPLACE, Invalidates, MULTI, Meta, OPS, Op, PARAMS, Program, RECOMPUTE_TOL, SHAPES, VERSION_PHRASE, bits, real,
)


# -- building and running ------------------------------------------------------------------------
def seed_all(seed: int, device: str) -> None:
    """Seed the RNGs the program draws from (dropout). Not ``torch.manual_seed``: without CUDA
    initialized, that queues a lazy CUDA seeding call (with a stack trace) every time."""
    torch.default_generator.manual_seed(seed)
    if device != "cpu":
        torch.cuda.manual_seed_all(seed)


def build(prog: Program, device: str) -> tuple[list[torch.Tensor], dict[int, dict[str, Any]]]:
    """Fresh leaf inputs and per-op parameters, the same for every call with the same program."""
    g = torch.Generator().manual_seed(prog.seed)
    dt = prog.torch_dtype
    leaves = [(torch.randn(*s, generator=g, dtype=torch.float64)).to(dt).to(device).requires_grad_(True)
              for s in prog.shapes]
    params: dict[int, dict[str, Any]] = {}
    for i, o in enumerate(prog.ops):
        make = PARAMS.get(o.name)
        if make is None:
            continue
        pg = torch.Generator().manual_seed(prog.seed * 7919 + i)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(prog.seed + i)
            p = make(pg, dt, o.k)
        moved: dict[str, Any] = {}
        for name, v in p.items():
            if isinstance(v, nn.Module):
                moved[name] = v.to(device)
            elif isinstance(v, nn.Parameter):
                continue  # a module's parameter: taken from the moved module below
            else:
                moved[name] = v.to(device).requires_grad_(v.is_floating_point() or v.is_complex()) \
                    if name not in ("rm", "rv") else v.to(device)
        if "m" in moved and "w" in p and isinstance(p["w"], nn.Parameter):
            moved["w"], moved["b"] = moved["m"].weight, moved["m"].bias
        params[i] = moved
    return leaves, params


def param_tensors(params: dict[int, dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor that gets a gradient, named ``op<i>.<name>``, in a fixed order."""
    out: list[tuple[str, torch.Tensor]] = []
    for i in sorted(params):
        seen: set[int] = set()
        for name, v in params[i].items():
            ts = list(v.named_parameters()) if isinstance(v, nn.Module) else [("", v)]
            for sub, t in ts:
                if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in seen:
                    seen.add(id(t))
                    out.append((f"op{i}.{name}{'.' + sub if sub else ''}", t))
    return out


def _apply(ctx: Ctx, vals: list[torch.Tensor], metas: list[Meta], i: int) -> None:
    """Run op ``i``, appending its outputs (and their metas) to ``vals``."""
    o = ctx.prog.ops[i]
    ctx.index, ctx.op = i, o
    n = len(vals)
    ia, ib = n - 1 - o.a % n, n - 1 - o.b % n
    fn = OPS[o.name]
    if o.name in INPLACE:
        res = fn(ctx, (vals[ia], metas[ia]), (vals[ib], metas[ib]), o.k)
    else:
        res = fn(ctx, vals[ia], vals[ib], o.k)
    outs = res if isinstance(res, list) else [res]
    for t in outs:
        if t.numel() > CAP:
            t = t.reshape(-1)[:CAP]
        meta = Meta(ctx.seg, len(vals))
        if t.numel() > 0:  # a view of a storage some live value holds: that storage's meta
            ptr = t.untyped_storage().data_ptr()
            for v, m in zip(reversed(vals), reversed(metas)):
                if v.numel() > 0 and v.untyped_storage().data_ptr() == ptr:
                    meta = m
                    break
        if o.name in MULTI:
            ctx.multi_sids.add(meta.sid)
        vals.append(t)
        metas.append(meta)
    names = ", ".join(f"v{j}" for j in range(n, len(vals)))
    ctx.lines.append(f"{names} = {o.name}(v{ia}, v{ib}, k={o.k}){'  # clobber' if o.clobber else ''}"
                     f"{'  # cloned (NOTE [ Fuzzer semantics ] Rule 3)' if i in ctx.clones else ''}")


class Plain:
    """Call the block as it is."""

    def call(self, fn: Callable[..., Any], *args: torch.Tensor) -> Any:
        return fn(*args)

    def __repr__(self) -> str:
        return "Plain()"


def _ref_pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    if t.grad_fn is not None or t._base is not None:  # NOTE [ Fuzzer semantics ] Rule 11: hold no graph (same storage, counter and bits)
        return t.detach(), t._version
    return t, t._version


def _ref_unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    t, version = packed
    if t._version != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been {VERSION_PHRASE} "
            f"(fuzzer reference hooks: version {t._version}, saved at {version})")
    return t


class Hooks:
    """``torchckpt.offload(store)`` around the block; with no store, the reference hooks: saved
    tensors kept by reference and their version checked at unpack, as plain autograd does
    (NOTE [ Fuzzer semantics ] Rule 4)."""

    def __init__(self, store: torchckpt.Store | None) -> None:
        self.store = store

    def cm(self) -> Any:
        if self.store is None:
            return torch.autograd.graph.saved_tensors_hooks(_ref_pack, _ref_unpack)
        return torchckpt.offload(self.store)

    def call(self, fn: Callable[..., Any], *args: torch.Tensor) -> Any:
        with self.cm():
            return fn(*args)

    def __repr__(self) -> str:
        return "Hooks(store)" if self.store is not None else "Hooks(None)"


class Pol:
    """``torchckpt.checkpoint(fn, *args, policy=policy)``, optionally inside ``Hooks(None)``."""

    def __init__(self, policy: Any, ref_hooks: bool = False) -> None:
        self.policy = policy
        self.ref_hooks = ref_hooks

    def call(self, fn: Callable[..., Any], *args: torch.Tensor) -> Any:
        if self.ref_hooks:
            with Hooks(None).cm():
                return torchckpt.checkpoint(fn, *args, policy=self.policy)
        return torchckpt.checkpoint(fn, *args, policy=self.policy)

    def __repr__(self) -> str:
        p = type(self.policy).__name__
        return f"Hooks(None)+{p}" if self.ref_hooks else p


class Reent:
    """``api.run(Recompute(reentrant=True), fn, *args, module=...)``, the program's parameters handed over as a
    module's (NOTE [ Fuzzer semantics ] Rule 12): reentrant refuses a closure's tensor that needs grad (NOTE
    [ Reentrant recompute ] Rule 4), and the vocabulary's parameters are the segment's closure."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []

    def bind(self, ctx: Ctx) -> None:
        self.params = [t for _, t in param_tensors(ctx.params)]

    def call(self, fn: Callable[..., Any], *args: torch.Tensor) -> Any:
        holder = nn.Module()
        for i, t in enumerate(self.params):
            holder._parameters[f"p{i}"] = t  # the tensors themselves: register_parameter would want nn.Parameter
        return torchckpt.api.run(Recompute(reentrant=True), fn, *args, module=holder)

    def __repr__(self) -> str:
        return "Recompute(reentrant)"


class Parts:
    """``checkpoint(fn, *args, policy=dataclasses.replace(policy, parts=cuts))``, the cuts from a probe run
    (NOTE [ Fuzzer semantics ] Rule 9)."""

    def __init__(self, policy: Recompute) -> None:
        self.policy = policy

    def call(self, fn: Callable[..., Any], *args: torch.Tensor) -> Any:
        n = 0

        def pack(t: torch.Tensor) -> None:
            nonlocal n
            n += 1  # nothing kept: a saved output would hold its grad_fn, and the probe's graph (NOTE [ Fuzzer semantics ] Rule 11)

        devices = sorted({a.device.index or 0 for a in args if a.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*args)
        k = 1 + n % 3  # parts
        cuts = tuple(sorted({n * j // k for j in range(1, k)} - {0}))
        return torchckpt.checkpoint(fn, *args, policy=dataclasses.replace(self.policy, parts=cuts))

    def __repr__(self) -> str:
        return "Recompute(parts)"


class Block(nn.Module):
    """A segment as an nn.Module (NOTE [ Fuzzer semantics ] Rule 10): ``forward(state, *rest)`` runs the segment on
    ``rest`` with ``state`` put back at position ``at``; ``fn`` (the segment) and ``at`` are set for each run."""

    def __init__(self, j: int) -> None:
        super().__init__()
        self.j, self.at = j, 0
        self.fn: Callable[..., tuple[torch.Tensor, ...]] | None = None

    def forward(self, state: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        assert self.fn is not None
        return self.fn(*rest[:self.at], state, *rest[self.at:])


CHAIN_FORMS = ("chain", "loose", "break")
CHAIN_POLICIES = ("rec", "save", "save_all", "parts")


def _shares_storage(x: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    if x.numel() == 0:
        return False
    ptr = x.untyped_storage().data_ptr()
    return any(o.numel() > 0 and o.untyped_storage().data_ptr() == ptr for o in others)


class ChainRun:
    """The outer runner of the ``chain*`` settings (NOTE [ Fuzzer semantics ] Rule 10): the segments as ``Block``
    modules, run under ``torchckpt.checkpoint_chain(blocks, snapshots=..., policy=[...])`` (``twin=False``) or each
    under ``torchckpt.api.run(policy)`` (``twin=True``). The snapshots, the per-block policies and the break come from
    the program's seed; the chain is installed on the first run and removed by ``close``."""

    def __init__(self, form: str, mixed: bool, twin: bool, nseg: int, seed: int, alias: bool = False) -> None:
        assert form in CHAIN_FORMS
        self.form, self.mixed, self.twin, self.alias = form, mixed, twin, alias
        self.blocks = [Block(j) for j in range(nseg)]
        r = random.Random(f"{seed} {form} {mixed}")  # str seeds are hashed the same in every run
        self.snapshots = r.randint(1, nseg)
        self.kinds = tuple(r.choice(CHAIN_POLICIES) if mixed else "rec" for _ in range(nseg))
        self.break_at = r.randrange(1, nseg) if form == "break" and nseg > 1 else None
        self.bump = r.random() < 0.5 or alias
        self.chain: Any = None  # torchckpt.ChainCheckpoint, once installed
        self.steps = 2 if form == "chain" and not mixed and not twin else 1  # a second step on the same chain
        self.notes: list[str] = []  # the chain's own account, when it is wrong (NOTE [ Fuzzer semantics ] Rule 10)

    @property
    def has_parts(self) -> bool:
        return "parts" in self.kinds

    def policy(self, kind: str, parts: tuple[int, ...] | None = None) -> Recompute:
        if kind == "save":
            return Recompute(save=SAVE_OPS)
        if kind == "save_all":
            return Recompute(save=ALL_POSITIONS)
        if kind == "parts" and not self.twin:
            assert parts is not None
            return Recompute(parts=parts)
        return Recompute()  # a parts block's twin: torch's whole recomputation (NOTE [ Fuzzer semantics ] Rule 9)

    def _drive(self, leaves: list[torch.Tensor], call: Callable[..., Any], probe: bool = False) -> list[torch.Tensor]:
        """Run the blocks in the form's order, ``call(j, *args)`` running block j; every value (leaves first)."""
        vals = list(leaves)
        state, at = vals[0], 0  # block j-1's first output and its position
        for j, blk in enumerate(self.blocks):
            if self.form == "loose":
                blk.at, args = 0, vals[1:]
                state = vals[0]
            else:
                if j == self.break_at and not probe:
                    # Bump only a tensor alone in its storage: a view's bump reaches its base (an earlier block's
                    # input, when it is one: the chain's bug 1 in test_fuzz.KNOWN, which the alias variant
                    # keeps), and a base's bump makes autograd refuse its multi-output views (chunk, split).
                    alone = state._base is None and not _shares_storage(state, vals[:at] + vals[at + 1:])
                    if self.bump and (alone or self.alias):
                        torch.autograd.graph.increment_version(state)
                    else:
                        state = state.view_as(state)
                blk.at, args = at, vals[:at] + vals[at + 1:]
            new = call(j, state, *args)
            at = len(vals)
            vals.extend(new)
            state = vals[at]
        return vals

    def _parts(self, leaves: list[torch.Tensor]) -> list[tuple[int, ...] | None]:
        """NOTE [ Fuzzer semantics ] Rule 9's cuts for each parts block, from a probe forward of the blocks (RNG forked)."""
        counts = [0] * len(self.blocks)
        j_now = [0]

        def pack(t: torch.Tensor) -> None:
            counts[j_now[0]] += 1  # nothing kept (NOTE [ Fuzzer semantics ] Rule 11)

        def call(j: int, *args: torch.Tensor) -> Any:
            j_now[0] = j
            return self.blocks[j](*args)

        devices = sorted({t.device.index or 0 for t in leaves if t.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self._drive(leaves, call, probe=True)
        out: list[tuple[int, ...] | None] = []
        for kind, n in zip(self.kinds, counts):
            k = 1 + n % 3
            out.append(tuple(sorted({n * i // k for i in range(1, k)} - {0})) if kind == "parts" else None)
        return out

    def execute(self, segment: Callable[..., tuple[torch.Tensor, ...]],
                leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        for j, blk in enumerate(self.blocks):
            blk.fn = functools.partial(segment, j)
        if self.twin:
            pols = [self.policy(kind) for kind in self.kinds]
            return self._drive(leaves, lambda j, *args: torchckpt.api.run(pols[j], self.blocks[j], *args,
                                                                             module=self.blocks[j]))
        if self.chain is None:
            cuts = self._parts(leaves) if self.has_parts else [None] * len(self.blocks)
            pols = [self.policy(kind, c) for kind, c in zip(self.kinds, cuts)]
            self.chain = torchckpt.checkpoint_chain(self.blocks, snapshots=self.snapshots, policy=pols)
        broken = self.chain.stats.broken
        vals = self._drive(leaves, lambda j, *args: self.blocks[j](*args))
        broke = self.chain.stats.broken > broken
        if broke != (len(self.blocks) > 1 and self.form != "chain"):
            self.notes.append(f"chain: the step {'left' if broke else 'stayed in'} the chain "
                              f"(form {self.form!r}, {len(self.blocks)} blocks)")
        return vals

    def close(self) -> None:
        if self.chain is not None:
            self.chain.remove()
            self.chain = None

    def __repr__(self) -> str:
        pols = ",".join(self.kinds)
        brk = "" if self.break_at is None else f", {'bump' if self.bump else 'view'} at {self.break_at}"
        alias = ", alias" if self.alias else ""
        s = "" if self.twin else f", s={self.snapshots}"
        return f"{'Twin' if self.twin else 'Chain'}({self.form}{s}, {pols}{brk}{alias})"


# A layout: (outer, per-segment runners); the per-segment tuple repeats when shorter.
Layout = tuple[Any, tuple[Any, ...]]
PLAIN: Layout = (Plain(), (Plain(),))


def execute(prog: Program, layout: Layout, leaves: list[torch.Tensor], ctx: Ctx) -> list[torch.Tensor]:
    """Run the program's segments under ``layout``; returns every value (leaves first)."""
    outer, per_seg = layout
    segs = prog.segments
    # The interpreter's state at each segment's start: a Recompute block re-runs its segment
    # from the same state (NOTE [ Fuzzer semantics ] Rule 2 depends on it).
    metas_at: list[tuple[list[Meta], frozenset[int]]] = [([Meta(-1, j) for j in range(len(leaves))], frozenset())]

    def segment(j: int, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lo, hi = segs[j]
        vals = list(ts)
        metas = list(metas_at[j][0])
        ctx.seg, ctx.multi_sids = j, set(metas_at[j][1])
        for i in range(lo, hi):
            _apply(ctx, vals, metas, i)
        if len(metas_at) == j + 1:
            metas_at.append((metas, frozenset(ctx.multi_sids)))
        return tuple(vals[len(ts):])

    if isinstance(outer, ChainRun):
        return outer.execute(segment, leaves)

    for r in (outer, *per_seg):
        if isinstance(r, Reent):  # NOTE [ Fuzzer semantics ] Rule 12
            r.bind(ctx)

    def body(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vals = list(ts)
        for j in range(len(segs)):
            new = per_seg[j % len(per_seg)].call(functools.partial(segment, j), *vals)
            vals.extend(new)
        return tuple(vals)

    try:
        return list(outer.call(body, *leaves))
    finally:
        for r in (outer, *per_seg):
            if isinstance(r, Reent):
                r.params = []  # the nodes hold what their backward needs; the layout holds nothing (Rule 11)


def loss_of(vals: Sequence[torch.Tensor], seed: int) -> torch.Tensor:
    """A scalar from every value: fixed random weights, so every value gets its own gradient."""
    g = torch.Generator().manual_seed(seed + 1)
    total = None
    for v in vals:
        r = real(v).to(torch.float64)
        w = torch.randn(r.shape, generator=g, dtype=torch.float64).to(r.device)
        term = (r * w).sum()
        total = term if total is None else total + term
    assert total is not None
    return total


def resolve(prog: Program, device: str = "cpu") -> frozenset[int]:
    """The in-place ops that would modify a saved tensor in plain autograd (NOTE [ Fuzzer semantics ] Rule 3)."""
    clones: set[int] = set()
    for _ in range(len(prog.ops) + 1):
        saved: list[tuple[torch.Tensor, int]] = []
        leaves, params = build(prog, device)
        ctx = Ctx(prog, params, frozenset(clones), saved)

        def pack(t: torch.Tensor) -> None:
            saved.append((t, t._version))  # the probe's own list; the graph keeps nothing (NOTE [ Fuzzer semantics ] Rule 11)

        try:
            seed_all(prog.seed, device)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                execute(prog, PLAIN, leaves, ctx)
        except Invalidates as e:
            clones.add(e.index)
            continue
        return frozenset(clones)
    raise RuntimeError("fuzzer bug: resolve did not converge")


# -- outcomes ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    """What one run gave: every value, the loss, every gradient; or the error it raised."""

    values: list[torch.Tensor] = dataclasses.field(default_factory=list)
    loss: torch.Tensor | None = None
    grads: list[tuple[str, torch.Tensor | None]] = dataclasses.field(default_factory=list)
    error: tuple[type, str] | None = None  # (type, message): no traceback keeps the graph alive
    phase: str = ""
    lines: list[str] = dataclasses.field(default_factory=list)


def _snap(t: torch.Tensor) -> torch.Tensor:
    """A detached, CPU, conj/neg-resolved copy, with its flags noted in the attributes."""
    s = t.detach().resolve_conj().resolve_neg().to("cpu", copy=True)
    s._fz_flags = (t.is_conj(), t.is_neg())  # type: ignore[attr-defined]
    return s


def run(prog: Program, layout: Layout, clones: frozenset[int], device: str = "cpu") -> Outcome:
    """One step of ``prog`` under ``layout``: forward, loss, backward."""
    leaves, params = build(prog, device)
    ctx = Ctx(prog, params, clones, None)
    out = Outcome(lines=ctx.lines)
    phase = "forward"
    try:
        seed_all(prog.seed, device)
        vals = execute(prog, layout, leaves, ctx)
        loss = loss_of(vals, prog.seed)
        out.values = [_snap(v) for v in vals]
        out.loss = _snap(loss)
        phase = "backward"
        loss.backward()
        del vals, loss
    except Exception as e:  # noqa: BLE001 - compared with the reference's error
        out.error, out.phase = (type(e), str(e)), phase
        return out
    named = [(f"input{i}", t) for i, t in enumerate(leaves)] + param_tensors(params)
    out.grads = [(n, None if t.grad is None else _snap(t.grad)) for n, t in named]
    return out


def forward_only(prog: Program, layout: Layout, clones: frozenset[int], device: str = "cpu") -> list[tuple[str, Any]]:
    """One forward of ``prog`` under ``layout``, not followed by a backward (NOTE [ Fuzzer semantics ] Rule 11).

    Returns:
        ``(name, weak reference)`` for every tensor the forward took or made: leaves and values as the program's
        listing names them (``v3``), parameters as ``param_tensors`` does (``op2.w``). No strong reference is left
        when it returns: every reference should be dead.
    """
    leaves, params = build(prog, device)
    ctx = Ctx(prog, params, clones, None)
    refs = [(f"v{i}", weakref.ref(t)) for i, t in enumerate(leaves)]
    refs += [(n, weakref.ref(t)) for n, t in param_tensors(params)]
    try:
        seed_all(prog.seed, device)
        vals = execute(prog, layout, leaves, ctx)
    except Exception:  # noqa: BLE001 - the steps report the error; what the forward made must be freed all the same
        vals = []
    refs += [(f"v{j}", weakref.ref(v)) for j, v in enumerate(vals) if j >= len(leaves)]
    if isinstance(layout[0], ChainRun):
        for blk in layout[0].blocks:
            blk.fn = None  # the segment's closure holds the interpreter's state, parameters included
    return refs


def _alive(refs: Sequence[tuple[str, Any]]) -> set[str]:
    """The names of ``refs`` still alive after a collection (NOTE [ Fuzzer semantics ] Rule 11)."""
    gc.collect()
    return {n for n, r in refs if r() is not None}


def leaks(refs: Sequence[tuple[str, Any]], store: torchckpt.Store | None) -> list[str]:
    """What ``forward_only`` left alive (NOTE [ Fuzzer semantics ] Rule 11), empty when nothing: tensors still
    reachable, and the store's live entries. Cycles through Python are collected first (only when something is alive: a
    collection is slow); a cycle through C++ (a packed value that holds the ``grad_fn`` that holds it) is not collectable."""
    def held() -> bool:
        return any(r() is not None for _, r in refs) or (store is not None and bool(store._live or store._entries))

    if not held():
        return []
    gc.collect()
    msgs = []
    alive = [(n, t) for n, t in ((n, r()) for n, r in refs) if t is not None]
    if alive:
        named = [f"{n} ({type(t.grad_fn).__name__ if t.grad_fn is not None else 'leaf'} "
                 f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)})" for n, t in alive]
        msgs.append(f"{len(alive)} of {len(refs)} tensors outlive it: {', '.join(named[:6])}"
                    f"{f' (+{len(named) - 6} more)' if len(named) > 6 else ''}")
    if store is not None and (store._live or store._entries):
        msgs.append(f"the store still holds {len(store._entries)} entries ({store._live} live)")
    return msgs


def flush_failed_backward(device: str) -> None:
    """Make PyTorch drop what a backward that raised left queued (NOTE [ Fuzzer semantics ] Rule 11): the engine keeps
    the nodes still in the thread's ready queue, and what they hold, until the next backward runs on that thread."""
    (torch.ones((), device=device, requires_grad=True) * 1).backward()


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit-for-bit equality (NaN and -0.0 included), with dtype, shape and conj/neg flags."""
    if a is None or b is None:
        return a is None and b is None
    return (a.dtype == b.dtype and a.shape == b.shape
            and getattr(a, "_fz_flags", None) == getattr(b, "_fz_flags", None)
            and torch.equal(_raw(a), _raw(b)))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``bits(t)``, without a copy when ``t`` is contiguous with no conj/neg bit (as ``_snap``'s copies mostly are)."""
    if t.is_conj() or t.is_neg():
        return bits(t)
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.stride(0) == 1 else bits(t)


def _describe(a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    if a is None or b is None:
        return f"{'None' if a is None else 'tensor'} vs {'None' if b is None else 'tensor'}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if getattr(a, "_fz_flags", None) != getattr(b, "_fz_flags", None):
        return f"conj/neg flags {a._fz_flags} vs {b._fz_flags}"  # type: ignore[attr-defined]
    bad = (bits(a) != bits(b)).sum().item()
    diff = ""
    if a.is_floating_point() or a.is_complex():
        d = (a.to(torch.complex128 if a.is_complex() else torch.float64)
             - b.to(torch.complex128 if b.is_complex() else torch.float64)).abs()
        diff = f", max abs diff {d.nan_to_num(nan=float('inf')).max().item():.3g}"
    return f"{bad} of {bits(a).numel()} bytes differ{diff}"


def close(a: torch.Tensor | None, b: torch.Tensor | None, tol: float) -> bool:
    """Equal up to ``tol`` times the larger magnitude in the tensor (NaN where NaN, inf where inf)."""
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return same(a, b)
    wide = torch.complex128 if a.is_complex() else torch.float64
    x, y = a.to(wide), b.to(wide)
    if not torch.equal(x.isnan(), y.isnan()) or not torch.equal(x.isinf(), y.isinf()):
        return False
    ok = x.isfinite()
    if not torch.equal(x[~ok & ~x.isnan()], y[~ok & ~y.isnan()]):
        return False
    x, y = x[ok], y[ok]
    scale = max(x.abs().max().item(), y.abs().max().item(), 1e-30) if x.numel() else 1.0
    return bool(((x - y).abs() <= tol * scale).all())


def compare(ref: Outcome, got: Outcome, grad_tol: float | None = None) -> list[str]:
    """Differences of ``got`` from ``ref`` (empty when they agree): bit for bit, or gradients
    within ``grad_tol`` of their largest magnitude when it is given (NOTE [ Fuzzer semantics ] Rule 4)."""
    if ref.error is not None or got.error is not None:
        if ref.error is None:
            assert got.error is not None
            return [f"raised in {got.phase} where the reference did not: {got.error[0].__name__}: {got.error[1]}"]
        if got.error is None:
            return [f"raised nothing where the reference raised in {ref.phase}: "
                    f"{ref.error[0].__name__}: {ref.error[1][:200]}"]
        msgs = []
        if not issubclass(got.error[0], ref.error[0]):
            msgs.append(f"raised {got.error[0].__name__} where the reference raised {ref.error[0].__name__}: {got.error[1]}")
        if VERSION_PHRASE in ref.error[1] and VERSION_PHRASE not in got.error[1]:
            msgs.append(f"error lacks {VERSION_PHRASE!r}: {got.error[1]}")
        return msgs
    msgs = []
    if len(ref.values) != len(got.values):
        msgs.append(f"{len(got.values)} values, reference has {len(ref.values)}")
    for j, (va, vb) in enumerate(zip(ref.values, got.values)):
        if not same(va, vb):
            msgs.append(f"value v{j}: {_describe(va, vb)}")
    if not same(ref.loss, got.loss):
        msgs.append(f"loss: {_describe(ref.loss, got.loss)}")
    for (n, a), (_, b) in zip(ref.grads, got.grads):
        if not (same(a, b) if grad_tol is None else close(a, b, grad_tol)):
            msgs.append(f"grad of {n}: {_describe(a, b)}")
    return msgs


# -- settings -----------------------------------------------------------------------------------
def small_host_pool(device: str) -> torchckpt.memory.HostPool:
    """A host pool with 1 MiB chunks (pinned when the store is on CUDA)."""
    return torchckpt.memory.HostPool(capacity_bytes=256 << 20, chunk_bytes=1 << 20, pin=device != "cpu")


BUDGET = 1536  # bytes: a cache that holds a few of the fuzzer's tensors, so some are evicted
STORES: dict[str, dict[str, Any]] = {
    "resident": dict(gpu_bytes=64 << 20, min_bytes=0),
    "evicted": dict(gpu_bytes=0, min_bytes=0),
    "budget": dict(gpu_bytes=BUDGET, min_bytes=0),
    "min_bytes": dict(gpu_bytes=BUDGET, min_bytes=128),
    "identity": dict(gpu_bytes=0, min_bytes=0, codec="identity"),
    "identity_budget": dict(gpu_bytes=BUDGET, min_bytes=0, codec="identity"),
    "no_prefetch": dict(gpu_bytes=BUDGET, min_bytes=0, prefetch=False),
}


# NOTE [ Fuzzer semantics ] Rule 6: the ops Recompute(save=...) keeps in rec_save, and the error it raises when the
# program writes one of their outputs in place later (plain autograd has nothing to object to there; keeping it would be
# wrong). Attention (NOTE [ Fuzzer semantics ] Rule 7): the fused kernels, kept when dropout_p=0 (the CPU's flash
# kernel; CUDA's flash, efficient and cuDNN kernels), and the math path's softmax (its matmuls are bmm), taken when dropout_p > 0.
ATTN_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention", "_safe_softmax")
    if hasattr(torch.ops.aten, name))
SAVE_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}) | ATTN_OPS
ALL_POSITIONS = frozenset(range(512))
KEPT_WRITTEN = "leave that op out of save"


def make_store(name: str, device: str) -> torchckpt.Store:
    kw = dict(STORES[name])
    if kw.get("codec") == "identity":
        kw["codec"] = Identity()
    return torchckpt.Store(device=device, host=small_host_pool(device), **kw)


@dataclasses.dataclass(frozen=True)
class Setting:
    """A policy layout (``structure``, see ``layout``) with a store configuration (``STORES``)."""

    structure: str
    store: str | None = None

    def __repr__(self) -> str:
        return f"Setting({self.structure!r}, {self.store!r})"

    def layout(self, store: torchckpt.Store | None, nseg: int, twin: bool | None = None, seed: int = 0) -> Layout:
        """(outer, per-segment runners); the twin (NOTE [ Fuzzer semantics ] Rule 4) with ``twin=True``, or by
        default with ``store=None``. ``seed`` (the program's) picks what a ``chain*`` setting draws
        (NOTE [ Fuzzer semantics ] Rule 10)."""
        s = store
        twin = s is None if twin is None else twin
        if self.structure.startswith("chain"):  # NOTE [ Fuzzer semantics ] Rule 10: chain, chain_mixed, chain_loose, chain_break[_alias]
            parts = self.structure.split("_")
            form = parts[1] if len(parts) > 1 and parts[1] in CHAIN_FORMS else "chain"
            if self.structure not in ("chain", "chain_mixed", "chain_loose", "chain_break", "chain_break_alias"):
                raise ValueError(f"unknown structure {self.structure!r}")
            run = ChainRun(form, mixed=self.structure == "chain_mixed", twin=twin, nseg=nseg, seed=seed,
                           alias=self.structure.endswith("_alias"))
            return (run, (Plain(),))
        hooks = Hooks(s)
        off: Any = hooks if twin else Pol(Offload(s))
        rec_store: Any = Pol(Recompute(), ref_hooks=True) if twin else Pol(Recompute(store=s))
        rec, plain = Pol(Recompute()), Plain()
        mid = min(1, nseg - 1)

        def at_mid(p: Any) -> tuple[Any, ...]:
            return tuple(p if j == mid else plain for j in range(nseg))

        st = self.structure
        if st == "ctx":
            return (hooks, (plain,))
        if st == "ctx_rec":  # a Recompute block inside an offload() region
            return (hooks, at_mid(rec))
        if st == "off":
            return (plain, (off,))
        if st == "off_some":  # Offload of every other saved tensor (the planner's per-tensor decisions)
            return (plain, (hooks if twin else Pol(Offload(s, tensors=frozenset(range(0, 256, 2)))),))
        if st == "off_codec":
            return (plain, (hooks if twin else Pol(Offload(s, codec=Identity())),))
        if st == "rec":
            return (plain, (rec,))
        if st == "rec_store":
            return (plain, (rec_store,))
        if st == "rec_reentrant":  # NOTE [ Fuzzer semantics ] Rule 12
            return (plain, (Reent(),))
        if st == "rec_save":  # selective recomputation: matmul outputs kept (through the store, if any)
            return (plain, (Pol(Recompute(save=SAVE_OPS, store=s)) if not twin else Pol(Recompute(save=SAVE_OPS)),))
        if st == "rec_save_all":  # every op position named: what can be kept is (the planner names positions)
            return (plain, (Pol(Recompute(save=ALL_POSITIONS, store=s)) if not twin else Pol(Recompute(save=ALL_POSITIONS)),))
        if st in ("rec_save_codec", "rec_save_all_codec"):  # NOTE [ Fuzzer semantics ] Rule 8: the kept outputs through the store, compressed
            save = SAVE_OPS if st == "rec_save_codec" else ALL_POSITIONS
            kept = Recompute(save=save) if twin else Recompute(save=save, store=s, codec=Identity())
            return (plain, (Pol(kept),))
        if st == "rec_parts":  # NOTE [ Fuzzer semantics ] Rule 9: the twins are torch's whole recomputation's
            return (plain, (rec if twin else Parts(Recompute()),))
        if st == "rec_parts_store":
            return (plain, (rec_store if twin else Parts(Recompute(store=s)),))
        if st == "rec_parts_save":
            return (plain, (Pol(Recompute(save=SAVE_OPS)) if twin else Parts(Recompute(save=SAVE_OPS, store=s)),))
        if st == "keep":
            return (plain, (Pol(Keep()),))
        if st == "rec_in_off":  # a Recompute block inside an Offload block
            return (off, at_mid(rec))
        if st == "off_in_rec":  # an Offload block inside a Recompute block
            return (rec, at_mid(off))
        if st == "mixed":  # Offload, Recompute(store), Keep, one per segment
            return (plain, (off, rec_store, Pol(Keep())))
        raise ValueError(f"unknown structure {st!r}")


def default_settings() -> list[Setting]:
    """Every store configuration under offload(), and each policy layout with one or more."""
    out = [Setting("ctx", name) for name in STORES]
    out += [Setting("ctx_rec", "budget"), Setting("off", "resident"), Setting("off", "evicted"),
            Setting("off", "budget"), Setting("off_some", "evicted"), Setting("off_some", "budget"),
            Setting("off_codec", "evicted"), Setting("off_codec", "budget"),
            Setting("rec"), Setting("rec_reentrant"), Setting("rec_store", "evicted"), Setting("rec_store", "budget"), Setting("keep"),
            Setting("rec_save"), Setting("rec_save", "evicted"), Setting("rec_save", "budget"),
            Setting("rec_save_all"), Setting("rec_save_all", "evicted"),
            Setting("rec_save_all_codec", "evicted"), Setting("rec_parts"), Setting("rec_parts_store", "evicted"),
            Setting("rec_parts_save", "budget"),
            Setting("rec_in_off", "evicted"), Setting("rec_in_off", "budget"),
            Setting("off_in_rec", "evicted"), Setting("off_in_rec", "resident"), Setting("mixed", "budget"),
            Setting("mixed", "evicted"), Setting("chain"), Setting("chain_mixed"), Setting("chain_loose"),
            Setting("chain_break")]
    return out


def _key(layout: Layout) -> str:
    return f"{layout[0]!r}|{','.join(map(repr, layout[1]))}"


def check(prog: Program, settings: Sequence[Setting] | None = None, device: str = "cpu", steps: int = 3) -> list[str]:
    """Run ``prog`` under plain autograd and every setting; return every difference found.

    Returns:
        Lines describing each mismatch ("" when none). ``assert not check(...)`` in a test.
    """
    settings = list(default_settings() if settings is None else settings)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention
    try:
        return _check(prog, settings, device, steps)
    finally:
        torch.set_num_threads(threads)


def _check(prog: Program, settings: list[Setting], device: str, steps: int) -> list[str]:
    clones = resolve(prog, device)
    nseg = len(prog.segments)
    plain = run(prog, PLAIN, clones, device)
    problems: list[str] = []
    if plain.error is not None and VERSION_PHRASE not in plain.error[1]:
        raise AssertionError(f"fuzzer bug: plain autograd raised {plain.error[0].__name__}: {plain.error[1]}\n"
                             f"{prog!r}\n" + "\n".join(plain.lines))
    again = run(prog, PLAIN, clones, device)
    for d in compare(plain, again):
        problems.append(f"plain autograd is not reproducible: {d}")
    twins: dict[str, Outcome] = {_key(PLAIN): plain}
    plain_alive: set[str] | None = None  # NOTE [ Fuzzer semantics ] Rule 11: what plain autograd's forward leaves alive
    for s in settings:
        tl = s.layout(None, nseg, twin=True, seed=prog.seed)
        key = _key(tl)
        if key not in twins:
            twins[key] = run(prog, tl, clones, device)
            recompute = "Recompute" in key or isinstance(tl[0], ChainRun)
            err = twins[key].error
            kept_then_written = err is not None and KEPT_WRITTEN in err[1]
            bumped = err is not None and VERSION_PHRASE in err[1] and isinstance(tl[0], ChainRun) and tl[0].bump \
                and tl[0].break_at is not None  # NOTE [ Fuzzer semantics ] Rule 10: plain autograd has no bump
            if (plain.error is None or not recompute) and not kept_then_written and not bumped:  # NOTE [ Fuzzer semantics ] Rules 4, 6
                for d in compare(plain, twins[key], grad_tol=RECOMPUTE_TOL if recompute else None):
                    problems.append(f"twin of {s!r} ({key}) vs plain autograd: {d}")
        ref = twins[key]
        if plain.error is not None and s.structure.startswith("rec_parts"):  # NOTE [ Fuzzer semantics ] Rule 9
            continue
        store = make_store(s.store, device) if s.store is not None else None
        layout = s.layout(store, nseg, twin=False, seed=prog.seed)
        outer = layout[0]
        if plain.error is not None and isinstance(outer, ChainRun) and outer.has_parts:  # NOTE [ Fuzzer semantics ] Rule 9
            continue
        try:
            n = steps if store is not None else getattr(outer, "steps", 1)
            for step in range(n):
                got = run(prog, layout, clones, device)
                for d in compare(ref, got):
                    problems.append(f"{s!r} step {step + 1}: {d}")
                if isinstance(outer, ChainRun):  # NOTE [ Fuzzer semantics ] Rule 10: the chain's own account
                    problems += [f"{s!r} step {step + 1}: {note}" for note in outer.notes]
                    outer.notes.clear()
            if got.error is not None and got.phase == "backward":
                flush_failed_backward(device)
            refs = forward_only(prog, layout, clones, device)  # NOTE [ Fuzzer semantics ] Rule 11
            found = leaks(refs, store)
            if found and all("tensors outlive it" in d for d in found):  # only tensors: plain autograd's own?
                if plain_alive is None:
                    plain_alive = _alive(forward_only(prog, PLAIN, clones, device))
                if _alive(refs) <= plain_alive:
                    found = []
            problems += [f"{s!r} step {n + 1} (forward only): {d}" for d in found]
        finally:
            if isinstance(outer, ChainRun):
                outer.close()
    if problems:
        problems.append("program:\n    " + "\n    ".join(plain.lines))
    return problems


def report(prog: Program, problems: Sequence[str], device: str = "cpu", per_setting: int = 3) -> str:
    """``check``'s findings condensed: a line to reproduce, the program as it ran, then for each
    setting the steps that failed and the first few differences of the first of them."""
    by: dict[str, dict[str, list[str]]] = {}
    listing = ""
    for p in problems:
        if p.startswith("program:"):
            listing = p
            continue
        who, _, rest = p.partition(": ")
        setting, _, step = who.partition(" step ")
        by.setdefault(setting, {}).setdefault(step or "-", []).append(rest)
    bad = [w for w in by if w.startswith("Setting(")]
    out = [f"{len(by)} setting(s) disagree with their reference; reproduce with",
           f"    check({prog!r}, device={device!r}, settings=[{', '.join(bad)}])", listing]
    for who, steps in by.items():
        first = next(iter(steps.values()))
        more = f" (+{len(first) - per_setting} more)" if len(first) > per_setting else ""
        label = who if list(steps) == ["-"] else f"{who} steps {', '.join(steps)}"
        out.append(f"{label}: " + "; ".join(first[:per_setting]) + more)
    return "\n".join(out)


# -- the hypothesis strategy ---------------------------------------------------------------------
def programs(max_ops: int = 8) -> Any:
    """A hypothesis strategy of ``Program`` values (imported lazily: hypothesis is a test dependency)."""
    from hypothesis import strategies as st

    names = sorted(n for n in OPS if n != "clobber")
    names += ["inplace"] * 3 + ["dropout_"]  # in-place ops more often
    operand = st.one_of(st.just(0), st.integers(0, 5))  # the newest value half of the time

    @st.composite
    def op_st(draw: Any) -> Op:
        name = draw(st.sampled_from(names))
        a, b, k = draw(operand), draw(operand), draw(st.integers(0, 63))
        return Op(name, a, b, k, clobber=name in INPLACE and draw(st.integers(0, 15)) == 0)

    @st.composite
    def prog(draw: Any) -> Program:
        ops = draw(st.lists(op_st(), min_size=1, max_size=max_ops))
        if draw(st.integers(0, 9)) == 0:  # now and then, a deliberate modification of a saved tensor
            at = draw(st.integers(0, len(ops)))
            ops.insert(at, Op("clobber", draw(st.integers(0, 5)), 0, draw(st.integers(0, 63))))
        n_in = draw(st.integers(1, 3))
        shapes = tuple(draw(st.sampled_from(SHAPES)) for _ in range(n_in))
        cut = st.integers(1, max(1, len(ops) - 1))
        cuts = tuple(sorted(set(draw(st.lists(cut, max_size=2)))))
        dtype, seed = draw(st.sampled_from(DTYPES)), draw(st.integers(0, 1 << 16))
        if draw(st.integers(0, 3)) == 0:  # now and then more cuts, up to one per op: longer chains (NOTE [ Fuzzer semantics ] Rule 10)
            cuts = tuple(sorted(set(cuts) | set(draw(st.lists(cut, max_size=len(ops))))))
        return Program(ops=tuple(ops), dtype=dtype, shapes=shapes, cuts=tuple(c for c in cuts if c < len(ops)),
                       seed=seed)

    return prog()
