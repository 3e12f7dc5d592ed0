"""Training with every block offloaded through a codec, against lossless offload of every block.

The claim (issue: GPU compression): a training step of the GPT-style stack of
``benchmarks/train_step.py`` (16 x (d2048, s2048, b8), bf16) with every block
``Offload(store, codec=TritonQuant(...))`` is at least 1.8x faster than with every block
``Offload(store)`` (lossless: the bytes as they are), same cache budget (256 MiB), same process.
Also prints plain autograd (``none``) for reference, and each mode's bytes over the link.

Then the quality half: a small GPT language model (embedding + the same blocks + head) trained for
``--loss-steps`` steps (300) on token sequences of a fixed random Markov chain, with AdamW, once with
lossless offload and once per lossy codec, from the same initialization and data: the loss curves
and their final gap are printed and written.

    python benchmarks/train_codecs.py [--shape D,H,S,B,L] [--reps 10] [--gpu-bytes 256M] [--codecs q8,q4]
                                      [--loss-steps 300] [--out DIR]
Writes ``train_codecs.json`` and ``train_codecs.png``. Without CUDA: a tiny smoke test.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(1, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torchckpt  # noqa: E402
from common import GiB, fmt, out_dir, parse_bytes, pinned_bandwidth, print_table, pyplot, save_figure, write_json  # noqa: E402
from torchckpt.codecs import TritonQuant  # noqa: E402
from train_step import Bench, Block  # noqa: E402

CODECS = {
    "q8": lambda: TritonQuant(bits=8, mode="rel", bound=1e-2),
    "q4": lambda: TritonQuant(bits=4, mode="rel", bound=0.1),
}


class CodecBench(Bench):
    codec = None

    def new_store(self, gpu_bytes: int) -> torchckpt.Store:
        dev = "cuda" if self.cuda else "cpu"
        return torchckpt.Store(dev, gpu_bytes=gpu_bytes, host=self.pool, min_bytes=0, codec=self.codec)


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, h: int, n: int, seq: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        x = self.emb(tok) + self.pos[: tok.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def markov_batches(vocab: int, seq: int, batch: int, steps: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    trans = torch.softmax(torch.randn(vocab, vocab, generator=g) * 3.0, dim=1)  # peaked: learnable structure
    out = []
    for _ in range(steps):
        tok = torch.empty(batch, seq + 1, dtype=torch.long)
        tok[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(seq):
            tok[:, t + 1] = torch.multinomial(trans[tok[:, t]], 1, generator=g).squeeze(1)
        out.append(tok.to(device))
    return out


def train_loss(codec, args, cuda: bool, data: list[torch.Tensor]) -> list[float]:
    dev = "cuda" if cuda else "cpu"
    d, h, n, seq = args.lm_shape
    torch.manual_seed(1)
    model = LM(args.vocab, d, h, n, seq).to(dev)
    store = torchckpt.Store(dev, gpu_bytes=args.lm_gpu_bytes, min_bytes=0, codec=codec,
                            host=torchckpt.memory.HostPool() if cuda else torchckpt.memory.HostPool(chunk_bytes=1 << 20, pin=False))
    for b in model.blocks:
        torchckpt.checkpoint(b, policy=torchckpt.Offload(store))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for tok in data:
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
            logits = model(tok[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tok[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    st = store.stats()
    if codec is not None and st.compressed == 0:
        raise SystemExit("train_loss: the codec compressed nothing: the comparison would be empty")
    return losses


def plot(res: dict, path: str) -> None:
    """Step times, loss curves, and each lossy curve's difference to the lossless one."""
    plt = pyplot(path)
    if plt is None:
        return
    runs, curves = res["speed"], res["loss"]["curves"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    labels = list(runs)
    ax[0].bar(labels, [runs[k]["step_ms"] for k in labels])
    ax[0].set_ylabel("step time (ms)")
    sh = res["shape"]
    ax[0].set_title(f"{res['device']}: GPT D,H,S,B,L={list(sh.values())}, cache {res['gpu_bytes'] >> 20} MiB", fontsize=9)
    for k, v in curves.items():
        ax[1].plot(v, label=k, lw=1)
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("training loss")
    ax[1].legend()
    ax[1].set_title("loss: lossless vs lossy offload", fontsize=9)
    base = curves["lossless"]
    for k, v in curves.items():
        if k != "lossless":
            ax[2].plot([a - b for a, b in zip(v, base)], label=f"{k} - lossless", lw=1)
    ax[2].axhline(0.0, color="k", lw=0.5)
    ax[2].set_xlabel("step")
    ax[2].set_ylabel("loss difference")
    ax[2].legend()
    ax[2].set_title("difference to lossless (same init, same batches)", fontsize=9)
    save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", help="D,H,S,B,L (default 2048,16,2048,8,16 on CUDA, 64,4,32,2,4 on CPU)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gpu-bytes", type=parse_bytes)
    p.add_argument("--codecs", default="q8,q4")
    p.add_argument("--loss-steps", type=int)
    p.add_argument("--out")
    p.add_argument("--replot", metavar="JSON", help="redraw the PNG from a train_codecs JSON; measure nothing")
    args = p.parse_args()
    if args.replot:
        import json

        with open(args.replot) as f:
            plot(json.load(f), os.path.splitext(args.replot)[0] + ".png")
        return 0
    cuda = torch.cuda.is_available()
    args.shape = [int(v) for v in (args.shape or ("2048,16,2048,8,16" if cuda else "64,4,32,2,4")).split(",")]
    args.gpu_bytes = args.gpu_bytes if args.gpu_bytes is not None else (256 << 20 if cuda else 128 << 10)
    args.loss_steps = args.loss_steps if args.loss_steps is not None else (300 if cuda else 20)
    args.offload_where, args.offload_blocks = "last", 0
    args.lm_shape = (512, 8, 6, 256) if cuda else (32, 4, 2, 16)
    args.vocab, args.lr = (256 if cuda else 32), 1e-3
    args.lm_gpu_bytes = 16 << 20 if cuda else 16 << 10
    names = [c for c in args.codecs.split(",") if c]
    out = out_dir(args.out)
    device = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"train_codecs: {device}, torch {torch.__version__}, shape {args.shape} bf16, cache {args.gpu_bytes >> 20} MiB",
          flush=True)
    res: dict = dict(device=device, torch=torch.__version__, shape=dict(zip("DHSBL", args.shape)),
                     gpu_bytes=args.gpu_bytes, codecs={k: repr(CODECS[k]()) for k in names})
    if cuda:
        d2h, h2d = pinned_bandwidth(GiB)
        res["bandwidth_GBps"] = dict(d2h=d2h / 1e9, h2d=h2d / 1e9)
        print(f"pinned D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s", flush=True)
    bench = CodecBench(args, cuda)
    runs = {"none": bench.measure("none", "none"), "offload": bench.measure("offload (lossless)", "offload",
                                                                           gpu_bytes=args.gpu_bytes)}
    for k in names:
        bench.codec = CODECS[k]()
        runs[f"offload+{k}"] = bench.measure(f"offload + {k} {bench.codec!r}", "offload", gpu_bytes=args.gpu_bytes)
    bench.codec = None
    base = runs["offload"]["step_ms"]
    rows = []
    for name, r in runs.items():
        s = r.get("stats_per_step", {})
        rows.append([name, fmt(r["step_ms"]), fmt(base / r["step_ms"], ".2f") + "x", fmt(r["peak_GiB"], ".2f"),
                     fmt(s.get("offloaded_bytes", 0) / GiB, ".3g"), fmt(s.get("loaded_bytes", 0) / GiB, ".3g")])
    res["speed"] = runs
    print()
    print_table(["mode", "step ms", "speedup vs lossless offload", "peak GiB", "offloaded GiB/step (raw)",
                 "loaded GiB/step (link)"], rows)
    best = max((k for k in runs if k.startswith("offload+")), key=lambda k: base / runs[k]["step_ms"], default=None)
    if best is not None:
        sp = base / runs[best]["step_ms"]
        res["target"] = dict(want=1.8, got=sp, codec=best, verdict=("PASS" if sp >= 1.8 else "FAIL") if cuda else "n/a (CPU)")
        print(f"target: every block through a codec >= 1.8x faster than lossless offload: {res['target']['verdict']} "
              f"({sp:.2f}x with {best})", flush=True)
    del bench

    print(f"\nloss over {args.loss_steps} steps, LM {args.lm_shape} (D,H,L,S), vocab {args.vocab}", flush=True)
    data = markov_batches(args.vocab, args.lm_shape[3], 16 if cuda else 4, args.loss_steps, "cuda" if cuda else "cpu")
    curves = {"lossless": train_loss(None, args, cuda, data)}
    for k in names:
        curves[k] = train_loss(CODECS[k](), args, cuda, data)
    tail = max(1, args.loss_steps // 10)
    final = {k: sum(v[-tail:]) / tail for k, v in curves.items()}
    for k, v in curves.items():
        print(f"  {k}: loss {v[0]:.4f} -> {final[k]:.4f} (mean of the last {tail} steps); "
              f"gap to lossless {final[k] - final['lossless']:+.4f}", flush=True)
    res["loss"] = dict(steps=args.loss_steps, lm_shape=args.lm_shape, vocab=args.vocab, curves=curves, final=final)
    write_json(os.path.join(out, "train_codecs.json"), res)
    plot(res, os.path.join(out, "train_codecs.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
