"""``python -m torchckpt demo``: a few training steps of a small transformer under each policy.

Prints step time, peak activation memory and the store's transfer statistics for: no
checkpointing, ``torch.utils.checkpoint``, and torchckpt's ``Recompute``, ``Offload``, a
mixed plan, and ``Offload`` through the lossy 4-bit ``TritonQuant`` codec. On a GPU it runs a
GPT-style stack in bf16; without one it runs a tiny model on the CPU, where the store
simulates its two tiers with CPU tensors. Each mode trains its own copy of the model; the
modes take turns one step at a time (after warm-up rounds), and each mode's time is
reported as a median, with its ratio to no checkpointing taken within each round, so that
the machine's slow and fast stretches fall on every mode alike.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import torchckpt
from torchckpt._errors import format_bytes
from torchckpt.codecs import TritonQuant


class Block(nn.Module):
    """Pre-norm transformer block: causal attention and a GELU MLP."""

    def __init__(self, d: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, s, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


LOSSY = "torchckpt Offload+4-bit (lossy)"  # TritonQuant(bits=4, mode="rel", bound=0.1) on what goes to host


def _mode_names(n_blocks: int) -> list[str]:
    mixed = f"torchckpt mixed ({max(1, n_blocks // 4)} Offload)"
    return ["no checkpointing", "torch.utils.checkpoint", "torchckpt Recompute", "torchckpt Offload (all)", mixed, LOSSY]


def _uses_store(name: str) -> bool:
    return "Offload" in name or "mixed" in name


def _forward(name: str, blocks: nn.ModuleList, store: torchckpt.Store | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The forward of ``blocks`` under mode ``name`` (one of ``_mode_names``)."""
    n = len(blocks)

    def plain(x: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            x = b(x)
        return x

    def torch_ckpt(x: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            x = torch_checkpoint(b, x, use_reentrant=False)
        return x

    def policy(pick: Callable[[int], torchckpt.Policy]) -> Callable[[torch.Tensor], torch.Tensor]:
        def fwd(x: torch.Tensor) -> torch.Tensor:
            for i, b in enumerate(blocks):
                x = torchckpt.api.run(pick(i), b, x, module=b)
            return x

        return fwd

    if name == "no checkpointing":
        return plain
    if name == "torch.utils.checkpoint":
        return torch_ckpt
    if name == "torchckpt Recompute":
        return policy(lambda i: torchckpt.Recompute())
    off = torchckpt.Offload(store)
    if name == "torchckpt Offload (all)":
        return policy(lambda i: off)
    if name == LOSSY:
        offq = torchckpt.Offload(store, codec=TritonQuant(bits=4, mode="rel", bound=0.1))
        return policy(lambda i: offq)
    rec = torchckpt.Recompute(store=store)
    return policy(lambda i: off if i < max(1, n // 4) else rec)


# -- command line ----------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse with errors in torchckpt's form: ``torchckpt: argument --steps: expected ...`` (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"torchckpt: {message}\n")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer (timed steps per mode), got {text!r}; "
                                         "pass e.g. --steps 5")
    return v


def _shape(text: str) -> tuple[int, int, int, int, int]:
    parts = text.split(",")
    try:
        d, h, s, b, nl = (int(v) for v in parts)
        ok = min(d, h, s, b, nl) >= 1
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(
            f"expected D,H,S,B,L: five positive integers separated by commas (model width, heads, sequence, batch, "
            f"blocks), got {text!r}; pass e.g. --shape 128,4,64,4,4")
    if d % h:
        raise argparse.ArgumentTypeError(f"the width D must be a multiple of the heads H, got D={d}, H={h} in {text!r}; "
                                         f"pass e.g. --shape {h * max(1, d // h)},{h},{s},{b},{nl}")
    return d, h, s, b, nl


def _device(text: str) -> torch.device:
    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return dev


def _parser() -> _Parser:
    p = _Parser(prog="python -m torchckpt demo", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=_positive_int, default=5,
                   help="timed training steps per mode, after 2 warm-up steps (default: 5)")
    p.add_argument("--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--shape", type=_shape, default=None, metavar="D,H,S,B,L",
                   help="model width, heads, sequence, batch, blocks (default: 2048,16,2048,4,8 on a GPU, "
                        "128,4,64,4,4 on the CPU)")
    return p


# -- measurement -----------------------------------------------------------------------------
@dataclasses.dataclass
class _Run:
    """One mode: its own copy of the model, optimizer and store, and what its steps measured."""

    name: str
    step: Callable[[], float]  # one training step; returns its loss
    store: torchckpt.Store | None
    times: list[float] = dataclasses.field(default_factory=list)
    peak_gib: float = float("nan")
    loss: float = float("nan")


def _make_run(name: str, base: nn.ModuleList, x: torch.Tensor, store: torchckpt.Store | None) -> _Run:
    blocks = copy.deepcopy(base)
    fwd = _forward(name, blocks, store)
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-4)

    def step() -> float:
        loss = fwd(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return _Run(name, step, store)


WARMUP = 2  # untimed rounds: first-call costs, and the store's first step (no prefetch plan yet)


def measure(runs: list[_Run], steps: int, dev: torch.device) -> None:
    """Time ``steps`` training steps of every run, interleaved round-robin after ``WARMUP`` rounds.

    Round r steps every mode once, starting at a different mode each round, so that a slow
    stretch of the machine (other processes, frequency changes) falls on all modes alike. On a
    GPU a step is timed by the wall clock between synchronizations; on the CPU by the CPU
    time of the calling thread, which runs all of it (one intra-op thread; CPU autograd runs
    backward on the caller), so that time other processes take does not count.
    """
    cuda = dev.type == "cuda"
    _clock = time.perf_counter if cuda else time.thread_time
    for r in range(WARMUP + steps):
        if r == WARMUP:
            for run in runs:
                if run.store is not None:
                    run.store.reset_stats()
        k = r % len(runs)
        for run in runs[k:] + runs[:k]:
            if cuda:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            before = torch.cuda.memory_allocated(dev) if cuda else 0
            t0 = _clock()
            run.loss = run.step()
            if cuda:
                torch.cuda.synchronize(dev)
            if r >= WARMUP:
                run.times.append(_clock() - t0)
                if cuda:
                    peak = (torch.cuda.max_memory_allocated(dev) - before) / 2**30
                    run.peak_gib = peak if run.peak_gib != run.peak_gib else max(run.peak_gib, peak)
        print(f"  round {r + 1}/{WARMUP + steps}{' (warm-up)' if r < WARMUP else ''} done", flush=True)


def ratios(run: _Run, ref: _Run) -> list[float]:
    """Each timed step of ``run`` over the step of ``ref`` in the same round."""
    return [t / t_ref for t, t_ref in zip(run.times, ref.times)]


def main(argv: list[str] | None = None) -> int:
    """Run the demo; exit status 0 (2 for bad arguments, with a ``torchckpt:`` message)."""
    p = _parser()
    args = p.parse_args(argv)
    dev = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error(f"argument --device: {str(dev)!r} needs CUDA, and torch.cuda.is_available() is False; pass --device cpu")
    d, h, s, b, nl = args.shape or ((2048, 16, 2048, 4, 8) if cuda else (128, 4, 64, 4, 4))
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    base = nn.ModuleList(Block(d, h) for _ in range(nl)).to(dev, dtype)
    x = torch.randn(b, s, d, device=dev, dtype=dtype)
    gpu_bytes = (1 << 30) if cuda else (2 << 20)
    where = torch.cuda.get_device_name(dev) if cuda else "CPU (the store's two tiers simulated with CPU tensors)"
    print(f"torchckpt {torchckpt.__version__} demo on {where}")
    print(f"model: {nl} blocks, d={d}, heads={h}, seq={s}, batch={b}, {dtype}; GPU cache {format_bytes(gpu_bytes)}; "
          f"{args.steps} timed steps per mode, interleaved round-robin after {WARMUP} warm-up rounds"
          f"{'' if cuda else '; 1 CPU thread'}\n")
    runs: list[_Run] = []
    host = None  # one host pool behind every mode's store
    for name in _mode_names(nl):
        store = None
        if _uses_store(name):
            store = torchckpt.Store(dev, gpu_bytes=gpu_bytes, min_bytes=(1 << 20) if cuda else 0, host=host)
            host = store.host
        runs.append(_make_run(name, base, x, store))
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)  # at this size more threads add scheduling noise (a busy machine: 4x), not speed
    try:
        measure(runs, args.steps, dev)
    finally:
        torch.set_num_threads(threads)
    _report(runs, args.steps, cuda)
    return 0


def _report(runs: list[_Run], steps: int, cuda: bool) -> None:
    ref = runs[0]
    print(f"\n{'mode':34s} {'step ms' if cuda else 'cpu ms':>9s} {'x none':>7s} {'x range':>11s} {'peak act GiB':>13s} {'offl MiB/step':>14s} "
          f"{'pf hits':>8s} {'misses':>7s} {'exposed ms':>11s} {'final loss':>11s}")
    spread = 0.0
    for run in runs:
        rel = ratios(run, ref)
        if run is not ref:
            spread = max(spread, max(rel) - min(rel))
        mem = f"{run.peak_gib:13.2f}" if cuda else f"{'n/a (CPU)':>13s}"
        if run.store is not None:
            st = run.store.stats()
            extra = (f"{st.offloaded_bytes / steps / 2**20:14.1f} {st.prefetch_hits // steps:8d} "
                     f"{st.misses // steps:7d} {st.exposed_transfer_s / steps * 1e3:11.2f}")
        else:
            extra = f"{'-':>14s} {'-':>8s} {'-':>7s} {'-':>11s}"
        span = f"{min(rel):.2f}-{max(rel):.2f}"
        print(f"{run.name:34s} {statistics.median(run.times) * 1e3:9.1f} {statistics.median(rel):7.2f} {span:>11s} "
              f"{mem} {extra} {run.loss:11.6f}")
    print(f"\n{'step ms' if cuda else 'cpu ms'}: median over the timed steps; x none: median over rounds of the step's time over the "
          "no-checkpointing step of the same round; x range: the lowest and highest of those ratios.")
    if not cuda:
        print("On the CPU a step's time is the CPU time of the demo's one thread (time.thread_time), so that other "
              "processes on the machine do not count, and the store's GPU tier and copies are CPU tensors and "
              "memcpy. At the default size the order is steady from run to run (no checkpointing, then the lossless "
              "checkpointing modes, then the CPU reference of the 4-bit codec); modes whose x none lie within a few tenths of each other are not "
              "told apart by a short run (more --steps narrow it), and Offload's cost here says nothing about its cost on a GPU.")
    exact = [r for r in runs if r.name != LOSSY]
    loss_spread = max(r.loss for r in exact) - min(r.loss for r in exact)
    lossless = next(r for r in runs if r.name == "torchckpt Offload (all)")
    for r in runs:
        if r.name == LOSSY:
            print(f"\n{LOSSY}: TritonQuant(bits=4, mode='rel', bound=0.1) compresses what crosses to host memory; "
                  f"lossy by design (|x - x'| <= 0.1 max|x| per 256-element block), final loss differs from "
                  f"lossless offload by {r.loss - lossless.loss:+.2e}.")
    if loss_spread == 0:
        print("\nFinal losses are identical across the lossless modes: saved tensors come back bit-identical and "
              "recomputation reruns the same ops.")
    else:
        print(f"\nFinal losses differ by up to {loss_spread:.2e} across modes: some CUDA kernels (e.g. the "
              "flash-attention backward) are not deterministic from run to run; the GPU tests check bit-exact "
              "gradients with deterministic kernels.")
