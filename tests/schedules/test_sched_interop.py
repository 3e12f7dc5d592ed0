"""Cross-check with firedrake's checkpoint_schedules (test-only dependency, version 1.0.4).

Its convention differs from ours (NOTE [ Schedule actions ]): its forward runs to step n and
the forward step of each adjoint step is a ``Forward(i, i+1, write_adj_deps=True)``, so its
forward steps = our advances + n. The converter below maps its actions to ours.
"""
from __future__ import annotations

import pytest

from torchckpt.schedules import (
    Action,
    Adjoint,
    Advance,
    End,
    EndForward,
    Free,
    Multistage,
    Restore,
    Revolve,
    Save,
    Tier,
    simulate,
)

cs = pytest.importorskip("checkpoint_schedules")


def _tier(storage) -> Tier:
    return {cs.StorageType.RAM: Tier.GPU, cs.StorageType.DISK: Tier.HOST}[storage]


def convert(schedule) -> tuple[list[Action], int]:
    """checkpoint_schedules actions -> ours; also returns its own forward step count."""
    out: list[Action] = []
    theirs = 0
    cur: int | None = 0
    for act in schedule:
        if isinstance(act, cs.Forward):
            theirs += act.n1 - act.n0
            if act.write_ics:
                out.append(Save(act.n0, _tier(act.storage)))
            if act.write_adj_deps:
                # The recorded step belongs to the adjoint step that follows (ours: Adjoint).
                if act.n1 - act.n0 != 1:
                    raise NotImplementedError(f"multi-step adjoint dependencies: {act!r}")
                if act.n0 != cur:
                    raise NotImplementedError(f"recorded step away from the current state: {act!r}")
            else:
                out.append(Advance(act.n0, act.n1))
                cur = act.n1
        elif isinstance(act, cs.Reverse):
            if act.n1 - act.n0 != 1:
                raise NotImplementedError(f"multi-step reverse: {act!r}")
            out.append(Adjoint(act.n0))
            cur = None
        elif isinstance(act, (cs.Copy, cs.Move)):
            if act.to_storage != cs.StorageType.WORK:
                raise NotImplementedError(f"copy between storages: {act!r}")
            out.append(Restore(act.n, _tier(act.from_storage)))
            if isinstance(act, cs.Move):
                out.append(Free(act.n, _tier(act.from_storage)))
            cur = act.n
        elif isinstance(act, cs.EndForward):
            out.append(EndForward())
        elif isinstance(act, cs.EndReverse):
            out.append(End())
            break
        else:
            raise NotImplementedError(repr(act))
    return out, theirs


CASES = [(n, s) for n in (2, 3, 5, 10, 17, 40, 100) for s in (1, 2, 3, 5, 8) if s < n]


@pytest.mark.parametrize(("n", "s"), CASES)
def test_revolve_forward_counts_match(n: int, s: int) -> None:
    actions, theirs = convert(cs.Revolve(n, s))
    sim = simulate(actions, n_steps=n, capacity={Tier.GPU: s})  # their stream is valid for us
    ours = simulate(Revolve(n, s)).forward_steps
    assert sim.forward_steps == ours == theirs - n
    assert sim.peak_snapshots[Tier.GPU] <= s


@pytest.mark.parametrize(("n", "s"), [(10, 3), (40, 5), (100, 8)])
def test_multistage_forward_counts_match(n: int, s: int) -> None:
    actions, theirs = convert(cs.MultistageCheckpointSchedule(n, s, 0))
    assert simulate(actions, n_steps=n).forward_steps == theirs - n
    assert simulate(Multistage(n, s, 0)).forward_steps == theirs - n


def test_same_sequence_as_revolve_10_3() -> None:
    actions, _ = convert(cs.Revolve(10, 3))
    # Their Revolve frees by Move at the last use; so do we: identical streams.
    assert actions == list(Revolve(10, 3))
