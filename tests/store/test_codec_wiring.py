"""Codecs in both offload paths (NOTE [ Store ] Rule 9, NOTE [ Snapshot store ] Rules 8-9), on the CPU."""
from __future__ import annotations

import warnings

import pytest
import torch

import torchckpt
from ckpt_models import Echo
from torchckpt.adjoint import AutoSchedule, checkpointed_loop, run_schedule
from torchckpt.codecs import Identity, Packed, TritonQuant
from torchckpt.schedules import Revolve, Tier
from torchckpt.memory import HostPool
from torchckpt.store import SnapshotStore, Store


def _pool() -> HostPool:
    return HostPool(chunk_bytes=1 << 20, pin=False)


def _echo(store: Store, a: torch.Tensor, codec=None) -> torch.Tensor:
    x = torch.zeros_like(a, requires_grad=True)
    with store.hooks(codec=codec):
        y = Echo.apply(x, a)
    y.sum().backward()
    return x.grad


def test_identity_codec_is_bit_exact_and_counted() -> None:
    torch.manual_seed(0)
    store = Store("cpu", gpu_bytes=0, min_bytes=0, host=_pool(), codec=Identity())
    a = torch.randn(1000, dtype=torch.float64)
    g = _echo(store, a)
    assert torch.equal(g, a)
    st = store.stats()
    assert st.compressed == 1 and st.compressed_bytes >= a.numel() * 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lossy_codec_round_trip_within_bound(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    bound = 5e-2  # 8-bit steps of N(0,1) blocks are ~0.025: no block is kept raw
    store = Store("cpu", gpu_bytes=0, min_bytes=0, host=_pool(), codec=TritonQuant(bits=8, mode="abs", bound=bound))
    a = torch.randn(4096).to(dtype)
    g = _echo(store, a)
    err = (g.float() - a.float()).abs().max().item()
    assert 0 < err <= bound  # lossy, and within the guarantee
    st = store.stats()
    assert st.compressed == 1
    assert st.compressed_bytes < a.numel() * a.element_size()  # fewer bytes crossed


def test_unsupported_dtype_goes_uncompressed() -> None:
    store = Store("cpu", gpu_bytes=0, min_bytes=0, host=_pool(), codec=TritonQuant(bits=8, bound=1e-2))
    a = torch.arange(5000, dtype=torch.int64)
    x = torch.zeros(5000, requires_grad=True)
    with store.hooks():
        y = Echo.apply(x, a.float())  # float entry: compressed
    y.sum().backward()
    assert store.stats().compressed == 1

    class SaveInt(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, idx):  # type: ignore[override]
            ctx.save_for_backward(idx)
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            (idx,) = ctx.saved_tensors
            return idx.to(g.dtype), None

    store2 = Store("cpu", gpu_bytes=0, min_bytes=0, host=_pool(), codec=TritonQuant(bits=8, bound=1e-2))
    x = torch.zeros(5000, requires_grad=True)
    with store2.hooks():
        y = SaveInt.apply(x, a)
    y.sum().backward()
    assert torch.equal(x.grad, a.float())  # int64 saved exactly
    st = store2.stats()
    assert st.offloaded == 1 and st.compressed == 0


def test_offload_policy_codec_overrides_the_store() -> None:
    torch.manual_seed(2)
    store = Store("cpu", gpu_bytes=0, min_bytes=0, host=_pool())
    lin = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    ref = torch.nn.Sequential(*[m for m in lin])
    x = torch.randn(32, 64)
    ref(x).square().sum().backward()
    want = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    lossy = torchckpt.Offload(store, codec=TritonQuant(bits=8, mode="rel", bound=1e-2))
    torchckpt.checkpoint(lin, x, policy=lossy).square().sum().backward()
    got = [p.grad for p in lin.parameters()]
    st = store.stats()
    assert st.compressed > 0
    diffs = [(a - b).abs().max().item() for a, b in zip(got, want)]
    assert max(diffs) > 0  # lossy saved activations change the gradient ...
    assert max(diffs) < 0.05 * max(w.abs().max().item() for w in want)  # ... but only a little
    # and the same block with a lossless codec is bit-exact
    lin.zero_grad()
    torchckpt.checkpoint(lin, x, policy=torchckpt.Offload(store, codec=Identity())).square().sum().backward()
    assert all(torch.equal(p.grad, w) for p, w in zip(lin.parameters(), want))


def test_checkpoint_takes_the_policy_positionally_for_a_module() -> None:
    store = Store("cpu", gpu_bytes=0, min_bytes=0, host=_pool())
    lin = torchckpt.checkpoint(torch.nn.Linear(64, 64), torchckpt.Offload(store))
    assert isinstance(lin, torch.nn.Linear)
    lin(torch.randn(8, 64)).sum().backward()
    st = store.stats()
    assert st.packed == 1 and st.offloaded == 1  # the input x, saved for weight's gradient, went through the store


def test_views_of_one_storage_with_other_dtypes_get_their_own_entries() -> None:
    store = Store("cpu", gpu_bytes=0, min_bytes=0, host=_pool(), codec=TritonQuant(bits=8, bound=1e-2))
    base = torch.randn(2048)
    as_int = base.view(torch.int32)

    class Two(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, f, i):  # type: ignore[override]
            ctx.save_for_backward(f, i)
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            f, i = ctx.saved_tensors
            assert torch.equal(i, as_int)  # the int view must come back bit-exact
            return f.clone(), None, None

    x = torch.zeros(2048, requires_grad=True)
    with store.hooks():
        y = Two.apply(x, base, as_int)
    y.sum().backward()
    assert (x.grad - base).abs().max() <= 1e-2
    assert store.stats().offloaded == 2


def test_codec_type_errors() -> None:
    with pytest.raises(TypeError, match="torchckpt: Store\\(codec"):
        Store("cpu", codec="quant")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torchckpt: Offload\\(codec"):
        torchckpt.Offload(codec=8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torchckpt: SnapshotStore\\(codec"):
        SnapshotStore("cpu", codec=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        SnapshotStore("cpu", slots=2, gpu_bytes=1 << 20)


# -- adjoint path -------------------------------------------------------------------------------
def _toy(n_steps: int):
    x = [torch.linspace(0, 1, 4096, dtype=torch.float32)]
    log: list[tuple[int, torch.Tensor]] = []

    def forward(n0: int, n1: int) -> None:
        for _ in range(n0, n1):
            x[0] = torch.sin(x[0] * 1.3 + 0.1)

    def restore(n: int, t: list[torch.Tensor]) -> None:
        x[0] = t[0].clone()

    def backward(n: int) -> None:
        log.append((n, x[0].clone()))
    return x, log, dict(forward=forward, save=lambda n: x[0], restore=restore, backward=backward)


def _reference(n_steps: int) -> dict[int, torch.Tensor]:
    x = torch.linspace(0, 1, 4096, dtype=torch.float32)
    out = {}
    for n in range(n_steps):
        out[n] = x.clone()
        x = torch.sin(x * 1.3 + 0.1)
    return out


def test_snapshot_store_identity_codec_exact_and_more_slots_from_budget() -> None:
    N = 30
    ref = _reference(N)
    snap = SnapshotStore("cpu", gpu_bytes=3 * 4096 * 4 + 100, host=_pool(), codec=Identity(), slot_margin=0.0)
    x, log, cb = _toy(N)
    st = run_schedule(Revolve(N, 5, tier=Tier.HOST), store=snap, **cb)
    assert snap.nslots == 3  # the budget holds three 16 KiB blobs
    assert [n for n, _ in log] == list(range(N - 1, -1, -1))
    assert all(torch.equal(v, ref[n]) for n, v in log)
    assert st.ratio == pytest.approx(1.0, rel=1e-3)


def test_snapshot_store_lossy_codec_within_bound_and_compressed_in_every_tier() -> None:
    N = 30
    ref = _reference(N)
    bound = 1e-3
    for tier in (Tier.HOST, Tier.GPU):
        codec = TritonQuant(bits=8, mode="abs", bound=bound)
        snap = SnapshotStore("cpu", gpu_bytes=1 << 16, host=_pool(), codec=codec)
        x, log, cb = _toy(N)
        st = run_schedule(Revolve(N, 5, tier=tier), store=snap, **cb)
        assert st.ratio > 3.0  # fp32 -> 8-bit codes
        # a restored state carries the codec's error, then the steps after it are recomputed from it
        restored = {n for n, _ in log}
        assert restored == set(range(N))
        errs = [(v - ref[n]).abs().max().item() for n, v in log]
        assert max(errs) > 0
        # A restored snapshot is within the bound; recomputed steps after it may grow that error
        # (sin(1.3 x + 0.1) is 1.3-Lipschitz) and Revolve re-saves recomputed states: bounded here by 2x.
        assert max(errs) <= 2 * bound
        snap.close()


def test_snapshot_slot_grows_when_a_blob_does_not_fit() -> None:
    N = 12
    ref = _reference(N)
    snap = SnapshotStore("cpu", slots=2, host=_pool(), codec=Identity(), slot_bytes=1024)
    x, log, cb = _toy(N)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        st = run_schedule(Revolve(N, 4, tier=Tier.HOST), store=snap, **cb)
    assert st.slot_grows >= 1
    assert any("did not fit its slot" in str(m.message) for m in w)
    assert all(torch.equal(v, ref[n]) for n, v in log)


def _unrolled_grads(step, x0: torch.Tensor, w: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``step`` applied ``n`` times by plain autograd, wrt (w, x0); leaves the .grads cleared."""
    y = x0
    for _ in range(n):
        y = step(y)
    y.square().sum().backward()
    gw, gx = w.grad.clone(), x0.grad.clone()
    w.grad = None
    x0.grad = None
    return gw, gx


def test_checkpointed_loop_with_a_store_codec() -> None:
    torch.manual_seed(3)
    w = torch.tensor(0.7, requires_grad=True)
    x0 = torch.randn(2048, requires_grad=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(w * x + 0.05)

    gw, gx = _unrolled_grads(step, x0, w, 40)
    store = Store("cpu", min_bytes=0, host=_pool(), codec=Identity())
    out = checkpointed_loop(step, x0, 40, schedule=Revolve(40, 4, tier=Tier.HOST), params=[w], store=store)
    out.square().sum().backward()
    assert torch.equal(w.grad, gw) and torch.equal(x0.grad, gx)


def _bitcomp():
    from torchckpt.codecs import Bitcomp

    if not Bitcomp().is_available():
        pytest.skip(Bitcomp().unavailable_reason() or "")
    return Bitcomp


def test_bitcomp_in_the_store_lossless_and_lossy() -> None:
    Bitcomp = _bitcomp()
    torch.manual_seed(4)
    a = torch.cumsum(torch.randn(1 << 16), 0) * 1e-3  # smooth: compressible
    st_ll = Store("cpu", gpu_bytes=0, min_bytes=0, host=_pool(), codec=Bitcomp())
    assert torch.equal(_echo(st_ll, a), a)
    lossy = Bitcomp(delta=1e-3)
    st = Store("cpu", gpu_bytes=0, min_bytes=0, host=_pool(), codec=lossy)
    g = _echo(st, a)
    err = (g - a).abs().max().item()
    assert 0 < err <= lossy.guarantee.bound
    s = st.stats()
    assert s.compressed == 1 and s.compressed_bytes < a.numel() * 4 / 2


def test_lossy_bitcomp_leaves_integer_tensors_alone() -> None:
    Bitcomp = _bitcomp()
    assert Bitcomp(delta=1e-3).supports(torch.float32) and not Bitcomp(delta=1e-3).supports(torch.int64)
    assert Bitcomp().supports(torch.int64)


def test_zfp_snapshots_fixed_rate() -> None:
    from torchckpt.codecs import ZFP

    if not ZFP().is_available():
        pytest.skip(ZFP().unavailable_reason() or "")
    N = 20
    ref = _reference(N)
    snap = SnapshotStore("cpu", gpu_bytes=1 << 15, host=_pool(), codec=ZFP(rate=16), slot_margin=0.0)
    x, log, cb = _toy(N)
    st = run_schedule(Revolve(N, 4, tier=Tier.HOST), store=snap, **cb)
    assert st.ratio == pytest.approx(2.0, rel=0.02)  # 16 of 32 bits per value
    assert snap.nslots == (1 << 15) // snap.slot_bytes and st.slot_grows == 0  # fixed rate: sizes never change
    err = max((v - ref[n]).abs().max().item() for n, v in log)
    assert 0 < err < 1e-2  # no bound is promised at a fixed rate; on this smooth 1D field it is small


def test_checkpointed_loop_store_codec_is_used_and_buys_snapshots() -> None:
    from torchckpt.adjoint.auto import _snapshot_bytes, auto_schedule

    torch.manual_seed(5)
    w = torch.tensor(0.7, requires_grad=True)
    x0 = torch.randn(4096, requires_grad=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(w * x + 0.05)

    _, gx = _unrolled_grads(step, x0, w, 30)
    lossy = TritonQuant(bits=8, mode="rel", bound=1e-2)
    store = Store("cpu", min_bytes=0, host=_pool(), codec=lossy)
    out = checkpointed_loop(step, x0, 30, schedule=Revolve(30, 4, tier=Tier.HOST), params=[w], store=store)
    out.square().sum().backward()
    rel = ((x0.grad - gx).norm() / gx.norm()).item()
    assert 0 < rel < 0.05  # the snapshots went through the lossy codec: close, not exact
    # "auto" counts compressed snapshots: the same budget holds more of them
    raw = _snapshot_bytes([x0], None)
    packed = _snapshot_bytes([x0], lossy)
    assert raw / packed > 3.0
    few = auto_schedule(1000, raw, gpu_bytes=20 * raw, host_bytes=0, slots=4)
    many = auto_schedule(1000, packed, gpu_bytes=20 * raw, host_bytes=0, slots=4)
    assert many.snapshots > few.snapshots  # type: ignore[attr-defined]


def test_uniform_sized_by_the_budget_uses_the_room_a_codec_makes() -> None:
    from torchckpt.adjoint import auto_schedule
    from torchckpt.schedules import Uniform

    raw, packed = 1000, 250
    u_raw = auto_schedule(500, raw, gpu_bytes=40 * raw, host_bytes=0, slots=4, kind=Uniform)
    u_packed = auto_schedule(500, packed, gpu_bytes=40 * raw, host_bytes=0, slots=4, kind=Uniform)
    assert isinstance(u_raw, Uniform) and u_raw.snapshots == 36 and u_raw.tier is Tier.GPU
    assert u_packed.snapshots == 156  # 4x smaller snapshots: 160 fit, minus 4 cache slots
    with pytest.raises(TypeError, match="Revolve or Uniform"):
        auto_schedule(10, raw, 10 * raw, 0, kind=int)  # type: ignore[arg-type]

    torch.manual_seed(6)
    x0 = torch.randn(2048, requires_grad=True)
    w = torch.tensor(0.8, requires_grad=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(w * x)

    y = x0
    for _ in range(25):
        y = step(y)
    y.sum().backward()
    gx = x0.grad.clone()
    x0.grad = None
    store = Store("cpu", gpu_bytes=8 * 2048 * 4, min_bytes=0, host=_pool(), codec=Identity())
    checkpointed_loop(step, x0, 25, schedule=AutoSchedule(kind=Uniform), params=[w], store=store).sum().backward()
    assert torch.equal(x0.grad, gx)
    from torchckpt.schedules import ZCut

    with pytest.raises(TypeError, match="Only Revolve and Uniform can be sized"):
        checkpointed_loop(step, x0, 25, schedule=ZCut, params=[w], store=store)  # type: ignore[arg-type]


class _CountingQuant(TritonQuant):
    """TritonQuant that counts how often each tensor's memory is compressed."""

    def __init__(self) -> None:
        super().__init__(bits=8, mode="rel", bound=1e-2)
        self.calls: dict[int, int] = {}

    def compress(self, x: torch.Tensor, stream: torch.cuda.Stream | None = None) -> Packed:  # type: ignore[override]
        self.calls[x.data_ptr()] = self.calls.get(x.data_ptr(), 0) + 1
        return super().compress(x, stream=stream)


def test_checkpointed_loop_compresses_the_first_state_once() -> None:
    """AutoSchedule's estimate, the snapshot store's slot sizing and the first Save share one compression."""
    torch.manual_seed(6)
    x0 = torch.randn(4096, requires_grad=True)
    codec = _CountingQuant()
    store = Store("cpu", min_bytes=0, host=_pool(), codec=codec, gpu_bytes=40 * 4096 * 4)
    ref_codec = TritonQuant(bits=8, mode="rel", bound=1e-2)
    ref_store = Store("cpu", min_bytes=0, host=_pool(), codec=ref_codec, gpu_bytes=40 * 4096 * 4)
    xs = [x0.detach().clone().requires_grad_() for _ in range(2)]  # alive throughout: their memory is theirs
    for x, s in zip(xs, (store, ref_store)):
        checkpointed_loop(torch.tanh, x, 30, schedule=AutoSchedule(), store=s).sum().backward()
    assert codec.calls.get(xs[0].data_ptr()) == 1, codec.calls  # estimate, slot sizing and Save(0): one compression
    assert torch.equal(xs[0].grad, xs[1].grad)  # the same gradients as a codec that does not count


def test_run_schedule_compresses_the_first_state_once() -> None:
    codec = _CountingQuant()
    u = [torch.randn(1024)]
    u0 = u[0]  # alive throughout: its memory is its own
    snaps = SnapshotStore("cpu", gpu_bytes=8 * 1024 * 4, host=_pool(), codec=codec)
    run_schedule(Revolve(6, 3, tier=Tier.HOST), forward=lambda a, b: u.__setitem__(0, u[0] * 1.01),
                 save=lambda n: u[0], restore=lambda n, t: u.__setitem__(0, t[0].clone()),
                 backward=lambda n: None, store=snaps)
    assert codec.calls.get(u0.data_ptr()) == 1, codec.calls  # slot sizing and Save(0): one compression
