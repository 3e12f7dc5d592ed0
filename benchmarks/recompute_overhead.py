"""What torchckpt's Recompute() and Recompute(save=...) cost a step beyond torch's own, per block, on a CPU-bound model.

ResNet-152 (torchvision, channels_last, bf16, batch 128 on CUDA; tiny on the CPU): the step without checkpointing,
with ``torch.utils.checkpoint`` on every Bottleneck, with ``torchckpt.checkpoint(block, policy=Recompute())``,
with torch SAC saving the convolutions' outputs and with ``Recompute(save={aten.convolution.default})`` (the same
selective recomputation through torchckpt's dispatch modes); then a cProfile of the torchckpt steps (host time,
which bounds a step whose kernels are short) and, with ``--trace``, torch.profiler's table of the selective steps
(device and host time per op).

    python benchmarks/recompute_overhead.py [--batch 128] [--reps 7] [--profile 30] [--trace 25]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import torchvision
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import torchckpt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--profile", type=int, default=30, help="lines of the cProfile to print")
    p.add_argument("--trace", type=int, default=0, help="lines of torch.profiler's table of the selective steps")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    m = (torchvision.models.resnet152() if cuda else torchvision.models.resnet152(width_per_group=4)).to(dev, dtype)
    m = m.to(memory_format=torch.channels_last)
    b = args.batch or (128 if cuda else 2)
    x = torch.randn(b, 3, 224 if cuda else 32, 224 if cuda else 32, device=dev, dtype=dtype).contiguous(
        memory_format=torch.channels_last)
    blocks = [blk for layer in (m.layer1, m.layer2, m.layer3, m.layer4) for blk in layer]

    def step() -> None:
        m(x).float().mean().backward()
        m.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed() -> float:
        for _ in range(2):
            step()
        ts = []
        for _ in range(args.reps):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    out = {"none": timed()}
    orig = [blk.forward for blk in blocks]
    for blk, f in zip(blocks, orig):
        blk.forward = (lambda f: lambda t: checkpoint(f, t, use_reentrant=False))(f)
    out["torch.utils.checkpoint"] = timed()
    for blk in blocks:
        del blk.forward
        torchckpt.checkpoint(blk, policy=torchckpt.Recompute())
    out["torchckpt Recompute()"] = timed()
    conv = torch.ops.aten.convolution.default

    def sac_conv(ctx: object, op: object, *a: object, **k: object) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op is conv else CheckpointPolicy.PREFER_RECOMPUTE

    for blk, f in zip(blocks, orig):
        del blk.forward
        blk.forward = (lambda f: lambda t: checkpoint(
            f, t, use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(sac_conv)))(f)
    out["torch SAC (save conv)"] = timed()
    for blk in blocks:
        del blk.forward
        torchckpt.checkpoint(blk, policy=torchckpt.Recompute(save={conv}))
    out["Recompute(save=conv)"] = timed()
    if args.trace:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            for _ in range(2):
                step()
            sync()
        key = "cuda_time_total" if cuda else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=args.trace))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.trace))
    for blk in blocks:
        del blk.forward
        torchckpt.checkpoint(blk, policy=torchckpt.Recompute())
    for k, v in out.items():
        print(f"{k:<24} {v * 1e3:8.1f} ms  {v / out['none']:.2f}x", flush=True)
    extra = out["torchckpt Recompute()"] - out["torch.utils.checkpoint"]
    print(f"torchckpt over torch.utils.checkpoint: {extra * 1e3:+.1f} ms a step, {extra / len(blocks) * 1e6:+.0f} us a "
          f"block ({len(blocks)} blocks)", flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        step()
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.profile)
    print(s.getvalue())


if __name__ == "__main__":
    main()
