"""Codec quality on real data from the project's examples: ratio, max error, PSNR and SSIM (issue 5).

Data (all produced in this run):

(a) ``wave``: snapshots u_n of the source wavefield of ``examples/wave.py`` (layered velocity
    model, Ricker source at the centre of the surface, fp32, the grid ``--grid``^3, 256 on
    CUDA) at several steps (``--wave-steps``): early ones hold a sparse wavefront near the
    source, late ones a wavefield filling most of the volume. These are what the adjoint path
    stores (one of the two grids of a snapshot state).
(b) ``gpt``: every floating-point tensor autograd saves in one forward of the GPT-style stack
    of ``benchmarks/train_step.py`` (its ``Block``; bf16, seeded random weights and input,
    ``--shape D,H,S,B,L``), captured with ``torch.autograd.graph.saved_tensors_hooks``: what
    ``Offload`` would compress. Parameters are left out (they are not activations); a tensor
    saved twice counts once.

Codecs and settings: those of ``benchmarks/codecs.py`` (``settings()`` with ``study``), each included when it
imports and is available here, else skipped with the reason printed. Absolute bounds are
relative to each tensor's max|x| (``abs 1e-2`` = ``1e-2 * max|x|`` of that tensor).

Metrics per tensor, against the original ``x`` (computed in fp32 / fp64):

* ratio: ``Packed.ratio`` (original bytes over packed bytes); for (b) also the total over all
  tensors a codec accepted (sum of bytes over sum of packed bytes).
* max abs error, and max abs error over max|x|.
* PSNR = 20 log10(ptp / RMSE), with ptp = max(x) - min(x), the data's peak-to-peak range
  (``inf``, stored as null with ``exact: true``, when the round trip is exact).
* SSIM (Wang et al. 2004): Gaussian window of 11 points, sigma 1.5, K1 = 0.01, K2 = 0.03, on
  both tensors normalized by the REFERENCE's range, ``(t - min(x)) / ptp``, so L = 1; mean
  over the valid region (no padding), computed with a separable filter. (a): 3D SSIM over
  the volume and 2D SSIM on the vertical section through the source (y = ny/2). (b): 2D
  SSIM on the tensor viewed as (rows, last dim), e.g. (tokens, features); the feature axis
  has no spatial order, so for activations SSIM is a structural check only; PSNR and max
  error are the more telling figures there.

A codec's own guarantee is checked on every tensor (exit status 1 if one broke; JSON first).
Without CUDA it runs a tiny smoke test on the CPU.

    python benchmarks/codec_quality.py [--grid 256] [--wave-steps 150,300,500,800]
                                       [--shape D,H,S,B,L] [--data wave,gpt] [--only SUBSTRING] [--out DIR]
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(1, ROOT)  # the repo, when torchckpt is not installed
sys.path.insert(2, os.path.join(ROOT, "examples"))  # wave.py

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import fmt, out_dir, print_table, pyplot, save_figure, write_json  # noqa: E402


def _load_bench_codecs() -> Any:
    """benchmarks/codecs.py as a module (its file name would clash with the standard ``codecs`` module)."""
    spec = importlib.util.spec_from_file_location("bench_codecs", os.path.join(HERE, "codecs.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_codecs"] = mod
    spec.loader.exec_module(mod)
    return mod


bc = _load_bench_codecs()
CPU_NOTE = "CPU: smoke test at a tiny size"
WIN, SIGMA, K1, K2 = 11, 1.5, 0.01, 0.03


# -- metrics ---------------------------------------------------------------------------------
def _gauss(device: torch.device) -> torch.Tensor:
    k = torch.arange(WIN, dtype=torch.float64) - (WIN - 1) / 2
    g = torch.exp(-k.square() / (2 * SIGMA**2))
    return (g / g.sum()).float().to(device)


def _blur(t: torch.Tensor, nd: int) -> torch.Tensor:
    """Separable Gaussian filter over the last ``nd`` (2 or 3) dims of ``t`` (N, 1, *spatial), valid region."""
    g = _gauss(t.device)
    conv = F.conv2d if nd == 2 else F.conv3d
    for ax in range(nd):
        shape = [1, 1] + [1] * nd
        shape[2 + ax] = WIN
        t = conv(t, g.view(shape))
    return t


def ssim(x: torch.Tensor, y: torch.Tensor, nd: int) -> float | None:
    """Mean SSIM of ``y`` against ``x`` (same shape, ``nd`` spatial dims), both normalized by x's range (L = 1).

    ``None`` when a dimension is shorter than the window or x is constant.
    """
    if x.dim() != nd or any(s < WIN for s in x.shape):
        return None
    xf, yf = x.float(), y.float()
    lo, hi = xf.min(), xf.max()
    ptp = hi - lo
    if not ptp > 0:
        return None
    xn, yn = (xf - lo) / ptp, (yf - lo) / ptp
    m = _blur(torch.stack([xn, yn, xn * xn, yn * yn, xn * yn])[:, None], nd)[:, 0]
    mx, my = m[0], m[1]
    vx, vy, cxy = m[2] - mx * mx, m[3] - my * my, m[4] - mx * my
    c1, c2 = K1**2, K2**2
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return s.double().mean().item()


def metrics(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """max abs error, error over max|x|, PSNR over the peak-to-peak range (fp64 reductions)."""
    d = x.double() - y.double()
    err = d.abs().max().item()
    mse = d.square().mean().item()
    amax = x.abs().max().item()
    ptp = (x.max() - x.min()).double().item()
    exact = mse == 0.0
    psnr = None if exact or ptp == 0 else 20 * math.log10(ptp) - 10 * math.log10(mse)
    return dict(max_abs_err=err, max_rel_err=err / amax if amax else 0.0, rmse=math.sqrt(mse), ptp=ptp, amax=amax,
                psnr=psnr, exact=exact)


# -- data ------------------------------------------------------------------------------------
def gpt_activations(shape: list[int], device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Every floating-point tensor saved for backward in one forward of train_step.py's stack (no parameters)."""
    from train_step import Block

    d, h, s, b, L = shape
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(d, h) for _ in range(L)).to(device, torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in blocks.parameters()}
    x = torch.randn(b, s, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    saved: list[tuple[str, torch.Tensor]] = []
    seen: set[tuple] = set()
    where = ["input"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.numel() and t.untyped_storage().data_ptr() not in params:
            # the same bytes saved twice (e.g. as (b, s, d) and as a (b*s, d) view) count once
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)
            if key not in seen:
                seen.add(key)
                saved.append((f"{where[0]}.t{len(saved)}", t.detach()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hid = x
        for i, blk in enumerate(blocks):
            where[0] = f"block{i}"
            hid = blk(hid)
    del hid
    return [(f"{n} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}", t) for n, t in saved]


# -- the study -------------------------------------------------------------------------------
def run_one(s: Any, x: torch.Tensor, nd_ssim: list[tuple[str, Any]]) -> dict[str, Any]:
    """Compress and decompress ``x`` with setting ``s``; metrics, guarantee check, SSIMs (name, view fn)."""
    row: dict[str, Any] = dict(codec=s.label, family=s.family, dtype=str(x.dtype).removeprefix("torch."),
                               shape=list(x.shape), input_bytes=x.numel() * x.element_size())
    try:
        codec = s.build(x.abs().max().item())
        row["guarantee"] = codec.guarantee.describe()
        if hasattr(codec, "supports") and not codec.supports(x.dtype):
            row.update(status="unsupported", error=f"{codec!r}.supports({x.dtype}) is False")
            return row
        p = codec.compress(x)
        y = codec.decompress(p)
    except (TypeError, ValueError) as e:
        msg = str(e).splitlines()[0]
        row.update(status="unsupported" if msg.startswith("torchckpt:") else "error", error=f"{type(e).__name__}: {msg}")
        return row
    except Exception as e:  # noqa: BLE001 - recorded and printed; the other rows still run
        row.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return row
    row.update(status="ok", packed_bytes=p.nbytes, ratio=p.ratio, **metrics(x, y),
               bound_held=bc.bound_held(codec, x, y))
    for name, view in nd_ssim:
        xs, ys, nd = view(x), view(y), 0
        nd = xs.dim()
        row[name] = ssim(xs, ys, nd)
    del p, y
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", type=int, help="wave grid side (default 256 on CUDA, 32 on CPU)")
    p.add_argument("--wave-steps", help="comma-separated steps of the snapshots (default 150,300,500,800 on "
                                        "CUDA, 20,40,80 on CPU)")
    p.add_argument("--shape", help="GPT D,H,S,B,L (default 2048,16,2048,2,2 on CUDA, 64,4,32,2,2 on CPU)")
    p.add_argument("--data", default="wave,gpt")
    p.add_argument("--only", help="run only settings whose label contains one of these (comma-separated)")
    p.add_argument("--out", help="output folder (default $OUT, else benchmarks/results)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    grid = args.grid or (256 if cuda else 32)
    steps = [int(v) for v in (args.wave_steps or ("150,300,500,800" if cuda else "20,40,80")).split(",")]
    shape = [int(v) for v in (args.shape or ("2048,16,2048,2,2" if cuda else "64,4,32,2,2")).split(",")]
    kinds = args.data.split(",")
    if len(shape) != 5 or any(k not in ("wave", "gpt") for k in kinds):
        p.error("--shape takes D,H,S,B,L; --data a subset of wave,gpt")
    out = out_dir(args.out)
    gpu = bc.device_name(cuda)
    print(f"codec_quality: {gpu}, torch {torch.__version__}, wave grid {grid}^3 steps {steps}, "
          f"GPT D,H,S,B,L={shape} bf16", flush=True)
    note = None
    if not cuda:
        tiny = args.grid is None and args.wave_steps is None and args.shape is None
        note = CPU_NOTE if tiny else ("CPU run at the sizes given (wave snapshots by the PyTorch stencil, which agrees "
                                      "with the Triton one to rounding; TritonQuant by its reference path, same bytes)")
        print(note, flush=True)
    all_settings, skipped = bc.settings()
    for fam, why in skipped:
        print(f"  skip {fam}: {why}", flush=True)
    only = args.only.split(",") if args.only else None
    todo = [s for s in bc.usable(all_settings, skipped, cuda)
            if s.study and (only is None or any(o in s.label for o in only))]
    print("settings: " + ", ".join(s.label for s in todo), flush=True)

    wave_rows: list[dict[str, Any]] = []
    gpt_rows: list[dict[str, Any]] = []
    if "wave" in kinds:
        t0 = time.perf_counter()
        snaps = bc.wave_snapshots((grid, grid, grid), steps, dev)
        print(f"wave: {len(snaps)} snapshots of {grid}^3 in {time.perf_counter() - t0:.1f} s", flush=True)
        views = [("ssim3d", lambda t: t), ("ssim2d_mid", lambda t: t[:, t.shape[1] // 2, :])]
        for n, u in snaps.items():
            nz = (u != 0).float().mean().item()
            print(f"  step {n}: max|u| {u.abs().max().item():.3g}, nonzero {nz:.1%}", flush=True)
            for s in todo:
                r = run_one(s, u, views)
                r.update(data="wave", step=n, nonzero_fraction=nz)
                wave_rows.append(r)
                if cuda:
                    torch.cuda.empty_cache()
        del snaps
    if "gpt" in kinds:
        acts = gpt_activations(shape, dev)
        total = sum(t.numel() * t.element_size() for _, t in acts)
        print(f"gpt: {len(acts)} saved tensors, {total / 2**20:.1f} MiB", flush=True)
        views = [("ssim2d", lambda t: t.reshape(-1, t.shape[-1]) if t.dim() >= 2 else t.view(1, -1))]
        for name, t in acts:
            for s in todo:
                r = run_one(s, t, views)
                r.update(data="gpt", tensor=name)
                gpt_rows.append(r)
            if cuda:
                torch.cuda.empty_cache()
        del acts

    for r in wave_rows + gpt_rows:
        if r["status"] != "ok":
            print(f"  {r['data']} {r.get('step', r.get('tensor'))} {r['codec']}: {r['status']}: {r['error']}", flush=True)
        elif r["bound_held"] is False:
            print(f"  {r['data']} {r.get('step', r.get('tensor'))} {r['codec']}: GUARANTEE BROKEN", flush=True)

    def psnr_s(v: float | None, exact: bool) -> str:
        return "inf" if exact else fmt(v, ".1f")

    if wave_rows:
        print(f"\n(a) wave snapshots, {grid}^3 fp32")
        table = []
        for r in wave_rows:
            if r["status"] != "ok":
                table.append([str(r["step"]), r["codec"], r["status"], "", "", "", "", "", ""])
                continue
            table.append([str(r["step"]), r["codec"], fmt(r["ratio"], ".2f"), fmt(r["max_abs_err"], ".3g"),
                          fmt(r["max_rel_err"], ".2e"), psnr_s(r["psnr"], r["exact"]), fmt(r["ssim3d"], ".5f"),
                          fmt(r["ssim2d_mid"], ".5f"), {True: "held", False: "BROKEN", None: "-"}[r["bound_held"]]])
        print_table(["step", "codec", "ratio", "max abs err", "err/max|x|", "PSNR dB", "SSIM 3D", "SSIM 2D", "bound"], table)

    gpt_summary = []
    if gpt_rows:
        for label in dict.fromkeys(r["codec"] for r in gpt_rows):
            rs = [r for r in gpt_rows if r["codec"] == label]
            ok = [r for r in rs if r["status"] == "ok"]
            psnrs = [r["psnr"] for r in ok if r["psnr"] is not None]
            ssims = [r["ssim2d"] for r in ok if r["ssim2d"] is not None]
            orig = sum(r["input_bytes"] for r in ok)
            summ = dict(codec=label, family=rs[0]["family"], tensors=len(rs), ok=len(ok),
                        not_ok=sorted({f"{r['status']}: {r['error']}" for r in rs if r["status"] != "ok"}),
                        input_bytes=orig, packed_bytes=sum(r["packed_bytes"] for r in ok),
                        ratio_total=orig / sum(r["packed_bytes"] for r in ok) if ok else None,
                        ratio_min=min((r["ratio"] for r in ok), default=None),
                        max_rel_err=max((r["max_rel_err"] for r in ok), default=None),
                        psnr_min=min(psnrs) if psnrs else None,
                        psnr_median=statistics.median(psnrs) if psnrs else None,
                        all_exact=bool(ok) and all(r["exact"] for r in ok),
                        ssim_min=min(ssims) if ssims else None, ssim_mean=statistics.fmean(ssims) if ssims else None,
                        bound_held=(None if not ok or any(r["bound_held"] is None for r in ok)
                                    else all(r["bound_held"] for r in ok)))
            gpt_summary.append(summ)
        print(f"\n(b) GPT activations (saved tensors of one forward), D,H,S,B,L={shape}: per codec over all tensors")
        table = []
        for g in gpt_summary:
            exact = g["all_exact"]
            table.append([g["codec"], f"{g['ok']}/{g['tensors']}", fmt(g["ratio_total"], ".2f"), fmt(g["ratio_min"], ".2f"),
                          fmt(g["max_rel_err"], ".2e"), "inf" if exact else fmt(g["psnr_min"], ".1f"),
                          "inf" if exact else fmt(g["psnr_median"], ".1f"), fmt(g["ssim_min"], ".5f"),
                          fmt(g["ssim_mean"], ".5f"), {True: "held", False: "BROKEN", None: "-"}[g["bound_held"]]])
        print_table(["codec", "tensors", "ratio (total)", "ratio (min)", "max err/max|x|", "PSNR min", "PSNR median",
                     "SSIM min", "SSIM mean", "bound"], table)

    result = dict(benchmark="codec_quality", device=gpu, torch=torch.__version__, cuda=cuda,
                  note=note, wave_grid=grid, wave_steps=steps, gpt_shape=dict(zip("DHSBL", shape)),
                  ssim=dict(window=WIN, sigma=SIGMA, K1=K1, K2=K2,
                            range="both tensors normalized by the reference's min and peak-to-peak: L = 1"),
                  psnr="20 log10(ptp / RMSE), ptp = max(x) - min(x) of the reference; null with exact=true if RMSE = 0",
                  skipped=[dict(codec=f, reason=w) for f, w in skipped],
                  wave=wave_rows, gpt=gpt_rows, gpt_summary=gpt_summary)
    write_json(os.path.join(out, "codec_quality.json"), result)
    plot(os.path.join(out, "codec_quality.png"), wave_rows, gpt_summary,
         f"codec quality on {gpu}, torch {torch.__version__}: wave {grid}^3 fp32, GPT {shape} bf16"
         + ("" if note is None else f"\n{note}"))
    if any(r.get("bound_held") is False for r in wave_rows + gpt_rows):
        print("FAIL: a codec broke its stated guarantee", flush=True)
        sys.exit(1)


def plot(path: str, wave_rows: list[dict[str, Any]], gpt_summary: list[dict[str, Any]], title: str) -> None:
    """Ratio (log x) against PSNR and SSIM per codec setting: wave snapshots (one marker per step) and GPT."""
    plt = pyplot(path)
    if plt is None:
        return
    labels = list(dict.fromkeys([r["codec"] for r in wave_rows] + [g["codec"] for g in gpt_summary]))
    colors = {c: plt.get_cmap("tab20")((2 * i) % 20 + (2 * i) // 20 % 2) for i, c in enumerate(labels)}  # dark shades first
    steps = list(dict.fromkeys(r["step"] for r in wave_rows))
    markers = dict(zip(steps, "ovs^D*Xp"))
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.5))
    for ax, key, name in ((axes[0], "psnr", "wave: PSNR (dB)"), (axes[1], "ssim3d", "wave: SSIM 3D")):
        for c in labels:
            pts = [r for r in wave_rows if r["codec"] == c and r["status"] == "ok" and r.get(key) is not None]
            for r in pts:
                ax.scatter(r["ratio"], r[key], color=colors[c], marker=markers[r["step"]], s=30)
            if pts:
                ax.plot([r["ratio"] for r in pts], [r[key] for r in pts], color=colors[c], lw=0.6, label=c)
        for n in steps:
            ax.scatter([], [], color="gray", marker=markers[n], label=f"step {n}")
        ax.set_xscale("log")
        ax.set_xlabel("compression ratio")
        ax.set_title(name + " (exact round trips not drawn)" if key == "psnr" else name, fontsize=9)
        ax.grid(alpha=0.3)
    if wave_rows:
        axes[0].legend(fontsize=6, ncol=2)
    ax = axes[2]
    for g in gpt_summary:
        if g["ratio_total"] is None or g["psnr_median"] is None:
            continue
        lo = g["psnr_median"] - g["psnr_min"]
        ax.errorbar(g["ratio_total"], g["psnr_median"], yerr=[[lo], [0]], fmt="o", color=colors[g["codec"]],
                    capsize=3, label=f"{g['codec']} ({g['ok']}/{g['tensors']})")
    ax.set_xscale("log")
    ax.set_xlabel("total compression ratio over the saved tensors")
    ax.set_title("GPT activations: median PSNR (bar down to the min)", fontsize=9)
    ax.grid(alpha=0.3)
    if gpt_summary:
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
