"""Bitcomp on CUDA: round trips on side streams, the bound, the same format as the host path (throughput is
benchmarks/codecs.py's)."""
from __future__ import annotations

import threading

import pytest
import torch

from bitcomp_checks import LOSSLESS_DTYPES, LOSSY, bits, check_bound, sample
from torchckpt.codecs import Packed
from torchckpt._native import nvcomp as nv
from torchckpt.codecs import bitcomp as bc
from torchckpt.codecs.bitcomp import Bitcomp

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(nv.unavailable_reason() is not None, reason=f"needs nvCOMP: {nv.unavailable_reason()}")]


def to(p: Packed, device: str) -> Packed:
    return Packed(tuple(b.to(device) for b in p.buffers) if isinstance(p.data, tuple) else p.data.to(device), p.meta)


def adversarial(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, device="cuda", generator=g, dtype=torch.float64) * torch.logspace(-6, 6, n, device="cuda",
                                                                                         dtype=torch.float64)
    x[::997] = float("nan")
    x[5::1999] = float("inf")
    x[7::2003] = -float("inf")
    x[300:900] = 3.0
    x[1000:1100] = -0.0
    x[2000:2100] = torch.finfo(dtype).tiny / 4
    x[3000:3010] = torch.finfo(dtype).max
    x[3100:3110] = -torch.finfo(dtype).max
    return x.to(dtype)


@pytest.mark.parametrize("dtype", LOSSLESS_DTYPES)
@pytest.mark.parametrize("shape", [(1000,), (3, 5, 257), (0,), ()])
def test_lossless_on_side_stream(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    c = Bitcomp()
    x = sample(dtype, shape).cuda()
    s = torch.cuda.Stream()
    p = c.compress(x, stream=s)
    out = torch.empty_like(x)
    c.decompress(p, out=out, stream=s)
    torch.cuda.current_stream().wait_stream(s)
    assert p.device.type == "cuda" and torch.equal(bits(out), bits(x))


@pytest.mark.parametrize("dtype", LOSSY)
@pytest.mark.parametrize("delta", [1e-6, 2e-3, 0.5, 1e30, 1e300])
def test_lossy_bound_on_cuda(dtype: torch.dtype, delta: float) -> None:
    c = Bitcomp(delta=delta)
    s = torch.cuda.Stream()
    for x in (adversarial(300_001, dtype), torch.randn(1 << 20, device="cuda").to(dtype),
              torch.randn(64, 999, device="cuda").to(dtype).t(), torch.empty(0, device="cuda", dtype=dtype)):
        p = c.compress(x, stream=s)
        y = c.decompress(p, stream=s)
        torch.cuda.current_stream().wait_stream(s)
        check_bound(c, x.contiguous(), y)


@pytest.mark.parametrize("dtype", LOSSY)
@pytest.mark.parametrize("delta", [None, 2e-3, 0.5])
@pytest.mark.parametrize("n", [1 << 22, 100_003, 1])
def test_host_and_device_share_the_format(dtype: torch.dtype, delta: float | None, n: int) -> None:
    """GPU output decodes on the host and the reverse, to the same values (NOTE [ Bitcomp ] Rule 1)."""
    c = Bitcomp(delta=delta)
    x = adversarial(max(n, 4000), dtype)[:n]
    pg, ph = c.compress(x), c.compress(x.cpu())
    yg = c.decompress(pg)
    assert torch.equal(bits(c.decompress(to(pg, "cpu"))), bits(yg.cpu()))  # GPU bytes, host decoder
    assert torch.equal(bits(c.decompress(to(ph, "cuda")).cpu()), bits(c.decompress(ph)))  # host bytes, GPU decoder
    assert torch.equal(bits(yg.cpu()), bits(c.decompress(ph)))  # both encoders give the same values
    if delta is not None:
        check_bound(c, x, yg)
    else:
        assert torch.equal(bits(yg), bits(x))


def test_stream_ordering_and_no_sync_in_decompress() -> None:
    """compress on a side stream waits for the producer of x; decompress enqueues without synchronizing."""
    c = Bitcomp(delta=1e-3)
    s = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    x = (a @ a).sin()  # still running on the current stream when compress is called
    p = c.compress(x, stream=s)
    out = torch.empty_like(x)
    torch.cuda.set_sync_debug_mode("error")
    try:
        c.decompress(p, out=out, stream=s)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ev = torch.cuda.Event()
    ev.record(s)
    torch.cuda.current_stream().wait_event(ev)
    check_bound(c, x, out)


def test_threads_share_plans_safely() -> None:
    """Two threads on two streams use the same cached plan (same size) at once (NOTE [ Bitcomp ] Rule 7)."""
    errors: list[BaseException] = []
    xs = [torch.randn(1 << 18, device="cuda") * (i + 1) for i in range(8)]
    torch.cuda.synchronize()

    def work(k: int) -> None:
        try:
            s = torch.cuda.Stream()
            c = Bitcomp(delta=1e-3) if k % 2 else Bitcomp()
            for _ in range(10):
                for x in xs:
                    y = c.decompress(c.compress(x, stream=s), stream=s)
                    s.synchronize()
                    if c.delta is None:
                        assert torch.equal(y, x)
                    else:
                        check_bound(c, x, y)
        except BaseException as e:  # reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[0]


def test_plan_cache_evicts_and_destroys(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = bc._PlanCache(2)
    monkeypatch.setattr(bc, "_PLANS", cache)
    c = Bitcomp(delta=1e-2)
    for n in (1000, 2000, 3000, 4000, 1000):
        x = torch.randn(n, device="cuda")
        check_bound(c, x, c.decompress(c.compress(x)))
        assert len(cache) <= 2
    torch.cuda.synchronize()
    x = torch.randn(10, device="cuda")
    c.compress(x)  # destroys the retired plans (their events are done), then evicts one more
    assert len(cache._retired) == 1
    torch.cuda.synchronize()
    c.compress(x)  # the same plan: nothing evicted, the last retired one destroyed
    assert len(cache._retired) == 0 and len(cache) == 2


def test_bound_holds_on_256_mib() -> None:
    """256 MiB fp32, smooth and N(0,1): lossless comes back equal, lossy within its bound (the inputs and
    settings of benchmarks/codecs.py's ``smooth`` and ``normal`` rows for ``bitcomp lossless`` and ``delta=2e-3``)."""
    n = (256 << 20) // 4
    g = torch.Generator(device="cuda").manual_seed(0)
    i = torch.arange(n, device="cuda", dtype=torch.float32)
    z, y, xx = i // (512 * 512), (i // 512) % 512, i % 512
    smooth = torch.sin(xx / 40) * torch.cos(y / 23) * torch.sin(z / 11 + 0.3)  # a 256x512x512 wave-like field
    for x in (smooth, torch.randn(n, device="cuda", generator=g)):
        for c in (Bitcomp(), Bitcomp(delta=2e-3)):
            out = torch.empty_like(x)
            c.decompress(c.compress(x), out=out)
            if c.delta is not None:
                assert (out - x).abs().max().item() <= c.guarantee.bound  # type: ignore[operator]
            else:
                assert torch.equal(out, x)
