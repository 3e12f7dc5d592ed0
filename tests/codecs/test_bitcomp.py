"""Bitcomp on the CPU (nvCOMP's host functions): bit-exact lossless, the stated lossy bound on adversarial input.

Skipped with a reason when nvCOMP's library is missing, except the tests of that error itself.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitcomp_checks import INT_VIEW, LOSSLESS_DTYPES, LOSSY, bits, check_bound, sample
from torchckpt._errors import CheckpointError
from torchckpt.codecs import Guarantee, Identity, Packed, TritonQuant
from torchckpt._native import nvcomp as nv
from torchckpt.codecs import bitcomp as bc
from torchckpt.codecs.base import Meta
from torchckpt.codecs.bitcomp import Bitcomp

needs_nvcomp = pytest.mark.skipif(nv.unavailable_reason() is not None,
                                  reason=f"needs nvCOMP: {nv.unavailable_reason()}")


def roundtrip(c: Bitcomp, x: torch.Tensor) -> Packed:
    p = c.compress(x)
    y = c.decompress(p)
    if c.delta is None:
        assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(bits(y), bits(x))
    else:
        check_bound(c, x, y)
    return p


# -- lossless ------------------------------------------------------------------------------
@needs_nvcomp
@pytest.mark.parametrize("dtype", LOSSLESS_DTYPES)
@pytest.mark.parametrize("shape", [(1000,), (7, 13), (1,), (0, 3), (), (3, 5, 257)])
def test_lossless_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = sample(dtype, shape)
    p = roundtrip(Bitcomp(), x)
    assert p.meta.shape == x.shape and p.meta.dtype == x.dtype and p.meta.params["mode"] == "lossless"
    assert all(b.dtype == torch.uint8 for b in p.buffers)


@needs_nvcomp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_lossless_noncontiguous_and_specials(dtype: torch.dtype) -> None:
    x = sample(dtype, (64, 99)).t()[::2]
    assert not x.is_contiguous()
    roundtrip(Bitcomp(), x)
    if dtype.is_floating_point:
        y = sample(dtype, (5000,))
        y[::7] = float("nan")
        y[3::11] = float("inf")
        y[5::13] = -0.0
        roundtrip(Bitcomp(), y)


# -- lossy: the bound -----------------------------------------------------------------------
def _values(width: int) -> st.SearchStrategy[float]:
    sp = [0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), -float("inf")]
    if width == 16:
        sp += [65504.0, -65504.0, 2.0**-24, 6.1e-5, 32752.0]
    elif width == 32:
        sp += [3.4028234663852886e38, -3.4028234663852886e38, 1e-45, -1e-40, 1.1754943508222875e-38]
    else:
        sp += [1.7976931348623157e308, -1.7976931348623157e308, 5e-324, 2.2250738585072014e-308]
    return st.one_of(st.floats(width=width, allow_nan=True, allow_infinity=True, allow_subnormal=True),
                     st.sampled_from(sp), st.floats(-3, 3, width=width))


WIDTH = {torch.float16: 16, torch.float32: 32, torch.float64: 64, torch.bfloat16: 32}
DELTAS = [1e-300, 1e-40, 1e-30, 1e-7, 1e-3, 0.3, 1.0, 64.0, 1e6, 1e30, 3e38, 1e300]


@needs_nvcomp
@settings(max_examples=200, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(LOSSY), delta=st.sampled_from(DELTAS),
       layout=st.sampled_from(["flat", "strided", "transposed"]), n=st.integers(0, 600))
def test_bound_holds_adversarial(data: st.DataObject, dtype: torch.dtype, delta: float, layout: str, n: int) -> None:
    vals = data.draw(st.lists(_values(WIDTH[dtype]), min_size=n, max_size=n))
    x = torch.tensor(vals, dtype=torch.float64).to(dtype)
    if data.draw(st.booleans()):  # runs of one value: constant stretches
        x[: n // 2] = x[n // 2] if n else 0.0
    if layout == "strided":
        x = x[::2]
    elif layout == "transposed" and x.numel() >= 6:
        x = x[: x.numel() // 3 * 3].view(3, -1).t()
    c = Bitcomp(delta=delta)
    check_bound(c, x, c.decompress(c.compress(x)))  # asserts the stated bound element by element


@needs_nvcomp
@pytest.mark.parametrize("dtype", LOSSY)
@pytest.mark.parametrize("case", ["constant", "zeros", "huge_range", "denormal", "odd", "empty", "scalar", "steps",
                                  "max", "max_mix", "nan_inf", "smooth"])
@pytest.mark.parametrize("delta", [1e-6, 2e-3, 1e30, 1e300])
def test_bound_named_cases(dtype: torch.dtype, case: str, delta: float) -> None:
    n = 5000
    fi = torch.finfo(dtype)
    x = {
        "constant": torch.full((n,), 3.25, dtype=torch.float64),
        "zeros": torch.zeros(n, dtype=torch.float64),
        "huge_range": torch.randn(n, dtype=torch.float64) * torch.logspace(-300, 300, n, dtype=torch.float64),
        "denormal": torch.randn(n, dtype=torch.float64) * fi.tiny * 0.5,
        "odd": torch.randn(257 * 3 + 1, dtype=torch.float64),
        "empty": torch.empty(0, 5, dtype=torch.float64),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "steps": (torch.arange(n) % 7).double() * 1e-3,
        "max": torch.full((n,), fi.max, dtype=torch.float64) * torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0),
        "max_mix": torch.where(torch.rand(n) < 0.5, torch.tensor(fi.max, dtype=torch.float64) * torch.rand(n).double(),
                               torch.randn(n, dtype=torch.float64)),
        "nan_inf": torch.randn(n, dtype=torch.float64).index_fill(0, torch.arange(0, n, 97), float("nan"))
                                                     .index_fill(0, torch.arange(5, n, 101), float("inf"))
                                                     .index_fill(0, torch.arange(9, n, 103), -float("inf")),
        "smooth": torch.sin(torch.linspace(0, 50, n, dtype=torch.float64)) * 10,
    }[case].to(dtype)
    c = Bitcomp(delta=delta)
    p = roundtrip(c, x)
    assert p.meta.shape == x.shape and p.meta.dtype == x.dtype


NAN_BITS = {torch.float16: 0x7E05, torch.bfloat16: 0x7FC5, torch.float32: 0x7FC00005,
            torch.float64: 0x7FF8000000000005}  # quiet NaNs with a payload


def _signed(v: int, nbytes: int) -> int:
    top = 1 << (8 * nbytes)
    return v - top if v >= top // 2 else v


@needs_nvcomp
@pytest.mark.parametrize("dtype", LOSSY)
@pytest.mark.parametrize("delta", [1e-2, 1e-5])  # 1e-5: fp16 through fp32 (NOTE [ Bitcomp ] Rule 9)
def test_nan_payload_inf_and_negative_zero(dtype: torch.dtype, delta: float) -> None:
    x = torch.randn(3000).to(dtype)
    size = x.element_size()
    xi = x.view(INT_VIEW[size])
    xi[10] = _signed(NAN_BITS[dtype], size)
    xi[11] = _signed(NAN_BITS[dtype] | (1 << (8 * size - 1)), size)  # the same NaN, sign bit set
    x[12], x[13], x[14] = float("inf"), -float("inf"), -0.0
    assert torch.isnan(x[10]) and torch.isnan(x[11])
    c = Bitcomp(delta=delta)
    y = c.decompress(c.compress(x))
    assert torch.equal(y.view(INT_VIEW[size])[10:14], xi[10:14])
    assert y[14] == 0.0  # -0.0 may come back as +0.0: numerically equal (NOTE [ Bitcomp ] Rule 4)
    check_bound(c, x, y)


@needs_nvcomp
@pytest.mark.parametrize("dtype", LOSSY)
def test_bound_across_magnitudes_around_the_step(dtype: torch.dtype) -> None:
    """Values from far below to far above the step, for steps across the dtype's range (NOTE [ Bitcomp ] Rules 3, 5)."""
    fi = torch.finfo(dtype)
    lo, hi = math.log2(fi.smallest_normal) + math.log2(fi.eps), math.log2(fi.max)
    for k in range(int(lo), int(hi), max(1, int(hi - lo) // 25)):
        delta = 2.0**k * 1.5
        ctr = k + 0.585  # log2(delta)
        e = torch.linspace(max(ctr - 12, lo), min(ctr + 12, hi - 1), 20_000, dtype=torch.float64)
        x = (torch.exp2(e) * torch.randn(20_000, dtype=torch.float64).sign()).to(dtype)
        c = Bitcomp(delta=delta)
        check_bound(c, x, c.decompress(c.compress(x)))


@needs_nvcomp
def test_bound_at_chunk_scale() -> None:
    """One million values with a few specials: past nvCOMP's internal chunking."""
    x = torch.randn(1 << 20) * torch.logspace(-5, 5, 1 << 20)
    x[123_457] = float("nan")
    x[999_999] = -float("inf")
    for delta in (1e-3, 0.5):
        c = Bitcomp(delta=delta)
        p = roundtrip(c, x)
        assert p.ratio > 1.2, p.ratio


# -- what a user sees -----------------------------------------------------------------------
def test_guarantee_and_repr() -> None:
    assert Bitcomp().guarantee == Guarantee("lossless")
    assert Bitcomp(delta=1e-3).guarantee == Guarantee("abs", 2.0**-11)
    assert Bitcomp(delta=1.0).guarantee == Guarantee("abs", 0.5)
    assert Bitcomp(delta=0.99).guarantee == Guarantee("abs", 0.25)
    assert Bitcomp(delta=3).guarantee.bound == 1.0
    assert repr(Bitcomp()) == "Bitcomp()"
    assert repr(Bitcomp(delta=0.002, sparse=True)) == "Bitcomp(delta=0.002, sparse=True)"


def test_pow2_floor_exact() -> None:
    for v in (1.0, 0.75, 1e-3, 3.0, 5e-324, 1e-310, 1.7976931348623157e308, 2.0**-1074, 2.0**1023):
        p = bc._pow2_floor(v)
        assert p <= v < 2 * p and math.frexp(p)[0] == 0.5


def test_recipes() -> None:
    """NOTE [ Bitcomp ] Rules 3 and 5: the step handed to nvCOMP per dtype, caps and lossless fallbacks."""
    r = bc._recipe(torch.float32, 1e-3)
    assert (r.work, r.step, r.mode) == (torch.float32, 2.0**-10, 1)
    assert bc._recipe(torch.bfloat16, 1e-3).step == 2.0**-10 and bc._recipe(torch.bfloat16, 1e-3).work == torch.float32
    assert bc._recipe(torch.float16, 1e4).step == 32.0
    assert bc._recipe(torch.float32, 1e300).step == 2.0**104
    assert bc._recipe(torch.float64, 1e308).step == 2.0**971
    assert bc._recipe(torch.bfloat16, 1e300).step == 2.0**104
    assert bc._recipe(torch.float16, 1e-9).mode == 0 and bc._recipe(torch.float32, 1e-46).mode == 0
    assert bc._recipe(torch.bfloat16, 1e-41).mode == 0 and bc._recipe(torch.bfloat16, 1e-41).work == torch.bfloat16
    assert bc._recipe(torch.bfloat16, 1e-40).mode == 1  # 2**-133 <= p: still lossy
    # NOTE [ Bitcomp ] Rule 9: fp16 steps below 2**-14 go through fp32; 2**-14 and up stay fp16
    r = bc._recipe(torch.float16, 2.0**-15)
    assert (r.work, r.btype, r.step, r.mode) == (torch.float32, nv.FP32, 2.0**-15, 1)
    assert bc._recipe(torch.float16, 2.0**-24).work == torch.float32
    assert bc._recipe(torch.float16, 2.0**-14).work == torch.float16
    assert bc._lossless_type(torch.float32) == nv.S32 and bc._lossless_type(torch.bool) == nv.U8
    assert bc._lossless_type(torch.complex64) == nv.S32 and bc._lossless_type(torch.uint8) == nv.U8


@needs_nvcomp
def test_ratios_on_smooth_data() -> None:
    """Smooth fp32 data: lossless gains a little, lossy a lot more, a coarser step more still."""
    t = torch.linspace(0, 20, 1 << 20, dtype=torch.float64)
    x = (torch.sin(t) * torch.exp(-t / 10)).float()
    r = {d: roundtrip(Bitcomp(delta=d), x).ratio for d in (1e-2, 2e-3, 1e-4)}
    r0 = roundtrip(Bitcomp(), x).ratio
    assert 1.5 < r0 < r[1e-4] < r[2e-3] < r[1e-2], (r0, r)
    assert r[2e-3] > 3.0
    xb = x.bfloat16()
    rb = roundtrip(Bitcomp(delta=2e-3), xb).ratio
    assert rb > 1.5, rb  # counted against bf16 bytes (NOTE [ Bitcomp ] Rule 5)
    # fp16 of small magnitude with a step below fp16's normal range (NOTE [ Bitcomp ] Rule 9): kept raw before
    xh = (x * 1e-3).half()
    for d in (2.0**-15, 2.0**-17):
        rh = roundtrip(Bitcomp(delta=d), xh).ratio
        assert rh > 1.5, (d, rh)  # counted against fp16 bytes; 1.00 when nvCOMP got the fp16 step
    z = torch.zeros(1 << 20)
    z[::1000] = 1.0
    assert roundtrip(Bitcomp(sparse=True), z).ratio > 50


@needs_nvcomp
def test_decompress_into_out_and_odd_buffers() -> None:
    x = torch.randn(30, 40)
    for c in (Bitcomp(), Bitcomp(delta=1e-2)):
        p = c.compress(x)
        out = torch.empty(30, 40)
        assert c.decompress(p, out=out) is out
        t = torch.empty(40, 30).t()  # non-contiguous out
        c.decompress(p, out=t)
        big = torch.empty(1201)
        shifted = big[1:].view(30, 40)  # contiguous, address 4 bytes past alignment
        assert shifted.data_ptr() % 16 != 0
        c.decompress(p, out=shifted)
        for y in (out, t, shifted):
            if c.delta is None:
                assert torch.equal(y, x)
            else:
                check_bound(c, x, y)
        raw = torch.empty(p.nbytes + 3, dtype=torch.uint8)
        moved = raw[3:]
        moved.copy_(p.buffers[0])  # a packed buffer at an odd address (e.g. placed in a pool)
        q = Packed(moved, p.meta)
        assert torch.equal(c.decompress(q), c.decompress(p))
        xs = torch.randn(1001)[1:]  # input at an odd address
        assert torch.equal(Bitcomp().decompress(Bitcomp().compress(xs)), xs)


@needs_nvcomp
def test_any_bitcomp_decodes_from_meta() -> None:
    x = torch.randn(999, dtype=torch.float64)
    p = Bitcomp(delta=0.1).compress(x)
    check_bound(Bitcomp(delta=0.1), x, Bitcomp().decompress(p))
    assert torch.equal(Bitcomp(delta=5.0, sparse=True).decompress(p), Bitcomp(delta=0.1).decompress(p))


@needs_nvcomp
def test_deterministic_bytes() -> None:
    x = torch.randn(10_000, dtype=torch.float16)
    a, b = Bitcomp(delta=1e-2).compress(x), Bitcomp(delta=1e-2).compress(x.clone())
    assert torch.equal(a.buffers[0], b.buffers[0])


@pytest.mark.parametrize("delta", [0, -1e-3, float("nan"), float("inf"), -float("inf"), True, "0.1", 1j])
def test_bad_delta(delta: object) -> None:
    with pytest.raises(ValueError, match="^torchckpt: Bitcomp delta must be a finite number > 0.*Bitcomp\\(\\)"):
        Bitcomp(delta=delta)  # type: ignore[arg-type]


def test_bad_sparse() -> None:
    with pytest.raises(TypeError, match="^torchckpt:"):
        Bitcomp(sparse=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_lossy_unsupported_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="^torchckpt: lossy Bitcomp.*float16, float32, float64 and bfloat16.*Bitcomp\\(\\)"):
        Bitcomp(delta=1e-3).compress(torch.zeros(10).to(dtype))


@needs_nvcomp
def test_misuse_errors() -> None:
    c = Bitcomp()
    with pytest.raises(TypeError, match="^torchckpt:"):
        c.compress([1.0, 2.0])  # type: ignore[arg-type]
    p = c.compress(torch.randn(10))
    with pytest.raises(ValueError, match="^torchckpt:.*shape"):
        c.decompress(p, out=torch.empty(11))
    with pytest.raises(ValueError, match="^torchckpt:.*bitcomp"):
        Identity().decompress(p)
    with pytest.raises(ValueError, match="^torchckpt:.*triton_quant"):
        c.decompress(TritonQuant().compress(torch.randn(10)))
    with pytest.raises(TypeError, match="^torchckpt:"):
        c.decompress("packed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^torchckpt:.*stream"):
        c.compress(torch.randn(10), stream=object())  # type: ignore[arg-type]
    bad = p.buffers[0].clone()
    bad[:8] = 0xFF  # a broken header
    with pytest.raises(ValueError, match="^torchckpt: this Bitcomp buffer does not hold what its meta says"):
        c.decompress(Packed(bad, p.meta))
    other = Bitcomp().compress(torch.randn(12))  # another tensor's bytes under this meta
    with pytest.raises(ValueError, match="^torchckpt: this Bitcomp buffer"):
        c.decompress(Packed(other.buffers[0], p.meta))
    with pytest.raises(ValueError, match="^torchckpt: this Bitcomp buffer"):
        c.decompress(Packed(p.buffers[0][: p.nbytes // 2], p.meta))  # truncated


@pytest.fixture
def no_nvcomp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the loader look only at a path that does not exist (restored afterwards)."""
    monkeypatch.setattr(nv, "_candidates", lambda: ["/nonexistent/libnvcomp.so.6"])
    monkeypatch.setattr(nv, "_loaded", False)
    monkeypatch.setattr(nv, "_lib", None)
    monkeypatch.setattr(nv, "_reason", None)
    monkeypatch.setattr(nv, "_path", None)


def test_missing_library_is_reported(no_nvcomp: None) -> None:
    c = Bitcomp(delta=1e-3)
    reason = c.unavailable_reason()
    assert reason is not None and "pip install nvidia-libnvcomp-cu13==6.0.0.12" in reason and "libnvcomp.so.6" in reason
    assert not c.is_available() and nv.version() is None and nv.library_path() is None
    with pytest.raises(CheckpointError, match="^torchckpt: Bitcomp needs nvCOMP 6.*pip install nvidia-libnvcomp-cu13"):
        c.compress(torch.randn(10))
    p = Packed(torch.zeros(8, dtype=torch.uint8), Meta(torch.Size([2]), torch.float32, "bitcomp", {
        "mode": "lossless", "delta": None, "step": None, "bound": None, "work_dtype": torch.float32,
        "bitcomp_type": nv.S32, "bitcomp_mode": 0, "algo": 0, "nbytes": 8}))
    with pytest.raises(CheckpointError, match="^torchckpt: Bitcomp needs nvCOMP"):
        c.decompress(p)


@needs_nvcomp
def test_library_found_in_wheel() -> None:
    assert Bitcomp().is_available()
    assert nv.version() is not None and nv.version() // 1000 == 6  # type: ignore[operator]
    path = nv.library_path()
    assert path is not None and path.endswith("libnvcomp.so.6")


def test_library_is_searched_on_sys_path(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wheel folder that find_spec cannot see (another ``nvidia`` package first) is still found."""
    import pathlib
    import sys

    lib = pathlib.Path(str(tmp_path)) / "nvidia" / "libnvcomp" / "lib64" / nv.SONAME
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)
    assert str(lib) in nv._candidates()


class _FakeEvent:
    done = False

    def record(self, stream: object) -> None:
        pass

    def query(self) -> bool:
        return _FakeEvent.done


class _FakeStream:
    cuda_stream = 0  # the legacy default stream; bitcompSetStream only stores it


@needs_nvcomp
def test_plan_cache_lru_and_deferred_destroy(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Bitcomp ] Rule 7 on the CPU: real host plans, a fake event: evicted plans wait for their event."""
    monkeypatch.setattr(bc.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(_FakeEvent, "done", False)
    cache = bc._PlanCache(2)
    dev, s = torch.device("cuda", 0), _FakeStream()
    for n in (1000, 2000, 3000, 4000, 1000):
        for _ in range(2):
            with cache.use(dev, n, nv.S32, nv.LOSSLESS, nv.DEFAULT_ALGO, s) as h:  # type: ignore[arg-type]
                assert h.value
    assert len(cache) == 2 and len(cache._retired) == 3  # events not done: nothing destroyed yet
    _FakeEvent.done = True
    with cache.use(dev, 10, nv.S32, nv.LOSSLESS, nv.DEFAULT_ALGO, s):  # type: ignore[arg-type]
        pass
    assert len(cache) == 2 and len(cache._retired) == 1  # three destroyed, one more evicted
    with cache.use(dev, 10, nv.S32, nv.LOSSLESS, nv.DEFAULT_ALGO, s):  # type: ignore[arg-type]
        pass
    assert len(cache._retired) == 0


@needs_nvcomp
def test_a_plan_used_in_a_capture_is_never_evicted(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Bitcomp ] Rule 7: a plan used while its stream captures a CUDA graph (NOTE [ Captured saves ]) stays,
    however many others come after it; the others are evicted least recently used first, as before."""
    monkeypatch.setattr(bc.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(_FakeEvent, "done", False)
    cache = bc._PlanCache(2)
    dev, s = torch.device("cuda", 0), _FakeStream()
    capturing = [True]
    monkeypatch.setattr(bc.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(bc.torch.cuda, "is_initialized", lambda: True)
    with cache.use(dev, 1000, nv.S32, nv.LOSSLESS, nv.DEFAULT_ALGO, s):  # type: ignore[arg-type]
        pass
    capturing[0] = False
    for n in (2000, 3000, 4000, 5000):
        with cache.use(dev, n, nv.S32, nv.LOSSLESS, nv.DEFAULT_ALGO, s):  # type: ignore[arg-type]
            pass
    kept = [k[1] for k in cache._plans]
    assert len(cache) == 2 and 1000 in kept and 5000 in kept and len(cache._retired) == 3


def test_error_codes_are_named() -> None:
    with pytest.raises(CheckpointError, match="^torchckpt: nvCOMP bitcompUncompress failed with BITCOMP_INVALID_ALIGNMENT"):
        nv.check(-3, "bitcompUncompress")
    nv.check(0, "anything")


