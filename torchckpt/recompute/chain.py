"""Revolve over a chain of blocks: the blocks' inputs rebuilt in backward from a few snapshots (issue 13).

``Recompute()`` on every block of a chain keeps every block's input on the device until its backward.
``torchckpt.checkpoint_chain`` keeps only the inputs a schedule saves (``Revolve(n, s)``: s of them), on the
device or, for a schedule with ``Tier.HOST``/``Tier.DISK`` snapshots (``Multistage``), in a ``SnapshotStore``,
and rebuilds the others in backward by running the blocks again from the nearest one, as a time-stepping
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
#    Each step reads the schedule through a stream of its own (``Planned``, NOTE [ Planned stream ]: the
#    prefetches and write-back of its off-GPU snapshots planned in). The forward sweep (the actions up to
#    ``EndForward``) runs as the model calls the blocks: at block k's call, when the sweep is at state k,
#    the stream's actions run up to the ``Advance`` the model's next calls are (a ``Save(k)`` of the state,
#    detached; prefetches planned there) or up to ``EndForward`` at the last block. The step keeps the latest
#    block's state as the current state (NOTE [ Schedule actions ] Rule 1), so after the forward it holds the
#    saved states and the last block's. Each call records what running the block again needs: its function,
#    its other arguments (tensors detached, keeping their ``requires_grad``), the CPU RNG state and those of
#    its tensors' devices (unless the policy's ``preserve_rng_state`` is off), the autocast state and device
#    context (``ForwardState``, recompute/forward_state.py, shared with ``Recompute(parts=...)``), the
#    state's shape, dtype and device. Autograd keeps the pack hook alive with every tensor saved under it,
#    so the hook reaches the state through a box emptied when the block returns: nothing else of the
#    forward holds the state.
# 3. Backward: unpacking block i's token runs the stream's actions after ``EndForward`` up to
#    ``Adjoint(i)``: ``Restore`` makes a snapshot current, ``Advance(a, b)`` runs blocks a..b-1 on it as the
#    forward ran them (grad enabled, the state requiring grad as it did, under a saved-tensor hook that keeps
#    nothing, with the recorded RNG and autocast state), ``Save``/``Free`` hold and release snapshots,
#    ``Prefetch`` starts an off-GPU snapshot's copy back ahead of its ``Restore`` (Rule 8);
#    ``Adjoint(i)`` hands the current state to the checkpoint, which recomputes block i from it. An
#    ``Adjoint(j)``, j > i, met on the way (block j's token not unpacked yet: a block whose backward reaches
#    its input late, or never) keeps its state for that token; the step releases it when it is freed.
# 4. Advancing runs the same kernels on the same inputs, so a rebuilt state is the forward's bit for bit when
#    the blocks are deterministic, which every recomputation assumes (``torch.utils.checkpoint``'s too). Its
#    shape, dtype and device are checked against the forward's.
# 5. A step that leaves the chain (a state that is not the previous block's output, a block called out of
#    order or twice, no positional tensor argument) keeps every state from that block on (saved as is, no
#    token) and warns once. A step that broke, or whose backward starts before its last block ran, rebuilds
#    a token's state by advancing from the nearest state it holds (the forward sweep's snapshots, on the
#    device or in the store: none was freed). Gradients are exact either way; only memory and time differ.
# 6. One backward per forward: a state is handed to its block once (to as many of the block's arguments as
#    hold it); a second backward through a retained graph raises.
# 7. A step's records and snapshots hold detached tensors only (no ``grad_fn``), so the step, which the
#    autograd graph holds through its tokens, forms no reference cycle through the graph: it is freed with
#    the graph. A step drops each block's record once that block's state was handed over (no later advance
#    runs it).
# 8. Off-GPU snapshots (``Tier.HOST``, ``Tier.DISK``) live in a ``SnapshotStore`` (NOTE [ Snapshot store ]): the
#    one passed (``store=``), else one the step makes at block 0's call on the state's device (``SLOTS`` slots,
#    the default store's host pool; DISK then held as HOST, NOTE [ Snapshot disk tier ] Rule 1).
#    NOTE [ Snapshot store ] Rule 1 makes every block's state one shape, dtype and device: checked at each call, an
#    error otherwise. Block 0's state calibrates the store, whose slot count plans the stream. ``Save(k, HOST)`` copies
#    the state into a slot (flushed to host behind the computation, or at eviction); a ``Restore``'s views of a slot are
#    copied (then ``after_use``) into a fresh tensor of the saved state's strides, so a handed state stays valid while
#    its block's recomputation and backward hold it. ``Tier.GPU`` snapshots stay detached references. Snapshot k is
#    named ``k`` in a store the step made, ``k`` plus a base of the step's own in one passed (steps alive at once share it).
# 9. A step releases its off-GPU snapshots once its stream passes ``Adjoint(0)`` (only ``Free``s follow): it
#    closes a store it made (``ChainRuntime.snapshot_stats`` reads its counters later) or frees its snapshots in one
#    passed. A step freed before (no backward, a broken or partial step) does so when it is garbage collected
#    (``weakref.finalize`` on the step, whose callback holds the store, never the step: Rule 7).
# 10. Version checks, as autograd's on saved tensors: a state the step holds from the forward (the current state,
#    a ``Tier.GPU`` snapshot of the forward sweep: detached aliases sharing the state's version counter) must be
#    at the version it had when its block was called, whenever backward uses it (hands it to its block, restores
#    it, advances from it); otherwise the chain raises autograd's "modified by an inplace operation" error,
#    where it would compute with the changed bytes (``Recompute()`` on a block raises there too). A snapshot in
#    the store is a copy taken at the call, unaffected. States rebuilt in backward are fresh tensors.
"""
from __future__ import annotations

import dataclasses
import itertools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from torchckpt._errors import CheckpointError, internal_error
from torchckpt.schedules import Adjoint, Advance, End, EndForward, Free, Prefetch, Restore, Revolve, Save, Schedule, Tier
from torchckpt.schedules.execute import Walker, run, walk
from torchckpt.schedules.planned import Planned
from torchckpt.recompute.forward_state import ForwardState
from torchckpt.store.saved import default_store
from torchckpt.store.lend import lend_snapshot_store
from torchckpt.store.snapshots import SnapshotStore
from torchckpt.store.stats import SnapshotStats

__all__ = ["ChainRuntime", "ChainStats", "SLOTS"]

SLOTS = 2  # device slots of the SnapshotStore a step makes (NOTE [ Chain of blocks ] Rule 8): the fewest that overlap copies and compute
_bases = itertools.count(1)  # NOTE [ Chain of blocks ] Rule 8: a step's snapshot names in a store passed


@dataclasses.dataclass
class ChainStats:
    """What a chain did, over all its steps.

    Attributes:
        steps: forward passes through the whole chain (block 0 to block n-1).
        advances: block forwards run again in backward to rebuild states (``Advance``).
        handed: states handed to a block's checkpoint in backward.
        broken: steps that left the chain (NOTE [ Chain of blocks ] Rule 5).
        peak_states / peak_state_bytes: the most states a step held at once on the device (``Tier.GPU``
            snapshots, the current state and those kept for a later token), and their bytes plus the device
            slots of the step's ``SnapshotStore`` (NOTE [ Chain of blocks ] Rule 8; none without off-GPU snapshots).
        host_saves / host_restores: snapshots saved to and restored from an off-GPU tier (the store's).
        peak_host_states / peak_host_bytes: the most off-GPU snapshots a step held at once, and their bytes.
    """

    steps: int = 0
    advances: int = 0
    handed: int = 0
    broken: int = 0
    peak_states: int = 0
    peak_state_bytes: int = 0
    host_saves: int = 0
    host_restores: int = 0
    peak_host_states: int = 0
    peak_host_bytes: int = 0


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.dtype, t.device


def _dense_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """``t``'s strides when it is a dense permutation other than row-major (a restore gives them back), else None."""
    if t.is_contiguous():
        return None
    expected = 1
    for st, size in sorted((st, size) for st, size in zip(t.stride(), t.shape) if size != 1):
        if st != expected:
            return None
        expected *= size
    return tuple(t.stride())


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
    """What running block i again needs (NOTE [ Chain of blocks ] Rule 2)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]  # the state's position holds None
    kwargs: dict[str, Any]
    at: int  # the state's position in args
    grad: bool  # the state required grad
    meta: tuple[Any, ...]
    state: ForwardState  # RNG, autocast and device context of the call


class _Token:
    """What a block's checkpoint holds instead of its state (NOTE [ Chain of blocks ] Rule 2)."""

    __slots__ = ("step", "i", "packs", "__weakref__")

    def __init__(self, step: _Step, i: int) -> None:
        self.step, self.i, self.packs = step, i, 0

    def __repr__(self) -> str:
        return f"<state of chain block {self.i}>"


def _unpack(x: Any) -> torch.Tensor:
    return x.step.unpack(x) if isinstance(x, _Token) else x


class _Snaps:
    """A step's off-GPU snapshots in a ``SnapshotStore`` (NOTE [ Chain of blocks ] Rules 8, 9); it holds no reference to
    the step."""

    def __init__(self, store: SnapshotStore, owns: bool) -> None:
        self.store: SnapshotStore | None = store
        self.owns = owns
        self.base = 0 if owns else next(_bases) << 32
        self.live: dict[int, tuple[Tier, tuple[int, ...] | None]] = {}  # snapshot -> its tier, the state's strides

    def close(self) -> None:
        """NOTE [ Chain of blocks ] Rule 9: close the store made for the step, or free the step's snapshots in the one passed."""
        store, self.store = self.store, None
        if store is None:
            return
        if self.owns:
            store.close()
        else:
            for n, (tier, _) in self.live.items():
                store.free(self.base + n, tier)
        self.live.clear()


class _Step:
    """One forward of the chain and its backward (NOTE [ Chain of blocks ] Rules 2-9)."""

    def __init__(self, chain: ChainRuntime) -> None:
        self.chain = chain
        n = chain.n
        self.records: list[_Record | None] = [None] * n
        self.next = 0  # the block expected next
        self.last: weakref.ReferenceType[torch.Tensor] | None = None
        self.last_version = -1
        self.held: dict[tuple[int, Tier], torch.Tensor] = {}  # Tier.GPU snapshots
        self.current: tuple[int, torch.Tensor] | None = None
        self.early: dict[int, torch.Tensor] = {}
        self.versions: WeakIdKeyDictionary = WeakIdKeyDictionary()  # NOTE [ Chain of blocks ] Rule 10: forward alias -> (block, version)
        self.handing: dict[int, tuple[torch.Tensor, int]] = {}  # state, unpacks left (NOTE [ Chain of blocks ] Rule 6)
        self.handed: set[int] = set()
        self.broken = False
        self.complete = False
        self.plan = Planned(chain.actions, True)  # NOTE [ Chain of blocks ] Rule 2: this step's stream
        self.stream = iter(self.plan)
        self.at = 0  # the state the forward sweep waits at (NOTE [ Chain of blocks ] Rule 2)
        self.meta0: tuple[Any, ...] | None = None  # block 0's state (NOTE [ Chain of blocks ] Rule 8)
        self.snaps: _Snaps | None = None

    def start(self, x: torch.Tensor) -> None:
        """Block 0's state: the step's store calibrated on it, and the stream planned for its slots
        (NOTE [ Chain of blocks ] Rule 8)."""
        self.meta0 = _meta(x)
        chain = self.chain
        if not chain.off_gpu:
            self.plan.start(1)  # no off-GPU snapshot: nothing to prefetch or flush
            return
        store = chain.store
        if store is None:  # NOTE [ Lending a snapshot store ]: the default store's host pool (NOTE [ Chain of blocks ] Rule 8)
            store = lend_snapshot_store(default_store(x.device), x.device, SLOTS)[0]
            chain.last_store = store
        elif store.device != x.device:
            raise CheckpointError(f"torchckpt: checkpoint_chain(store=...) holds snapshots on {store.device}, but block "
                                  f"0's input is on {x.device}; pass a SnapshotStore made on {x.device}.")
        self.snaps = _Snaps(store, chain.store is None)
        weakref.finalize(self, self.snaps.close)  # NOTE [ Chain of blocks ] Rule 9: a step freed before its backward ended
        self.plan.start(store.calibrate([x]))

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
        snaps = self.snaps
        slots = snaps.store.device_bytes() if snaps is not None and snaps.store is not None else 0
        st.peak_state_bytes = max(st.peak_state_bytes, sum(seen.values()) + slots)
        if snaps is not None and self.meta0 is not None:
            nbytes = self.meta0[1].itemsize * torch.Size(self.meta0[0]).numel()
            st.peak_host_states = max(st.peak_host_states, len(snaps.live))
            st.peak_host_bytes = max(st.peak_host_bytes, len(snaps.live) * nbytes)

    def checked(self, x: torch.Tensor) -> torch.Tensor:
        """NOTE [ Chain of blocks ] Rule 10: a state the forward held (not rebuilt) must be unchanged since its block ran."""
        seen = self.versions.get(x)
        if seen is not None and x._version != seen[1]:
            i, v = seen
            raise CheckpointError(
                f"torchckpt: one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: the input of block {i} of checkpoint_chain ({list(x.shape)}, {x.dtype}) is at version "
                f"{x._version}; expected version {v} instead. The chain keeps that input to recompute from it, as "
                "Recompute() keeps each block's input (NOTE [ Chain of blocks ] Rule 10); do not modify a block's "
                "input in place after the block ran, or clone it first.")
        return x

    # -- snapshots (NOTE [ Chain of blocks ] Rule 8) -----------------------------------------------------------
    def _store(self) -> tuple[_Snaps, SnapshotStore]:
        snaps = self.snaps
        if snaps is None or snaps.store is None:
            raise internal_error("chain off-GPU snapshot without its store")
        return snaps, snaps.store

    def save(self, pos: int, n: int, tier: Tier, x: torch.Tensor) -> None:
        if tier is Tier.GPU:
            self.held[(n, tier)] = x
            return
        snaps, store = self._store()
        store.save(snaps.base + n, tier, [x], flush=self.plan.flush(pos))
        snaps.live[n] = (tier, _dense_strides(x))
        self.chain.stats.host_saves += 1

    def restore(self, n: int, tier: Tier) -> torch.Tensor:
        if tier is Tier.GPU:
            return self.checked(self.held[(n, tier)])
        snaps, store = self._store()
        (view,) = store.restore(snaps.base + n, tier)
        if store.codec is not None:
            x = view  # decompressed into a fresh tensor (NOTE [ Snapshot store ] Rule 8)
        else:
            stride = snaps.live[n][1]
            x = (torch.empty_strided(view.shape, stride, dtype=view.dtype, device=view.device).copy_(view)
                 if stride is not None else view.clone())
        store.after_use()
        self.chain.stats.host_restores += 1
        return x

    def free(self, n: int, tier: Tier) -> None:
        if tier is Tier.GPU:
            del self.held[(n, tier)]
            return
        snaps, store = self._store()
        store.free(snaps.base + n, tier)
        del snaps.live[n]

    def sweep(self, i: int) -> None:
        """NOTE [ Chain of blocks ] Rule 2: the forward sweep's actions at block ``i``'s call (its state current)."""
        if not run(self.stream, _Sweep(self, i)):
            raise internal_error("chain schedule ended before EndForward")

    # -- backward (NOTE [ Chain of blocks ] Rules 3, 5, 6) -----------------------------------------------------
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
        self.checked(x)
        self.handed.add(i)
        self.chain.stats.handed += 1
        for j in range(i, len(self.records)):  # NOTE [ Chain of blocks ] Rule 7: no later advance runs block j >= i
            self.records[j] = None
        if tok.packs > 1:
            self.handing[i] = (x, tok.packs - 1)
        self.note_held()
        return x

    def follow(self, i: int) -> torch.Tensor:
        """NOTE [ Chain of blocks ] Rule 3: the stream's actions up to ``Adjoint(i)``."""
        w = _Follow(self, i)
        run(self.stream, w)
        if w.state is None:
            raise internal_error(f"chain schedule ended before Adjoint({i})")
        return w.state

    def rebuild(self, i: int) -> torch.Tensor:
        """NOTE [ Chain of blocks ] Rule 5: advance from the nearest state held."""
        have: dict[int, Tier | None] = {n: t for n, t in self.held}
        if self.snaps is not None:
            have.update((n, t) for n, (t, _) in self.snaps.live.items() if n not in have)
        if self.current is not None:
            have[self.current[0]] = None
        start = max((n for n in have if n <= i), default=None)
        if start is None:
            raise internal_error(f"chain block {i}'s state: no state at or before it is held")
        tier = have[start]
        x = self.restore(start, tier) if tier is not None else self.checked(self.current[1])  # type: ignore[index]
        return x if start == i else self.advance(start, i, x)

    def advance(self, a: int, b: int, x: torch.Tensor) -> torch.Tensor:
        """NOTE [ Chain of blocks ] Rule 3: run blocks a..b-1 on state ``x`` as the forward ran them."""
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


class _Walk(Walker):
    """A step's walk of its stream (NOTE [ Executor ]): ``Save``, ``Free`` and ``Prefetch`` as both sweeps run
    them; any other action is a bug here, unless a sweep reads it."""

    def __init__(self, step: _Step, i: int) -> None:
        self.step, self.i = step, i

    def save(self, a: Save, pos: int) -> None:
        step = self.step
        if step.current is None or step.current[0] != a.n:
            raise internal_error(f"chain Save({a.n}) of another state")
        step.save(pos, a.n, a.tier, step.current[1])
        step.note_held()

    def free(self, a: Free, pos: int) -> None:
        self.step.free(a.n, a.tier)
        self.step.note_held()

    def prefetch(self, a: Prefetch, pos: int) -> None:
        snaps, store = self.step._store()
        store.prefetch(snaps.base + a.n, a.src, a.dst)
        self.step.note_held()

    def _unexpected(self, a: Any, pos: int) -> None:
        raise internal_error(f"chain {type(self).__name__.lstrip('_').lower()} at block {self.i}: {a!r}")

    advance = restore = adjoint = end_forward = end = _unexpected  # type: ignore[assignment]


class _Sweep(_Walk):
    """NOTE [ Chain of blocks ] Rule 2: the forward sweep at block ``i``'s call, up to the ``Advance`` from it (or
    ``EndForward``)."""

    def advance(self, a: Advance, pos: int) -> bool:  # type: ignore[override]
        if a.n0 != self.i:
            raise internal_error(f"chain Advance({a.n0}, {a.n1}) at block {self.i}")
        self.step.at = a.n1
        return False

    def end_forward(self, a: EndForward, pos: int) -> bool:  # type: ignore[override]
        self.step.at = -1
        return False


class _Follow(_Walk):
    """NOTE [ Chain of blocks ] Rule 3: the backward's actions up to ``Adjoint(i)``; ``state`` is then block ``i``'s state."""

    state: torch.Tensor | None = None

    def adjoint(self, a: Adjoint, pos: int) -> bool | None:  # type: ignore[override]
        step, i = self.step, self.i
        if step.current is None or step.current[0] != a.n:
            raise internal_error(f"chain Adjoint({a.n}) without its state current")
        x = step.current[1]
        step.current = None
        if a.n == 0:  # NOTE [ Chain of blocks ] Rule 9: nothing after Adjoint(0) reads a snapshot
            step.held.clear()
            if step.snaps is not None:
                step.snaps.close()
        if a.n == i:
            self.state = x
            return False
        if a.n < i:
            raise internal_error(f"chain block {i}'s state asked for after Adjoint({a.n})")
        step.early[a.n] = x  # NOTE [ Chain of blocks ] Rule 3: for a token unpacked later
        step.handed.discard(a.n)
        step.note_held()
        return None

    def restore(self, a: Restore, pos: int) -> None:  # type: ignore[override]
        self.step.current = (a.n, self.step.restore(a.n, a.tier))
        self.step.note_held()

    def advance(self, a: Advance, pos: int) -> None:  # type: ignore[override]
        step = self.step
        if step.current is None or step.current[0] != a.n0:
            raise internal_error(f"chain Advance({a.n0}, {a.n1}) from another state")
        step.current = (a.n1, step.advance(a.n0, a.n1, step.current[1]))
        step.note_held()

    def end(self, a: End, pos: int) -> None:  # type: ignore[override]
        return None


class _Shape(Walker):
    """What ``ChainRuntime`` checks of a schedule, in one walk (NOTE [ Executor ]): whether its forward sweep (the actions
    before ``EndForward``) only saves and advances, in order from state 0; where it ends; whether it saves block
    0's input; whether any snapshot goes off the GPU."""

    def __init__(self) -> None:
        self.at, self.ok, self.ended, self.saves_first, self.off_gpu = 0, True, False, False, False

    def advance(self, a: Advance, i: int) -> None:
        if not self.ended:
            if a.n0 == self.at and a.n1 > self.at:
                self.at = a.n1
            else:
                self.ok = False

    def save(self, a: Save, i: int) -> None:
        self.off_gpu |= a.tier is not Tier.GPU
        if not self.ended:
            self.ok &= a.n == self.at
            self.saves_first |= a.n == 0

    def _not_forward(self, a: Any, i: int) -> None:
        if not self.ended:
            self.ok = False

    restore = adjoint = prefetch = free = _not_forward  # type: ignore[assignment]

    def end_forward(self, a: EndForward, i: int) -> None:
        self.ended = True


class ChainRuntime:
    """The runtime of ``torchckpt.checkpoint_chain`` (NOTE [ Chain of blocks ]): ``call`` runs block ``i``.

    Args:
        n: the number of blocks.
        snapshots: states the default schedule, ``Revolve(n, snapshots)``, saves (block 0's included).
        schedule: a schedule over ``n`` steps instead; snapshots off the GPU go to a ``SnapshotStore``
            (NOTE [ Chain of blocks ] Rule 8).
        store: the ``SnapshotStore`` for those (``None``: each step makes one).
    """

    def __init__(self, n: int, snapshots: int | None = None, schedule: Schedule | None = None,
                 store: SnapshotStore | None = None) -> None:
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
        if store is not None and not isinstance(store, SnapshotStore):
            raise TypeError(f"torchckpt: checkpoint_chain(store=...) expects a torchckpt.store.SnapshotStore (where "
                            f"off-GPU snapshots go), got {type(store).__name__}; pass e.g. SnapshotStore('cuda', "
                            "slots=2), or no store.")
        self.n = n
        self.schedule = schedule
        self.actions = schedule.pack()
        shape = _Shape()
        walk(self.actions, shape)
        if not (shape.ok and shape.ended and shape.at == n - 1):
            raise ValueError("torchckpt: checkpoint_chain runs the forward sweep as the model calls the blocks: pass a "
                             "schedule whose forward sweep (the actions before EndForward) only saves and advances, from "
                             "block 0 to the last.")
        if n > 1 and not shape.saves_first:
            raise ValueError("torchckpt: checkpoint_chain needs a schedule that saves block 0's input in its forward "
                             "sweep, as Revolve does.")
        self.off_gpu = shape.off_gpu
        if store is not None and not self.off_gpu:
            raise ValueError("torchckpt: checkpoint_chain(store=...) holds snapshots kept off the GPU, and this "
                             "schedule keeps all of them on Tier.GPU; pass a schedule with Tier.HOST snapshots (e.g. "
                             "Multistage(n, gpu_slots=1, host_slots=3) or Revolve(n, s, tier=Tier.HOST)), or no store.")
        self.store = store
        self.last_store: SnapshotStore | None = None  # the latest store a step made (NOTE [ Chain of blocks ] Rule 9)
        self.stats = ChainStats()
        self.step: _Step | None = None
        self.warned = False

    def snapshot_stats(self) -> SnapshotStats | None:
        """The counters of the store passed, else of the latest step's own (``None`` before one was made)."""
        store = self.store if self.store is not None else self.last_store
        return store.stats() if store is not None else None

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
        """Run block ``i``: ``body()`` runs it under its policy; ``fn(*args, **kwargs)`` runs it again
        (NOTE [ Chain of blocks ] Rule 2)."""
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
        if i == 0:
            step.start(state.detach())
        elif self.off_gpu and _meta(state) != step.meta0:
            self.step = None
            raise CheckpointError(
                f"torchckpt: checkpoint_chain keeps snapshots off the GPU in a SnapshotStore, which holds states of one "
                f"shape, dtype and device (NOTE [ Snapshot store ] Rule 1); block {i}'s input has {_meta(state)}, block "
                f"0's {step.meta0}. Pass a schedule with its snapshots on Tier.GPU (e.g. Revolve(n, s), or "
                "WeightedRevolve for blocks of unequal size), or chain only blocks whose inputs match "
                "(NOTE [ Chain of blocks ] Rule 8).")
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        rec = _Record(fn, tuple(None if k == at else tree_map(_detached, a) for k, a in enumerate(args)),
                      tree_map(_detached, kwargs), at, state.requires_grad, _meta(state),
                      ForwardState(tensors, preserve_rng_state))
        step.records[i] = rec
        alias = state.detach()  # shares the state's version counter (NOTE [ Chain of blocks ] Rule 10)
        step.versions[alias] = (i, state._version)
        step.current = (i, alias)
        if i == step.at:
            step.sweep(i)
        step.note_held()
        tok = _Token(step, i)
        box: list[torch.Tensor] = [state]  # NOTE [ Chain of blocks ] Rule 2: every tensor saved under the hooks keeps ``pack`` alive,
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
            if step.at != -1:
                raise internal_error("chain forward sweep did not reach EndForward at the last block")
            step.complete = True
            self.step = None
            self.stats.steps += 1
        return out

    def run_again(self, rec: _Record, x: torch.Tensor) -> torch.Tensor:
        """NOTE [ Chain of blocks ] Rule 3: block ``rec`` on state ``x``, as the forward ran it; its first output, detached."""
        args = list(rec.args)
        args[rec.at] = x.detach().requires_grad_(True) if rec.grad else x.detach()
        with rec.state.replayed(), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep_nothing, _never):
            out = rec.fn(*args, **rec.kwargs)
        self.stats.advances += 1
        first = _first_tensor(out)
        if first is None:
            raise CheckpointError("torchckpt: running a chain block again returned no tensor; checkpoint_chain needs "
                                  "blocks that return their state (NOTE [ Chain of blocks ] Rule 1).")
        return first.detach()

