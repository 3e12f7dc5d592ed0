"""Diagnosis (not a claim): what a plan's offloads cost against what the step model says (NOTE [ Mechanism costs ]
Rule 14 measures an offload's host work while planning; the traffic's cost is the model's copies alone).

On an H100 the zoo's ResNet-152 plans that offloaded one tensor in 8 to 26 blocks were predicted within 1-7% of keep
everything and measured 35-40 ms (40%) over it in verification, whatever the number of blocks; Mixtral's 21 ms.
Per model: the profile the zoo wrote (``--profile``: the same model, size and batch as ``architectures.py`` builds
here), calibrated and searched offline as ``replan.py`` does; at each budget the search's best plan, applied as
``Plan.apply`` applies it. In turns in one process: keep everything; each plan with the store ``Plan.apply`` makes;
the plan with a 40 GiB GPU cache (nothing crosses the link: the store's host cost alone); the plan's offloading
blocks under ``Offload(tensors=())`` (the saved-tensor hooks alone, nothing stored). Each: a warm-up step, the
median of 5, the forward's and backward's device time (CUDA events), the store's stats. Then a ``torch.profiler``
table of two steps of the first plan. Writes ``diag_offload.json`` and ``prof_offload_<model>.txt``.

    python benchmarks/diag_offload.py --model resnet152 --profile docs/results/.../profile_resnet152.json \\
        --budgets 8.27,10.45 [--turns 3] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import torchckpt
from architectures import build
from common import GiB, out_dir
from replan import load, summary
from torchckpt.planner import search
from torchckpt.planner.costs import cache_bytes
from torchckpt.planner.verify import _make


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet152")
    p.add_argument("--profile", required=True)
    p.add_argument("--budgets", default="8.27,10.45", help="GiB")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("diag_offload.py measures CUDA steps: run it on the GPU machine")
    out, dev = out_dir(args.out), torch.device("cuda")
    prof, chain, _, _ = load(args.profile)
    found = search(chain)
    none = found.plans[0][1]
    b = build(args.model, "train", dev, torch.bfloat16)
    plans = []
    for g in (float(v) for v in args.budgets.split(",")):
        dec, pred = found.best(int(g * GiB))
        plans.append((g, _make(prof, dec, pred, found.floor, none, int(g * GiB), chain.link, None), pred))
        print(f"{g:g} GiB: predicted {pred.peak_bytes / GiB:.2f} GiB, {pred.step_s * 1e3:.1f} ms (keep everything "
              f"{none.step_s * 1e3:.1f}), to host {pred.d2h_bytes / GiB:.2f} GiB: {summary(dec)}", flush=True)

    def timed(label: str, on: Callable[[], tuple[Callable[[], None], Any]], rows: dict[str, Any]) -> None:
        off, store = on()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            tot, fwd, bwd = b.timed_steps(reps=5, warm=1)
        finally:
            off()
        row = rows.setdefault(label, {"step_s": [], "fwd_dev_s": [], "bwd_dev_s": [], "peak_GiB": []})
        row["step_s"].append(statistics.median(tot))
        row["fwd_dev_s"].append(statistics.median(fwd))
        row["bwd_dev_s"].append(statistics.median(bwd))
        row["peak_GiB"].append((torch.cuda.max_memory_allocated() - base) / GiB)
        row["stats"] = store.stats().summary() if store is not None else ""
        print(f"  {label:<44} step {row['step_s'][-1] * 1e3:7.1f} ms  forward (device) {row['fwd_dev_s'][-1] * 1e3:6.1f}"
              f"  backward {row['bwd_dev_s'][-1] * 1e3:6.1f}  peak {row['peak_GiB'][-1]:5.2f} GiB  {row['stats']}",
              flush=True)

    def applied(plan: Any, store: torchckpt.Store | None) -> Callable[[], tuple[Callable[[], None], Any]]:
        def on() -> tuple[Callable[[], None], Any]:
            a = plan.apply(b.model, store=store)
            return a.remove, a.store
        return on

    def hooks_only(plan: Any, store: torchckpt.Store) -> Callable[[], tuple[Callable[[], None], Any]]:
        """The plan's offloading blocks sending nothing (``Offload(tensors=())``: the saved-tensor hooks alone), every
        other block kept."""
        return applied(dataclasses.replace(plan, blocks=tuple(
            dataclasses.replace(blk, offload=()) if blk.mode == "offload" else dataclasses.replace(blk, mode="keep")
            for blk in plan.blocks)), store)

    rows: dict[str, Any] = {}
    for turn in range(args.turns):
        print(f"turn {turn + 1}", flush=True)
        timed("keep everything", lambda: ((lambda: None), None), rows)
        for g, plan, _ in plans:
            timed(f"plan {g:g} GiB, the plan's store", applied(plan, None), rows)  # as Plan.apply makes it
            big = torchckpt.Store(dev, gpu_bytes=40 << 30, min_bytes=0)
            timed(f"plan {g:g} GiB, 40 GiB GPU cache", applied(plan, big), rows)
            hooks = torchckpt.Store(dev, gpu_bytes=cache_bytes([blk.host_bytes for blk in plan.blocks]), min_bytes=0)
            timed(f"plan {g:g} GiB, hooks alone", hooks_only(plan, hooks), rows)
            big.close()
            hooks.close()
    res = {"model": args.model, "profile": args.profile, "device": torch.cuda.get_device_name(),
           "plans": {f"{g:g}": {"pred_step_s": pred.step_s, "pred_peak_GiB": pred.peak_bytes / GiB,
                                "to_host_GiB": pred.d2h_bytes / GiB} for g, _, pred in plans},
           "none_pred_step_s": none.step_s, "rows": rows}
    print("medians of the turns:")
    for label, row in rows.items():
        print(f"  {label:<44} step {statistics.median(row['step_s']) * 1e3:7.1f} ms  forward (device) "
              f"{statistics.median(row['fwd_dev_s']) * 1e3:6.1f}  backward {statistics.median(row['bwd_dev_s']) * 1e3:6.1f}")
    with open(os.path.join(out, "diag_offload.json"), "w") as f:
        json.dump(res, f, indent=1)
    g, plan, _ = plans[0]
    a = plan.apply(b.model)
    for _ in range(2):
        b.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
        for _ in range(2):
            b.step()
        torch.cuda.synchronize()
    a.remove()
    with open(os.path.join(out, f"prof_offload_{args.model}.txt"), "w") as f:
        f.write(pr.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60))
    print(pr.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))


if __name__ == "__main__":
    main()
