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
#    One backward pass per loop: the schedule's snapshots are consumed by it. A loop run
#    without grad, or dropped without a backward, gives its host blocks back.
# 3. Parameters: tensors the step uses that need gradients must be visible to autograd as
#    inputs of the Function: an ``nn.Module`` step's parameters are found; otherwise pass
#    ``params=``.
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

from torchckpt._errors import CheckpointError
from torchckpt.schedules import (
    Adjoint, Advance, End, EndForward, Free, Multistage, Prefetch, Restore, Revolve, Save, Tier, Uniform, plan_flushes,
    plan_prefetch,
)
from torchckpt.schedules.schedule import Schedule
from torchckpt.codecs.base import Codec
from torchckpt.store import Store
from torchckpt.store.blob import Blob
from torchckpt.store.host_pool import HostPool  # noqa: F401  (run_schedule's docstring example uses it)
from torchckpt.store.lazy_pool import shared_host_pool
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
    snaps = store if isinstance(store, SnapshotStore) else None
    n_adj = getattr(schedule, "n_steps", 0)
    prog = _Progress(progress, n_adj)
    sched = list(schedule)
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
            tensors = save(a.n)
            first = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
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
            tensors = save(a.n)
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
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


def _check_structure(took: Any, returned: Any) -> None:
    if returned != took:
        raise CheckpointError(
            f"torchckpt: step must return a state of the same structure as it takes; took {took}, returned {returned}."
        )


class _LoopRun:
    """What the autograd Function carries from forward to backward."""

    def __init__(self, step: Callable[..., Any], spec: Any, n_state: int, schedule: Iterable[Any],
                 snaps_factory: Callable[[torch.device], SnapshotStore], slots: int, prefetch: bool) -> None:
        self.step, self.spec, self.n_state = step, spec, n_state
        acts, self.flushes = _actions(schedule, slots, prefetch)
        self.actions = iter(enumerate(acts))
        self.factory = snaps_factory
        self.snaps: SnapshotStore | None = None
        self.last: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.stats: SnapshotStats | None = None
        self.done = False

    def call(self, x: list[torch.Tensor]) -> list[torch.Tensor]:
        y = self.step(tree_unflatten(x, self.spec))
        flat, spec = tree_flatten(y)
        _check_structure(self.spec, spec)
        for a, b in zip(x, flat):
            if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
                raise CheckpointError(
                    "torchckpt: step must return a state of the same shapes and dtypes as it takes; took "
                    f"{tuple(a.shape)} {a.dtype}, returned {tuple(getattr(b, 'shape', ()))} {getattr(b, 'dtype', type(b))}."
                )
        return flat

    def save(self, i: int, n: int, tier: Tier, x: list[torch.Tensor]) -> None:
        if self.snaps is None:
            self.snaps = self.factory(x[0].device)
            # Rule 3: a loop dropped without a backward still gives its host blocks back.
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
                for _ in range(a.n0, a.n1):
                    x = run.call(x)
            elif t is Save:
                run.save(i, a.n, a.tier, x)
            elif t is Prefetch or t is Free:
                run.housekeep(a)
            elif t is EndForward:
                break
            else:
                raise CheckpointError(f"torchckpt: {a!r} before EndForward: the schedule is invalid.")
        with torch.enable_grad():  # Rule 2: record the last step, keep its graph for Adjoint(n-1)
            xin = [v.detach().requires_grad_(v.is_floating_point() or v.is_complex()) for v in x]
            y = run.call(xin)
        run.last = (xin, y)
        ctx.set_materialize_grads(False)  # an output the loss does not use brings None, as in plain autograd
        ctx.run = run
        ctx.n_params = len(tensors) - run.n_state
        ctx.params = tensors[run.n_state:]
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
        params = list(ctx.params)
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
                    with torch.enable_grad():
                        xin = [v.detach().requires_grad_(v.is_floating_point() or v.is_complex()) for v in x]
                        y = run.call(xin)
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
                with torch.no_grad():
                    for _ in range(a.n0, a.n1):
                        x = run.call(x)
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
    for deterministic ops) while at most the schedule's snapshots are held; the others are
    recomputed from them. Snapshots off the GPU pass through ``slots`` GPU cache slots and are
    prefetched following ``plan_prefetch`` (NOTE [ Adjoint executor ]).

    Args:
        step: one time step, ``state -> state`` of the same structure (a tensor, tuple or dict of
            tensors). It must be deterministic given its input (no fresh randomness).
        state: the initial state.
        n_steps: number of steps (>= 1).
        schedule: a schedule for ``n_steps`` (``Revolve``, ``ZCut``, ``Uniform``, ``Multistage``)
            or ``"auto"``: Revolve over as many snapshots as ``store``'s budgets hold (with a
            ``Store(codec=...)``, counted at the compressed size of the initial state plus 25%:
            compression buys snapshots, hence less recomputation); the class ``Uniform`` (not an
            instance): a ``Uniform`` schedule sized the same way.
        store: supplies the device, the GPU budget and the host pool (``None``: the default store).
        slots: GPU cache slots in front of host snapshots.
        prefetch: prefetch host snapshots ahead of their restores.
        params: tensors ``step`` uses that need gradients; ``None``: ``step.parameters()`` for an
            ``nn.Module`` step, else none.

    Returns:
        The state after ``n_steps`` steps.

    Example::

        >>> from torchckpt.schedules import Revolve
        >>> w = torch.tensor(0.9, requires_grad=True)
        >>> x0 = torch.ones(3, requires_grad=True)
        >>> y = checkpointed_loop(lambda x: torch.sin(w * x), x0, 50, schedule=Revolve(50, 4),
        ...                       params=[w], store=Store("cpu"))
        >>> y.sum().backward()
        >>> w.grad is not None and x0.grad.shape == (3,)
        True
    """
    if not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"torchckpt: n_steps must be an int >= 1, got {n_steps!r}.")
    flat, spec = tree_flatten(state)
    if not flat or not all(isinstance(t, torch.Tensor) for t in flat):
        raise TypeError("torchckpt: state must be a tensor or a tuple/list/dict of tensors.")
    if params is None:
        params = [p for p in step.parameters() if p.requires_grad] if isinstance(step, nn.Module) else []
    params = list(params)
    if store is None:
        from torchckpt.api import default_store

        store = default_store(flat[0].device)
    if isinstance(schedule, str) or schedule in (Revolve, Uniform):
        if isinstance(schedule, str) and schedule != "auto":
            raise ValueError(f"torchckpt: schedule must be a schedule object, 'auto', Revolve or Uniform, got {schedule!r}.")
        nbytes = _snapshot_bytes(flat, store.codec)
        kind = Uniform if schedule is Uniform else Revolve
        schedule = auto_schedule(n_steps, nbytes, store.cache.budget_bytes, store.host.capacity_bytes, slots, kind=kind)
    if isinstance(schedule, (str, type)):
        raise TypeError(
            f"torchckpt: schedule must be a schedule object (e.g. ZCut(n_steps, ...)), 'auto', Revolve or Uniform; "
            f"got {schedule!r}. Only Revolve and Uniform can be sized from the budgets: build other schedules yourself."
        )
    sched_n = getattr(schedule, "n_steps", n_steps)
    if sched_n != n_steps:
        raise ValueError(f"torchckpt: the schedule is for {sched_n} steps but n_steps={n_steps}; build it with n_steps.")
    st = store

    def factory(device: torch.device) -> SnapshotStore:
        return SnapshotStore(st.device, slots=slots, host=st.host, codec=st.codec)

    if not torch.is_grad_enabled() or not any(t.requires_grad for t in [*flat, *params]):
        with torch.no_grad():  # nothing to differentiate: no snapshots at all
            for _ in range(n_steps):
                state = step(state)
                _check_structure(spec, tree_flatten(state)[1])
        return state
    run = _LoopRun(step, spec, len(flat), schedule, factory, slots, prefetch)
    out = _Loop.apply(run, *flat, *params)
    return tree_unflatten(list(out), spec)
