"""``Codec.compress_deferred`` on the CPU: the sizes left on the device, decoded as they are and settled later, give
``compress``'s bytes and ``decompress``'s bits (NOTE [ Codec streams ] Rule 3, NOTE [ Block quantization ] Rule 5)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchckpt.codecs import Bitcomp, Codec, Deferred, Identity, Packed, TritonQuant

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CODES = [(8, "int"), (4, "int"), (8, "e4m3")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ity(dtype: torch.dtype) -> torch.dtype:
    return torch.int32 if dtype.itemsize == 4 else torch.int16


def adversarial(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Smooth and wild values, NaN (with payloads), +-Inf, -0.0, subnormals, values near the dtype's max."""
    g = torch.Generator().manual_seed(seed)
    m = max(n, 3200)
    x = torch.randn(m, generator=g) * torch.logspace(-4, 4, m)
    x[::997] = float("nan")
    x[5::1999] = float("inf")
    x[7::2003] = -float("inf")
    x[300:900] = 3.0
    x[1000:1100] = -0.0
    x[2000:2100] = 1e-40
    x[3000:3001] = 3e38
    x[3100:3101] = -3e38
    x = x.to(dtype)
    if dtype == torch.float32:  # NaNs with payloads, quiet and signalling
        b = x.view(torch.int32)
        k = b[1::1501].numel()
        b[1::1501] = torch.tensor([0x7F800001, 0x7FC00123, -0x7FFFFB] * k, dtype=torch.int32)[:k]
    return x[:n]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(ity(a.dtype)),
                                                                      b.reshape(-1).view(ity(b.dtype)))


def same_packed(a: Packed, b: Packed) -> bool:
    return a.meta == b.meta and len(a.buffers) == len(b.buffers) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(a.buffers, b.buffers))


def check_deferred(c: Codec, x: torch.Tensor, same_bytes: bool = True) -> None:
    """The deferred form decodes to ``decompress(compress(x))``'s bits as it is and settled; settled, it is
    ``compress``'s Packed byte for byte (``same_bytes=False``: its meta and the decoded bits only, for a codec whose
    bytes may differ from one compression to the next); decoding into an ``out`` (contiguous or not) gives the same
    bits."""
    p = c.compress(x)
    want = c.decompress(p)
    d = c.compress_deferred(x)
    assert isinstance(d, Deferred)
    assert same_bits(c.decompress(d.packed), want)
    out = torch.full_like(x, 7.0)
    assert c.decompress(d.packed, out=out) is out and same_bits(out, want)
    if x.dim() == 2 and x.shape[1] > 1:
        t = torch.full_like(x.t().contiguous(), 5.0).t()  # a non-contiguous out
        c.decompress(d.packed, out=t)
        assert same_bits(t.contiguous(), want)
    s = c.settle(d, d.sizes.tolist() if d.sizes is not None else [])
    assert same_packed(s, p) if same_bytes else s.meta == p.meta, (s.meta, p.meta)
    assert same_bits(c.decompress(s), want)
    assert all(b.device == x.device for b in s.buffers)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,fmt", CODES)
@pytest.mark.parametrize("mode,bound", [("abs", 1e-3), ("rel", 0.01), ("abs", 1e-12), ("rel", 0.5)])
@pytest.mark.parametrize("n", [1, 255, 256, 3000, 10_001])
def test_quant_deferred_is_compress_bit_for_bit(dtype: torch.dtype, bits: int, fmt: str, mode: str, bound: float,
                                                n: int) -> None:
    c = TritonQuant(bits, mode, bound, fmt=fmt, use_triton=False)
    check_deferred(c, adversarial(n, dtype))


@pytest.mark.parametrize("block", [64, 4096])
def test_quant_deferred_blocks_and_shapes(block: int) -> None:
    c = TritonQuant(8, "abs", 1e-6, block=block)
    for shape in [(0,), (3, 0), (5, 7), (40, 300), (2, 3, 4, 5)]:
        x = adversarial(max(1, torch.Size(shape).numel()), torch.float32)[: torch.Size(shape).numel()].view(shape)
        check_deferred(c, x)


def test_quant_deferred_all_raw_and_none_raw() -> None:
    """Every block raw (the worst case the buffers have room for) and no block raw."""
    c = TritonQuant(4, "abs", 1e-30)
    x = torch.randn(5000) * 100
    d = c.compress_deferred(x)
    assert d.sizes is not None and d.sizes.tolist() == [-(-5000 // 256), 1]
    check_deferred(c, x)
    y = torch.linspace(-1, 1, 4096)
    d = TritonQuant(8, "abs", 0.1).compress_deferred(y)
    assert d.sizes is not None and d.sizes.tolist() == [0, 0]
    check_deferred(TritonQuant(8, "abs", 0.1), y)


def test_quant_deferred_keeps_count_on_device() -> None:
    """The deferred meta holds the count as a tensor (read on the device); settle makes it compress's int."""
    c = TritonQuant(8, "abs", 1e-3)
    x = adversarial(5000, torch.float32)
    d = c.compress_deferred(x)
    assert isinstance(d.packed.meta.params["raw_blocks"], torch.Tensor) and d.sizes is not None
    s = c.settle(d, d.sizes.tolist())
    assert s.meta.params["raw_blocks"] == c.compress(x).meta.params["raw_blocks"] > 0
    with pytest.raises(RuntimeError, match="internal error"):
        c.settle(d, [10**6, 0])  # more raw blocks than blocks: never trusted


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**16), bound=st.sampled_from([1e-6, 1e-3, 0.1]),
       code=st.sampled_from(CODES), dtype=st.sampled_from(DTYPES), mode=st.sampled_from(["abs", "rel"]),
       block=st.sampled_from([64, 256]))
def test_quant_deferred_fuzz(n: int, seed: int, bound: float, code: tuple[int, str], dtype: torch.dtype, mode: str,
                             block: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * 10 ** torch.randint(-5, 5, (n,), generator=g).float()).to(dtype)
    x[torch.rand(n, generator=g) < 0.01] = float("nan")
    check_deferred(TritonQuant(code[0], mode, bound, block=block, fmt=code[1]), x)


def test_default_deferred_is_compress() -> None:
    """Codecs whose sizes follow from the shape defer nothing: ``sizes`` is None and settle returns the Packed."""
    x = adversarial(3000, torch.float32)
    for c in (Identity(),) + ((Bitcomp(), Bitcomp(delta=1e-3)) if Bitcomp().is_available() else ()):
        d = c.compress_deferred(x)
        assert d.sizes is None and c.settle(d, []) is d.packed
        check_deferred(c, x)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_raw_block_kernels_match_reference_in_interpreter() -> None:
    """The deferred path's Triton side, run by triton's CPU interpreter: the quantizer counting into ``sizes[0]``'s low
    word, the raw rows copied by their markers (``sizes[1]`` written) and put back, give the PyTorch reference's
    bytes and sizes, and ranked as ``settle`` ranks them, ``_gather_raw``'s; put back, ``_scatter_raw``'s bits."""
    script = textwrap.dedent("""
        import torch
        from tests.codecs.test_deferred import adversarial, ity
        from torchckpt.codecs import TritonQuant
        from torchckpt.codecs import quant as Q
        seen = 0
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            for B in (64, 256, 4096):
                for n in (1, B - 1, B, 3000, 10_001):
                    for bound in (1e-3, 1e-12):
                        key = (dt, B, n, bound)
                        x = adversarial(n, dt)
                        nb = -(-n // B)
                        sizes = torch.zeros(2, dtype=torch.int64)
                        _, params, _ = TritonQuant(8, "abs", bound, block=B)._quantize(
                            x, n, nb, count=sizes.view(torch.int32)[:1])
                        raw_t = Q._raw_rows_triton(x, params, B, sizes)
                        raw_r, sz_r = Q._raw_rows_dev(x, params, B)
                        assert torch.equal(sizes, sz_r), (key, sizes, sz_r)
                        k = int(sz_r[0])
                        seen += k
                        ids, raw, tail = Q._gather_raw(x, params, B, -1)
                        assert tail == (k > 0 and n % B != 0 and bool(sizes[1])), key
                        if k:
                            for rows in (raw_t, raw_r):
                                got_ids, got = Q._rank_raw_rows(params, rows, B, k)
                                assert torch.equal(got_ids, ids) and torch.equal(got, raw), key
                        o_t, o_r, o = (torch.zeros_like(x) for _ in range(3))
                        Q._put_raw_rows_triton(o_t, params, raw_t, B)
                        Q._put_raw_rows_dev(o_r, params, raw_r, B)
                        if k:
                            Q._scatter_raw(o, ids.view(torch.int32), raw.view(dt), B, tail)
                        assert torch.equal(o_t.view(ity(dt)), o.view(ity(dt))), key
                        assert torch.equal(o_r.view(ity(dt)), o.view(ity(dt))), key
        assert seen > 1000, seen
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
