"""What Revolve over the chain of blocks costs (pure Python): the schedule, the inputs it holds, the blocks it runs again.

# NOTE [ Revolve over the chain ]
# 1. A plan may recompute every block and keep only some of their inputs, rebuilding the others in backward
#    from the nearest one kept (``torchckpt.checkpoint_chain``, NOTE [ Chain of blocks ] in recompute/chain.py):
#    worth it where the blocks' inputs alone are a large part of the budget and the host link is busy or
#    absent. ``Decision.revolve`` is the bytes the chain's snapshots may hold; every block of such a plan
#    has the same.
# 2. The schedule (``schedule``): ``Revolve(n, memory // size)`` when every block's input has one size,
#    else ``WeightedRevolve`` over the blocks' measured forward times and input sizes (a rotor-style
#    dynamic program, which is Revolve for equal blocks).
# 3. ``states`` walks the schedule's actions through the executor (NOTE [ Executor ]) as the runtime does (NOTE [ Chain of blocks ] Rules 2-3) and
#    gives, per block: the inputs held during its forward (the forward sweep's snapshots so far and its own
#    input); the snapshots held during its backward besides its own input (which the block's recomputation
#    counts); the forward time of the blocks run again right before its backward (the ``Advance``s between
#    the previous ``Adjoint`` and its own); and the most input bytes held while they run (the snapshots, the
#    current state and the next one).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torchckpt.schedules import Adjoint, Advance, EndForward, Free, Revolve, Save, Schedule, WeightedRevolve
from torchckpt.schedules.execute import Walker, walk

__all__ = ["States", "schedule", "states"]


def schedule(fwd_s: Sequence[float], input_bytes: Sequence[int], memory: int) -> Schedule:
    """The schedule Revolve over blocks of these forward times and input sizes follows with ``memory`` bytes of
    snapshots (NOTE [ Revolve over the chain ] Rule 2).

    Raises:
        ValueError: ``memory`` does not hold block 0's input.
    """
    n = len(input_bytes)
    size = max(input_bytes, default=0)
    if n == 0 or memory < input_bytes[0]:
        raise ValueError(f"torchckpt: Revolve over the chain needs memory for block 0's input ({input_bytes[0] if n else 0} "
                         f"bytes), got {memory}.")
    if min(input_bytes) == size or size == 0:
        return Revolve(n, max(1, min(n, memory // size if size else n)))
    return WeightedRevolve(tuple(fwd_s), tuple(input_bytes), memory)


@dataclasses.dataclass(frozen=True)
class States:
    """NOTE [ Revolve over the chain ] Rule 3's figures, one per block (forward order)."""

    fwd: tuple[int, ...]
    bwd: tuple[int, ...]
    extra_s: tuple[float, ...]
    rebuild: tuple[int, ...]
    advances: int
    memory: int = 0  # the snapshot memory these are for


def states(fwd_s: Sequence[float], input_bytes: Sequence[int], memory: int) -> States:
    """NOTE [ Revolve over the chain ] Rule 3: what ``schedule(fwd_s, input_bytes, memory)`` holds and runs again, per block."""
    n = len(input_bytes)
    w = _Pricing(fwd_s, input_bytes)
    walk(schedule(fwd_s, input_bytes, memory), w)
    fwd, acc = [], 0
    for i in range(n):
        if i in w.saves:
            acc += input_bytes[i]
        fwd.append(acc + (0 if i in w.saves else input_bytes[i]))
    return States(tuple(fwd), tuple(w.bwd), tuple(w.extra), tuple(w.rebuild), w.advances, memory)


class _Pricing(Walker):
    """``states``' driver (NOTE [ Executor ]): the schedule's actions as the runtime runs them
    (NOTE [ Revolve over the chain ] Rule 3)."""

    def __init__(self, fwd_s: Sequence[float], input_bytes: Sequence[int]) -> None:
        n = len(input_bytes)
        self.fwd_s, self.input_bytes = fwd_s, input_bytes
        self.saves: set[int] = set()  # the forward sweep's snapshots
        self.held: set[int] | None = None  # the snapshots held, once the backward began
        self.bwd, self.extra, self.rebuild = [0] * n, [0.0] * n, [0] * n
        self.spent, self.most, self.advances = 0.0, 0, 0

    def end_forward(self, a: EndForward, i: int) -> None:
        self.held = set(self.saves)

    def save(self, a: Save, i: int) -> None:
        (self.saves if self.held is None else self.held).add(a.n)

    def free(self, a: Free, i: int) -> None:
        if self.held is not None:
            self.held.discard(a.n)

    def adjoint(self, a: Adjoint, i: int) -> None:
        held = self.held if self.held is not None else set()
        self.bwd[a.n] = sum(self.input_bytes[k] for k in held if k != a.n)
        self.extra[a.n], self.rebuild[a.n] = self.spent, self.most
        self.spent, self.most = 0.0, 0

    def advance(self, a: Advance, i: int) -> None:
        held = self.held
        if held is None:  # the forward sweep: the model's own calls
            return
        ib, n = self.input_bytes, len(self.input_bytes)
        base = sum(ib[k] for k in held)
        for j in range(a.n0, a.n1):
            self.spent += self.fwd_s[j]
            self.advances += 1
            mine = ib[j] if j not in held else 0
            self.most = max(self.most, base + mine + ib[j + 1] if j + 1 < n else base + mine)
