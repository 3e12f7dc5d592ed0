"""``checkpointed_scan`` and ``checkpointed_loop``: a time-stepping loop differentiated under a schedule.

# NOTE [ Checkpointed loop ]
# 1. ``checkpointed_loop`` is an autograd Function driven by the executor (NOTE
#    [ Executor ]). Its forward executes the schedule up to ``EndForward`` without recording,
#    then evaluates the last step with recording and keeps that graph for
#    ``Adjoint(n_steps - 1)`` (NOTE [ Schedule actions ] Rule 4). Its backward executes the
#    rest: each ``Adjoint(n)`` re-evaluates step n with recording from the current state and
#    back-propagates the incoming adjoint through it.
# 2. Gradients with respect to the initial state and to the parameters are those of the
#    unrolled loop, bit for bit for deterministic ops: a parameter's running sum is passed to
#    each step's ``autograd.grad`` as the gradient of the parameter itself, so every use adds to
#    it in the order plain autograd's accumulation would.
#    Steps that are not recorded (the forward sweep, the advances between restores) still run
#    as plain autograd runs them: under grad, with the state requiring grad, and their graph
#    dropped at once. Kernels that choose by grad mode would otherwise compute other values
#    (the eval-mode fast paths of ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention``,
#    attention backends that differ by whether inputs require grad).
#    One backward pass per loop: the schedule's snapshots are consumed by it. A loop run
#    without grad, or dropped without a backward, gives its host blocks back.
# 3. Captured tensors: every tensor from outside the loop that a step reads differentiably is
#    an input of the Function (NOTE [ Captured tensors ], torchckpt/adjoint/captures.py): found by a
#    probe of step 0, whose output is state 1, where the forward sweep starts.
# 4. The scan. ``checkpointed_scan``'s step is ``(carry, xs[k]) -> (carry, y)``; the loop is its
#    case with no ``xs`` and no ``y``. The state the schedule snapshots is the carry's tensor
#    leaves (its other leaves pass through, checked unchanged). ``xs`` leaves are inputs of the
#    Function; each step reads ``xs[k]`` as a view, and a recorded step as a leaf of its own, so
#    ``Adjoint(k)`` returns its gradient, and the Function returns each leaf's gradient as the
#    steps' gradients stacked (what ``select``'s backward accumulates in plain autograd, at
#    disjoint positions: the same values). Each step's ``y`` is kept from the forward sweep
#    (every step runs once there; recomputations in the backward drop theirs) and returned
#    stacked; ``Adjoint(k)`` seeds ``y``'s outputs with slice ``k`` of the stacked adjoint, beside
#    the carry's. The step index reaches the step as a Python int (``index=True``): the
#    executor knows it, so no tensor holds it and nothing syncs.
#    A ``y`` leaf that is a captured tensor returned as it is at every step (``(carry, w)``): plain
#    autograd's ``stack`` backward hands all its slices to that tensor at once, in step order,
#    before any step's own uses; so its slices are summed in that order first (the stacks of
#    later leaves first, into one sum, when it is several leaves) and start the tensor's running
#    sum (Rule 2), and are not seeded step by step. A swapped tensor (NOTE [ Captured tensors ]
#    Rule 2) returned as it is passes no op the mode sees: the recorded step returns its alias
#    instead. Known limit (a strict-xfail
#    test in tests/adjoint/test_scan_fuzz.py): a ``y`` that is the step's input carry returned as
#    it is may differ in the last bit; return a copy (``c.clone()``) for exactness.
# 5. One tensor at two positions of a state (``init=(u0, u0)``, a step returning ``(v, v)``) stays
#    one tensor: one input of the Function for the initial state, one detached tensor after an
#    advance, the saved state's pattern re-applied at its restore, and one leaf when a step is
#    recorded, differentiated once, its gradient given to its first position (the others get
#    ``None``, so the step before seeds that tensor once). Autograd then sums the step's uses of
#    it in the order plain autograd does. The final state's two positions are two outputs of the
#    Function, whose gradients the last step sums (the last bit may differ there).
# 6. A ``Restore`` writes the snapshot into fresh tensors of the loop's own (``SnapshotStore.restore(
#    out=...)``, NOTE [ Snapshot store ] Rule 11): a codec decodes straight into the new state, an
#    uncompressed snapshot is copied into it once from its slot (or GPU-tier copy), and no device
#    copy follows. It never writes into the tensors of an earlier state: those went to the user's
#    step, which may hand them on (a carry leaf returned as it is, a view, a custom Function's saved
#    or returned tensor), and a recorded step's graph saves them until its ``Adjoint``; nothing here
#    can prove them unheld, and a tensor from the caching allocator costs no device work.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchckpt._args import check_flag
from torchckpt._errors import CheckpointError
from torchckpt.adjoint.args import check_actions, check_callable, check_params, check_slots, check_store
from torchckpt.adjoint.auto import AutoSchedule
from torchckpt.codecs.base import Packed
from torchckpt.adjoint.captures import (
    Age, Swap, descendants, exits, grad_leaf, node_mark, owned_nodes, probe, unfound,
)
from torchckpt.adjoint.step import Step, Tree, aliases, detached, firsts
from torchckpt.schedules.execute import run as execute_all
from torchckpt.schedules import Adjoint, Advance, End, EndForward, Free, Prefetch, Restore, Revolve, Save, Tier, Uniform
from torchckpt.schedules.planned import Planned
from torchckpt.schedules.schedule import Schedule
from torchckpt.store import SnapshotStats, SnapshotStore, Store, default_store
from torchckpt.store.lend import lend_snapshot_store

__all__ = ["checkpointed_loop", "checkpointed_scan"]


def _auto_value(schedule: Any) -> Any:
    """``"auto"``, ``Revolve`` or ``Uniform`` (the class) as the ``AutoSchedule`` value they stand for, with a warning."""
    if isinstance(schedule, str):
        if schedule != "auto":
            raise ValueError(f"torchckpt: schedule must be a schedule object or torchckpt.adjoint.AutoSchedule(), got {schedule!r}; "
                             "pass e.g. schedule=Revolve(n_steps, 4) or schedule=torchckpt.adjoint.AutoSchedule().")
        warnings.warn("torchckpt: checkpointed_loop(schedule='auto') is deprecated; pass schedule=torchckpt.adjoint.AutoSchedule() "
                      "(the default).", DeprecationWarning, stacklevel=3)
        return AutoSchedule()
    if schedule is Revolve or schedule is Uniform:
        warnings.warn(f"torchckpt: checkpointed_loop(schedule={schedule.__name__}) is deprecated; pass "
                      f"schedule=torchckpt.adjoint.AutoSchedule(kind={schedule.__name__}).", DeprecationWarning, stacklevel=3)
        return AutoSchedule(kind=schedule)
    return schedule


class _LoopRun:
    """What the autograd Function carries from forward to backward."""

    def __init__(self, fn: Step, n_state: int, n_steps: int, schedule: Iterable[Any],
                 snaps_factory: Callable[[torch.device], SnapshotStore], slots: int, prefetch: bool,
                 inputs: list[torch.Tensor], swapped: list[torch.Tensor], out1: list[torch.Tensor] | None,
                 through_old: bool) -> None:
        self.fn, self.n_state, self.n_steps = fn, n_state, n_steps
        self.plan = Planned.of(schedule, prefetch)
        self.slots = slots
        self.factory = snaps_factory
        self.snaps: SnapshotStore | None = None
        self.last: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = None
        self.stats: SnapshotStats | None = None
        self.done = False
        # NOTE [ Captured tensors ] Rule 1: the probe's output, where the forward sweep starts (and y of step 0)
        self.state1 = out1[:n_state] if out1 is not None else None
        self.ys: list[list[torch.Tensor] | None] = [None] * n_steps  # NOTE [ Checkpointed loop ] Rule 4: each step's y, from the forward sweep
        if out1 is not None:
            self.ys[0] = out1[n_state:]
        # NOTE [ Captured tensors ] Rule 2: recorded steps see an alias of each swapped tensor; each step is differentiated
        # with respect to the Function's inputs, or to their aliases.
        self.swaps = {id(t): (t, t.detach().requires_grad_()) for t in swapped}
        self.wrt = [self.swaps[id(p)][1] if id(p) in self.swaps else p for p in inputs]
        self.inputs = inputs
        self.passthrough: dict[int, int] = {}  # NOTE [ Checkpointed loop ] Rule 4: y leaf -> the captured tensor it returns as is, every step
        self.not_passthrough: set[int] = set()  # y leaves that were something else at some step
        self.through_old = through_old  # NOTE [ Captured tensors ] Rule 1: a step running autograd makes nodes on other threads
        # The executor's state (NOTE [ Executor ] Rule 1): the sweep, the current state, the adjoints.
        self.backward = False
        self.first_packs: list[Packed] | None = None  # the initial state, compressed by AutoSchedule (or None)
        self.like: list[tuple[torch.Size, torch.dtype]] = []  # the saved state's layout (NOTE [ Checkpointed loop ] Rule 6)
        self.owns_snaps = True  # False: the caller's SnapshotStore
        self.x: list[torch.Tensor] | None = None
        self.g: list[torch.Tensor | None] = []  # the adjoint of the current state
        self.gp: list[torch.Tensor | None] = []  # each captured tensor's running sum
        self.gys: list[torch.Tensor | None] = []  # the incoming adjoint of each stacked y (NOTE [ Checkpointed loop ] Rule 4)
        self.gxs: list[list[torch.Tensor | None]] = []  # each step's adjoint of xs[k] (NOTE [ Checkpointed loop ] Rule 4)
        self.alias: dict[int, list[int]] = {}  # NOTE [ Checkpointed loop ] Rule 5: the saved states that hold one tensor in two places
        self.unique_of: list[int] = list(range(n_state))  # NOTE [ Checkpointed loop ] Rule 5: each initial position's input of the Function
        self.first_of: list[int] = list(range(n_state))  # NOTE [ Checkpointed loop ] Rule 5: each input's first position
        self.n_unique = n_state

    def steps(self, x: list[torch.Tensor], n0: int, n1: int) -> list[torch.Tensor]:
        """Steps ``n0`` to ``n1`` with no graph kept, in the grad mode plain autograd runs them in
        (NOTE [ Checkpointed loop ] Rule 2)."""
        for k in range(n0, n1):
            if k == 0 and self.state1 is not None:
                x = self.state1
                continue
            with torch.enable_grad():
                out, y = self.fn(k, [grad_leaf(v) for v in x], self.fn.x_at(k))
            x = detached(out)  # NOTE [ Checkpointed loop ] Rule 5: one tensor in two places stays one
            if not self.backward and y:  # NOTE [ Checkpointed loop ] Rule 4: the forward sweep keeps each step's y
                self.ys[k] = [v.detach() for v in y]
                self.check_passthrough(y, self.inputs)
        return x

    def check_passthrough(self, y: list[torch.Tensor], captured: list[torch.Tensor]) -> None:
        """NOTE [ Checkpointed loop ] Rule 4: note the y leaves that are a captured tensor returned as it is (the same
        one at every step)."""
        for j, v in enumerate(y):
            m = next((i for i, p in enumerate(captured) if v is p), None)
            if m is None or self.passthrough.get(j, m) != m:
                self.not_passthrough.add(j)
            else:
                self.passthrough[j] = m

    def record(self, x: list[torch.Tensor],
               k: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Evaluate step k from ``x`` with recording (NOTE [ Checkpointed loop ] Rule 1): the graph ends at the inputs
        (NOTE [ Captured tensors ] Rule 2) and at ``xs[k]``; returns the inputs, ``xs[k]`` and the outputs (the state, then y)."""
        leaves: dict[int, torch.Tensor] = {}
        xin = [leaves.setdefault(id(v), grad_leaf(v)) for v in x]  # NOTE [ Checkpointed loop ] Rule 5: one leaf where the state holds one tensor
        xk = self.fn.x_at(k, grad=True)
        with torch.enable_grad():
            if self.swaps:
                with Swap(self.swaps):
                    out, y = self.fn(k, xin, xk)
                # a swapped tensor returned as it is went through no op the mode sees: its alias stands in
                # (NOTE [ Captured tensors ] Rule 2)
                return xin, xk, [self.swaps[id(v)][1] if id(v) in self.swaps else v for v in out + y]
            out, y = self.fn(k, xin, xk)
        return xin, xk, out + y

    def check_exits(self, xin: list[torch.Tensor], y: list[torch.Tensor], mark: int) -> None:
        """NOTE [ Captured tensors ] Rule 2: a recorded step's graph leaves it only through its inputs."""
        swapped = owned_nodes(t for t, _ in self.swaps.values())
        leaves, edges, stopped = exits(y, {**owned_nodes(self.wrt), **swapped}, Age(mark, xin), self.through_old)
        if stopped & swapped.keys():
            raise CheckpointError(
                "torchckpt: the step of checkpointed_loop reads a tensor computed before the loop and also a tensor it "
                "was computed from, and passes the first to code a TorchFunctionMode does not see (a custom "
                "Function's apply, TorchScript, compiled code): that use cannot be cut from the first tensor's "
                "history, so every step would back-propagate through that history again (NOTE [ Captured tensors ] "
                "Rule 2). Compute the first inside the step, or pass it through a torch op first (e.g. "
                "Fn.apply(x, w2.view_as(w2)))."
            )
        known = {id(t) for t in xin} | {id(t) for t in self.wrt if t.grad_fn is None}
        for v in leaves:
            if id(v) not in known:
                raise CheckpointError(
                    f"torchckpt: the last step of checkpointed_loop reads a leaf tensor that requires grad (shape "
                    f"{tuple(v.shape)}, {v.dtype}) that step 0 did not read, or makes one itself; pass it with "
                    "params=[...], or make the step's own tensors without requires_grad=True (NOTE [ Captured "
                    "tensors ] Rule 3)."
                )
        if edges:
            raise unfound(next(iter(edges.values())), "the last step")

    # -- the driver (NOTE [ Executor ] Rule 1) ---------------------------------------
    def save(self, a: Save, i: int) -> None:
        n, tier = a.n, a.tier
        x = self.x
        assert x is not None
        if self.snaps is None:
            self.snaps = self.factory(x[0].device)
            if self.owns_snaps:
                # NOTE [ Checkpointed loop ] Rule 2: a loop dropped without a backward still gives its host blocks back.
                weakref.finalize(self, self.snaps.close)
            # The first state is compressed once; a store sized by bytes fixes its slots here.
            self.plan.start(self.snaps.calibrate(x, packs=self.first_packs))
            self.first_packs = None
            self.like = [(v.shape, v.dtype) for v in x]
        self.snaps.save(n, tier, x, flush=self.plan.flush(i))
        pattern = aliases(x)
        if pattern is not None:  # NOTE [ Checkpointed loop ] Rule 5: restored as one tensor where it was one
            self.alias[n] = pattern
        else:
            self.alias.pop(n, None)

    def prefetch(self, a: Prefetch, i: int) -> None:
        if self.snaps is not None:  # nothing to do before the first save
            self.snaps.prefetch(a.n, a.src, a.dst)

    def free(self, a: Free, i: int) -> None:
        if self.snaps is not None:
            self.snaps.free(a.n, a.tier)

    def restore(self, a: Restore, i: int) -> None:
        n, tier = a.n, a.tier
        if not self.backward:
            raise CheckpointError(f"torchckpt: {Restore(n, tier)!r} before EndForward: the schedule is invalid.")
        assert self.snaps is not None
        dev = self.snaps.device  # NOTE [ Checkpointed loop ] Rule 6: into fresh tensors, with no copy after
        self.x = self.snaps.restore(n, tier, out=[torch.empty(s, dtype=d, device=dev) for s, d in self.like])
        if n in self.alias:  # NOTE [ Checkpointed loop ] Rule 5
            self.x = [self.x[j] for j in self.alias[n]]

    def advance(self, a: Advance, i: int) -> None:
        assert self.x is not None
        self.x = self.steps(self.x, a.n0, a.n1)

    def end_forward(self, a: EndForward, i: int) -> bool:
        return False  # the forward sweep ends here; the backward goes on from the next action

    def end(self, a: End, i: int) -> None:
        if not self.backward:
            raise CheckpointError("torchckpt: End() before EndForward: the schedule is invalid.")

    def adjoint(self, a: Adjoint, i: int) -> None:
        """Back-propagate the adjoints through step n (NOTE [ Checkpointed loop ] Rules 2, 4)."""
        n = a.n
        if not self.backward:
            raise CheckpointError(f"torchckpt: {Adjoint(n)!r} before EndForward: the schedule is invalid.")
        if self.last is not None:
            xin, xk, out = self.last
            self.last = None
        else:
            if self.x is None:
                raise CheckpointError(f"torchckpt: {Adjoint(n)!r} with no current state: the schedule is invalid.")
            xin, xk, out = self.record(self.x, n)
        params, gp = self.wrt, self.gp
        g = self.g + [gy[n] if gy is not None else None for gy in self.gys]  # NOTE [ Checkpointed loop ] Rule 4: this step's slice of ys' adjoint
        outs_y = [v for v, gv in zip(out, g) if gv is not None and v.requires_grad]
        gs = [gv for v, gv in zip(out, g) if gv is not None and v.requires_grad]
        first = firsts(xin)  # NOTE [ Checkpointed loop ] Rule 5: a leaf at two positions is differentiated once, its gradient given to the first
        wrt = ([v for i, v in enumerate(xin) if v.requires_grad and first[i]] + [v for v in xk if v.requires_grad]
               + [p for p in params if p.requires_grad])
        # NOTE [ Checkpointed loop ] Rule 2: each parameter's running sum enters as an output of its own, so autograd
        # adds this step's uses to it one by one, in the order plain autograd would.
        seeds = [(p, s) for p, s in zip(params, gp) if p.requires_grad and s is not None]
        res = (torch.autograd.grad(outs_y + [p for p, _ in seeds], wrt, gs + [s for _, s in seeds],
                                   allow_unused=True) if outs_y or seeds else [None] * len(wrt))
        it = iter(res)
        self.g = [next(it) if v.requires_grad and first[i] else None for i, v in enumerate(xin)]
        if xk:
            self.gxs[n] = [next(it) if v.requires_grad else None for v in xk]
        for k, p in enumerate(params):
            if p.requires_grad:
                d = next(it)
                if d is not None:
                    gp[k] = d
        self.x = None


class _Loop(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: _LoopRun, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        uniq = [t.detach() for t in tensors[: run.n_unique]]
        run.x = [uniq[j] for j in run.unique_of]  # NOTE [ Checkpointed loop ] Rule 5: the initial state, one tensor where it was one
        execute_all(iter(run.plan), run)  # up to EndForward (NOTE [ Checkpointed loop ] Rule 1)
        x = run.x
        run.state1 = None
        mark = node_mark()
        last = run.n_steps - 1
        xin, xk, out = run.record(x, last)  # NOTE [ Checkpointed loop ] Rule 1: record the last step, keep its graph for Adjoint(n-1)
        run.check_exits(xin + xk, out, mark)
        run.last = (xin, xk, out)
        run.ys[last] = [v.detach() for v in out[run.n_state:]]
        run.check_passthrough(out[run.n_state:], run.wrt)  # the recorded step sees the aliases (wrt)
        ctx.set_materialize_grads(False)  # an output the loss does not use brings None, as in plain autograd
        ctx.run = run
        ys = [torch.stack([y[j] for y in run.ys]) for j in range(len(out) - run.n_state)]  # type: ignore[index]
        return (*(v.detach() for v in out[: run.n_state]), *ys)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        run: _LoopRun = ctx.run
        if run.done:
            raise CheckpointError(
                "torchckpt: a second backward through checkpointed_loop: its snapshots were consumed by the "
                "first one. Run the loop again for another backward (retain_graph=True cannot replay it)."
            )
        run.done = True
        run.backward = True
        run.g, run.gp, run.x = list(grads[: run.n_state]), [None] * len(run.wrt), None
        run.gys = list(grads[run.n_state:])
        for j, m in sorted(run.passthrough.items(), reverse=True):  # NOTE [ Checkpointed loop ] Rule 4: a captured tensor returned as y
            gy = run.gys[j]
            if j in run.not_passthrough or gy is None:
                continue
            acc = run.gp[m]  # the same tensor as another y leaf too: the later stack's backward runs first
            for k in range(run.n_steps):  # stack's backward hands the slices over in order, into one buffer
                acc = gy[k] if acc is None else acc + gy[k]
            run.gp[m] = acc  # the running sum starts with them (NOTE [ Checkpointed loop ] Rule 2)
            run.gys[j] = None
        run.gxs = [[None] * len(run.fn.xs) for _ in range(run.n_steps)]
        execute_all(iter(run.plan), run)  # the rest of the schedule, to End
        if run.snaps is not None:
            run.stats = run.snaps.stats()
            if run.owns_snaps:
                run.snaps.close()
        gxs: list[torch.Tensor | None] = []  # NOTE [ Checkpointed loop ] Rule 4: each xs leaf's adjoint: its steps' slices stacked
        for j, t in enumerate(run.fn.xs):
            parts = [gk[j] for gk in run.gxs]
            if not t.requires_grad or all(p is None for p in parts):
                gxs.append(None)
                continue
            zero = torch.zeros_like(t[0])
            gxs.append(torch.stack([p if p is not None else zero for p in parts]))
        g0 = [run.g[i] for i in run.first_of]  # NOTE [ Checkpointed loop ] Rule 5: each input's gradient (the first position of its tensor)
        return (None, *g0, *gxs, *run.gp)


def checkpointed_loop(
    step: Callable[[Any], Any],
    state: Any,
    n_steps: int,
    *,
    schedule: Schedule | AutoSchedule | Iterable[Any] = AutoSchedule(),
    store: Store | SnapshotStore | None = None,
    slots: int = 4,
    prefetch: bool = True,
    params: Sequence[torch.Tensor] | None = None,
) -> Any:
    """Run ``state = step(state)`` ``n_steps`` times, differentiably, storing only a schedule's snapshots.

    ``backward()`` through the result gives the gradients of the plain unrolled loop (exactly,
    for deterministic ops; a tensor the step reads that the loss also uses after the loop can
    differ in the last bit) while at most the schedule's snapshots are held; the others are
    recomputed from them. Snapshots off the GPU pass through ``slots`` GPU cache slots and are
    prefetched following ``plan_prefetch`` (NOTE [ Executor ]).

    The tensors ``step`` reads from outside the loop (a closure's weights, a module's
    parameters, a tensor computed before the loop) get their gradients with no ``params=``:
    under grad, step 0 is first run once on its own to find them (NOTE [ Captured tensors ]
    Rules 1-3). Its result is state 1, where the loop goes on, so this costs an extra step only
    when ``n_steps == 1``.

    Args:
        step: one time step, ``state -> state`` of the same structure (a tensor, tuple or dict of
            tensors). It must be deterministic given its input (no fresh randomness) and free of
            side effects: it is called again to recompute states, and step 0 runs inside the
            probe that finds what it reads.
        state: the initial state.
        n_steps: number of steps (>= 1).
        schedule: a schedule for ``n_steps`` (``Revolve``, ``ZCut``, ``Uniform``, ``Multistage``)
            or ``AutoSchedule()`` (the default): Revolve over as many snapshots as ``store``'s budgets
            hold (with a ``Store(codec=...)``, counted at the compressed size of the initial state
            plus ``AutoSchedule.margin``: compression buys snapshots, hence less recomputation);
            with a disk tier (``store``'s ``disk=``) and GPU and host short, ``Multistage`` over GPU,
            host and disk, the busiest slots on the fastest tier by measured bandwidth (NOTE [ AutoSchedule
            schedule ]); ``AutoSchedule(kind=Uniform)``: a ``Uniform`` schedule sized the same way. (``"auto"`` and the
            classes ``Revolve``/``Uniform`` still mean ``AutoSchedule()``/``AutoSchedule(kind=...)``, with a
            ``DeprecationWarning``.)
        store: where the snapshots go. A ``SnapshotStore`` is used as it is (its device, slots,
            host pool, codec and disk tier; ``AutoSchedule`` then keeps every snapshot off the GPU, behind its
            slots); the loop frees its snapshots and leaves the store open for the next loop. A
            ``Store`` lends its device, GPU budget, host pool, codec and disk tier to a snapshot
            store of ``slots`` slots made for the loop (``None``: the default store).
        slots: GPU cache slots in front of host snapshots (>= 1).
        prefetch: prefetch host snapshots ahead of their restores.
        params: tensors ``step`` uses that need gradients, in addition to those found (the
            parameters of an ``nn.Module`` step and what step 0 reads), as a list. Needed only
            for a non-leaf tensor read through code that PyTorch's function modes do not see
            (TorchScript, compiled code), or for a tensor that step 0 does not read: the loop
            raises a ``CheckpointError`` for those it sees (the first and the last step), but a
            tensor read only by steps in between goes unseen (NOTE [ Captured tensors ] Rule 3).

    Returns:
        The state after ``n_steps`` steps.

    Example::

        >>> from torchckpt.schedules import Revolve
        >>> w = torch.tensor(0.9, requires_grad=True)
        >>> x0 = torch.ones(3, requires_grad=True)
        >>> y = checkpointed_loop(lambda x: torch.sin(w * x), x0, 50, schedule=Revolve(50, 4),
        ...                       store=Store("cpu"))
        >>> y.sum().backward()
        >>> w.grad is not None and x0.grad.shape == (3,)
        True
    """
    check_callable("checkpointed_loop", "step", step)
    if not isinstance(n_steps, int) or isinstance(n_steps, bool) or n_steps < 1:
        raise ValueError(f"torchckpt: n_steps must be an int >= 1, got {n_steps!r}.")
    flat, spec = tree_flatten(state)
    if not flat or not all(isinstance(t, torch.Tensor) for t in flat):
        raise TypeError("torchckpt: state must be a tensor or a tuple/list/dict of tensors.")
    carry = Tree(state, "state", "state")
    fn = Step(step, carry, [], None, index=False, loop=True)
    out, _ = _differentiate("checkpointed_loop", fn, flat, n_steps, schedule, store, slots, prefetch,
                            _given(step, params))
    return tree_unflatten(out, spec)


def checkpointed_scan(
    step: Callable[..., tuple[Any, Any]],
    init: Any,
    xs: Any = None,
    *,
    length: int | None = None,
    index: bool = False,
    schedule: Schedule | AutoSchedule | Iterable[Any] = AutoSchedule(),
    store: Store | SnapshotStore | None = None,
    slots: int = 4,
    prefetch: bool = True,
    params: Sequence[torch.Tensor] | None = None,
) -> tuple[Any, Any]:
    """``carry, y = step(carry, xs[k])`` for every k, differentiably, storing only a schedule's snapshots of the carry.

    The scan of ``jax.lax.scan`` and ``torch``'s scan operator, checkpointed as ``checkpointed_loop``
    is (its special case: no ``xs``, no ``y``): ``backward()`` through the final carry and the
    stacked outputs gives the gradients of the plain unrolled loop, bit for bit for deterministic
    ops, with respect to ``init``, ``xs`` and every tensor ``step`` reads from outside (NOTE
    [ Checkpointed loop ] Rule 4).

    Args:
        step: ``step(carry, x) -> (carry, y)``, or ``step(carry, x, k)`` with ``index=True`` (``k``
            the step's index as a Python int: no tensor, no device sync). ``carry`` keeps its
            structure, shapes and dtypes from step to step; its non-tensor leaves (settings,
            metadata) are passed through unchanged and must come back unchanged. ``y`` is a tensor,
            a tuple/dict of tensors or ``None``, the same structure every step. Deterministic and
            free of side effects: steps run again to recompute carries.
        init: the initial carry (a tensor or a pytree with at least one tensor).
        xs: per-step inputs, a tensor or a pytree of tensors stacked along a first dimension of
            ``length``; ``step`` gets ``xs[k]`` (views). ``None``: ``step`` gets ``None``, and
            ``length`` is required.
        length: the number of steps (default: the first dimension of ``xs``).
        index: pass the step index as a third argument.
        schedule, store, slots, prefetch, params: as for ``checkpointed_loop``; the schedule is
            for ``length`` steps and its snapshots are of the carry.

    Returns:
        ``(carry, ys)``: the carry after the last step, and the ``y`` of every step stacked along
        a new first dimension (``None`` where ``y`` is ``None``).

    Example::

        >>> w = torch.tensor(0.9, requires_grad=True)
        >>> forcing = torch.linspace(0, 1, 20).unsqueeze(1).expand(20, 3)
        >>> def step(u, f):
        ...     u = torch.sin(w * u) + f
        ...     return u, u.sum()
        >>> u, traces = checkpointed_scan(step, torch.ones(3, requires_grad=True), forcing,
        ...                               store=Store("cpu"))
        >>> traces.shape
        torch.Size([20])
        >>> (u.sum() + traces.square().sum()).backward()
        >>> w.grad is not None
        True
    """
    check_callable("checkpointed_scan", "step", step)
    check_flag("checkpointed_scan", "index", index)
    carry = Tree(init, "carry", "carry")
    flat = carry.like
    if not flat:
        raise TypeError("torchckpt: checkpointed_scan(init=...) must hold at least one tensor (the carry).")
    xs_tree = None if xs is None else Tree(xs, "xs", "xs")
    leaves = xs_tree.like if xs_tree is not None else []
    if xs_tree is not None and any(v is not None for _, v in xs_tree.rest):
        raise TypeError("torchckpt: checkpointed_scan(xs=...) must be a tensor or a tuple/list/dict of tensors stacked "
                        "along their first dimension (None leaves allowed).")
    sizes = {t.shape[0] if t.dim() else None for t in leaves}
    if None in sizes or len(sizes) > 1:
        raise ValueError("torchckpt: checkpointed_scan(xs=...) tensors must share their first dimension (the steps); "
                         f"got shapes {[tuple(t.shape) for t in leaves]}.")
    n = sizes.pop() if sizes else None
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 1):
        raise ValueError(f"torchckpt: checkpointed_scan(length=...) must be an int >= 1, got {length!r}.")
    if n is None and length is None:
        raise ValueError("torchckpt: checkpointed_scan needs xs=... (stacked per-step inputs) or length=... (the "
                         "number of steps).")
    if n is not None and length is not None and n != length:
        raise ValueError(f"torchckpt: checkpointed_scan(length={length}) but xs has {n} steps along its first "
                         "dimension.")
    n_steps = length if length is not None else n
    assert n_steps is not None
    if n_steps < 1:
        raise ValueError("torchckpt: checkpointed_scan needs at least one step; xs has 0 along its first dimension.")
    fn = Step(step, carry, leaves, xs_tree, index=index, loop=False)
    out, ys = _differentiate("checkpointed_scan", fn, flat, n_steps, schedule, store, slots, prefetch,
                             _given(step, params))
    assert fn.y is not None
    if any(v is not None for _, v in fn.y.rest):
        raise TypeError("torchckpt: checkpointed_scan's step must return y as a tensor, a tuple/list/dict of tensors, "
                        "or None.")
    return carry.build(out), fn.y.build(ys)


def _given(step: Any, params: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    given = check_params(params)
    if isinstance(step, nn.Module):
        given = [p for p in step.parameters() if p.requires_grad] + given
    return given


def _differentiate(name: str, fn: Step, flat: list[torch.Tensor], n_steps: int, schedule: Any,
                   store: Store | SnapshotStore | None, slots: int, prefetch: bool,
                   given: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The loop or scan of ``fn`` for ``n_steps``: the last state and the stacked ys
    (NOTE [ Checkpointed loop ] Rules 1-4)."""
    check_store(name, store, snapshot_store=True)
    check_slots(name, slots)
    check_flag(name, "prefetch", prefetch)
    if store is None:
        store = default_store(flat[0].device)
    schedule = _auto_value(schedule)
    first_packs = None  # with a codec, AutoSchedule's compression of the initial state, reused by its Save (compressed once)
    if isinstance(schedule, AutoSchedule):
        nbytes, first_packs = schedule.estimate(flat, store.codec)
        # A SnapshotStore's GPU memory is all slots: AutoSchedule keeps every snapshot on the host tier behind them.
        gpu = store.cache.capacity if isinstance(store, Store) else 0
        # NOTE [ Auto schedule ]: with the store's disk tier, Multistage over GPU, host and disk when the first two are short.
        schedule = schedule.resolve(n_steps, nbytes, gpu, store.host.capacity_bytes, slots, disk=store.disk,
                                    host=store.host, device=store.device)
    if isinstance(schedule, type):
        raise TypeError(
            f"torchckpt: schedule must be a schedule object (e.g. ZCut(n_steps, ...)), AutoSchedule() or AutoSchedule(kind=...); "
            f"got {schedule!r}. Only Revolve and Uniform can be sized from the budgets: build other schedules yourself."
        )
    if schedule is None:
        raise TypeError(f"torchckpt: {name}(schedule=None): expected a schedule (e.g. Revolve(n_steps, "
                        "4)) or torchckpt.adjoint.AutoSchedule(); pass schedule=torchckpt.adjoint.AutoSchedule() (the default) to size Revolve from the "
                        "store.")
    sched_n = getattr(schedule, "n_steps", n_steps)
    if not isinstance(schedule, Schedule):
        schedule = check_actions(name, schedule)
    if sched_n != n_steps:
        raise ValueError(f"torchckpt: the schedule is for {sched_n} steps but the {'loop' if fn.loop else 'scan'} has "
                         f"{n_steps}; build it with n_steps={n_steps}.")
    st = store

    def factory(device: torch.device) -> SnapshotStore:
        return lend_snapshot_store(st, device, slots)[0]  # NOTE [ Lending a snapshot store ]

    if not torch.is_grad_enabled():
        return _plain(fn, list(flat), 0, n_steps, [])  # nothing to differentiate: no snapshots at all
    n = len(flat)
    # NOTE [ Captured tensors ] Rule 1: step 0 (with xs[0]) finds what the steps read
    def step0(xin: list[torch.Tensor]) -> list[torch.Tensor]:
        out, y = fn(0, xin[:n], xin[n:])
        return out + y

    inputs, out1, through_old = probe(step0, [*flat, *(t[0] for t in fn.xs)], given)
    if not any(t.requires_grad for t in [*flat, *fn.xs, *inputs]):
        return _plain(fn, out1[:n], 1, n_steps, [out1[n:]])  # nothing to differentiate
    run = _LoopRun(fn, n, n_steps, schedule, factory, slots, prefetch, inputs, descendants(inputs), out1, through_old)
    run.first_packs = first_packs
    run.owns_snaps = not isinstance(store, SnapshotStore)
    pattern = aliases(flat)
    uniq = flat
    if pattern is not None:  # NOTE [ Checkpointed loop ] Rule 5: one tensor at two positions of the initial state is one input
        firsts = sorted(set(pattern))
        run.first_of, run.n_unique = firsts, len(firsts)
        run.unique_of = [firsts.index(p) for p in pattern]
        uniq = [flat[i] for i in firsts]
    res = _Loop.apply(run, *uniq, *fn.xs, *inputs)
    return list(res[:n]), list(res[n:])


def _plain(fn: Step, x: list[torch.Tensor], k0: int, n_steps: int,
           ys: list[list[torch.Tensor]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Steps ``k0`` to the last with no graph: the last state and the stacked ys."""
    with torch.no_grad():
        for k in range(k0, n_steps):
            x, y = fn(k, x, fn.x_at(k))
            ys.append(y)
    return x, [torch.stack([y[j] for y in ys]) for j in range(len(ys[0]))] if ys else []
