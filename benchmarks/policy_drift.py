"""Diagnosis (not a claim): why the planner's own measurement of a simple policy differs from the same policy
measured later in the same process (issue 24: on an H100, every block ``Recompute()`` measured 148.7 ms while planning
ConvNeXt-B and 111.7 ms in the zoo's row; keep everything agreed within 1.5%).

For each model of ``benchmarks/architectures.py`` (training size on CUDA, tiny on the CPU): the planner's profile and
its measurements of the simple policies (``_Profiled.prepare``, as ``torchckpt.plans`` runs it), with Python's
collector watched (collections per generation and their time, from ``gc.callbacks``); then, in the same process, every
block ``Recompute()`` and keep everything measured step by step (8 steps after one warm-up, each between two
synchronisations) with the planner's objects alive, then the same after ``gc.collect()``, with the collector off, and
with the planner's objects dropped.

With ``--host`` (and ``--no-plan`` to skip the planner) each step also prints where its time went on the host, to
tell a slower host from waiting: the wall time, the time until ``backward()`` returned (the host's issue time; the
rest is the device's tail), the process's CPU time (every thread), per thread the CPU time and the run-queue wait
(``/proc/self/task/*/schedstat``: time runnable but not running, where the kernel reports it), voluntary and
involuntary context switches, the device's time from the step's start to its forward's end and to its end (CUDA
events; the forward's is the device's own speed, since the host issues it far ahead), the machine's steal time (``/proc/stat``: a virtual machine's CPUs taken by its
host), and the caching allocator's device allocations and frees (``cudaMalloc``/``cudaFree``, which can
synchronise).

    python benchmarks/policy_drift.py [--models convnext,t5] [--steps 8] [--host] [--no-plan] [--series 3] [--reentrant]
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import time
from typing import Any

import torch

import torchckpt
from architectures import build_here
from common import step_times
from torchckpt.planner.restore import untouched
from torchckpt.planner.verify import _Profiled


class GcWatch:
    """Collections per generation and their total time while installed."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            g = info["generation"]
            self.count[g] += 1
            self.seconds[g] += time.perf_counter() - self._t

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self)

    def __str__(self) -> str:
        return (f"collections {self.count} (gen 0/1/2), "
                f"{', '.join(f'{s * 1e3:.1f}' for s in self.seconds)} ms")


def _threads() -> dict[int, tuple[int, int]]:
    """Per thread of this process: (ns on a CPU, ns runnable but waiting), from schedstat; (0, 0) where the kernel
    keeps none (then the CPU time comes from ``stat``'s ticks and the wait reads 0)."""
    out = {}
    tick = 1e9 / os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait, _ = (int(x) for x in f.read().split())
            if run == 0:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                run = int((int(fields[11]) + int(fields[12])) * tick)  # utime + stime
            out[int(tid)] = (run, wait)
        except (OSError, ValueError):
            continue
    return out


def _name(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f"{f.read().strip()}/{tid}"
    except OSError:
        return str(tid)


def _steal() -> tuple[int, int]:
    """The machine's (steal, all) CPU ticks from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    return (vals[7] if len(vals) > 7 else 0), sum(vals)


class HostStep:
    """Where one step's time went on the host (see the module's docstring)."""

    def __init__(self, cuda: bool, marks: list[Any]) -> None:
        self.cuda = cuda
        self.marks = marks  # CUDA events: the step's start, its forward's end, its end (timed on the device)

    def _snap(self) -> tuple[Any, ...]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        mem = torch.cuda.memory_stats() if self.cuda else {}
        return (time.perf_counter(), time.process_time(), _threads(), ru.ru_nvcsw, ru.ru_nivcsw, _steal(),
                mem.get("num_device_alloc", 0), mem.get("num_device_free", 0), mem.get("num_sync_all_streams", 0))

    def run(self, step: Any) -> dict[str, Any]:
        if self.cuda:
            torch.cuda.synchronize()
        a = self._snap()
        at = time.time()
        if self.marks:
            self.marks[0].record()
        step()
        if self.marks:
            self.marks[2].record()
        issued = time.perf_counter()
        if self.cuda:
            torch.cuda.synchronize()
        b = self._snap()
        ev = self.marks
        fwd_dev = ev[0].elapsed_time(ev[1]) / 1e3 if ev else 0.0
        all_dev = ev[0].elapsed_time(ev[2]) / 1e3 if ev else 0.0
        th = []
        for tid, (run, wait) in b[2].items():
            r0, w0 = a[2].get(tid, (0, 0))
            if run - r0 > 1e6 or wait - w0 > 1e6:
                th.append((run - r0, wait - w0, tid))
        th.sort(reverse=True)
        steal = b[5][0] - a[5][0]
        ticks = max(b[5][1] - a[5][1], 1)
        return {"at": at, "fwd_dev": fwd_dev, "all_dev": all_dev, "wall": b[0] - a[0], "issue": issued - a[0], "cpu": b[1] - a[1],
                "threads": [(tid, run / 1e9, wait / 1e9) for run, wait, tid in th[:3]],
                "vcsw": b[3] - a[3], "ivcsw": b[4] - a[4], "steal_pct": 100.0 * steal / ticks,
                "device_alloc": b[6] - a[6], "device_free": b[7] - a[7], "sync_all": b[8] - a[8]}


def steps(b: Any, n: int, cuda: bool, host: bool = False) -> list[float]:
    marks: list[Any] = []

    def one() -> None:
        b.model.zero_grad(set_to_none=True)
        out = b.model(*b.args, **b.kwargs)
        if marks:
            marks[1].record()  # the device reaches it when the forward's kernels are done
        b.loss(out).backward()
        del out

    one()
    if host and cuda:
        marks += [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    if host:
        hs = HostStep(cuda, marks)
        rows = [hs.run(one) for _ in range(n)]
        for r in rows:
            thr = " ".join(f"[{_name(tid)}: cpu {run * 1e3:.0f} wait {wait * 1e3:.1f}]" for tid, run, wait in r["threads"])
            dev = f"  device fwd {r['fwd_dev'] * 1e3:5.1f} all {r['all_dev'] * 1e3:6.1f}" if marks else ""
            print(f"    {r['at']:.3f} step {r['wall'] * 1e3:6.1f} ms  issue {r['issue'] * 1e3:6.1f}{dev}  cpu {r['cpu'] * 1e3:6.1f}  "
                  f"csw {r['vcsw']}/{r['ivcsw']}  steal {r['steal_pct']:.1f}%  cudaMalloc/Free "
                  f"{r['device_alloc']}/{r['device_free']} sync_all {r['sync_all']}  threads {thr}", flush=True)
        ts = [r["wall"] for r in rows]
    else:
        ts = step_times(one, n, cuda)
    b.model.zero_grad(set_to_none=True)
    return ts


def recompute_all(b: Any, reentrant: bool = False) -> Any:
    for blk in b.blocks:
        torchckpt.checkpoint(blk, policy=torchckpt.Recompute(reentrant=reentrant))
    return lambda: [blk.__dict__.pop("forward", None) for blk in b.blocks]


def reentrant_all(b: Any) -> Any:
    return recompute_all(b, reentrant=True)


def show(label: str, ts: list[float], watch: GcWatch | None = None) -> None:
    print(f"  {label:<44} median {statistics.median(ts) * 1e3:7.1f} ms  steps "
          f"{' '.join(f'{t * 1e3:.0f}' for t in ts)}{'  ' + str(watch) if watch else ''}", flush=True)


def run(name: str, n: int, host: bool = False, plan: bool = True, series: int = 1, reentrant: bool = False) -> None:
    b, cuda = build_here(name)
    print(f"== {name}: {b.note}; {len(b.blocks)} blocks; gc thresholds {gc.get_threshold()}", flush=True)

    def measure(label: str, setup: Any = None) -> None:
        undo = setup(b) if setup else None
        try:
            with GcWatch() as w:
                ts = steps(b, n, cuda, host)
            show(label, ts, w)
        finally:
            if undo:
                undo()
        if cuda:
            torch.cuda.empty_cache()

    for i in range(series):
        tag = f" ({i + 1}/{series})" if series > 1 else ""
        measure(f"before planning: keep everything{tag}")
        measure(f"before planning: every block Recompute(){tag}", recompute_all)
        if reentrant:
            measure(f"before planning: every block Recompute(reentrant=True){tag}", reentrant_all)
    if not plan:
        return
    with untouched(b.model, (b.args, b.kwargs)):
        t0 = time.perf_counter()
        with GcWatch() as w:
            planned = _Profiled.prepare(b.model, b.args, b.kwargs, None, b.blocks, b.loss, None, progress=True,
                                        call="plans")
        print(f"  planning: {time.perf_counter() - t0:.1f} s, {w}; objects tracked by gc: {len(gc.get_objects())}",
              flush=True)
        for label, fig in planned.measured.items():
            print(f"  planner measured {label}: {fig[1] * 1e3:.1f} ms", flush=True)
        measure("planner alive: keep everything")
        measure("planner alive: every block Recompute()", recompute_all)
        gc.collect()
        measure("planner alive, after gc.collect(): every block Recompute()", recompute_all)
        gc.disable()
        try:
            measure("planner alive, collector off: every block Recompute()", recompute_all)
        finally:
            gc.enable()
        del planned
    gc.collect()
    print(f"  objects tracked by gc after dropping the planner: {len(gc.get_objects())}", flush=True)
    measure("planner dropped: every block Recompute()", recompute_all)
    measure("planner dropped: keep everything")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="convnext,t5")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--host", action="store_true", help="print where each step's time went on the host")
    p.add_argument("--no-plan", action="store_true", help="only the series before planning")
    p.add_argument("--series", type=int, default=1, help="series of each policy before planning, alternately")
    p.add_argument("--reentrant", action="store_true",
                   help="also every block Recompute(reentrant=True) in each series (NOTE [ Reentrant recompute ])")
    args = p.parse_args()
    for name in args.models.split(","):
        run(name, args.steps, args.host, not args.no_plan, args.series, args.reentrant)


if __name__ == "__main__":
    main()
