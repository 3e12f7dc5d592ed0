"""Quick CUDA smoke check: exact gradients under Offload with evictions and prefetch, and a
rough step time of the GPT-style stack (no checkpointing / save_on_cpu / Offload)."""
import sys, time
import torch
import torchckpt
from torchckpt.demo import Block

dev = torch.device("cuda")
torch.manual_seed(0)
# 1. exactness, small budget so that evictions and prefetches happen
blocks = torch.nn.ModuleList(Block(256, 4) for _ in range(4)).to(dev)
x = torch.randn(4, 128, 256, device=dev, requires_grad=True)
def fwd(pol):
    h = x
    for b in blocks:
        h = torchckpt.run(pol, b, h, module=b) if pol else b(h)
    return h.square().mean()
ref = torch.autograd.grad(fwd(None), [x, *blocks.parameters()])
store = torchckpt.Store(dev, gpu_bytes=2 << 20, min_bytes=0)
ok = True
for step in range(5):
    g = torch.autograd.grad(fwd(torchckpt.Offload(store)), [x, *blocks.parameters()])
    ok &= all(torch.equal(a, b) for a, b in zip(g, ref))
print("exact:", ok, store.stats().summary())

# 2. GPT shape timing
D, H, S, B, L = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "2048,16,2048,8,16").split(","))
blocks = torch.nn.ModuleList(Block(D, H) for _ in range(L)).to(dev, torch.bfloat16)
x = torch.randn(B, S, D, device=dev, dtype=torch.bfloat16)
def step(mode, store=None):
    h = x
    if mode == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            for b in blocks: h = b(h)
    else:
        for b in blocks:
            h = torchckpt.run(torchckpt.Offload(store), b, h, module=b) if mode == "offload" else b(h)
    h.float().square().mean().backward()
for mode, gb in [("none", 0), ("save_on_cpu", 0), ("offload", 1 << 30), ("offload", 512 << 20)]:
    store = torchckpt.Store(dev, gpu_bytes=gb) if mode == "offload" else None
    for _ in range(3): step(mode, store)
    if store: store.reset_stats()
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    ts = []
    for _ in range(4):
        torch.cuda.synchronize(); t0 = time.perf_counter(); step(mode, store); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    print(f"{mode:12s} gpu_bytes={gb>>20:5d}MiB step {sorted(ts)[2]*1e3:7.1f} ms peak {peak:.2f} GiB", store.stats().summary() if store else "", flush=True)
