"""Diagnosis (not a claim): what every block ``Recompute(store=...)`` (its inputs to host, the planner's plans near
the floor) costs against every block ``Recompute()`` on zoo models, and where.

Per model of ``benchmarks/architectures.py`` (training size, bf16, CUDA), in one process: every block
``Recompute()``; every block ``Recompute(store=...)`` with the GPU cache a plan's store gets (twice the largest
block input), with a 40 GiB cache (nothing moves after the first step: the store's own host cost), without prefetch,
and with ``timing=False``; ``Recompute()`` again (the run's drift). Each: 2 warm-up steps, the median of 7 of the
step, the forward's and the backward's device time (CUDA events), and the store's stats over all its steps. Then a
``torch.profiler`` table of two steps of the store with the plan's cache. Writes ``diag_store.json``,
``prof_<model>.txt`` (and ``trace_<model>.json`` with ``--trace``).

    python benchmarks/diag_store.py [--models llama,resnet152] [--trace] [--out DIR]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import torchckpt
from architectures import build, wrap_blocks
from common import out_dir
from torchckpt.planner.costs import cache_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama,resnet152")
    p.add_argument("--trace", action="store_true", help="also write the profiler's chrome trace")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("diag_store.py measures CUDA steps: run it on the GPU machine")
    out, dev, res = out_dir(args.out), torch.device("cuda"), {}
    for name in args.models.split(","):
        b = build(name, "train", dev, torch.bfloat16)
        sizes: list[int] = []
        hooks = [m.register_forward_pre_hook(lambda mod, a: sizes.append(
            sum(t.numel() * t.element_size() for t in a if torch.is_tensor(t)))) for m in b.blocks]
        with torch.no_grad():
            b.model(*b.args, **b.kwargs)
        for h in hooks:
            h.remove()
        cache = cache_bytes(sizes)  # the plan's store (NOTE [ Step model ] Rule 3)
        print(f"{name}: {len(b.blocks)} blocks, inputs {sum(sizes) / 2**30:.2f} GiB, plan's cache {cache >> 20} MiB")

        def step() -> None:
            out = b.model(*b.args, **b.kwargs)
            b.loss(out).backward()
            del out
            b.model.zero_grad(set_to_none=True)

        def recomputed(store: torchckpt.Store | None) -> Any:
            """Every block under ``Recompute(store=store)``; returns the undo."""
            return wrap_blocks(b.blocks, lambda i, f: functools.partial(
                torchckpt.checkpoint, f, policy=torchckpt.Recompute(store=store)))

        def run(label: str, store: torchckpt.Store | None, reps: int = 7) -> None:
            undo = recomputed(store)
            try:
                tot, fwd, bwd = b.timed_steps(reps, warm=2)
            finally:
                undo()
            row: dict[str, Any] = {"step_s": statistics.median(tot), "fwd_dev_s": statistics.median(fwd),
                                   "bwd_dev_s": statistics.median(bwd),
                                   "stats": store.stats().summary() if store is not None else ""}
            res[f"{name}/{label}"] = row
            print(f"{name} {label:<24} step {row['step_s'] * 1e3:7.1f} ms  forward (device) {row['fwd_dev_s'] * 1e3:6.1f}"
                  f"  backward {row['bwd_dev_s'] * 1e3:6.1f}  {row['stats']}", flush=True)

        run("Recompute()", None)
        run("store, plan's cache", torchckpt.Store(dev, gpu_bytes=cache, min_bytes=0))
        run("store, 40 GiB cache", torchckpt.Store(dev, gpu_bytes=40 << 30, min_bytes=0))
        run("store, no prefetch", torchckpt.Store(dev, gpu_bytes=cache, min_bytes=0, prefetch=False))
        run("store, timing=False", torchckpt.Store(dev, gpu_bytes=cache, min_bytes=0, timing=False))
        run("Recompute() again", None)
        undo = recomputed(torchckpt.Store(dev, gpu_bytes=cache, min_bytes=0))
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        undo()
        with open(os.path.join(out, f"prof_{name}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
        if args.trace:
            prof.export_chrome_trace(os.path.join(out, f"trace_{name}.json"))
        del b
        torch.cuda.empty_cache()
    with open(os.path.join(out, "diag_store.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
