"""What Revolve over the chain of blocks costs (pure Python): the schedule, the inputs it holds, the blocks it runs again.

# NOTE [ Revolve over the chain ]
# 1. A plan may recompute every block and keep only some of their inputs, rebuilding the others in backward
#    from the nearest one kept (``torchckpt.checkpoint_chain``, NOTE [ Chain of blocks ] in store/chain.py):
#    worth it where the blocks' inputs alone are a large part of the budget and the host link is busy or
#    absent. ``Decision.revolve`` is the bytes the chain's snapshots may hold; every block of such a plan
#    has the same.
# 2. The schedule (``schedule``): ``Revolve(n, memory // size)`` when every block's input has one size,
#    else ``WeightedRevolve`` over the blocks' measured forward times and input sizes (a rotor-style
#    dynamic program, which is Revolve for equal blocks).
# 3. ``states`` walks the schedule's actions as the runtime does (NOTE [ Chain of blocks ] Rules 2-3) and
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

__all__ = ["States", "schedule", "states"]


def schedule(fwd_s: Sequence[float], input_bytes: Sequence[int], memory: int) -> Schedule:
    """The schedule Revolve over blocks of these forward times and input sizes follows with ``memory`` bytes of
    snapshots (Rule 2).

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
    """Rule 3's figures, one per block (forward order)."""

    fwd: tuple[int, ...]
    bwd: tuple[int, ...]
    extra_s: tuple[float, ...]
    rebuild: tuple[int, ...]
    advances: int


def states(fwd_s: Sequence[float], input_bytes: Sequence[int], memory: int) -> States:
    """Rule 3: what ``schedule(fwd_s, input_bytes, memory)`` holds and runs again, per block."""
    n = len(input_bytes)
    acts = list(schedule(fwd_s, input_bytes, memory))
    end = next(k for k, a in enumerate(acts) if isinstance(a, EndForward))
    saves = {a.n for a in acts[:end] if isinstance(a, Save)}
    fwd, acc = [], 0
    for i in range(n):
        if i in saves:
            acc += input_bytes[i]
        fwd.append(acc + (0 if i in saves else input_bytes[i]))
    held = set(saves)
    bwd, extra, rebuild = [0] * n, [0.0] * n, [0] * n
    spent, most, advances = 0.0, 0, 0
    for a in acts[end + 1:]:
        if isinstance(a, Adjoint):
            bwd[a.n] = sum(input_bytes[k] for k in held if k != a.n)
            extra[a.n], rebuild[a.n] = spent, most
            spent, most = 0.0, 0
        elif isinstance(a, Save):
            held.add(a.n)
        elif isinstance(a, Free):
            held.discard(a.n)
        elif isinstance(a, Advance):
            base = sum(input_bytes[k] for k in held)
            for j in range(a.n0, a.n1):
                spent += fwd_s[j]
                advances += 1
                mine = input_bytes[j] if j not in held else 0
                most = max(most, base + mine + input_bytes[j + 1] if j + 1 < n else base + mine)
    return States(tuple(fwd), tuple(bwd), tuple(extra), tuple(rebuild), advances)
