"""Plan offline from a profile that ``benchmarks/frontier.py`` wrote: what the search predicts, no device needed.

Reads ``profile*.json`` (a measured ``Profile``, the host link and the codec's costs), runs the search of
NOTE [ Plan search ] on them and prints, per budget, the predicted peak and step time (as a ratio to the
predicted no-checkpointing step) and the decisions, with the search's time. Predictions only: a plan's
measured figures come from ``frontier.py`` on the device. For working on the search and the step model
between device runs.

    python benchmarks/replan.py PROFILE.json [--budgets 1.2,2.3,3.5,5,7,9,12,14] [--lookahead 1] [--explain B]
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from torchckpt.planner import CodecCost, Link, PlanError, Profile, StepCosts, search
from torchckpt.planner.calibrate import calibrate
from torchckpt.planner.optimize import simple_policies, size

GiB = 2**30


def summary(decisions: tuple) -> str:
    """The decisions, counted: e.g. ``4 keep, 12 recompute+keep5``."""
    names = Counter(d.mode + (f"{len(d.offload)}" if d.offload else "") + ("c" if d.compress else "")
                    + (f"+keep{len(d.keep)}" if d.keep else "") + ("+host" if d.host else "") for d in decisions)
    return ", ".join(f"{n} {k}" for k, n in names.most_common())


def load(path: str) -> tuple[Profile, StepCosts]:
    """The profile in ``path`` and its chain, calibrated on what the device measured of the simple policies where the
    file has it (NOTE [ Mechanism costs ]; ``zoo.py`` writes it), as the planner had it."""
    with open(path) as f:
        d = json.load(f)
    prof = Profile.from_json(json.dumps(d["profile"]))
    codec = CodecCost(**d["codec"]) if d.get("codec") else None
    chain = prof.chain(Link(*d["link"]), codec)
    if d.get("measured"):
        chain = calibrate(chain, simple_policies(chain), {k: tuple(v) for k, v in d["measured"].items()})
    return prof, chain


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile")
    p.add_argument("--budgets", default="1.2,2.3,3.5,5,7,9,12,14", help="GiB")
    p.add_argument("--lookahead", type=int, default=1)
    p.add_argument("--explain", type=float, default=None, help="print every block's decision at this budget (GiB)")
    args = p.parse_args()
    prof, chain = load(args.profile)
    t0 = time.perf_counter()
    found = search(chain, lookahead=args.lookahead)
    took = time.perf_counter() - t0
    none = found.plans[0][1]
    print(f"{len(chain.blocks)} blocks, {len(found.plans)} plans searched in {took:.2f} s; floor "
          f"{size(found.floor)}; no checkpointing predicted {size(none.peak_bytes)}, "
          f"{none.step_s * 1e3:.1f} ms (measured {prof.step_s * 1e3:.1f} ms)")
    for b in (float(v) for v in args.budgets.split(",")):
        try:
            dec, pred = found.best(int(b * GiB))
        except PlanError:
            print(f"{b:6g} GiB  below the floor")
            continue
        print(f"{b:6g} GiB  peak {size(pred.peak_bytes):>10}  step {pred.step_s * 1e3:6.1f} ms "
              f"{pred.step_s / none.step_s:5.3f}x  stall {pred.stall_s * 1e3:5.1f} ms  "
              f"to host {pred.d2h_bytes / GiB:5.2f} GiB  {summary(dec)}")
        if args.explain is not None and abs(b - args.explain) < 1e-9:
            for blk, dd in zip(chain.blocks, dec):
                print(f"    {blk.name:<24} {dd}")


if __name__ == "__main__":
    main()
