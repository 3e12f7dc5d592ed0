"""What the planner measured on the device, plan by plan, kept for offline study (pure Python).

A ``Trial`` is one plan run under measurement while planning: a policy NOTE [ Mechanism costs ] measures (by its
name) or a plan verification measured (NOTE [ Applying a plan ] Rules 4-10). Every one is kept with the search's
decisions it was made from, so that a change to the step model can be checked offline against every plan a device
measured, not only against the plans returned (``benchmarks/replay_trials.py``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torchckpt.planner.costs import Decision

__all__ = ["Trial", "trials_from_records", "trials_to_records"]


@dataclasses.dataclass(frozen=True)
class Trial:
    """One plan measured while planning.

    Attributes:
        what: the measured policy's name (NOTE [ Mechanism costs ]), or ``"verification"``.
        decisions: the search's decisions, one per block.
        peak_bytes: the largest peak of its timed steps.
        step_s: the median of its timed steps (of its rounds' medians for a policy measured in rounds).
    """

    what: str
    decisions: tuple[Decision, ...]
    peak_bytes: int
    step_s: float


def trials_to_records(trials: Sequence[Trial]) -> list[dict[str, Any]]:
    """``trials`` as JSON-ready dicts (``trials_from_records`` reads them back).

    Example::

        >>> from torchckpt.planner.costs import KEEP, RECOMPUTE
        >>> rec = trials_to_records([Trial("keep everything", (KEEP, RECOMPUTE), 1 << 30, 0.1)])
        >>> trials_from_records(rec)[0].decisions == (KEEP, RECOMPUTE)
        True
    """
    return [{"what": t.what, "decisions": [dataclasses.asdict(d) for d in t.decisions], "peak_bytes": t.peak_bytes,
             "step_s": t.step_s} for t in trials]


def trials_from_records(records: Sequence[dict[str, Any]]) -> list[Trial]:
    """The trials ``trials_to_records`` wrote (lists back to the tuples ``Decision`` holds)."""
    return [Trial(r["what"], tuple(_decision(d) for d in r["decisions"]), int(r["peak_bytes"]), float(r["step_s"]))
            for r in records]


def _decision(d: dict[str, Any]) -> Decision:
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return Decision(**fields)
