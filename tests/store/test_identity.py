"""NOTE [ Saved tensor identity ]: saved tensors come back as autograd saved them (issue 11 regressions).

Each test here failed on the store before the fix it names:
- sharing an entry keyed by (storage, version) alone: ``unsafe_chunk`` outputs (ATen's LSTM and
  GRU cells) collided and came back with stale bytes once evicted (NOTE [ Saved tensor identity ] Rule 2);
- the conj and neg bits were dropped on unpack, even while resident (NOTE [ Saved tensor identity ] Rule 3);
- a saved tensor modified in place after saving raised nothing, since autograd skips its version
  check when hooks are set (NOTE [ Saved tensor identity ] Rule 1);
- a step never ended while graphs overlapped, and the trace grew without bound (NOTE [ Store ] Rule 10);
- ``Store.stats()`` on CUDA waited for a copy's event but not for the compute-stream event it is
  timed against;
- ``torch.func`` transforms: functorch's wrapped tensors have no accessible storage
  (NOTE [ Saved tensor identity ] Rule 4);
- a tensor kept by reference that is an op's output held its own ``grad_fn``: a forward without a
  backward never freed its graph (NOTE [ Saved tensor identity ] Rule 5; tests/test_soak.py soaks every
  policy and pattern).
"""
from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import torchckpt
from ckpt_models import cpu_store, gate_up_loss, small_pool
from torchckpt import Offload, Recompute
from torchckpt.codecs.base import Identity

BUDGETS = [0, 4096, 1 << 30]  # evicted at once, some evicted, resident
INPLACE = "modified by an inplace operation"


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN and -0.0 included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def grads_of(loss_fn: Callable[[], torch.Tensor], wrt: list[torch.Tensor], ctx: Any) -> list[torch.Tensor]:
    with ctx:
        loss = loss_fn()
    return list(torch.autograd.grad(loss, wrt))


def check_steps(loss_fn: Callable[[], torch.Tensor], wrt: list[torch.Tensor], make_ctx: Callable[[], Any],
                steps: int = 3) -> None:
    """Every step (the first records the trace, later ones follow the prefetch plan) equals plain autograd."""
    ref = grads_of(loss_fn, wrt, contextlib.nullcontext())
    for i in range(steps):
        got = grads_of(loss_fn, wrt, make_ctx())
        for r, g in zip(ref, got):
            assert same(r, g), f"step {i}: max |diff| {(r - g).abs().max().item()}"


# -- NOTE [ Saved tensor identity ] Rule 2: entries are shared only within one version counter ---
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell", "LSTM", "GRU"])
def test_rnn_gradients_bit_identical(kind: str, dtype: torch.dtype, budget: int) -> None:
    torch.manual_seed(0)
    cell = kind.endswith("Cell")
    m = getattr(nn, kind)(16, 24).to(dtype)
    x = torch.randn(*(() if cell else (6,)), 5, 16, dtype=dtype, requires_grad=True)

    def loss() -> torch.Tensor:
        out = m(x)
        out = out[0] if isinstance(out, tuple) else out
        return out.square().sum()

    store = cpu_store(budget)
    check_steps(loss, [x, *m.parameters()], lambda: torchckpt.offload(store))


@pytest.mark.parametrize("budget", BUDGETS)
def test_unsafe_chunk_siblings_do_not_share_an_entry(budget: int) -> None:
    # The two halves share one storage but not a version counter: both are at version 1 when
    # saved, and the second was written after the first was copied out.
    x = torch.randn(8, 64, requires_grad=True)

    def loss() -> torch.Tensor:
        a, b = (x * 1.0).unsafe_chunk(2, 1)
        a = a.sigmoid_()
        y = a * 3.0  # saves nothing of a (mul by a scalar)...
        y = y * a  # ...this saves a at version 1, copying the whole storage
        b = b.tanh_()
        return (y * b).sum()  # saves b at version 1: the storage's bytes have changed since

    store = cpu_store(budget)
    check_steps(loss, [x], lambda: torchckpt.offload(store))
    assert store.stats().deduplicated < store.stats().packed


def test_views_of_one_tensor_still_share_an_entry() -> None:
    store = cpu_store(1 << 30)
    x = torch.randn(64, 64, requires_grad=True)

    def loss() -> torch.Tensor:
        y = x * 2.0
        return (y * y.t()).sum() + (y.t() * y).sum()  # y and y.t() saved twice each: one copy

    check_steps(loss, [x], lambda: store.hooks(), steps=1)
    st = store.stats()
    assert st.offloaded == 1 and st.deduplicated == 3, st


# -- NOTE [ Saved tensor identity ] Rule 3: value bits ---------------------------------------
def _conj_program(x: torch.Tensor) -> torch.Tensor:
    y = (x * 2).conj()  # conj view: a bit, not new bytes
    return (y * y.exp()).abs().sum()


def _neg_program(x: torch.Tensor) -> torch.Tensor:
    y = (x * 2).conj().imag  # the imaginary part of a conj view carries the neg bit
    assert y.is_neg()
    return (y * y.sin()).sum()


def _fft_program(x: torch.Tensor) -> torch.Tensor:
    # A spectral convolution as in Fourier neural operators: rfft, weights on the modes, irfft.
    w = torch.linspace(0.5, 1.5, x.shape[-1] // 2 + 1, dtype=torch.cfloat)
    xf = torch.fft.rfft(x.real * 1.0)
    return torch.fft.irfft(xf.conj() * w * xf, n=x.shape[-1]).square().sum()


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("codec", [None, Identity()])
@pytest.mark.parametrize("program", [_conj_program, _neg_program, _fft_program])
def test_conj_and_neg_bits_survive(program: Callable[[torch.Tensor], torch.Tensor], codec: Any, budget: int) -> None:
    x = torch.randn(4, 64, dtype=torch.cfloat, requires_grad=True)
    store = cpu_store(budget, codec=codec)
    check_steps(lambda: program(x), [x], lambda: torchckpt.offload(store))


def test_unpacked_tensor_has_the_saved_bits() -> None:
    store = cpu_store(1 << 30)
    z = torch.randn(256, dtype=torch.cdouble)
    for t in (z.conj(), z.conj().imag, z.conj()[::3]):
        back = store.unpack(store.pack(t))
        assert back.is_conj() == t.is_conj() and back.is_neg() == t.is_neg()
        assert back.stride() == t.stride() and same(back, t)


# -- NOTE [ Saved tensor identity ] Rule 1: in-place changes after saving raise, as in plain autograd ---
def _modify_after_save(store: torchckpt.Store | None, small: bool = False) -> None:
    x = torch.randn(4 if small else 4096, requires_grad=True)
    ctx = torchckpt.offload(store) if store is not None else contextlib.nullcontext()
    with ctx:
        y = x * 2
        z = y.exp()  # saves its output z
    with torch.no_grad():
        z.add_(1)
    z.sum().backward()


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("codec", [None, Identity()])
def test_modified_saved_tensor_raises_like_autograd(budget: int, codec: Any) -> None:
    with pytest.raises(RuntimeError, match=INPLACE) as plain:
        _modify_after_save(None)
    with pytest.raises(RuntimeError, match=INPLACE) as ours:
        _modify_after_save(cpu_store(budget, codec=codec))
    assert str(ours.value) == str(plain.value)  # the same text, shape, origin and versions


def test_modified_kept_tensor_raises() -> None:
    with pytest.raises(RuntimeError, match=INPLACE):  # under min_bytes: kept by reference
        _modify_after_save(cpu_store(0, min_bytes=1 << 20), small=True)
    w = torch.randn(64, 64, requires_grad=True)  # a leaf: kept by reference
    x = torch.randn(8, 64, requires_grad=True)
    with torchckpt.offload(cpu_store(0)):
        y = (x * 1.0) @ w
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match=INPLACE):
        y.sum().backward()


def test_modified_through_a_view_raises_and_evicted_copy_is_not_used() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    for budget in BUDGETS:
        with torchckpt.offload(cpu_store(budget)):
            y = x * 2
            z = y.sin()  # saves y
        with torch.no_grad():
            y[0].zero_()  # through a view: the family's counter moves
        with pytest.raises(RuntimeError, match=INPLACE):
            z.sum().backward()


def test_in_place_before_saving_is_fine() -> None:
    x = torch.randn(4096, requires_grad=True)
    store = cpu_store(0)

    def loss() -> torch.Tensor:
        y = x * 2
        y.add_(1)
        return y.exp().sum()

    check_steps(loss, [x], lambda: torchckpt.offload(store))


def test_recompute_store_checks_versions_too() -> None:
    x = torch.randn(4096, requires_grad=True)
    inp = x * 1.0
    y = torchckpt.checkpoint(torch.sin, inp, policy=Recompute(store=cpu_store(0)))
    with torch.no_grad():
        inp.add_(1)  # the block's saved input
    with pytest.raises(RuntimeError, match=INPLACE):
        y.sum().backward()


# -- NOTE [ Saved tensor identity ] Rule 4: torch.func --------------------------------------
def test_offload_under_torch_func_grad_says_why() -> None:
    # PyTorch refuses saved-tensor hooks inside torch.func.grad (torch.utils.checkpoint too).
    store = cpu_store(0)

    def f(x: torch.Tensor) -> torch.Tensor:
        with torchckpt.offload(store, keep=[x]):  # x is a functorch wrapper: no storage to read
            return (x.sin() * x.exp()).sum()

    with pytest.raises(torchckpt.CheckpointError, match="^torchckpt: .*torch.func.grad"):
        torch.func.grad(f)(torch.randn(4096))


def test_offload_under_vmap() -> None:
    store = cpu_store(0)
    x = torch.randn(3, 4096, requires_grad=True)

    def f(v: torch.Tensor) -> torch.Tensor:
        return (v.sin() * v.exp()).sum()

    check_steps(lambda: torch.vmap(f)(x).sum(), [x], lambda: torchckpt.offload(store))


@pytest.mark.parametrize("name", ["Offload", "Recompute"])
def test_policy_under_torch_func_grad_runs_as_keep(name: str) -> None:
    # torch.utils.checkpoint itself raises under torch.func.grad; a policy warns and runs as Keep().
    lin = nn.Linear(32, 32)
    x = torch.randn(4, 32)
    policy = Offload(cpu_store(0)) if name == "Offload" else Recompute(store=cpu_store(0))
    block = torchckpt.checkpoint(nn.Sequential(nn.Linear(32, 32), nn.Tanh()), policy=policy)
    params = dict(block.named_parameters())

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(block, p, (lin(x),)).square().sum()

    with pytest.warns(UserWarning, match=f"torchckpt: {name}\\(\\) runs as Keep\\(\\) inside torch.func.grad"):
        got = torch.func.grad(loss)(params)
    plain_block = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
    plain_block.load_state_dict(block.state_dict())
    ref = torch.func.grad(lambda p: torch.func.functional_call(plain_block, p, (lin(x),)).square().sum())(
        dict(plain_block.named_parameters()))
    assert all(same(got[k], ref[k]) for k in ref)


# -- NOTE [ Store ] Rule 10: overlapping graphs ----------------------------------------------------
def test_trace_bounded_when_graphs_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchckpt.store.saved as store_mod

    monkeypatch.setattr(store_mod, "_TRACE_MIN", 64)
    store = cpu_store(1 << 30)
    m = nn.Linear(64, 64)
    prev = None
    for _ in range(500):  # an evaluation loop without no_grad: the last output is alive at the next forward
        with torchckpt.offload(store):
            out = m(torch.randn(8, 64)).exp()
        prev = out
        assert len(store._trace) <= 64
    assert store.stats().trace_overflows >= 1
    del prev, out
    # Once everything is released, steps close and plans are made again.
    x = torch.randn(8, 64, requires_grad=True)
    for _ in range(3):
        with torchckpt.offload(store):
            loss = m(x).exp().sum()
        loss.backward()
    assert store.plan is not None and store.stats().prefetch_hits + store.stats().cache_hits > 0


# -- Store(...) arguments and pickling --------------------------------------------------------------
@pytest.mark.parametrize("kw, err, says", [
    (dict(gpu_bytes="1 gigabyte"), ValueError, "gpu_bytes"),
    (dict(gpu_bytes=-1), ValueError, "gpu_bytes"),
    (dict(gpu_bytes=1.5), TypeError, "gpu_bytes"),
    (dict(min_bytes="lots"), ValueError, "min_bytes"),
    (dict(host="pinned"), TypeError, "host="),
    (dict(prefetch="no"), TypeError, "prefetch"),
    (dict(timing=1), TypeError, "timing"),
    (dict(device="gpu"), ValueError, "'cuda'"),
    (dict(device=0.5), TypeError, "device"),
    (dict(codec="fp8"), TypeError, "codec"),
])
def test_store_arguments_checked_at_construction(kw: dict[str, Any], err: type, says: str) -> None:
    kw.setdefault("device", "cpu")
    with pytest.raises(err, match="^torchckpt: ") as e:
        torchckpt.Store(**kw)
    assert says in str(e.value)


def test_store_sizes_as_strings() -> None:
    s = torchckpt.Store(device="cpu", gpu_bytes="1.5GiB", min_bytes="4KiB", host=small_pool())
    assert s.cache.capacity == 3 << 29 and s.min_bytes == 4096


def test_store_pickles_as_its_configuration() -> None:
    s = torchckpt.Store(device="cpu", gpu_bytes="2MiB", min_bytes=0, prefetch=False, host=small_pool(), codec=Identity())
    x = torch.randn(4096, requires_grad=True)
    with s.hooks():
        y = x.exp()  # something in flight: it does not travel
    t = pickle.loads(pickle.dumps(s))
    assert t is not s and t.device == s.device and t.cache.capacity == 2 << 20
    assert t.min_bytes == 0 and t.prefetch is False and isinstance(t.codec, Identity)
    assert t.host is not s.host and t.host.capacity_bytes == s.host.capacity_bytes
    assert t.host.chunk_bytes == s.host.chunk_bytes and t.stats().packed == 0
    y.sum().backward()
    check_steps(lambda: x.exp().sum(), [x], lambda: t.hooks())


# -- Store.stats() on CUDA -----------------------------------------------------------------------
@pytest.mark.cuda
def test_stats_right_after_backward_never_raise_on_cuda() -> None:
    store = torchckpt.Store("cuda", gpu_bytes=1 << 20, min_bytes=0)
    m = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]).cuda()
    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    for _ in range(10):  # from step 2 on the prefetch plan is in use
        with torchckpt.offload(store):
            loss = m(x).square().sum()
        loss.backward()
        st = store.stats()  # before any synchronize: the README's usage
        store.reset_stats()
    assert st.prefetch_hits + st.cache_hits + st.misses > 0


# -- NOTE [ Saved tensor identity ] Rule 2b: writes no counter sees ------------------------------
@pytest.mark.parametrize("budget", BUDGETS)
def test_scratch_buffer_written_through_data(budget: int) -> None:
    # torchdiffeq's Runge-Kutta step: k.data[..., i] = f, then k[..., :i + 1] is saved. The first
    # view's entry copies the whole storage before column 1 is written; no version counter moves.
    w = torch.ones(4, 1, requires_grad=True)
    store = cpu_store(budget)
    check_steps(lambda: _rk_stages(w), [w], lambda: torchckpt.offload(store))


def _rk_stages(w: torch.Tensor) -> torch.Tensor:
    """Two stages of a Runge-Kutta scratch buffer: column 0 written through ``.data`` and ``k[:, :1]`` saved, then
    column 1 written the same way and ``k[:, :2]`` saved (NOTE [ Saved tensor identity ] Rules 2b-2c)."""
    k = torch.zeros(4, 3)
    k.data[:, 0] = 1.0
    a = (k[:, :1] * w).sum()
    k.data[:, 1] = 5.0
    b = (k[:, :2] * w).sum()
    return a + b


@pytest.mark.parametrize("budget", BUDGETS)
def test_halves_saved_by_two_nodes_share_one_entry(budget: int) -> None:
    # NOTE [ Saved tensor identity ] Rule 2c: before it, the up half took a second whole-storage entry.
    torch.manual_seed(0)
    x = torch.randn(16, 8, requires_grad=True)
    w = torch.randn(8, 32, requires_grad=True)
    store = cpu_store(budget)
    check_steps(lambda: gate_up_loss(x, w), [x, w], lambda: torchckpt.offload(store))
    store.reset_stats()
    grads_of(lambda: gate_up_loss(x, w), [x, w], torchckpt.offload(store))
    st = store.stats()
    # saved: x, w (x @ w), gate, up (the product), silu's output (the product) and the product (square)
    assert st.packed == 6, st
    if budget:  # the gate/up storage resident at the up half's save: one entry for both halves
        assert st.deduplicated == 1, st
    else:  # evicted at once: the up half cannot share it and takes an entry of its own
        assert st.deduplicated == 0, st


@pytest.mark.parametrize("budget", [2048, 3072])
def test_an_entry_shared_last_step_is_written_once_at_its_last_share(budget: int) -> None:
    # NOTE [ Saved tensor identity ] Rule 2c: the first step writes the gate/up storage at the gate's save and again at
    # the up half's; from the second step on (the plan evicts it) it is written once, at the up half's save. The
    # other entries written a step: the product's 1 KiB.
    torch.manual_seed(0)
    x = torch.randn(16, 8, requires_grad=True)
    w = torch.randn(8, 32, requires_grad=True)
    store = cpu_store(budget)
    check_steps(lambda: gate_up_loss(x, w), [x, w], lambda: torchckpt.offload(store), steps=1)
    first = store.stats()
    assert first.offloaded == 4 and first.offloaded_bytes == 2 * 2048 + 2 * 1024, first
    for _ in range(2):
        store.reset_stats()
        check_steps(lambda: gate_up_loss(x, w), [x, w], lambda: torchckpt.offload(store), steps=1)
        st = store.stats()
        assert st.deduplicated == 1 and st.evictions >= 1 and st.plan_divergences == 0, st
        assert st.offloaded == 2 and st.offloaded_bytes == 2048 + 1024, st


def test_shared_entry_written_again_after_a_write_nothing_counts() -> None:
    # NOTE [ Saved tensor identity ] Rule 2c with Rule 2b's scratch buffer: the first view's entry is copied to
    # host at its save (the first step writes every entry), column 1 is written through .data, the second
    # view shares the entry; then later saves need the cache and the entry is evicted: backward reads the host
    # copy, which must hold column 1 as written.
    w = torch.ones(4, 1, requires_grad=True)
    noise = torch.randn(64, 64)

    def loss() -> torch.Tensor:
        stages = _rk_stages(w)
        h = (noise * w.sum()).exp()  # 16 KiB saves (noise, exp's output): k's entry is evicted to make room
        return stages + h.mean() * 1e-3

    ref = grads_of(loss, [w], contextlib.nullcontext())
    store = cpu_store(16384)
    got = grads_of(loss, [w], torchckpt.offload(store))
    st = store.stats()
    assert st.deduplicated == 1 and st.evictions >= 1, st
    assert st.offloaded >= 3, st  # k's storage at its first save and again at the second, then the 16 KiB ones
    assert same(ref[0], got[0]), (ref, got)


def test_views_saved_by_one_op_share_an_entry() -> None:
    # q and k of one unbind, saved while one autograd node is built: no op ran in between.
    store = cpu_store(0)
    x = torch.randn(2, 8, 3, 4, 8, requires_grad=True)

    def loss() -> torch.Tensor:
        q, k, v = (x * 1.0).unbind(2)
        return (q @ k.transpose(-2, -1)).softmax(-1).matmul(v).sum()

    check_steps(loss, [x], lambda: torchckpt.offload(store), steps=1)
    st = store.stats()
    assert st.deduplicated >= 1 and st.offloaded < st.packed - st.kept, st


# -- NOTE [ Saved tensor identity ] Rule 5: what a pack hook returns never holds the saved tensor's graph ---
@pytest.mark.parametrize("make_ctx", [
    lambda: torchckpt.offload(torchckpt.Store(device="cpu", host=small_pool())),  # default min_bytes: kept
    lambda: cpu_store(1 << 20).hooks(keep=()),
], ids=["kept_small", "moved"])
def test_forward_without_backward_frees_its_graph(make_ctx: Callable[[], Any]) -> None:
    import gc
    import weakref
    x = torch.randn(16, 16, requires_grad=True)
    with make_ctx():
        y = x.tanh()  # tanh saves its output
        v = y.t()[1:]  # a view of an output, saved through its _base
        z = (y.exp() * v.t().sum()).softmax(-1)
    refs = [weakref.ref(t) for t in (y, v, z)]
    del y, v, z
    gc.collect()
    assert [r() is None for r in refs] == [True] * 3


def test_kept_output_raises_autograds_own_error() -> None:
    """A kept op output, held detached (NOTE [ Saved tensor identity ] Rule 5), still names the op that made it in
    NOTE [ Saved tensor identity ] Rule 1's error."""
    x = torch.randn(4, requires_grad=True)

    def run(ctx: Any) -> str:
        with ctx:
            y = x.tanh()
            z = y.exp()
        y.add_(1)
        with pytest.raises(RuntimeError, match=INPLACE) as err:
            z.sum().backward()
        return str(err.value)

    plain = run(contextlib.nullcontext())
    assert "output 0 of TanhBackward0" in plain
    assert run(torchckpt.offload(torchckpt.Store(device="cpu", host=small_pool()))) == plain
