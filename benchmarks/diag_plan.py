"""Diagnosis (not a claim): where a planned step's time goes against the plan's prediction. GPT stack, one budget."""
from __future__ import annotations

import dataclasses
import sys
import time

import torch

import torchckpt
from common import GiB
from frontier import Stack
from torchckpt.planner.verify import _Profiled

budget = float(sys.argv[1]) if len(sys.argv) > 1 else 2.3
codec = torchckpt.codecs.TritonQuant(bits=4, mode="rel", bound=0.1) if "--q4" in sys.argv else None
torch.manual_seed(0)
dev = torch.device("cuda")
m = Stack(2048, 16, 16).to(dev, torch.bfloat16)
x = torch.randn(8, 2048, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
planned = _Profiled.prepare(m, (x,), {}, codec, None, None, None)
pl = planned.plan(int(budget * GiB))
pl.explain()


def measure(label: str, store=None, p=pl) -> None:
    a = p.apply(m, store=store, codec=codec)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    fw, bw, tot = [], [], []
    for r in range(9):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        ev[0].record()
        out = m(x)
        ev[1].record()
        out.backward()
        ev[2].record()
        torch.cuda.synchronize()
        if r >= 4:
            tot.append(time.perf_counter() - t0)
            fw.append(ev[0].elapsed_time(ev[1]))
            bw.append(ev[1].elapsed_time(ev[2]))
    peak = (torch.cuda.max_memory_allocated() - base) / GiB
    st = a.store.stats().summary() if a.store is not None else "-"
    a.remove()
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    print(f"{label:<28} step {med(tot) * 1e3:6.1f} ms  fwd {med(fw):6.1f}  bwd {med(bw):6.1f}  peak {peak:5.2f} GiB  {st}",
          flush=True)


print(f"predicted step {pl.step_time * 1e3:.1f} ms, peak {pl.peak_bytes / GiB:.2f} GiB")
measure("plan")
measure("plan, store 40 GiB cache", torchckpt.Store(dev, gpu_bytes=40 * GiB, min_bytes=0))
measure("plan, store no prefetch", torchckpt.Store(dev, gpu_bytes=pl.blocks and max(b.host_bytes for b in pl.blocks) * 2,
                                                   min_bytes=0, prefetch=False))
on_dev = dataclasses.replace(pl, blocks=tuple(dataclasses.replace(b, host=False, compress=False) for b in pl.blocks))
measure("plan, host -> device", p=on_dev)
if codec is not None:
    raw = dataclasses.replace(pl, blocks=tuple(dataclasses.replace(b, compress=False) for b in pl.blocks))
    measure("plan, uncompressed", p=raw)
rec = next((b for b in pl.blocks if b.mode == "recompute" and b.keep_ops and not b.host), None)
if rec is not None:  # the plan's selective recomputation on every block, and on none
    same = dataclasses.replace(pl, blocks=tuple(dataclasses.replace(b, mode="recompute", keep_ops=rec.keep_ops, host=False,
                                                                    compress=False) for b in pl.blocks))
    measure("every block as " + ",".join(map(str, rec.keep_ops)), p=same)
    kept = dataclasses.replace(pl, blocks=tuple(dataclasses.replace(b, mode="keep", keep_ops=()) for b in pl.blocks))
    measure("every block kept", p=kept)
