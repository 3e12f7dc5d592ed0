"""A lazily pinned pool made right after a large pinned region was freed: what slows it, and why.

Question (docs/benchmarks.md, "Both orders of the lazy approaches ... (runs 6-7)"): twice on H100
machines, the first chunked ``LazyHostPool`` made right after ``cudaHostAlloc`` memory of the same
size was freed touched 3-5x slower than usual. Does freeing pinned memory cause that? This script
runs a ``--sequence`` of steps in one process and, around each, reads the kernel's counters
(``/proc/vmstat``: page migration, compaction, huge-page faults, allocations per zone) and each
zone's free memory (``/proc/zoneinfo``), so that a cause would show as numbers. On the H100 it
ran on, it found none: every pool touched 32 GiB in 2.6-2.9 s (``docs/results/after_pin_h100.json``).

Steps (comma-separated, run in order):
  pin        ``torch.empty(--size, pin_memory=True)`` (``cudaHostAlloc``), then freed
  chunked    ``LazyHostPool`` of ``--size``, strategy concurrent, waited until all registered, closed
  whole      the same with strategy "whole" (touch all, then one ``cudaHostRegister``)
  touch      the same with no registration (touch only)
  idleN      sleep N seconds

    python benchmarks/after_pin.py [--size 32G] [--sequence pin,chunked,chunked,pin,whole,...] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

import torch
from common import GiB, out_dir, parse_bytes, print_table, write_json

from torchckpt.memory.lazy_pool import LazyHostPool

COUNTERS = ("pgmigrate_success", "pgmigrate_fail", "compact_stall", "compact_migrate_scanned", "compact_free_scanned",
            "compact_success", "thp_fault_alloc", "thp_fault_fallback", "pgalloc_normal", "pgalloc_movable",
            "pgalloc_dma32", "pgfault", "numa_hint_faults", "thp_migration_success", "thp_split_page")


def vmstat() -> dict[str, int]:
    try:
        with open("/proc/vmstat") as f:
            return {k: int(v) for k, v in (line.split() for line in f) if k in COUNTERS}
    except OSError:
        return {}


def zone_free_gib() -> dict[str, float]:
    """Free memory of each populated zone, GiB (``/proc/zoneinfo``)."""
    out: dict[str, float] = {}
    zone = None
    try:
        with open("/proc/zoneinfo") as f:
            for line in f:
                parts = line.split()
                if line.startswith("Node"):
                    zone = f"{parts[1].rstrip(',')}:{parts[3]}"
                elif zone and len(parts) >= 3 and parts[0] == "pages" and parts[1] == "free":
                    out[zone] = int(parts[2]) * os.sysconf("SC_PAGE_SIZE") / GiB
    except (OSError, ValueError, IndexError):
        pass
    return {k: round(v, 2) for k, v in out.items() if v > 0}


def step(name: str, size: int) -> dict[str, Any]:
    if name.startswith("idle"):
        time.sleep(float(name[4:]))
        return {}
    if name == "pin":
        t = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        del t
        torch._C._host_emptyCache()
        return {}
    mode = {"chunked": ("concurrent", "cuda"), "whole": ("whole", "cuda"), "touch": ("concurrent", "none")}.get(name)
    if mode is None:
        raise SystemExit(f"torchckpt: unknown step {name!r}; pass pin, chunked, whole, touch or idleN")
    pool = LazyHostPool(capacity_bytes=size, chunk_bytes=1 << 30, first_chunk_bytes=128 << 20, strategy=mode[0],
                        register_mode=mode[1], node_lock=False, pin=mode[1] == "cuda")
    pool.wait_ready()
    s = pool.lazy_stats()
    pool.close()
    return {"touch_s": s.touch_s, "register_s": s.register_s, "all_registered_s": s.all_registered_s,
            "huge_page_bytes": s.huge_page_bytes, "failed_chunks": s.failed_chunks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_bytes, default=32 * GiB)
    ap.add_argument("--sequence", default="pin,chunked,chunked,pin,whole,chunked,pin,touch,chunked,pin,idle15,chunked")
    ap.add_argument("--tag", default="h100")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("after_pin needs a CUDA device (it frees cudaHostAlloc memory); nothing to measure here.")
        return 0
    out = out_dir(args.out)
    torch.zeros(1, device="cuda")  # the context first: not part of any step
    runs, rows = [], []
    for k, name in enumerate(args.sequence.split(",")):
        before, free = vmstat(), zone_free_gib()
        t = time.perf_counter()
        r = step(name, args.size)
        wall = time.perf_counter() - t
        delta = {c: v - before.get(c, 0) for c, v in vmstat().items()}
        r.update(step=name, index=k, wall_s=wall, zone_free_gib_before=free, vmstat_delta=delta)
        runs.append(r)
        mig = delta.get("pgmigrate_success", 0) * 4096 / GiB
        print(f"{k:2d} {name:8s} {wall:6.2f} s  touch {r.get('touch_s', 0):5.2f}  register {r.get('register_s', 0):5.2f}  "
              f"migrated {mig:6.2f} GiB  compact stalls {delta.get('compact_stall', 0)}  "
              f"thp faults {delta.get('thp_fault_alloc', 0)} (fallback {delta.get('thp_fault_fallback', 0)})  "
              f"free before {free}", flush=True)
        rows.append([str(k), name, f"{wall:.2f}", f"{r.get('touch_s', 0):.2f}", f"{r.get('register_s', 0):.2f}",
                     f"{mig:.2f}", str(delta.get("compact_stall", 0)),
                     f"{delta.get('pgalloc_normal', 0) * 4096 / GiB:.1f}/{delta.get('pgalloc_movable', 0) * 4096 / GiB:.1f}"])
    print(f"\n{args.size / GiB:g} GiB on {torch.cuda.get_device_name()}")
    print_table(["#", "step", "wall s", "touch s", "register s", "migrated GiB", "compact stalls",
                 "alloc normal/movable GiB"], rows)
    write_json(os.path.join(out, f"after_pin_{args.tag}.json"),
               {"meta": {"size": args.size, "gpu": torch.cuda.get_device_name(), "sequence": args.sequence,
                         "kernel": os.uname().release}, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
