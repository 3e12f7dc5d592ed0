"""The step model's predicted peaks against the zoo's measured ones, offline, and what each prediction is made of.

For every ``zoo_<model>.json`` in the directories given with its ``profile_<model>.json`` (``zoo.py`` writes both),
the profile is planned again (``replan.load``: calibrated on what the device measured of the simple policies) and
every plan the zoo measured is predicted again: each plan row's (rebuilt from its words; the last column says whether
the search's plan for its budget is still that one, which verification may have replaced: NOTE [ Applying a plan ]
Rules 4-7) and each eager method that is one of the search's simple policies (the row names the method). Printed per
plan: the measured peak (the zoo's and verification's), the prediction (the zoo's and today's), today's error, where
the peak is (``forward i`` / ``backward i``) and its terms there (NOTE [ Step model ] Rule 3):

  base    what no decision changes: ``fixed_bytes`` + ``other_saved_bytes`` (forward) or the backward's own at
          that block (``StepCosts.bwd_fixed``; NOTE [ Step model ] Rules 4, 6)
  kept    saved tensors of kept blocks (and offloaded blocks' bytes left on the device) held there
  inputs  inputs (and kept ops' outputs) of recomputed blocks held there
  own     the block's own bytes in its backward: a kept block's saved tensors, a recomputed block's frame
          (``materialised_bytes``)
  calib   the measured terms added to the frame (NOTE [ Mechanism costs ] Rules 3-5: ``rec_bytes``,
          ``keep_rec_bytes``, ``host_rec_bytes``) and Revolve's states and ``revolve_bytes`` (Rules 8, 10)
  work    the block's backward working memory (``Block.bwd_bytes``)
  once    storages several blocks reference, counted once (NOTE [ Shared storages ]; profiles that record them)
  rest    the prediction less the above (offloaded bytes on the device, the store's GPU cache)

Each model's calibrated terms are printed above its rows (GiB).

    python benchmarks/peak_check.py [DIR ...]   (default: docs/results/zoo_h100_run6)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from common import fmt, print_table
from replan import load
from torchckpt.planner.costs import Decision, Prediction, StepCosts, chain_states, materialised_bytes, predict, terms
from torchckpt.planner.optimize import Search, ladder, search
from torchckpt.planner.shared import corrections

GiB = 2**30
DIRS = ("docs/results/zoo_h100_run6",)


def words(plan: Sequence[Decision]) -> list[str]:
    """One word per block, as ``common.block_decisions`` writes a ``Plan``'s."""
    return [d.mode + (f"{len(d.offload)}" if d.offload else "") + ("c" if d.compress else "")
            + (f"+keep{len(d.keep)}" if d.keep else "") + (f"+parts{len(d.parts)}" if d.parts else "")
            + ("+host" if d.host else "") + ("+revolve" if d.revolve else "") for d in plan]


def zoo_plan(chain: StepCosts, found: Search, row: dict[str, Any]) -> tuple[tuple[Decision, ...], str]:
    """The plan the zoo ran for ``row``, rebuilt from its words (a simple policy by its name, else each block's ladder
    option with the block's word, Revolve plans from the recorded ones), and a note: whether the search's plan for
    the row's budget is the same (verification may have run another: NOTE [ Applying a plan ] Rules 4-7)."""
    mine = words(found.best(int(row["budget_GiB"] * GiB))[0])
    note = "search's" if mine == row["decisions"] else f"search's now {_count(mine)}"
    if row.get("simple"):
        return next(d for name, d, _ in found.simple if name == row["simple"]), note
    if any(w.endswith("+revolve") for w in row["decisions"]):
        return next(d for d, _ in found.plans if words(d) == row["decisions"]), note
    # a run before NOTE [ Plan search ] Rule 1 sent a storage's positions together offered its offloads without that
    ladders = [ladder(b, chain.codec is not None) + ladder(dataclasses.replace(b, same=()), chain.codec is not None)
               for b in chain.blocks]
    return tuple(next(d for d in opts if words([d]) == [w]) for opts, w in zip(ladders, row["decisions"])), note


def _count(ws: Sequence[str]) -> str:
    return ", ".join(f"{ws.count(w)} {w}" for w in sorted(set(ws), key=ws.index))


def breakdown(chain: StepCosts, plan: Sequence[Decision], pred: Prediction) -> dict[str, int]:
    """The terms of ``pred``'s peak (the module docstring's), where ``predict`` sampled it."""
    where, i = pred.at.split()[0], int(pred.at.split()[1])
    per = [terms(chain, b, d) for b, d in zip(chain.blocks, plan)]
    rev = chain_states(chain, plan[0].revolve) if plan and plan[0].revolve else None
    upto = range(i + 1) if where == "forward" else range(i)
    kept = sum(per[j][0] for j in upto if plan[j].mode != "recompute")
    inputs = sum(per[j][0] for j in upto if plan[j].mode == "recompute")
    out = {"kept": kept, "inputs": inputs}
    if where == "forward":
        out.update(base=chain.fixed_bytes + chain.other_saved_bytes, calib=rev.fwd[i] if rev else 0)
    else:
        b, d = chain.blocks[i], plan[i]
        own = materialised_bytes(b, d) if d.mode == "recompute" else per[i][0]
        out.update(base=chain.bwd_fixed(i), own=own, calib=per[i][5] - own if d.mode == "recompute" else 0, work=b.bwd_bytes)
        if rev:
            out["calib"] += rev.bwd[i] + chain.revolve_offset(rev.memory)
    once = corrections([t[8] for t in per]) if rev is None else None
    out["once"] = once[0 if where == "forward" else 1][i] if once else 0
    out["rest"] = pred.peak_bytes - sum(out.values())
    return out


def check(directory: str) -> list[list[str]]:
    rows = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("zoo_") and name.endswith(".json")) or name == "zoo_summary.json":
            continue
        model = name[4:-5]
        profile = os.path.join(directory, f"profile_{model}.json")
        if not os.path.exists(profile):
            continue
        with open(os.path.join(directory, name)) as f:
            zoo = json.load(f)
        _, chain, _, _ = load(profile)
        found = search(chain)
        at = [chain.bwd_fixed(i) for i in range(len(chain.blocks))]
        print(f"{model}: fixed {chain.fixed_bytes / GiB:.3f}, other saved {chain.other_saved_bytes / GiB:.3f}, backward's "
              f"{at[-1] / GiB:.3f} (last block) .. {at[0] / GiB:.3f} (first), rec_bytes {chain.rec_bytes / GiB:+.3f}, "
              f"keep_rec_bytes {chain.keep_rec_bytes / GiB:+.3f}, host_rec_bytes {chain.host_rec_bytes / GiB:+.3f}, "
              f"revolve_bytes {chain.revolve_bytes / GiB:+.3f}; {sum(1 for b in chain.blocks if b.shared)} blocks share storages")
        simple = {name: d for name, d, _ in found.simple}
        for r in zoo["rows"]:
            if r.get("peak_GiB") is None or not (r.get("method") == "plan" or r.get("pred_of") in simple):
                continue
            if r["method"] == "plan":
                dec, note = zoo_plan(chain, found, r)
            else:  # an eager method, the simple policy it is (zoo.py's pred_of)
                dec, note = simple[r["pred_of"]], r["pred_of"]
            pred = predict(chain, dec)
            parts = breakdown(chain, dec, pred)
            label = f"{r['budget_GiB']:.3g}" if r["method"] == "plan" else r["name"]
            rows.append([model, label, f"{r['peak_GiB']:.3f}", fmt(r.get("verified_peak_GiB"), ".3f"),
                         f"{r['pred_peak_GiB']:.3f}", f"{pred.peak_bytes / GiB:.3f}",
                         f"{(pred.peak_bytes / GiB / r['peak_GiB'] - 1) * 100:+.1f}", pred.at]
                        + [f"{parts.get(k, 0) / GiB:.3f}" for k in TERMS] + [note])
    return rows


TERMS = ("base", "kept", "inputs", "own", "calib", "work", "once", "rest")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="*", default=list(DIRS))
    args = p.parse_args()
    for d in args.dirs:
        print(f"\n{d}")
        rows = check(d)
        print("(GiB; err: today's prediction / the zoo's measured peak - 1; plan: whether the search's plan for the budget "
              "is still the one the zoo ran)")
        print_table(["model", "budget", "measured", "verified", "zoo pred", "pred", "err %", "at", *TERMS, "plan"], rows)


if __name__ == "__main__":
    main()
