"""Diagnosis (not a claim): why the planner's own measurement of a simple policy differs from the same policy
measured later in the same process (issue 24: on an H100, every block ``Recompute()`` measured 148.7 ms while planning
ConvNeXt-B and 111.7 ms in the zoo's row; keep everything agreed within 1.5%).

For each model of ``benchmarks/architectures.py`` (training size on CUDA, tiny on the CPU): the planner's profile and
its measurements of the simple policies (``_Profiled.prepare``, as ``torchckpt.plans`` runs it), with Python's
collector watched (collections per generation and their time, from ``gc.callbacks``); then, in the same process, every
block ``Recompute()`` and keep everything measured step by step (8 steps after one warm-up, each between two
synchronisations) with the planner's objects alive, then the same after ``gc.collect()``, with the collector off, and
with the planner's objects dropped.

    python benchmarks/policy_drift.py [--models convnext,t5] [--steps 8]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch

import torchckpt
from architectures import build
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


def steps(b: Any, n: int, cuda: bool) -> list[float]:
    def one() -> None:
        b.model.zero_grad(set_to_none=True)
        out = b.model(*b.args, **b.kwargs)
        b.loss(out).backward()
        del out

    one()
    ts = step_times(one, n, cuda)
    b.model.zero_grad(set_to_none=True)
    return ts


def recompute_all(b: Any) -> Any:
    for blk in b.blocks:
        torchckpt.checkpoint(blk, policy=torchckpt.Recompute())
    return lambda: [blk.__dict__.pop("forward", None) for blk in b.blocks]


def show(label: str, ts: list[float], watch: GcWatch | None = None) -> None:
    print(f"  {label:<44} median {statistics.median(ts) * 1e3:7.1f} ms  steps "
          f"{' '.join(f'{t * 1e3:.0f}' for t in ts)}{'  ' + str(watch) if watch else ''}", flush=True)


def run(name: str, n: int) -> None:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    b = build(name, "train" if cuda else "tiny", dev, torch.bfloat16 if cuda else torch.float32)
    print(f"== {name}: {b.note}; {len(b.blocks)} blocks; gc thresholds {gc.get_threshold()}", flush=True)

    def measure(label: str, setup: Any = None) -> None:
        undo = setup(b) if setup else None
        try:
            with GcWatch() as w:
                ts = steps(b, n, cuda)
            show(label, ts, w)
        finally:
            if undo:
                undo()
        if cuda:
            torch.cuda.empty_cache()

    measure("before planning: keep everything")
    measure("before planning: every block Recompute()", recompute_all)
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
    args = p.parse_args()
    for name in args.models.split(","):
        run(name, args.steps)


if __name__ == "__main__":
    main()
