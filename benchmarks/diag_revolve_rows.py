"""Diagnosis (not a claim; no device): the zoo's plans that use Revolve over the chain, predicted again from their
runs' recorded profiles with NOTE [ Mechanism costs ] Rule 11 as it is and as it was (the rebuilds' fraction from the
floor's Revolve plan alone), against each row's measured step (issue 24: ViT-L's plan at 1.03x the floor).

For each ``zoo_<model>.json`` beside a ``profile_<model>.json`` under the given folders: every plan row whose decisions
use Revolve; its plan is found offline among the search's best of each family at the row's budget (and the simple
policy the row names) as the one whose prediction under the old rule matches the row's recorded prediction within
0.2%; printed with its snapshot memory, both predictions and their errors against the row's step, and verification's
step. Then, per profile, the measured Revolve policies and what each rule predicts for them.

    python benchmarks/diag_revolve_rows.py docs/results/zoo_h100_2026-11-27*
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(1, os.path.dirname(HERE))

from replan import load  # noqa: E402
from torchckpt.planner import PlanError, search  # noqa: E402
from torchckpt.planner.costs import predict  # noqa: E402
from torchckpt.planner.optimize import FAMILIES, simple_policies  # noqa: E402

GiB = 2**30


def rows_of(folder: str) -> list[str]:
    """The lines of one run folder: its Revolve rows, then its measured Revolve policies."""
    out: list[str] = []
    for name in sorted(os.listdir(folder)):
        if not (name.startswith("zoo_") and name.endswith(".json")) or "summary" in name:
            continue
        with open(os.path.join(folder, name)) as f:
            zoo = json.load(f)
        prof_path = os.path.join(folder, f"profile_{zoo['model']}.json")
        if not os.path.exists(prof_path):
            continue
        _, now, raw, measured = load(prof_path)
        was = dataclasses.replace(now, revolve_scale_at=None)  # the rule's first form
        found = search(was)
        policies = dict(simple_policies(raw))
        tag = f"{os.path.basename(folder.rstrip('/'))} {zoo['model']}"
        for r in zoo["rows"]:
            if r.get("method") != "plan" or "revolve" not in str(r.get("decisions", "")) or "pred_step_s" not in r:
                continue
            cands = []
            for fam in FAMILIES:
                try:
                    cands.append(found.best(int(r["budget_GiB"] * GiB), family=fam)[0])
                except PlanError:
                    pass
            if r.get("simple") in policies:
                cands.append(policies[r["simple"]])
            hit = next((d for d in cands if abs(predict(was, d).step_s / r["pred_step_s"] - 1) < 2e-3), None)
            row = r["step_s"]
            if hit is None:
                out.append(f"{tag} {r['budget_GiB']:.2f} GiB: no plan matches the recorded prediction")
                continue
            before, after = predict(was, hit).step_s, predict(now, hit).step_s
            ver = r.get("verified_step_s")
            out.append(f"{tag} {r['budget_GiB']:.2f} GiB, {hit[0].revolve / GiB:.2f} GiB of snapshots: before "
                       f"{before * 1e3:.1f} ms ({100 * (before / row - 1):+.1f}%), after {after * 1e3:.1f} ms "
                       f"({100 * (after / row - 1):+.1f}%); row {row * 1e3:.1f} ms, verification "
                       + ("-" if ver is None else f"{ver * 1e3:.1f} ms"))
        for n, (_, sec) in measured.items():
            if n in policies and policies[n] and policies[n][0].revolve:
                out.append(f"{tag} measured {n}: {sec * 1e3:.1f} ms; before {predict(was, policies[n]).step_s * 1e3:.1f}"
                           f", after {predict(now, policies[n]).step_s * 1e3:.1f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", help="zoo run folders (zoo_<model>.json beside profile_<model>.json)")
    args = p.parse_args()
    for folder in args.folders:
        if os.path.isdir(folder):
            for line in rows_of(folder):
                print(line)


if __name__ == "__main__":
    main()
