"""How long until a process has a usable device cache: one cudaMalloc versus the VMM arena.

Claim (issue 4, deliverables 1 and 3): a device cache reserved with ``cuMemAddressReserve`` and
mapped chunk by chunk in a background thread (torchckpt.memory.device_arena, csrc/vmm_cache.cpp)
gives the first slot in milliseconds, where one ``cudaMalloc`` of the whole cache (``torch.empty``
through PyTorch's caching allocator) is usable only when all of it is backed; and it keeps that
advantage when several processes start at once.

Per cache size, each method runs in ``--procs`` fresh processes at once (forked from this one,
which never touches CUDA). Each process makes its CUDA context, waits on a barrier, then times
from the barrier:

- ``cudaMalloc``: ``torch.empty(size)``, write the first slot, synchronize -> first = all usable.
- ``vmm``: ``DeviceArena(size, first_bytes=slot, chunk_bytes=--chunk)``, write the first slot,
  synchronize -> first usable; write the last slot (waits for its mapping) -> last usable;
  ``wait()`` -> all mapped.
- ``vmm_sync``: the arena with ``background=False`` (everything mapped before it returns): the raw
  cost of mapping in chunks, for comparison with one cudaMalloc.

Then the process frees its cache (timed) and exits. ``--procs N`` puts process i on GPU i % G
(G GPUs visible); ``--share-gpu`` puts them all on GPU 0. Sizes that do not fit (procs per GPU x
size > 95% of the GPU's memory) are skipped. Reported per (procs, size, method): the median over
``--reps`` of the slowest process, and ratios to cudaMalloc measured in the same run.

    python benchmarks/device_cache_init.py [--sizes 16G,32G,64G] [--procs 1] [--share-gpu]
        [--chunk 256M] [--slot 64M] [--reps 3] [--methods cudaMalloc,vmm,vmm_sync] [--tag h100] [--out DIR]
    python benchmarks/device_cache_init.py --replot docs/results/device_cache_h100.json   # PNG from JSON

Writes ``device_cache_<tag>.json`` and ``.png`` (tag: the GPU's short name unless given).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(1, ROOT)

import torch  # noqa: E402

from common import GiB, fmt, fmt_bytes, median, out_dir, parse_bytes, print_table, pyplot, save_figure, write_json  # noqa: E402

METHODS = ("cudaMalloc", "vmm", "vmm_sync")


def gpu_count() -> int:
    """GPUs visible, without initializing CUDA in this process (it forks the workers)."""
    n = torch.cuda._device_count_nvml()
    if n >= 0:
        return n
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                         capture_output=True, text=True, check=False)
    try:
        return int(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def worker(rank: int, device: int, method: str, nbytes: int, slot: int, chunk: int,
           barrier: Any, queue: Any) -> None:
    rec: dict[str, Any] = {"rank": rank, "device": device, "method": method, "nbytes": nbytes}
    try:
        t = time.perf_counter()
        torch.cuda.set_device(device)
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        from torchckpt.memory import device_arena as da

        rec["ctx_s"] = time.perf_counter() - t
        rec["gpu"] = torch.cuda.get_device_name(device)
        rec["free_before"] = torch.cuda.mem_get_info()[0]
        if method != "cudaMalloc":
            why = da.unavailable_reason(device)
            if why is not None:
                raise RuntimeError(why)
        barrier.wait()
        t0 = time.perf_counter()
        if method == "cudaMalloc":
            buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            rec["create_s"] = time.perf_counter() - t0
            buf[:slot].fill_(1)
            torch.cuda.synchronize()
            rec["first_s"] = rec["all_s"] = time.perf_counter() - t0
            buf[nbytes - slot :].fill_(1)
            torch.cuda.synchronize()
            rec["last_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            del buf
            torch.cuda.empty_cache()
            rec["free_s"] = time.perf_counter() - t1
        else:
            arena = da.DeviceArena(nbytes, device, chunk_bytes=chunk, background=(method == "vmm"), first_bytes=slot)
            rec["create_s"] = time.perf_counter() - t0
            rec["chunks"] = arena.num_chunks
            rec["chunk_bytes"] = arena.chunk_bytes
            rec["mapped_at_create"] = arena.mapped_bytes
            arena.slot(0, slot).fill_(1)
            torch.cuda.synchronize()
            rec["first_s"] = time.perf_counter() - t0
            arena.view(nbytes - slot, slot).fill_(1)
            torch.cuda.synchronize()
            rec["last_s"] = time.perf_counter() - t0
            arena.wait()
            rec["all_s"] = time.perf_counter() - t0
            rec["all_mapped_native_s"] = arena.all_mapped_s
            rec["mapped_bytes"] = arena.mapped_bytes
            rec["torch_allocated"] = torch.cuda.memory_allocated()
            t1 = time.perf_counter()
            arena.close()  # the views above are gone: this returns the memory
            rec["free_s"] = time.perf_counter() - t1
    except BaseException as e:  # report, do not hang the barrier
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["trace"] = traceback.format_exc()[-2000:]
        try:
            barrier.abort()
        except Exception:
            pass
    queue.put(rec)


def run_config(ctx: Any, procs: int, devices: list[int], method: str, nbytes: int, slot: int, chunk: int,
               timeout: float) -> list[dict[str, Any]]:
    barrier = ctx.Barrier(procs)
    queue = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, devices[r], method, nbytes, slot, chunk, barrier, queue))
          for r in range(procs)]
    for p in ps:
        p.start()
    recs = []
    deadline = time.time() + timeout
    for _ in ps:
        try:
            recs.append(queue.get(timeout=max(1.0, deadline - time.time())))
        except Exception:
            break
    for p in ps:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if len(recs) < procs:
        recs.append({"method": method, "nbytes": nbytes, "error": "timed out waiting for a worker"})
    return recs


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (procs, size, method): medians over repetitions of the slowest process's times."""
    groups: dict[tuple[int, int, int, str], list[list[dict[str, Any]]]] = {}
    for r in results:
        groups.setdefault((r["procs"], r["per_gpu"], r["nbytes"], r["method"]), []).append(r["workers"])
    rows = []
    for (procs, per_gpu, nbytes, method), reps in sorted(groups.items(),
                                                         key=lambda kv: (*kv[0][:3], METHODS.index(kv[0][3]))):
        ok = [w for w in reps if w and all("error" not in x for x in w) and len(w) == procs]
        row: dict[str, Any] = {"procs": procs, "per_gpu": per_gpu, "nbytes": nbytes, "method": method,
                               "reps": len(ok),
                               "errors": [x["error"] for w in reps for x in w if "error" in x][:3]}
        for key in ("create_s", "first_s", "last_s", "all_s", "free_s", "ctx_s"):
            vals = [max(x[key] for x in w) for w in ok if all(key in x for x in w)]
            row[key] = median(vals) if vals else float("nan")
        rows.append(row)
    base = {(r["procs"], r["per_gpu"], r["nbytes"]): r for r in rows if r["method"] == "cudaMalloc"}
    for r in rows:
        b = base.get((r["procs"], r["per_gpu"], r["nbytes"]))
        r["first_speedup_vs_cudaMalloc"] = b["all_s"] / r["first_s"] if b and r["first_s"] == r["first_s"] else float("nan")
        r["all_ratio_vs_cudaMalloc"] = r["all_s"] / b["all_s"] if b and r["all_s"] == r["all_s"] else float("nan")
    return rows


def plot(path: str, rows: list[dict[str, Any]], title: str) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    configs = sorted({(r["procs"], r["per_gpu"]) for r in rows})
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4.2), squeeze=False)
    series = [("cudaMalloc", "all_s", "cudaMalloc: usable", "tab:red"),
              ("vmm", "first_s", "VMM: first slot usable", "tab:green"),
              ("vmm", "all_s", "VMM: all mapped (background)", "tab:olive"),
              ("vmm_sync", "all_s", "VMM: all mapped (no thread)", "tab:gray")]
    for ax, (procs, per_gpu) in zip(axes[0], configs):
        mine = [r for r in rows if (r["procs"], r["per_gpu"]) == (procs, per_gpu)]
        sizes = sorted({r["nbytes"] for r in mine})
        w = 0.8 / len(series)
        for k, (method, key, label, color) in enumerate(series):
            vals = []
            for s in sizes:
                m = [r for r in mine if r["nbytes"] == s and r["method"] == method]
                vals.append(m[0][key] * 1e3 if m and m[0][key] == m[0][key] else 0.0)
            xs = [i + (k - (len(series) - 1) / 2) * w for i in range(len(sizes))]
            bars = ax.bar(xs, vals, w, label=label, color=color)
            ax.bar_label(bars, labels=[fmt(v, ".3g") for v in vals], fontsize=7)
        ax.set_xticks(range(len(sizes)), [fmt_bytes(s) + "iB" for s in sizes])
        ax.set_yscale("log")
        ax.set_ylabel("ms from start (slowest process)")
        ax.set_title(f"{procs} process(es) at once, {per_gpu} per GPU")
        ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 60 * len(configs)), fontsize=9)
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16G,32G,64G")
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--share-gpu", action="store_true", help="all processes on GPU 0")
    ap.add_argument("--chunk", default="256M")
    ap.add_argument("--slot", default="64M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per configuration")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--append", action="store_true", help="add to an existing JSON of the same tag")
    ap.add_argument("--replot", default=None, metavar="JSON", help="redraw the PNG of a result file; measure nothing")
    args = ap.parse_args()
    if args.replot:
        import json

        with open(args.replot) as f:
            res = json.load(f)
        plot(args.replot.removesuffix(".json") + ".png", res["summary"],
             f"Device cache start-up on {res['gpu']}: one cudaMalloc vs VMM arena (slot {fmt_bytes(res['slot_bytes'])}, "
             f"chunk {fmt_bytes(res['chunk_bytes'])})")
        return 0
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    slot, chunk = parse_bytes(args.slot), parse_bytes(args.chunk)
    ngpu = gpu_count()
    if ngpu == 0:
        print("device_cache_init: needs a CUDA GPU (none visible); nothing measured.")
        return 0
    devices = [0 if args.share_gpu else r % ngpu for r in range(args.procs)]
    per_gpu = max(devices.count(d) for d in set(devices))
    ctx = mp.get_context("fork")

    probe = run_config(ctx, 1, [0], "cudaMalloc", 2 << 20, 1 << 20, 2 << 20, args.timeout)[0]
    if "error" in probe:
        print("device_cache_init: probe failed:", probe["error"], probe.get("trace", ""))
        return 1
    gpu, free0 = probe["gpu"], probe["free_before"]
    tag = args.tag or gpu.replace("NVIDIA", "").split()[0].lower()
    print(f"GPU: {gpu} x{ngpu} visible; {args.procs} process(es), {per_gpu} per GPU; free {free0 / GiB:.1f} GiB; "
          f"slot {fmt_bytes(slot)}, chunk {fmt_bytes(chunk)}", flush=True)

    results: list[dict[str, Any]] = []
    for nbytes in sizes:
        if per_gpu * nbytes > 0.95 * free0:
            print(f"skip {fmt_bytes(nbytes)}: {per_gpu} x {fmt_bytes(nbytes)} does not fit in {free0 / GiB:.1f} GiB free")
            continue
        for rep in range(args.reps):
            for method in methods:  # interleaved, so drifts hit every method alike
                recs = run_config(ctx, args.procs, devices, method, nbytes, slot, chunk, args.timeout)
                results.append({"procs": args.procs, "per_gpu": per_gpu, "nbytes": nbytes,
                                "method": method, "rep": rep, "workers": recs})
                errs = [r["error"] for r in recs if "error" in r]
                mx = {k: max((r.get(k, float("nan")) for r in recs), default=float("nan"))
                      for k in ("first_s", "all_s")}
                print(f"  {fmt_bytes(nbytes):>5} {method:<10} rep {rep}: first {fmt(mx['first_s'] * 1e3, '.2f')} ms, "
                      f"all {fmt(mx['all_s'] * 1e3, '.2f')} ms" + (f"  ERROR {errs[0]}" if errs else ""), flush=True)

    d = out_dir(args.out)
    jpath = os.path.join(d, f"device_cache_{tag}.json")
    old: list[dict[str, Any]] = []
    if args.append and os.path.exists(jpath):
        import json

        with open(jpath) as f:
            old = json.load(f).get("runs", [])
    runs = old + results
    rows = summarize(runs)
    header = ["procs", "/GPU", "size", "method", "create ms", "first usable ms", "last slot ms", "all mapped ms", "free ms",
              "first: cudaMalloc/x", "all: x/cudaMalloc", "reps"]
    table = [[str(r["procs"]), str(r["per_gpu"]), fmt_bytes(r["nbytes"]) + "iB", r["method"], fmt(r["create_s"] * 1e3, ".2f"),
              fmt(r["first_s"] * 1e3, ".2f"), fmt(r["last_s"] * 1e3, ".1f"), fmt(r["all_s"] * 1e3, ".1f"),
              fmt(r["free_s"] * 1e3, ".1f"), fmt(r["first_speedup_vs_cudaMalloc"], ".1f"),
              fmt(r["all_ratio_vs_cudaMalloc"], ".2f"), str(r["reps"])] for r in rows]
    print()
    print(f"Device cache start-up on {gpu} (slowest process of each run; median of reps)")
    print_table(header, table)
    for r in rows:
        if r["errors"]:
            print(f"errors ({r['procs']} procs, {fmt_bytes(r['nbytes'])}, {r['method']}): {r['errors']}")
    write_json(jpath, {"gpu": gpu, "gpus_visible": ngpu, "slot_bytes": slot, "chunk_bytes": chunk,
                       "torch": torch.__version__, "summary": rows, "runs": runs})
    plot(os.path.join(d, f"device_cache_{tag}.png"), rows,
         f"Device cache start-up on {gpu}: one cudaMalloc vs VMM arena (slot {fmt_bytes(slot)}, chunk {fmt_bytes(chunk)})")
    return 0 if all(not r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
