"""What torchckpt's Recompute() and Recompute(save=...) cost a step beyond torch's own, per block, on a CPU-bound model.

ResNet-152 (torchvision, channels_last, bf16, batch 128 on CUDA; tiny on the CPU): the step without checkpointing,
with ``torch.utils.checkpoint`` on every Bottleneck, with ``torchckpt.checkpoint(block, policy=Recompute())``,
with torch SAC saving the convolutions' outputs and with ``Recompute(save={aten.convolution.default})`` (the same
selective recomputation through torchckpt's dispatch modes); then a cProfile of the torchckpt steps (host time,
which bounds a step whose kernels are short) and, with ``--trace``, torch.profiler's table of the selective steps
(device and host time per op).

    python benchmarks/recompute_overhead.py [--batch 128] [--reps 7] [--profile 30] [--trace 25]

``--ablate vit_l,resnet152`` instead: where ``Recompute()``'s cost beyond ``torch.utils.checkpoint`` comes from, on
the zoo's models (``benchmarks/architectures.py``, training sizes on CUDA, tiny on the CPU): every block under
``torch.utils.checkpoint``, under ``Recompute()``, and under ``Recompute()`` with parts of ``api.run`` switched off
(the buffer guard, NOTE [ Buffers written in a forward ]; the call's state, NOTE [ Mutating forwards ] Rule 2;
both), measured in ``--turns`` turns (each method in turn, a warm-up step and the median of 5 a turn; the median of
the turns), and ``Recompute(reentrant=True)`` on every block (one autograd node a block, NOTE [ Reentrant
recompute ]); each method's forward alone is timed too (its cost a block over no checkpointing's forward), then a
torch.profiler table of one ``Recompute()`` step and one ``torch.utils.checkpoint`` step (host
time per op), with ``--trace`` rows.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from typing import Any

import torch
import torchvision
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import torchckpt


def ablate(name: str, turns: int, trace: int) -> None:
    """The ``--ablate`` run for one model of ``benchmarks/architectures.py``."""
    import contextlib
    import statistics

    import torchckpt.api as api
    from architectures import build_here, torch_checkpoint, wrap_blocks
    from common import measure_steps

    b, cuda = build_here(name)
    print(f"== {name}: {b.note}", flush=True)
    step = b.step

    @contextlib.contextmanager
    def without(guard: bool, state: bool) -> Any:
        old = api.guarded, api.watched
        if guard:
            api.guarded = lambda fn, module: fn  # type: ignore[assignment]
        if state:
            api.watched = lambda *a: None  # type: ignore[assignment]
        try:
            yield
        finally:
            api.guarded, api.watched = old

    def ours(guard: bool = False, state: bool = False) -> Any:
        def setup() -> Any:
            undo = wrap_blocks(b.blocks, lambda i, f: None)
            for blk in b.blocks:
                torchckpt.checkpoint(blk, policy=torchckpt.Recompute())
            ctx = without(guard, state)
            ctx.__enter__()

            def remove() -> None:
                ctx.__exit__(None, None, None)
                for blk in b.blocks:
                    blk.__dict__.pop("forward", None)
                undo()
            return remove
        return setup

    def ours_on(which: Any, policy: Any = None) -> Any:
        def setup() -> Any:
            chosen = [blk for i, blk in enumerate(b.blocks) if which(i)]
            for blk in chosen:
                torchckpt.checkpoint(blk, policy=policy if policy is not None else torchckpt.Recompute())
            return lambda: [blk.__dict__.pop("forward", None) for blk in chosen]
        return setup

    half = len(b.blocks) * 5 // 8
    methods: dict[str, Any] = {
        "none": lambda: None,
        "library": b.library,
        "torch.utils.checkpoint": lambda: wrap_blocks(b.blocks, lambda i, f: torch_checkpoint(f)),
        "torch.utils.checkpoint, every other": lambda: wrap_blocks(
            b.blocks, lambda i, f: torch_checkpoint(f) if i % 2 == 0 else None),
        "Recompute()": ours(),
        "Recompute(reentrant=True)": ours_on(lambda i: True, torchckpt.Recompute(reentrant=True)),
        "Recompute(), every other": ours_on(lambda i: i % 2 == 0),
        f"Recompute(), first {half} then every other": ours_on(lambda i: i < half or (i - half) % 2 == 1),
        "Recompute(), no guard": ours(guard=True),
        "Recompute(), no call state": ours(state=True),
        "Recompute(), neither": ours(guard=True, state=True),
    }
    def forward() -> None:  # the forward alone (what the host issues before backward), its graph dropped
        b.loss(b.model(*b.args, **b.kwargs))

    got: dict[str, list[float]] = {k: [] for k in methods}
    fwd: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(turns):
        for k, setup in methods.items():
            undo = setup()
            try:
                got[k].append(float(measure_steps(step, 5, cuda, warmup=1)["step_s"]))
                fwd[k].append(float(measure_steps(forward, 5, cuda, warmup=1)["step_s"]))
            finally:
                if callable(undo):
                    undo()
            if cuda:
                torch.cuda.empty_cache()
    base = statistics.median(got["torch.utils.checkpoint"])
    f0 = statistics.median(fwd["none"])
    n = len(b.blocks)
    for k, ts in got.items():
        m, f = statistics.median(ts), statistics.median(fwd[k])
        print(f"{k:<28} {m * 1e3:8.1f} ms  turns {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}  "
              f"{(m - base) / n * 1e6:+7.0f} us a block over torch.utils.checkpoint; forward alone {f * 1e3:.2f} ms, "
              f"{(f - f0) / n * 1e6:+.0f} us a block over none's", flush=True)
    if trace:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        for k in ("none", "Recompute()", "torch.utils.checkpoint", "library", "Recompute(), every other"):
            undo = methods[k]()
            try:
                step()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                with profile(activities=acts) as prof:
                    step()
                    if cuda:
                        torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            finally:
                if callable(undo):
                    undo()
            ka = prof.key_averages()
            busy = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6 if cuda else 0.0
            syncs = {e.key: e.count for e in ka if "ynchronize" in e.key or "Memcpy" in e.key or "EventQuery" in e.key}
            print(f"-- {k}: profiled step {wall * 1e3:.1f} ms wall (the profiler's own cost included), kernels "
                  f"{busy * 1e3:.1f} ms; "
                  f"synchronising/copy calls {syncs}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=trace))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ablate", default="", help="models of architectures.py (comma-separated): the ablation instead")
    p.add_argument("--turns", type=int, default=5, help="turns of each method in --ablate")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--profile", type=int, default=30, help="lines of the cProfile to print")
    p.add_argument("--trace", type=int, default=0, help="lines of torch.profiler's table of the selective steps")
    args = p.parse_args()
    if args.ablate:
        for name in args.ablate.split(","):
            ablate(name, args.turns, args.trace)
        return
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
