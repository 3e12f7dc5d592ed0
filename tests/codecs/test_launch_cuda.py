"""NOTE [ Kernel launches ] on CUDA: launches through the compiled kernels give the JIT launch's results, hit their
cache for arguments of a kind seen before and go through the JIT for a new kind or while launch hooks are set."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda

triton = pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import triton.language as tl  # noqa: E402

from torchckpt.codecs import TritonQuant  # noqa: E402
from torchckpt.codecs import _launch  # noqa: E402
from torchckpt.codecs._launch import Launch  # noqa: E402


@triton.jit
def _axpy(x_ptr, y_ptr, out_ptr, a, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, a * tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)


def _run(go: Launch, x: torch.Tensor, y: torch.Tensor, a: float) -> torch.Tensor:
    out = torch.full_like(x, float("nan"))
    n = x.numel()
    go((triton.cdiv(n, 128),), x, y, out, a, n, BLOCK=128)
    return out


def test_cache_by_kind_and_results() -> None:
    go = Launch(_axpy)
    base = torch.randn(4096, device="cuda")
    y = torch.randn(4096, device="cuda")
    cases = [(base[:1000], y[:1000]), (base[:1800], y[:1800]),  # i32, neither 1 nor a multiple of 16: one kind
             (base[1:1001], y[:1000]),  # x 4 bytes off 16: a new kind
             (base[:1024], y[:1024]),  # n a multiple of 16: a new kind
             (base[:1], y[:1])]  # n == 1: a new kind
    calls = []
    for x, yy in cases:
        got = _run(go, x, yy, 0.5)
        assert torch.equal(got, 0.5 * x + yy)
        calls.append(go.jit_calls)
    assert calls == [1, 1, 2, 3, 4]
    for x, yy in cases:  # every kind again: all from the cache, same results
        assert torch.equal(_run(go, x, yy, 2.0), 2.0 * x + yy)
    assert go.jit_calls == 4


def test_side_stream_is_the_current_one() -> None:
    go = Launch(_axpy)
    x, y = torch.randn(1 << 20, device="cuda"), torch.randn(1 << 20, device="cuda")
    _run(go, x, y, 1.0)  # compiled and cached
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = _run(go, x, y, 0.25)  # on s: the result is there once s is done (0.25: a * x is exact, fused or not)
        done = torch.cuda.Event()
        done.record()
    done.synchronize()
    assert go.jit_calls == 1
    assert torch.equal(out, 0.25 * x + y)


def test_hooks_and_disabled_go_through_the_jit() -> None:
    from triton import knobs

    go = Launch(_axpy)
    x, y = torch.randn(300, device="cuda"), torch.randn(300, device="cuda")
    _run(go, x, y, 1.0)
    seen = []

    def hook(meta: object) -> None:
        seen.append(1)

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # a chain of hooks (Triton 3.5+), as profilers add theirs
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        _run(go, x, y, 1.0)
        _run(go, x, y, 1.0)
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert go.jit_calls == 3 and len(seen) == 2  # a profiler's hook sees every launch
    _launch.ENABLED = False
    try:
        assert torch.equal(_run(go, x, y, 1.0), x + y)
    finally:
        _launch.ENABLED = True
    assert go.jit_calls == 4
    _run(go, x, y, 1.0)
    assert go.jit_calls == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_triton_quant_bytes_as_through_the_jit(dtype: torch.dtype, bits: int) -> None:
    """TritonQuant's save and restore, exact and deferred, give the same bytes and bits with the cache on (twice:
    the second from the cache) as with every launch through the JIT, on data with raw blocks and a masked tail."""
    c = TritonQuant(bits=bits, mode="abs", bound=1e-3)
    g = torch.Generator(device="cuda").manual_seed(0)
    base = (torch.randn(100_003 + 8, device="cuda", generator=g) * 3).to(dtype)
    base[::977] = float("nan")
    results = []
    for enabled in (False, True, True):
        _launch.ENABLED = enabled
        try:
            got = []
            for x in (base[:100_003], base[1:100_004], base[:4096]):  # tail; misaligned; whole blocks
                p = c.compress(x)
                d = c.compress_deferred(x)
                sizes = d.sizes.tolist()
                q = c.settle(d, sizes)
                got += [b.clone() for b in p.buffers] + [b.clone() for b in q.buffers]
                got += [c.decompress(p).view(torch.uint8), c.decompress(d.packed).view(torch.uint8)]
            results.append(got)
        finally:
            _launch.ENABLED = True
    assert all(len(r) == len(results[0]) for r in results)
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert a.shape == b.shape and torch.equal(a, b)
