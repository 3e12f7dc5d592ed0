"""Timing on the device or the CPU, and the host link's and a codec's measured speeds (planner)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from torchckpt.memory.bandwidth import host_link
from torchckpt.planner.costs import CodecCost, Link

__all__ = ["Clock", "measure_codec", "measure_link"]


class Clock:
    """CUDA events on a CUDA device, ``time.perf_counter`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def between(self, a: Any, b: Any) -> float:
        if self.cuda:
            return float(a.elapsed_time(b)) / 1e3
        return float(b - a)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def times(self, fn: Callable[[], Any], reps: int) -> list[float]:
        """``fn``'s time, ``reps`` times, each between two synchronisations (at least 1 ns)."""
        out = []
        for _ in range(reps):
            self.sync()
            a = self.mark()
            fn()
            b = self.mark()
            self.sync()
            out.append(max(self.between(a, b), 1e-9))
        return out


def measure_link(device: torch.device, nbytes: int = 64 << 20, reps: int = 5) -> Link:
    """Host-link bandwidth each way on ``device``: the one measurement, ``memory.bandwidth.host_link`` (pinned
    memory on CUDA; a copy within host memory on the CPU, what an offload there does), once per process. Ranks that
    plan together call it at once (NOTE [ One plan for all ranks ] Rule 9), so each figure is the link under their
    shared traffic.

    Example::

        >>> measure_link(torch.device("cpu"), nbytes=1 << 20).d2h > 0
        True
    """
    d2h, h2d = host_link(device, pinned=device.type == "cuda", nbytes=nbytes, reps=reps)
    return Link(d2h=d2h, h2d=h2d)


def measure_codec(codec: Any, sample: torch.Tensor, reps: int = 3) -> CodecCost:
    """``codec``'s ratio and throughputs on ``sample`` (a saved tensor of the profiled step), best of ``reps``."""
    clock = Clock(sample.device)
    packed = codec.compress(sample)
    nb = sample.numel() * sample.element_size()
    tc = min(clock.times(lambda: codec.compress(sample), reps))
    td = min(clock.times(lambda: codec.decompress(packed), reps))
    g = codec.guarantee
    lossy = g.kind != "lossless"
    return CodecCost(name=repr(codec), ratio=float(packed.ratio), compress=nb / tc, decompress=nb / td, lossy=lossy,
                     bound=g.describe() if lossy else "")
