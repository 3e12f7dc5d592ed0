"""Are the planner's plans stable? One model, batch and budget planned in separate processes, each plan measured.

Issue 24's Deliver 3: the same model, batch and budget planned in three separate processes should measure within
3% of each other. Each process builds the model of ``benchmarks/architectures.py`` (same seed, same batch), plans
every budget as ``torchckpt.planner.plans`` does (one profile, verification on the device), then measures each plan
applied and plain autograd in the same way as ``benchmarks/zoo.py`` (2 warm-up steps, the median of ``--reps``),
and writes what it planned and measured. The parent prints, per budget, each process's decisions, predicted and
measured step, and the spread of the measured steps (max / min - 1), with no checkpointing's spread beside it (the
device's own noise between processes). Then (``--turns``, default 5) one more process measures every process's
plan of each budget in turns (plan 0, plan 1, plan 2, plan 0, ...; a warm-up step and the median of 5 a turn): the
spread of their medians is what the plans differ by, apart from the speed of the process that made them (the
claim's figure; the spread in their own processes is kept beside it). Processes that returned the identical plan are
named, with that plan's spread in the turns: what the turns themselves vary by. Writes ``plan_stability_<model>.json``, a
plot, each process's profile and measured policies, ``profile_<model>_proc<k>.json``, from which
``benchmarks/replan.py`` makes that process's plans again offline (what its measurements made the search choose), and
its planner's messages, ``plan_<model>_proc<k>.log`` (which rule of verification decided each budget's plan).

    python benchmarks/plan_stability.py --model llama --budgets 5.29,9 [--procs 3] [--reps 7] [--turns 5] [--out DIR]
    python benchmarks/plan_stability.py --tiny          # the CPU, tiny sizes (times only)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import torch

from common import GiB, block_decisions, finish_figure, measure_steps, out_dir, profile_record, pyplot

HERE = os.path.dirname(os.path.abspath(__file__))


def _decisions(p: Any) -> str:
    """The plan's decisions, counted (e.g. ``4 keep, 8 recompute``)."""
    names = Counter(block_decisions(p))
    return ", ".join(f"{n} {k}" for k, n in names.most_common())


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, HERE)
    from architectures import build
    from torchckpt.planner import PlanError
    from torchckpt.planner.restore import untouched
    from torchckpt.planner.verify import _Profiled

    cuda = torch.cuda.is_available() and not args.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    b = build(args.model, "tiny" if args.tiny else "train", dev, torch.bfloat16 if cuda else torch.float32)

    def step() -> None:
        args_, kwargs = b.args, b.kwargs
        b.loss(b.model(*args_, **kwargs)).backward()
        b.model.zero_grad(set_to_none=True)

    def measure() -> dict[str, Any]:
        return measure_steps(step, args.reps, cuda)

    out: dict[str, Any] = {"none": measure(), "plans": []}
    budgets = [int(float(v) * GiB) for v in args.budgets.split(",")]
    t0 = time.perf_counter()
    got = {}
    with untouched(b.model, (b.args, b.kwargs)):  # the body of torchckpt.plans, keeping the profile for replan.py
        try:
            planned = _Profiled.prepare(b.model, b.args, b.kwargs, None, b.blocks, b.loss, None, progress=True,
                                        call="plans")  # its messages: the parent's plan_<model>_proc<k>.log
        except PlanError as e:  # the profile refused (a step that does not fit): every budget without a plan
            out["error"] = str(e)
            planned = None
        for budget in budgets if planned is not None else ():
            try:
                got[budget] = planned.plan(budget)
            except PlanError as e:
                out.setdefault("errors", {})[str(budget)] = str(e)
    if planned is not None:
        out["profile"] = profile_record(planned)
    out["plan_s"] = time.perf_counter() - t0
    for budget in budgets:
        p = got.get(budget)
        if p is None:
            out["plans"].append({"budget_GiB": budget / GiB, "error": "no plan"})
            continue
        a = p.apply(b.model)
        try:
            row = measure()
        finally:
            a.remove()
        out["plans"].append({"budget_GiB": budget / GiB, "decisions": _decisions(p), "simple": p.simple,
                             "pred_step_s": p.step_time, "pred_peak_GiB": p.peak_bytes / GiB, "plan": p.to_json(),
                             "blocks": block_decisions(p), **row})
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


def judge(args: argparse.Namespace) -> None:
    """One process measures every process's plan of each budget in turns (plan 0, plan 1, plan 2, plan 0, ...; each
    turn applied afresh, a warm-up step and the median of ``_TURN_STEPS``): what the plans cost, apart from what the
    process that made them ran at (on an H100 the first of three processes ran the same ConvNeXt-B plan 17% slower
    than the second, its own no checkpointing 0.1% apart)."""
    sys.path.insert(0, HERE)
    from architectures import build
    from torchckpt.planner import Plan

    cuda = torch.cuda.is_available() and not args.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    b = build(args.model, "tiny" if args.tiny else "train", dev, torch.bfloat16 if cuda else torch.float32)
    with open(args.json) as f:
        todo = json.load(f)  # {"budgets": [[plan json or None per process], ...]}

    step = b.step

    out = []
    for texts in todo["budgets"]:
        plans = [Plan.from_json(t) if t else None for t in texts]
        turns: list[list[float]] = [[] for _ in plans]
        for _ in range(args.turns):
            for k, pl in enumerate(plans):
                if pl is None:
                    continue
                a = pl.apply(b.model)
                try:
                    turns[k].append(float(measure_steps(step, _TURN_STEPS, cuda, warmup=1)["step_s"]))
                finally:
                    a.remove()
        out.append(turns)
    with open(args.json, "w") as f:
        json.dump({"turns": out}, f)


_TURN_STEPS = 5  # timed steps a turn of judge()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama")
    p.add_argument("--budgets", default=None, help="GiB (default 5.29,9 on CUDA; tiny: 0.002,0.004)")
    p.add_argument("--procs", type=int, default=3)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--turns", type=int, default=5, help="turns of each process's plan, measured in one more process")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--judge", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.tiny = args.tiny or not torch.cuda.is_available()
    if args.budgets is None:
        args.budgets = "0.002,0.004" if args.tiny else "5.29,9"
    if args.child:
        child(args)
        return
    if args.judge:
        judge(args)
        return
    out = out_dir(args.out)
    gpu = "cpu" if args.tiny else torch.cuda.get_device_name()
    print(f"plan stability: {args.model} on {gpu}, {args.procs} processes, budgets {args.budgets} GiB", flush=True)
    runs = []
    for k in range(args.procs):
        path = os.path.join(out, f"plan_stability_{args.model}_proc{k}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--budgets", args.budgets,
               "--reps", str(args.reps), "--json", path] + (["--tiny"] if args.tiny else [])
        t0 = time.perf_counter()
        with open(os.path.join(out, f"plan_{args.model}_proc{k}.log"), "w") as log:  # what the planner measured and chose
            subprocess.run(cmd, check=True, stderr=log)
        with open(path) as f:
            runs.append(json.load(f))
        os.remove(path)
        if "profile" in runs[-1]:  # absent where profiling refused (the child's "error")
            with open(os.path.join(out, f"profile_{args.model}_proc{k}.json"), "w") as f:  # benchmarks/replan.py's input
                json.dump(runs[-1].pop("profile"), f)
        if "error" in runs[-1]:
            print(f"process {k}: no plan: {runs[-1]['error']}", flush=True)
        print(f"process {k}: {time.perf_counter() - t0:.1f} s (planning {runs[-1]['plan_s']:.1f} s); none "
              f"{runs[-1]['none']['step_s'] * 1e3:.1f} ms", flush=True)
    turns: list[list[list[float]]] = []
    if args.turns:  # every process's plans measured again, in turns, by one more process
        path = os.path.join(out, f"plan_stability_{args.model}_judge.json")
        with open(path, "w") as f:
            json.dump({"budgets": [[r["plans"][i].get("plan") for r in runs]
                                   for i in range(len(args.budgets.split(",")))]}, f)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, os.path.abspath(__file__), "--judge", "--model", args.model, "--turns",
                        str(args.turns), "--json", path] + (["--tiny"] if args.tiny else []), check=True)
        with open(path) as f:
            turns = json.load(f)["turns"]
        os.remove(path)
        print(f"one process measured every plan in {args.turns} turns: {time.perf_counter() - t0:.1f} s", flush=True)
    nones = [r["none"]["step_s"] for r in runs]
    result: dict[str, Any] = {"model": args.model, "device": gpu, "torch": torch.__version__, "procs": args.procs,
                              "none_spread": max(nones) / min(nones) - 1, "budgets": []}
    print(f"\nno checkpointing: {', '.join(f'{t * 1e3:.1f}' for t in nones)} ms, spread "
          f"{result['none_spread'] * 100:.1f}%")
    for i, budget in enumerate(float(v) for v in args.budgets.split(",")):
        rows = [r["plans"][i] for r in runs]
        ok = [r for r in rows if "step_s" in r]
        spread = max(r["step_s"] for r in ok) / min(r["step_s"] for r in ok) - 1 if len(ok) == len(rows) else None
        same = len({json.dumps(r.get("blocks")) for r in rows}) == 1
        groups: dict[str, list[int]] = {}  # processes that returned the identical plan
        for k, r in enumerate(rows):
            groups.setdefault(json.dumps(r.get("blocks")), []).append(k)
        for r in rows:
            r.pop("plan", None)
        entry: dict[str, Any] = {"budget_GiB": budget, "runs": rows, "spread": spread, "same_decisions": same}
        if turns:
            meds = [statistics.median(t) if t else None for t in turns[i]]
            entry["turns"] = turns[i]
            entry["turn_medians_s"] = meds
            entry["turn_spread"] = (max(meds) / min(meds) - 1) if None not in meds else None  # type: ignore[type-var]
            # one plan measured more than once in the turns: their spread is the turns' own, not the plans'
            alike = [[meds[k] for k in g] for g in groups.values() if len(g) > 1 and None not in [meds[k] for k in g]]
            entry["same_plan_turn_spread"] = max((max(m) / min(m) - 1 for m in alike), default=None)
        entry["same_plan_processes"] = [g for g in groups.values() if len(g) > 1]
        result["budgets"].append(entry)
        judged = (f"; measured in turns in one process: {', '.join(f'{m * 1e3:.1f}' for m in entry['turn_medians_s'])}"
                  f" ms, spread {entry['turn_spread'] * 100:.1f}%" if entry.get("turn_spread") is not None else "")
        print(f"budget {budget:g} GiB: spread {spread * 100:.1f}% in their own processes{judged}"
              if spread is not None else f"budget {budget:g} GiB: not every process planned it",
              f"({'the same plan' if same else f'{len(groups)} different plans'})")
        if not same and entry["same_plan_processes"]:
            tw = entry.get("same_plan_turn_spread")
            print(f"  processes {', '.join(' and '.join(map(str, g)) for g in entry['same_plan_processes'])} returned "
                  "the identical plan" + (f", which measured {tw * 100:.1f}% apart in the turns: the turns' own noise"
                                          if tw is not None else ""))
        for k, r in enumerate(rows):
            if "step_s" in r:
                pk = f"{r['peak_GiB']:.2f} GiB" if r.get("peak_GiB") is not None else "-"
                print(f"  process {k}: {r['step_s'] * 1e3:7.1f} ms {pk:>10} (predicted {r['pred_step_s'] * 1e3:.1f} "
                      f"ms, {r['pred_peak_GiB']:.2f} GiB)  {r['decisions']}{'  = ' + r['simple'] if r['simple'] else ''}")
            else:
                print(f"  process {k}: {r.get('error')}")
    path = os.path.join(out, f"plan_stability_{args.model}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out, f"plan_stability_{args.model}.png"))
    print(f"wrote {path}")


def plot(result: dict[str, Any], path: str) -> None:
    """Each process's measured step per budget (over its own no checkpointing), one marker per process."""
    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, b in enumerate(result["budgets"]):
        for k, r in enumerate(b["runs"]):
            if "step_s" in r:
                ax.plot(i + (k - 1) * 0.08, r["step_s"] * 1e3, "o", color=f"C{k}", label=f"process {k}" if i == 0 else None)
        for k, m in enumerate(b.get("turn_medians_s") or []):
            if m is not None:
                ax.plot(i + (k - 1) * 0.08, m * 1e3, "x", color=f"C{k}",
                        label=f"process {k}'s plan, in turns in one process" if i == 0 else None)
    ax.set_xticks(range(len(result["budgets"])), [f"{b['budget_GiB']:g} GiB" for b in result["budgets"]])
    ax.set_ylabel("measured step, ms")
    ax.set_title(f"plans in {result['procs']} processes, {result['model']}, {result['device']}")
    finish_figure(fig, ax, path)


if __name__ == "__main__":
    main()
