"""Models torchckpt's authors did not write: gradients bit-identical to plain autograd over two training steps.

transformers (GPT-2, LLaMA, Mixtral with its fused expert projections, BERT), timm (ViT, Swin),
torchvision (ResNet-18, MobileNetV3, ConvNeXt) and torchdiffeq (``odeint`` with dopri5 and rk4,
``odeint_adjoint``) models, built tiny from configs with random weights (tests/zoo_models.py), run
two SGD steps under each setting:
the whole forward under ``torchckpt.offload(store)`` (resident, a partial budget, evicted, the
identity codec), each of the model's repeated blocks wrapped with ``torchckpt.checkpoint``
(``Offload`` resident / evicted / identity codec, ``Recompute()``, ``Recompute(store=...)``,
``Recompute(reentrant=True)``, ``Keep()``), and transformers' own gradient-checkpointing hook calling ``torchckpt.checkpoint``.
The second step runs with the same store, which then follows the prefetch plan made from the
first step's trace. Loss and every parameter gradient of both steps must equal plain autograd's
bit for bit (same seed before each step: dropout, drop-path and stochastic depth draw the same
masks); buffers too, under Recompute as well (BatchNorm's running statistics are put back around the
recomputation: NOTE [ Buffers written in a forward ]).

The packages are not torchckpt dependencies: each model skips when its package is missing. The
``cuda`` variants run the same matrix with stores on the GPU (real streams, pinned host pool,
math SDPA and deterministic cuDNN so that plain autograd is reproducible), plus copies delayed
at random on the store's streams and forwards under bf16 autocast.
"""
from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import torchckpt
from ckpt_models import assert_same_buffers, assert_same_records, grads, small_pool
from torchckpt import Keep, Offload, Recompute
from torchckpt.codecs import Identity
from zoo_models import BY_NAME, ZOO, Batch, Zoo, available, deterministic_cuda, to

RESIDENT = 64 << 20  # holds every tiny model's saved tensors
PARTIAL = 16 << 10  # holds some: evictions and planned prefetches
STEPS = 2


@dataclasses.dataclass(frozen=True)
class Setting:
    """Where the policy goes (``model``: ``offload(store)`` around the forward; ``blocks``: each
    repeated block wrapped; ``hf``: transformers' checkpointing hook), which policy, and the store."""

    scope: str
    policy: str  # "offload", "recompute", "keep"
    gpu_bytes: int | None = None  # the store's budget; None: no store
    codec: bool = False  # the identity codec on the host path
    slow: bool = False  # random delays before each copy on the store's streams (CUDA only)
    bf16: bool = False  # the forward under torch.autocast(dtype=torch.bfloat16)
    reentrant: bool = False  # Recompute(reentrant=True) (NOTE [ Reentrant recompute ])
    graphed: bool = False  # Recompute(graphed=True) (NOTE [ Graphed recompute ]): a third step replays the graphs

    @property
    def steps(self) -> int:
        return STEPS + 1 if self.graphed else STEPS

    @property
    def recompute(self) -> bool:
        return self.policy == "recompute"


SETTINGS: dict[str, Setting] = {
    "offload": Setting("model", "offload", RESIDENT),
    "offload_partial": Setting("model", "offload", PARTIAL),
    "offload_evicted": Setting("model", "offload", 0),
    "offload_identity": Setting("model", "offload", 0, codec=True),
    "block_offload": Setting("blocks", "offload", RESIDENT),
    "block_offload_partial": Setting("blocks", "offload", PARTIAL),
    "block_offload_evicted": Setting("blocks", "offload", 0),
    "block_offload_identity": Setting("blocks", "offload", 0, codec=True),
    "block_recompute": Setting("blocks", "recompute"),
    "block_recompute_store": Setting("blocks", "recompute", 0),
    "block_recompute_reentrant": Setting("blocks", "recompute", reentrant=True),
    "block_recompute_reentrant_bf16": Setting("blocks", "recompute", reentrant=True, bf16=True),
    "block_recompute_reentrant_store": Setting("blocks", "recompute", 0, reentrant=True),
    "block_keep": Setting("blocks", "keep"),
    "hf_recompute": Setting("hf", "recompute"),
    "hf_recompute_reentrant": Setting("hf", "recompute", reentrant=True),
    "hf_offload_evicted": Setting("hf", "offload", 0),
}
# Copies that lag behind compute: a missing wait between the streams shows up as a wrong value.
CUDA_SETTINGS: dict[str, Setting] = {
    **SETTINGS,
    "offload_partial_slow": Setting("model", "offload", PARTIAL, slow=True),
    "block_offload_partial_slow": Setting("blocks", "offload", PARTIAL, slow=True),
    "block_offload_identity_slow": Setting("blocks", "offload", PARTIAL, codec=True, slow=True),
    "offload_partial_bf16": Setting("model", "offload", PARTIAL, bf16=True),
    "block_offload_identity_bf16": Setting("blocks", "offload", 0, codec=True, bf16=True),
    "block_recompute_store_bf16": Setting("blocks", "recompute", 0, bf16=True),
    "block_recompute_graphed": Setting("blocks", "recompute", graphed=True),
    "block_recompute_graphed_bf16": Setting("blocks", "recompute", graphed=True, bf16=True),
    "hf_recompute_graphed": Setting("hf", "recompute", graphed=True),
}


def make_store(device: str, gpu_bytes: int, codec: bool) -> torchckpt.Store:
    if device == "cpu":
        host = small_pool()
    else:
        host = torchckpt.memory.HostPool(capacity_bytes=256 << 20, chunk_bytes=1 << 20, pin=True)
    return torchckpt.Store(device=device, gpu_bytes=gpu_bytes, min_bytes=0, host=host,
                           codec=Identity() if codec else None)


def make_policy(s: Setting, store: torchckpt.Store | None) -> torchckpt.Policy:
    if s.policy == "offload":
        return Offload(store)
    if s.policy == "recompute":
        return Recompute(store=store, reentrant=s.reentrant, graphed=s.graphed)
    return Keep()


def prepare(s: Setting, model: nn.Module, z: Zoo, store: torchckpt.Store | None) -> tuple[Callable[[], Any], list[int]]:
    """Apply ``s`` to ``model`` in place; return the context manager factory each forward runs
    under, and a list that grows by one at each call of transformers' checkpointing hook."""
    calls: list[int] = []
    if s.scope == "model":
        assert store is not None
        return (lambda: torchckpt.offload(store)), calls
    policy = make_policy(s, store)
    if s.scope == "blocks":
        blocks = z.blocks(model)
        assert blocks, f"{z.name}: no blocks to wrap"
        for b in blocks:
            torchckpt.checkpoint(b, policy=policy)
    elif s.scope == "hf":
        # What model.gradient_checkpointing_enable() sets up, with torchckpt's function in place of
        # torch.utils.checkpoint's: layers call checkpoint_fn(partial(forward, **kwargs), *args).
        def hook(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return torchckpt.checkpoint(fn, *args, policy=policy, **kwargs)

        hf_model: Any = model
        hf_model._set_gradient_checkpointing(True, hook)
    else:
        raise KeyError(s.scope)
    return torch.enable_grad, calls  # a no-op context


Record = list[tuple[torch.Tensor, dict[str, torch.Tensor | None]]]


def train(model: nn.Module, z: Zoo, batch: Batch, ctx: Callable[[], Any], use_cache: bool, bf16: bool = False,
          steps: int = STEPS) -> Record:
    """``steps`` SGD steps from fixed seeds; the loss and the parameter gradients of each."""
    model.train(z.train)
    device = next(iter(batch.values())).device.type
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out: Record = []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(100 + i)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16), ctx():
            loss = z.loss(model, batch, use_cache)
        loss.backward()
        out.append((loss.detach().clone(), grads(model)))
        opt.step()
    return out


_built: dict[str, tuple[nn.Module, Batch]] = {}
_reference: dict[tuple[str, str, bool, bool, int], tuple[nn.Module, Record]] = {}


def build(z: Zoo, device: str) -> tuple[nn.Module, Batch]:
    """A fresh copy of ``z``'s model (built once: the same weights every time) and its batch."""
    if z.name not in _built:
        _built[z.name] = z.build()
    model, batch = _built[z.name]
    return copy.deepcopy(model).to(device), to(batch, device)


def reference(z: Zoo, device: str, use_cache: bool, bf16: bool = False, steps: int = STEPS) -> tuple[nn.Module, Record]:
    """Plain autograd from the same model and seeds (computed once per model, device, flags and steps)."""
    key = (z.name, device, use_cache, bf16, steps)
    if key not in _reference:
        model, batch = build(z, device)
        rec = train(model, z, batch, torch.enable_grad, use_cache, bf16, steps)
        _reference[key] = (model, rec)
    return _reference[key]


def host_in_use(store: torchckpt.Store) -> int:
    """Host bytes still in use once every copy has finished (blocks freed mid-copy are parked until
    the pool next allocates, NOTE [ Host pool ] Rule 3: a 1-byte allocation reclaims them)."""
    if store.device.type == "cuda":
        torch.cuda.synchronize()
    store.host.free(store.host.alloc(1))
    return store.host.stats().in_use_bytes


def check(z: Zoo, name: str, device: str) -> None:
    pytest.importorskip(z.package)
    s = CUDA_SETTINGS[name]
    use_cache = not s.recompute and s.scope != "hf"
    plain, ref = reference(z, device, use_cache, s.bf16, s.steps)

    model, batch = build(z, device)
    store = None if s.gpu_bytes is None else make_store(device, s.gpu_bytes, s.codec)
    if s.slow:
        assert store is not None and device != "cpu"
        rng = random.Random(0)
        store._set_delay(lambda kind, stream: torch.cuda._sleep(rng.randint(0, 2_000_000)))
    ctx, calls = prepare(s, model, z, store)
    got = train(model, z, batch, ctx, use_cache, s.bf16, s.steps)

    assert_same_records(got, ref)
    if s.scope == "hf":
        assert len(calls) == s.steps * len(z.blocks(model))
    assert_same_buffers(model, plain)  # NOTE [ Buffers written in a forward ]: under Recompute too
    if store is None:
        return
    st = store.stats()
    if s.scope != "model" and z.blocks_in_backward:
        assert st.packed > 0 and st.kept == st.packed, st  # saved during backward: kept (NOTE [ Store ] Rule 1)
        return
    assert st.offloaded > 0, st
    assert st.steps == STEPS, st
    if s.gpu_bytes == 0:
        assert st.cache_hits == 0 and st.misses > 0, st
    if s.codec:
        assert st.compressed > 0, st
    assert host_in_use(store) == 0


ZOO_IDS = [z.name for z in ZOO]


def cases(settings: dict[str, Setting]) -> list[Any]:
    """(model, setting) pairs; transformers' checkpointing hook only on transformers models."""
    return [pytest.param(z.name, name, id=f"{z.name}-{name}")
            for z in ZOO for name, s in settings.items() if s.scope != "hf" or z.hf]


@pytest.mark.parametrize(("zoo", "setting"), cases(SETTINGS))
def test_zoo_cpu(zoo: str, setting: str) -> None:
    check(BY_NAME[zoo], setting, "cpu")


@pytest.fixture
def _deterministic_cuda() -> Iterator[None]:
    with deterministic_cuda():
        yield


@pytest.mark.cuda
@pytest.mark.usefixtures("_deterministic_cuda")
@pytest.mark.parametrize("zoo", ZOO_IDS)
def test_zoo_cuda_plain_is_reproducible(zoo: str) -> None:
    """Guards the CUDA matrix: two plain runs agree bit for bit (else a mismatch below means nothing)."""
    z = BY_NAME[zoo]
    pytest.importorskip(z.package)
    _, ref = reference(z, "cuda", True)
    model, batch = build(z, "cuda")
    got = train(model, z, batch, torch.enable_grad, True)
    assert_same_records(got, ref)


@pytest.mark.cuda
@pytest.mark.usefixtures("_deterministic_cuda")
@pytest.mark.parametrize(("zoo", "setting"), cases(CUDA_SETTINGS))
def test_zoo_cuda(zoo: str, setting: str) -> None:
    check(BY_NAME[zoo], setting, "cuda")


def test_zoo_catches_a_wrong_gradient() -> None:
    """The comparison is live: a store that hands back its saved tensors off by one ulp fails it."""
    z = next((z for z in ZOO if available(z)), None)
    if z is None:
        pytest.skip("none of transformers, timm, torchvision, torchdiffeq is installed")
    _, ref = reference(z, "cpu", True)
    model, batch = build(z, "cpu")
    store = make_store("cpu", RESIDENT, False)
    unpack = store.unpack

    def bad_unpack(h: Any) -> torch.Tensor:
        t = unpack(h)
        return t * (1 + torch.finfo(t.dtype).eps) if t.is_floating_point() else t

    store.unpack = bad_unpack  # type: ignore[method-assign]  # store.hooks() reads it
    got = train(model, z, batch, lambda: torchckpt.offload(store), True)
    with pytest.raises(AssertionError):
        assert_same_records(got, ref)


@pytest.mark.parametrize("gpu_bytes", [0, RESIDENT])
def test_scratch_buffer_written_through_data(gpu_bytes: int) -> None:
    """torchdiffeq's Runge-Kutta step (``_UncheckedAssign``) fills a scratch buffer ``k`` column by
    column through ``k.data[..., i] = f`` and saves ``k[..., :i + 1]`` after each write. ``k.data``
    has a version counter of its own, so ``k``'s views are saved at one version of one counter
    while their bytes differ; plain autograd reads each by reference and gets the new column."""

    def run(ctx: Callable[[], Any]) -> torch.Tensor:
        w = torch.ones(4, 1, requires_grad=True)
        k = torch.zeros(4, 3)
        k.data[:, 0] = 1.0
        with ctx():
            a = (k[:, :1] * w).sum()  # reaches over half of k's storage: a whole-storage entry
            k.data[:, 1] = 5.0  # k._version unchanged
            b = (k[:, :2] * w).sum()  # same storage, counter and version as k[:, :1]; column 1 is new
        (a + b).backward()
        assert w.grad is not None
        return w.grad

    store = make_store("cpu", gpu_bytes, False)
    plain = run(torch.enable_grad)
    assert torch.equal(run(lambda: torchckpt.offload(store)), plain)
