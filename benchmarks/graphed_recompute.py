"""Recompute(graphed=True) against the other whole-block recomputations, on the zoo's models (issue 24 Deliver 4).

Per model of ``benchmarks/architectures.py`` (training sizes on CUDA, tiny on the CPU), every block under: nothing
(none), the library's own checkpointing, ``Recompute()``, ``Recompute(reentrant=True)`` and
``Recompute(graphed=True)`` (NOTE [ Graphed recompute ]), measured in turns (each method in turn: set up, two
warm-up steps, which make the graphed method's captures, the median of 5 steps; undone, graphs freed); the median
of the turns. Peak: the allocator's peak over the timed steps less what was allocated before them, plus, for the
graphed method, what its graphs hold that the allocator does not count (``graphed.held_bytes()``: shared buffers
and the intermediates' pool). Prints each method's step, peak and ratio to ``Recompute(reentrant=True)``, and how
many blocks replayed (``graphed.stats()``); writes ``graphed_recompute.json`` and a bar plot.

    python benchmarks/graphed_recompute.py --models resnet152,convnext,vit_l,t5 --turns 5 --out DIR
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
import torchckpt  # noqa: E402
from architectures import build_here  # noqa: E402
from common import measure_steps, out_dir, plot_bars, write_json  # noqa: E402
from torchckpt.recompute import graphed  # noqa: E402

POLICIES = {
    "Recompute()": torchckpt.Recompute(),
    "Recompute(reentrant=True)": torchckpt.Recompute(reentrant=True),
    "Recompute(graphed=True)": torchckpt.Recompute(graphed=True),
}


def run_model(name: str, turns: int, reps: int) -> dict[str, Any]:
    b, cuda = build_here(name)
    print(f"== {name}: {b.note}", flush=True)

    def on(policy: Any) -> Any:
        def setup() -> Any:
            for blk in b.blocks:
                torchckpt.checkpoint(blk, policy=policy)

            def undo() -> None:
                for blk in b.blocks:
                    blk.__dict__.pop("forward", None)
            return undo
        return setup

    methods: dict[str, Any] = {"none": lambda: None, "library": b.library,
                               **{k: on(p) for k, p in POLICIES.items()}}
    times: dict[str, list[float]] = {k: [] for k in methods}
    peaks: dict[str, list[float]] = {k: [] for k in methods}
    stats: dict[str, Any] = {}
    for turn in range(turns):
        for k, setup in methods.items():
            graphed.clear()
            undo = setup()
            try:
                got = measure_steps(b.step, reps, cuda, warmup=2)
                held = graphed.held_bytes() if cuda and k == "Recompute(graphed=True)" else 0
                times[k].append(float(got["step_s"]))
                peaks[k].append(float(got["peak_GiB"] or 0.0) + held / 2**30)
                if k == "Recompute(graphed=True)":
                    stats = {**graphed.stats(), "held_GiB": held / 2**30, "pool_GiB": graphed.pool_bytes() / 2**30
                             if cuda else 0.0}
            finally:
                if callable(undo):
                    undo()
                graphed.clear()
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
        print(f"  turn {turn + 1}: " + ", ".join(f"{k} {times[k][-1] * 1e3:.1f}" for k in methods), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = med["Recompute(reentrant=True)"]
    rows = []
    for k in methods:
        row = {"method": k, "step_s": med[k], "turns_s": times[k], "peak_GiB": statistics.median(peaks[k]),
               "x_none": med[k] / med["none"], "x_reentrant": med[k] / ref}
        rows.append(row)
        print(f"  {k:<28} {med[k] * 1e3:8.1f} ms (turns {min(times[k]) * 1e3:.1f}-{max(times[k]) * 1e3:.1f})  "
              f"peak {row['peak_GiB']:6.2f} GiB  x none {row['x_none']:.3f}  x reentrant {row['x_reentrant']:.3f}",
              flush=True)
    print(f"  graphed: {stats}", flush=True)
    return {"model": name, "note": b.note, "blocks": len(b.blocks), "rows": rows, "graphed_stats": stats}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet152,convnext,vit_l,t5")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    out = out_dir(a.out)
    t0 = time.perf_counter()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                           "torch": torch.__version__, "turns": a.turns, "reps": a.reps, "models": []}
    for name in a.models.split(","):
        try:
            res["models"].append(run_model(name, a.turns, a.reps))
        except Exception as e:  # noqa: BLE001 - one model's failure is reported, the others run
            import traceback
            traceback.print_exc()
            res["models"].append({"model": name, "error": f"{type(e).__name__}: {e}"})
        write_json(os.path.join(out, "graphed_recompute.json"), res)
    res["total_s"] = time.perf_counter() - t0
    write_json(os.path.join(out, "graphed_recompute.json"), res)
    done = [m for m in res["models"] if "rows" in m]
    if done:
        labels = [m["model"] for m in done]
        panels = {r["method"]: [next(x["x_none"] for x in m["rows"] if x["method"] == r["method"]) for m in done]
                  for r in done[0]["rows"]}
        plot_bars(os.path.join(out, "graphed_recompute.png"), labels, panels,
                  f"step over no checkpointing ({res['device']})")


if __name__ == "__main__":
    main()
