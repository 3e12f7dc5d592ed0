"""Where the peak of one training step sits: save_on_cpu against torchckpt Offload (256 MiB cache).

Records the CUDA allocator history of one step of the GPT-style stack of train_step.py under each,
replays it to the peak and prints the live allocations there (sizes, counts). Backs the explanation
of the memory gap in docs/notes/2026-11-22-train-step-and-adjoint.md. CUDA only.
"""
import collections

import torch

import torchckpt
from torchckpt.demo import Block

D,H,S,B,L = 2048,16,2048,8,16
torch.manual_seed(0)
blocks = torch.nn.ModuleList(Block(D,H) for _ in range(L)).cuda().to(torch.bfloat16)
x = torch.randn(B,S,D,device="cuda",dtype=torch.bfloat16,requires_grad=True)
def step(mode, store):
    if mode == "soc":
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
    else:
        ctx = torchckpt.offload(store)
    with ctx:
        h = x
        for b in blocks: h = b(h)
        loss = h.float().square().mean()
    loss.backward()
for mode in ("soc", "off"):
    store = torchckpt.Store("cuda", gpu_bytes=256<<20, min_bytes=0)
    for _ in range(3): step(mode, store)
    torch.cuda.synchronize(); base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    torch.cuda.reset_peak_memory_stats()
    step(mode, store); torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    ev = snap["device_traces"][0]
    live = {}; cur = 0; best = (0, None, 0)
    for i, e in enumerate(ev):
        if e["action"] == "alloc":
            live[e["addr"]] = e; cur += e["size"]
            if cur > best[0]: best = (cur, dict(live), i)
        elif e["action"] in ("free_completed",):
            if e["addr"] in live: cur -= live.pop(e["addr"])["size"]
    print(f"== {mode}: peak above base {peak/2**20:.1f} MiB; traced peak {best[0]/2**20:.1f} MiB at event {best[2]}/{len(ev)}")
    sizes = collections.Counter()
    for a, e in best[1].items():
        fr = [f"{f['name']}:{f['filename'].split('/')[-1]}:{f['line']}" for f in e.get("frames", []) if "torch/" not in f["filename"] or "autograd" in f["filename"]][:2]
        sizes[(e["size"], " < ".join(fr))] += 1
    for (sz, fr), n in sorted(sizes.items(), key=lambda kv: -kv[0][0]*kv[1])[:14]:
        print(f"  {n} x {sz/2**20:8.2f} MiB  {fr}")
