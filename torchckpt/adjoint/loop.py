"""``checkpointed_loop``: ``state = step(state)`` n times, differentiated through autograd under a schedule.

# NOTE [ Checkpointed loop ]
# 1. ``checkpointed_loop`` is an autograd Function driven by the executor (NOTE [ Adjoint
#    executor ]). Its forward executes the schedule up to ``EndForward`` without recording,
#    then evaluates the last step with recording and keeps that graph for
#    ``Adjoint(n_steps - 1)`` (Rule 4 of NOTE [ Schedule actions ]). Its backward executes the
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
from torchckpt.adjoint.auto import Auto
from torchckpt.codecs.base import Packed
from torchckpt.adjoint.captures import (
    Age, Swap, check_structure, descendants, exits, flat_state, grad_leaf, node_mark, owned_nodes, probe, unfound,
)
from torchckpt.adjoint.execute import Planned
from torchckpt.adjoint.execute import run as execute_all
from torchckpt.schedules import Adjoint, Restore, Revolve, Tier, Uniform
from torchckpt.schedules.schedule import Schedule
from torchckpt.store import SnapshotStats, SnapshotStore, Store, default_store

__all__ = ["checkpointed_loop"]


def _auto_value(schedule: Any) -> Any:
    """``"auto"``, ``Revolve`` or ``Uniform`` (the class) as the ``Auto`` value they stand for, with a warning."""
    if isinstance(schedule, str):
        if schedule != "auto":
            raise ValueError(f"torchckpt: schedule must be a schedule object or torchckpt.Auto(), got {schedule!r}; "
                             "pass e.g. schedule=Revolve(n_steps, 4) or schedule=torchckpt.Auto().")
        warnings.warn("torchckpt: checkpointed_loop(schedule='auto') is deprecated; pass schedule=torchckpt.Auto() "
                      "(the default).", DeprecationWarning, stacklevel=3)
        return Auto()
    if schedule is Revolve or schedule is Uniform:
        warnings.warn(f"torchckpt: checkpointed_loop(schedule={schedule.__name__}) is deprecated; pass "
                      f"schedule=torchckpt.Auto(kind={schedule.__name__}).", DeprecationWarning, stacklevel=3)
        return Auto(kind=schedule)
    return schedule


class _LoopRun:
    """What the autograd Function carries from forward to backward."""

    def __init__(self, step: Callable[..., Any], spec: Any, n_state: int, schedule: Iterable[Any],
                 snaps_factory: Callable[[torch.device], SnapshotStore], slots: int, prefetch: bool,
                 inputs: list[torch.Tensor], swapped: list[torch.Tensor], state1: list[torch.Tensor] | None,
                 through_old: bool) -> None:
        self.step, self.spec, self.n_state = step, spec, n_state
        self.plan = Planned.of(schedule, prefetch)
        self.slots = slots
        self.factory = snaps_factory
        self.snaps: SnapshotStore | None = None
        self.last: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.stats: SnapshotStats | None = None
        self.done = False
        self.state1 = state1  # NOTE [ Captured tensors ] Rule 1: the probe's output, where the forward sweep starts
        # NOTE [ Captured tensors ] Rule 2: recorded steps see an alias of each swapped tensor; each step is differentiated
        # with respect to the Function's inputs, or to their aliases.
        self.swaps = {id(t): (t, t.detach().requires_grad_()) for t in swapped}
        self.wrt = [self.swaps[id(p)][1] if id(p) in self.swaps else p for p in inputs]
        self.through_old = through_old  # NOTE [ Captured tensors ] Rule 1: a step running autograd makes nodes on other threads
        # The executor's state (NOTE [ Adjoint executor ] Rule 1): the sweep, the current state, the adjoints.
        self.backward = False
        self.first_packs: list[Packed] | None = None  # the initial state, compressed by Auto (or None)
        self.owns_snaps = True  # False: the caller's SnapshotStore
        self.x: list[torch.Tensor] | None = None
        self.g: list[torch.Tensor | None] = []
        self.gp: list[torch.Tensor | None] = []

    def call(self, x: list[torch.Tensor]) -> list[torch.Tensor]:
        return flat_state(self.spec, x, self.step(tree_unflatten(x, self.spec)))

    def steps(self, x: list[torch.Tensor], n0: int, n1: int) -> list[torch.Tensor]:
        """Steps ``n0`` to ``n1`` with no graph kept, in the grad mode plain autograd runs them in (Rule 2)."""
        for k in range(n0, n1):
            if k == 0 and self.state1 is not None:
                x = self.state1
                continue
            with torch.enable_grad():
                x = [v.detach() for v in self.call([grad_leaf(v) for v in x])]
        return x

    def record(self, x: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Evaluate one step from ``x`` with recording (Rule 2): the graph ends at the inputs (NOTE [ Captured tensors ] Rule 2)."""
        xin = [grad_leaf(v) for v in x]
        with torch.enable_grad():
            if self.swaps:
                with Swap(self.swaps):
                    return xin, self.call(xin)
            return xin, self.call(xin)

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

    # -- the driver (NOTE [ Adjoint executor ] Rule 1) ---------------------------------------
    def save(self, i: int, n: int, tier: Tier) -> None:
        x = self.x
        assert x is not None
        if self.snaps is None:
            self.snaps = self.factory(x[0].device)
            if self.owns_snaps:
                # Rule 2: a loop dropped without a backward still gives its host blocks back.
                weakref.finalize(self, self.snaps.close)
            # The first state is compressed once; a store sized by bytes fixes its slots here.
            self.plan.start(self.snaps.calibrate(x, packs=self.first_packs))
            self.first_packs = None
        self.snaps.save(n, tier, x, flush=self.plan.flush(i))

    def prefetch(self, n: int, src: Tier, dst: Tier) -> None:
        if self.snaps is not None:  # nothing to do before the first save
            self.snaps.prefetch(n, src, dst)

    def free(self, n: int, tier: Tier) -> None:
        if self.snaps is not None:
            self.snaps.free(n, tier)

    def restore(self, n: int, tier: Tier) -> None:
        if not self.backward:
            raise CheckpointError(f"torchckpt: {Restore(n, tier)!r} before EndForward: the schedule is invalid.")
        assert self.snaps is not None
        got = self.snaps.restore(n, tier)
        # With a codec the store decompresses into fresh tensors (NOTE [ Snapshot store ] Rule 8):
        # they are ours already; otherwise they are views of a slot or of the stored snapshot.
        self.x = list(got) if self.snaps.codec is not None else [v.clone() for v in got]
        self.snaps.after_use()

    def advance(self, n0: int, n1: int) -> None:
        assert self.x is not None
        self.x = self.steps(self.x, n0, n1)

    def end_forward(self) -> bool:
        return False  # the forward sweep ends here; the backward goes on from the next action

    def end(self) -> None:
        if not self.backward:
            raise CheckpointError("torchckpt: End() before EndForward: the schedule is invalid.")

    def adjoint(self, n: int) -> None:
        """Back-propagate the adjoints through step n (Rule 2)."""
        if not self.backward:
            raise CheckpointError(f"torchckpt: {Adjoint(n)!r} before EndForward: the schedule is invalid.")
        if self.last is not None:
            xin, y = self.last
            self.last = None
        else:
            if self.x is None:
                raise CheckpointError(f"torchckpt: {Adjoint(n)!r} with no current state: the schedule is invalid.")
            xin, y = self.record(self.x)
        params, g, gp = self.wrt, self.g, self.gp
        outs_y = [v for v, gv in zip(y, g) if gv is not None and v.requires_grad]
        gs = [gv for v, gv in zip(y, g) if gv is not None and v.requires_grad]
        wrt = [v for v in xin if v.requires_grad] + [p for p in params if p.requires_grad]
        # Rule 2: each parameter's running sum enters as an output of its own, so autograd adds
        # this step's uses to it one by one, in the order plain autograd would.
        seeds = [(p, s) for p, s in zip(params, gp) if p.requires_grad and s is not None]
        res = (torch.autograd.grad(outs_y + [p for p, _ in seeds], wrt, gs + [s for _, s in seeds],
                                   allow_unused=True) if outs_y or seeds else [None] * len(wrt))
        it = iter(res)
        self.g = [next(it) if v.requires_grad else None for v in xin]
        for k, p in enumerate(params):
            if p.requires_grad:
                d = next(it)
                if d is not None:
                    gp[k] = d
        self.x = None


class _Loop(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: _LoopRun, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        run.x = [t.detach() for t in tensors[: run.n_state]]
        execute_all(iter(run.plan), run)  # up to EndForward (Rule 2)
        x = run.x
        run.state1 = None
        mark = node_mark()
        xin, y = run.record(x)  # Rule 2: record the last step, keep its graph for Adjoint(n-1)
        run.check_exits(xin, y, mark)
        run.last = (xin, y)
        ctx.set_materialize_grads(False)  # an output the loss does not use brings None, as in plain autograd
        ctx.run = run
        return tuple(v.detach() for v in y)

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
        run.g, run.gp, run.x = list(grads), [None] * len(run.wrt), None
        execute_all(iter(run.plan), run)  # the rest of the schedule, to End
        if run.snaps is not None:
            run.stats = run.snaps.stats()
            if run.owns_snaps:
                run.snaps.close()
        return (None, *run.g, *run.gp)


def checkpointed_loop(
    step: Callable[[Any], Any],
    state: Any,
    n_steps: int,
    *,
    schedule: Schedule | Auto | Iterable[Any] = Auto(),
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
    prefetched following ``plan_prefetch`` (NOTE [ Adjoint executor ]).

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
            or ``Auto()`` (the default): Revolve over as many snapshots as ``store``'s budgets
            hold (with a ``Store(codec=...)``, counted at the compressed size of the initial state
            plus ``Auto.margin``: compression buys snapshots, hence less recomputation);
            ``Auto(kind=Uniform)``: a ``Uniform`` schedule sized the same way. (``"auto"`` and the
            classes ``Revolve``/``Uniform`` still mean ``Auto()``/``Auto(kind=...)``, with a
            ``DeprecationWarning``.)
        store: where the snapshots go. A ``SnapshotStore`` is used as it is (its device, slots,
            host pool and codec; ``Auto`` then keeps every snapshot on the host tier behind its
            slots); the loop frees its snapshots and leaves the store open for the next loop. A
            ``Store`` lends its device, GPU budget, host pool and codec to a snapshot store of
            ``slots`` slots made for the loop (``None``: the default store).
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
    given = check_params(params)
    if isinstance(step, nn.Module):
        given = [p for p in step.parameters() if p.requires_grad] + given
    check_store("checkpointed_loop", store, snapshot_store=True)
    check_slots("checkpointed_loop", slots)
    check_flag("checkpointed_loop", "prefetch", prefetch)
    if store is None:
        store = default_store(flat[0].device)
    schedule = _auto_value(schedule)
    first_packs = None  # with a codec, Auto's compression of the initial state, reused by its Save (compressed once)
    if isinstance(schedule, Auto):
        nbytes, first_packs = schedule.estimate(flat, store.codec)
        # A SnapshotStore's GPU memory is all slots: Auto keeps every snapshot on the host tier behind them.
        gpu = store.cache.capacity if isinstance(store, Store) else 0
        schedule = schedule.resolve(n_steps, nbytes, gpu, store.host.capacity_bytes, slots)
    if isinstance(schedule, type):
        raise TypeError(
            f"torchckpt: schedule must be a schedule object (e.g. ZCut(n_steps, ...)), Auto() or Auto(kind=...); "
            f"got {schedule!r}. Only Revolve and Uniform can be sized from the budgets: build other schedules yourself."
        )
    if schedule is None:
        raise TypeError("torchckpt: checkpointed_loop(schedule=None): expected a schedule (e.g. Revolve(n_steps, "
                        "4)) or torchckpt.Auto(); pass schedule=torchckpt.Auto() (the default) to size Revolve from the "
                        "store.")
    sched_n = getattr(schedule, "n_steps", n_steps)
    if not isinstance(schedule, Schedule):
        schedule = check_actions("checkpointed_loop", schedule)
    if sched_n != n_steps:
        raise ValueError(f"torchckpt: the schedule is for {sched_n} steps but n_steps={n_steps}; build it with n_steps.")
    st = store

    def factory(device: torch.device) -> SnapshotStore:
        if isinstance(st, SnapshotStore):
            return st  # the caller's: it keeps it (and closes it)
        return SnapshotStore(st.device, slots=slots, host=st.host, codec=st.codec)

    if not torch.is_grad_enabled():
        with torch.no_grad():  # nothing to differentiate: no snapshots at all
            for _ in range(n_steps):
                state = step(state)
                check_structure(spec, tree_flatten(state)[1])
        return state
    inputs, state1, through_old = probe(step, flat, spec, given)  # NOTE [ Captured tensors ] Rule 1
    if not any(t.requires_grad for t in [*flat, *inputs]):
        state = tree_unflatten(state1, spec)
        with torch.no_grad():  # nothing to differentiate: no snapshots at all
            for _ in range(n_steps - 1):
                state = step(state)
                check_structure(spec, tree_flatten(state)[1])
        return state
    run = _LoopRun(step, spec, len(flat), schedule, factory, slots, prefetch, inputs, descendants(inputs), state1,
                   through_old)
    run.first_packs = first_packs
    run.owns_snaps = not isinstance(store, SnapshotStore)
    out = _Loop.apply(run, *flat, *inputs)
    return tree_unflatten(list(out), spec)
