"""The memory/time frontier: torchckpt's planner against what users have today, in one run.

Models (``--model``):
  gpt    the GPT-style stack of the planner issue (``--shape D,H,S,B,L``, default 2048,16,2048,8,16:
         16 blocks, d2048, 16 heads, seq 2048, batch 8, bf16; loss ``h.float().square().mean()``), as
         ../shared/bench/peers_train.py builds it;
  llama  transformers' LlamaForCausalLM from a config of similar size (hidden D, L layers, H heads,
         intermediate 2.75 D, vocabulary 32000, random weights), batch B of S random tokens, its own
         loss; ``none`` then ``hf_checkpoint`` (``gradient_checkpointing_enable()``, non-reentrant)
         and the planner (the GPT-only methods are skipped).

Methods, each measured the same way in this process:
  none           plain autograd
  checkpoint     ``torch.utils.checkpoint`` per block (non-reentrant)
  every_other    ``torch.utils.checkpoint`` on every other block
  sac            torch SAC per block: save mm/addmm/attention outputs, recompute the rest
  rec_save       ``torchckpt.Recompute(save=...)`` per block with the same ops (the planner's mechanism)
  offload_all    ``torchckpt.Offload`` on every block (a store with no GPU cache)
  plan_{B}       ``torchckpt.plan(..., budget=B GiB)`` applied, lossless
  plan_q4_{B}    the same with ``codec=TritonQuant(bits=4, mode="rel", bound=0.1)`` (LOSSY: each value
                 within 0.1 x the max |x| of its block of 256)
  compile_b{F}   ``torch.compile`` with ``activation_memory_budget = F`` (``--compile``)

Each: 2 warm-up steps, then the median of ``--reps`` steps (7); peak = max_memory_allocated over the timed
steps minus memory_allocated before them. A step ends with ``model.zero_grad(set_to_none=True)`` (and the GPT
stack's input gradient set to None), as a training loop's ``optimizer.zero_grad()`` does, so every step allocates
its gradients and its peak counts them, as the planner's budget does (NOTE [ Profiling step ] Rule 4);
``--keep-grads`` leaves them in place between steps (gradient accumulation: the base then holds them, as in
peers_train.py, and plans peak lower than their budgets by up to the gradients' bytes). For planned settings the
plan's predicted peak and step time are recorded beside the measured ones. One profiling step serves every budget of a codec (as ``torchckpt.planner.plans``);
its profile, link and codec costs go to ``profile[_llama][_q4].json`` (``benchmarks/replan.py`` plans
from it offline).
``none`` runs again last (``none_end``): the drift of the device over the run is printed and recorded.
Prints the table with ratios to ``none`` of this run; writes ``frontier.json`` and ``frontier.png``
(step time over ``none``'s against peak, one line per method) to ``--out``. Without CUDA it runs a tiny shape.

    python benchmarks/frontier.py [--shape 2048,16,2048,8,16] [--budgets 1.2,2.3,3.5,5,7,9,12,14]
                                  [--q4-budgets 1.2,2.3,5] [--reps 5] [--compile] [--only a,b] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import torchckpt
from common import GiB, GPTBlock, block_decisions, finish_figure, measure_steps, out_dir, pyplot
from torchckpt.planner import PlanError
from torchckpt.planner.verify import _Profiled
aten = torch.ops.aten
SAVE = {getattr(aten, op).default for op in (
    "mm", "addmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(aten, op)}


class Stack(nn.Module):
    def __init__(self, d: int, h: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(GPTBlock(d, h) for _ in range(layers))
        self.wrap: Callable[[int, nn.Module, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, blk in enumerate(self.blocks):
            x = self.wrap(i, blk, x) if self.wrap is not None else blk(x)
        return x.float().square().mean()


def sac_policy(ctx: Any, op: Any, *a: Any, **k: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE else CheckpointPolicy.PREFER_RECOMPUTE


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.cuda = torch.cuda.is_available()
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        d, h, s, b, layers = args.shape
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        torch.manual_seed(0)
        self.llama = args.model == "llama"
        self.kwargs: dict[str, Any] = {}
        if self.llama:
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(hidden_size=d, intermediate_size=int(2.75 * d), num_hidden_layers=layers,
                              num_attention_heads=h, num_key_value_heads=h, vocab_size=32000,
                              max_position_embeddings=max(s, 128))
            self.model: nn.Module = LlamaForCausalLM(cfg).to(self.dev, self.dtype)
            self.x = torch.randint(0, 32000, (b, s), device=self.dev)
            self.kwargs = {"labels": self.x, "use_cache": False}
        else:
            self.model = Stack(d, h, layers).to(self.dev, self.dtype)
            self.x = torch.randn(b, s, d, device=self.dev, dtype=self.dtype, requires_grad=True)
        self.reps = args.reps
        self.keep_grads = args.keep_grads

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, step: Callable[[], None]) -> dict[str, float | None]:
        return measure_steps(step, self.reps, self.cuda)

    def step(self) -> None:
        out = self.model(self.x, **self.kwargs)
        (out.loss if self.llama else out).backward()
        self.clear()

    def clear(self) -> None:
        """The gradients set to None after a step, as ``optimizer.zero_grad()`` does (unless ``--keep-grads``)."""
        if not self.keep_grads:
            self.model.zero_grad(set_to_none=True)
            if self.x.is_floating_point():
                self.x.grad = None

    def clean(self) -> None:
        if not self.llama:
            self.model.wrap = None
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", choices=["gpt", "llama"])
    p.add_argument("--shape", default=None, help="D,H,S,B,L (default 2048,16,2048,8,16 on CUDA, 64,4,32,2,6 on CPU)")
    p.add_argument("--budgets", default=None, help="GiB, lossless plans (default 1.2,2.3,3.5,5,7,9,12,14)")
    p.add_argument("--q4-budgets", default=None, help="GiB, plans with TritonQuant(bits=4) (default 1.2,2.3,5; CUDA)")
    p.add_argument("--local-budgets", default=None,
                   help="GiB, lossless plans with nothing over the host link (default 1.2,1.5,2.3 on CUDA)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--keep-grads", action="store_true", help="leave gradients in place between steps")
    p.add_argument("--compile", action="store_true", help="also torch.compile with activation_memory_budget")
    p.add_argument("--only", default="", help="run only methods whose name starts with one of these")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    args.shape = tuple(int(v) for v in (args.shape or ("2048,16,2048,8,16" if cuda else "64,4,32,2,6")).split(","))
    budgets = [float(v) for v in (args.budgets or ("1.2,2.3,3.5,5,7,9,12,14" if cuda else "0.002,0.004,0.006")).split(",")]
    q4 = [float(v) for v in (args.q4_budgets if args.q4_budgets is not None else ("1.2,2.3,5" if cuda else "")).split(",")
          if v]
    local = [float(v) for v in (args.local_budgets if args.local_budgets is not None else
                                ("1.2,1.5,2.3" if cuda else "")).split(",") if v]
    out = out_dir(args.out)
    only = [o for o in args.only.split(",") if o]
    bench = Bench(args)
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"frontier: {args.model} on {gpu}, torch {torch.__version__}, shape D,H,S,B,L = {args.shape}, {bench.dtype}",
          flush=True)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"model": args.model, "device": gpu, "torch": torch.__version__, "shape": args.shape,
                              "grads": "kept" if args.keep_grads else "none", "rows": rows}
    tag = "" if args.model == "gpt" else f"_{args.model}"

    def save() -> None:
        with open(os.path.join(out, f"frontier{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)

    def run(name: str, method: str, setup: Callable[[], Any], extra: dict[str, Any] | None = None) -> None:
        if only and not any(name.startswith(o) for o in only):
            return
        row: dict[str, Any] = {"name": name, "method": method, **(extra or {})}
        try:
            undo = setup()
            try:
                row.update(bench.measure(bench.step))
            finally:
                if callable(undo):
                    undo()
            row.update(extra or {})
        except Exception as e:  # noqa: BLE001 - recorded; the other methods still run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            traceback.print_exc()
        bench.clean()
        rows.append(row)
        none = next((r for r in rows if r["name"] == "none" and "step_s" in r), None)
        if "step_s" in row:
            ratio = row["step_s"] / none["step_s"] if none else float("nan")
            row["x_none"] = ratio
            pk = f"{row['peak_GiB']:.2f} GiB" if row.get("peak_GiB") is not None else "-"
            pred = (f"   predicted {row['pred_peak_GiB']:.2f} GiB, {row['pred_step_s'] * 1e3:.1f} ms"
                    if "pred_peak_GiB" in row else "")
            print(f"{name:<16} {row['step_s'] * 1e3:9.1f} ms {ratio:6.2f}x {pk:>11}{pred}", flush=True)
            if "store" in row:
                print(f"{'':<16} store: {row['store']}", flush=True)
        else:
            print(f"{name:<16} error: {row['error']}", flush=True)
        save()

    m = bench.model

    def wrap(fn: Callable[[int, nn.Module, torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        m.wrap = fn
        return lambda: setattr(m, "wrap", None)

    run("none", "none", lambda: None)
    if bench.llama:
        def hf() -> Callable[[], None]:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return m.gradient_checkpointing_disable

        run("hf_checkpoint", "hf_checkpoint", hf)
        only = only or ["none", "hf", "plan"]
    run("checkpoint", "checkpoint", lambda: wrap(lambda i, b, x: checkpoint(b, x, use_reentrant=False)))
    run("every_other", "every_other",
        lambda: wrap(lambda i, b, x: checkpoint(b, x, use_reentrant=False) if i % 2 == 0 else b(x)))
    run("sac", "sac", lambda: wrap(lambda i, b, x: checkpoint(
        b, x, use_reentrant=False, context_fn=functools.partial(create_selective_checkpoint_contexts, sac_policy))))
    rec_save = torchckpt.Recompute(save=frozenset(SAVE))  # the same selection through torchckpt's own dispatch mode
    run("rec_save", "rec_save", lambda: wrap(lambda i, b, x: torchckpt.api.run(rec_save, b, x, module=b)))
    if not bench.llama:  # Revolve over the chain (checkpoint_chain): s of the block inputs kept, nothing to host
        for snaps in (2, 4, 8):
            def chain(snaps: int = snaps) -> Callable[[], None]:
                return torchckpt.checkpoint_chain(list(m.blocks), snapshots=snaps).remove

            run(f"chain_s{snaps}", "chain", chain, {"snapshots": snaps})
    store_all = torchckpt.Store(bench.dev, gpu_bytes=0, min_bytes=0)
    run("offload_all", "offload_all",
        lambda: wrap(lambda i, b, x: torchckpt.api.run(torchckpt.Offload(store_all), b, x, module=b)))

    for codec_name, bl in (("", budgets), ("q4", q4), ("local", local)):
        if not bl or (only and not any(o.startswith("plan") for o in only)):
            continue
        codec = torchckpt.codecs.TritonQuant(bits=4, mode="rel", bound=0.1) if codec_name == "q4" else None
        t0 = time.perf_counter()
        try:
            planned = _Profiled.prepare(m, (bench.x,), bench.kwargs, codec, None, None, None, progress=True)
            with open(os.path.join(out, f"profile{tag}{'_' + codec_name if codec_name else ''}.json"), "w") as f:
                json.dump({"link": [planned.link.d2h, planned.link.h2d],
                           "codec": dataclasses.asdict(planned.codec) if planned.codec else None,
                           "profile": json.loads(planned.prof.to_json())}, f)
            found = {}
            for b in bl:
                try:  # local: the best plan with nothing over the host link (Revolve over the chain where needed)
                    found[int(b * GiB)] = planned._verified(int(b * GiB), "local")[0] if codec_name == "local" \
                        else planned.plan(int(b * GiB))
                except PlanError:
                    pass
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"name": f"plan{codec_name}", "error": f"{type(e).__name__}: {e}"})
            continue
        bench.clean()
        plan_s = time.perf_counter() - t0
        print(f"planned {len(found)} of {len(bl)} budgets{' with ' + codec_name if codec_name else ''} in {plan_s:.1f} s "
              "(profiling step included)", flush=True)
        for b in bl:
            name = f"plan{'_' + codec_name if codec_name else ''}_{b:g}"
            pl = found.get(int(b * GiB))
            if pl is None:
                rows.append({"name": name, "method": f"plan{codec_name}", "budget_GiB": b, "error": "below the floor"})
                print(f"{name:<16} below the floor", flush=True)
                continue
            with open(os.path.join(out, f"{name}.txt"), "w") as f:
                pl.explain(file=f)
            extra = {"budget_GiB": b, "pred_peak_GiB": pl.peak_bytes / GiB, "pred_step_s": pl.step_time,
                     "verified_peak_GiB": pl.measured_peak_bytes / GiB if pl.measured_peak_bytes is not None else None,
                     "verified_step_s": pl.measured_step_time,
                     "floor_GiB": pl.floor_bytes / GiB, "plan_s": plan_s, "lossy": pl.lossy,
                     "decisions": block_decisions(pl)}

            def setup(pl: Any = pl, codec: Any = codec, extra: dict[str, Any] = extra) -> Callable[[], None]:
                applied = pl.apply(m, codec=codec)

                def undo() -> None:  # the store's counters over warm-up and timed steps, then the plan comes off
                    if applied.store is not None:
                        extra["store"] = applied.store.stats().summary()
                    applied.remove()

                return undo

            run(name, f"plan{codec_name}", setup, extra)

    if args.compile:
        import torch._functorch.config as fconf

        for frac in (0.7, 0.5, 0.3, 0.1):
            def setup(frac: float = frac) -> Callable[[], None]:
                torch._dynamo.reset()
                fconf.activation_memory_budget = frac
                compiled = torch.compile(bench.model)
                old = bench.step
                bench.step = lambda: (compiled(bench.x).backward(), bench.clear())  # type: ignore[method-assign]

                def undo() -> None:
                    bench.step = old  # type: ignore[method-assign]
                    fconf.activation_memory_budget = 1.0

                return undo

            run(f"compile_b{frac:g}", "compile", setup, {"budget_fraction": frac})

    run("none_end", "none_end", lambda: None)  # the device's drift over the run: none again, last
    first, last = (next((r for r in rows if r["name"] == n and "step_s" in r), None) for n in ("none", "none_end"))
    if first and last:
        result["drift"] = last["step_s"] / first["step_s"] - 1
        print(f"drift: no checkpointing took {result['drift'] * 100:+.1f}% at the end of the run against its start",
              flush=True)
    save()
    plot([r for r in rows if r["name"] != "none_end"], os.path.join(out, f"frontier{tag}.png"), gpu, args.model)


def plot(rows: list[dict[str, Any]], path: str, gpu: str, model: str) -> None:
    """Step time over no checkpointing's against peak memory, one line per method (points off the scale at the top)."""
    plt = pyplot(path)
    if plt is None:
        return
    ok = [r for r in rows if r.get("peak_GiB") is not None and "x_none" in r]
    if not ok:
        return
    top = 1.45
    fig, ax = plt.subplots(figsize=(8, 5))
    by: dict[str, list[dict[str, Any]]] = {}
    for r in ok:
        by.setdefault(r["method"], []).append(r)
    for method, rs in by.items():
        rs = sorted(rs, key=lambda r: r["peak_GiB"])
        ys = [min(r["x_none"], top) for r in rs]
        line = ax.plot([r["peak_GiB"] for r in rs], ys, "o-" if len(rs) > 1 else "o",
                       label=method + (" (lossy)" if rs[0].get("lossy") else ""))[0]
        for r in rs:
            if r["x_none"] > top:
                ax.annotate(f"{r['x_none']:.1f}x", (r["peak_GiB"], top), textcoords="offset points", xytext=(4, -12),
                            color=line.get_color(), fontsize=8)
    ax.set_ylim(0.95, top + 0.02)
    ax.set_xlabel("peak memory above the step's start, GiB")
    ax.set_ylabel("step time / no checkpointing (same run)")
    ax.set_title(f"Memory/time frontier, {'GPT stack' if model == 'gpt' else 'Llama (transformers)'}, {gpu}")
    finish_figure(fig, ax, path)


if __name__ == "__main__":
    main()
