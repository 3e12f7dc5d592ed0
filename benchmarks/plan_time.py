"""The planner's own time on a 7B-class decoder: ``torchckpt.plan`` end to end, profile included, by phase.

Model: transformers' LlamaForCausalLM from a 7B-class config (hidden 4096, 32 layers, 32 heads, intermediate
11008, vocabulary 32000; random weights, made on the device in bf16), batch 1 x 4096 tokens, its own loss. On a
CUDA device; with ``--tiny`` or without CUDA, a 4-layer tiny config on the CPU (fp32).

Two timings, one process:
  phases      the body of ``torchckpt.plan`` (``_Profiled.prepare``, then ``.plan(budget)``, inside ``untouched``),
              with ``progress=True``: each line the planner prints to stderr (profiling, search, each verification)
              is timestamped, and the time from one line to the next is that phase's. The budget is half of the
              no-checkpointing peak of this profile (midway between the floor and that peak where half is
              below the floor: the tiny model).
  end_to_end  ``torchckpt.plan(model, budget=<that budget>, **batch)``, the public call as a user makes it, timed
              whole (the host link, measured once per process, is not measured again).

Target (issue 24, Deliver 6): under 60 s. Prints total and per phase; writes ``plan_time.json`` to ``--out``.

    python benchmarks/plan_time.py [--tiny] [--out DIR]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from typing import Any

import torch

import torchckpt
from common import GiB, out_dir
from torchckpt.planner.verify import _Profiled
from torchckpt.planner.restore import untouched


class Stamped(io.TextIOBase):
    """A stand-in for ``sys.stderr`` that passes everything through and keeps each line with its time."""

    def __init__(self, inner: Any, t0: float) -> None:
        self.inner, self.t0, self._part = inner, t0, ""
        self.lines: list[tuple[float, str]] = []

    def write(self, s: str) -> int:
        self.inner.write(s)
        self._part += s
        while "\n" in self._part:
            line, self._part = self._part.split("\n", 1)
            if line.strip():
                self.lines.append((time.perf_counter() - self.t0, line))
        return len(s)

    def flush(self) -> None:
        self.inner.flush()


def model_and_batch(tiny: bool, dev: torch.device) -> tuple[torch.nn.Module, dict[str, Any], str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    d, layers, heads, inter, vocab, s = (64, 4, 4, 176, 256, 64) if tiny else (4096, 32, 32, 11008, 32000, 4096)
    cfg = LlamaConfig(  # type: ignore[call-arg]
        hidden_size=d, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, vocab_size=vocab, max_position_embeddings=s,
        attn_implementation="sdpa")
    dtype = torch.float32 if tiny else torch.bfloat16
    old = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)  # made in place, on the device: seconds, not minutes, for 6.7B parameters
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.train()
    g = torch.Generator("cpu").manual_seed(1234)
    ids = torch.randint(0, vocab, (1, s), generator=g, device="cpu").to(dev)
    note = f"LlamaForCausalLM d{d} L{layers} h{heads} ff{inter} vocab {vocab}, batch 1x{s}, {dtype}"
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}, note


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a 4-layer tiny config on the CPU (the default without CUDA)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda:
        torch.set_num_threads(1)  # a tiny model: threads only add waits
    dev = torch.device("cuda" if cuda else "cpu")
    out = out_dir(args.out)
    t0 = time.perf_counter()
    model, batch, note = model_and_batch(not cuda, dev)
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"plan_time: {note}, {params / 1e9:.2f}B parameters, built in {build_s:.1f} s on {gpu}", flush=True)

    stamped = Stamped(sys.stderr, time.perf_counter())
    sys.stderr = stamped
    try:
        t0 = time.perf_counter()
        with untouched(model, ((), batch)):  # torchckpt.plan's body, in two parts: the budget comes from the profile
            planned = _Profiled.prepare(model, (), batch, None, None, None, None, progress=True, call="plan")
            prepare_s = time.perf_counter() - t0
            budget = planned.prof.peak_none // 2
            if budget < 1.05 * planned.found.floor:  # tiny models, whose gradients weigh as much as their activations
                budget = (planned.found.floor + planned.prof.peak_none) // 2
            pl = planned.plan(budget)
        phases_s = time.perf_counter() - t0
    finally:
        sys.stderr = stamped.inner
    marks = [(0.0, "start"), *stamped.lines, (phases_s, "returned")]
    phases: list[dict[str, Any]] = [{"until_s": t, "s": t - marks[i - 1][0], "line": line}
                                    for i, (t, line) in enumerate(marks) if i]
    print(f"\nphases (each: the time from the line before to this one, the phase this line ends; budget "
          f"{budget / GiB:.3g} GiB, no-checkpointing peak {planned.prof.peak_none / GiB:.3g} GiB, floor "
          f"{planned.found.floor / GiB:.3g} GiB):", flush=True)
    for ph in phases:
        print(f"  {ph['s']:7.2f} s  {ph['line'][:110]}", flush=True)
    print(f"prepare (profile + search) {prepare_s:.1f} s, plan(budget) (verification) {phases_s - prepare_s:.1f} s, "
          f"total {phases_s:.1f} s", flush=True)
    del pl, planned

    t0 = time.perf_counter()
    pl = torchckpt.plan(model, budget=budget, **batch)
    end_to_end_s = time.perf_counter() - t0
    print(f"torchckpt.plan end to end: {end_to_end_s:.1f} s; plan: predicted {pl.peak_bytes / GiB:.3g} GiB, "
          f"{pl.step_time * 1e3:.1f} ms" + (f"; measured {pl.measured_peak_bytes / GiB:.3g} GiB, "
                                              f"{pl.measured_step_time * 1e3:.1f} ms"
                                              if pl.measured_peak_bytes is not None and pl.measured_step_time else "")
          + f"; target under 60 s: {'met' if max(end_to_end_s, phases_s) < 60 else 'MISSED'}", flush=True)
    result = {"model": note, "device": gpu, "torch": torch.__version__, "params": params, "build_s": build_s,
              "budget_bytes": budget, "none_peak_bytes": pl.none_peak_bytes, "prepare_s": prepare_s,
              "plan_s": phases_s - prepare_s, "phases_total_s": phases_s, "phases": phases,
              "end_to_end_s": end_to_end_s, "simple": pl.simple,
              "pred_peak_bytes": pl.peak_bytes, "pred_step_s": pl.step_time,
              "measured_peak_bytes": pl.measured_peak_bytes, "measured_step_s": pl.measured_step_time,
              "decisions": [b.mode for b in pl.blocks], "target_s": 60}
    path = os.path.join(out, "plan_time.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
