"""CUDA: codecs in the training store and the snapshot store, with real streams.

A lossless codec must leave gradients bit-identical (the stress test delays the copy streams at
random, so a decompress that reads a buffer before its copy landed, or a buffer reused too early,
shows up as a mismatch); a lossy one must stay within its guarantee.
"""
from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ckpt_models import Echo, assert_same_grads, clone
from test_saved_cuda import ACT, B, D, T, apply, host_in_use, run_step, stack, store
from torchckpt import Offload, Recompute
from torchckpt.adjoint import run_schedule
from torchckpt.codecs import Identity, TritonQuant
from torchckpt.schedules import Revolve, Tier
from torchckpt.store import SnapshotStore

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _math_sdpa() -> Iterator[None]:
    with sdpa_kernel(SDPBackend.MATH):
        yield


@pytest.mark.parametrize("budget", [0, 2 * ACT, 6 * ACT])
def test_identity_codec_stress_bit_exact(budget: int) -> None:
    rng = random.Random(99)
    plain = stack(torch.float32, seed=5)
    s = store(budget, codec=Identity())
    model = apply(clone(plain), [Offload(s), Recompute(store=s), Offload(s), Offload(s)])
    delays = {"d2h": 0, "h2d": 0}

    def delay(kind: str, stream: torch.cuda.Stream) -> None:
        delays[kind] += 1
        torch.cuda._sleep(rng.randint(0, 2_000_000))

    s._set_delay(delay)
    g = torch.Generator(device="cuda").manual_seed(7)
    for i in range(12):
        x = torch.randn(B, T, D, device="cuda", generator=g)
        ref = run_step(plain, x, seed=i)
        got = run_step(model, x, seed=i)
        assert torch.equal(got[0], ref[0]), f"step {i}"
        assert_same_grads(got[1], ref[1])
    s._set_delay(None)
    torch.cuda.synchronize()
    st = s.stats()
    assert st.compressed > 0 and delays["d2h"] > 0 and host_in_use(s) == 0
    if budget:
        assert st.prefetch_hits > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lossy_codec_gradients_close_and_fewer_bytes(dtype: torch.dtype) -> None:
    plain = stack(dtype, seed=6)
    s = store(2 * ACT)
    codec = TritonQuant(bits=8, mode="rel", bound=1e-2)
    model = apply(clone(plain), [Offload(s, codec=codec)] * 4)
    g = torch.Generator(device="cuda").manual_seed(8)
    for i in range(3):
        x = torch.randn(B, T, D, device="cuda", dtype=dtype, generator=g)
        ref = run_step(plain, x, seed=i)
        got = run_step(model, x, seed=i)
        rel = ((got[0].float() - ref[0].float()).norm() / ref[0].float().norm()).item()
        assert rel < 0.05, f"step {i}: relative gradient error {rel}"
    torch.cuda.synchronize()
    st = s.stats()
    assert st.compressed > 0
    assert st.compressed_bytes < 0.7 * st.offloaded_bytes


@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_saved_tensor_within_abs_bound_on_cuda(budget: int) -> None:
    bound = 5e-2
    s = store(budget, codec=TritonQuant(bits=8, mode="abs", bound=bound))
    a = torch.randn(1 << 20, device="cuda") * 0.5
    x = torch.zeros_like(a, requires_grad=True)
    with s.hooks():
        y = Echo.apply(x, a * 1.0)
    y.sum().backward()
    err = (x.grad - a).abs().max().item()
    assert 0 < err <= bound if budget == 0 else err == 0  # resident in the cache: never compressed


def _wave_like(n: int) -> tuple[list[torch.Tensor], dict]:
    """A damped nonlinear map on two fields, a stand-in for a wave step (cheap, deterministic)."""
    u = [torch.sin(torch.linspace(0, 20, n, device="cuda")), torch.zeros(n, device="cuda")]

    def forward(n0: int, n1: int) -> None:
        for _ in range(n0, n1):
            nxt = 0.9 * torch.roll(u[0], 1) + 0.1 * u[1]
            u[1] = u[0]
            u[0] = nxt

    return u, dict(forward=forward, save=lambda n: (u[0], u[1]))


@pytest.mark.parametrize("codec_name", ["identity", "quant"])
@pytest.mark.parametrize("tier", [Tier.HOST, Tier.GPU])
def test_snapshot_store_codec_on_cuda(codec_name: str, tier: Tier) -> None:
    n, N = 1 << 20, 60
    u, cb = _wave_like(n)
    states: dict[int, list[torch.Tensor]] = {}
    for k in range(N):  # reference states
        states[k] = [t.clone() for t in u]
        cb["forward"](k, k + 1)
    u2, cb2 = _wave_like(n)
    seen: dict[int, list[torch.Tensor]] = {}

    def restore(k: int, ts: list[torch.Tensor]) -> None:
        u2[0], u2[1] = ts[0].clone(), ts[1].clone()

    codec = Identity() if codec_name == "identity" else TritonQuant(bits=8, mode="abs", bound=1e-3)
    # no margin: Identity's blob has a fixed size, so the budget holds exactly 3 of them
    snap = SnapshotStore("cuda", gpu_bytes=3 * 2 * n * 4, codec=codec,
                         slot_margin=0.0 if codec_name == "identity" else 0.25)
    st = run_schedule(Revolve(N, 6, tier=tier), forward=cb2["forward"], save=cb2["save"], restore=restore,
                      backward=lambda k: seen.__setitem__(k, [t.clone() for t in u2]), store=snap)
    torch.cuda.synchronize()
    assert sorted(seen) == list(range(N))
    if codec_name == "identity":
        assert all(torch.equal(a, b) for k in seen for a, b in zip(seen[k], states[k]))
        assert snap.nslots == 3
    else:
        err = max((a - b).abs().max().item() for k in seen for a, b in zip(seen[k], states[k]))
        # each restore is within 1e-3; Revolve re-saves recomputed states, so errors can add up once
        # per level of its recursion (at most the 6 snapshots); this map does not amplify them
        assert 0 < err <= 6e-3
        assert st.ratio > 3.5 and snap.nslots >= 9  # 3.9x smaller blobs, 1.25x margin: 3x the slots
    if tier is Tier.HOST:
        assert st.hit_rate == 1.0
    snap.close()
