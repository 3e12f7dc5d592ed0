"""Several GPUs of one node: serialized versus parallel host-memory registration.

One process per GPU (``torch.multiprocessing`` spawn, no torchrun), all starting together at a
barrier; each runs ``host_init.py``'s checkpoint/restore workload for one compute interval with
its own lazily pinned pool (``--count`` x ``--ckpt`` bytes), either

  serialized  every ``cudaHostRegister`` of the node under the /dev/shm flock
              (NOTE [ Node registration lock ]), one process registering at a time, or
  parallel    no lock: every process registers whenever its chunks are touched.

For each approach (``chunked``: torchckpt's per-chunk registration; ``whole``: the HiPC'22
paper's touch-everything-then-register-once) it reports, per process, the time from creating the
pool until all of it was registered, the checkpoint and checkpoint+restore blocking time, and
the time spent waiting for the lock. The paper measured serialized registration 6.4x faster on
average than parallel.

    python benchmarks/host_init_multi.py --procs 2 [--count 256] [--ckpt 128M] [--interval 5]
        [--approaches chunked,whole] [--modes serialized,parallel] [--tag h200x2] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import host_init  # noqa: E402
from common import GiB, fmt, out_dir, parse_bytes, print_table, write_json  # noqa: E402
from torchckpt._native import host_pool_can_register  # noqa: E402


def worker(rank: int, args: argparse.Namespace, approach: str, mode: str, barrier: Any, q: Any) -> None:
    try:
        torch.cuda.set_device(rank)
        h = host_init.Harness(args)
        a = host_init.make_approach(approach, args, node_lock=(mode == "serialized"))
        barrier.wait()
        t = time.perf_counter()
        r = h.run(a, args.interval)
        if isinstance(a, host_init.Lazy):
            a.pool.wait_ready()
            s = a.pool.lazy_stats()
            r.update(all_registered_s=s.all_registered_s, lock_wait_s=s.lock_wait_s, register_s=s.register_s,
                     touch_s=s.touch_s, failed_chunks=s.failed_chunks)
        a.close()
        r.update(rank=rank, mode=mode, wall_s=time.perf_counter() - t, gpu=torch.cuda.get_device_name(rank))
        q.put(r)
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        q.put({"rank": rank, "mode": mode, "approach": approach, "error": repr(e)})
        barrier.abort()


def run_group(args: argparse.Namespace, approach: str, mode: str) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(args.procs)
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, approach, mode, barrier, q)) for r in range(args.procs)]
    for p in procs:
        p.start()
    out = [q.get() for _ in procs]
    for p in procs:
        p.join()
    return sorted(out, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=None, help="processes, one per GPU (default: every GPU)")
    ap.add_argument("--count", type=int, default=256)
    ap.add_argument("--ckpt", type=parse_bytes, default=128 << 20)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--chunk", type=parse_bytes, default=1 << 30)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--strategy", default="auto", choices=("auto", "concurrent", "sequential"))
    ap.add_argument("--approaches", default="chunked,whole")
    ap.add_argument("--modes", default="serialized,parallel")
    ap.add_argument("--warmup", action="store_true",
                    help="first run one untimed group (chunked, parallel): the first touch of memory a virtual machine "
                         "has not backed yet is several times slower (measured on 2 x H200) and would bias whichever "
                         "group runs first")
    ap.add_argument("--reps", type=int, default=1,
                    help="repeat every group; odd repetitions run the modes in reverse order (no order bias)")
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not host_pool_can_register():
        print("host_init_multi needs CUDA and torchckpt._C built with the CUDA host pool; nothing to measure here.")
        return 0
    ngpu = torch.cuda.device_count()
    args.procs = args.procs or ngpu
    if args.procs > ngpu:
        raise SystemExit(f"--procs {args.procs} but only {ngpu} GPUs")
    out = out_dir(args.out)
    meta = {"gpus": [torch.cuda.get_device_name(i) for i in range(args.procs)], "procs": args.procs,
            "count": args.count, "ckpt": args.ckpt, "slots": args.slots, "chunk": args.chunk,
            "interval_ms": args.interval, "strategy": args.strategy, "cpus": os.cpu_count(),
            "pool_bytes_per_process": args.count * args.ckpt}
    print(f"{args.procs} x {meta['gpus'][0]}: {args.count * args.ckpt / GiB:.1f} GiB pool per process, "
          f"interval {args.interval:g} ms", flush=True)
    results: list[dict[str, Any]] = []
    ok = True
    modes = [m for m in args.modes.split(",") if m]
    groups = [(rep, approach, mode) for rep in range(args.reps) for approach in [a for a in args.approaches.split(",") if a]
              for mode in (modes if rep % 2 == 0 else modes[::-1])]
    if args.warmup:
        warm = run_group(args, "chunked", "parallel")
        print("warm-up (not counted): " + "; ".join(
            f"rank {r['rank']} registered in {fmt(r.get('all_registered_s'), '.2f')} s, touch "
            f"{fmt(r.get('touch_s'), '.2f')} s" for r in warm if "error" not in r), flush=True)
        meta["warmup"] = warm
    for rep, approach, mode in groups:
        rs = run_group(args, approach, mode)
        for r in rs:
            r["rep"] = rep
        for r in rs:
            if "error" in r:
                print(f"rank {r['rank']} {approach}/{mode} failed: {r['error']}")
                ok = False
            elif r.get("wrong_bytes_sampled"):
                print(f"WRONG DATA rank {r['rank']} {approach}/{mode}")
                ok = False
        results += rs
        good = [r for r in rs if "error" not in r]
        print(f"rep {rep} {approach}/{mode}: " + "; ".join(
            f"rank {r['rank']} registered in {fmt(r.get('all_registered_s'), '.2f')} s, ckpt block "
            f"{r['ckpt_blocking_s']:.3f} s, +restore {r['total_blocking_s']:.3f} s, lock wait "
            f"{fmt(r.get('lock_wait_s'), '.2f')} s" for r in good), flush=True)
    rows, summary = [], []
    for approach in dict.fromkeys(r["approach"] for r in results if "error" not in r):
        per_mode = {}
        for mode in dict.fromkeys(r["mode"] for r in results):
            rs = [r for r in results if r.get("approach") == approach and r["mode"] == mode and "error" not in r]
            if not rs:
                continue
            reg = [r["all_registered_s"] for r in rs if r.get("all_registered_s") is not None]
            per_rep = [max(r["all_registered_s"] for r in rs if r.get("rep") == k and r.get("all_registered_s") is not None)
                       for k in sorted({r.get("rep", 0) for r in rs if r.get("all_registered_s") is not None})]
            s = {"approach": approach, "mode": mode, "max_all_registered_s": statistics.mean(per_rep) if per_rep else None,
                 "per_rep_max_all_registered_s": per_rep,
                 "mean_all_registered_s": statistics.mean(reg) if reg else None,
                 "mean_ckpt_blocking_s": statistics.mean(r["ckpt_blocking_s"] for r in rs),
                 "mean_total_blocking_s": statistics.mean(r["total_blocking_s"] for r in rs),
                 "mean_lock_wait_s": statistics.mean(r.get("lock_wait_s") or 0.0 for r in rs)}
            per_mode[mode] = s
            summary.append(s)
            rows.append([approach, mode, fmt(s["max_all_registered_s"], ".2f"), fmt(s["mean_all_registered_s"], ".2f"),
                         fmt(s["mean_ckpt_blocking_s"], ".3f"), fmt(s["mean_total_blocking_s"], ".3f"),
                         fmt(s["mean_lock_wait_s"], ".2f")])
        if "serialized" in per_mode and "parallel" in per_mode:
            a, b = per_mode["serialized"], per_mode["parallel"]
            if a["max_all_registered_s"] and b["max_all_registered_s"]:
                a["parallel_over_serialized_registration"] = b["max_all_registered_s"] / a["max_all_registered_s"]
    print()
    print_table(["approach", "registration", "all registered (max over ranks, mean over reps) s", "(mean) s", "ckpt block s", "ckpt+restore s",
                 "lock wait s"], rows)
    for s in summary:
        if "parallel_over_serialized_registration" in s:
            print(f"{s['approach']}: parallel / serialized time to fully registered = "
                  f"{s['parallel_over_serialized_registration']:.2f}x")
    write_json(os.path.join(out, f"host_init_multi_{args.tag}.json"), {"meta": meta, "summary": summary,
                                                                        "results": results})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
