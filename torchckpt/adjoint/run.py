"""``run_schedule``: a hand-written adjoint (e.g. reverse time migration) driven by a checkpoint schedule.

The user's callbacks compute (forward, backward) and move the state in and out of snapshots
(``save`` returns the state's tensors; ``restore_into`` returns the state's tensors for a restore to
write the snapshot into, NOTE [ Snapshot store ] Rule 11, or ``restore`` receives read-only views of a
snapshot and copies them into the user's buffers); the executor (NOTE [ Executor ], schedules/execute.py)
runs the schedule.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from torchckpt._args import check_flag
from torchckpt._errors import CheckpointError
from torchckpt.adjoint.args import check_actions, check_callable, check_slots, check_store
from torchckpt.memory import HostPool  # noqa: F401  (run_schedule's example)
from torchckpt.schedules import Adjoint, Advance, End, EndForward, Free, Prefetch, Restore, Save, Tier
from torchckpt.schedules.execute import run
from torchckpt.schedules.planned import Planned
from torchckpt.store import SnapshotStats, SnapshotStore, Store
from torchckpt.store.lend import lend_snapshot_store

__all__ = ["run_schedule"]


def _saved(tensors: object, n: int, what: str = "save") -> list[torch.Tensor]:
    """What ``run_schedule``'s ``save(n)`` (or ``restore_into(n)``) returned, as a list of tensors."""
    out = [tensors] if isinstance(tensors, torch.Tensor) else (
        list(tensors) if isinstance(tensors, (list, tuple)) else None)
    if not out or not all(isinstance(t, torch.Tensor) for t in out):
        raise TypeError(f"torchckpt: run_schedule's {what}({n}) must return a tensor or a list/tuple of tensors, found "
                        f"{type(tensors).__name__}; return the tensors of the current state, e.g. (u, u_prev).")
    return out  # type: ignore[return-value]


class Progress:
    """Adjoint progress on stderr every 10% (``progress=True``)."""

    def __init__(self, enabled: bool, n: int) -> None:
        self.enabled, self.n, self.done, self.t0, self.next = enabled, n, 0, time.perf_counter(), 0.1

    def adjoint(self) -> None:
        self.done += 1
        if self.enabled and self.done >= self.next * self.n:
            self.next += 0.1
            dt = time.perf_counter() - self.t0
            print(f"torchckpt: adjoint {self.done}/{self.n} steps, {dt:.1f} s", file=sys.stderr, flush=True)


class _Callbacks:
    """``run_schedule``'s driver: each action calls the user's callbacks (NOTE [ Executor ] Rule 1)."""

    def __init__(self, forward: Callable[[int, int], None], save: Callable[[int], Any],
                 restore: Callable[[int, list[torch.Tensor]], None] | None, backward: Callable[[int], None],
                 end_forward: Callable[[], None] | None, store: Store | SnapshotStore | None, slots: int,
                 plan: Planned, progress: Progress, restore_into: Callable[[int], Any] | None = None) -> None:
        self.forward, self.save_fn, self.restore_fn, self.backward = forward, save, restore, backward
        self.into_fn = restore_into
        self.end_forward_fn = end_forward
        self.store, self.slots, self.plan, self.progress = store, slots, plan, progress
        self.snaps: SnapshotStore | None = store if isinstance(store, SnapshotStore) else None
        self.started = False

    def advance(self, a: Advance, i: int) -> None:
        self.forward(a.n0, a.n1)

    def save(self, a: Save, i: int) -> None:
        n, tier = a.n, a.tier
        tensors = _saved(self.save_fn(n), n)
        if not self.started:  # the first Save fixes the slots (NOTE [ Planned stream ] Rule 1)
            self.started = True
            if self.snaps is None:  # NOTE [ Lending a snapshot store ]
                self.snaps = lend_snapshot_store(self.store, tensors[0].device, self.slots)[0]
            self.plan.start(self.snaps.calibrate(tensors))  # the plan must match the slots the store has
        assert self.snaps is not None
        self.snaps.save(n, tier, tensors, flush=self.plan.flush(i))

    def restore(self, a: Restore, i: int) -> None:
        n, tier = a.n, a.tier
        if self.snaps is None:
            raise CheckpointError(f"torchckpt: {Restore(n, tier)!r} before any Save: the schedule is invalid (check it "
                                  "with simulate()).")
        if self.into_fn is not None:  # NOTE [ Snapshot store ] Rule 11: written straight into the user's state
            dst = _saved(self.into_fn(n), n, "restore_into")
            self.snaps.restore(n, tier, out=dst)
            if self.restore_fn is not None:
                self.restore_fn(n, dst)
            return
        assert self.restore_fn is not None
        self.restore_fn(n, self.snaps.restore(n, tier))
        self.snaps.after_use()

    def adjoint(self, a: Adjoint, i: int) -> None:
        self.backward(a.n)
        self.progress.adjoint()

    def prefetch(self, a: Prefetch, i: int) -> None:
        if self.snaps is not None:
            self.snaps.prefetch(a.n, a.src, a.dst)

    def free(self, a: Free, i: int) -> None:
        if self.snaps is not None:
            self.snaps.free(a.n, a.tier)

    def end_forward(self, a: EndForward, i: int) -> bool:
        if self.end_forward_fn is not None:
            self.end_forward_fn()
        return True

    def end(self, a: End, i: int) -> None:
        return None


def run_schedule(
    schedule: Iterable[Any],
    *,
    forward: Callable[[int, int], None],
    save: Callable[[int], torch.Tensor | Sequence[torch.Tensor]],
    restore: Callable[[int, list[torch.Tensor]], None] | None = None,
    backward: Callable[[int], None],
    store: Store | SnapshotStore | None = None,
    slots: int = 4,
    prefetch: bool = True,
    end_forward: Callable[[], None] | None = None,
    progress: bool = False,
    restore_into: Callable[[int], torch.Tensor | Sequence[torch.Tensor]] | None = None,
) -> SnapshotStats:
    """Drive a hand-written adjoint (e.g. reverse time migration) through a checkpoint schedule.

    torchckpt does the saving, caching, prefetching and restoring of snapshots; the callbacks
    do the compute.

    Args:
        schedule: a schedule from ``torchckpt.schedules`` (or any iterable of its actions).
        forward: ``forward(n0, n1)`` advances the current state from step n0 to n1.
        save: ``save(n)`` returns the tensors of the current state (step n); torchckpt copies them.
        restore: ``restore(n, tensors)`` copies snapshot n into the current state; ``tensors`` are
            read-only views, valid until the callback returns. With ``restore_into`` it is optional
            and gets the state's tensors once the snapshot is in them.
        backward: ``backward(n)`` takes the adjoint step n (the current state is state n).
        store: a ``SnapshotStore``, or a ``Store`` whose device and host pool to use; ``None``: the
            device of the first saved tensor and a new host pool.
        slots: GPU cache slots in front of host memory (a ``SnapshotStore`` given uses its own).
        prefetch: plan prefetches with ``plan_prefetch`` (``False``: restores load on demand).
        end_forward: called once the forward sweep is done.
        progress: print adjoint progress to stderr every 10%.
        restore_into: ``restore_into(n)`` returns the current state's tensors (as ``save`` does) for
            the restore of snapshot n to overwrite: the store writes the snapshot straight into them
            (a codec decodes there), saving the device copy ``restore`` makes (NOTE [ Snapshot
            store ] Rule 11). They must match the snapshot's shapes and dtypes, be contiguous, not
            require grad and hold nothing still needed; e.g. ``restore_into=lambda n: (u, u_prev)``.

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

        With ``restore_into`` a restore writes into the state itself, with no copy after it:

        >>> u, log = torch.zeros(1), []
        >>> stats = run_schedule(
        ...     Revolve(4, 2, tier=Tier.HOST),
        ...     forward=lambda n0, n1: u.add_(n1 - n0), save=lambda n: u, restore_into=lambda n: u,
        ...     backward=lambda n: log.append(u.item()),
        ...     store=SnapshotStore("cpu", slots=2, host=HostPool(chunk_bytes=1 << 20, pin=False)))
        >>> log
        [3.0, 2.0, 1.0, 0.0]
    """
    if restore is None and restore_into is None:
        raise TypeError("torchckpt: run_schedule needs restore=... (copies a snapshot into the state) or restore_into=... "
                        "(returns the state's tensors, which a restore writes the snapshot into); pass one of them.")
    for name, fn in (("forward", forward), ("save", save), ("backward", backward), ("restore", restore),
                     ("restore_into", restore_into), ("end_forward", end_forward)):
        if fn is not None or name in ("forward", "save", "backward"):
            check_callable("run_schedule", name, fn)
    check_store("run_schedule", store, snapshot_store=True)
    check_slots("run_schedule", slots)
    check_flag("run_schedule", "prefetch", prefetch)
    check_flag("run_schedule", "progress", progress)
    plan = Planned.of(check_actions("run_schedule", schedule), prefetch)
    d = _Callbacks(forward, save, restore, backward, end_forward, store, slots, plan,
                   Progress(progress, getattr(schedule, "n_steps", 0)), restore_into)
    try:
        run(iter(plan), d)
        return d.snaps.stats() if d.snaps is not None else SnapshotStats()
    finally:  # a store made here is closed here, also when a callback raises (not when the traceback is dropped)
        if d.snaps is not None and not isinstance(store, SnapshotStore):
            d.snaps.close()
