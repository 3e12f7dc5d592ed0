"""Pickling and copying wrapped modules: torch.save/torch.load, pickle and copy.deepcopy keep the policy.

A ``Store`` in a policy pickles as its configuration (the loaded module gets a fresh, empty store
with the same settings; modules that shared a store share the new one); ``copy.deepcopy`` keeps
the same store. Classes decorated with ``@checkpoint`` pickle by reference, their policy with them.
"""
from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchckpt
from ckpt_models import MLP, Block, assert_same_grads, assert_same_state, clone, cpu_store, make, step
from torchckpt import Keep, Offload, Recompute
from torchckpt.codecs import Identity


# Module level, so that they pickle by reference.
@torchckpt.checkpoint
class BareNet(MLP):
    pass


@torchckpt.checkpoint(Recompute())
class RecomputeNet(MLP):
    pass


OFFLOAD_NET_STORE = cpu_store(2048)


@torchckpt.checkpoint(Offload(OFFLOAD_NET_STORE))
class OffloadNet(MLP):
    pass


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Block()
        self.b = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


POLICIES: dict[str, Callable[[], torchckpt.Policy]] = {
    "keep": Keep,
    "offload_b0": lambda: Offload(cpu_store(0)),
    "offload_small": lambda: Offload(cpu_store(2048)),
    "offload_identity": lambda: Offload(cpu_store(1024), codec=Identity()),
    "recompute": Recompute,
    "recompute_store": lambda: Recompute(store=cpu_store(1024)),
}


def torch_save_load(obj: object) -> object:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES: dict[str, Callable[[object], object]] = {
    "torch_save": torch_save_load,
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "deepcopy": copy.deepcopy,
}


def policy_of(m: nn.Module) -> torchckpt.Policy:
    return m.__dict__["forward"].policy


def assert_same_settings(a: torchckpt.Store, b: torchckpt.Store) -> None:
    assert (a.device, a.cache.capacity, a.min_bytes, a.prefetch) == (b.device, b.cache.capacity, b.min_bytes, b.prefetch)
    assert type(a.codec) is type(b.codec)
    assert (a.host.capacity_bytes, a.host.chunk_bytes, a.host.pin) == (b.host.capacity_bytes, b.host.chunk_bytes, b.host.pin)


def check_store_copy(how: str, old: torchckpt.Store | None, new: torchckpt.Store | None) -> None:
    """deepcopy shares the store; pickling gives a fresh store with the same settings."""
    if old is None:
        assert new is None
        return
    assert new is not None
    if how == "deepcopy":
        assert new is old
        return
    assert new is not old
    assert_same_settings(new, old)
    s = new.stats()
    assert s.packed == 0 and s.host.in_use_bytes == 0 and new.plan is None


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("pname", list(POLICIES))
def test_instance_wrapped_module_round_trips(pname: str, how: str) -> None:
    model, x = make("block")
    model.drop.p = 0.3
    plain = clone(model)
    policy = POLICIES[pname]()
    m = torchckpt.checkpoint(clone(model), policy=policy)
    before = step(m, m, x)  # the original has run a step: its store has a trace and stats
    keys = list(m.state_dict())

    c = COPIES[how](m)
    assert isinstance(c, Block) and c is not m and list(c.state_dict()) == keys
    assert_same_state(c, m)
    new_policy = policy_of(c)
    assert type(new_policy) is type(policy)
    check_store_copy(how, getattr(policy, "store", None), getattr(new_policy, "store", None))
    if isinstance(policy, Offload) and policy.codec is not None:
        assert isinstance(new_policy.codec, Identity)

    # The copy gives plain autograd's gradients, bit for bit, and its store is used.
    packed = new_policy.store.stats().packed if getattr(new_policy, "store", None) is not None else 0
    ref = step(plain, plain, x)
    got = step(c, c, x)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert_same_grads(got[2], ref[2])
    if getattr(new_policy, "store", None) is not None:
        assert new_policy.store.stats().packed > packed

    # The copy runs its own parameters; the original is untouched.
    with torch.no_grad():
        for p in c.parameters():
            p.mul_(1.5)
    changed = clone(model)
    changed.load_state_dict(c.state_dict())
    ref = step(changed, changed, x)
    got = step(c, c, x)
    assert torch.equal(got[0], ref[0])
    assert_same_grads(got[2], ref[2])
    again = step(m, m, x)
    assert torch.equal(again[0], before[0])
    assert_same_grads(again[2], before[2])


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("cls", [BareNet, RecomputeNet, OffloadNet], ids=lambda c: c.__name__)
def test_decorated_class_pickles_by_reference(cls: type[MLP], how: str) -> None:
    torch.manual_seed(1)
    m = cls()
    x = torch.randn(4, 16)
    plain = MLP()
    plain.load_state_dict(m.state_dict())
    c = COPIES[how](m)
    assert type(c) is cls and "forward" not in c.__dict__  # the policy is the class's
    packed = OFFLOAD_NET_STORE.stats().packed
    ref = step(plain, plain, x)
    got = step(c, c, x)
    assert torch.equal(got[1], ref[1])
    assert_same_grads(got[2], ref[2])
    assert (OFFLOAD_NET_STORE.stats().packed > packed) == (cls is OffloadNet)


@pytest.mark.parametrize("how", list(COPIES))
def test_blocks_sharing_a_store_share_the_loaded_one(how: str) -> None:
    # One store for several blocks (one prefetch plan): the copies share one store too.
    torch.manual_seed(3)
    model = TwoBlocks()
    x = torch.randn(2, 8, 32)
    plain = clone(model)
    s = cpu_store(2048)
    m = clone(model)
    torchckpt.checkpoint(m.a, policy=Offload(s))
    torchckpt.checkpoint(m.b, policy=Offload(s))
    step(m, m, x)
    c = COPIES[how](m)
    sa, sb = policy_of(c.a).store, policy_of(c.b).store
    assert sa is sb
    check_store_copy(how, s, sa)
    for i in range(3):
        ref = step(plain, plain, x, seed=i)
        got = step(c, c, x, seed=i)
        assert torch.equal(got[1], ref[1])
        assert_same_grads(got[2], ref[2])
    assert sa.stats().plans == 1 and sa.stats().host.in_use_bytes == 0


@pytest.mark.parametrize("how", list(COPIES))
def test_nested_and_class_plus_instance_wrapping_round_trip(how: str) -> None:
    # A decorated class whose instance is wrapped with its own policy, holding a wrapped submodule.
    torch.manual_seed(4)
    inner_store, outer_store = cpu_store(1024), cpu_store(0)
    m = RecomputeNet()
    torchckpt.checkpoint(m.layers[1], policy=Offload(inner_store))
    torchckpt.checkpoint(m, policy=Recompute(store=outer_store))
    x = torch.randn(4, 16)
    plain = MLP()
    plain.load_state_dict(m.state_dict())
    c = COPIES[how](m)
    assert isinstance(policy_of(c), Recompute) and isinstance(policy_of(c.layers[1]), Offload)
    check_store_copy(how, outer_store, policy_of(c).store)
    check_store_copy(how, inner_store, policy_of(c.layers[1]).store)
    ref = step(plain, plain, x)
    got = step(c, c, x)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert_same_grads(got[2], ref[2])
    assert policy_of(c.layers[1]).store.stats().offloaded > 0


def test_policy_with_a_store_pickles() -> None:
    # The policy alone (not only through a module): Offload and Recompute with a store.
    s = cpu_store(4096, min_bytes=16, prefetch=False)
    for policy in (Offload(s, codec=Identity()), Recompute(store=s, preserve_rng_state=False)):
        for how, fn in COPIES.items():
            p = fn(policy)
            assert type(p) is type(policy)
            check_store_copy(how, s, p.store)
    r = pickle.loads(pickle.dumps(Recompute(store=s, preserve_rng_state=False, determinism_check="none")))
    assert (r.preserve_rng_state, r.determinism_check) == (False, "none")
