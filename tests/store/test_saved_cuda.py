"""CUDA: gradients bit-identical to plain autograd with real streams, prefetches and evictions.

Every test is marked ``cuda`` and skips without a GPU (tests/conftest.py). Attention runs on the
math SDPA backend so that plain autograd itself is deterministic and ``torch.equal`` is meaningful.
"""
from __future__ import annotations

import gc
import random
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import torchckpt
from ckpt_models import Block, assert_same_grads, clone, gate_up_loss, grads
from torchckpt import Keep, Offload, Recompute

pytestmark = pytest.mark.cuda

D, HEADS, T, B, DEPTH = 256, 4, 128, 4, 4
ACT = B * T * D * 4  # bytes of one fp32 block activation (512 KiB)


@pytest.fixture(autouse=True)
def _math_sdpa() -> Iterator[None]:
    with sdpa_kernel(SDPBackend.MATH):
        yield


def store(gpu_bytes: int, **kw) -> torchckpt.Store:
    return torchckpt.Store(device="cuda", gpu_bytes=gpu_bytes, min_bytes=0, **kw)


def host_in_use(s: torchckpt.Store) -> int:
    """Host bytes still in use once every copy has finished.

    Blocks freed while their last copy ran are parked and count as in use until the pool next
    allocates (NOTE [ Host pool ] Rule 3); a 1-byte allocation makes it reclaim them.
    """
    torch.cuda.synchronize()
    s.host.free(s.host.alloc(1))
    return s.host.stats().in_use_bytes


def stack(dtype: torch.dtype, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(D, HEADS, p=0.1) for _ in range(DEPTH)]).to("cuda", dtype)


def apply(model: nn.Sequential, policies: list[torchckpt.Policy]) -> nn.Sequential:
    for blk, pol in zip(model, policies):
        torchckpt.checkpoint(blk, policy=pol)
    return model


def run_step(model: nn.Module, x: torch.Tensor, seed: int, fn: Callable | None = None) -> tuple[torch.Tensor, dict]:
    """One step of ``fn`` (default: ``model``) from a fixed seed: (input grad, parameter grads)."""
    model.zero_grad(set_to_none=True)
    xl = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = (fn or model)(xl * 1.0)
    out.float().square().mean().backward()
    return xl.grad, grads(model)


def policy_sets(s: torchckpt.Store) -> dict[str, list[torchckpt.Policy]]:
    return {
        "offload": [Offload(s)] * DEPTH,
        "recompute": [Recompute()] * DEPTH,
        "recompute_store": [Recompute(store=s)] * DEPTH,
        "mixed": [Offload(s), Recompute(), Recompute(store=s), Keep()][:DEPTH],
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pname", ["offload", "recompute", "recompute_store", "mixed"])
@pytest.mark.parametrize("budget", [0, 3 * ACT, 1 << 30], ids=["b0", "small", "large"])
def test_block_stack_gradients_exact(dtype: torch.dtype, pname: str, budget: int) -> None:
    plain = stack(dtype)
    s = store(budget)
    model = apply(clone(plain), policy_sets(s)[pname])
    g = torch.Generator(device="cuda").manual_seed(1)
    for i in range(4):
        x = torch.randn(B, T, D, device="cuda", dtype=dtype, generator=g)
        ref = run_step(plain, x, seed=i)
        again = run_step(plain, x, seed=i)
        assert torch.equal(ref[0], again[0]), "plain autograd is not deterministic here"
        got = run_step(model, x, seed=i)
        assert torch.equal(got[0], ref[0]), f"step {i}"
        assert_same_grads(got[1], ref[1])
    torch.cuda.synchronize()
    st = s.stats()
    if pname != "recompute":
        assert st.offloaded > 0 and host_in_use(s) == 0
    if pname == "offload" and budget == 3 * ACT:
        assert st.evictions > 0 and st.prefetch_hits > 0


@pytest.mark.parametrize("budget", [0, 2 * ACT, 6 * ACT])
def test_stress_random_copy_delays(budget: int) -> None:
    """Copies delayed by random sleeps on their own streams; every step bit-exact.

    A tensor read before its host-to-device copy finished, or a buffer (device or host)
    reused while a copy still reads or writes it, shows up as a gradient mismatch.
    """
    rng = random.Random(1234)
    plain = stack(torch.float32, seed=3)
    s = store(budget)
    model = apply(clone(plain), [Offload(s), Recompute(store=s), Offload(s), Offload(s)])
    opt_p = torch.optim.SGD(plain.parameters(), lr=1e-2)
    opt_m = torch.optim.SGD(model.parameters(), lr=1e-2)
    delays = {"d2h": 0, "h2d": 0}

    def delay(kind: str, stream: torch.cuda.Stream) -> None:
        assert torch.cuda.current_stream() == stream  # the sleep lands on the copy stream
        delays[kind] += 1
        torch.cuda._sleep(rng.randint(0, 2_000_000))

    s._set_delay(delay)
    g = torch.Generator(device="cuda").manual_seed(2)
    for i in range(30):
        x = torch.randn(B, T, D, device="cuda", generator=g)
        ref = run_step(plain, x, seed=i)
        got = run_step(model, x, seed=i)
        assert torch.equal(got[0], ref[0]), f"step {i}: input gradient differs"
        assert_same_grads(got[1], ref[1])
        for a, b in zip(plain.parameters(), model.parameters()):
            assert torch.equal(a, b)
        opt_p.step()
        opt_m.step()
    s._set_delay(None)
    torch.cuda.synchronize()
    st = s.stats()
    assert delays["d2h"] > 0 and host_in_use(s) == 0
    if budget:
        assert delays["h2d"] > 0 and st.prefetch_hits > 0


def test_memory_flat_over_many_steps() -> None:
    plain = stack(torch.float32, seed=4)
    s = store(3 * ACT)
    model = apply(clone(plain), [Offload(s), Offload(s), Recompute(store=s), Offload(s)])
    del plain
    x = torch.randn(B, T, D, device="cuda")
    mem = reserved = None
    for i in range(200):
        model.zero_grad(set_to_none=False)
        model(x * 1.0).square().mean().backward()
        # Recompute's early stop leaves frames in reference cycles (torch.utils.checkpoint
        # raises to stop recomputing); collect them so that only torchckpt's memory is measured.
        gc.collect()
        assert host_in_use(s) == 0, i
        h = s.stats().host
        if i == 0:
            reserved = h.reserved_bytes
        assert h.reserved_bytes == reserved, (i, h)
        if i == 1:
            mem = torch.cuda.memory_allocated()
        elif i > 1:
            assert torch.cuda.memory_allocated() == mem, f"step {i + 1}: {torch.cuda.memory_allocated()} != {mem}"
    assert s.cache.used == 0


def test_stats_after_warmup() -> None:
    plain = stack(torch.float32, seed=5)
    s = store(4 * ACT)
    model = apply(clone(plain), [Offload(s)] * DEPTH)
    x = torch.randn(B, T, D, device="cuda")
    for _ in range(2):
        run_step(model, x, seed=0)
    for i in range(5):
        before = s.stats()
        ref = run_step(plain, x, seed=i)
        got = run_step(model, x, seed=i)
        assert torch.equal(got[0], ref[0])
        torch.cuda.synchronize()
        after = s.stats()
        assert after.prefetch_hits > before.prefetch_hits, f"step {i + 3}: no prefetch hits"
        assert after.misses == before.misses, f"step {i + 3}: {after.misses - before.misses} misses"
        assert after.plan_divergences == before.plan_divergences
    st = s.stats()
    assert st.evictions > 0 and st.loaded_bytes > 0
    assert st.exposed_transfer_s >= 0 and st.late_wait_s >= 0
    assert st.host.pinned_bytes == st.host.reserved_bytes > 0
    assert isinstance(st.summary(), str)


@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_strided_views_restore_on_cuda(budget: int) -> None:
    s = store(budget)
    x = torch.randn(64, 96, device="cuda")
    qkv = torch.randn(2, 16, 3, 4, 8, device="cuda")
    views = [x.t(), x[:, 1::2], x[1:], x.diagonal(), x[10:20], x[0].expand(50, 96), *qkv.unbind(2)]
    hs = [s.pack(v) for v in views]
    for h, v in zip(hs, views):
        u = s.unpack(h)
        assert u.device == v.device and u.stride() == v.stride() and torch.equal(u, v)
    assert s.stats().deduplicated >= 2  # q, k, v share qkv's entry
    del hs, h
    assert host_in_use(s) == 0


@pytest.mark.parametrize("budget", [0, 3 * ACT])
def test_offload_context_with_autocast(budget: int) -> None:
    plain = stack(torch.float32, seed=6)
    m = clone(plain)
    s = store(budget)
    x = torch.randn(B, T, D, device="cuda")

    def fwd(t: torch.Tensor) -> torch.Tensor:
        with torchckpt.offload(s, keep=list(m.buffers())):
            return m(t)

    for i in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref = run_step(plain, x, seed=i)
            got = run_step(m, x, seed=i, fn=fwd)
        assert torch.equal(got[0], ref[0])
        assert_same_grads(got[1], ref[1])


def test_default_store_is_cuda() -> None:
    s = torchckpt.default_store()
    assert s.device.type == "cuda" and s.device.index == torch.cuda.current_device()
    assert torchckpt.default_store("cuda") is s


def test_pinned_host_pool() -> None:
    p = torchckpt.memory.HostPool(capacity_bytes=64 << 20, chunk_bytes=1 << 20, pin=True)
    b = p.alloc(1000)
    assert b.pinned and b.tensor.is_pinned()
    ev = torch.cuda.Event()
    ev.record()
    p.free(b, ev)
    torch.cuda.synchronize()
    assert p.stats().in_use_bytes in (0, b.nbytes)
    p.close()



@pytest.mark.parametrize("budget", [0, 3 << 20, 1 << 30])
def test_halves_of_one_storage_share_an_entry_on_cuda(budget: int) -> None:
    """NOTE [ Saved tensor identity ] Rule 2c on the device: a fused gate/up projection whose halves two nodes save
    (Mixtral's experts) takes one entry while resident, written to host once a step from the second step on (at the
    up half's save), bit for bit against plain autograd at every budget."""
    torch.manual_seed(0)
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    w = torch.randn(256, 1024, device="cuda", requires_grad=True)
    ref = torch.autograd.grad(gate_up_loss(x, w), [x, w])  # a 2 MiB product, two non-dense halves
    s = store(budget)
    for step in range(3):
        s.reset_stats()
        with torchckpt.offload(s):
            out = gate_up_loss(x, w)
        got = torch.autograd.grad(out, [x, w])
        torch.cuda.synchronize()
        for r, g in zip(ref, got):
            assert torch.equal(r, g), f"step {step}: max |diff| {(r - g).abs().max().item()}"
        st = s.stats()
        assert st.deduplicated == (1 if budget else 0), st  # evicted at once, the up half takes an entry of its own
        if step and budget == 3 << 20:  # the plan evicts the gate/up entry: written once (3 MiB a step with the
            # product's 1 MiB on the CPU's simulation of this store, 5 MiB when it was written at both saves)
            assert (2 << 20) <= st.offloaded_bytes < (5 << 20), st
