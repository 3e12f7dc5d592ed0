import subprocess, sys, textwrap
SCEN = {
 "small_no_clear": "steps(small(), 3); probe()",
 "small_clear": "steps(small(), 3); graphed.clear(); probe()",
 "small_clear_gc": "steps(small(), 3); graphed.clear(); import gc; gc.collect(); torch.cuda.empty_cache(); probe()",
 "small_two_rounds": "steps(small(), 3); graphed.clear(); steps(small(), 3); graphed.clear(); probe()",
 "tiny_resnet_clear": "b = build('resnet152','tiny',torch.device('cuda'),torch.bfloat16); steps_b(b,3); graphed.clear(); probe()",
 "train_resnet_clear": "b = build('resnet152','train',torch.device('cuda'),torch.bfloat16); steps_b(b,3); probe(); graphed.clear(); probe()",
}
PRE = textwrap.dedent('''
import sys, torch, copy
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "tests")
import torchckpt
from torchckpt.recompute import graphed
from architectures import build
from recompute.test_graphed_cuda import _net
def small():
    m = _net(4)
    for b in list(m)[1:5]: torchckpt.checkpoint(b, policy=torchckpt.Recompute(graphed=True))
    return m
def steps(m, n):
    for i in range(n):
        x = torch.randn(8,3,16,16,device="cuda").to(memory_format=torch.channels_last)
        m(x).square().mean().backward(); m.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
def steps_b(b, n):
    for blk in b.blocks: torchckpt.checkpoint(blk, policy=torchckpt.Recompute(graphed=True))
    for i in range(n):
        b.loss(b.model(*b.args, **b.kwargs)).backward(); b.model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
def probe():
    try:
        torch.rand(4, device="cuda"); torch.cuda.synchronize(); print("PROBE ok", graphed.stats().get("captures"), flush=True)
    except Exception as e:
        print("PROBE POISON", type(e).__name__, str(e)[:100], graphed.stats(), flush=True)
''')
for name, body in SCEN.items():
    r = subprocess.run([sys.executable, "-c", PRE + body], capture_output=True, text=True, timeout=120)
    lines = [l for l in (r.stdout + r.stderr).splitlines() if "PROBE" in l or "Error" in l][-4:]
    print(f"{name}: rc={r.returncode} " + " | ".join(lines), flush=True)
