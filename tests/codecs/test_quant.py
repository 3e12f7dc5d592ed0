"""TritonQuant and the codec interface on the CPU (reference path): the stated bound on adversarial input."""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchckpt.codecs import Codec, Guarantee, Identity, Packed, TritonQuant
from torchckpt.codecs import quant as quant_mod

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CODES = [(8, "int"), (4, "int"), (8, "e4m3")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_bound(c: TritonQuant, x: torch.Tensor, y: torch.Tensor) -> None:
    """Every element is bit-exact or within the guarantee of NOTE [ Block quantization ] Rule 3."""
    assert y.shape == x.shape and y.dtype == x.dtype
    xf = x.contiguous().reshape(-1).double()
    yf = y.contiguous().reshape(-1).double()
    fin = torch.isfinite(xf)
    # NaN and Inf come back bit-exact (their blocks are raw), NaN payloads included
    ity = torch.int32 if x.dtype == torch.float32 else torch.int16
    xb, yb = x.contiguous().reshape(-1).view(ity), y.contiguous().reshape(-1).view(ity)
    assert torch.equal(xb[~fin], yb[~fin])
    d = (xf - yf).abs()
    if c.mode == "abs":
        lim = torch.full_like(xf, c.bound)
    else:
        n, B = xf.numel(), c.block
        pad = (-n) % B
        a = torch.where(fin, xf.abs(), torch.zeros_like(xf))
        amax = torch.cat([a, a.new_zeros(pad)]).view(-1, B).amax(1)
        lim = (c.bound * amax).repeat_interleave(B)[:n]
    bad = fin & ~((d <= lim) | (d == 0))
    assert not bad.any(), f"bound broken at {bad.nonzero()[:5].flatten().tolist()}: x={xf[bad][:5]}, x'={yf[bad][:5]}"


def roundtrip(c: TritonQuant, x: torch.Tensor) -> Packed:
    p = c.compress(x)
    check_bound(c, x, c.decompress(p))
    return p


floats = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
specials = st.sampled_from([0.0, -0.0, 1e-45, -1e-40, 3.4e38, -3.4e38, float("nan"), float("inf"), -float("inf"), 1.0])
values = st.lists(st.one_of(floats, specials, st.floats(-2, 2, width=32)), min_size=0, max_size=700)


@settings(max_examples=200, deadline=None)
@given(vals=values, dtype=st.sampled_from(DTYPES), codes=st.sampled_from(CODES), mode=st.sampled_from(["abs", "rel"]),
       bound=st.sampled_from([1e-6, 1e-3, 0.05, 0.5, 10.0]), block=st.sampled_from([64, 256]),
       layout=st.sampled_from(["flat", "strided", "transposed"]))
def test_bound_holds_adversarial(vals: list[float], dtype: torch.dtype, codes: tuple[int, str], mode: str,
                                 bound: float, block: int, layout: str) -> None:
    x = torch.tensor(vals, dtype=torch.float32).to(dtype)
    if layout == "strided":
        x = x[::2]
    elif layout == "transposed" and x.numel() >= 6:
        x = x[: x.numel() // 3 * 3].view(3, -1).t()
    c = TritonQuant(bits=codes[0], mode=mode, bound=bound, block=block, fmt=codes[1])
    check_bound(c, x, c.decompress(c.compress(x)))  # asserts the stated bound element by element


@settings(max_examples=100, deadline=None)
@given(vals=st.lists(st.floats(-1e6, 1e6, width=32, allow_subnormal=True), min_size=1, max_size=600),
       scale=st.sampled_from([1.0, 1e-3, 1e-30, 1e-38, 1e30, 3.0]), dtype=st.sampled_from(DTYPES),
       mode=st.sampled_from(["abs", "rel"]), bound=st.sampled_from([1e-3, 0.02, 0.07, 1.0]))
def test_e4m3_bound_holds_on_scaled_finite_data(vals: list[float], scale: float, dtype: torch.dtype, mode: str,
                                                 bound: float) -> None:
    """e4m3 on finite data of any magnitude (tiny scales hit the 2**-126 floor of
    NOTE [ Block quantization ] Rule 1)."""
    x = (torch.tensor(vals, dtype=torch.float64) * scale).float().to(dtype)
    c = TritonQuant(bits=8, mode=mode, bound=bound, block=64, fmt="e4m3")
    p = c.compress(x)
    check_bound(c, x, c.decompress(p))
    codes = p.buffers[0].view(torch.float8_e4m3fn).float()
    assert not torch.isnan(codes).any()  # no code saturates or is NaN in a finite block (NOTE [ Block quantization ] Rule 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["constant", "zeros", "huge_range", "denormal", "odd", "empty", "scalar", "steps"])
def test_bound_named_cases(dtype: torch.dtype, case: str) -> None:
    n = 1000
    x = {
        "constant": torch.full((n,), 3.25),
        "zeros": torch.zeros(n),
        "huge_range": torch.randn(n) * torch.logspace(-30, 30, n),
        "denormal": torch.randn(n) * 1e-40,
        "odd": torch.randn(257 * 3 + 1),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(2.5),
        "steps": torch.arange(n) % 7 * 1e-3,
    }[case].to(dtype)
    for c in (TritonQuant(8, "abs", 1e-3), TritonQuant(4, "abs", 1e-2), TritonQuant(8, "rel", 1e-2),
              TritonQuant(4, "rel", 0.1), TritonQuant(8, "abs", 1e-2, fmt="e4m3"),
              TritonQuant(8, "rel", 0.05, fmt="e4m3")):
        p = roundtrip(c, x)
        assert p.meta.shape == x.shape and p.meta.dtype == x.dtype


@pytest.mark.parametrize("bits,fmt", CODES)
def test_nan_inf_survive_bit_exact(bits: int, fmt: str) -> None:
    x = torch.randn(1000)
    x[3] = float("nan")
    x[400] = float("inf")
    x[999] = -float("inf")
    c = TritonQuant(bits, "rel", 0.1, fmt=fmt)
    p = c.compress(x)
    y = c.decompress(p)
    assert p.meta.params["raw_blocks"] == 3
    assert p.meta.params["tail_raw"]  # the partial last block (1000 = 3 * 256 + 232) is raw
    for i in (3, 400, 999):
        assert y[i].view(torch.int32) == x[i].view(torch.int32)
    check_bound(c, x, y)


@pytest.mark.parametrize("bits,lo,hi", [(8, 3.8, 4.0), (4, 7.4, 8.0)])
def test_ratio(bits: int, lo: float, hi: float) -> None:
    x = torch.rand(1 << 20)
    c = TritonQuant(bits, "abs", 0.05)
    p = roundtrip(c, x)
    assert p.meta.params["raw_blocks"] == 0
    assert lo < p.ratio < hi, p.ratio
    assert p.nbytes == sum(b.numel() for b in p.buffers)
    assert all(b.dtype == torch.uint8 for b in p.buffers)


def test_ratio_e4m3_and_format() -> None:
    """e4m3: one byte per element plus one fp32 scale per block; codes decode as torch's float8_e4m3fn."""
    x = torch.randn(1 << 16)
    c = TritonQuant(8, "rel", 0.05, fmt="e4m3")
    p = roundtrip(c, x)
    assert p.meta.params["raw_blocks"] == 0 and p.meta.params["fmt"] == "e4m3"
    assert p.ratio == pytest.approx(1024 / 260)
    scale = p.buffers[1].view(torch.float32)
    assert scale.numel() == x.numel() // 256 and bool((scale > 0).all())
    y = p.buffers[0].view(torch.float8_e4m3fn).float().view(-1, 256) * scale[:, None]
    assert torch.equal(y.reshape(-1), c.decompress(p))
    amax = x.view(-1, 256).abs().amax(1)
    assert torch.equal(p.buffers[0].view(torch.float8_e4m3fn).float().view(-1, 256).abs().amax(1),
                       torch.full_like(amax, 448.0))  # each block's max|x| maps to 448
    assert "fmt='e4m3'" in repr(c) and "fmt" not in repr(TritonQuant())


def test_e4m3_is_finer_near_zero_int_near_the_max() -> None:
    """The two formats on N(0,1) at 8 bits: e4m3 keeps small values more precisely, int the large ones."""
    x = torch.randn(1 << 16)
    yi = TritonQuant(8, "rel", 0.5).decompress(TritonQuant(8, "rel", 0.5).compress(x))
    e = TritonQuant(8, "rel", 0.5, fmt="e4m3")
    ye = e.decompress(e.compress(x))
    small, large = x.abs() < 0.1, x.abs() > 2.5
    assert (ye - x)[small].abs().max() < (yi - x)[small].abs().max()
    assert (ye - x)[large].abs().max() > (yi - x)[large].abs().max()


def test_4bit_nibble_layout() -> None:
    """NOTE [ Block quantization ] Rule 4: element j of a block sits in the low nibble of byte j, element j + block/2 in
    its high nibble."""
    x = torch.cat([torch.zeros(32), torch.full((32,), 15.0)])  # one block of 64: codes 0 then 15
    p = TritonQuant(4, "abs", 0.01, block=64).compress(x)
    assert torch.equal(p.buffers[0], torch.full((32,), 0xF0, dtype=torch.uint8))


def test_ratio_half_types_and_rel() -> None:
    x = torch.randn(1 << 16, dtype=torch.bfloat16)
    p = roundtrip(TritonQuant(8, "rel", 0.01), x)
    assert 1.9 < p.ratio < 2.0 and p.meta.params["raw_blocks"] == 0
    p = roundtrip(TritonQuant(4, "rel", 0.1), x)
    assert 3.7 < p.ratio < 4.0 and p.meta.params["raw_blocks"] == 0


@pytest.mark.parametrize("n,bad", [(1024, [1023]), (1024, [0, 300]), (1000, [0, 600]), (1000, [999]), (100, [50]),
                                   (257, [256]), (257, [0, 256])])
def test_raw_blocks_whole_and_partial(n: int, bad: list[int]) -> None:
    """Raw whole blocks are gathered as rows, a raw partial last block padded (NOTE [ Block quantization ] Rule 4); all
    come back bit-exact."""
    x = torch.randn(n)
    x[bad] = float("nan")
    c = TritonQuant(8, "rel", 0.05)
    p = c.compress(x)
    blocks = sorted({i // 256 for i in bad})
    assert p.buffers[2].view(torch.int32).tolist() == blocks
    assert p.meta.params["tail_raw"] == (n % 256 != 0 and blocks[-1] == n // 256)
    raw = p.buffers[3].view(torch.float32).view(-1, 256)
    for k, b in enumerate(blocks):
        seg = x[b * 256:(b + 1) * 256]
        want = torch.cat([seg, seg[-1:].expand(256 - seg.numel())])
        assert torch.equal(raw[k].view(torch.int32), want.view(torch.int32))
    y = c.decompress(p)
    assert torch.equal(y.view(torch.int32)[bad], x.view(torch.int32)[bad])
    check_bound(c, x, y)


def test_blocks_that_cannot_meet_the_bound_are_raw() -> None:
    x = torch.randn(4096) * 100  # range ~ 800 per block: needs far more than 255 steps of 2e-3
    c = TritonQuant(8, "abs", 1e-3)
    p = c.compress(x)
    assert p.meta.params["raw_blocks"] == p.meta.params["blocks"]
    assert torch.equal(c.decompress(p), x)


def test_decompress_into_out_and_noncontiguous_out() -> None:
    c = TritonQuant(8, "abs", 1e-2)
    x = torch.randn(30, 40)
    p = c.compress(x)
    out = torch.empty(30, 40)
    assert c.decompress(p, out=out) is out
    check_bound(c, x, out)
    big = torch.empty(40, 30).t()
    assert not big.is_contiguous()
    c.decompress(p, out=big)
    check_bound(c, x, big)


def test_reference_is_deterministic_bytes() -> None:
    x = torch.randn(5000, dtype=torch.float16)
    c = TritonQuant(4, "rel", 0.1)
    a, b = c.compress(x), c.compress(x.clone())
    assert all(torch.equal(u, v) for u, v in zip(a.buffers, b.buffers))


@pytest.mark.parametrize("kwargs", [dict(bits=3), dict(bits=16), dict(bits=True), dict(mode="max"), dict(bound=0),
                                    dict(bound=-1e-3), dict(bound=float("nan")), dict(bound=float("inf")),
                                    dict(bound=1e-50), dict(block=100), dict(block=32), dict(fmt="e5m2"),
                                    dict(fmt="e4m3", bits=4), dict(fmt=None)])
def test_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="^torchckpt:"):
        TritonQuant(**kwargs)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.uint8, torch.bool])
def test_unsupported_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="^torchckpt:.*float32, float16 and bfloat16"):
        TritonQuant().compress(torch.zeros(10, dtype=dtype))


def test_misuse_errors() -> None:
    c = TritonQuant()
    with pytest.raises(TypeError, match="^torchckpt:"):
        c.compress([1.0, 2.0])  # type: ignore[arg-type]
    p = c.compress(torch.randn(10))
    with pytest.raises(ValueError, match="^torchckpt:.*shape"):
        c.decompress(p, out=torch.empty(11))
    with pytest.raises(ValueError, match="^torchckpt:.*triton_quant"):
        Identity().decompress(p)
    with pytest.raises(TypeError, match="^torchckpt:"):
        c.decompress("packed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^torchckpt:.*stream"):
        c.compress(torch.randn(10), stream=object())  # type: ignore[arg-type]


def test_guarantee() -> None:
    assert TritonQuant(8, "abs", 1e-3).guarantee.describe() == "lossy: |x - x'| <= 0.001 per element"
    assert "max|x| over its block of 256" in TritonQuant(4, "rel", 0.1).guarantee.describe()
    assert Identity().guarantee == Guarantee("lossless")
    for bad in (dict(kind="lossy", bound=1.0), dict(kind="abs"), dict(kind="abs", bound=0.0),
                dict(kind="lossless", bound=1.0)):
        with pytest.raises(ValueError, match="^torchckpt:"):
            Guarantee(**bad)  # type: ignore[arg-type]


def test_availability_is_reported() -> None:
    c = TritonQuant()
    reason = c.unavailable_reason()
    assert c.is_available() == (reason is None)
    if not torch.cuda.is_available():
        assert reason is not None and ("CUDA" in reason or "triton" in reason)
    assert Identity().is_available() and isinstance(Identity(), Codec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_identity_roundtrip(dtype: torch.dtype) -> None:
    x = (torch.randn(7, 9) * 10).to(dtype).t()
    c = Identity()
    p = c.compress(x)
    assert p.nbytes == x.numel() * x.element_size() and p.ratio == 1.0
    assert torch.equal(c.decompress(p), x)
    out = torch.empty(9, 7, dtype=dtype)
    c.decompress(p, out=out)
    assert torch.equal(out, x)


# The interpreter converts fp32 -> bf16 by truncation and fp32 <-> fp8 with a carry bug; the
# script swaps in torch's round-to-nearest-even conversions (what the GPU's cvt.rn does), so
# this test checks the kernels' logic for every dtype and format; the GPU test checks the hardware.
_INTERP_CONVERT = """
import numpy as np, torch
import triton.runtime.interpreter as _I
_T = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8e4nv": torch.float8_e4m3fn}
_orig = _I._convert_float
def _convert_float(input, input_dtype, output_dtype, rounding_mode):
    a, b = _T.get(input_dtype.name), _T.get(output_dtype.name)
    if a is None or b is None:
        return _orig(input, input_dtype, output_dtype, rounding_mode)
    arr = np.ascontiguousarray(input)
    t = torch.from_numpy(arr.reshape(-1).copy()).view(a).to(b)
    return t.view({1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[b.itemsize]).numpy().reshape(arr.shape)
_I._convert_float = _convert_float
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_triton_kernels_match_reference_in_interpreter() -> None:
    """The Triton kernels, run by triton's CPU interpreter, give the reference's bytes
    (NOTE [ Block quantization ] Rule 6), masked and not."""
    script = _INTERP_CONVERT + textwrap.dedent("""
        import os, torch
        from torchckpt.codecs import quant as Q, _quant_triton as K
        torch.manual_seed(0)
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            for bits, fmt in ((8, "int"), (4, "int"), (8, "e4m3")):
                # n = 2048: whole programs only; 3000: whole programs and a masked tail
                for rel, bound, n in ((False, 0.05, 2048), (True, 0.1, 3000), (False, 1e-4, 3000)):
                    x = (torch.randn(n) * torch.logspace(-3, 3, n)).to(dt)
                    x[17] = float("nan"); x[1800] = -float("inf"); x[600:900] = 3.0; x[1500:1520] = -0.0
                    x[1024:1280] = torch.randn(256).to(dt)  # a block that quantizes in every setting
                    if dt == torch.float32:
                        x[1000:1010] = 1e-40
                    B = 256; nb = -(-n // B); b = Q._fp32_at_most(bound); rows = 4
                    codes = torch.empty(nb * B * bits // 8, dtype=torch.uint8)
                    params = torch.empty(nb, 1 if fmt == "e4m3" else 2)
                    count = torch.zeros(1, dtype=torch.int32)
                    Q._launch(K.quant_kernel, n, nb, B, rows,
                              (x, codes, params, count, n, nb, b, float(2**bits - 1)),
                              REL=rel, BITS=bits, FP8=fmt == "e4m3", BLOCK=B, ROWS=rows, OUT=Q._tl_dtype(dt))
                    c2, p2 = Q._quant_ref(x, bits, B, rel, b, fmt)
                    key = (dt, bits, fmt, rel, n)
                    assert torch.equal(codes, c2), key
                    assert torch.equal(params.view(torch.int32), p2.view(torch.int32)), key
                    assert int(count) == int((p2[:, -1] < 0).sum()), key
                    assert bound < 0.05 or bool((p2[:, -1] >= 0).any()), key  # not all raw
                    out = torch.zeros(n, dtype=dt); out2 = out.clone()
                    Q._launch(K.dequant_kernel, n, nb, B, rows, (codes, params, out, n, nb), BITS=bits,
                              FP8=fmt == "e4m3", BLOCK=B, ROWS=rows, OUT=Q._tl_dtype(dt))
                    Q._dequant_ref(c2, p2, out2, bits, B, fmt)
                    ity = torch.int16 if dt != torch.float32 else torch.int32
                    assert torch.equal(out.view(ity), out2.view(ity)), key
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_bound_is_largest_fp32_below() -> None:
    for v in (1e-3, 0.1, 1 / 3, 1e-30):
        f = quant_mod._fp32_at_most(v)
        assert f <= v and torch.tensor(f, dtype=torch.float32).item() == f
        assert float(torch.nextafter(torch.tensor(f), torch.tensor(math.inf))) > v
