"""The planner's frontier on a zoo of real architectures: is a plan ever slower than the eager method that fits?

Models (``--models``, default all; builders in ``benchmarks/architectures.py``, random weights from configs):
  llama, qwen2, gpt_neox, moe (Mixtral-style), t5 (encoder-decoder), vit_l (timm), convnext (timm),
  resnet152 (torchvision, batch norm). On CUDA at training sizes in bf16 (>= 8 GiB of activations without
  checkpointing); with ``--tiny`` or without CUDA, tiny fp32 ones on the CPU (1 timed step, no peaks).

Methods, per model, each measured the same way in one process:
  none         plain autograd
  library      the library's own checkpointing: transformers' ``gradient_checkpointing_enable()`` (non-reentrant),
               timm's ``set_grad_checkpointing()``, ``torch.utils.checkpoint`` on each block for torchvision
  sac          torch SAC on each block, saving the ops the planner counts as SAC's (``SAC_OPS``: matmuls, attention)
  every_other  ``torch.utils.checkpoint`` on blocks 0, 2, 4, ...
  recompute    ``torchckpt.Recompute()`` on every block
  reentrant    ``torchckpt.Recompute(reentrant=True)`` on every block (NOTE [ Reentrant recompute ])
  plan_{B}     plans from one profiling step (``_Profiled.prepare``, the body of ``torchckpt.plans``) for ``--budgets``
               budgets from 1.03 x the planner's floor to 0.97 x none's measured peak, each applied and measured
  none_end     none again, last: the device's drift over the run

A step: forward, loss, backward, then ``model.zero_grad(set_to_none=True)`` (every step allocates its gradients;
``--keep-grads`` leaves them in place between steps instead, as the planner's own profiling and verification steps
do). Each method: 2 warm-up steps, the median of ``--reps`` timed ones; peak = max_memory_allocated over the timed
steps minus memory_allocated before them (CUDA; on the CPU only times). A method that raises (out of memory) is
recorded with its error and the run goes on. Each plan row keeps the planner's predicted peak and step, its own
verification's figures, ``plan.simple``, ``plan.measurements``, ``plan.turns`` and the decisions; eager rows get the
planner's prediction for the simple policy they are (``pred_of``). Then (``--pair-rounds``, default 5) each plan and the
fastest eager method within its budget are measured again in turns (eager, plan, eager, plan, ...), and again, a
turn at a time up to ``--pair-max`` (default 15), while either side's turns spread over 10%: the ratio the
summary gives is theirs, so that the drift of a run and the allocator's state between methods fall on both alike
(the same policy measured 114-125 ms at three times of one ViT-L run on an H100; on host-bound models turns of
one policy vary by 10-25%, ResNet-152's every block Recompute() 127-168 ms, so five turns of five steps a side);
the unpaired ratio is kept.

Writes, under ``--out``: ``zoo_<model>.json`` (after every method), ``zoo_<model>.png`` (step time over none's
against peak) and ``zoo_summary.json`` over every ``zoo_<model>.json`` there (so models run in separate calls,
``--models llama,qwen2`` then ``--models t5``, end in one summary), printed as a table: per model and budget, the
plan's step and peak, the fastest eager method whose peak is within the budget, the ratio (target <= 1.02), the
prediction errors (target within 3%; the step's against the median of the plan's row and its paired turns) and whether the floor is at or below ``recompute``'s peak (within 0.1%: where
the floor is that policy's, the planner measured it in a run of its own). On the CPU the
eager methods' peaks are the planner's predictions for them (``peak_source``).

    python benchmarks/zoo.py [--models llama,qwen2,...] [--tiny] [--reps 7] [--budgets 5] [--methods none,plan]
                             [--keep-grads] [--pair-rounds 5] [--pair-max 15] [--progress] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import textwrap
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import torchckpt
from architectures import ARCHS, PACKAGE, Built, build, torch_checkpoint, wrap_blocks
from common import (GiB, block_decisions, fmt, measure_steps, measured_under, more_turns, out_dir, plot_frontier,
                    print_table, profile_record)
from torchckpt.planner import PlanError
from torchckpt.planner.op_timing import SAC_OPS
from torchckpt.planner.verify import _Profiled
from torchckpt.planner.restore import untouched

EAGER = ("none", "library", "sac", "every_other", "recompute", "reentrant")
METHODS = (*EAGER, "plan", "none_end")
# the planner's simple policy (NOTE [ Plan search ] Rule 7) each eager method is, by the start of its name
SIMPLE_OF = {"none": "keep everything", "library": "every block Recompute()", "recompute": "every block Recompute()",
             "reentrant": "every block Recompute(reentrant=True)",
             "sac": "every block Recompute(save=matmuls", "every_other": "every other block Recompute() ("}
MARKERS = {"none": "s", "library": "^", "sac": "D", "every_other": "v", "recompute": "P", "reentrant": "X"}


def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if str(op) in SAC_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def recompute_every_block(blocks: list[torch.nn.Module], reentrant: bool = False) -> Callable[[], None]:
    """``torchckpt.checkpoint(block, policy=Recompute(reentrant=reentrant))`` on every block; returns the undo."""
    before = [(m, "forward" in m.__dict__, m.__dict__.get("forward")) for m in blocks]
    for m in blocks:
        torchckpt.checkpoint(m, policy=torchckpt.Recompute(reentrant=reentrant))

    def undo() -> None:
        for m, had, prev in before:
            if had:
                object.__setattr__(m, "forward", prev)
            else:
                m.__dict__.pop("forward", None)

    return undo


class Bench:
    """Steps of one built model, measured as ``benchmarks/frontier.py``'s ``Bench.measure`` does."""

    def __init__(self, built: Built, cuda: bool, reps: int, keep_grads: bool) -> None:
        self.b, self.cuda, self.reps, self.keep_grads = built, cuda, reps, keep_grads

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def step(self) -> None:
        out = self.b.model(*self.b.args, **self.b.kwargs)
        self.b.loss(out).backward()
        del out
        if not self.keep_grads:
            self.b.model.zero_grad(set_to_none=True)

    def measure(self) -> dict[str, float | None]:
        return measure_steps(self.step, self.reps, self.cuda)

    def clean(self) -> None:
        self.b.model.zero_grad(set_to_none=True)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


_PAIR_STEPS = 5  # timed steps a turn of pair()
_PEAK_REPEAT = 1e-3  # two measurements of one policy's peak: T5's Recompute() 3.1337 GiB while planning, 3.1325 here


def budgets_between(floor: int, top: float, n: int) -> list[int]:
    """``n`` budgets from 1.03 x ``floor`` to 0.97 x ``top``, evenly spaced (one when they cross)."""
    lo, hi = 1.03 * floor, 0.97 * top
    if n <= 1 or hi <= lo:
        return [int(lo)]
    return [int(lo + (hi - lo) * k / (n - 1)) for k in range(n)]


def gib(x: float | None) -> str:
    """Bytes in GiB for a line: MiB under 0.1 GiB (tiny models)."""
    return "-" if x is None else f"{x:.2f} GiB" if x >= 0.1 else f"{x * 1024:.2f} MiB"


def fit_peak(row: dict[str, Any]) -> float | None:
    """The peak a row is judged on: measured (CUDA), else the planner's prediction for it (CPU)."""
    if row.get("peak_GiB") is not None:
        return row["peak_GiB"]  # type: ignore[no-any-return]
    return row.get("pred_peak_GiB")


def run_model(name: str, args: argparse.Namespace, out: str, cuda: bool) -> dict[str, Any]:
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    size = "train" if cuda else "tiny"
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    t_model = time.perf_counter()
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"model": name, "size": size, "device": gpu, "torch": torch.__version__,
                              "dtype": str(dtype), "reps": args.reps, "grads": "kept" if args.keep_grads else "none",
                              "rows": rows}
    path = os.path.join(out, f"zoo_{name}.json")

    def save() -> None:
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    try:
        built = build(name, size, dev, dtype)
    except Exception as e:  # noqa: BLE001 - recorded; the other models still run
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
        save()
        print(f"{name}: build failed: {result['error']}", flush=True)
        return result
    m = built.model
    result.update(note=built.note, blocks=len(built.blocks),
                  params_GiB=sum(p.numel() * p.element_size() for p in m.parameters()) / GiB,
                  build_s=time.perf_counter() - t_model)
    print(f"\n== {name}: {built.note}; {len(built.blocks)} blocks, {gib(result['params_GiB'])} of parameters, "
          f"{dtype}, {gpu}, built in {result['build_s']:.1f} s", flush=True)
    bench = Bench(built, cuda, args.reps, args.keep_grads)
    methods = [x for x in args.methods.split(",") if x] if args.methods else list(METHODS)

    def run(label: str, method: str, setup: Callable[[], Any], extra: dict[str, Any] | None = None) -> None:
        row: dict[str, Any] = {"name": label, "method": method, **(extra or {}), **measured_under(setup, bench.measure)}
        bench.clean()
        rows.append(row)
        none = next((r for r in rows if r["name"] == "none" and "step_s" in r), None)
        if "step_s" in row:
            row["x_none"] = row["step_s"] / none["step_s"] if none else None
            pk = gib(row.get("peak_GiB"))
            pred = (f"   predicted {gib(row['pred_peak_GiB'])}, {row['pred_step_s'] * 1e3:.1f} ms"
                    if "pred_peak_GiB" in row else "")
            print(f"{label:<14} {row['step_s'] * 1e3:9.1f} ms {fmt(row['x_none'], '6.2f')}x {pk:>11}{pred}", flush=True)
        else:
            print(f"{label:<14} error: {row['error']}", flush=True)
        save()

    blocks = built.blocks
    setups: dict[str, Callable[[], Any]] = {
        "none": lambda: None,
        "library": built.library,
        "sac": lambda: wrap_blocks(blocks, lambda i, f: torch_checkpoint(
            f, functools.partial(create_selective_checkpoint_contexts, sac_policy))),
        "every_other": lambda: wrap_blocks(blocks, lambda i, f: torch_checkpoint(f) if i % 2 == 0 else None),
        "recompute": lambda: recompute_every_block(blocks),
        "reentrant": lambda: recompute_every_block(blocks, reentrant=True),
    }
    for method in EAGER:
        if method in methods:
            run(method, method, setups[method])

    if "plan" in methods:
        plan_rows(name, built, bench, rows, result, args, run, out, setups)
        save()
    if "none_end" in methods:
        run("none_end", "none_end", lambda: None)
    first, last = (next((r for r in rows if r["name"] == n and "step_s" in r), None) for n in ("none", "none_end"))
    if first and last:
        result["drift"] = last["step_s"] / first["step_s"] - 1
        print(f"drift: none took {result['drift'] * 100:+.1f}% at the end of the run against its start", flush=True)
    result["total_s"] = time.perf_counter() - t_model
    save()
    plot(result, os.path.join(out, f"zoo_{name}.png"))
    print(f"{name}: {result['total_s']:.1f} s in all", flush=True)
    return result


def plan_rows(name: str, built: Built, bench: Bench, rows: list[dict[str, Any]], result: dict[str, Any],
              args: argparse.Namespace, run: Callable[..., None], out: str,
              setups: dict[str, Callable[[], Any]]) -> None:
    """Profile once, plan every budget (as ``torchckpt.plans`` does, leaving no trace), then measure each plan."""
    m = built.model
    t0 = time.perf_counter()
    found: dict[int, Any] = {}
    refused: dict[int, str] = {}
    try:
        with untouched(m, (built.args, built.kwargs)):  # NOTE [ Planning leaves no trace ], as plans() does
            planned = _Profiled.prepare(m, built.args, built.kwargs, None, built.blocks, built.loss, None,
                                        progress=args.progress, call="plans")
            with open(os.path.join(out, f"profile_{name}.json"), "w") as f:  # benchmarks/replan.py plans from it
                json.dump(profile_record(planned), f)
            said: list[str] = []  # what verification measured of each family and simple policy, for offline study
            shown = planned.say

            def say(msg: str) -> None:
                said.append(msg)
                shown(msg)

            planned.say = say
            none = next((r for r in rows if r["name"] == "none" and r.get("peak_GiB") is not None), None)
            top = none["peak_GiB"] * GiB if none else planned.prof.peak_none
            budgets = budgets_between(planned.found.floor, top, args.budgets)
            for b in budgets:
                try:
                    found[b] = planned.plan(b)
                except PlanError as e:
                    refused[b] = f"PlanError: {str(e).splitlines()[0]}"
            with open(os.path.join(out, f"profile_{name}.json"), "w") as f:  # again, with verification's trials
                json.dump(profile_record(planned), f)
    except Exception as e:  # noqa: BLE001 - recorded; none_end still runs
        traceback.print_exc()
        rows.append({"name": "plan", "method": "plan", "error": f"{type(e).__name__}: {e}"})
        print(f"{'plan':<14} error: {rows[-1]['error']}", flush=True)
        bench.clean()
        return
    plan_s = time.perf_counter() - t0
    bench.clean()
    prof, search = planned.prof, planned.found
    simple: list[dict[str, Any]] = [{"name": n, "pred_peak_GiB": p.peak_bytes / GiB, "pred_step_s": p.step_s}
                                    for n, _, p in search.simple]
    result["planner"] = {"plan_s": plan_s, "budgets": len(budgets), "planned": len(found),
                         "floor_GiB": search.floor / GiB,
                         "none_peak_GiB": prof.peak_none / GiB, "none_step_s": prof.step_s, "by_blocks": prof.by_blocks,
                         "plans_searched": len(search.plans), "simple": simple, "verification": said}
    print(f"planned {len(found)} of {len(budgets)} budgets in {plan_s:.1f} s (profiling included); floor "
          f"{gib(search.floor / GiB)}, no checkpointing {gib(prof.peak_none / GiB)} {prof.step_s * 1e3:.1f} ms "
          "(profiled)", flush=True)
    for r in rows:  # each eager method beside the planner's prediction for the simple policy it is
        s = next((s for s in simple if r["method"] in SIMPLE_OF and s["name"].startswith(SIMPLE_OF[r["method"]])), None)
        if s is not None:
            r.update(pred_of=s["name"], pred_peak_GiB=s["pred_peak_GiB"], pred_step_s=s["pred_step_s"])
    for b in budgets:
        label = f"plan_{b / GiB:.3g}" if b >= GiB // 100 else f"plan_{b / 2**20:.3g}M"
        pl = found.get(b)
        if pl is None:
            rows.append({"name": label, "method": "plan", "budget_GiB": b / GiB, "floor_GiB": search.floor / GiB,
                         "plan_s": plan_s, "error": refused.get(b, "not planned")})
            print(f"{label:<14} refused: {rows[-1]['error']}", flush=True)
            continue
        extra = {"budget_GiB": b / GiB, "pred_peak_GiB": pl.peak_bytes / GiB, "pred_step_s": pl.step_time,
                 "verified_peak_GiB": pl.measured_peak_bytes / GiB if pl.measured_peak_bytes is not None else None,
                 "verified_step_s": pl.measured_step_time, "floor_GiB": pl.floor_bytes / GiB, "plan_s": plan_s,
                 "simple": pl.simple, "measurements": [dataclasses.asdict(x) for x in pl.measurements],
                 "turns": [dataclasses.asdict(x) for x in pl.turns],
                 "decisions": block_decisions(pl)}

        def setup(pl: Any = pl, extra: dict[str, Any] = extra) -> Callable[[], None]:
            applied = pl.apply(m)

            def undo() -> None:
                if applied.store is not None:
                    extra["store"] = applied.store.stats().summary()
                applied.remove()

            return undo

        run(label, "plan", setup, extra)
        if args.pair_rounds and "step_s" in rows[-1]:
            pair(rows[-1], rows, bench, setup, setups, args.pair_rounds, args.pair_max)


def best_eager(rows: list[dict[str, Any]], budget_GiB: float) -> dict[str, Any] | None:
    """The fastest eager method whose peak is within the budget."""
    fits = [e for e in rows if e.get("method") in EAGER and "step_s" in e and fit_peak(e) is not None
            and fit_peak(e) <= budget_GiB]
    return min(fits, key=lambda e: e["step_s"]) if fits else None


def pair(row: dict[str, Any], rows: list[dict[str, Any]], bench: Bench, setup: Callable[[], Any],
         setups: dict[str, Callable[[], Any]], rounds: int, most: int = 0) -> None:
    """The plan and the fastest eager method within its budget measured in turns (eager, plan, eager, plan, ...;
    each turn set up afresh, a warm-up step and the median of ``_PAIR_STEPS``), so drift and the allocator's state fall on
    both alike: ``row["paired"]`` gets both medians of the turns' medians and their ratio. ``rounds`` turns a side,
    then more, one at a time up to ``most``, while a side's turns spread over 10% (``common.more_turns``)."""
    best = best_eager(rows, row["budget_GiB"])
    if best is None:
        return
    times: dict[str, list[float]] = {"eager": [], "plan": []}
    done = 0
    while done < rounds or more_turns(times, most):
        done += 1
        for side, how in (("eager", setups[best["method"]]), ("plan", setup)):
            undo = how()
            try:
                times[side].append(float(measure_steps(bench.step, _PAIR_STEPS, bench.cuda, warmup=1)["step_s"] or 0.0))
            finally:
                if callable(undo):
                    undo()
            bench.clean()
    e, p = statistics.median(times["eager"]), statistics.median(times["plan"])
    row["paired"] = {"eager": best["name"], "eager_step_s": e, "plan_step_s": p, "ratio": p / e, "turns": times}
    print(f"{'':<14} paired with {best['name']}: {p * 1e3:.1f} against {e * 1e3:.1f} ms, {p / e:.3f}x", flush=True)


def pooled_step(row: dict[str, Any]) -> float:
    """A plan's measured step for its prediction error: the median of its row's figure and its paired turns' (one
    7-step median of a model whose turns vary by 10% is not the step's typical time; T5's plan at 24 GiB measured
    174 ms in its row and 176-191 ms in five turns)."""
    return float(statistics.median([row["step_s"]] + list(row.get("paired", {}).get("turns", {}).get("plan", []))))


def own_spread(row: dict[str, Any]) -> float | None:
    """How far a plan's own step moved while its process measured it, in % (largest over smallest, less 1): the step
    verification returned, its row's and the median of its paired turns'; ``None`` with fewer than two. A prediction
    is judged within 3% only where its plan measured within 3% of itself (on an H100, ResNet-152's 10.45 GiB plan
    measured 73.7, 96.1 and 84.1 ms in one process)."""
    turns = list(row.get("paired", {}).get("turns", {}).get("plan", []))
    figs = [row["step_s"]] + ([row["verified_step_s"]] if row.get("verified_step_s") else []) \
        + ([statistics.median(turns)] if turns else [])
    return (max(figs) / min(figs) - 1) * 100 if len(figs) > 1 else None


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per budget of one model: the plan against the fastest eager method within the budget."""
    rows = result.get("rows", [])
    eager = [r for r in rows if r.get("method") in EAGER and "step_s" in r]
    rec = next((r for r in eager if r["method"] == "recompute"), None)
    out = []
    for r in rows:
        if r.get("method") != "plan" or "budget_GiB" not in r:
            continue
        b = r["budget_GiB"]
        s: dict[str, Any] = {"model": result["model"], "device": result.get("device"), "budget_GiB": b,
                             "floor_GiB": r.get("floor_GiB"), "error": r.get("error"), "plan_step_s": None,
                             "plan_peak_GiB": None, "ratio": None}
        best = best_eager(eager, b)
        s["peak_source"] = "measured" if all(e.get("peak_GiB") is not None for e in eager) else "predicted"
        s.update(best_eager=best["name"] if best else None, best_eager_step_s=best["step_s"] if best else None,
                 best_eager_peak_GiB=fit_peak(best) if best else None)
        if "step_s" in r:
            peak = r.get("peak_GiB")
            s.update(plan_step_s=r["step_s"], plan_peak_GiB=peak, simple=r.get("simple"),
                     within_budget=(peak <= b) if peak is not None else None,
                     ratio_unpaired=r["step_s"] / best["step_s"] if best else None,
                     ratio=r["paired"]["ratio"] if "paired" in r else r["step_s"] / best["step_s"] if best else None,
                     step_err_pct=(r["pred_step_s"] / pooled_step(r) - 1) * 100, own_spread_pct=own_spread(r),
                     row_step_err_pct=(r["pred_step_s"] / r["step_s"] - 1) * 100,
                     peak_err_pct=(r["pred_peak_GiB"] / peak - 1) * 100 if peak else None,
                     verified_step_err_pct=(r["pred_step_s"] / r["verified_step_s"] - 1) * 100
                     if r.get("verified_step_s") else None,
                     verified_peak_err_pct=(r["pred_peak_GiB"] / r["verified_peak_GiB"] - 1) * 100
                     if r.get("verified_peak_GiB") else None,
                     ratio_err_pct=ratio_err(r, eager))
        rec_peak = fit_peak(rec) if rec else None
        s["recompute_peak_GiB"] = rec_peak
        s["floor_le_recompute"] = (r["floor_GiB"] <= rec_peak * (1 + _PEAK_REPEAT)) if rec_peak is not None and r.get(
            "floor_GiB") else None
        out.append(s)
    return out


def ratio_err(plan_row: dict[str, Any], eager: list[dict[str, Any]]) -> float | None:
    """The model's plan / eager ratio against the one measured in their paired turns, in % (predicted / measured - 1):
    the step prediction's error with the host's drift between the planner's measurements and the zoo's taken out
    (both sides of each ratio come from one time); ``None`` without paired turns or the eager method's prediction."""
    paired = plan_row.get("paired")
    if not paired or not paired.get("ratio"):
        return None
    e = next((r for r in eager if r["name"] == paired["eager"]), None)
    if e is None or not e.get("pred_step_s"):
        return None
    return (plan_row["pred_step_s"] / e["pred_step_s"] / paired["ratio"] - 1) * 100


def write_summary(out: str) -> list[dict[str, Any]]:
    """``zoo_summary.json`` over every ``zoo_<model>.json`` in ``out``, and the table printed."""
    results = []
    for name in ARCHS:
        p = os.path.join(out, f"zoo_{name}.json")
        if os.path.exists(p):
            with open(p) as f:
                results.append(json.load(f))
    summary = [s for r in results for s in summarize(r)]
    models = {r["model"]: {"device": r.get("device"), "size": r.get("size"), "total_s": r.get("total_s"),
                           "plan_s": r.get("planner", {}).get("plan_s"),
                           "floor_GiB": r.get("planner", {}).get("floor_GiB"),
                           "error": r.get("error")} for r in results}
    with open(os.path.join(out, "zoo_summary.json"), "w") as f:
        json.dump({"models": models, "budgets": summary}, f, indent=1, default=str)
    table = [[s["model"], fmt(s["budget_GiB"], ".3g"), fmt(s.get("plan_step_s") and s["plan_step_s"] * 1e3),
              fmt(s.get("plan_peak_GiB"), ".2f"), s["best_eager"] or "-",
              fmt(s["best_eager_step_s"] and s["best_eager_step_s"] * 1e3), fmt(s.get("ratio"), ".3f"),
              fmt(s.get("step_err_pct"), "+.1f"), fmt(s.get("own_spread_pct"), ".1f"), fmt(s.get("ratio_err_pct"), "+.1f"),
              fmt(s.get("peak_err_pct"), "+.1f"),
              {True: "yes", False: "NO", None: "-"}[s.get("within_budget")],
              {True: "yes", False: "NO", None: "-"}[s["floor_le_recompute"]], (s["error"] or "")[:40]]
             for s in summary]
    print("\nsummary (ratio: plan / fastest eager method within the budget; errors: predicted / measured - 1; spread: of"
          " the plan's own steps in its process, verification's, its row's and its turns'; ratio err: of the plan / eager"
          " ratio, the model's against the paired turns')")
    print_table(["model", "budget GiB", "plan ms", "peak GiB", "best eager", "eager ms", "ratio", "step err %",
                 "spread %", "ratio err %", "peak err %", "fits", "floor<=rec", "error"], table)
    for n, v in models.items():
        print(f"{n}: {fmt(v['total_s'])} s in all, planner {fmt(v['plan_s'])} s (profile included)"
              + (f", error {v['error']}" if v["error"] else ""))
    return summary


def plot(result: dict[str, Any], path: str) -> None:
    """Step time over none's against peak (measured; predicted on the CPU): eager methods as markers, plans a line."""
    title = textwrap.fill(f"{result['model']}: {result.get('note', '')}", 100)
    plot_frontier(path, [r for r in result["rows"] if r["name"] != "none_end"], fit_peak, MARKERS,
                  result.get("planner", {}).get("floor_GiB"), "peak memory above the step's start, GiB",
                  f"{title}\n{result['device']}")

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(ARCHS), help=f"comma-separated, of {', '.join(ARCHS)}")
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU (the default without CUDA)")
    p.add_argument("--reps", type=int, default=None, help="timed steps per method (default 7; 1 on the CPU)")
    p.add_argument("--budgets", type=int, default=5, help="plans from 1.03 x the floor to 0.97 x none's peak")
    p.add_argument("--methods", default="", help=f"run only these, comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--keep-grads", action="store_true", help="leave gradients in place between steps")
    p.add_argument("--pair-rounds", type=int, default=5,
                   help="turns of the plan and the fastest eager method within its budget, measured alternately (0: none)")
    p.add_argument("--pair-max", type=int, default=15,
                   help="more turns, one at a time up to this many, while a side's turns spread over 10%% (0: none)")
    p.add_argument("--progress", action="store_true", help="the planner prints its phases to stderr")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    args.reps = args.reps if args.reps is not None else (7 if cuda else 1)
    if not cuda:
        torch.set_num_threads(1)  # tiny models: threads only add waits, long ones when another process holds a core
    names = [n for n in args.models.split(",") if n]
    bad = [n for n in names if n not in ARCHS] + [x for x in args.methods.split(",") if x and x not in METHODS]
    if bad:
        p.error(f"unknown {', '.join(bad)}: models are {', '.join(ARCHS)}; methods {', '.join(METHODS)}")
    out = out_dir(args.out)
    print(f"zoo: {', '.join(names)} on {torch.cuda.get_device_name() if cuda else 'cpu (tiny sizes)'}, "
          f"torch {torch.__version__}, {args.reps} timed steps a method, {args.budgets} budgets", flush=True)
    t0 = time.perf_counter()
    for n in names:
        try:
            __import__(PACKAGE[n])
        except ImportError:
            print(f"{n}: skipped, {PACKAGE[n]} is not installed", flush=True)
            continue
        run_model(n, args, out, cuda)
        gc.collect()  # the model and its batch went with run_model's frame
        if cuda:
            torch.cuda.empty_cache()
    write_summary(out)
    print(f"zoo: {time.perf_counter() - t0:.1f} s in all", flush=True)


if __name__ == "__main__":
    main()
