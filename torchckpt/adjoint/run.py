"""Adjoint loops under a checkpoint schedule: ``checkpointed_loop`` (autograd) and ``run_schedule`` (explicit).

# NOTE [ Adjoint executor ]
# One schedule (torchckpt.schedules) drives two executors here, with the semantics of
# NOTE [ Schedule actions ]; snapshots go through a ``SnapshotStore`` (NOTE [ Snapshot store ])
# and, unless ``prefetch=False``, the schedule is first passed through ``plan_prefetch`` so
# that every off-GPU restore has its copy started ahead of time (GPUZIP's Prefetch Setup).
# 1. ``run_schedule`` calls the user's callbacks for compute (forward, backward) and for
#    moving the state in and out of snapshots (save returns the state's tensors, restore
#    receives read-only views of a snapshot and copies them into the user's buffers).
# 2. ``checkpointed_loop`` is an autograd Function. Its forward executes the schedule up to
#    ``EndForward`` without recording, then evaluates the last step with recording and keeps
#    that graph for ``Adjoint(n_steps - 1)`` (Rule 4 of NOTE [ Schedule actions ]). Its
#    backward executes the rest: each ``Adjoint(n)`` re-evaluates step n with recording from
#    the current state and back-propagates the incoming adjoint through it. Gradients with
#    respect to the initial state and to the parameters are those of the unrolled loop, bit
#    for bit for deterministic ops: a parameter's running sum is passed to each step's
#    ``autograd.grad`` as the gradient of the parameter itself, so every use adds to it in
#    the order plain autograd's accumulation would.
#    Steps that are not recorded (the forward sweep, the advances between restores) still run
#    as plain autograd runs them: under grad, with the state requiring grad, and their graph
#    dropped at once. Kernels that choose by grad mode would otherwise compute other values:
#    the eval-mode fast paths of ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention``,
#    attention backends that differ by whether inputs require grad. The price: autograd's
#    bookkeeping on those steps, and one step's saved tensors alive until the step returns.
#    One backward pass per loop: the schedule's snapshots are consumed by it. A loop run
#    without grad, or dropped without a backward, gives its host blocks back.
# 3. Captured tensors: every tensor from outside the loop that a step reads differentiably is
#    an input of the Function (NOTE [ Captured tensors ], torchckpt/adjoint/captures.py): found by a
#    probe of step 0, whose output is state 1, where the forward sweep starts.
# 4. Bad arguments (``store``, ``schedule``, ``params``, ``slots``, the callbacks) raise at the
#    call, naming the argument and what to pass (``_check_store`` and its neighbours).
"""
from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchckpt._args import check_flag
from torchckpt._errors import CheckpointError
from torchckpt.adjoint.captures import (
    Age, Swap, check_structure, descendants, exits, flat_state, grad_leaf, node_mark, owned_nodes, probe, unfound,
)
from torchckpt.schedules import (
    Action, Adjoint, Advance, End, EndForward, Free, Multistage, Prefetch, Restore, Revolve, Save, Tier, Uniform,
    plan_flushes,
    plan_prefetch,
)
from torchckpt.schedules.schedule import Schedule, check_int
from torchckpt.codecs.base import Codec
from torchckpt.store import Store
from torchckpt.codecs.blob import Blob
from torchckpt.memory import HostPool, shared_host_pool  # noqa: F401  (HostPool: run_schedule docstring example)
from torchckpt.store.snapshots import SnapshotStats, SnapshotStore

__all__ = ["checkpointed_loop", "run_schedule", "auto_schedule"]


def auto_schedule(n_steps: int, snapshot_bytes: int, gpu_bytes: int, host_bytes: int, slots: int = 4,
                  kind: type[Revolve] | type[Uniform] = Revolve) -> Schedule:
    """The schedule ``schedule="auto"`` picks: Revolve over as many snapshots as the budgets hold.

    GPU snapshots get what the GPU budget holds beyond ``slots`` cache slots; host snapshots
    what the host budget holds. With room for every step on the GPU nothing is recomputed.
    ``kind=Uniform`` sizes a ``Uniform`` schedule instead (``checkpointed_loop(schedule=Uniform)``):
    as many snapshots as the tier with more room holds (GPUZIP: Uniform gains from more snapshots).

    Args:
        n_steps: loop length.
        snapshot_bytes: bytes of one state.
        gpu_bytes: GPU memory the snapshots may use (cache slots included).
        host_bytes: host memory the snapshots may use.
        slots: GPU cache slots in front of the host tier.
        kind: ``Revolve`` (default) or ``Uniform``.

    Returns:
        ``Revolve`` (one tier), ``Multistage`` (GPU and host) or, with ``kind=Uniform``, ``Uniform``.
    """
    if snapshot_bytes <= 0:
        raise ValueError(f"torchckpt: snapshot_bytes must be > 0, got {snapshot_bytes}.")
    if kind not in (Revolve, Uniform):
        raise TypeError(f"torchckpt: auto_schedule(kind=...) takes Revolve or Uniform, got {kind!r}.")
    gpu = max(0, gpu_bytes // snapshot_bytes - slots)
    host = host_bytes // snapshot_bytes
    if kind is Uniform:
        if gpu == 0 and host == 0:
            raise CheckpointError(
                f"torchckpt: no room for even one snapshot of {snapshot_bytes} bytes (GPU budget {gpu_bytes}, "
                f"host budget {host_bytes}); give the Store a larger gpu_bytes or HostPool capacity."
            )
        tier = Tier.GPU if gpu >= min(host, n_steps) else Tier.HOST
        return Uniform(n_steps, min(n_steps, gpu if tier is Tier.GPU else host), tier=tier)
    if gpu >= n_steps:
        return Revolve(n_steps, n_steps, tier=Tier.GPU)
    if host == 0:
        if gpu == 0:
            raise CheckpointError(
                f"torchckpt: no room for even one snapshot of {snapshot_bytes} bytes (GPU budget {gpu_bytes}, "
                f"host budget {host_bytes}); give the Store a larger gpu_bytes or HostPool capacity."
            )
        return Revolve(n_steps, gpu, tier=Tier.GPU)
    return Multistage(n_steps, gpu_slots=gpu, host_slots=min(host, n_steps - gpu))


class _Progress:
    def __init__(self, enabled: bool, n: int) -> None:
        self.enabled, self.n, self.done, self.t0, self.next = enabled, n, 0, time.perf_counter(), 0.1

    def adjoint(self) -> None:
        self.done += 1
        if self.enabled and self.done >= self.next * self.n:
            self.next += 0.1
            dt = time.perf_counter() - self.t0
            print(f"torchckpt: adjoint {self.done}/{self.n} steps, {dt:.1f} s", file=sys.stderr, flush=True)


def _actions(schedule: Iterable[Any], slots: int, prefetch: bool) -> tuple[list[Any], frozenset[int]]:
    """The actions to execute (with prefetches) and the Saves that flush (NOTE [ Write-back ])."""
    acts = list(plan_prefetch(schedule, slots)) if prefetch else list(schedule)
    return acts, plan_flushes(acts, slots)


# -- arguments (NOTE [ Adjoint executor ] Rule 4) -----------------------------------------------
def _check_callable(fn: str, name: str, value: object) -> None:
    if not callable(value):
        raise TypeError(f"torchckpt: {fn}({name}=...) expects a callable, found {type(value).__name__} {value!r}; "
                        f"pass a function (see help({fn})).")


def _check_slots(fn: str, slots: object) -> None:
    check_int(f"{fn}(slots=...)", slots, 1,
              "pass the number of GPU cache slots in front of host snapshots, e.g. slots=4 (2 or more overlap copies)")


def _check_store(fn: str, store: object, snapshot_store: bool) -> None:
    """``store=`` is None, a ``Store`` instance or (for ``run_schedule``) a ``SnapshotStore`` instance."""
    if store is None or isinstance(store, Store) or (snapshot_store and isinstance(store, SnapshotStore)):
        return
    takes = "a torchckpt.Store, a SnapshotStore" if snapshot_store else "a torchckpt.Store"
    if isinstance(store, type) and issubclass(store, (Store, SnapshotStore)):
        found = f"the class {store.__name__}"
        fix = f"pass an instance, e.g. store={store.__name__}('cuda', ...) ('cpu' to simulate)"
    elif isinstance(store, SnapshotStore):
        found = "a SnapshotStore"
        fix = ("pass store=Store(device, gpu_bytes=..., host=...): the loop makes its snapshot store from its device, "
               "budget, host pool and codec; a SnapshotStore of your own goes to run_schedule(store=...)")
    elif isinstance(store, (str, torch.device)):
        found = f"the device {str(store)!r}"
        fix = f"pass store=torchckpt.Store({str(store)!r}), or None for the default store"
    else:
        found = f"{type(store).__name__} {store!r}"
        fix = "pass store=torchckpt.Store(...), or None for the default store"
    raise TypeError(f"torchckpt: {fn}(store=...) expects {takes} or None, found {found}; {fix}.")


def _check_actions(fn: str, schedule: object) -> list[Any]:
    """The actions of a schedule given as an iterable of actions (a ``Schedule`` or a list)."""
    if schedule is None or isinstance(schedule, (str, bytes, type, torch.Tensor)) or not isinstance(schedule, Iterable):
        raise TypeError(
            f"torchckpt: {fn}(schedule=...) expects a schedule from torchckpt.schedules (e.g. Revolve(n_steps, 4)) "
            f"or a list of its actions, found {schedule!r}; build one, e.g. schedule=Revolve(n_steps, 4)."
        )
    acts = list(schedule)
    if not isinstance(schedule, Schedule):
        for i, a in enumerate(acts):
            if not isinstance(a, Action):
                raise TypeError(f"torchckpt: unknown schedule action {a!r} at position {i} of {fn}(schedule=...); a "
                                "schedule holds actions of torchckpt.schedules (Save, Advance, Restore, Adjoint, ...).")
    return acts


def _check_params(params: object) -> list[torch.Tensor]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        raise TypeError("torchckpt: checkpointed_loop(params=...) expects a list of tensors, found a tensor; pass a "
                        "list, e.g. params=[w] (tensors the step reads are found without params=: see its docstring).")
    if isinstance(params, nn.Module):
        raise TypeError("torchckpt: checkpointed_loop(params=...) expects a list of tensors, found an nn.Module; pass "
                        "params=list(module.parameters()), or nothing: the tensors the step reads are found.")
    if not isinstance(params, Iterable) or isinstance(params, (str, bytes, dict)):
        raise TypeError(f"torchckpt: checkpointed_loop(params=...) expects a list of tensors, found "
                        f"{type(params).__name__} {params!r}; pass a list, e.g. params=[w].")
    out = list(params)
    for i, p in enumerate(out):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"torchckpt: checkpointed_loop(params=...) expects tensors, found {type(p).__name__} "
                            f"{p!r} at index {i}; pass a list of tensors, e.g. params=[w].")
    return out


def _saved(tensors: object, n: int) -> list[torch.Tensor]:
    """What ``run_schedule``'s ``save(n)`` returned, as a list of tensors."""
    out = [tensors] if isinstance(tensors, torch.Tensor) else (
        list(tensors) if isinstance(tensors, (list, tuple)) else None)
    if not out or not all(isinstance(t, torch.Tensor) for t in out):
        raise TypeError(f"torchckpt: run_schedule's save({n}) must return a tensor or a list/tuple of tensors, found "
                        f"{type(tensors).__name__}; return the tensors of the current state, e.g. (u, u_prev).")
    return out  # type: ignore[return-value]


def run_schedule(
    schedule: Iterable[Any],
    *,
    forward: Callable[[int, int], None],
    save: Callable[[int], torch.Tensor | Sequence[torch.Tensor]],
    restore: Callable[[int, list[torch.Tensor]], None],
    backward: Callable[[int], None],
    store: Store | SnapshotStore | None = None,
    slots: int = 4,
    prefetch: bool = True,
    end_forward: Callable[[], None] | None = None,
    progress: bool = False,
) -> SnapshotStats:
    """Drive a hand-written adjoint (e.g. reverse time migration) through a checkpoint schedule.

    torchckpt does the saving, caching, prefetching and restoring of snapshots; the callbacks
    do the compute.

    Args:
        schedule: a schedule from ``torchckpt.schedules`` (or any iterable of its actions).
        forward: ``forward(n0, n1)`` advances the current state from step n0 to n1.
        save: ``save(n)`` returns the tensors of the current state (step n); torchckpt copies them.
        restore: ``restore(n, tensors)`` copies snapshot n into the current state; ``tensors`` are
            read-only views, valid until the callback returns.
        backward: ``backward(n)`` takes the adjoint step n (the current state is state n).
        store: a ``SnapshotStore``, or a ``Store`` whose device and host pool to use; ``None``: the
            device of the first saved tensor and a new host pool.
        slots: GPU cache slots in front of host memory (a ``SnapshotStore`` given uses its own).
        prefetch: plan prefetches with ``plan_prefetch`` (``False``: restores load on demand).
        end_forward: called once the forward sweep is done.
        progress: print adjoint progress to stderr every 10%.

    Returns:
        The snapshot store's statistics.

    Example::

        >>> from torchckpt.schedules import Revolve, Tier
        >>> x, log = [torch.tensor([1.0])], []
        >>> stats = run_schedule(
        ...     Revolve(4, 2, tier=Tier.HOST),
        ...     forward=lambda n0, n1: x.__setitem__(0, x[0] * 2 ** (n1 - n0)),
        ...     save=lambda n: x[0],
        ...     restore=lambda n, t: x.__setitem__(0, t[0].clone()),
        ...     backward=lambda n: log.append((n, x[0].item())),
        ...     store=SnapshotStore("cpu", slots=2, host=HostPool(chunk_bytes=1 << 20, pin=False)))
        >>> log  # adjoint step n sees state n = 2**n
        [(3, 8.0), (2, 4.0), (1, 2.0), (0, 1.0)]
    """
    for name, fn in (("forward", forward), ("save", save), ("restore", restore), ("backward", backward)):
        _check_callable("run_schedule", name, fn)
    if end_forward is not None:
        _check_callable("run_schedule", "end_forward", end_forward)
    _check_store("run_schedule", store, snapshot_store=True)
    _check_slots("run_schedule", slots)
    check_flag("run_schedule", "prefetch", prefetch)
    check_flag("run_schedule", "progress", progress)
    sched = _check_actions("run_schedule", schedule)
    snaps = store if isinstance(store, SnapshotStore) else None
    n_adj = getattr(schedule, "n_steps", 0)
    prog = _Progress(progress, n_adj)
    # Only Advance (and End markers) can come before the first Save: nothing is cached before
    # it, so planning from there is planning the whole schedule. The first Save fixes the
    # snapshot store's slots (a store sized by gpu_bytes, or holding a codec, calibrates on it).
    i0 = next((i for i, a in enumerate(sched) if type(a) is Save), len(sched))
    first: list[torch.Tensor] | None = None
    acts: list[Any] = sched[: i0 + 1]
    flushes: frozenset[int] = frozenset()
    i = 0
    while i < len(acts):
        a = acts[i]
        t = type(a)
        if i == i0 and first is None:
            first = _saved(save(a.n), a.n)
            if snaps is None:
                snaps = _new_snapshot_store(store if isinstance(store, Store) else None, first[0].device, slots)
            slots = snaps.calibrate(first)  # the plan must match the slots the store has
            planned, flushes = _actions(sched[i0:], slots, prefetch)
            flushes = frozenset(f + i0 for f in flushes)
            acts = acts[:i0] + planned
            snaps.save(a.n, a.tier, first, flush=i in flushes)
            i += 1
            continue
        if t is Advance:
            forward(a.n0, a.n1)
        elif t is Save:
            tensors = _saved(save(a.n), a.n)
            assert snaps is not None
            snaps.save(a.n, a.tier, tensors, flush=i in flushes)
        elif t is Restore:
            if snaps is None:
                raise CheckpointError(f"torchckpt: {a!r} before any Save: the schedule is invalid (check it with simulate()).")
            restore(a.n, snaps.restore(a.n, a.tier))
            snaps.after_use()
        elif t is Adjoint:
            backward(a.n)
            prog.adjoint()
        elif t is Prefetch:
            if snaps is not None:
                snaps.prefetch(a.n, a.src, a.dst)
        elif t is Free:
            if snaps is not None:
                snaps.free(a.n, a.tier)
        elif t is EndForward:
            if end_forward is not None:
                end_forward()
        elif t is End:
            break
        else:
            raise TypeError(f"torchckpt: unknown schedule action {a!r}.")
        i += 1
    if snaps is None:
        return SnapshotStats()
    st = snaps.stats()
    if not isinstance(store, SnapshotStore):
        snaps.close()
    return st


def _new_snapshot_store(store: Store | None, device: torch.device, slots: int) -> SnapshotStore:
    host = store.host if isinstance(store, Store) else shared_host_pool(pin=device.type == "cuda", device=device)
    dev = store.device if isinstance(store, Store) else device
    codec = store.codec if isinstance(store, Store) else None
    return SnapshotStore(dev, slots=slots, host=host, codec=codec)


def _snapshot_bytes(flat: list[torch.Tensor], codec: Codec | None, margin: float = 0.25) -> int:
    """Bytes one snapshot of ``flat`` takes: as it is, or compressed by ``codec`` (with a margin).

    With a codec the estimate comes from compressing the initial state once: a variable-rate
    codec's later states may compress worse (NOTE [ Snapshot store ] Rule 9), hence the margin.
    """
    if codec is None:
        return sum(t.numel() * t.element_size() for t in flat)
    with torch.no_grad():
        packs = [codec.compress(t.detach()) for t in flat]
    return int(Blob(packs).nbytes * (1.0 + margin))


class _LoopRun:
    """What the autograd Function carries from forward to backward."""

    def __init__(self, step: Callable[..., Any], spec: Any, n_state: int, schedule: Iterable[Any],
                 snaps_factory: Callable[[torch.device], SnapshotStore], slots: int, prefetch: bool,
                 inputs: list[torch.Tensor], swapped: list[torch.Tensor], state1: list[torch.Tensor] | None,
                 through_old: bool) -> None:
        self.step, self.spec, self.n_state = step, spec, n_state
        acts, self.flushes = _actions(schedule, slots, prefetch)
        self.actions = iter(enumerate(acts))
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

    def call(self, x: list[torch.Tensor]) -> list[torch.Tensor]:
        return flat_state(self.spec, x, self.step(tree_unflatten(x, self.spec)))

    def advance(self, x: list[torch.Tensor], n0: int, n1: int) -> list[torch.Tensor]:
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

    def save(self, i: int, n: int, tier: Tier, x: list[torch.Tensor]) -> None:
        if self.snaps is None:
            self.snaps = self.factory(x[0].device)
            # Rule 2: a loop dropped without a backward still gives its host blocks back.
            weakref.finalize(self, self.snaps.close)
        self.snaps.save(n, tier, x, flush=i in self.flushes)

    def housekeep(self, a: Any) -> None:
        """Execute a ``Prefetch`` or ``Free`` (nothing to do before the first save)."""
        if self.snaps is None:
            return
        if type(a) is Prefetch:
            self.snaps.prefetch(a.n, a.src, a.dst)
        else:
            self.snaps.free(a.n, a.tier)

    def restore(self, n: int, tier: Tier) -> list[torch.Tensor]:
        assert self.snaps is not None
        got = self.snaps.restore(n, tier)
        # With a codec the store decompresses into fresh tensors (NOTE [ Snapshot store ] Rule 8):
        # they are ours already; otherwise they are views of a slot or of the stored snapshot.
        x = list(got) if self.snaps.codec is not None else [v.clone() for v in got]
        self.snaps.after_use()
        return x


class _Loop(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: _LoopRun, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        x = [t.detach() for t in tensors[: run.n_state]]
        for i, a in run.actions:
            t = type(a)
            if t is Advance:
                x = run.advance(x, a.n0, a.n1)
            elif t is Save:
                run.save(i, a.n, a.tier, x)
            elif t is Prefetch or t is Free:
                run.housekeep(a)
            elif t is EndForward:
                break
            else:
                raise CheckpointError(f"torchckpt: {a!r} before EndForward: the schedule is invalid.")
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
        params = run.wrt
        g: list[torch.Tensor | None] = list(grads)
        gp: list[torch.Tensor | None] = [None] * len(params)
        x: list[torch.Tensor] | None = None
        for i, a in run.actions:
            t = type(a)
            if t is Adjoint:
                if run.last is not None:
                    xin, y = run.last
                    run.last = None
                else:
                    if x is None:
                        raise CheckpointError(f"torchckpt: {a!r} with no current state: the schedule is invalid.")
                    xin, y = run.record(x)
                outs_y = [v for v, gv in zip(y, g) if gv is not None and v.requires_grad]
                gs = [gv for v, gv in zip(y, g) if gv is not None and v.requires_grad]
                wrt = [v for v in xin if v.requires_grad] + [p for p in params if p.requires_grad]
                # Rule 2: each parameter's running sum enters as an output of its own, so autograd adds
                # this step's uses to it one by one, in the order plain autograd would.
                seeds = [(p, s) for p, s in zip(params, gp) if p.requires_grad and s is not None]
                res = (torch.autograd.grad(outs_y + [p for p, _ in seeds], wrt, gs + [s for _, s in seeds],
                                           allow_unused=True) if outs_y or seeds else [None] * len(wrt))
                it = iter(res)
                g = [next(it) if v.requires_grad else None for v in xin]
                for i, p in enumerate(params):
                    if p.requires_grad:
                        d = next(it)
                        if d is not None:
                            gp[i] = d
                x = None
            elif t is Restore:
                x = run.restore(a.n, a.tier)
            elif t is Advance:
                assert x is not None
                x = run.advance(x, a.n0, a.n1)
            elif t is Save:
                assert x is not None
                run.save(i, a.n, a.tier, x)
            elif t is Prefetch or t is Free:
                run.housekeep(a)
            elif t is End:
                break
        if run.snaps is not None:
            run.stats = run.snaps.stats()
            run.snaps.close()
        return (None, *g, *gp)


def checkpointed_loop(
    step: Callable[[Any], Any],
    state: Any,
    n_steps: int,
    *,
    schedule: Schedule | Iterable[Any] | str | type[Revolve] | type[Uniform] = "auto",
    store: Store | None = None,
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
            or ``"auto"``: Revolve over as many snapshots as ``store``'s budgets hold (with a
            ``Store(codec=...)``, counted at the compressed size of the initial state plus 25%:
            compression buys snapshots, hence less recomputation); the class ``Uniform`` (not an
            instance): a ``Uniform`` schedule sized the same way.
        store: a ``Store``: supplies the device, the GPU budget, the host pool and the codec
            (``None``: the default store).
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
    _check_callable("checkpointed_loop", "step", step)
    if not isinstance(n_steps, int) or isinstance(n_steps, bool) or n_steps < 1:
        raise ValueError(f"torchckpt: n_steps must be an int >= 1, got {n_steps!r}.")
    flat, spec = tree_flatten(state)
    if not flat or not all(isinstance(t, torch.Tensor) for t in flat):
        raise TypeError("torchckpt: state must be a tensor or a tuple/list/dict of tensors.")
    given = _check_params(params)
    if isinstance(step, nn.Module):
        given = [p for p in step.parameters() if p.requires_grad] + given
    _check_store("checkpointed_loop", store, snapshot_store=False)
    _check_slots("checkpointed_loop", slots)
    check_flag("checkpointed_loop", "prefetch", prefetch)
    if store is None:
        from torchckpt.api import default_store

        store = default_store(flat[0].device)
    if isinstance(schedule, str) or schedule in (Revolve, Uniform):
        if isinstance(schedule, str) and schedule != "auto":
            raise ValueError(f"torchckpt: schedule must be a schedule object, 'auto', Revolve or Uniform, got {schedule!r}.")
        nbytes = _snapshot_bytes(flat, store.codec)
        kind = Uniform if schedule is Uniform else Revolve
        schedule = auto_schedule(n_steps, nbytes, store.cache.capacity, store.host.capacity_bytes, slots, kind=kind)
    if isinstance(schedule, type):
        raise TypeError(
            f"torchckpt: schedule must be a schedule object (e.g. ZCut(n_steps, ...)), 'auto', Revolve or Uniform; "
            f"got {schedule!r}. Only Revolve and Uniform can be sized from the budgets: build other schedules yourself."
        )
    if schedule is None:
        raise TypeError("torchckpt: checkpointed_loop(schedule=None): expected a schedule (e.g. Revolve(n_steps, "
                        "4)), 'auto', Revolve or Uniform; pass schedule='auto' (the default) to size Revolve from the "
                        "store.")
    sched_n = getattr(schedule, "n_steps", n_steps)
    if not isinstance(schedule, Schedule):
        schedule = _check_actions("checkpointed_loop", schedule)
    if sched_n != n_steps:
        raise ValueError(f"torchckpt: the schedule is for {sched_n} steps but n_steps={n_steps}; build it with n_steps.")
    st = store

    def factory(device: torch.device) -> SnapshotStore:
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
    out = _Loop.apply(run, *flat, *inputs)
    return tree_unflatten(list(out), spec)
