"""Does a ``cudaHostRegister`` in another thread slow this thread's pinned copies, and where?

Claim (docs/benchmarks.md, "... where the blocking comes from (runs 6-7)"): while a background
thread registers host memory, a checkpoint's device-to-host copy into memory that is *already*
pinned is held up. This script separates the two places it could be held up:

* host: how long the CUDA calls that enqueue the copy take (an API call waiting on the driver);
* device: how long the copy itself runs on the GPU, measured between two events enqueued behind a
  ``--lead`` ms GPU sleep, so that the enqueue has finished before the copy starts and host stalls
  do not count (unless one outlasts the lead: then it is reported as such).

Phases, each ``--reps`` copies of ``--size`` into a pinned buffer (D2H):
  idle              nothing else runs
  cycle             a thread registers, then unregisters, ``--chunk``-sized pieces of ``--region``
                    bytes of touched pageable memory, back to back, for the whole phase
  register sweep    a thread registers the region once, piece after piece (copies counted only
                    until it is done); what a LazyHostPool's registrar does
  unregister sweep  a thread unregisters those pieces once (copies counted until it is done)
  touch             a thread faults in fresh pageable memory (no CUDA calls), for the whole phase

    python benchmarks/register_stall.py [--size 128M] [--chunk 1G] [--reps 30] [--lead 100] [--region 8G] [--out DIR]
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

import torch
from common import GiB, out_dir, parse_bytes, print_table, write_json
from host_init import Sleeper


class Background(threading.Thread):
    """Runs ``work`` in a loop until stopped (``once``: a single time); counts rounds, keeps the first error."""

    def __init__(self, work: Any, once: bool = False) -> None:
        super().__init__(daemon=True)
        self.work, self.once, self.stop, self.done = work, once, threading.Event(), threading.Event()
        self.rounds, self.error = 0, None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.work(self.stop)
                self.rounds += 1
                if self.once:
                    break
        except RuntimeError as e:  # reported, not swallowed: the phase is then marked invalid
            self.error = repr(e)
        finally:
            self.done.set()


def registrar(buf: torch.Tensor, chunk: int, op: str = "cycle") -> Any:
    """``op``: "register" (one sweep), "unregister" (one sweep) or "cycle" (register all, then unregister all)."""
    rt = torch.cuda.cudart()
    offs = list(range(0, buf.numel() - chunk + 1, chunk))

    def work(stop: threading.Event) -> None:
        base = buf.data_ptr()
        done = []
        if op in ("register", "cycle"):
            for off in offs:
                if stop.is_set():
                    break
                err = rt.cudaHostRegister(base + off, chunk, 0)
                if int(err) != 0:
                    raise RuntimeError(f"torchckpt: cudaHostRegister returned {err}")
                done.append(off)
        if op in ("unregister", "cycle"):
            for off in done if op == "cycle" else offs:
                rt.cudaHostUnregister(base + off)
    return work


def toucher(nbytes: int) -> Any:
    def work(stop: threading.Event) -> None:
        x = torch.empty(nbytes, dtype=torch.uint8)
        x[:: 4096].fill_(1)  # one byte per page: the faults, not the bandwidth
        del x
    return work


def huge_page_region(nbytes: int) -> tuple[torch.Tensor, bool]:
    """Touched anonymous memory advised ``MADV_HUGEPAGE``, as a ``LazyHostPool`` maps it (and whether advised)."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    huge = False
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
            huge = True
        except OSError:
            pass
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(1)
    return t, huge


def measure(src: torch.Tensor, dst: torch.Tensor, reps: int, lead_ms: float, cycles_per_ms: float,
            until: threading.Event | None = None) -> dict[str, Any]:
    """``reps`` timed copies, fewer if ``until`` is set first (a sweep has ended)."""
    host_ms, dev_ms, late = [], [], 0
    for _ in range(reps):
        if until is not None and until.is_set() and host_ms:
            break
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(lead_ms * cycles_per_ms))
        t = time.perf_counter()
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        h = (time.perf_counter() - t) * 1e3
        late += int(h >= lead_ms)  # the enqueue outlasted the lead: its stall may show in the copy's time
        b.synchronize()
        host_ms.append(h)
        dev_ms.append(a.elapsed_time(b))
    gbps = [src.numel() / (d * 1e-3) / 1e9 for d in dev_ms]
    return {"host_ms_median": statistics.median(host_ms), "host_ms_max": max(host_ms),
            "device_ms_median": statistics.median(dev_ms), "device_gbps_median": statistics.median(gbps),
            "device_gbps_min": min(gbps), "enqueue_outlasted_lead": late, "host_ms": host_ms, "device_ms": dev_ms}


def register_cost(buf: torch.Tensor, pieces: list[int], touching: bool) -> list[dict[str, Any]]:
    """Register ``buf`` in pieces of each size back to back (nothing else calling CUDA); time it, then unregister."""
    rt = torch.cuda.cudart()
    out = []
    for piece in pieces:
        bg = Background(toucher(4 * GiB)) if touching else None
        if bg is not None:
            bg.start()
        offs = list(range(0, buf.numel() - piece + 1, piece))
        t = time.perf_counter()
        for off in offs:
            err = rt.cudaHostRegister(buf.data_ptr() + off, piece, 0)
            if int(err) != 0:
                raise RuntimeError(f"torchckpt: cudaHostRegister returned {err}")
        reg = time.perf_counter() - t
        t = time.perf_counter()
        for off in offs:
            rt.cudaHostUnregister(buf.data_ptr() + off)
        unreg = time.perf_counter() - t
        if bg is not None:
            bg.stop.set()
            bg.join()
        n = len(offs) * piece
        out.append({"piece": piece, "calls": len(offs), "touching": touching, "register_s": reg,
                    "register_gibps": n / GiB / reg, "ms_per_call": reg / len(offs) * 1e3, "unregister_s": unreg})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_bytes, default=128 << 20)
    ap.add_argument("--chunk", type=parse_bytes, default=1 << 30)
    ap.add_argument("--region", type=parse_bytes, default=8 * GiB, help="pageable bytes the registrar cycles over")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--lead", type=float, default=100.0, help="ms of GPU sleep enqueued before each timed copy")
    ap.add_argument("--tag", default="h100")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("register_stall needs a CUDA device; nothing to measure here.")
        return 0
    out = out_dir(args.out)
    src = torch.empty(args.size, dtype=torch.uint8, device="cuda").fill_(7)
    dst = torch.empty(args.size, dtype=torch.uint8, pin_memory=True)
    cycles_per_ms = Sleeper(torch.cuda.current_stream()).cycles_per_ms
    region, huge = huge_page_region(args.region)  # touched pageable memory for the registrar, as a LazyHostPool's
    phases = {"idle": None, "cycle": registrar(region, args.chunk),
              "register sweep": registrar(region, args.chunk, "register"),
              "unregister sweep": registrar(region, args.chunk, "unregister"), "touch": toucher(4 * GiB)}
    results: dict[str, Any] = {}
    rows = []
    for name, work in phases.items():
        sweep = name.endswith("sweep")
        bg = Background(work, once=sweep) if work is not None else None
        if bg is not None:
            bg.start()
            time.sleep(0.002 if sweep else 0.05)
        r = measure(src, dst, args.reps, args.lead, cycles_per_ms, bg.done if sweep and bg is not None else None)
        r["copies"] = len(r["host_ms"])
        if bg is not None:
            bg.stop.set()
            bg.join()
            r.update(background_rounds=bg.rounds, background_error=bg.error)
        results[name] = r
        base = results["idle"]
        rows.append([name, f"{r['host_ms_median']:.3f}", f"{r['host_ms_max']:.1f}", f"{r['device_ms_median']:.2f}",
                     f"{r['device_gbps_median']:.1f}", f"{r['device_gbps_min']:.1f}",
                     f"{r['device_ms_median'] / base['device_ms_median']:.2f}",
                     f"{r['enqueue_outlasted_lead']}/{r['copies']}", str(r.get("background_rounds", "-")),
                     r.get("background_error") or ""])
        print(f"{name}: host {r['host_ms_median']:.3f} ms (max {r['host_ms_max']:.1f}), device "
              f"{r['device_gbps_median']:.1f} GB/s (min {r['device_gbps_min']:.1f})", flush=True)
    print(f"\n{args.size >> 20} MiB D2H into pinned memory on {torch.cuda.get_device_name()}, {args.reps} copies per phase; "
          f"registrar: {args.chunk >> 20} MiB pieces of {args.region / GiB:g} GiB ({'huge pages advised' if huge else '4 KiB pages'})")
    print_table(["phase", "enqueue ms (median)", "enqueue ms (max)", "copy ms", "GB/s", "GB/s min", "copy x idle",
                 "enqueue > lead", "bg rounds", "bg error"], rows)
    pieces = sorted({args.region, 4 * GiB, GiB, 256 << 20} - {0}, reverse=True)
    pieces = [p for p in pieces if p <= args.region and args.region % p == 0]
    cost = register_cost(region, pieces, False) + register_cost(region, pieces, True)
    print(f"\nregistering {args.region / GiB:g} GiB of touched memory in pieces, back to back")
    print_table(["piece", "calls", "another thread faulting pages", "register s", "GiB/s", "ms per call", "unregister s"],
                [[f"{c['piece'] >> 20} MiB", str(c["calls"]), "yes" if c["touching"] else "no", f"{c['register_s']:.3f}",
                  f"{c['register_gibps']:.1f}", f"{c['ms_per_call']:.1f}", f"{c['unregister_s']:.3f}"] for c in cost])
    write_json(os.path.join(out, f"register_stall_{args.tag}.json"),
               {"register_cost": cost, "meta": {"size": args.size, "chunk": args.chunk, "region": args.region, "reps": args.reps,
                         "lead_ms": args.lead, "gpu": torch.cuda.get_device_name()}, "phases": results})
    return 0 if not any(r.get("background_error") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
