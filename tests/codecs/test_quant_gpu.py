"""TritonQuant on CUDA: Triton kernels bit-identical to the reference, the bound, streams, no raw blocks at the
benchmark's settings (throughput is benchmarks/quant_throughput.py's)."""
from __future__ import annotations

import pytest
import torch

from torchckpt.codecs import Packed, TritonQuant
from torchckpt.codecs import quant as Q

pytestmark = pytest.mark.cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CODES = [(8, "int"), (4, "int"), (8, "e4m3")]


def ity(dtype: torch.dtype) -> torch.dtype:
    return torch.int32 if dtype == torch.float32 else torch.int16


def adversarial(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, device="cuda", generator=g) * torch.logspace(-4, 4, n, device="cuda")
    x[::997] = float("nan")
    x[5::1999] = float("inf")
    x[300:900] = 3.0
    x[1000:1100] = -0.0
    x[2000:2100] = 1e-40
    x[3000:3001] = 3e38
    x[3100:3101] = -3e38
    return x.to(dtype)


def compare(t: TritonQuant, r: TritonQuant, x: torch.Tensor) -> tuple[list[str], Packed]:
    """How Triton and reference differ (packed bytes, decoded bits, CPU decode of GPU bytes); the Triton form."""
    pt, pr = t.compress(x), r.compress(x)
    diffs = [] if pt.meta == pr.meta else [f"meta {pt.meta} != {pr.meta}"]
    for i, (a, b) in enumerate(zip(pt.buffers, pr.buffers)):
        if a.shape != b.shape or not torch.equal(a, b):
            diffs.append(f"packed buffer {i} differs")
    it = ity(x.dtype)
    yt, yr = t.decompress(pt), r.decompress(pr)
    if not torch.equal(yt.view(it), yr.view(it)):
        diffs.append("decoded bits differ")
    cpu = r.decompress(Packed(tuple(b.cpu() for b in pr.buffers), pr.meta)).view(it)
    if not torch.equal(cpu, yt.cpu().view(it)):  # the CPU reference decodes the GPU's bytes the same
        diffs.append("CPU decode of the bytes differs")
    return diffs, pt


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,fmt", CODES)
@pytest.mark.parametrize("mode,bound", [("abs", 1e-3), ("abs", 0.05), ("rel", 0.01), ("rel", 0.1)])
@pytest.mark.parametrize("n", [100_003, 8192, 4096, 1])
def test_triton_matches_reference_bits(dtype: torch.dtype, bits: int, fmt: str, mode: str, bound: float,
                                       n: int) -> None:
    x = adversarial(max(n, 3200), dtype)[:n]
    diffs, _ = compare(TritonQuant(bits, mode, bound, use_triton=True, fmt=fmt),
                       TritonQuant(bits, mode, bound, use_triton=False, fmt=fmt), x)
    assert not diffs, diffs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,fmt", CODES)
def test_triton_matches_reference_smooth_data(dtype: torch.dtype, bits: int, fmt: str) -> None:
    """Mostly quantized blocks (few raw), several launch shapes: whole programs plus a masked tail."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1 << 20 | 77, device="cuda", generator=g).to(dtype)
    for mode, bound in (("rel", 0.1), ("abs", 0.2), ("rel", 0.02)):
        diffs, p = compare(TritonQuant(bits, mode, bound, use_triton=True, fmt=fmt),
                           TritonQuant(bits, mode, bound, use_triton=False, fmt=fmt), x)
        assert not diffs, (mode, bound, diffs)
        if (mode, bound) == ("rel", 0.1):
            assert p.meta.params["raw_blocks"] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_e4m3_rounding_ties_match(dtype: torch.dtype) -> None:
    """x * inv lands on every e4m3 value, every midpoint (ties to even) and their fp32 neighbours."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([grid, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e4))])
    v = torch.cat([v, -v])
    B = 256
    per = B - 1
    nblk = -(-v.numel() // per)
    v = torch.cat([v, v.new_zeros(nblk * per - v.numel())]).view(nblk, per)
    x = torch.cat([torch.full((nblk, 1), 448.0), v], 1).reshape(-1)  # max|x| = 448: scale 1, inv 1
    for scale in (1.0, 2.0**-10, 3.0):  # 3.0: inv is not a power of two
        xs = (x * scale).to(dtype).cuda()
        diffs, _ = compare(TritonQuant(8, "abs", 1e3, use_triton=True, fmt="e4m3"),
                           TritonQuant(8, "abs", 1e3, use_triton=False, fmt="e4m3"), xs)
        assert not diffs, (scale, diffs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,fmt", CODES)
@pytest.mark.parametrize("mode,bound", [("abs", 1e-3), ("abs", 1e-2), ("rel", 1e-2), ("rel", 0.1)])
def test_bound_on_cuda(dtype: torch.dtype, bits: int, fmt: str, mode: str, bound: float) -> None:
    c = TritonQuant(bits, mode, bound, fmt=fmt)
    for x in (adversarial(300_001, dtype), torch.randn(1 << 20, device="cuda").to(dtype),
              torch.randn(64, 999, device="cuda").to(dtype).t()):
        p = c.compress(x)
        _check(c, x.contiguous(), c.decompress(p))


def test_side_stream_and_out() -> None:
    for fmt in ("int", "e4m3"):
        c = TritonQuant(8, "rel", 0.05, fmt=fmt)
        s = torch.cuda.Stream()
        x = torch.rand(1 << 22, device="cuda") * 2
        p = c.compress(x, stream=s)
        out = torch.empty_like(x)
        c.decompress(p, out=out, stream=s)
        ev = torch.cuda.Event()
        ev.record(s)
        torch.cuda.current_stream().wait_event(ev)
        assert p.meta.params["raw_blocks"] == 0 and 3.8 < p.ratio < 4.0
        _check(c, x, out)


def test_raw_count_and_compaction_on_cuda() -> None:
    """The kernel's raw-block count drives the compaction: NaN blocks come back bit-exact."""
    x = torch.randn(1 << 16, device="cuda")
    x[5] = float("nan")
    x[70_000 % x.numel()] = float("inf")
    x[-1] = -float("inf")
    for bits, fmt in CODES:
        c = TritonQuant(bits, "rel", 0.2, fmt=fmt)
        p = c.compress(x)
        assert p.meta.params["raw_blocks"] == 3
        y = c.decompress(p)
        fin = torch.isfinite(x)
        assert torch.equal(x[~fin].view(torch.int32), y[~fin].view(torch.int32))
        _check(c, x, y)


def test_more_than_2_31_elements() -> None:
    """64-bit indexing (BIG): the last blocks of a 2**31 + 1000 element tensor match the reference."""
    free, _ = torch.cuda.mem_get_info()
    n = 2**31 + 1000
    if free < 14 * 2**30:
        pytest.skip("needs 14 GiB of free GPU memory")
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    x.normal_()
    B, tail = 256, 3 * 256 + 1000
    start = n - tail
    x[-7] = float("nan")
    for bits, fmt in ((4, "int"), (8, "e4m3")):
        t = TritonQuant(bits, "rel", 0.1, fmt=fmt)
        p = t.compress(x)
        assert p.meta.params["raw_blocks"] == 1
        codes, params = p.buffers[0], p.buffers[1].view(torch.float32)
        c2, p2 = Q._quant_ref(x[start:], bits, B, True, t._b32, fmt)
        npar = 1 if fmt == "e4m3" else 2
        assert torch.equal(codes[start * bits // 8:], c2)
        assert torch.equal(params[start // B * npar:].view(torch.int32), p2.reshape(-1).view(torch.int32))
        y = t.decompress(p)
        assert torch.equal(y[-8:-6].view(torch.int16), x[-8:-6].view(torch.int16))  # raw block: bit-exact
        _check(t, x[start:], y[start:])
        del p, y


def _check(c: TritonQuant, x: torch.Tensor, y: torch.Tensor) -> None:
    xf, yf = x.reshape(-1).double(), y.reshape(-1).double()
    fin = torch.isfinite(xf)
    assert torch.equal(x.reshape(-1).view(ity(x.dtype))[~fin], y.reshape(-1).view(ity(x.dtype))[~fin])
    d = (xf - yf).abs()
    if c.mode == "abs":
        lim = torch.full_like(xf, c.bound)
    else:
        n, B = xf.numel(), c.block
        a = torch.where(fin, xf.abs(), torch.zeros_like(xf))
        amax = torch.cat([a, a.new_zeros((-n) % B)]).view(-1, B).amax(1)
        lim = (c.bound * amax).repeat_interleave(B)[:n]
    assert not (fin & ~((d <= lim) | (d == 0))).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,fmt,bound", [(8, "int", 1e-2), (4, "int", 0.1), (8, "e4m3", 0.05)])
def test_no_raw_blocks_at_the_benchmark_settings(dtype: torch.dtype, bits: int, fmt: str, bound: float) -> None:
    """The settings benchmarks/quant_throughput.py measures send no block raw on 256 MiB of N(0,1)."""
    n = (256 << 20) // dtype.itemsize
    x = torch.randn(n, device="cuda").to(dtype)
    p = TritonQuant(bits, "rel", bound, fmt=fmt).compress(x)
    assert p.meta.params["raw_blocks"] == 0
