"""Checks of the adjoint entry points' arguments: each raises at the call, naming the argument and what to pass."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from torchckpt.schedules import Action
from torchckpt.schedules.schedule import Schedule, check_int
from torchckpt.store import SnapshotStore, Store


def check_callable(fn: str, name: str, value: object) -> None:
    if not callable(value):
        raise TypeError(f"torchckpt: {fn}({name}=...) expects a callable, found {type(value).__name__} {value!r}; "
                        f"pass a function (see help({fn})).")


def check_slots(fn: str, slots: object) -> None:
    check_int(f"{fn}(slots=...)", slots, 1,
              "pass the number of GPU cache slots in front of host snapshots, e.g. slots=4 (2 or more overlap copies)")


def check_store(fn: str, store: object, snapshot_store: bool) -> None:
    """``store=`` is None, a ``Store`` instance or (``snapshot_store``) a ``SnapshotStore`` instance."""
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


def check_actions(fn: str, schedule: object) -> Schedule | list[Any]:
    """A ``Schedule`` as it is, or the actions of another iterable as a list, each checked to be an action."""
    if schedule is None or isinstance(schedule, (str, bytes, type, torch.Tensor)) or not isinstance(schedule, Iterable):
        raise TypeError(
            f"torchckpt: {fn}(schedule=...) expects a schedule from torchckpt.schedules (e.g. Revolve(n_steps, 4)) "
            f"or a list of its actions, found {schedule!r}; build one, e.g. schedule=Revolve(n_steps, 4)."
        )
    if isinstance(schedule, Schedule):
        return schedule
    acts = list(schedule)
    for i, a in enumerate(acts):
        if not isinstance(a, Action):
            raise TypeError(f"torchckpt: unknown schedule action {a!r} at position {i} of {fn}(schedule=...); a "
                            "schedule holds actions of torchckpt.schedules (Save, Advance, Restore, Adjoint, ...).")
    return acts


def check_params(params: object) -> list[torch.Tensor]:
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
