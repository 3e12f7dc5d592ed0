"""checkpoint_chain: Revolve over a chain of blocks (NOTE [ Chain of blocks ] in torchckpt/recompute/chain.py).

Every case compares with plain autograd bit for bit, and counts what the chain ran again against the schedule's
optimum."""
from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.memory import HostPool
from torchckpt.schedules import Multistage, Revolve, Tier, Uniform, optimal_forward_steps, plan_prefetch
from torchckpt.store import SnapshotStore
from torchckpt.recompute.chain import SLOTS
from zoo_models import ZOO, available, deterministic_cuda, to

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class Block(nn.Module):
    def __init__(self, d: int = 16, p: float = 0.1) -> None:
        super().__init__()
        self.lin, self.norm, self.drop = nn.Linear(d, d), nn.LayerNorm(d), nn.Dropout(p)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, *, scale: float = 1.0) -> torch.Tensor:
        h = self.drop(torch.nn.functional.gelu(self.lin(self.norm(x))))
        if bias is not None:
            h = h + bias
        return x + scale * h


class Stack(nn.Module):
    def __init__(self, n: int, d: int = 16, p: float = 0.1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, p) for _ in range(n))
        self.bias = nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, self.bias * 2, scale=0.5)
        return x


def _step(model: nn.Module, x: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    assert x.grad is not None
    return out.detach(), grads, x.grad



def _seeded(make: Callable[[], nn.Module], device: str = "cpu", rows: int = 4) -> tuple[nn.Module, torch.Tensor, Any]:
    """A model made after seeding, a batch of ``rows`` x 16 and plain autograd's step on it (``_step``)."""
    torch.manual_seed(0)
    model = make().to(device)
    x = torch.randn(rows, 16, device=device)
    return model, x, _step(model, x)

def _same(a: tuple[torch.Tensor, list[torch.Tensor], torch.Tensor], b: tuple[torch.Tensor, list[torch.Tensor],
          torch.Tensor]) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and all(torch.equal(u, v) for u, v in zip(a[1], b[1]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,s", [(1, 1), (2, 1), (3, 2), (7, 1), (7, 3), (12, 2), (12, 5), (16, 16)])
def test_bit_exact_and_optimal(device: str, n: int, s: int) -> None:
    model, x, ref = _seeded(lambda: Stack(n), device)
    chain = torchckpt.checkpoint_chain(list(model.blocks), snapshots=s)
    for _ in range(2):  # a second step starts afresh
        assert _same(_step(model, x), ref)
    s = min(s, n)
    # Revolve's count includes the forward sweep's n - 1 steps, which the model's own calls are (NOTE [ Schedule
    # actions ] Rule 2); what the chain runs again is the rest.
    assert chain.stats.advances == 2 * (optimal_forward_steps(n, s) - (n - 1))
    assert chain.stats.steps == 2 and chain.stats.handed == 2 * n
    assert chain.stats.peak_states == (min(s, n - 1) + 1 if n > 1 else 1)  # the snapshots and the current state
    chain.remove()
    assert "forward" not in model.blocks[0].__dict__
    assert _same(_step(model, x), ref)


def test_fewer_inputs_held_than_per_block_recompute() -> None:
    torch.manual_seed(0)
    n, s = 10, 3
    model = Stack(n, d=64, p=0.0)
    x = torch.randn(32, 64)
    chain = torchckpt.checkpoint_chain(list(model.blocks), snapshots=s)
    _step(model, x)
    assert chain.stats.peak_state_bytes == (s + 1) * x.nbytes


def test_schedule_argument_and_uniform() -> None:
    model, x, ref = _seeded(lambda: Stack(9))
    chain = torchckpt.checkpoint_chain(list(model.blocks), schedule=Revolve(9, 3))
    assert _same(_step(model, x), ref)
    chain.remove()
    with pytest.raises(ValueError, match="torchckpt: checkpoint_chain got 9 blocks and a schedule over 8 steps"):
        torchckpt.checkpoint_chain(list(model.blocks), schedule=Revolve(8, 3))
    with pytest.raises(ValueError, match="torchckpt: checkpoint_chain\\(store=...\\) holds snapshots kept off the GPU"):
        torchckpt.checkpoint_chain(list(model.blocks), schedule=Revolve(9, 3), store=SnapshotStore("cpu"))
    with pytest.raises(TypeError, match="torchckpt: checkpoint_chain\\(store=...\\) expects a torchckpt.store.Snapshot"):
        torchckpt.checkpoint_chain(list(model.blocks), schedule=Revolve(9, 3, tier=Tier.HOST),
                                   store=torchckpt.Store("cpu"))  # type: ignore[arg-type]
    chain = torchckpt.checkpoint_chain(list(model.blocks), schedule=Uniform(9, 3))
    assert _same(_step(model, x), ref)
    chain.remove()


def test_policies_in_the_chain() -> None:
    model, x, ref = _seeded(lambda: Stack(6))
    for policy in (torchckpt.Recompute(parts=(2,)), torchckpt.Recompute(save={torch.ops.aten.addmm.default})):
        chain = torchckpt.checkpoint_chain(list(model.blocks), snapshots=2, policy=policy)
        assert _same(_step(model, x), ref), policy
        chain.remove()


def test_autocast_cpu() -> None:
    torch.manual_seed(0)
    model = Stack(6)
    x = torch.randn(4, 16)

    def run() -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _step(model, x)

    ref = run()
    chain = torchckpt.checkpoint_chain(list(model.blocks), snapshots=2)
    assert _same(run(), ref)
    assert chain.stats.advances > 0
    chain.remove()


class Broken(Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, b in enumerate(self.blocks):
            x = b(x, self.bias)
            if k == 3:
                x = x * 1.5  # not the block's output: the chain breaks here
        return x


def test_a_step_that_leaves_the_chain_warns_and_is_exact() -> None:
    model, x, ref = _seeded(lambda: Broken(8))
    chain = torchckpt.checkpoint_chain(list(model.blocks), snapshots=2)
    with pytest.warns(RuntimeWarning, match="at block 4, the block's first tensor argument is not the previous"):
        assert _same(_step(model, x), ref)
    assert chain.stats.broken == 1
    chain.remove()


def test_out_of_order_and_partial_steps() -> None:
    torch.manual_seed(0)
    model = Stack(6, p=0.0)
    blocks = list(model.blocks)
    x = torch.randn(4, 16, requires_grad=True)
    chain = torchckpt.checkpoint_chain(blocks, snapshots=2)
    # a step that stops after block 3 (backward before the last block ran): rebuilt from the nearest state
    h = x
    for b in blocks[:4]:
        h = b(h)
    (g,) = torch.autograd.grad(h.sum(), x)
    chain.remove()
    h = x
    for b in blocks[:4]:
        h = b(h)
    (want,) = torch.autograd.grad(h.sum(), x)
    assert torch.equal(g, want)
    chain = torchckpt.checkpoint_chain(blocks, snapshots=2)
    with pytest.warns(RuntimeWarning, match="block 2 was called where block 1 was expected"):
        h = blocks[2](blocks[0](x))
    (g,) = torch.autograd.grad(h.sum(), x)
    chain.remove()
    (want,) = torch.autograd.grad(blocks[2](blocks[0](x)).sum(), x)
    assert torch.equal(g, want)


def _two_forwards(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor) -> list[torch.Tensor]:
    """Gradient accumulation: two forwards, then one backward of their sum; the parameters' gradients."""
    torch.manual_seed(3)
    loss = model(x1).pow(2).sum() + model(x2).sin().sum()
    loss.backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out



def _accumulating() -> tuple[nn.Module, Callable[[], Any], Any]:
    """A seeded 7-block stack with dropout, two forwards then one backward on it (``_two_forwards``), and what that
    gives without a chain."""
    torch.manual_seed(0)
    model = Stack(7, p=0.2)
    x1, x2 = torch.randn(4, 16), torch.randn(4, 16)
    two = functools.partial(_two_forwards, model, x1, x2)
    return model, two, two()

def test_gradient_accumulation_two_forwards_then_backward() -> None:
    model, two, ref = _accumulating()
    chain = torchckpt.checkpoint_chain(list(model.blocks), snapshots=3)
    assert all(torch.equal(u, v) for u, v in zip(two(), ref))
    assert chain.stats.steps == 2
    chain.remove()


def test_no_grad_and_eval_steps_are_left_alone() -> None:
    model = Stack(5)
    chain = torchckpt.checkpoint_chain(list(model.blocks), snapshots=2)
    with torch.no_grad():
        model(torch.randn(2, 16))
    assert chain.stats.steps == 0
    chain.remove()


def test_second_backward_raises() -> None:
    torch.manual_seed(0)
    model = Stack(6, p=0.0)
    chain = torchckpt.checkpoint_chain(list(model.blocks), snapshots=2)
    loss = model(torch.randn(2, 16, requires_grad=True)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(torchckpt.CheckpointError, match="torchckpt: checkpoint_chain rebuilt block"):
        loss.backward()
    chain.remove()


def test_bad_arguments() -> None:
    model = Stack(3)
    blocks = list(model.blocks)
    with pytest.raises(TypeError, match="torchckpt: checkpoint_chain needs snapshots"):
        torchckpt.checkpoint_chain(blocks)
    with pytest.raises(TypeError, match="torchckpt: checkpoint_chain takes snapshots=... or schedule"):
        torchckpt.checkpoint_chain(blocks, 2, schedule=Revolve(3, 2))
    with pytest.raises(ValueError, match="torchckpt: checkpoint_chain\\(snapshots=...\\) takes an int >= 1"):
        torchckpt.checkpoint_chain(blocks, snapshots=0)
    with pytest.raises(TypeError, match="torchckpt: checkpoint_chain\\(blocks, ...\\) expects a non-empty list"):
        torchckpt.checkpoint_chain(model, snapshots=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got a module twice"):
        torchckpt.checkpoint_chain([blocks[0], blocks[0]], snapshots=1)
    with pytest.raises(TypeError, match="takes Recompute\\(\\) without a store"):
        torchckpt.checkpoint_chain(blocks, snapshots=2, policy=torchckpt.Offload(torchckpt.Store(device="cpu")))
    with pytest.raises(ValueError, match="1 policies"):
        torchckpt.checkpoint_chain(blocks, snapshots=2, policy=[torchckpt.Recompute()])
    chain = torchckpt.checkpoint_chain(blocks, snapshots=2)
    with pytest.raises(ValueError, match="already checkpointed"):
        torchckpt.checkpoint_chain(blocks, snapshots=2)
    chain.remove()
    torchckpt.checkpoint(blocks[1], policy=torchckpt.Recompute())
    with pytest.raises(ValueError, match="block 1 of checkpoint_chain is already checkpointed"):
        torchckpt.checkpoint_chain(blocks, snapshots=2)


CHAIN_ZOO = [z.name for z in ZOO if not z.name.startswith("ode")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CHAIN_ZOO)
def test_zoo_models_bit_exact(name: str, device: str) -> None:
    """Models we did not write (transformers, timm, torchvision), their own blocks under a chain of 2 snapshots."""
    z = next(z for z in ZOO if z.name == name)
    if not available(z):
        pytest.skip(f"{z.package} is not installed")
    model, batch = z.build()
    model = model.to(device).train(z.train)
    batch = to(batch, device)
    params = [p for p in model.parameters() if p.requires_grad]

    def grads() -> list[torch.Tensor]:
        torch.manual_seed(0)
        if device == "cuda":
            torch.cuda.manual_seed_all(0)
        return list(torch.autograd.grad(z.loss(model, batch, False), params, allow_unused=True, materialize_grads=True))

    with deterministic_cuda() if device == "cuda" else warnings.catch_warnings():
        ref = grads()
        if not all(torch.equal(u, v) for u, v in zip(ref, grads())):
            pytest.skip(f"plain autograd is not reproducible for {name} on {device}")
        blocks = z.blocks(model)
        chain = torchckpt.checkpoint_chain(blocks, snapshots=2)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # stages with a downsampling between blocks break it
                for _ in range(2):
                    got = grads()
                    bad = [k for k, (u, v) in enumerate(zip(ref, got)) if not torch.equal(u, v)]
                    assert not bad, f"{name}: gradients {bad} differ"
        finally:
            chain.remove()
    if name in ("gpt2", "llama", "bert", "vit", "resnet18"):  # their blocks form one chain
        assert chain.stats.broken == 0 and chain.stats.steps == 2, (name, chain.stats)
        if len(blocks) > 2:
            assert chain.stats.advances > 0


def test_deepcopy_of_stack_is_independent() -> None:
    model, x, ref = _seeded(lambda: Stack(4), rows=2)
    chain = torchckpt.checkpoint_chain(list(model.blocks), snapshots=2)
    twin = copy.deepcopy(model)
    assert _same(_step(twin, x), ref)
    assert chain.stats.steps == 0 and twin.blocks[0].forward.chain.stats.steps == 1
    chain.remove()


class Widen(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def test_weighted_revolve_for_blocks_of_unequal_size() -> None:
    """A chain whose states alternate between two widths, under the rotor-style schedule over their sizes."""
    from torchckpt.schedules import WeightedRevolve

    torch.manual_seed(0)
    dims = [16, 64, 16, 64, 16, 64, 16, 64, 16]
    model = nn.Sequential(*[Widen(a, b) for a, b in zip(dims, dims[1:])])
    x = torch.randn(4, 16)
    ref = _step(model, x)
    sizes = [4 * d * 4 for d in dims[:-1]]
    sched = WeightedRevolve([1.0] * len(sizes), sizes, sizes[0] + 2 * min(sizes))
    chain = torchckpt.checkpoint_chain(list(model), schedule=sched)
    assert _same(_step(model, x), ref)
    assert chain.stats.advances == sched.forward_steps - (len(sizes) - 1)
    chain.remove()


def test_the_forward_holds_no_block_input_but_its_snapshots() -> None:
    """NOTE [ Chain of blocks ] Rule 2: autograd keeps the pack hook alive with every tensor saved under it; the hook
    must not keep the state (it did: every block input stayed alive, and the chain freed no memory on an H200)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = Stack(8, p=0.0)
    seen: list[weakref.ReferenceType[torch.Tensor]] = []
    hooks = [b.register_forward_pre_hook(lambda m, a: seen.append(weakref.ref(a[0]))) for b in model.blocks]
    chain = torchckpt.checkpoint_chain(list(model.blocks), snapshots=2)
    x = torch.randn(4, 16, requires_grad=True)
    out = model(x).sum()
    gc.collect()
    alive = [k for k, r in enumerate(seen) if r() is not None]
    assert alive == [0], alive  # the caller's x; the chain holds detached aliases of the snapshots only
    out.backward()
    for h in hooks:
        h.remove()
    chain.remove()


# -- snapshots in host memory and on disk (NOTE [ Chain of blocks ] Rules 8, 9) -------------------------------------


def _host_schedule(kind: str, n: int, s: int) -> tuple[Revolve | Multistage, int]:
    """The schedule, and how many snapshots Revolve's count is for."""
    if kind == "revolve":
        return Revolve(n, s, tier=Tier.HOST), s
    return Multistage(n, gpu_slots=1, host_slots=s), s + 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["revolve", "multistage"])
@pytest.mark.parametrize("n,s", [(2, 1), (5, 2), (9, 2), (12, 3), (20, 4)])
def test_host_snapshots_bit_exact_and_optimal(kind: str, n: int, s: int, device: str) -> None:
    model, x, ref = _seeded(lambda: Stack(n, p=0.2), device)
    sched, total = _host_schedule(kind, n, s)
    chain = torchckpt.checkpoint_chain(list(model.blocks), schedule=sched)
    for _ in range(2):  # two steps in a row, each with a store of its own
        assert _same(_step(model, x), ref)
    assert chain.stats.advances == 2 * (optimal_forward_steps(n, min(total, n)) - (n - 1))
    assert chain.stats.steps == 2 and chain.stats.handed == 2 * n
    st = chain.snapshot_stats()  # the last step's store
    off = sum(isinstance(a, torchckpt.schedules.Save) and a.tier is Tier.HOST for a in sched)
    restores = sum(isinstance(a, torchckpt.schedules.Restore) and a.tier is Tier.HOST for a in sched)
    if off == 0:  # Multistage(2, ...) needs its GPU slot only: no store
        assert st is None and chain.stats.host_saves == 0
        return
    assert st is not None
    assert st.host_saves == off and chain.stats.host_saves == 2 * off
    assert chain.stats.host_restores == 2 * restores
    # exact prefetch: every restore from host hits a slot, and every copy the plan makes is a prefetch hit
    assert st.misses == 0 and st.hits == restores, st
    copies = plan_prefetch(sched, SLOTS).copies
    assert st.prefetches == st.prefetch_hits == copies, (st, copies)
    assert chain.stats.peak_host_states <= s
    chain.remove()


def test_host_snapshots_prefetch_copies_on_a_long_chain() -> None:
    """With more host snapshots than slots, the plan copies snapshots back ahead of their restores."""
    torch.manual_seed(0)
    n = 24
    model = Stack(n, p=0.1)
    x = torch.randn(4, 16)
    ref = _step(model, x)
    sched = Multistage(n, gpu_slots=1, host_slots=4)
    chain = torchckpt.checkpoint_chain(list(model.blocks), schedule=sched)
    assert _same(_step(model, x), ref)
    st = chain.snapshot_stats()
    assert st is not None and st.prefetch_hits > 0 and st.misses == 0, st
    assert st.bytes_to_host > 0 and st.bytes_to_device > 0
    chain.remove()


def test_host_snapshots_hold_less_on_the_device() -> None:
    """Device memory: the current state and the store's slots; the snapshots are in host memory."""
    torch.manual_seed(0)
    n, s = 10, 3
    model = Stack(n, d=64, p=0.0)
    x = torch.randn(32, 64)  # 8 KiB: a whole number of slot alignments
    chain = torchckpt.checkpoint_chain(list(model.blocks), schedule=Revolve(n, s, tier=Tier.HOST))
    _step(model, x)
    assert chain.stats.peak_states == 1
    assert chain.stats.peak_state_bytes == (1 + SLOTS) * x.nbytes
    assert chain.stats.peak_host_states == s and chain.stats.peak_host_bytes == s * x.nbytes
    chain.remove()


def test_a_store_passed_is_used_and_left_open(tmp_path: object) -> None:
    torch.manual_seed(0)
    n = 9
    model = Stack(n, p=0.2)
    x = torch.randn(4, 16)
    ref = _step(model, x)
    pool = HostPool(chunk_bytes=1 << 20, pin=False)
    with SnapshotStore("cpu", slots=1, host=pool) as store:  # one slot: snapshots go to host and come back
        chain = torchckpt.checkpoint_chain(list(model.blocks), schedule=Multistage(n, gpu_slots=1, host_slots=2),
                                           store=store)
        for _ in range(2):
            assert _same(_step(model, x), ref)
            assert pool.stats().in_use_bytes == 0  # the step freed its snapshots after its backward
        st = store.stats()
        assert chain.snapshot_stats() == st
        assert st.host_saves == chain.stats.host_saves > 0 and st.misses == 0 and st.bytes_to_host > 0
        chain.remove()


@pytest.mark.parametrize("sched", [Revolve(10, 3, tier=Tier.DISK), Multistage(10, gpu_slots=1, host_slots=1,
                                                                              disk_slots=2)], ids=["revolve", "multi"])
def test_disk_snapshots(tmp_path: object, sched: Revolve | Multistage) -> None:
    import pathlib

    model, x, ref = _seeded(lambda: Stack(10, p=0.2))
    chain = torchckpt.checkpoint_chain(list(model.blocks), schedule=sched)  # no disk: held in host memory
    assert _same(_step(model, x), ref)
    chain.remove()
    with SnapshotStore("cpu", slots=2, disk=tmp_path) as store:  # type: ignore[arg-type]
        chain = torchckpt.checkpoint_chain(list(model.blocks), schedule=sched, store=store)
        for _ in range(2):
            assert _same(_step(model, x), ref)
            assert not [f for f in pathlib.Path(str(tmp_path)).rglob("*") if f.is_file()]  # the step freed them
        st = store.stats()
        assert st.disk is not None and st.disk.writes > 0 and st.disk.reads > 0, st
        assert st.misses == 0
        chain.remove()


def test_host_snapshots_gradient_accumulation() -> None:
    """Two forwards, then one backward: two steps alive at once, in stores of their own or in one store passed."""
    model, two, ref = _accumulating()
    for store in (None, SnapshotStore("cpu", slots=2)):
        chain = torchckpt.checkpoint_chain(list(model.blocks), schedule=Revolve(7, 2, tier=Tier.HOST), store=store)
        assert all(torch.equal(u, v) for u, v in zip(two(), ref))
        assert chain.stats.steps == 2 and chain.stats.host_restores > 0
        chain.remove()


def test_host_snapshots_broken_and_partial_steps() -> None:
    model, x, ref = _seeded(lambda: Broken(8))
    chain = torchckpt.checkpoint_chain(list(model.blocks), schedule=Multistage(8, gpu_slots=1, host_slots=2))
    with pytest.warns(RuntimeWarning, match="at block 4"):
        assert _same(_step(model, x), ref)
    chain.remove()
    model = Stack(8, p=0.0)
    blocks = list(model.blocks)
    x = torch.randn(4, 16, requires_grad=True)
    chain = torchckpt.checkpoint_chain(blocks, schedule=Revolve(8, 2, tier=Tier.HOST))
    h = x
    for b in blocks[:6]:  # backward before the last block: rebuilt from the snapshots in the store
        h = b(h)
    (g,) = torch.autograd.grad(h.sum(), x)
    assert chain.stats.host_restores > 0
    chain.remove()
    h = x
    for b in blocks[:6]:
        h = b(h)
    (want,) = torch.autograd.grad(h.sum(), x)
    assert torch.equal(g, want)


def test_host_snapshots_freed_without_a_backward() -> None:
    """NOTE [ Chain of blocks ] Rule 9: a step dropped before its backward frees its snapshots when it is collected."""
    import gc

    torch.manual_seed(0)
    model = Stack(6, p=0.0)
    pool = HostPool(chunk_bytes=1 << 20, pin=False)
    store = SnapshotStore("cpu", slots=1, host=pool)  # one slot for three snapshots: two go to host
    chain = torchckpt.checkpoint_chain(list(model.blocks), schedule=Revolve(6, 3, tier=Tier.HOST), store=store)
    out = model(torch.randn(4, 16, requires_grad=True))
    assert pool.stats().in_use_bytes > 0
    del out
    gc.collect()
    assert pool.stats().in_use_bytes == 0
    chain.remove()
    store.close()


def test_host_snapshots_need_one_layout() -> None:
    torch.manual_seed(0)
    dims = [16, 64, 16, 64, 16]
    model = nn.Sequential(*[Widen(a, b) for a, b in zip(dims, dims[1:])])
    chain = torchckpt.checkpoint_chain(list(model), schedule=Multistage(4, gpu_slots=1, host_slots=1))
    with pytest.raises(torchckpt.CheckpointError, match="torchckpt: checkpoint_chain keeps snapshots off the GPU in a "
                       "SnapshotStore, which holds states of one shape, dtype and device"):
        model(torch.randn(4, 16, requires_grad=True))
    chain.remove()


class Transposing(nn.Module):
    """A block whose output has the strides of a transpose (the same shape)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + torch.tanh(self.lin(x))).t().contiguous().t()


def test_restored_states_keep_their_strides() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Transposing(16) for _ in range(8)])
    seen: list[tuple[int, tuple[int, ...]]] = []
    hooks = [b.register_forward_pre_hook(lambda m, a, k=k: seen.append((k, a[0].stride())))
             for k, b in enumerate(model)]
    x = torch.randn(4, 16)
    ref = _step(model, x)
    forward = dict(seen)
    seen.clear()
    chain = torchckpt.checkpoint_chain(list(model), schedule=Revolve(8, 2, tier=Tier.HOST))
    assert _same(_step(model, x), ref)
    assert all(forward[k] == st for k, st in seen), seen
    assert chain.stats.host_restores > 0
    for h in hooks:
        h.remove()
    chain.remove()


def test_inside_torch_func_grad_the_blocks_run_as_run_does() -> None:
    """Saved-tensor hooks are refused inside torch.func transforms: the blocks then run as run() runs them (Keep,
    with its warning), and the values and gradients are plain autograd's."""
    torch.manual_seed(0)
    model = Stack(4, p=0.0)
    x = torch.randn(2, 16)
    params = dict(model.named_parameters())

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,)).square().sum()

    want = torch.func.grad(loss)(params)
    chain = torchckpt.checkpoint_chain(list(model.blocks), snapshots=2)
    with pytest.warns(UserWarning, match="runs as Keep\\(\\) inside torch.func"):
        got = torch.func.grad(loss)(params)
    chain.remove()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert chain.stats.steps == 0


class ViewOut(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.k, self.w = k, nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> Any:
        if self.k == 1:  # first output: a view of the block's input
            return x[:2], torch.tanh(x * 3 + self.w[0])
        return torch.tanh(x @ self.w) @ self.w


@pytest.mark.parametrize("s", [1, 2, 3])
def test_an_input_written_after_its_block_ran_raises_as_recompute_does(s: int) -> None:
    """NOTE [ Chain of blocks ] Rule 10 (the fuzzer's chain bug 1): block 1's input written through the view block 1
    returned. Recompute() raises autograd's version error; the chain computed with the written bytes, silently wrong,
    before the fix."""
    torch.manual_seed(0)
    blocks = [ViewOut(k) for k in range(3)]
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    def run(call: Any) -> None:
        h0 = call(blocks[0], x)
        h1, y1 = call(blocks[1], h0)
        h1.mul_(2)  # writes h0, block 1's input
        (call(blocks[2], h1).sum() + y1.sum()).backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(lambda b, h: torchckpt.checkpoint(b, h, policy=torchckpt.Recompute()))
    chain = torchckpt.checkpoint_chain(blocks, snapshots=s)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # block 2's input is not block 1's output unchanged
            with pytest.raises(torchckpt.CheckpointError, match="modified by an inplace operation: the input of "
                                                                 "block 1 of checkpoint_chain"):
                run(lambda b, h: b(h))
    finally:
        chain.remove()
