"""Store placement, deduplication, eviction, host pool reuse and plan divergence, simulated on CPU.

Each test checks NOTE [ Store ] / NOTE [ GPU cache ] rules directly, and gradients against
plain autograd bit for bit.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchckpt
from ckpt_models import MLP, Block, assert_same_grads, clone, cpu_store, step

BUDGETS = [0, 256, 1 << 20]


# -- NOTE [ Store ] Rule 1: what is kept by reference --------------------------------------
def test_parameters_and_grad_leaves_are_kept() -> None:
    s = cpu_store(0)
    p = nn.Parameter(torch.randn(64, 64))
    frozen = nn.Parameter(torch.randn(64, 64), requires_grad=False)
    leaf = torch.randn(64, 64, requires_grad=True)
    for t in (p, frozen, leaf):
        assert s.unpack(s.pack(t)) is t  # kept by reference
    st = s.stats()
    assert st.kept == 3 and st.offloaded == 0 and st.kept_bytes == 3 * 64 * 64 * 4
    assert st.host.in_use_bytes == 0


def test_non_leaf_and_no_grad_tensors_are_offloaded() -> None:
    s = cpu_store(1 << 20)
    leaf = torch.randn(64, 64, requires_grad=True)
    for t in (leaf * 2, torch.randn(64, 64)):
        h = s.pack(t)
        assert h is not t and torch.equal(s.unpack(h), t)
    assert s.stats().offloaded == 2


def test_linear_weight_view_is_kept() -> None:
    # F.linear saves the input and weight.t() (a view of a parameter). Moving that view frees
    # nothing -- the parameter stays -- and costs a copy per step and GPU cache budget.
    # NOTE [ Store ] Rule 1: parameters are kept by reference; so must their views be.
    s = cpu_store(0)
    lin = nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    with s.hooks():
        y = lin(x * 1.0)
    st = s.stats()
    assert st.packed == 2
    assert st.kept == 1 and st.offloaded == 1, st
    y.sum().backward()


def test_frozen_weight_view_is_kept() -> None:
    s = cpu_store(0)
    lin = nn.Linear(64, 64).requires_grad_(False)
    x = torch.randn(8, 64, requires_grad=True)
    with s.hooks():
        y = lin(x * 1.0)  # addmm saves weight.t() for grad of x
    st = s.stats()
    assert st.kept == 1 and st.offloaded == 0, st
    y.sum().backward()


def test_small_tensors_under_min_bytes_are_kept() -> None:
    s = cpu_store(0, min_bytes=1024)
    small, exact = torch.randn(255), torch.randn(256)  # 1020 and 1024 bytes
    assert s.unpack(s.pack(small)) is small  # kept by reference
    h = s.pack(exact)
    assert h is not exact
    st = s.stats()
    assert st.kept == 1 and st.kept_bytes == 1020 and st.offloaded == 1 and st.offloaded_bytes == 1024
    del h


def test_keep_buffers_and_their_views() -> None:
    s = cpu_store(0)
    buf = torch.randn(32, 32)
    x = torch.randn(32, 32, requires_grad=True)
    with s.hooks(keep=[buf]):
        y = (x * buf.t()).sum()  # mul saves buf.t(), a view of the kept storage
    st = s.stats()
    assert st.packed == 1 and st.kept == 1 and st.offloaded == 0
    y.backward()
    assert torch.equal(x.grad, buf.t())

    m = nn.BatchNorm1d(64).eval()  # eval: backward reads the running stats (buffers)
    x = torch.randn(8, 64, requires_grad=True)
    ref = torch.autograd.grad(clone(m)(x * 1.0).square().sum(), x)[0]
    s2 = cpu_store(0)
    with torchckpt.offload(s2, keep=list(m.buffers())):
        y = m(x * 1.0)
    assert torch.equal(torch.autograd.grad(y.square().sum(), x)[0], ref)
    assert s2.stats().kept >= 2  # running_mean, running_var


def test_other_device_and_non_strided_are_kept() -> None:
    s = cpu_store(0)
    meta = torch.empty(1000, device="meta")
    sparse = torch.randn(16, 16).to_sparse()
    assert s.unpack(s.pack(meta)) is meta  # kept by reference
    assert s.unpack(s.pack(sparse)) is sparse  # kept by reference
    assert s.stats().kept == 2 and s.stats().offloaded == 0


# -- NOTE [ Store ] Rule 2: views, deduplication, in-place changes ---------------------------
@pytest.mark.parametrize("budget", BUDGETS)
def test_tensor_and_its_transpose_moved_once(budget: int) -> None:
    s = cpu_store(budget)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(16, 16)
    ref = torch.autograd.grad((torch.tanh(x @ w) @ torch.tanh(x @ w).t()).sum(), w)[0]
    with s.hooks():
        h = torch.tanh(x @ w)
        out = h @ h.t()  # mm saves h and h.t(): one storage, one version
    st = s.stats()
    # x (saved by x @ w) and h: tanh saves h, mm saves h and h.t() -- h is moved once.
    assert st.offloaded == 2 and st.deduplicated == 2, st
    assert torch.equal(torch.autograd.grad(out.sum(), w)[0], ref)
    assert s.stats().host.in_use_bytes == 0


@pytest.mark.parametrize("budget", BUDGETS)
def test_qkv_unbind_views_share_one_entry(budget: int) -> None:
    s = cpu_store(budget)
    qkv = torch.randn(2, 8, 3, 4, 8)  # (batch, time, 3, heads, head_dim)
    q, k, v = qkv.unbind(2)
    hs = [s.pack(t) for t in (q, k, v)]
    st = s.stats()
    assert st.offloaded == 1 and st.deduplicated == 2 and st.offloaded_bytes == qkv.numel() * 4
    for h, t in zip(hs, (q, k, v)):
        u = s.unpack(h)
        assert torch.equal(u, t) and u.stride() == t.stride() and u.storage_offset() == t.storage_offset()
    del hs, h
    assert s.stats().host.in_use_bytes == 0


@pytest.mark.parametrize("budget", BUDGETS)
def test_block_attention_gradients_with_shared_qkv(budget: int) -> None:
    torch.manual_seed(0)
    blk = Block(p=0.0)
    x = torch.randn(2, 8, 32)
    plain = clone(blk)
    ref = step(plain, plain, x)
    s = cpu_store(budget)
    m = torchckpt.checkpoint(clone(blk), policy=torchckpt.Offload(s))
    got = step(m, m, x)
    assert torch.equal(got[1], ref[1])
    assert_same_grads(got[2], ref[2])
    assert s.stats().deduplicated > 0


def test_small_slices_get_entries_of_their_own() -> None:
    s = cpu_store(0)
    base = torch.randn(3, 64)
    a, b, c = base.unbind(0)  # each a third of the storage: partial spans
    hs = [s.pack(t) for t in (a, b, c)]
    st = s.stats()
    assert st.offloaded == 3 and st.deduplicated == 0 and st.offloaded_bytes == base.numel() * 4
    for h, t in zip(hs, (a, b, c)):
        assert torch.equal(s.unpack(h), t)


@pytest.mark.parametrize("budget", [0, 1 << 20])
def test_view_saved_after_inplace_change_gets_new_entry(budget: int) -> None:
    def run(store: torchckpt.Store | None) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.linspace(-1, 1, 256, requires_grad=True)
        ctx = store.hooks() if store is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with ctx:
            y = a * 3.0
            junk = y.sin()  # saves y at version 0; never backpropagated, kept alive
            y.mul_(2.0)  # version 1
            out = (y.cos() * y.t()).sum()  # saves y (and its view) at version 1
        out.backward()
        del junk
        return a.grad, y.detach()

    ref, _ = run(None)
    s = cpu_store(budget)
    got, _ = run(s)
    assert torch.equal(got, ref)
    st = s.stats()
    # y@v0 (sin), y@v1 (cos), cos(y) (mul); mul's y.t()@v1 shares y@v1's entry
    assert st.offloaded == 3 and st.deduplicated == 1, st


@pytest.mark.parametrize("budget", [0, 1 << 20])
def test_strided_views_restore_exactly(budget: int) -> None:
    s = cpu_store(budget)
    x = torch.randn(6, 8)
    views = {
        "t": x.t(),
        "cols": x[:, 1::2],
        "tail": x[1:],
        "diag": x.diagonal(),
        "col": x[:, 3],
        "rows_step": x[1::3],
        "expand": x[0].expand(100, 8),
        "as_strided": x.as_strided((3, 4), (1, 8), 5),
        "dtype_view": x.view(torch.int32)[1:],
        "rows": x[2:4],  # a third of the storage: a partial span
        "scalar": x[5, 7],
    }
    for name, v in views.items():
        h = s.pack(v)
        u = s.unpack(h)
        assert u.dtype == v.dtype and u.shape == v.shape and u.stride() == v.stride(), name
        assert torch.equal(u, v), name
        whole = h.entry.nbytes == x.untyped_storage().nbytes()
        if whole or budget:  # whole storage moved, or still resident (zero-copy)
            assert u.storage_offset() == v.storage_offset(), name
        else:  # partial span brought back: only the bytes the view reaches
            assert u.untyped_storage().nbytes() == h.entry.nbytes, name
            assert u.storage_offset() * 4 == h.rel, name


# -- eviction and the budget -----------------------------------------------------------------
def test_lru_eviction_order() -> None:
    s = cpu_store(2 * 1024)
    ts = [torch.randn(256) for _ in range(4)]  # 1 KiB each
    hs = [s.pack(t) for t in ts]
    assert [h.entry.id in s.cache for h in hs] == [False, False, True, True]
    s.unpack(hs[2])  # now hs[3] is least recently used
    t = torch.randn(256)
    h4 = s.pack(t)
    assert [h.entry.id in s.cache for h in hs] == [False, False, True, False]
    assert h4.entry.id in s.cache
    assert s.stats().evictions == 3


@pytest.mark.parametrize("budget", [1024, 3000, 8192])
def test_gpu_peak_respects_budget(budget: int) -> None:
    # Every tensor fits the budget alone: the resident bytes never exceed it (NOTE [ GPU cache ]).
    s = cpu_store(budget)
    sizes = [256, 128, 64, 256, 32, 200, 256, 16]  # floats: at most 1 KiB each
    x = torch.randn(8, requires_grad=True)
    ref_model = [torch.randn(n) for n in sizes]
    with s.hooks():
        outs = [((x.sum() * w).sin()) for w in ref_model]
    sum(o.sum() for o in outs).backward()
    st = s.stats()
    assert st.evictions > 0
    assert st.gpu_peak_bytes <= budget, f"peak {st.gpu_peak_bytes} > budget {budget}"


@pytest.mark.parametrize("budget", [0, 100, 1000])
def test_budget_smaller_than_tensors_still_exact(budget: int) -> None:
    model, x = MLP(d_in=64, d=64, d_out=64, depth=4), torch.randn(8, 64)
    plain = clone(model)
    s = cpu_store(budget)
    m = torchckpt.checkpoint(clone(model), policy=torchckpt.Offload(s))
    for i in range(3):
        ref = step(plain, plain, x, seed=i)
        got = step(m, m, x, seed=i)
        assert torch.equal(got[1], ref[1])
        assert_same_grads(got[2], ref[2])
    st = s.stats()
    assert st.misses > 0 and st.host.in_use_bytes == 0
    assert s.cache.used == 0 and len(s.cache) == 0


# -- the host pool over many steps -----------------------------------------------------------
@pytest.mark.parametrize("budget", [0, 4096])
def test_host_pool_memory_flat_over_steps(budget: int) -> None:
    torch.manual_seed(0)
    model, x = MLP(d_in=64, d=64, d_out=64, depth=4), torch.randn(16, 64)
    s = cpu_store(budget)
    m = torchckpt.checkpoint(clone(model), policy=torchckpt.Offload(s))
    reserved = allocs = None
    for i in range(20):
        step(m, m, x, seed=i)
        h = s.stats().host
        assert h.in_use_bytes == 0 and h.pageable_in_use_bytes == 0, (i, h)
        if i == 0:
            reserved, allocs = h.reserved_bytes, h.chunk_allocations
            assert reserved > 0
        assert h.reserved_bytes == reserved and h.chunk_allocations == allocs, (i, h)
    assert s.stats().host.pageable_fallbacks == 0


# -- steps and plan divergence ---------------------------------------------------------------
def offload_fn(m: nn.Module, s: torchckpt.Store):
    def fn(t: torch.Tensor) -> torch.Tensor:
        with torchckpt.offload(s, keep=list(m.parameters())):
            return m(t)

    return fn


def test_trace_change_diverges_then_replans() -> None:
    torch.manual_seed(1)
    model = MLP(d_in=32, d=32, d_out=32, depth=6)
    plain = clone(model)
    m = clone(model)
    s = cpu_store(4 * 8 * 32 * 4)  # four activations of batch 8
    fn = offload_fn(m, s)
    batches = [8, 8, 4, 4, 4, 8]
    expect_div = [0, 0, 1, 1, 1, 2]
    expect_plans = [0, 1, 1, 2, 2, 2]  # a plan is made when the next step starts
    prev = s.stats()
    for i, b in enumerate(batches):
        x = torch.randn(b, 32)
        ref = step(plain, plain, x, seed=i)
        got = step(fn, m, x, seed=i)
        assert torch.equal(got[1], ref[1])
        assert_same_grads(got[2], ref[2])
        st = s.stats()
        assert st.plan_divergences == expect_div[i], (i, st)
        assert st.plans == expect_plans[i], (i, st)
        if i in (1, 3, 4):  # on a plan that matches: prefetched, nothing loaded on demand
            assert st.misses == prev.misses and st.prefetch_hits > prev.prefetch_hits, i
        prev = st
    assert s.plan is not None and s.plan.pack_sizes[0] == 4 * 32 * 4


def test_steps_counter_counts_finished_steps() -> None:
    # Stats.steps: "completed steps (a step ends when all its entries are released)".
    s = cpu_store(0)
    x = torch.randn(64, requires_grad=True)
    for n in range(1, 4):
        with s.hooks():
            y = (x * 2).sin().sum()
        y.backward()
        assert s.stats().steps == n


def test_prefetch_false_never_plans() -> None:
    s = cpu_store(1024, prefetch=False)
    model, x = MLP(d_in=32, d=32, d_out=32, depth=4), torch.randn(8, 32)
    fn = offload_fn(model, s)
    for i in range(3):
        step(fn, model, x, seed=i)
    st = s.stats()
    assert s.plan is None and st.plans == 0 and st.prefetch_hits == 0 and st.misses > 0


def test_reset_stats() -> None:
    s = cpu_store(0)
    x = torch.randn(64, requires_grad=True)
    with s.hooks():
        y = x.exp().sin().sum()
    y.backward()
    assert s.stats().offloaded > 0
    s.reset_stats()
    st = s.stats()
    assert st.offloaded == 0 and st.misses == 0 and st.gpu_peak_bytes == 0
