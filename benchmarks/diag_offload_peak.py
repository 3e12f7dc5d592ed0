"""Diagnosis (not a claim): why an offloading plan's measured peak is under its prediction (issue 24: Mixtral's
5.26 GiB plan, blocks 0 and 6 offloading four saved tensors each, the other ten recomputed reentrantly, predicted
4.81 GiB like the plan that keeps those two blocks, which measured 4.80, where it measured 4.62).

On the zoo's Mixtral (``benchmarks/architectures.py``, training size, bf16, CUDA), in one process, the same plan by
hand: blocks 0 and 6 kept, or ``Offload(tensors=...)`` through a store whose GPU cache is the plan's (twice one
block's offloaded bytes, NOTE [ Step model ] Rule 3), twice that, or none; the other blocks
``Recompute(reentrant=True)``. Per variant: 2 warm-up steps, then 3 steps, each with the memory allocated at the
forward's end (the loss computed, before backward) and the step's peak, both less what was allocated before the
step; the store's stats over the timed steps (evictions, bytes to host, cache hits); and the store's GPU cache
accounting at the forward's end (``Cache.used`` and its entries' sizes).

    python benchmarks/diag_offload_peak.py [--model moe] [--blocks 0,6] [--tensors 44,45,46,49] [--expect 54]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

import torchckpt
from architectures import build
from common import out_dir
from torchckpt.memory import shared_host_pool

MiB = 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="moe")
    p.add_argument("--blocks", default="0,6")
    p.add_argument("--tensors", default="44,45,46,49")
    p.add_argument("--expect", type=int, default=54)
    p.add_argument("--host-mib", type=float, default=352.0, help="one block's offloaded bytes, as profiled (MiB)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("diag_offload_peak.py measures CUDA peaks: run it on the GPU machine")
    out, dev = out_dir(args.out), torch.device("cuda")
    b = build(args.model, "train", dev, torch.bfloat16)
    chosen = {int(k) for k in args.blocks.split(",")}
    tensors = frozenset(int(k) for k in args.tensors.split(","))
    plan_cache = int(2 * args.host_mib * MiB)
    res = {}
    for label, cache in (("keep", None), ("offload, plan's cache", plan_cache), ("offload, twice the cache", 2 * plan_cache),
                         ("offload, no cache", 0), ("keep again", None)):
        store = None if cache is None else torchckpt.Store(device=dev, gpu_bytes=cache, min_bytes=0,
                                                           host=shared_host_pool(pin=True, device=dev))
        undo = []
        for i, mod in enumerate(b.blocks):
            pol = (torchckpt.Offload(store, tensors=tensors, expect=args.expect) if store is not None else None) \
                if i in chosen else torchckpt.Recompute(reentrant=True)
            if pol is not None:
                undo.append((mod, "forward" in mod.__dict__, mod.__dict__.get("forward")))
                torchckpt.checkpoint(mod, policy=pol)
        ends, peaks = [], []
        for k in range(5):
            if k == 2 and store is not None:
                store.reset_stats()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss = b.loss(b.model(*b.args, **b.kwargs))
            torch.cuda.synchronize()
            end = torch.cuda.memory_allocated() - base
            cache_used = store.cache.used if store is not None else None
            loss.backward()
            del loss
            b.model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            if k >= 2:
                ends.append(end)
                peaks.append(peak)
                print(f"{label}: step {k}: forward's end {end / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB, "
                      f"cache used at the forward's end {None if cache_used is None else cache_used / MiB} MiB",
                      flush=True)
        st = store.stats() if store is not None else None
        res[label] = dict(cache_bytes=cache, forward_end_MiB=[e / MiB for e in ends], peak_MiB=[q / MiB for q in peaks],
                          stats=None if st is None else {k: v for k, v in vars(st).items() if isinstance(v, (int, float))})
        print(f"{label}: stats {res[label]['stats']}", flush=True)
        for mod, had, prev in undo:  # as Applied.remove() puts a block back
            if had:
                object.__setattr__(mod, "forward", prev)
            else:
                mod.__dict__.pop("forward", None)
        if store is not None:
            store.close()
    with open(os.path.join(out, "diag_offload_peak.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
