"""``SnapshotStore.restore(out=...)`` on CUDA (NOTE [ Snapshot store ] Rule 11): codecs decode straight into the
caller's tensors, bit-identical to the plain restore, with no device allocation of the state's size."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from ckpt_models import assert_bits_equal
from torchckpt import SnapshotStore
from torchckpt.adjoint import run_schedule
from torchckpt.codecs import ZFP, Bitcomp, Codec, Identity, Packed, TritonQuant
from torchckpt.memory import HostPool
from torchckpt.schedules import Prefetch, Restore, Revolve, Save, Tier, ZCut, plan_prefetch

from test_snapshot_restore_into import _replay

pytestmark = pytest.mark.cuda

QUANTS = [TritonQuant(bits=8, mode="abs", bound=1e-3), TritonQuant(bits=4, mode="rel", bound=0.1),
          TritonQuant(bits=8, mode="rel", bound=0.05, fmt="e4m3")]


def _pool() -> HostPool:
    return HostPool(capacity_bytes=1 << 30, chunk_bytes=16 << 20, pin=True)


def adversarial(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values that force raw blocks (non-finite, huge, subnormal), so the raw scatter writes into ``out`` too."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, device="cuda", generator=g) * torch.logspace(-4, 4, n, device="cuda")
    x[::997] = float("nan")
    x[5::1999] = float("inf")
    x[2000:2100] = 1e-40
    x[3000:3001] = 3e38
    return x.to(dtype)


@pytest.mark.parametrize("codec", QUANTS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1 << 20, (1 << 20) + 77])  # whole programs, and a masked tail with a partial raw block
def test_triton_decode_into_out_is_in_place_and_bit_identical(codec: TritonQuant, dtype: torch.dtype, n: int) -> None:
    x = adversarial(n, dtype).view(-1, 1) if n % 2 else adversarial(n, dtype).view(1024, -1)
    p = codec.compress(x)
    assert isinstance(p, Packed) and p.meta.params["raw_blocks"] > 0
    want = codec.decompress(p)
    out = torch.full_like(x, 7.0)
    ptr = out.data_ptr()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = codec.decompress(p, out=out)
    torch.cuda.synchronize()
    assert got is out and out.data_ptr() == ptr
    assert torch.cuda.max_memory_allocated() - base < out.numel() * out.element_size() // 8  # no temporary output
    assert_bits_equal([out], [want])


def _codecs() -> list[Any]:
    out: list[Any] = [None, Identity(), *QUANTS]
    for c in (Bitcomp(), Bitcomp(delta=1e-3), ZFP(rate=12)):
        out.append(c if c.is_available() else pytest.param(c, marks=pytest.mark.skip(reason=c.unavailable_reason() or "")))
    return out


def _state(n: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(3000 + n)
    return [torch.cumsum(torch.randn(32, 32, 32, device="cuda", generator=g), 2),
            torch.randn(16, 16, 16, device="cuda", generator=g) * (n + 1)]


@pytest.mark.parametrize("codec", _codecs(), ids=repr)
@pytest.mark.parametrize("tier", [Tier.GPU, Tier.HOST])
def test_store_restore_into_matches_the_plain_restore(codec: Codec | None, tier: Tier) -> None:
    sched = list(plan_prefetch(list(Revolve(12, 3, tier=tier)), 2)) + list(ZCut(7, tier=tier))
    sched += [Save(20, tier), Prefetch(20, Tier.GPU, Tier.GPU), Prefetch(20, Tier.GPU, Tier.GPU)]
    sched += [Save(21, tier), Restore(21, tier), Restore(20, tier)]  # a restore with every slot pinned (Rule 4)
    plain = SnapshotStore("cuda", slots=1, host=_pool(), codec=codec)
    into = SnapshotStore("cuda", slots=1, host=_pool(), codec=codec)
    assert _replay(sched, _state, plain, into) > 10
    plain.close()
    into.close()


@pytest.mark.parametrize("codec", [None, QUANTS[1]], ids=repr)
def test_restore_into_64mib_allocates_nothing_of_its_size(codec: Codec | None) -> None:
    x = [torch.randn(64 << 18, device="cuda")]
    s = SnapshotStore("cuda", slots=2, host=_pool(), codec=codec)
    s.save(0, Tier.HOST, x)
    s.save(1, Tier.GPU, x)
    out = [torch.empty_like(x[0])]
    for n, tier in [(0, Tier.HOST), (1, Tier.GPU)]:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        s.restore(n, tier, out=out)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base < (8 << 20), (n, tier)
    s.close()


def test_run_schedule_restore_into_on_cuda() -> None:
    """The RTM's pattern: two state buffers written in place by the store, results as with ``restore=``."""
    N = 30
    logs = []
    for into in (False, True):
        u, v = torch.linspace(0, 1, 1 << 16, device="cuda"), torch.zeros(1 << 16, device="cuda")
        log: list[torch.Tensor] = []

        def forward(n0: int, n1: int) -> None:
            for _ in range(n0, n1):
                v.add_(torch.sin(u * 1.3), alpha=0.1)
                u.add_(v, alpha=0.1)

        def restore(n: int, t: list[torch.Tensor]) -> None:
            u.copy_(t[0])
            v.copy_(t[1])

        kw: dict[str, Any] = {"restore_into": lambda n: (u, v)} if into else {"restore": restore}
        snaps = SnapshotStore("cuda", slots=2, host=_pool(), codec=QUANTS[0])
        run_schedule(Revolve(N, 4, tier=Tier.HOST), forward=forward, save=lambda n: (u, v),
                     backward=lambda n: log.append(u + v), store=snaps, **kw)
        snaps.close()
        logs.append(log)
    assert len(logs[0]) == N and all(torch.equal(a, b) for a, b in zip(*logs))
