"""Training step of a GPT-style stack under five memory plans, measured in one process.

Modes: ``none`` (plain autograd), ``checkpoint`` (torch.utils.checkpoint per block),
``save_on_cpu`` (torch.autograd.graph.save_on_cpu(pin_memory=True)), ``offload`` (every block
``torchckpt.Offload(store)``) and ``mixed`` (the first K blocks ``Offload(store)``, the rest
``Recompute(store=store)``). Reports median step time, peak activation memory, the store's
per-step transfer statistics, and the PCIe link bound of ``offload`` measured in the same run:
``max(fwd, offloaded/D2H) + max(bwd, loaded/H2D)``. Writes ``train_step.json`` and ``train_step.png``.

Without CUDA it runs at a tiny shape on the CPU (a smoke test: times are not meaningful).

    python benchmarks/train_step.py [--shape D,H,S,B,L] [--reps 10] [--gpu-bytes 256M] [--mixed-gpu-bytes 1G] [--sweep]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(1, os.path.dirname(HERE))  # the repo, when torchckpt is not installed

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.checkpoint import checkpoint as torch_checkpoint  # noqa: E402

import torchckpt  # noqa: E402
from common import GiB, Clock, fmt, fmt_bytes, median, out_dir, parse_bytes, pinned_bandwidth  # noqa: E402
from common import GPTBlock, plot_bars, print_table, write_json  # noqa: E402

MODES = ("none", "checkpoint", "save_on_cpu", "offload", "mixed")
PER_STEP = ("offloaded_bytes", "loaded_bytes", "prefetch_hits", "late_prefetches", "late_wait_s", "misses",
            "miss_wait_s", "eviction_wait_s", "cache_hits", "plan_divergences")
CPU_NOTE = "CPU: times are not meaningful (smoke test at a tiny shape; memory n/a)"


class Bench:
    def __init__(self, args: argparse.Namespace, cuda: bool) -> None:
        self.args, self.cuda, self.clock = args, cuda, Clock(cuda)
        dev, dt = ("cuda" if cuda else "cpu"), torch.bfloat16
        d, h, s, b, n = args.shape
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(GPTBlock(d, h) for _ in range(n)).to(dev, dt)
        self.x = torch.randn(b, s, d, device=dev, dtype=dt, requires_grad=True)
        # One host pool for every store: pinning ~L GiB happens once, not once per config.
        self.pool = torchckpt.memory.HostPool() if cuda else torchckpt.memory.HostPool(chunk_bytes=1 << 20, pin=False)

    def new_store(self, gpu_bytes: int) -> torchckpt.Store:
        if self.cuda:
            # min_bytes=0: every saved tensor moves, as under save_on_cpu (the default keeps < 1 MiB)
            return torchckpt.Store("cuda", gpu_bytes=gpu_bytes, host=self.pool, min_bytes=0)
        return torchckpt.Store("cpu", gpu_bytes=gpu_bytes, host=self.pool, min_bytes=0)

    def step(self, mode: str) -> tuple:
        call = (lambda blk, h: torch_checkpoint(blk, h, use_reentrant=False)) if mode == "checkpoint" else None
        ctx = (torch.autograd.graph.save_on_cpu(pin_memory=self.cuda) if mode == "save_on_cpu"
               else torchckpt.offload(self.loss_store) if mode == "offload"  # the loss too, as save_on_cpu does
               else contextlib.nullcontext())
        a = self.clock.mark()
        with ctx:
            h = self.x
            for blk in self.blocks:
                h = call(blk, h) if call else blk(h)
            loss = h.float().square().mean()
        b = self.clock.mark()
        loss.backward()
        return a, b, self.clock.mark()

    def measure(self, label: str, mode: str, k: int = 0, gpu_bytes: int = 0) -> dict:
        args, clock, store = self.args, self.clock, None
        if mode in ("offload", "mixed"):
            store = self.new_store(gpu_bytes)
            self.loss_store = store
            L = len(self.blocks)
            # mixed: K offloaded blocks, the others recompute (their inputs go to the store). "last": the
            # last K blocks, whose tensors mostly stay in the GPU cache until backward needs them first;
            # "spread": spaced over the stack, so each one's copies overlap the blocks around it.
            where = getattr(self, "where", self.args.offload_where)
            spread = (set(range(L - k, L)) if where == "last" else
                      {i * L // k + L // (2 * k) for i in range(k)}) if k else set()
            for i, blk in enumerate(self.blocks):
                pol = torchckpt.Offload(store) if mode == "offload" or i in spread else torchckpt.Recompute(store=store)
                torchckpt.checkpoint(blk, policy=pol)
        warmup = max(args.warmup, 3) if store else args.warmup  # step 1 records the plan, 2+ replay it
        print(f"[{label}] {warmup} warm-up + {args.reps} timed steps", flush=True)
        try:
            for _ in range(warmup):
                self.step(mode)
            clock.sync()
            if store:
                store.reset_stats()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            wall, fwd, dev = [], [], []
            for _ in range(args.reps):
                clock.sync()
                t0 = time.perf_counter()
                a, b, c = self.step(mode)
                clock.sync()
                wall.append((time.perf_counter() - t0) * 1e3)
                fwd.append(clock.ms(a, b))
                dev.append(clock.ms(a, c))
            peak = (torch.cuda.max_memory_allocated() - base) / GiB if self.cuda else float("nan")
            st = store.stats() if store else None
        finally:
            for blk in self.blocks:
                blk.__dict__.pop("forward", None)  # undo torchckpt.checkpoint(blk, ...)
        r = dict(label=label, mode=mode, offload_blocks=k if mode == "mixed" else None,
                 gpu_bytes=gpu_bytes if store else None, warmup=warmup, step_ms=median(wall), fwd_ms=median(fwd),
                 peak_GiB=peak, step_ms_raw=wall, fwd_ms_raw=fwd, device_step_ms_raw=dev)
        msg = f"[{label}] step {r['step_ms']:.1f} ms (fwd {r['fwd_ms']:.1f} ms), peak activations {fmt(peak, '.2f')} GiB"
        if st is not None:
            r["stats_per_step"] = {f: getattr(st, f) / args.reps for f in PER_STEP}
            r["stats_per_step"]["exposed_transfer_s"] = st.exposed_transfer_s / args.reps
            r["stats_total"] = dataclasses.asdict(st)
            r["plan_in_force"] = store.plan is not None
            msg += f"\n    store over {args.reps} steps: {st.summary()}; plan {'yes' if store.plan else 'NO'}, " \
                   f"divergences {st.plan_divergences}, cache peak {st.gpu_peak_bytes / GiB:.2f} GiB"
        print(msg, flush=True)
        return r


def row(r: dict, none: dict | None) -> list[str]:
    ratio = lambda key: fmt(r[key] / none[key], ".2f") + "x" if none and none[key] == none[key] else "n/a"  # noqa: E731
    s = r.get("stats_per_step")
    return [r["label"], fmt(r["step_ms"]), ratio("step_ms"), fmt(r["peak_GiB"], ".2f"), ratio("peak_GiB"),
            fmt(s["offloaded_bytes"] / GiB, ".3g") if s else "-", fmt(s["prefetch_hits"], ".0f") if s else "-",
            fmt(s["late_prefetches"], ".0f") if s else "-", fmt(s["exposed_transfer_s"] * 1e3) if s else "-"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", help="D,H,S,B,L (default 2048,16,2048,8,16 on CUDA, 64,4,32,2,4 on CPU)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (at least 3 for torchckpt modes)")
    p.add_argument("--out", help="output folder (default $OUT, else benchmarks/results)")
    p.add_argument("--gpu-bytes", type=parse_bytes, help="`offload` GPU cache budget (default 256M; 128K on CPU)")
    p.add_argument("--mixed-gpu-bytes", type=parse_bytes, help="`mixed` GPU cache budget (default 1.5G; 128K on CPU)")
    p.add_argument("--offload-blocks", type=int, default=1, help="K: blocks offloaded in `mixed` (the rest recompute)")
    p.add_argument("--offload-where", choices=("last", "spread"), default="last",
                   help="which K blocks `mixed` offloads (default: the last K)")
    p.add_argument("--sweep", action="store_true", help="also sweep K and gpu_bytes for `mixed`")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    args.shape = [int(v) for v in (args.shape or ("2048,16,2048,8,16" if cuda else "64,4,32,2,4")).split(",")]
    args.gpu_bytes = args.gpu_bytes if args.gpu_bytes is not None else (256 << 20 if cuda else 128 << 10)
    if args.mixed_gpu_bytes is None:
        args.mixed_gpu_bytes = 1536 << 20 if cuda else 128 << 10
    modes = list(dict.fromkeys(m for m in args.modes.split(",") if m))
    if len(args.shape) != 5 or any(m not in MODES for m in modes) or not 0 <= args.offload_blocks <= args.shape[4]:
        p.error("--shape takes D,H,S,B,L; --modes a subset of " + ",".join(MODES) + "; 0 <= --offload-blocks <= L")
    out = out_dir(args.out)
    device = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"train_step: {device}, torch {torch.__version__}, torchckpt {torchckpt.__version__}, shape D,H,S,B,L="
          f"{args.shape} bf16, reps {args.reps}, gpu_bytes {fmt_bytes(args.gpu_bytes)}, K {args.offload_blocks}", flush=True)
    if not cuda:
        print(CPU_NOTE, flush=True)
    res: dict = dict(device=device, cuda=cuda, torch=torch.__version__, torchckpt=torchckpt.__version__,
                     note=None if cuda else CPU_NOTE, shape=dict(zip("DHSBL", args.shape)), dtype="bfloat16",
                     reps=args.reps, warmup=args.warmup, gpu_bytes=args.gpu_bytes, offload_blocks=args.offload_blocks)
    d2h = h2d = float("nan")
    if cuda:
        d2h, h2d = pinned_bandwidth(GiB)
        print(f"pinned 1 GiB copies: D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s", flush=True)
    res["bandwidth_GBps"] = dict(d2h=d2h / 1e9, h2d=h2d / 1e9)

    bench = Bench(args, cuda)
    errors: dict[str, str] = {}

    def safe(label: str, mode: str, k: int, gb: int) -> dict | None:
        try:
            return bench.measure(label, mode, k, gb)
        except RuntimeError as e:  # e.g. out of memory: record it and go on with the other modes
            errors[label] = f"{type(e).__name__}: {e}"
            print(f"[{label}] FAILED: {errors[label]}", flush=True)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            return None

    results: dict[str, dict] = {}
    for m in modes:
        gb = args.mixed_gpu_bytes if m == "mixed" else args.gpu_bytes
        r = safe(m if m != "mixed" else f"mixed K={args.offload_blocks}", m, args.offload_blocks, gb)
        if r is not None:
            results[m] = r
    none, ckpt, soc = results.get("none"), results.get("checkpoint"), results.get("save_on_cpu")
    sweep: list[dict] = []
    best: dict[str, dict | None] = {}
    if args.sweep:  # mixed over K x gpu_bytes, offload over gpu_bytes; best = fastest under the reference's peak
        L, g = args.shape[4], args.gpu_bytes
        M = 1 << 20
        for mode, ks, gbs, ref in (("mixed", sorted({k for k in (1, 2, 3) if k < L} | {args.offload_blocks}),
                                    (1024 * M, 1536 * M, 2048 * M), ckpt),
                                   ("offload", [L], (192 * M, 256 * M, 320 * M), soc)):
            rows = []
            for where in (("last", "spread") if mode == "mixed" else ("-",)):
                bench.where = where
                for k in ks:
                    g = args.mixed_gpu_bytes if mode == "mixed" else args.gpu_bytes
                    for gb in sorted(set(gbs) | {g}):
                        if (mode in results and gb == g and where in ("-", args.offload_where)
                                and (mode == "offload" or k == args.offload_blocks)):
                            rows.append(results[mode])
                        elif (r := safe(f"{mode}{f' K={k} {where}' if mode == 'mixed' else ''} {fmt_bytes(gb)}",
                                        mode, k, gb)):
                            rows.append(r)
            del bench.where
            ok = [r for r in rows if not cuda or (ref and r["peak_GiB"] <= ref["peak_GiB"])]
            best[mode] = min(ok, key=lambda r: r["step_ms"]) if ok else None
            sweep += rows
    res.update(modes=results, sweep=sweep, best=best, errors=errors)

    # Link bound of `offload`: the forward can't end before its bytes left, nor the backward before they came back.
    bound = float("nan")
    if none is not None:
        fwd, bwd = none["fwd_ms"], none["step_ms"] - none["fwd_ms"]
        res.update(none_fwd_ms=fwd, none_bwd_ms=bwd)
        if "offload" in results and cuda:
            s = results["offload"]["stats_per_step"]
            bound = max(fwd, s["offloaded_bytes"] / d2h * 1e3) + max(bwd, s["loaded_bytes"] / h2d * 1e3)
    res["offload_link_bound_ms"] = bound

    print()
    if not cuda:
        print(CPU_NOTE)
    rows = [row(r, none) for r in results.values()]
    rows += [row(dict(r, label="best " + r["label"]), none) for r in best.values() if r]
    print_table(["mode", "step ms", "x none", "peak GiB", "x none", "offl GiB/step", "pf hits", "late", "exposed ms"], rows)
    if none is not None:
        print(f"none: forward {res['none_fwd_ms']:.1f} ms, backward {res['none_bwd_ms']:.1f} ms; "
              f"pinned D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s")
    if "offload" in results:
        over = results["offload"]["step_ms"] / bound
        res["offload_over_bound"] = over
        print(f"offload step / link bound = {results['offload']['step_ms']:.1f} / {fmt(bound)} ms = {fmt(over, '.2f')}")

    def target(name: str, a: str, b: str, time_ok) -> None:
        ra, rb = results.get(a), results.get(b)
        if ra is None or rb is None:
            verdict, why = "n/a", f"needs modes {a} and {b}"
        else:
            mem_ok = ra["peak_GiB"] <= rb["peak_GiB"]
            t_ok, t_why = time_ok(ra)
            why = f"peak {fmt(ra['peak_GiB'], '.2f')} <= {b} {fmt(rb['peak_GiB'], '.2f')} GiB; {t_why}"
            verdict = ("PASS" if mem_ok and t_ok else "FAIL") if cuda else "n/a (CPU)"
        res.setdefault("targets", {})[name] = dict(verdict=verdict, detail=why)
        print(f"target {name}: {verdict}  ({why})")

    target("(1) offload <= save_on_cpu memory, <= 1.15 x link bound", "offload", "save_on_cpu",
           lambda r: (r["step_ms"] <= 1.15 * bound, f"{r['step_ms']:.1f} <= 1.15 x {fmt(bound)} ms"))
    target("(2) mixed <= checkpoint memory, faster than checkpoint", "mixed", "checkpoint",
           lambda r: (r["step_ms"] < ckpt["step_ms"], f"{r['step_ms']:.1f} < {ckpt['step_ms']:.1f} ms"))
    for mode, ref in (("mixed", "checkpoint"), ("offload", "save_on_cpu")):
        if args.sweep:
            r = best.get(mode)
            print(f"sweep: best {mode} at or under {ref}'s peak: " + (f"{r['label']}, {r['step_ms']:.1f} ms, "
                  f"{fmt(r['peak_GiB'], '.2f')} GiB" if r else "none") + ("" if cuda else " (CPU: memory not compared)"))
    for label, err in errors.items():
        print(f"FAILED {label}: {err}")
    sys.stdout.flush()

    write_json(os.path.join(out, "train_step.json"), res)
    shown = list(results.values()) + [r for r in best.values() if r and r not in results.values()]
    plot_bars(os.path.join(out, "train_step.png"), [r["label"] for r in shown],
              {"step time (ms)": [r["step_ms"] for r in shown], "peak activations (GiB)": [r["peak_GiB"] for r in shown]},
              f"{device}, torch {torch.__version__}, D,H,S,B,L={args.shape}" + ("\n" + CPU_NOTE if not cuda else ""))


if __name__ == "__main__":
    main()
