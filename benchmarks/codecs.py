"""Codec throughput, ratio and error per codec, setting and dtype, against the PCIe link (issue 5).

Every codec of ``torchckpt.codecs`` that imports and is available here runs at each of its
settings (``SETTINGS``) on fp32, bf16 and fp16 inputs of ``--mib`` MiB (256 on CUDA): one call
``compress(x)`` and one ``decompress(p, out)`` as a user makes them (the current stream, whatever
host synchronization the codec does inside included), timed with CUDA events, median of
``--reps`` calls after ``--warmup``. A codec missing or unavailable is skipped with the reason
printed; a dtype a codec rejects (a ``torchckpt:`` TypeError/ValueError) is listed as
unsupported. Nothing is substituted for a missing codec.

Inputs (``x`` of ``--mib`` MiB, a 3D tensor so that ZFP sees a volume):

* ``normal``: N(0, 1) in the dtype (seeded).
* ``wave``: a snapshot u_n of the 3D acoustic wave equation of ``examples/wave.py`` (layered
  model, Ricker source at the surface, fp32, ``--wave-steps`` steps, so the wavefront has
  crossed most of the grid). The grid is the 16-bit input's shape; fp32 uses its top half
  (the same bytes), bf16 and fp16 are the whole field cast.
* ``smooth``: the analytic wave-like field ``sin(x/40) cos(y/23) sin(z/11 + 0.3)`` over the
  grid's indices (z slowest), computed in fp32 from an fp32 flat index (``smooth_field``); at
  256 MiB the fp32 input is 256x512x512. Grid, top half and casts as for ``wave``.

Reported per row: compress / decompress GB/s of input (bytes of ``x`` over the median time),
ratio (``Packed.ratio``), max abs error and max abs error over max|x|, whether the codec's own
``guarantee`` held on every element (lossless: bit for bit; ``abs``/``rel``: the bound), and
against the pinned PCIe bandwidth measured in this run (``common.pinned_bandwidth``, 1 GiB):
``c/D2H`` = compress throughput over D2H bandwidth, ``d/H2D`` likewise (issue 5 asks for
codecs an order of magnitude faster than the link), and ``xfer`` = time of a raw D2H copy of x
over (compress time + packed bytes / D2H): how much faster x reaches the host through the
codec, done one after the other, than uncompressed.

The kernel alone (``kernel_alone``): for Bitcomp and ZFP rows, the library call that does the
coding, timed the same way on buffers made beforehand: Bitcomp's nvCOMP compress / uncompress
call on its cached plan (no read of the compressed size, no copy out of the worst-case buffer;
where the codec works in fp32 for a bf16/fp16 input, on the fp32 copy made once), ZFP's
``zfp_compress`` / ``zfp_decompress`` op (no NaN/Inf flag pass, no allocation). GB/s are of
``x``'s bytes. On the CPU these are nvCOMP's host calls and zfp's CPU path.

Absolute bounds are given relative to the input: a setting ``abs 1e-2`` is ``1e-2 * max|x|``,
and Bitcomp's ``d=1e-2`` is ``delta = 1e-2 * max|x|``; ``bitcomp delta=2e-3`` is an absolute
``Bitcomp(delta=2e-3)`` (part of this benchmark only, not of ``codec_quality.py``'s study).
Exit status 1 if a guarantee was broken (a wrong result); the JSON is written first.
Without CUDA it runs a tiny smoke test on the CPU (times are not meaningful).

    python benchmarks/codecs.py [--mib 256] [--reps 10] [--warmup 3] [--dtypes fp32,bf16,fp16]
                                [--data normal,wave,smooth] [--only SUBSTRING] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(1, ROOT)  # the repo, when torchckpt is not installed
sys.path.insert(2, os.path.join(ROOT, "examples"))  # wave.py

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import Clock, fmt, median, out_dir, pinned_bandwidth, print_table, pyplot, save_figure, write_json  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DX = 10.0  # m, as in examples/adjoint_wave.py
CPU_NOTE = "CPU: smoke test at a tiny size; times are not meaningful"


# -- the codecs ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Setting:
    """One codec at one setting. ``build(amax)`` makes the codec for an input whose max|x| is ``amax``."""

    label: str
    family: str
    build: Callable[[float], Any]
    bench: bool = True  # part of the throughput benchmark
    study: bool = True  # part of codec_quality.py's study (whose bounds are all relative to max|x|)


def _import(module: str, name: str) -> tuple[Any, str | None]:
    """``module.name`` or ``(None, why not)``: other codecs are imported by module path (they may not be exported)."""
    try:
        return getattr(importlib.import_module(module), name), None
    except Exception as e:  # noqa: BLE001 - any import failure means: skip it, say why
        return None, f"{module}.{name} not importable: {type(e).__name__}: {e}"


def _e4m3_kw() -> tuple[dict[str, Any] | None, str | None]:
    """The keyword that selects TritonQuant's fp8 e4m3 mode (``fmt="e4m3"``), or why there is none."""
    from torchckpt.codecs.quant import TritonQuant

    try:
        TritonQuant(fmt="e4m3", mode="rel", bound=0.1)
        return {"fmt": "e4m3"}, None
    except (TypeError, ValueError) as e:
        return None, "TritonQuant(fmt='e4m3') not accepted here: " + str(e).splitlines()[0]


def settings() -> tuple[list[Setting], list[tuple[str, str]]]:
    """Every codec setting that can be built here, and ``(family, reason)`` for those that cannot."""
    out: list[Setting] = []
    skipped: list[tuple[str, str]] = []
    Identity, why = _import("torchckpt.codecs.base", "Identity")
    if Identity is not None:
        out.append(Setting("identity", "identity", lambda a: Identity()))
    else:
        skipped.append(("identity", str(why)))
    TQ, why = _import("torchckpt.codecs.quant", "TritonQuant")
    if TQ is None:
        skipped.append(("triton_quant", str(why)))
    else:
        out += [
            Setting("tq8 abs 1e-2", "triton_quant", lambda a: TQ(bits=8, mode="abs", bound=1e-2 * a)),
            Setting("tq8 abs 1e-3", "triton_quant", lambda a: TQ(bits=8, mode="abs", bound=1e-3 * a), bench=False),
            Setting("tq8 rel 1e-2", "triton_quant", lambda a: TQ(bits=8, mode="rel", bound=1e-2)),
            Setting("tq4 abs 1e-1", "triton_quant", lambda a: TQ(bits=4, mode="abs", bound=1e-1 * a)),
            Setting("tq4 rel 1e-1", "triton_quant", lambda a: TQ(bits=4, mode="rel", bound=1e-1)),
        ]
        kw, why = _e4m3_kw()
        if kw is None:
            skipped.append(("triton_quant e4m3", str(why)))
        else:
            out += [
                Setting("tq e4m3 rel 5e-2", "triton_quant_e4m3", lambda a, kw=kw: TQ(mode="rel", bound=5e-2, **kw)),
                Setting("tq e4m3 abs 1e-2", "triton_quant_e4m3", lambda a, kw=kw: TQ(mode="abs", bound=1e-2 * a, **kw),
                        bench=False),
            ]
    Bitcomp, why = _import("torchckpt.codecs.bitcomp", "Bitcomp")
    if Bitcomp is None:
        skipped.append(("bitcomp", str(why)))
    else:
        out += [
            Setting("bitcomp lossless", "bitcomp", lambda a: Bitcomp()),
            Setting("bitcomp d=1e-2", "bitcomp_lossy", lambda a: Bitcomp(delta=1e-2 * a)),
            Setting("bitcomp d=1e-3", "bitcomp_lossy", lambda a: Bitcomp(delta=1e-3 * a)),
            Setting("bitcomp delta=2e-3", "bitcomp_lossy", lambda a: Bitcomp(delta=2e-3), study=False),
        ]
    ZFP, why = _import("torchckpt.codecs.zfp", "ZFP")
    if ZFP is None:
        skipped.append(("zfp", str(why)))
    else:
        out += [
            Setting("zfp rate 4", "zfp", lambda a: ZFP(rate=4), bench=False),
            Setting("zfp rate 8", "zfp", lambda a: ZFP(rate=8)),
            Setting("zfp rate 16", "zfp", lambda a: ZFP(rate=16)),
        ]
    return out, skipped


def usable(all_settings: list[Setting], skipped: list[tuple[str, str]], cuda: bool) -> list[Setting]:
    """Drop the families whose codec says it is unavailable (on the CPU: keep them, noting the reason).

    On the CPU a codec that needs a GPU may still have a CPU path (TritonQuant's PyTorch reference,
    Bitcomp's host functions): it runs there as a smoke test; an error is then recorded per row.
    """
    keep, seen = [], {}
    for s in all_settings:
        if s.family not in seen:
            try:
                seen[s.family] = s.build(1.0).unavailable_reason()
            except Exception as e:  # noqa: BLE001
                seen[s.family] = f"construction failed: {type(e).__name__}: {e}"
                skipped.append((s.family, seen[s.family]))
                print(f"  skip {s.family}: {seen[s.family]}", flush=True)
                continue
            if seen[s.family] is not None:
                msg = seen[s.family] if cuda else f"(on the CPU anyway) {seen[s.family]}"
                print(f"  {'skip' if cuda else 'note'} {s.family}: {msg}", flush=True)
                if cuda:
                    skipped.append((s.family, seen[s.family]))
        reason = seen[s.family]
        if reason is None or (not cuda and not reason.startswith("construction failed")):
            keep.append(s)
    return keep


# -- checks ----------------------------------------------------------------------------------
def errors(x: torch.Tensor, y: torch.Tensor, chunk: int = 1 << 24) -> tuple[float, float, float]:
    """(max|x - y|, max|x|, min x .. max x span) over finite x, in fp64 on chunks (memory stays small)."""
    xf, yf = x.reshape(-1), y.reshape(-1)
    err, amax, lo, hi = 0.0, 0.0, math.inf, -math.inf
    for i in range(0, xf.numel(), chunk):
        a, b = xf[i:i + chunk].double(), yf[i:i + chunk].double()
        err = max(err, (a - b).abs().max().item())
        amax = max(amax, a.abs().max().item())
        lo, hi = min(lo, a.min().item()), max(hi, a.max().item())
    return err, amax, hi - lo


def bound_held(codec: Any, x: torch.Tensor, y: torch.Tensor, chunk_blocks: int = 1 << 16) -> bool | None:
    """Whether ``codec.guarantee`` held on every element (``None``: the guarantee bounds nothing)."""
    g = codec.guarantee
    xf, yf = x.reshape(-1), y.reshape(-1)
    if g.kind == "lossless":
        ity = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        return bool(torch.equal(xf.view(ity), yf.view(ity)))
    if g.kind == "abs":
        return all(bool(((xf[i:i + (1 << 24)].double() - yf[i:i + (1 << 24)].double()).abs() <= g.bound).all())
                   for i in range(0, xf.numel(), 1 << 24))
    if g.kind == "rel":
        B = g.block or 1
        if xf.numel() % B:  # zero padding changes no block's max|x| and adds no error
            pad = B - xf.numel() % B
            xf, yf = F.pad(xf, (0, pad)), F.pad(yf, (0, pad))
        xb, yb = xf.view(-1, B), yf.view(-1, B)
        for i in range(0, xb.shape[0], chunk_blocks):
            a, b = xb[i:i + chunk_blocks].double(), yb[i:i + chunk_blocks].double()
            if not bool(((a - b).abs() <= g.bound * a.abs().amax(1, keepdim=True)).all()):
                return False
        return True
    return None


# -- inputs ----------------------------------------------------------------------------------
def wave_snapshots(shape: tuple[int, int, int], steps: list[int], device: torch.device) -> dict[int, torch.Tensor]:
    """Snapshots u_n (fp32) of the source wavefield of ``examples/wave.py`` at the given steps.

    The layered model, CFL time step, Ricker wavelet and a source at the centre of the surface,
    as in ``examples/adjoint_wave.py`` and ``benchmarks/adjoint.py`` (no receivers are needed).
    """
    from wave import Wavefield, cfl_dt, dominant_frequency, layered_model, ricker, surface_survey

    vel = layered_model(shape, DX, device, torch.float64)
    dt = cfl_dt(vel.max().item(), DX)
    wavelet = ricker(max(steps), dt, dominant_frequency(vel.min().item(), DX))
    vel2 = (vel * dt / DX).square().float().contiguous()
    del vel
    src = surface_survey(shape, depth=2, stride=max(shape), device=device).src
    amp = vel2.view(-1)[src].item()
    wf = Wavefield(vel2)
    out = {}
    for n in range(max(steps)):
        wf.step(vel2)
        wf.flat()[src].add_(amp * wavelet[n])
        if n + 1 in steps:
            out[n + 1] = wf.cur.clone()
    return out


def smooth_field(shape: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """``sin(x/40) cos(y/23) sin(z/11 + 0.3)`` on a (z, y, x) grid, in fp32 from an fp32 flat index.

    The index arithmetic is fp32 (flat indices above 2**24 round to even ones), as in
    tests/codecs/test_bitcomp_gpu.py's 256 MiB test, so both see the same bits at 256 MiB.
    """
    ny, nx = shape[1], shape[2]
    i = torch.arange(math.prod(shape), device=device, dtype=torch.float32)
    z, y, x = i // (ny * nx), (i // nx) % ny, i % nx
    del i
    return (torch.sin(x / 40) * torch.cos(y / 23) * torch.sin(z / 11 + 0.3)).view(shape)


def shapes(mib: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """3D shapes of ``mib`` MiB in fp32 and in a 16-bit dtype (the second is twice the first along z)."""
    k = int(math.log2(mib * 2**20 // 4))
    if 2**k * 4 != mib * 2**20:
        raise SystemExit(f"--mib must be a power of two, got {mib}")
    b = -(-k // 3)
    a = k - 2 * b
    return (2**a, 2**b, 2**b), (2**(a + 1), 2**b, 2**b)


def make_inputs(mib: int, kinds: list[str], dtypes: list[str], wave_steps: int,
                device: torch.device) -> dict[tuple[str, str], torch.Tensor]:
    s32, s16 = shapes(mib)
    out: dict[tuple[str, str], torch.Tensor] = {}
    if "wave" in kinds:
        t0 = time.perf_counter()
        u = wave_snapshots(s16, [wave_steps], device)[wave_steps]
        print(f"wave snapshot {s16} at step {wave_steps}: {time.perf_counter() - t0:.1f} s, "
              f"max|u| {u.abs().max().item():.3g}, nonzero {(u != 0).float().mean().item():.1%}", flush=True)
        for d in dtypes:
            out["wave", d] = u[:s32[0]].clone() if d == "fp32" else u.to(DTYPES[d])
        del u
    if "smooth" in kinds:
        u = smooth_field(s16, device)
        for d in dtypes:
            out["smooth", d] = u[:s32[0]].clone() if d == "fp32" else u.to(DTYPES[d])
        del u
    if "normal" in kinds:
        g = torch.Generator(device=device).manual_seed(0)
        for d in dtypes:
            shp = s32 if d == "fp32" else s16
            out["normal", d] = torch.randn(shp, generator=g, device=device).to(DTYPES[d])
    return out


# -- the measurement -------------------------------------------------------------------------
def timed(fn: Callable[[], Any], clock: Clock, reps: int, warmup: int) -> tuple[list[float], list[float], Any]:
    """(event ms per call, wall ms per call, last result): event marks on the current stream around
    each call, so a host synchronization inside the call counts, as a user sees it."""
    r = None
    for _ in range(warmup):
        r = fn()
    clock.sync()
    ev, wall = [], []
    for _ in range(reps):
        del r
        t0 = time.perf_counter()
        a = clock.mark()
        r = fn()
        b = clock.mark()
        clock.sync()
        wall.append((time.perf_counter() - t0) * 1e3)
        ev.append(clock.ms(a, b))
    return ev, wall, r


def kernel_alone(codec: Any, x: torch.Tensor, p: Any, out: torch.Tensor
                 ) -> tuple[str, Callable[[], Any], Callable[[], Any], Callable[[], bool | None], int] | None:
    """The library calls inside ``codec.compress`` / ``decompress`` on buffers made here, for Bitcomp and
    ZFP: ``(what, compress, decompress, same, packed_bytes)``, where ``same()`` (after both ran) says
    whether the decompress call gave the codec's own output (``None``: not comparable here) and
    ``packed_bytes`` is what the calls alone write; ``None`` for other codecs.

    ``p`` is the codec's packed form of ``x`` (the decompress call reads its stream) and ``out`` the
    codec's decompressed ``x``. This reaches into the codecs' private helpers on purpose: the split
    between the kernel and the codec's own work is what it measures.
    """
    name = type(codec).__name__
    if name == "Bitcomp":
        from torchckpt._native import nvcomp as nv
        from torchckpt.codecs import bitcomp as bcm

        lib = nv.library()
        r = bcm._recipe(x.dtype, codec.delta)
        src = x.detach().contiguous().reshape(-1)
        src = bcm._aligned(src.to(r.work) if r.work != x.dtype else src)
        nbytes = src.numel() * src.element_size()
        scratch = torch.empty(lib.bitcompMaxBuflen(nbytes), dtype=torch.uint8, device=x.device)
        buf = p.buffers[0] if p.buffers[0].data_ptr() % 8 == 0 else p.buffers[0].clone()
        flat = torch.empty_like(src)
        algo = codec._algo
        if x.device.type == "cuda":
            def plan() -> Any:
                return bcm._PLANS.use(x.device, nbytes, r.btype, r.mode, algo, torch.cuda.current_stream())
            prefix, uncompress = "bitcomp", lib.bitcompUncompress
        else:
            def plan() -> Any:
                return bcm._host_plan(nbytes, r.btype, r.mode, algo)
            prefix, uncompress = "bitcompHost", lib.bitcompHostUncompress

        def compress() -> None:
            with plan() as h:
                nv.check(bcm._compress_call(lib, prefix, h, r, src, scratch), "Bitcomp compression")

        def decompress() -> None:
            with plan() as h:
                nv.check(uncompress(h, buf.data_ptr(), flat.data_ptr()), "Bitcomp decompression")

        def same() -> bool | None:
            if r.work != x.dtype:
                return None  # the codec narrows the fp32 result; the call alone does not
            ity = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
            return bool(torch.equal(flat.view(ity), out.reshape(-1).view(ity)))

        what = (f"nvCOMP {prefix}Compress/{prefix}Uncompress on a {r.work} buffer, "
                "no size read, no copy out of the worst-case buffer")
        return what, compress, decompress, same, p.nbytes  # the codec keeps the call's stream as it is
    if name == "ZFP":
        from torchckpt._native import ops
        from torchckpt.codecs.zfp import field_shape, packed_layout

        fld = list(field_shape(x.shape))
        rate = float(codec.rate)
        _, _, total = packed_layout(fld, x.dtype, rate, flags=False)
        f = x.detach().contiguous().view(fld)
        zbuf = torch.zeros(total, dtype=torch.uint8, device=x.device)
        y = torch.empty(fld, dtype=x.dtype, device=x.device)

        def same_zfp() -> bool | None:  # finite inputs: the codec's flags change nothing
            return bool(torch.equal(y.reshape(-1), out.reshape(-1))) if bool(torch.isfinite(x).all()) else None

        return ("zfp_compress/zfp_decompress op, no NaN/Inf flag pass, no allocation",
                lambda: ops.zfp_compress(f, fld, rate, zbuf), lambda: ops.zfp_decompress(zbuf, fld, rate, y), same_zfp,
                total)
    return None


def measure_kernel(codec: Any, x: torch.Tensor, p: Any, out: torch.Tensor, clock: Clock,
                   args: argparse.Namespace) -> dict[str, Any]:
    """Row fields of the kernel alone (``kernel_alone``); ``{}`` for codecs without one, ``kernel_error`` if it failed."""
    try:
        k = kernel_alone(codec, x, p, out)
        if k is None:
            return {}
        what, compress, decompress, same, packed = k
        kc, _, _ = timed(compress, clock, args.reps, args.warmup)
        kd, _, _ = timed(decompress, clock, args.reps, args.warmup)
        clock.sync()
        nb = x.numel() * x.element_size()
        return dict(kernel=what, compress_kernel_ms=median(kc), decompress_kernel_ms=median(kd),
                    compress_kernel_gbs=nb / median(kc) / 1e6, decompress_kernel_gbs=nb / median(kd) / 1e6,
                    kernel_ratio=nb / packed, kernel_same_output=same())
    except Exception as e:  # noqa: BLE001 - recorded and printed; the codec's own figures stand
        return dict(kernel_error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def measure(s: Setting, data: str, dname: str, x: torch.Tensor, clock: Clock, args: argparse.Namespace,
            link: tuple[float, float] | None) -> dict[str, Any]:
    row: dict[str, Any] = dict(codec=s.label, family=s.family, data=data, dtype=dname, shape=list(x.shape),
                               input_bytes=x.numel() * x.element_size())
    amax = x.abs().max().item()
    try:
        codec = s.build(amax)
        row["repr"], row["guarantee"] = repr(codec), codec.guarantee.describe()
        if hasattr(codec, "supports") and not codec.supports(x.dtype):
            row["status"], row["error"] = "unsupported", f"{codec!r}.supports({x.dtype}) is False"
            return row
        ct, cw, p = timed(lambda: codec.compress(x), clock, args.reps, args.warmup)
        out = torch.empty_like(x)
        dt, dw, _ = timed(lambda: codec.decompress(p, out), clock, args.reps, args.warmup)
    except (TypeError, ValueError) as e:
        msg = str(e).splitlines()[0]
        row["status"] = "unsupported" if msg.startswith("torchckpt:") else "error"
        row["error"] = f"{type(e).__name__}: {msg}"
        return row
    except Exception as e:  # noqa: BLE001 - recorded and printed; the other rows still run
        row["status"], row["error"] = "error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return row
    nb = row["input_bytes"]
    err, amax, _ = errors(x, out)
    row.update(status="ok", packed_bytes=p.nbytes, ratio=p.ratio, max_abs_err=err, max_rel_err=err / amax if amax else 0.0,
               bound_held=bound_held(codec, x, out), compress_ms=median(ct), decompress_ms=median(dt),
               compress_wall_ms=median(cw), decompress_wall_ms=median(dw),
               compress_ms_all=ct, decompress_ms_all=dt)
    row["compress_gbs"] = nb / row["compress_ms"] / 1e6
    row["decompress_gbs"] = nb / row["decompress_ms"] / 1e6
    row["compress_wall_gbs"] = nb / row["compress_wall_ms"] / 1e6
    row["decompress_wall_gbs"] = nb / row["decompress_wall_ms"] / 1e6
    if link is not None:
        d2h, h2d = link
        row["compress_over_d2h"] = row["compress_gbs"] * 1e9 / d2h
        row["decompress_over_h2d"] = row["decompress_gbs"] * 1e9 / h2d
        row["xfer_speedup_d2h"] = (nb / d2h) / (row["compress_ms"] / 1e3 + p.nbytes / d2h)
        row["xfer_speedup_h2d"] = (nb / h2d) / (row["decompress_ms"] / 1e3 + p.nbytes / h2d)
    row.update(measure_kernel(codec, x, p, out, clock, args))
    del p, out
    return row


def plot(path: str, rows: list[dict[str, Any]], link: tuple[float, float] | None, title: str) -> None:
    """Per input: compress GB/s, decompress GB/s (log, the link and 10x the link dashed) and ratio; bars per dtype."""
    plt = pyplot(path)
    if plt is None:
        return
    ok = [r for r in rows if r.get("status") == "ok"]
    datas = list(dict.fromkeys(r["data"] for r in ok))
    if not datas:
        return
    codecs = list(dict.fromkeys(r["codec"] for r in ok))
    dts = list(dict.fromkeys(r["dtype"] for r in ok))
    fig, axes = plt.subplots(len(datas), 3, figsize=(18, 4.2 * len(datas)), squeeze=False)
    w = 0.8 / len(dts)
    for i, data in enumerate(datas):
        for j, (key, name) in enumerate((("compress_gbs", "compress GB/s"), ("decompress_gbs", "decompress GB/s"),
                                         ("ratio", "ratio"))):
            ax = axes[i][j]
            for k, d in enumerate(dts):
                by = {r["codec"]: r for r in ok if r["data"] == data and r["dtype"] == d}
                v = [by[c][key] if c in by else 0.0 for c in codecs]
                ax.bar([n + (k - (len(dts) - 1) / 2) * w for n in range(len(codecs))], v, w, label=d)
            if key != "ratio":
                ax.set_yscale("log")
                if link is not None:
                    bw = (link[0] if key == "compress_gbs" else link[1]) / 1e9
                    ax.axhline(bw, ls="--", c="k", lw=1, label=f"pinned {'D2H' if j == 0 else 'H2D'} {bw:.0f}")
                    ax.axhline(10 * bw, ls=":", c="r", lw=1, label="10x link")
            ax.set_xticks(range(len(codecs)), codecs, rotation=35, ha="right", fontsize=8)
            ax.set_title(f"{data}: {name}", fontsize=10)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, dpi=110)


def fmt_gbs(v: float) -> str:
    return fmt(v, ".0f" if v >= 100 else ".3g")


def device_name(cuda: bool) -> str:
    return torch.cuda.get_device_name() if cuda else "cpu"


def nvcomp_version() -> int | None:
    """nvCOMP's version as it reports it (e.g. 6000), ``None`` when the library is not loaded here."""
    try:
        from torchckpt._native import nvcomp as nv

        return nv.version()
    except Exception:  # noqa: BLE001 - no version is all this records
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, help="input size in MiB, a power of two (default 256 on CUDA, 1 on CPU)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtypes", default="fp32,bf16,fp16")
    p.add_argument("--data", default="normal,wave,smooth")
    p.add_argument("--wave-steps", type=int, help="steps before the wave snapshot (default 2.6 x the grid's depth)")
    p.add_argument("--only", help="run only settings whose label contains one of these (comma-separated)")
    p.add_argument("--out", help="output folder (default $OUT, else benchmarks/results)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    args.mib = args.mib or (256 if cuda else 1)
    dtypes, kinds = args.dtypes.split(","), args.data.split(",")
    if any(d not in DTYPES for d in dtypes) or any(k not in ("normal", "wave", "smooth") for k in kinds):
        p.error(f"--dtypes takes a subset of {','.join(DTYPES)}; --data of normal,wave,smooth")
    args.wave_steps = args.wave_steps or int(2.6 * shapes(args.mib)[1][0])
    out = out_dir(args.out)
    gpu = device_name(cuda)
    nvcomp = nvcomp_version()
    print(f"codecs: {gpu}, torch {torch.__version__}, nvCOMP {nvcomp}, input {args.mib} MiB, reps {args.reps}",
          flush=True)
    if not cuda:
        print(CPU_NOTE, flush=True)

    all_settings, skipped = settings()
    for fam, why in skipped:
        print(f"  skip {fam}: {why}", flush=True)
    only = args.only.split(",") if args.only else None
    todo = [s for s in usable(all_settings, skipped, cuda) if s.bench and (only is None or any(o in s.label for o in only))]
    print("settings: " + ", ".join(s.label for s in todo), flush=True)

    link = None
    if cuda:
        link = pinned_bandwidth()
        print(f"pinned D2H {link[0] / 1e9:.1f} GB/s, H2D {link[1] / 1e9:.1f} GB/s (1 GiB, CUDA events)", flush=True)
    inputs = make_inputs(args.mib, kinds, dtypes, args.wave_steps, dev)
    clock = Clock(cuda)
    rows = []
    for (data, dname), x in inputs.items():
        for s in todo:
            r = measure(s, data, dname, x, clock, args, link)
            rows.append(r)
            if r["status"] != "ok":
                print(f"  {data} {dname} {s.label}: {r['status']}: {r['error']}", flush=True)
            elif r["bound_held"] is False:
                print(f"  {data} {dname} {s.label}: GUARANTEE BROKEN ({r['guarantee']}; max err {r['max_abs_err']:.3g})",
                      flush=True)
            if "kernel_error" in r:
                print(f"  {data} {dname} {s.label}: kernel alone not measured: {r['kernel_error']}", flush=True)
            elif r.get("kernel_same_output") is False:
                print(f"  {data} {dname} {s.label}: the kernel alone decoded other values than the codec", flush=True)
            if cuda:
                torch.cuda.empty_cache()

    header = ["data", "dtype", "codec", "compress GB/s", "decompress GB/s", "kernel c GB/s", "kernel d GB/s", "ratio",
              "max abs err", "err/max|x|", "bound", "c/D2H", "d/H2D", "xfer D2H"]
    table = []
    for r in rows:
        if r["status"] != "ok":
            table.append([r["data"], r["dtype"], r["codec"], r["status"]] + [""] * (len(header) - 4))
            continue
        held = {True: "held", False: "BROKEN", None: "-"}[r["bound_held"]]
        kc, kd = r.get("compress_kernel_gbs"), r.get("decompress_kernel_gbs")
        table.append([r["data"], r["dtype"], r["codec"], fmt_gbs(r["compress_gbs"]), fmt_gbs(r["decompress_gbs"]),
                      "-" if kc is None else fmt_gbs(kc), "-" if kd is None else fmt_gbs(kd),
                      fmt(r["ratio"], ".2f"), fmt(r["max_abs_err"], ".3g"), fmt(r["max_rel_err"], ".2e"), held,
                      fmt(r.get("compress_over_d2h"), ".1f"), fmt(r.get("decompress_over_h2d"), ".1f"),
                      fmt(r.get("xfer_speedup_d2h"), ".2f")])
    print()
    print_table(header, table)
    result = dict(benchmark="codecs", device=gpu, torch=torch.__version__, nvcomp=nvcomp, cuda=cuda,
                  note=None if cuda else CPU_NOTE,
                  input_mib=args.mib, reps=args.reps, warmup=args.warmup, wave_steps=args.wave_steps,
                  pinned_d2h_gbs=link[0] / 1e9 if link else None, pinned_h2d_gbs=link[1] / 1e9 if link else None,
                  skipped=[dict(codec=f, reason=w) for f, w in skipped], rows=rows)
    write_json(os.path.join(out, "codecs.json"), result)
    plot(os.path.join(out, "codecs.png"), rows, link,
         f"codecs on {gpu}, torch {torch.__version__}, {args.mib} MiB inputs" + ("" if cuda else f"\n{CPU_NOTE}"))
    if any(r.get("bound_held") is False for r in rows):
        print("FAIL: a codec broke its stated guarantee (see BROKEN rows)", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
