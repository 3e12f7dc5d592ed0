"""A zoo run the GPU machine recorded, read back for the CPU tests that replay it (docs/results/<run>)."""
from __future__ import annotations

import json
import os

from torchckpt.planner import CodecCost, Link, Profile
from torchckpt.planner.costs import StepCosts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def recorded_run(run: str, model: str) -> tuple[StepCosts, dict[str, tuple[int | None, float]]]:
    """The chain of ``docs/results/<run>/profile_<model>.json`` before calibration, and the policies its planner
    measured on the device (by name: largest peak, seconds)."""
    with open(os.path.join(ROOT, "docs", "results", run, f"profile_{model}.json")) as f:
        d = json.load(f)
    prof = Profile.from_json(json.dumps(d["profile"]))
    bare = prof.chain(Link(*d["link"]), CodecCost(**d["codec"]) if d.get("codec") else None)
    return bare, {k: tuple(v) for k, v in d["measured"].items()}
