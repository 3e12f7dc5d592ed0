"""The planner's frontier under FSDP2: a Llama decoder sharded over 2 GPUs, each plan against the eager methods that fit.

Model: ``benchmarks/architectures.py``'s ``llama`` (transformers ``LlamaForCausalLM`` from a config, random weights,
seeded alike on every rank): on CUDA its training size in bf16 (d2048, 16 layers, 16 heads, ff 5632, vocab 32000,
~1B parameters) on a per-rank batch of ``--batch`` x ``--seq`` tokens (default 2 x 4096), where the activations (~15
GiB a rank without checkpointing) outweigh the sharded parameters and gradients (~1 GiB each a rank); with ``--tiny``
or without CUDA its tiny fp32 size (d64, 4 layers) on 2 CPU processes over gloo, 1 timed step (tests). ``fully_shard``
on each decoder layer, then on the root. Each rank trains on its own random batch (seeded by its rank); the loss is
the model's own (``labels=input_ids``).

Methods, in this order, all on the one sharded model in the same processes (each set up, measured, then undone):
  none        FSDP2, no checkpointing
  checkpoint  transformers' own per-layer checkpointing (``torch.utils.checkpoint``, non-reentrant), switched on
  sac         torch SAC on each layer, saving the ops the planner counts as SAC's (``SAC_OPS``: matmuls, attention)
  plan_{B}    ``torchckpt.planner.plans`` on the sharded model, every rank together with its own batch (NOTE [ One
              plan for all ranks ]), for ``--n-budgets`` per-rank budgets from 1.1 x the planner's floor to 0.9 x
              none's measured per-rank peak (a first ``plans`` call for one budget above everything tells the floor)
              or for ``--budgets``; each plan applied, measured, removed
  none_end    none again, last: the device's drift over the run

A step: forward with labels, ``loss.backward()``, ``model.zero_grad(set_to_none=True)`` (no optimizer). Each method:
2 warm-up steps, the median of ``--reps`` timed ones (``common.measure_steps``); a rank's peak = max_memory_allocated
over the timed steps minus memory_allocated before them (CUDA; on the CPU only times). Every rank's figures are
gathered; a row holds the largest step time and peak of any rank (the ranks' own in ``ranks_*``). A method that
raises (out of memory) is recorded with its error and the run goes on; one that raises on some ranks only leaves the
others waiting in a collective until the process group times out. Each plan row keeps the planner's predictions, its
verification's figures, its decisions, a hash of the plan on each rank (the same on all: one plan for all ranks), and
the fastest eager method whose per-rank peak fits the budget, with the plan's ratio to it (target <= 1.02). Then
(``--pair-rounds``, default 5 on CUDA) each plan and that eager method are measured again in turns (eager, plan, eager,
plan, ...; each turn set up afresh, a warm-up step and the median of 5, every rank together): the ratio reported is
the median of the plan's turns over the median of the eager method's, so that drift between the two rows (measured a
minute apart) does not decide it; the unpaired ratio is kept (``ratio_unpaired``).

Writes, under ``--out``: ``fsdp_frontier.json`` (after every method) and ``fsdp_frontier.png`` (step time over none's
against per-rank peak: eager methods as markers, plans a line; on the CPU the planner's predicted peaks).

    python benchmarks/fsdp_frontier.py [--gpus 2] [--tiny] [--batch 2] [--seq 4096] [--reps 7] [--n-budgets 4]
                                       [--budgets 12G,16G] [--pair-rounds 5] [--progress] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import torchckpt.planner
from architectures import build, torch_checkpoint, wrap_blocks
from common import GiB, block_decisions, fmt, measure_steps, measured_under, out_dir, parse_bytes, plot_frontier, print_table
from zoo import gib, sac_policy

EAGER = ("none", "checkpoint", "sac")
MARKERS = {"none": "s", "checkpoint": "^", "sac": "D", "none_end": "x"}
_PAIR_STEPS = 5  # timed steps a turn of Rank.pair
PROBE = 1 << 50  # a budget above any step: the plan that keeps everything, and the planner's floor with it


def budgets_between(floor: int, top: float, n: int) -> list[int]:
    """``n`` budgets from 1.1 x ``floor`` to 0.9 x ``top``, evenly spaced (one when they cross)."""
    lo, hi = 1.1 * floor, 0.9 * top
    if n <= 1 or hi <= lo:
        return [int(lo)]
    return [int(lo + (hi - lo) * k / (n - 1)) for k in range(n)]


def plan_hash(plan: Any) -> str:
    """The plan's JSON less the rank's own device, hashed: equal on every rank when they planned together."""
    d = {k: v for k, v in dataclasses.asdict(plan).items() if k != "device"}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def best_eager(rows: list[dict[str, Any]], budget_GiB: float) -> dict[str, Any] | None:
    """The fastest eager method whose measured per-rank peak is within the budget (none on the CPU: no peaks)."""
    fits = [r for r in rows if r["method"] in EAGER and r.get("step_s") and r.get("peak_GiB") is not None
            and r["peak_GiB"] <= budget_GiB]
    return min(fits, key=lambda r: r["step_s"]) if fits else None


class Rank:
    """One rank's model, batch and measurements; every rank runs the same methods in the same order and gathers
    each method's figures, so every rank holds the same ``rows``, which rank 0 prints and writes."""

    def __init__(self, rank: int, world: int, args: argparse.Namespace, cuda: bool, out: str) -> None:
        self.rank, self.world, self.args, self.cuda = rank, world, args, cuda
        dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        dtype = torch.bfloat16 if cuda else torch.float32
        built = build("llama", "train" if cuda else "tiny", dev, dtype)
        m: Any = built.model  # a LlamaForCausalLM
        params = sum(p.numel() for p in m.parameters())
        g = torch.Generator("cpu").manual_seed(1234 + rank)  # each rank its own batch
        ids = torch.randint(0, m.config.vocab_size, (args.batch, args.seq), generator=g).to(dev)
        self.batch = {"input_ids": ids, "labels": ids, "use_cache": False}
        from torch.distributed.fsdp import fully_shard

        for layer in m.model.layers:
            fully_shard(layer)
        fully_shard(m)
        self.model, self.blocks, self.library = m, built.blocks, built.library
        sac = functools.partial(create_selective_checkpoint_contexts, sac_policy)
        self.setups: dict[str, Callable[[], Any]] = {
            "none": lambda: None, "checkpoint": self.library,
            "sac": lambda: wrap_blocks(self.blocks, lambda i, f: torch_checkpoint(f, sac))}
        self.losses: list[torch.Tensor] = []
        self.rows: list[dict[str, Any]] = []
        self.path = os.path.join(out, "fsdp_frontier.json")
        note = built.note.split(", batch")[0] + f", batch {args.batch}x{args.seq} a rank"
        self.result: dict[str, Any] = {
            "model": note, "params": params, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
            "torch": torch.__version__, "world_size": world, "backend": dist.get_backend(), "dtype": str(dtype),
            "batch": args.batch, "seq": args.seq, "reps": args.reps, "rows": self.rows}
        count = f"{params / 1e9:.3g}B" if params >= 1e8 else f"{params / 1e6:.3g}M"
        self.say(f"fsdp_frontier: {note}, {count} parameters, {dtype}, {world} ranks of "
                 f"{self.result['device']} ({dist.get_backend()}), torch {torch.__version__}, {args.reps} timed steps")

    # -- steps ---------------------------------------------------------------------------
    def say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def step(self) -> None:
        out = self.model(**self.batch)
        out.loss.backward()
        self.losses.append(out.loss.detach())
        del out
        self.model.zero_grad(set_to_none=True)

    def clean(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.losses.clear()
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def gather(self, obj: Any) -> list[Any]:
        got: list[Any] = [None] * self.world
        dist.all_gather_object(got, obj)
        return got

    def save(self) -> None:
        if self.rank == 0:
            with open(self.path, "w") as f:
                json.dump(self.result, f, indent=1, default=str)

    # -- methods -------------------------------------------------------------------------
    def run(self, label: str, method: str, setup: Callable[[], Any], extra: dict[str, Any] | None = None,
            local: dict[str, Any] | None = None) -> None:
        """Set up, measure, undo on every rank; gather; one row (on every rank), printed and written by rank 0.
        ``local``: this rank's own figures to record beside its measurements (``ranks_<key>``)."""
        def measure() -> dict[str, Any]:
            return {**measure_steps(self.step, self.args.reps, self.cuda), "loss": float(self.losses[-1])}

        mine: dict[str, Any] = {**(local or {}), **measured_under(setup, measure)}
        self.clean()
        got = self.gather(mine)
        row: dict[str, Any] = {"name": label, "method": method, **(extra or {})}
        errors = [f"rank {r}: {g['error']}" for r, g in enumerate(got) if "error" in g]
        if errors:
            row["error"] = "; ".join(errors)
        else:
            peaks = [g["peak_GiB"] for g in got]
            row.update(step_s=max(g["step_s"] for g in got), peak_GiB=None if None in peaks else max(peaks))
        for k in sorted({k for g in got for k in g} - {"error"}):
            row[f"ranks_{k}"] = [g.get(k) for g in got]
        self.rows.append(row)
        none = next((r for r in self.rows if r["name"] == "none" and "step_s" in r), None)
        if "step_s" in row:
            row["x_none"] = row["step_s"] / none["step_s"] if none else None
        if "step_s" in row:
            pk = gib(row["peak_GiB"])
            pred = (f"   predicted {gib(row['pred_peak_GiB'])}, {row['pred_step_s'] * 1e3:.1f} ms"
                    if "pred_peak_GiB" in row else "")
            self.say(f"{label:<14} {row['step_s'] * 1e3:9.1f} ms {fmt(row['x_none'], '6.2f')}x {pk:>11} a rank{pred}")
        else:
            self.say(f"{label:<14} error: {row['error']}")
        self.save()

    def plan_rows(self) -> None:
        """Plan every budget on the sharded model, all ranks together, then measure each plan."""
        args, m, kw = self.args, self.model, dict(self.batch)
        t0 = time.perf_counter()
        try:
            if args.budgets:
                budgets = [parse_bytes(b) for b in args.budgets.split(",") if b]
            else:  # the floor, from the plan for a budget above everything
                probe = torchckpt.planner.plans(m, blocks=self.blocks, budgets=[PROBE], progress=args.progress, **kw)
                p = probe[PROBE]
                none = next((r for r in self.rows if r["name"] == "none" and r.get("peak_GiB") is not None), None)
                top = none["peak_GiB"] * GiB if none else p.none_peak_bytes
                budgets = budgets_between(p.floor_bytes, top, args.n_budgets)
                self.result["probe"] = {"floor_GiB": p.floor_bytes / GiB, "none_peak_GiB": p.none_peak_bytes / GiB,
                                        "none_step_s": p.none_step_time, "s": time.perf_counter() - t0}
            t1 = time.perf_counter()
            found = torchckpt.planner.plans(m, blocks=self.blocks, budgets=budgets, progress=args.progress, **kw)
            plan_s = time.perf_counter() - t1
        except Exception as e:  # noqa: BLE001 - recorded; none_end still runs
            traceback.print_exc()
            self.rows.append({"name": "plan", "method": "plan", "error": f"{type(e).__name__}: {e}"})
            self.say(f"{'plan':<14} error: {self.rows[-1]['error']}")
            self.clean()
            return
        self.clean()
        self.result["planner"] = {"budgets_GiB": [b / GiB for b in budgets], "planned": len(found), "plans_s": plan_s,
                                  "total_s": time.perf_counter() - t0}
        self.say(f"planned {len(found)} of {len(budgets)} budgets in {plan_s:.1f} s "
                 f"({time.perf_counter() - t0:.1f} s with the floor's probe)")
        for b in budgets:
            label = f"plan_{b / GiB:.3g}" if b >= GiB // 100 else f"plan_{b / 2**20:.3g}M"
            pl = found.get(b)
            if pl is None:
                self.rows.append({"name": label, "method": "plan", "budget_GiB": b / GiB, "error": "refused (PlanError)"})
                self.say(f"{label:<14} refused")
                self.save()
                continue
            extra = {"budget_GiB": b / GiB, "pred_peak_GiB": pl.peak_bytes / GiB, "pred_step_s": pl.step_time,
                     "verified_peak_GiB": pl.measured_peak_bytes / GiB if pl.measured_peak_bytes is not None else None,
                     "verified_step_s": pl.measured_step_time, "floor_GiB": pl.floor_bytes / GiB,
                     "none_pred_peak_GiB": pl.none_peak_bytes / GiB, "simple": pl.simple,
                     "decisions": block_decisions(pl)}

            def setup(pl: Any = pl) -> Callable[[], None]:
                return pl.apply(m).remove  # type: ignore[no-any-return]

            self.run(label, "plan", setup, extra, {"plan_hash": plan_hash(pl)})
            if self.args.pair_rounds and "step_s" in self.rows[-1]:
                self.pair(self.rows[-1], setup)

    def pair(self, row: dict[str, Any], setup: Callable[[], Any]) -> None:
        """The plan and the fastest eager method within its budget measured again in turns (eager, plan, eager, plan,
        ...; each turn set up afresh, a warm-up step and the median of ``_PAIR_STEPS``, every rank together; a turn's
        time the largest of any rank's), so drift and the allocator's state fall on both alike: ``row["paired"]`` gets
        both medians of the turns and their ratio. Every rank holds the same rows, so every rank picks the same eager
        method and runs the same turns."""
        best = best_eager(self.rows, row["budget_GiB"])
        if best is None:
            return
        times: dict[str, list[float]] = {"eager": [], "plan": []}
        for _ in range(self.args.pair_rounds):
            for side, how in (("eager", self.setups[best["method"]]), ("plan", setup)):
                undo = how()
                try:
                    mine = float(measure_steps(self.step, _PAIR_STEPS, self.cuda, warmup=1)["step_s"] or 0.0)
                finally:
                    if callable(undo):
                        undo()
                self.clean()
                times[side].append(max(self.gather(mine)))
        e, p = statistics.median(times["eager"]), statistics.median(times["plan"])
        row["paired"] = {"eager": best["name"], "eager_step_s": e, "plan_step_s": p, "ratio": p / e, "turns": times}
        self.say(f"{'':<14} paired with {best['name']}: {p * 1e3:.1f} against {e * 1e3:.1f} ms, {p / e:.3f}x")
        self.save()

    def all(self) -> None:
        t0 = time.perf_counter()
        for name in EAGER:
            self.run(name, name, self.setups[name])
        self.plan_rows()
        self.run("none_end", "none_end", lambda: None)
        first, last = (next((r for r in self.rows if r["name"] == n and "step_s" in r), None)
                       for n in ("none", "none_end"))
        if first and last:
            self.result["drift"] = last["step_s"] / first["step_s"] - 1
        self.result["total_s"] = time.perf_counter() - t0
        for r in self.rows:
            if r["method"] == "plan" and "budget_GiB" in r:
                best = best_eager(self.rows, r["budget_GiB"])
                r["best_eager"] = best["name"] if best else None
                r["ratio_unpaired"] = r["step_s"] / best["step_s"] if best and "step_s" in r else None
                r["ratio"] = r["paired"]["ratio"] if "paired" in r else r["ratio_unpaired"]
                r["within_budget"] = r["peak_GiB"] <= r["budget_GiB"] if r.get("peak_GiB") is not None else None
        self.save()
        if self.rank == 0:
            report(self.result)
            plot(self.result, os.path.join(os.path.dirname(self.path), "fsdp_frontier.png"))
            print(f"wrote {self.path}", flush=True)


def report(result: dict[str, Any]) -> None:
    """The table: per method its step, ratio to none and per-rank peak; per plan its budget, predictions, fit and
    ratio to the fastest eager method within its budget."""
    yes = {True: "yes", False: "NO", None: "-"}
    table = [[r["name"], fmt(r.get("step_s") and r["step_s"] * 1e3), fmt(r.get("x_none"), ".2f"),
              fmt(r.get("peak_GiB"), ".3g"), fmt(r.get("budget_GiB"), ".3g"), fmt(r.get("pred_peak_GiB"), ".3g"),
              fmt(r.get("pred_step_s") and r["pred_step_s"] * 1e3), yes[r.get("within_budget")],
              r.get("best_eager") or "-", fmt(r.get("ratio"), ".3f"), fmt(r.get("ratio_unpaired"), ".3f"),
              (r.get("error") or "")[:50]] for r in result["rows"]]
    print(f"\n{result['model']}; {result['world_size']} x {result['device']}, per-rank figures (the largest of any rank)")
    print_table(["method", "step ms", "x none", "peak GiB", "budget GiB", "pred GiB", "pred ms", "fits",
                 "best eager", "ratio", "unpaired", "error"], table)
    if result.get("drift") is not None:
        print(f"drift: none took {result['drift'] * 100:+.1f}% at the end of the run against its start")
    print(f"{result['total_s']:.1f} s in all (ratio: plan / the fastest eager method within its budget, target <= 1.02)",
          flush=True)


def plot(result: dict[str, Any], path: str) -> None:
    """Step time over none's against per-rank peak (measured; the planner's predictions on the CPU): eager methods as
    markers, plans a line."""
    probe = result.get("probe", {})

    def peak(r: dict[str, Any]) -> float | None:
        if r.get("peak_GiB") is not None:
            return r["peak_GiB"]  # type: ignore[no-any-return]
        if r["method"] in ("none", "none_end"):  # on the CPU: the planner's profile of it
            return probe.get("none_peak_GiB")  # type: ignore[no-any-return]
        return r.get("pred_peak_GiB")

    plot_frontier(path, result["rows"], peak, MARKERS, probe.get("floor_GiB"),
                  "per-rank peak above the step's start, GiB",
                  f"FSDP2, {result['world_size']} ranks: {result['model']}\n{result['device']}, torch {result['torch']}")


def worker(rank: int, world: int, init: str, args: argparse.Namespace, cuda: bool, out: str) -> None:
    if cuda:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank), timeout=datetime.timedelta(minutes=10))
    else:
        torch.set_num_threads(1)  # tiny models: threads only add waits
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=2))
    try:
        Rank(rank, world, args, cuda, out).all()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # As tests/test_works_with.py's gloo workers: a rank tearing down after its work was done has been seen to abort
    # ("terminate called without an active exception"); leave without running C++ static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2, help="ranks, one process each (GPUs on CUDA; CPU processes else)")
    p.add_argument("--tiny", action="store_true", help="the tiny model on CPU processes over gloo (default without CUDA)")
    p.add_argument("--batch", type=int, default=None, help="sequences a rank (default 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens a sequence (default 4096; 32 tiny)")
    p.add_argument("--reps", type=int, default=None, help="timed steps per method (default 7; 1 tiny)")
    p.add_argument("--n-budgets", type=int, default=4, help="plans from 1.1 x the floor to 0.9 x none's per-rank peak")
    p.add_argument("--budgets", default="", help="per-rank budgets instead, comma-separated (e.g. 12G,16G)")
    p.add_argument("--pair-rounds", type=int, default=None,
                   help="turns a side when each plan is measured again against its eager method (default 5; 0 tiny)")
    p.add_argument("--progress", action="store_true", help="the planner prints its phases to stderr (every rank)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda and torch.cuda.device_count() < args.gpus:
        p.error(f"--gpus {args.gpus}, but {torch.cuda.device_count()} CUDA devices are visible; pass --gpus "
                f"{torch.cuda.device_count()} or --tiny")
    args.batch = args.batch or 2
    args.seq = args.seq or (4096 if cuda else 32)
    args.pair_rounds = args.pair_rounds if args.pair_rounds is not None else (5 if cuda else 0)
    args.reps = args.reps if args.reps is not None else (7 if cuda else 1)
    out = out_dir(args.out)
    with tempfile.TemporaryDirectory() as d:  # a rendezvous file: no port to find free
        mp.spawn(worker, args=(args.gpus, "file://" + os.path.join(d, "init"), args, cuda, out), nprocs=args.gpus,
                 join=True)


if __name__ == "__main__":
    main()
