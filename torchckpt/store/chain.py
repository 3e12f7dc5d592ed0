"""Revolve over a chain of blocks: the blocks' inputs rebuilt in backward from a few snapshots (issue 13).

``Recompute()`` on every block of a chain keeps every block's input on the device until its backward.
``torchckpt.checkpoint_chain`` keeps only the inputs a schedule saves (``Revolve(n, s)``: s of them) and
rebuilds the others in backward by running the blocks again from the nearest one, as a time-stepping
adjoint does (NOTE [ Schedule actions ]): the blocks are the steps, their inputs the states. Griewank and
Walther's Revolve for equal blocks; ``schedules.WeightedRevolve`` (a rotor-style dynamic program) for
blocks of unequal cost and size.

# NOTE [ Chain of blocks ]
# 1. A chain is n modules called in order 0..n-1 once per step; a step starts when block 0 is called with
#    grad enabled. The *state* of block i is its first positional tensor argument; for i > 0 it must be
#    the very tensor block i-1 returned first (the first tensor of its output in pytree order), unchanged
#    since (same version). Each block runs under its ``Recompute`` policy (without a store); the chain's
#    saved-tensor hooks, around it, see what the policy's checkpoint saves of the block's inputs.
# 2. Forward: the state is packed as a *token* naming (step, block); the other tensors pass by reference.
#    The schedule's forward sweep (its actions up to ``EndForward``) says which states it saves: the step
#    keeps those (detached), and the latest block's state as the current state (NOTE [ Schedule actions ]
#    Rule 1), so after the forward it holds the saved states and the last block's. Each call records what
#    running the block again needs: its function, its other arguments (tensors detached, keeping their
#    ``requires_grad``), the CPU RNG state and those of its tensors' devices (unless the policy's
#    ``preserve_rng_state`` is off), the autocast state, the state's shape, dtype and device. Autograd keeps
#    the pack hook alive with every tensor saved under it, so the hook reaches the state through a box
#    emptied when the block returns: nothing else of the forward holds the state.
# 3. Backward: unpacking block i's token runs the schedule's actions after ``EndForward`` up to
#    ``Adjoint(i)``: ``Restore`` makes a snapshot current, ``Advance(a, b)`` runs blocks a..b-1 on it as the
#    forward ran them (grad enabled, the state requiring grad as it did, under a saved-tensor hook that keeps
#    nothing, with the recorded RNG and autocast state), ``Save``/``Free`` hold and release snapshots;
#    ``Adjoint(i)`` hands the current state to the checkpoint, which recomputes block i from it. An
#    ``Adjoint(j)``, j > i, met on the way (block j's token not unpacked yet: a block whose backward reaches
#    its input late, or never) keeps its state for that token; the step releases it when it is freed.
# 4. Advancing runs the same kernels on the same inputs, so a rebuilt state is the forward's bit for bit when
#    the blocks are deterministic, which every recomputation assumes (``torch.utils.checkpoint``'s too). Its
#    shape, dtype and device are checked against the forward's.
# 5. A step that leaves the chain (a state that is not the previous block's output, a block called out of
#    order or twice, no positional tensor argument) keeps every state from that block on (saved as is, no
#    token) and warns once. A step that broke, or whose backward starts before its last block ran, rebuilds
#    a token's state by advancing from the nearest state it holds (the forward sweep's snapshots: none was
#    freed). Gradients are exact either way; only memory and time differ.
# 6. One backward per forward: a state is handed to its block once (to as many of the block's arguments as
#    hold it); a second backward through a retained graph raises.
# 7. A step's records and snapshots hold detached tensors only (no ``grad_fn``), so the step, which the
#    autograd graph holds through its tokens, forms no reference cycle through the graph: it is freed with
#    the graph. A step drops each block's record once that block's state was handed over (no later advance
#    runs it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import get_device_states, set_device_states

from torchckpt._errors import CheckpointError, internal_error
from torchckpt.schedules import Adjoint, Advance, EndForward, Free, Restore, Revolve, Save, Schedule, Tier
from torchckpt.store.parts import _autocast_state, _device_type

__all__ = ["Chain", "ChainStats"]


@dataclasses.dataclass
class ChainStats:
    """What a chain did, over all its steps.

    Attributes:
        steps: forward passes through the whole chain (block 0 to block n-1).
        advances: block forwards run again in backward to rebuild states (``Advance``).
        handed: states handed to a block's checkpoint in backward.
        broken: steps that left the chain (NOTE [ Chain of blocks ] Rule 5).
        peak_states / peak_state_bytes: the most states a step held at once (snapshots, the current state and
            those kept for a later token), and their bytes.
    """

    steps: int = 0
    advances: int = 0
    handed: int = 0
    broken: int = 0
    peak_states: int = 0
    peak_state_bytes: int = 0


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.dtype, t.device


def _detached(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        d = x.detach()
        return d.requires_grad_(True) if x.requires_grad else d
    return x


def _first_tensor(x: Any) -> torch.Tensor | None:
    for leaf in tree_flatten(x)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf
    return None


def _keep_nothing(_: torch.Tensor) -> None:
    return None


def _never(_: Any) -> torch.Tensor:  # pragma: no cover - an advance's graph is never differentiated
    raise internal_error("a chain's advance was differentiated")


@dataclasses.dataclass
class _Record:
    """What running block i again needs (Rule 2)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]  # the state's position holds None
    kwargs: dict[str, Any]
    at: int  # the state's position in args
    grad: bool  # the state required grad
    meta: tuple[Any, ...]
    preserve: bool
    device_type: str
    autocast: tuple[dict[str, Any] | None, dict[str, Any]]
    cpu_state: torch.Tensor | None = None
    devices: list[int] = dataclasses.field(default_factory=list)
    device_states: list[torch.Tensor] = dataclasses.field(default_factory=list)


class _Token:
    """What a block's checkpoint holds instead of its state (Rule 2)."""

    __slots__ = ("step", "i", "packs", "__weakref__")

    def __init__(self, step: _Step, i: int) -> None:
        self.step, self.i, self.packs = step, i, 0

    def __repr__(self) -> str:
        return f"<state of chain block {self.i}>"


def _unpack(x: Any) -> torch.Tensor:
    return x.step.unpack(x) if isinstance(x, _Token) else x


class _Step:
    """One forward of the chain and its backward (Rules 2-7)."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        n = chain.n
        self.records: list[_Record | None] = [None] * n
        self.next = 0  # the block expected next
        self.last: weakref.ReferenceType[torch.Tensor] | None = None
        self.last_version = -1
        self.held: dict[tuple[int, Tier], torch.Tensor] = {}
        self.current: tuple[int, torch.Tensor] | None = None
        self.early: dict[int, torch.Tensor] = {}
        self.handing: dict[int, tuple[torch.Tensor, int]] = {}  # state, unpacks left (Rule 6)
        self.handed: set[int] = set()
        self.broken = False
        self.complete = False
        self.cursor: Iterator[Any] | None = None

    # -- memory ------------------------------------------------------------------------------------------------
    def note_held(self) -> None:
        ts = list(self.held.values()) + list(self.early.values()) + [t for t, _ in self.handing.values()]
        if self.current is not None:
            ts.append(self.current[1])
        seen: dict[int, int] = {}
        for t in ts:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        st = self.chain.stats
        st.peak_states = max(st.peak_states, len(seen))
        st.peak_state_bytes = max(st.peak_state_bytes, sum(seen.values()))

    # -- backward (Rules 3, 5, 6) ------------------------------------------------------------------------------
    def unpack(self, tok: _Token) -> torch.Tensor:
        i = tok.i
        if i in self.handing:
            x, left = self.handing[i]
            if left <= 1:
                del self.handing[i]
            else:
                self.handing[i] = (x, left - 1)
            return x
        if i in self.handed:
            raise CheckpointError(
                f"torchckpt: checkpoint_chain rebuilt block {i}'s input for an earlier backward of this forward and "
                "does not keep it (NOTE [ Chain of blocks ] Rule 6); a second backward through the same forward "
                "(retain_graph=True) is not supported: run the forward again, or checkpoint the blocks with "
                "torchckpt.Recompute() instead of checkpoint_chain.")
        if i in self.early:
            x = self.early.pop(i)
        else:
            x = self.follow(i) if self.complete and not self.broken else self.rebuild(i)
        self.handed.add(i)
        self.chain.stats.handed += 1
        for j in range(i, len(self.records)):  # Rule 7: no later advance runs block j >= i
            self.records[j] = None
        if tok.packs > 1:
            self.handing[i] = (x, tok.packs - 1)
        self.note_held()
        return x

    def follow(self, i: int) -> torch.Tensor:
        """Rule 3: the schedule's actions up to ``Adjoint(i)``."""
        if self.cursor is None:
            self.cursor = iter(self.chain.backward_actions)
        for act in self.cursor:
            if isinstance(act, Adjoint):
                if self.current is None or self.current[0] != act.n:
                    raise internal_error(f"chain Adjoint({act.n}) without its state current")
                x = self.current[1]
                self.current = None
                if act.n == i:
                    return x
                if act.n < i:
                    raise internal_error(f"chain block {i}'s state asked for after Adjoint({act.n})")
                self.early[act.n] = x  # Rule 3: for a token unpacked later
                self.handed.discard(act.n)
            elif isinstance(act, Restore):
                self.current = (act.n, self.held[(act.n, act.tier)])
            elif isinstance(act, Advance):
                if self.current is None or self.current[0] != act.n0:
                    raise internal_error(f"chain Advance({act.n0}, {act.n1}) from another state")
                self.current = (act.n1, self.advance(act.n0, act.n1, self.current[1]))
            elif isinstance(act, Save):
                if self.current is None or self.current[0] != act.n:
                    raise internal_error(f"chain Save({act.n}) of another state")
                self.held[(act.n, act.tier)] = self.current[1]
            elif isinstance(act, Free):
                del self.held[(act.n, act.tier)]
            self.note_held()
        raise internal_error(f"chain schedule ended before Adjoint({i})")

    def rebuild(self, i: int) -> torch.Tensor:
        """Rule 5: advance from the nearest state held."""
        have = {n: t for (n, _), t in self.held.items()}
        if self.current is not None:
            have[self.current[0]] = self.current[1]
        start = max((n for n in have if n <= i), default=None)
        if start is None:
            raise internal_error(f"chain block {i}'s state: no state at or before it is held")
        return have[start] if start == i else self.advance(start, i, have[start])

    def advance(self, a: int, b: int, x: torch.Tensor) -> torch.Tensor:
        """Rule 3: run blocks a..b-1 on state ``x`` as the forward ran them."""
        for j in range(a, b):
            rec = self.records[j]
            if rec is None:
                raise internal_error(f"chain block {j} advanced without its record")
            x = self.chain.run_again(rec, x)
            nxt = self.records[j + 1] if j + 1 < len(self.records) else None
            if nxt is not None and _meta(x) != nxt.meta:
                raise CheckpointError(
                    f"torchckpt: running chain block {j} again returned a state with (shape, dtype, device) "
                    f"{_meta(x)}, where the forward passed {nxt.meta} to block {j + 1}; checkpoint_chain needs blocks "
                    "that compute the same thing when run again (NOTE [ Chain of blocks ] Rule 4).")
        return x


class Chain:
    """The runtime of ``torchckpt.checkpoint_chain`` (NOTE [ Chain of blocks ]): ``call`` runs block ``i``.

    Args:
        n: the number of blocks.
        snapshots: states the default schedule, ``Revolve(n, snapshots)``, saves (block 0's included).
        schedule: a schedule over ``n`` steps with its snapshots on the GPU tier instead.
    """

    def __init__(self, n: int, snapshots: int | None = None, schedule: Schedule | None = None) -> None:
        if schedule is None:
            if snapshots is None:
                raise TypeError("torchckpt: checkpoint_chain needs snapshots=... (how many block inputs to keep, block "
                                "0's included) or schedule=... (a torchckpt.schedules schedule over the blocks).")
            schedule = Revolve(n, min(snapshots, n))
        elif snapshots is not None:
            raise TypeError("torchckpt: checkpoint_chain takes snapshots=... or schedule=..., not both.")
        if not isinstance(schedule, Schedule):
            raise TypeError(f"torchckpt: checkpoint_chain(schedule=...) expects a torchckpt.schedules schedule, got "
                            f"{type(schedule).__name__}; pass e.g. torchckpt.schedules.Revolve(len(blocks), 4).")
        if schedule.n_steps != n:
            raise ValueError(f"torchckpt: checkpoint_chain got {n} blocks and a schedule over {schedule.n_steps} steps; "
                             f"pass a schedule over {n} steps.")
        self.n = n
        self.schedule = schedule
        acts = list(schedule)
        if any(isinstance(a, (Save, Restore, Free)) and a.tier is not Tier.GPU for a in acts):
            raise ValueError("torchckpt: checkpoint_chain keeps its snapshots on the device; pass a schedule whose "
                             "snapshots are on Tier.GPU (e.g. Revolve(n, s), the default tier).")
        end = next((k for k, a in enumerate(acts) if isinstance(a, EndForward)), None)
        if end is None or any(not isinstance(a, (Save, Advance)) for a in acts[:end]):
            raise ValueError("torchckpt: checkpoint_chain runs the forward sweep as the model calls the blocks: pass a "
                             "schedule whose forward sweep (the actions before EndForward) only saves and advances.")
        self.forward_saves = frozenset(a.n for a in acts[:end] if isinstance(a, Save))
        if n > 1 and 0 not in self.forward_saves:
            raise ValueError("torchckpt: checkpoint_chain needs a schedule that saves block 0's input in its forward "
                             "sweep, as Revolve does.")
        self.backward_actions = tuple(acts[end + 1:])
        self.stats = ChainStats()
        self.step: _Step | None = None
        self.warned = False

    def warn(self, i: int, why: str) -> None:
        self.stats.broken += 1
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"torchckpt: checkpoint_chain: at block {i}, {why}; this step keeps every block input from there on "
                "(gradients are exact; only the memory saving is lost). The chain needs blocks called in order, once "
                "a step, each taking the previous block's first output unchanged as its first positional argument "
                "(NOTE [ Chain of blocks ] Rule 5).", RuntimeWarning, stacklevel=4)

    def call(self, i: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             body: Callable[[], Any], preserve_rng_state: bool = True) -> Any:
        """Run block ``i``: ``body()`` runs it under its policy; ``fn(*args, **kwargs)`` runs it again (Rule 2)."""
        if not torch.is_grad_enabled():
            return body()
        if i == 0:
            self.step = _Step(self)
        step = self.step
        if step is None:
            self.warn(i, "a block was called before block 0 started a step")
            return body()
        if step.broken:
            if i == self.n - 1:
                self.step = None
            return body()
        at = next((k for k, a in enumerate(args) if isinstance(a, torch.Tensor)), -1)
        state: torch.Tensor | None = args[at] if at >= 0 else None
        why = None
        if step.next != i:
            why = f"block {i} was called where block {step.next} was expected"
        elif state is None:
            why = "the block has no positional tensor argument"
        elif i > 0 and (step.last is None or step.last() is not state or state._version != step.last_version):
            why = "the block's first tensor argument is not the previous block's first output, unchanged"
        if why is not None:
            step.broken = True
            if i == self.n - 1:
                self.step = None
            self.warn(i, why)
            return body()
        assert state is not None
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        device_type = _device_type(tensors)
        rec = _Record(fn, tuple(None if k == at else tree_map(_detached, a) for k, a in enumerate(args)),
                      tree_map(_detached, kwargs), at, state.requires_grad, _meta(state), preserve_rng_state,
                      device_type, _autocast_state(device_type))
        if preserve_rng_state:
            rec.cpu_state = torch.get_rng_state()
            rec.devices, rec.device_states = get_device_states(*tensors)
        step.records[i] = rec
        if i in self.forward_saves:
            step.held[(i, Tier.GPU)] = state.detach()
        step.current = (i, state.detach())
        step.note_held()
        tok = _Token(step, i)
        box: list[torch.Tensor] = [state]  # Rule 2: every tensor saved under the hooks keeps ``pack`` alive,
        del state  # so ``pack`` reaches the state through ``box``, emptied once the block returns

        def pack(t: torch.Tensor) -> Any:
            if box and t is box[0]:
                tok.packs += 1
                return tok
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            out = body()
        box.clear()
        first = _first_tensor(out)
        step.next = i + 1
        step.last = weakref.ref(first) if first is not None else None
        step.last_version = first._version if first is not None else -1
        if i == self.n - 1:
            step.complete = True
            self.step = None
            self.stats.steps += 1
        return out

    def run_again(self, rec: _Record, x: torch.Tensor) -> torch.Tensor:
        """Rule 3: block ``rec`` on state ``x``, as the forward ran it; its first output, detached."""
        args = list(rec.args)
        args[rec.at] = x.detach().requires_grad_(True) if rec.grad else x.detach()
        devices = rec.devices if rec.preserve else []
        with torch.random.fork_rng(devices=devices, enabled=rec.preserve, device_type=rec.device_type):
            if rec.preserve:
                assert rec.cpu_state is not None
                torch.set_rng_state(rec.cpu_state)
                if rec.devices:
                    set_device_states(rec.devices, rec.device_states, device_type=rec.device_type)
            dev, cpu = rec.autocast
            dev_ctx: Any = torch.amp.autocast(device_type=rec.device_type, **dev) if dev is not None \
                else contextlib.nullcontext()
            with dev_ctx, torch.amp.autocast("cpu", **cpu), torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(_keep_nothing, _never):
                out = rec.fn(*args, **rec.kwargs)
        self.stats.advances += 1
        first = _first_tensor(out)
        if first is None:
            raise CheckpointError("torchckpt: running a chain block again returned no tensor; checkpoint_chain needs "
                                  "blocks that return their state (NOTE [ Chain of blocks ] Rule 1).")
        return first.detach()

