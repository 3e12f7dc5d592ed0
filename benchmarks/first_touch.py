"""First touch of host memory: how fast a LazyHostPool's pages are touched, fresh and after idling.

Claim (docs/benchmarks.md, "the order of approaches matters"): on a virtual machine whose
balloon reports free pages to its host, memory freed a few seconds ago is faulted in again on
first touch, several times slower than memory freed just before; huge pages are not the cause.

Creates a ``--size`` pool (no registration: ``register_mode="none"``, so it runs without a GPU),
waits until every page is touched, reads how much the kernel backs with huge pages, closes it;
``--reps`` times in a row, then sleeps ``--idle`` seconds, then ``--reps`` times again. Prints the
touch rate of each pool and whether this machine's virtio balloon reports free pages.

    python benchmarks/first_touch.py [--size 4G] [--reps 3] [--idle 15] [--tag cpu] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from common import GiB, out_dir, parse_bytes, print_table, write_json  # noqa: E402
from torchckpt._native import host_pool_available  # noqa: E402
from torchckpt.env import balloon_reporting  # noqa: E402
from torchckpt.memory.lazy_pool import LazyHostPool  # noqa: E402


def one_pool(size: int) -> dict[str, Any]:
    t = time.perf_counter()
    pool = LazyHostPool(capacity_bytes=size, chunk_bytes=1 << 30, first_chunk_bytes=1 << 30, register_mode="none",
                        strategy="concurrent", node_lock=False)
    pool.wait_ready()
    wall = time.perf_counter() - t
    s = pool.lazy_stats()
    pool.close()
    return {"wall_s": wall, "touch_s": s.touch_s, "touch_gibps": size / GiB / max(s.touch_s, 1e-9),
            "huge_page_bytes": s.huge_page_bytes, "huge_pages_advised": s.huge_pages}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_bytes, default=4 * GiB)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--idle", type=float, default=15.0)
    ap.add_argument("--tag", default=platform.node() or "run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not host_pool_available():
        print("first_touch needs torchckpt._C with csrc/host_pool.cpp; nothing to measure here.")
        return 0
    out = out_dir(args.out)
    rows, runs = [], []
    for phase in ("in a row", f"after {args.idle:g} s idle"):
        if runs:
            time.sleep(args.idle)
        for k in range(args.reps):
            r = one_pool(args.size)
            r.update(phase=phase, rep=k)
            runs.append(r)
            hp = r["huge_page_bytes"]
            rows.append([phase, str(k), f"{r['touch_gibps']:.2f}", f"{r['touch_s']:.2f}",
                         "-" if hp is None else f"{hp / args.size:.0%}"])
            print(f"{phase} #{k}: {r['touch_gibps']:.2f} GiB/s", flush=True)
    rep = balloon_reporting()
    meta = {"size": args.size, "reps": args.reps, "idle_s": args.idle, "cpus": os.cpu_count(),
            "kernel": platform.release(), "balloon_free_page_reporting": rep}
    print(f"\n{args.size / GiB:g} GiB LazyHostPool, touched then closed; virtio balloon free page reporting: {rep}")
    print_table(["when", "rep", "touch GiB/s", "touch s", "huge pages"], rows)
    write_json(os.path.join(out, f"first_touch_{args.tag}.json"), {"meta": meta, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
