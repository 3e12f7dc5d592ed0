"""ZFP on CUDA (cuZFP): bytes identical to CPU zfp, round trips, NaN/Inf, stream ordering, no host fallback.

Needs a GPU and torchckpt._zfp built with cuZFP (``TORCHCKPT_BUILD_ZFP=1 pip install --no-build-isolation -e .``
where a CUDA toolkit is found). Throughput, codec and op alone, is benchmarks/codecs.py's.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from torchckpt._native import ops
from torchckpt.codecs import zfp as zfp_mod
from torchckpt.codecs.zfp import ZFP, field_shape, packed_layout

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not zfp_mod.ext_has_cuda(),
                       reason="torchckpt._zfp with cuZFP is not built: TORCHCKPT_BUILD_ZFP=1 pip install "
                              "--no-build-isolation -e . (with a CUDA toolkit)"),
]


def smooth(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    grids = torch.meshgrid(*[torch.linspace(0, 1, n, dtype=torch.float64, device=device) for n in shape],
                           indexing="ij")
    f = torch.zeros(shape, dtype=torch.float64, device=device)
    for k, g in enumerate(grids):
        f = f + torch.sin(2 * math.pi * (k + 1) * g + 0.3 * k)
    return (f * 3.7 + 1.0).to(dtype)


def field(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Smooth data plus a little noise, on the CPU (so both sides start from the same bits)."""
    g = torch.Generator().manual_seed(0)
    return smooth(shape, dtype) + 0.01 * torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


SHAPES = [(1000,), (37,), (1 << 16,), (64, 64), (33, 17), (16, 16, 16), (5, 6, 7), (30, 41, 9), (2, 3, 5, 7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rate", [1, 4.5, 8, 16, 32])
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_bytes_match_cpu(dtype: torch.dtype, rate: float, shape: tuple[int, ...]) -> None:
    x = field(shape, dtype)
    c = ZFP(rate=rate)
    pc, pg = c.compress(x), c.compress(x.cuda())
    assert pg.device.type == "cuda" and pg.nbytes == pc.nbytes
    assert torch.equal(pg.buffers[0].cpu(), pc.buffers[0])  # stream, pad word and flags, byte for byte
    yc, yg = c.decompress(pc), c.decompress(pg)
    ity = torch.int32 if dtype == torch.float32 else torch.int64
    assert torch.equal(yg.cpu().view(ity), yc.view(ity))
    # each side decodes the other's bytes the same
    cross = type(pc)(pc.buffers[0].cuda(), pc.meta)
    assert torch.equal(c.decompress(cross).cpu().view(ity), yc.view(ity))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gpu_nonfinite_blocks_match_cpu(dtype: torch.dtype) -> None:
    shape = (9, 10, 11)
    x = field(shape, dtype)
    for pt, v in zip([(0, 0, 0), (5, 9, 10), (8, 3, 2)], [float("nan"), float("inf"), -float("inf")]):
        x[pt] = v
    c = ZFP(rate=12)
    pc, pg = c.compress(x), c.compress(x.cuda())
    sb = pc.meta.params["stream_bytes"]
    assert torch.equal(pg.buffers[0][sb:].cpu(), pc.buffers[0][sb:])  # same flags (stream bits may differ there)
    yc, yg = c.decompress(pc), c.decompress(pg).cpu()
    # blocks (z, y, x) clipped to the field: 4*4*4 + 4*2*3 + 1*4*4 values
    assert torch.equal(torch.isnan(yg), torch.isnan(yc)) and int(torch.isnan(yc).sum()) == 64 + 24 + 16
    ok = ~torch.isnan(yc)
    assert torch.equal(yg[ok], yc[ok])


def test_raise_mode_on_gpu() -> None:
    c = ZFP(rate=8, nonfinite="raise")
    x = smooth((32, 32, 32), device="cuda")
    assert torch.equal(c.decompress(c.compress(x)), ZFP(rate=8).decompress(ZFP(rate=8).compress(x)))
    x[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        c.compress(x)


def test_side_stream_ordering_and_no_host_sync() -> None:
    """NOTE [ ZFP fixed rate ] Rule 4: cuZFP runs on the legacy stream, ordered with the caller's stream both ways."""
    c = ZFP(rate=16)
    shape = (64, 64, 64)
    src = field(shape, torch.float32)
    ref = c.compress(src)
    ref_y = c.decompress(ref)
    srcg = src.cuda()
    c.decompress(c.compress(srcg))  # warm up
    torch.cuda.synchronize()
    s, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    cycles = 200_000_000  # ~0.1 s of GPU time
    # compress: x is written on s after a long sleep; zfp (legacy stream) must wait for it
    x = torch.zeros_like(srcg)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(cycles)
        x.copy_(srcg)
    t0 = time.perf_counter()
    p = c.compress(x, stream=s)
    host_s = time.perf_counter() - t0
    with torch.cuda.stream(s):
        got = p.buffers[0].cpu()
    assert host_s < 0.05, f"compress blocked the host for {host_s:.3f} s"
    assert torch.equal(got, ref.buffers[0])
    # decompress: the legacy stream is busy (sleep), the caller's current stream is s2; a consumer
    # on s must see zfp's output, not the sentinel
    out = torch.full(shape, 7.0, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.default_stream()):
        torch.cuda._sleep(cycles)
    with torch.cuda.stream(s2):
        t0 = time.perf_counter()
        c.decompress(p, out=out, stream=s)
        host_s = time.perf_counter() - t0
    with torch.cuda.stream(s):
        seen = out.clone()
    ev = torch.cuda.Event()
    ev.record(s)
    ev.synchronize()
    assert host_s < 0.05, f"decompress blocked the host for {host_s:.3f} s"
    assert torch.equal(seen.cpu(), ref_y)


def test_roundtrip_fp64_4d_and_noncontiguous() -> None:
    c = ZFP(rate=24)
    x = smooth((3, 20, 18, 10), torch.float64, device="cuda")
    y = c.decompress(c.compress(x))
    assert y.shape == x.shape and y.dtype == torch.float64 and float((y - x).abs().max()) < 1e-5
    xt = smooth((40, 24), device="cuda").t()
    out = torch.empty(40, 24, device="cuda").t()
    c.decompress(c.compress(xt), out=out)
    assert torch.equal(out.cpu(), c.decompress(c.compress(xt.cpu().contiguous())))


def _time(fn, iters: int) -> float:
    """Seconds per call, by CUDA events on the current stream, after two warm-up calls."""
    fn()
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def test_gpu_path_is_not_a_fallback() -> None:
    """A 256^3 fp32 field goes through cuZFP far faster than any host round trip could (a floor, not a
    benchmark: throughput is benchmarks/codecs.py's)."""
    shape = (256, 256, 256)
    x = smooth(shape, device="cuda")
    nbytes = x.numel() * 4
    for rate in (8, 16):
        c = ZFP(rate=rate)
        p = c.compress(x)
        out = torch.empty_like(x)
        fld = list(field_shape(shape))
        _, _, total = packed_layout(fld, torch.float32, rate, flags=False)
        buf = torch.zeros(total, dtype=torch.uint8, device="cuda")
        calls = {"codec compress": lambda: c.compress(x), "codec decompress": lambda: c.decompress(p, out=out),
                 "op compress": lambda: ops.zfp_compress(x, fld, float(rate), buf),  # the op alone: no flag pass
                 "op decompress": lambda: ops.zfp_decompress(buf, fld, float(rate), out)}
        for name, call in calls.items():  # far below any working GPU path; catches a fallback or a host round trip
            gbps = nbytes / _time(call, 20) / 1e9
            assert gbps > 5, f"ZFP(rate={rate}) {name}: {gbps:.1f} GB/s of input, under any GPU path's (a host fallback?)"
