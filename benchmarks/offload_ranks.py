"""Several GPUs offloading through one host: each rank's pinned copy bandwidth alone and with the others copying,
and whether the planner's link figure on each rank sees the shared traffic (issue 25).

Launched once, it starts one process per GPU (``torch.multiprocessing`` spawn, no torchrun) with a gloo process
group used for barriers only (CPU-side, nothing on the GPUs' streams). Per rank, copies of ``--size`` bytes between
the GPU and a pinned host buffer, device-to-host (D2H) and host-to-device (H2D), timed by CUDA events:

  alone     each rank in turn copies, ``--reps`` times each way, while the others wait at a barrier;
  together  every rank copies at the same moment: a barrier before each of the ``--reps`` copies; the node's
            aggregate is every rank's bytes over the host-clock span from the first start to the last end.

``--rounds`` repeats both, in alternating order (no order bias); the medians count. Then the planner's own link
measurement, ``torchckpt.planner.measure.measure_link`` (the one ``host_link`` measurement: 64 MiB copies, median of
5 each way), which is measured once per process, so each measurement runs in fresh processes:

  planner alone     each rank in turn calls it while the others wait;
  planner together  every rank calls ``measure_link(device)`` after a barrier, as ranks planning together do
                    (NOTE [ One plan for all ranks ] Rule 9); the host-clock windows of the calls give their overlap.

``--planner-reps`` pairs of such process groups (alternating order). The first group also runs the copies. Prints
the tables (GB/s = 1e9 bytes/s; the ratio together/alone per rank and direction, the mean over ranks) and writes
``offload_ranks_<tag>.json`` and ``offload_ranks_<tag>.png`` to ``--out`` (default ``$OUT``, else
benchmarks/results). ``--cpu`` runs the same harness on the CPU as a smoke test (memory copies; figures mean
nothing). Fewer GPUs than ``--gpus`` is a ``torchckpt:`` error.

    python benchmarks/offload_ranks.py [--gpus 2] [--size 256MiB] [--reps 10] [--rounds 2] [--planner-reps 2]
                                       [--tag h100x2] [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # the repo, when torchckpt is not installed

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from common import fmt, out_dir, parse_bytes, print_table, pyplot, save_figure, write_json  # noqa: E402
from torchckpt.planner.measure import measure_link  # noqa: E402

GB = 1e9
DIRECTIONS = ("d2h", "h2d")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_gpus(wanted: int, found: int) -> None:
    """Exit with a ``torchckpt:`` message when fewer than ``wanted`` GPUs are visible."""
    if found < wanted:
        raise SystemExit(
            f"torchckpt: offload_ranks.py --gpus {wanted} needs {wanted} CUDA GPUs on this host, found {found} "
            f"(torch.cuda.is_available() is {torch.cuda.is_available()}); "
            + (f"pass --gpus {found}, or run it " if found else "run it ")
            + f"on a machine with {wanted} GPUs (--cpu: a smoke test of the harness without any).")


def copy_seconds(host: torch.Tensor, gpu: torch.Tensor, direction: str) -> float:
    """One copy's time by CUDA events on the current stream (the host clock for ``--cpu``'s memory copies)."""
    if gpu.device.type == "cpu":
        t0 = time.perf_counter()
        (host.copy_(gpu) if direction == "d2h" else gpu.copy_(host))
        return time.perf_counter() - t0
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    if direction == "d2h":
        host.copy_(gpu, non_blocking=True)
    else:
        gpu.copy_(host, non_blocking=True)
    b.record()
    b.synchronize()
    return float(a.elapsed_time(b)) / 1e3


def copies(rank: int, n: int, dev: torch.device, size: int, reps: int, rounds: int) -> dict[str, Any]:
    """Seconds of each copy, alone and together, per direction; host-clock windows of the together copies."""
    host = torch.empty(size, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    gpu = torch.ones(size, dtype=torch.uint8, device=dev)
    for d in DIRECTIONS:  # warm-up
        copy_seconds(host, gpu, d)
    out: dict[str, Any] = {p: {d: [] for d in DIRECTIONS} for p in ("alone", "together")}
    out["windows"] = {d: [] for d in DIRECTIONS}
    for rnd in range(rounds):
        for phase in ("alone", "together") if rnd % 2 == 0 else ("together", "alone"):
            for d in DIRECTIONS:
                if phase == "alone":
                    for r in range(n):
                        dist.barrier()
                        if r == rank:
                            out["alone"][d] += [copy_seconds(host, gpu, d) for _ in range(reps)]
                    dist.barrier()
                else:
                    for _ in range(reps):
                        dist.barrier()
                        w0 = time.time()
                        out["together"][d].append(copy_seconds(host, gpu, d))
                        out["windows"][d].append((w0, time.time()))
    del host, gpu
    return out


def worker(rank: int, n: int, port: int, mode: str, opts: dict[str, Any], tmp: str) -> None:
    dev = torch.device("cpu") if opts["cpu"] else torch.device("cuda", rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=120))
    try:
        res: dict[str, Any] = {"rank": rank, "mode": mode, "gpu": "cpu (smoke test)"}
        if dev.type == "cuda":
            torch.zeros(1, device=dev)  # the CUDA context, before any timing
            torch.cuda.synchronize()
            res["gpu"] = torch.cuda.get_device_name(dev)
        link, t0, t1 = None, 0.0, 0.0
        if mode == "together":
            dist.barrier()  # as the planner's ready() exchange before it measures (NOTE [ One plan for all ranks ] Rule 9)
            t0 = time.time()
            link = measure_link(dev)
            t1 = time.time()
        else:
            for r in range(n):
                dist.barrier()
                if r == rank:
                    t0 = time.time()
                    link = measure_link(dev)
                    t1 = time.time()
            dist.barrier()
        assert link is not None  # every rank measured in its turn
        res["planner"] = {"d2h": link.d2h, "h2d": link.h2d, "window": (t0, t1)}
        if opts["copies"]:
            res["copies"] = copies(rank, n, dev, opts["size"], opts["reps"], opts["rounds"])
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_group(n: int, mode: str, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Spawn ``n`` fresh processes for one group; their results, by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(n, free_port(), mode, opts, tmp), nprocs=n, join=True)
        out = []
        for r in range(n):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                out.append(json.load(f))
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def overlap(windows: list[tuple[float, float]]) -> float:
    """The share of the longest window during which every window was open (1: all at once, 0: none shared)."""
    start, end = max(w[0] for w in windows), min(w[1] for w in windows)
    longest = max(w[1] - w[0] for w in windows)
    return max(0.0, end - start) / longest if longest > 0 else float("nan")


def summarize(copy_res: list[dict[str, Any]], planner: dict[str, list[list[dict[str, Any]]]], size: int) -> dict[str, Any]:
    """Per rank and direction: GB/s alone and together (copies, planner), their ratios; node aggregates."""
    n = len(copy_res)
    ranks = []
    for r in range(n):
        c = copy_res[r]["copies"]
        row: dict[str, Any] = {"rank": r, "gpu": copy_res[r]["gpu"]}
        for d in DIRECTIONS:
            alone, tog = size / median(c["alone"][d]) / GB, size / median(c["together"][d]) / GB
            pa = [g[r]["planner"][d] / GB for g in planner["alone"]]
            pt = [g[r]["planner"][d] / GB for g in planner["together"]]
            row[d] = {"copy_alone_GBps": alone, "copy_together_GBps": tog, "copy_ratio": tog / alone,
                      "planner_alone_GBps": median(pa), "planner_together_GBps": median(pt),
                      "planner_alone_each": pa, "planner_together_each": pt,
                      "planner_ratio": median(pt) / median(pa),
                      "planner_together_over_copy_together": median(pt) / tog}
        ranks.append(row)
    node: dict[str, Any] = {}
    for d in DIRECTIONS:
        per_rep = []
        for k in range(len(copy_res[0]["copies"]["windows"][d])):
            ws = [copy_res[r]["copies"]["windows"][d][k] for r in range(n)]
            per_rep.append((n * size / (max(w[1] for w in ws) - min(w[0] for w in ws)) / GB, overlap(ws)))
        alone_sum = sum(x[d]["copy_alone_GBps"] for x in ranks)
        node[d] = {"aggregate_together_GBps": median([a for a, _ in per_rep]),
                   "together_copy_overlap": median([o for _, o in per_rep]),
                   "sum_alone_GBps": alone_sum,
                   "mean_copy_ratio": statistics.mean(x[d]["copy_ratio"] for x in ranks),
                   "mean_planner_ratio": statistics.mean(x[d]["planner_ratio"] for x in ranks),
                   "lowest_planner_together_GBps": min(x[d]["planner_together_GBps"] for x in ranks),
                   "lowest_planner_alone_GBps": min(x[d]["planner_alone_GBps"] for x in ranks)}
    windows = [overlap([tuple(g[r]["planner"]["window"]) for r in range(n)]) for g in planner["together"]]
    return {"ranks": ranks, "node": node, "planner_together_window_overlap": windows}


def print_tables(s: dict[str, Any], n: int) -> None:
    rows = []
    for x in s["ranks"]:
        for d in DIRECTIONS:
            v = x[d]
            rows.append([str(x["rank"]), d.upper(), fmt(v["copy_alone_GBps"], ".2f"), fmt(v["copy_together_GBps"], ".2f"),
                         fmt(v["copy_ratio"], ".2f"), fmt(v["planner_alone_GBps"], ".2f"),
                         fmt(v["planner_together_GBps"], ".2f"), fmt(v["planner_ratio"], ".2f"),
                         fmt(v["planner_together_over_copy_together"], ".2f")])
    print()
    print_table(["rank", "dir", "copy alone GB/s", "copy together GB/s", "together/alone",
                 "planner alone GB/s", "planner together GB/s", "together/alone", "planner together/copy together"],
                rows)
    print()
    rows = []
    for d in DIRECTIONS:
        v = s["node"][d]
        rows.append([d.upper(), fmt(v["sum_alone_GBps"], ".2f"), fmt(v["aggregate_together_GBps"], ".2f"),
                     fmt(v["aggregate_together_GBps"] / v["sum_alone_GBps"], ".2f"), fmt(v["together_copy_overlap"], ".2f"),
                     fmt(v["mean_copy_ratio"], ".2f"), fmt(v["mean_planner_ratio"], ".2f"),
                     fmt(v["lowest_planner_alone_GBps"], ".2f"), fmt(v["lowest_planner_together_GBps"], ".2f")])
    print_table(["dir", f"sum of {n} alone GB/s", "node aggregate together GB/s", "aggregate/sum", "copy overlap",
                 "mean copy together/alone", "mean planner together/alone", "lowest planner alone GB/s",
                 "lowest planner together GB/s"], rows)
    print("planner together: overlap of the ranks' measure_link windows per group: "
          + ", ".join(fmt(o, ".2f") for o in s["planner_together_window_overlap"]))


def plot(path: str, s: dict[str, Any], title: str) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    labels = [f"rank {x['rank']} {d.upper()}" for x in s["ranks"] for d in DIRECTIONS]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    for ax, (what, name) in zip(axes[0], (("copy", "pinned copies"), ("planner", "planner's measure_link"))):
        xs = range(len(labels))
        for off, phase, color in ((-0.2, "alone", "tab:blue"), (0.2, "together", "tab:orange")):
            vals = [x[d][f"{what}_{phase}_GBps"] for x in s["ranks"] for d in DIRECTIONS]
            bars = ax.bar([i + off for i in xs], vals, width=0.4, color=color, label=phase)
            ax.bar_label(bars, labels=[fmt(v, ".1f") for v in vals], fontsize=7)
        ax.set_xticks(list(xs), labels, rotation=30, ha="right")
        ax.set_ylabel("GB/s per rank")
        ax.set_title(name)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2, help="processes, one per GPU (default 2)")
    ap.add_argument("--size", type=parse_bytes, default=256 << 20, help="bytes per copy (default 256MiB)")
    ap.add_argument("--reps", type=int, default=10, help="copies timed per rank, direction, phase and round")
    ap.add_argument("--rounds", type=int, default=2, help="alone/together rounds, alternating order")
    ap.add_argument("--planner-reps", type=int, default=2,
                    help="pairs of fresh process groups measuring the planner's link alone and together")
    ap.add_argument("--cpu", action="store_true",
                    help="a smoke test of the harness on the CPU (memory copies, gloo; the figures mean nothing)")
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for name in ("gpus", "size", "reps", "rounds", "planner_reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.cpu:
        check_gpus(args.gpus, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    out = out_dir(args.out)
    n = args.gpus
    t_start = time.perf_counter()
    opts = {"size": args.size, "reps": args.reps, "rounds": args.rounds, "copies": False, "cpu": args.cpu}
    planner: dict[str, list[list[dict[str, Any]]]] = {"alone": [], "together": []}
    copy_res: list[dict[str, Any]] = []
    for rep in range(args.planner_reps):
        for mode in ("alone", "together") if rep % 2 == 0 else ("together", "alone"):
            first = not copy_res
            got = run_group(n, mode, dict(opts, copies=first))
            planner[mode].append(got)
            if first:
                copy_res = got
            print(f"group {rep} {mode}: planner link " + "; ".join(
                f"rank {g['rank']} D2H {g['planner']['d2h'] / GB:.2f} H2D {g['planner']['h2d'] / GB:.2f} GB/s"
                for g in got) + f" ({time.perf_counter() - t_start:.0f} s)", flush=True)
    s = summarize(copy_res, planner, args.size)
    gpu = copy_res[0]["gpu"]
    print(f"\n{n} x {gpu}, {args.size / (1 << 20):g} MiB copies, {args.reps} reps x {args.rounds} rounds; "
          f"planner: measure_link, {args.planner_reps} groups each way")
    print_tables(s, n)
    meta = {"gpus": [g["gpu"] for g in copy_res], "n": n, "size": args.size, "reps": args.reps, "rounds": args.rounds,
            "planner_reps": args.planner_reps, "host": socket.gethostname(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "wall_s": time.perf_counter() - t_start}
    write_json(os.path.join(out, f"offload_ranks_{args.tag}.json"),
               {"meta": meta, "summary": s, "copies": copy_res, "planner": planner})
    plot(os.path.join(out, f"offload_ranks_{args.tag}.png"), s,
         f"{n} x {gpu}: per-rank host link alone vs all ranks at once ({args.size / (1 << 20):g} MiB copies)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
