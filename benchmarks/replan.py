"""Plan offline from a profile that ``benchmarks/frontier.py``, ``zoo.py`` or ``plan_stability.py`` wrote: what the
search predicts, no device needed.

Reads ``profile*.json`` (a measured ``Profile``, the host link, the codec's costs and the policies measured while
planning), runs the search of NOTE [ Plan search ] on them and prints, per budget, the predicted peak and step time
(as a ratio to the predicted no-checkpointing step) and the decisions, with the search's time. Predictions only: a
plan's measured figures come from the device. For working on the search and the step model between device runs.

``--noise S --draws N``: how much the choice rests on the measured policies (NOTE [ Mechanism costs ]): N times, each
measured policy's step time times 1 + a normal draw of standard deviation S (seeded), the chain calibrated on that
and searched again; per budget, the distinct plans chosen, how often, and each one's step predicted by the
calibration on the measurements as they were (on an H100, ConvNeXt-B's 4.9 GiB plans differed between three
processes whose predictions of them differed by 15%).

    python benchmarks/replan.py PROFILE.json [--budgets 1.2,2.3,3.5,5,7,9,12,14] [--lookahead 1] [--explain B]
                                             [--noise 0.03 --draws 8]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from typing import Any

from torchckpt.planner import CodecCost, Link, PlanError, Profile, StepCosts, search
from torchckpt.planner.calibrate import calibrate
from torchckpt.planner.costs import predict
from torchckpt.planner.optimize import simple_policies, size

GiB = 2**30


def summary(decisions: tuple) -> str:
    """The decisions, counted: e.g. ``4 keep, 12 recompute+keep5``."""
    names = Counter(d.mode + (f"{len(d.offload)}" if d.offload else "") + ("c" if d.compress else "")
                    + (f"+keep{len(d.keep)}" if d.keep else "") + ("+host" if d.host else "") for d in decisions)
    return ", ".join(f"{n} {k}" for k, n in names.most_common())


def load(path: str) -> tuple[Profile, StepCosts, StepCosts, dict[str, Any]]:
    """The profile in ``path``, its chain calibrated on what the device measured of the simple policies where the
    file has it (NOTE [ Mechanism costs ]), as the planner had it, the chain before calibration, and those
    measurements by policy name."""
    with open(path) as f:
        d = json.load(f)
    prof = Profile.from_json(json.dumps(d["profile"]))
    codec = CodecCost(**d["codec"]) if d.get("codec") else None
    raw = prof.chain(Link(*d["link"]), codec)
    measured = {k: tuple(v) for k, v in (d.get("measured") or {}).items()}
    chain = calibrate(raw, simple_policies(raw), measured) if measured else raw
    return prof, chain, raw, measured


def noisy(raw: StepCosts, chain: StepCosts, measured: dict[str, Any], budgets: list[float], sigma: float, draws: int,
          lookahead: int) -> None:
    """``--noise``: the plans chosen when the measured policies' times move by ``sigma`` (see the module's doc)."""
    rng = random.Random(0)
    found = []
    for _ in range(draws):
        m = {k: (v[0], v[1] * (1 + rng.gauss(0, sigma))) for k, v in measured.items()}
        found.append(search(calibrate(raw, simple_policies(raw), m), lookahead=lookahead))
    for b in budgets:
        picks: Counter[str] = Counter()
        preds: dict[str, float] = {}
        for f in found:
            try:
                dec, _ = f.best(int(b * GiB))
            except PlanError:
                picks["below the floor"] += 1
                continue
            key = summary(dec) + " | " + " ".join(d.mode[0] + ("h" if d.host else "") + ("r" if d.reentrant else "")
                                                  for d in dec)
            picks[key] += 1
            preds[key] = predict(chain, dec, lookahead).step_s
        print(f"{b:6g} GiB  {len(picks)} distinct plans in {draws} draws at {sigma:g} noise")
        for key, n in picks.most_common():
            at = f"{preds[key] * 1e3:7.1f} ms" if key in preds else ""
            print(f"    {n:3d}x {at}  {key}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile")
    p.add_argument("--budgets", default="1.2,2.3,3.5,5,7,9,12,14", help="GiB")
    p.add_argument("--lookahead", type=int, default=1)
    p.add_argument("--explain", type=float, default=None, help="print every block's decision at this budget (GiB)")
    p.add_argument("--noise", type=float, default=None, help="relative noise on the measured policies' times")
    p.add_argument("--draws", type=int, default=8)
    args = p.parse_args()
    prof, chain, raw, measured = load(args.profile)
    if args.noise is not None:
        if not measured:
            raise SystemExit("replan.py --noise: the profile holds no measured policies to move")
        noisy(raw, chain, measured, [float(v) for v in args.budgets.split(",")], args.noise, args.draws, args.lookahead)
        return
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
