"""Streaming prefetch and write-back planning against planning over a whole list, on the CPU.

Claim: the executor's planned stream (``torchckpt.schedules.planned.Planned``: for a packed schedule, one replay
of the snapshot cache at the first Save that plans the write-back and the prefetches, NOTE [ Cache replay ], then
the actions with those prefetches merged in as they are read) holds memory that does not grow with the schedule,
for a small CPU cost per action. Baseline, in the same process: what the executor did
before, the schedule's actions as a list, ``plan_prefetch`` into a tuple and ``plan_flushes`` into a
set, then iterating the tuple.

Per Revolve(n_steps, 8, tier=HOST) schedule and 3 cache slots: traced peak bytes (tracemalloc,
the packed schedule excluded) and bytes per action; wall time to the first Save planned and for the
whole stream (best of ``--reps``, without tracemalloc). Pure Python: the figures are the machine's
CPU, the same on the GPU machine.

    python benchmarks/plan_stream.py [--steps 2000,16000,100000] [--reps 3] [--out DIR]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

from common import out_dir, pyplot, save_figure
from torchckpt.schedules.planned import Planned
from torchckpt.schedules import Action, PackedSchedule, Revolve, Save, Tier, plan_flushes, plan_prefetch

SLOTS = 3


def whole_list(packed: PackedSchedule) -> Iterator[tuple[int, Action, bool]]:
    """The baseline: list, plan_prefetch, plan_flushes over the whole schedule, then iterate."""
    acts = list(packed)
    i0 = next(i for i, a in enumerate(acts) if type(a) is Save)
    rest = plan_prefetch(acts[i0:], SLOTS).actions
    flush = frozenset(f + i0 for f in plan_flushes(rest, SLOTS))
    for i, a in enumerate(acts[:i0] + list(rest)):
        yield i, a, i in flush


def stream(packed: PackedSchedule) -> Iterator[tuple[int, Action, bool]]:
    plan = Planned(packed, True)
    for i, a in plan:
        if type(a) is Save:
            plan.start(SLOTS)
            yield i, a, plan.flush(i)
        else:
            yield i, a, False


def run(fn: Callable[[PackedSchedule], Iterator[tuple[int, Action, bool]]], packed: PackedSchedule) -> tuple[int, int]:
    """Actions read and flushes decided (so both methods can be checked to agree)."""
    n = f = 0
    for _, _, fl in fn(packed):
        n += 1
        f += fl
    return n, f


def peak(fn: Callable[[PackedSchedule], Any], packed: PackedSchedule) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        run(fn, packed)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def timed(fn: Callable[[PackedSchedule], Any], packed: PackedSchedule, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        gc.collect()
        t = time.perf_counter()
        run(fn, packed)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", default="2000,16000,100000")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", help="output folder (default $OUT, else benchmarks/results)")
    args = p.parse_args()
    out = out_dir(args.out)
    rows = []
    print(f"{'steps':>7} {'actions':>8} {'list peak MB':>12} {'stream peak MB':>14} {'ratio':>7} "
          f"{'list B/act':>10} {'stream B/act':>12} {'list s':>7} {'stream s':>8} {'stream/list':>11}")
    for n_steps in (int(s) for s in args.steps.split(",")):
        packed = Revolve(n_steps, 8, tier=Tier.HOST).pack()
        a, b = run(whole_list, packed), run(stream, packed)
        if a != b:
            raise SystemExit(f"the two plans differ at {n_steps} steps: {a} against {b} (actions, flushes)")
        pl, ps = peak(whole_list, packed), peak(stream, packed)
        tl, ts = timed(whole_list, packed, args.reps), timed(stream, packed, args.reps)
        r = dict(steps=n_steps, actions=a[0], flushes=a[1], list_peak_bytes=pl, stream_peak_bytes=ps,
                 list_s=tl, stream_s=ts, time_ratio=ts / tl, memory_ratio=pl / ps)
        rows.append(r)
        print(f"{n_steps:>7} {a[0]:>8} {pl / 1e6:>12.2f} {ps / 1e6:>14.3f} {pl / ps:>6.0f}x {pl / a[0]:>10.1f} "
              f"{ps / a[0]:>12.2f} {tl:>7.3f} {ts:>8.3f} {ts / tl:>10.2f}x", flush=True)
    with open(os.path.join(out, "plan_stream.json"), "w") as f:
        json.dump(dict(slots=SLOTS, schedule="Revolve(n, 8, tier=HOST)", rows=rows), f, indent=1)
    print(f"wrote {os.path.join(out, 'plan_stream.json')}")
    plt = pyplot(os.path.join(out, "plan_stream.png"))
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["actions"] for r in rows]
    ax1.loglog(xs, [r["list_peak_bytes"] for r in rows], "o-", label="whole list (before)")
    ax1.loglog(xs, [r["stream_peak_bytes"] for r in rows], "o-", label="stream")
    ax1.set_xlabel("actions")
    ax1.set_ylabel("peak traced bytes")
    ax1.legend()
    ax2.plot(xs, [r["list_s"] / r["actions"] * 1e6 for r in rows], "o-", label="whole list (before)")
    ax2.plot(xs, [r["stream_s"] / r["actions"] * 1e6 for r in rows], "o-", label="stream")
    ax2.set_xscale("log")
    ax2.set_xlabel("actions")
    ax2.set_ylabel("us per action")
    ax2.legend()
    fig.suptitle("Planning the executor's action stream, Revolve(n, 8) on host, 3 slots (CPU)")
    save_figure(fig, os.path.join(out, "plan_stream.png"))


if __name__ == "__main__":
    main()
