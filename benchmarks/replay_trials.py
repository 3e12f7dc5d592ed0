"""Diagnosis (not a claim): the step model's prediction of every plan a device measured while planning, offline.

For each ``profile_<model>.json`` in the given run folders (``benchmarks/zoo.py`` or ``plan_stability.py`` wrote them
on the GPU machine): the chain calibrated as the planner had it (``benchmarks/replan.py``'s ``load``), then every
plan measured while planning (``torchckpt.planner.trials``: the policies NOTE [ Mechanism costs ] measures and each
plan verification measured) predicted again and set against what it measured. Profiles written before trials were
kept hold none; for those, verification's plans are found again from what the zoo's JSON kept of verification's
lines (``budget B GiB (family): predicted ... ms; measured ... ms``) as the search's best plan of that family for
that budget, where the search predicts the logged step within 0.15 ms (that is: run with the code of the run's
commit; a changed model finds other plans), and the one-line policies by name.

Per trial: its kind (``keep/recompute``, ``host``: inputs to host, ``offload``, ``parts``, ``revolve``), predicted and
measured step and the error (measured / predicted - 1), its measured peak and that error; then per model, source
(the measured policies, verification) and kind the count, the median of the absolute step errors, how many steps
and how many peaks are within 3%. What the step model gets wrong, by mechanism, over every plan measured,
not only over the plans returned: run it before and after a change to the model.

    python benchmarks/replay_trials.py docs/results/zoo_h100_2026-11-28_d095e8e [more run folders] [--json OUT]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
from typing import Any

from replan import load
from torchckpt.planner import PlanError, search
from torchckpt.planner.calibrate import as_measured
from torchckpt.planner.costs import Decision, predict
from torchckpt.planner.optimize import simple_policies
from torchckpt.planner.trials import Trial, trials_from_records

GiB = 2**30
_SAID = re.compile(r"budget ([\d.]+) GiB \((\w+)\): predicted [\d.]+ \w+, ([\d.]+) ms; measured (\d+(?:\.\d+)?) (\w+), "
                   r"([\d.]+) ms")
_UNITS = {"GiB": GiB, "MiB": 2**20, "KiB": 2**10, "B": 1}
_MATCH_S = 1.5e-4  # a reconstructed plan's prediction within this of the logged one is the plan measured


def kind(decisions: tuple[Decision, ...]) -> str:
    """The mechanisms a plan uses beside keeping and recomputing whole blocks, e.g. ``offload+host``.

    Example::

        >>> from torchckpt.planner.costs import KEEP, RECOMPUTE
        >>> kind((KEEP, RECOMPUTE)), kind((Decision("offload", (0,)), Decision("recompute", host=True)))
        ('keep/recompute', 'offload+host')
    """
    got = [name for name, used in (("offload", any(d.mode == "offload" for d in decisions)),
                                   ("host", any(d.host for d in decisions)),
                                   ("parts", any(d.parts for d in decisions)),
                                   ("revolve", any(d.revolve for d in decisions)),
                                   ("keep ops", any(d.keep for d in decisions))) if used]
    return "+".join(got) if got else "keep/recompute"


def reconstructed(path: str, chain: Any, raw: Any, measured: dict[str, Any]) -> list[Trial]:
    """Trials of a profile written without them: the one-line policies by name, and verification's plans found again
    from the lines the zoo's JSON beside it kept (see the module's doc)."""
    out = []
    forms = as_measured(simple_policies(raw), measured)
    for name, (peak, seconds) in measured.items():
        if peak is not None and name in forms:
            out.append(Trial(name, tuple(forms[name]), int(peak), float(seconds)))
    zoo = os.path.join(os.path.dirname(path), os.path.basename(path).replace("profile_", "zoo_"))
    if not os.path.exists(zoo):
        return out
    with open(zoo) as f:
        said = json.load(f).get("planner", {}).get("verification", [])
    found = search(chain)
    for line in said:
        m = _SAID.search(line)
        if m is None:
            continue
        budget, family, logged, peak, unit, ms = m.groups()
        try:
            decisions, pred = found.best(int(float(budget) * GiB), family)
        except PlanError:
            continue
        if abs(pred.step_s - float(logged) / 1e3) <= _MATCH_S:
            out.append(Trial("verification", decisions, int(float(peak) * _UNITS[unit]), float(ms) / 1e3))
    return out


def replay(path: str) -> list[dict[str, Any]]:
    """Every trial of the profile at ``path``, predicted by its calibrated chain."""
    prof, chain, raw, measured = load(path)
    with open(path) as f:
        records = json.load(f).get("trials")
    trials = trials_from_records(records) if records else reconstructed(path, chain, raw, measured)
    model = os.path.basename(path)[len("profile_"):-len(".json")]
    rows = []
    for t in trials:
        if len(t.decisions) != len(chain.blocks):
            continue
        p = predict(chain, t.decisions)
        rows.append({"run": os.path.basename(os.path.dirname(os.path.abspath(path))), "model": model, "what": t.what,
                     "kind": kind(t.decisions), "pred_step_s": p.step_s, "step_s": t.step_s,
                     "err_pct": (t.step_s / p.step_s - 1) * 100, "pred_peak_GiB": p.peak_bytes / GiB,
                     "peak_GiB": t.peak_bytes / GiB, "peak_err_pct": (t.peak_bytes / p.peak_bytes - 1) * 100,
                     "stored": bool(records)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run folders (profile_<model>.json, zoo_<model>.json beside them)")
    p.add_argument("--json", default=None, help="write every trial's row here")
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    for run in args.runs:
        for path in sorted(glob.glob(os.path.join(run, "profile_*.json"))):
            rows += replay(path)
    for r in rows:
        print(f"{r['run'][:30]:30s} {r['model']:10s} {r['kind']:16s} predicted {r['pred_step_s'] * 1e3:8.1f} ms "
              f"measured {r['step_s'] * 1e3:8.1f} ms {r['err_pct']:+6.1f}%  peak {r['peak_GiB']:6.2f} GiB "
              f"{r['peak_err_pct']:+5.1f}%  {r['what'][:60]}")
    print("\nby model, source and kind (error: measured / predicted - 1; a measured policy predicts what it measured"
          " where the calibration could fit it)")
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        source = "verification" if r["what"] == "verification" else "policies"
        groups.setdefault((r["model"], source, r["kind"]), []).append(r)
    for (model, source, k), got in sorted(groups.items()):
        errs = [r["err_pct"] for r in got]
        peaks = sum(abs(r["peak_err_pct"]) <= 3 for r in got)
        print(f"{model:10s} {source:12s} {k:18s} {len(errs):3d}  median |error| "
              f"{statistics.median(abs(e) for e in errs):5.1f}%  within 3%: {sum(abs(e) <= 3 for e in errs)}/{len(errs)}"
              f"  ({min(errs):+.1f}% .. {max(errs):+.1f}%)  peaks within 3%: {peaks}/{len(got)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
