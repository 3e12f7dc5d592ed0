"""Recompute and checkpoint_chain on blocks whose forward changes what it is called with (NOTE [ Mutating forwards ]
Rules 1-4): a clear ``torchckpt:`` error in the forward, never a cache holding tokens twice, a size mismatch inside
backward or a wrong gradient; Offload and Keep run the forward once and need no check."""
from __future__ import annotations

import pytest
import torch

import torchckpt
from cache_models import (
    LLAMA_IDS, T, CacheNet, batch, cache_of, grads, llama, llama_grads, same, toy,
)
from ckpt_models import cpu_store

POLICIES = {
    "Recompute()": lambda: torchckpt.Recompute(),
    "Recompute(save=mm)": lambda: torchckpt.Recompute(save={torch.ops.aten.mm.default}),
    "Recompute(store)": lambda: torchckpt.Recompute(store=cpu_store(0)),
    "Recompute(parts)": lambda: torchckpt.Recompute(parts=(2,)),
}


def _step(m: CacheNet, use_cache: bool | None = None) -> tuple[dict[str, torch.Tensor], list[int] | None]:
    m.zero_grad(set_to_none=True)
    out = m(batch(), use_cache=use_cache)
    out.loss.backward()
    return grads(m), out.cache.lengths() if out.cache is not None else None


@pytest.mark.parametrize("policy", list(POLICIES))
def test_recompute_refuses_a_block_that_appends_to_its_cache(policy: str) -> None:
    plain, m = toy()
    for b in m.blocks:
        torchckpt.checkpoint(b, policy=POLICIES[policy]())
    x = batch()
    with pytest.raises(torchckpt.CheckpointError, match=r"torchckpt: a block \(CacheBlock\) under Recompute\(\) changed "
                                                        r"what it was called with.*cache \(KVCache\)"):
        m(x)
    # Without the cache the same blocks recompute, bit for bit.
    want, _ = _step(plain, use_cache=False)
    got, lengths = _step(m, use_cache=False)
    assert lengths is None and same(got, want)


def test_checkpoint_chain_refuses_a_block_that_appends_to_its_cache() -> None:
    plain, m = toy()
    chain = torchckpt.checkpoint_chain(list(m.blocks), snapshots=2)
    with pytest.raises(torchckpt.CheckpointError, match="changed what it was called with"):
        m(batch())
    want, _ = _step(plain, use_cache=False)
    got, _ = _step(m, use_cache=False)
    assert same(got, want) and chain.stats.advances > 0
    chain.remove()


class _StaticCache:
    """A preallocated cache written in place, as transformers' ``StaticCache`` is."""

    def __init__(self) -> None:
        self.keys = torch.zeros(3, 4)


def _append(y: torch.Tensor, into: object) -> None:
    into.append(y)  # type: ignore[attr-defined]


def _set_key(y: torch.Tensor, into: object) -> None:
    into[len(into)] = y  # type: ignore[index]


def _write(y: torch.Tensor, into: object) -> None:
    into.keys.copy_(y.detach())  # type: ignore[attr-defined]


CHANGES = {  # what the block changes, what it is handed, how the message names it
    "list.append": (_append, list, r"argument 1 `log` \(list\)"),
    "dict[key] =": (_set_key, dict, r"argument 1 `log` \(dict\)"),
    "in-place write": (_write, _StaticCache, r"argument 1 `log` \(_StaticCache\): argument 1.keys"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_recompute_refuses_a_block_that_changes_an_argument(change: str) -> None:
    update, kind, named = CHANGES[change]
    lin = torch.nn.Linear(4, 4)
    log = kind()

    def block(x: torch.Tensor, log: object) -> torch.Tensor:
        y = lin(x).tanh()
        update(y, log)
        return y

    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(torchckpt.CheckpointError, match=r"a block \(.*block\) under Recompute\(\) changed what it was "
                                                        r"called with during its forward: " + named):
        torchckpt.checkpoint(block, x, log, policy=torchckpt.Recompute())
    # Offload and Keep run it once, as without torchckpt: no error.
    for policy in (torchckpt.Offload(cpu_store(0)), torchckpt.Keep()):
        torchckpt.checkpoint(block, x, log, policy=policy).sum().backward()
    if change != "in-place write":
        assert len(log) == 3  # type: ignore[arg-type]


def test_offload_and_keep_leave_the_cache_as_plain_autograd_does() -> None:
    plain, _ = toy()
    want, want_len = _step(plain)
    for policy in (torchckpt.Offload(cpu_store(0)), torchckpt.Keep(), torchckpt.Recompute()):
        _, m = toy()
        for b in m.blocks:
            torchckpt.checkpoint(b, policy=policy)
        if isinstance(policy, torchckpt.Recompute):  # NOTE [ Mutating forwards ] Rule 2: refused in the forward
            with pytest.raises(torchckpt.CheckpointError):
                _step(m)
            continue
        got, lengths = _step(m)
        assert same(got, want) and lengths == want_len == [T] * 4


def test_recompute_checks_only_what_a_backward_could_recompute() -> None:
    _, m = toy()
    for b in m.blocks:
        torchckpt.checkpoint(b, policy=torchckpt.Recompute())
    with torch.no_grad():  # generation: no policy runs, the cache fills once
        assert m(batch()).cache.lengths() == [T] * 4
    for p in m.parameters():  # nothing requires grad: no backward, no recomputation to refuse
        p.requires_grad_(False)
    assert m(batch()).cache.lengths() == [T] * 4
    for p in m.parameters():
        p.requires_grad_(True)
    with pytest.raises(torchckpt.CheckpointError):
        m(batch())


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_recompute_on_llama_layers_with_use_cache_raises_in_the_forward(attn: str) -> None:
    plain, m = llama(attn)
    for layer in m.model.layers:
        torchckpt.checkpoint(layer, policy=torchckpt.Recompute())
    with pytest.raises(torchckpt.CheckpointError, match=r"LlamaDecoderLayer.*DynamicCache.*use_cache=False"):
        m(LLAMA_IDS, labels=LLAMA_IDS)  # the config's default use_cache=True
    assert same(llama_grads(m, use_cache=False), llama_grads(plain, use_cache=False))
    with torch.no_grad():  # generation keeps the cache, filled once
        assert cache_of(m(LLAMA_IDS)).get_seq_length() == LLAMA_IDS.shape[1]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_checkpoint_chain_on_llama_layers_with_use_cache_raises_in_the_forward(attn: str) -> None:
    plain, m = llama(attn)
    chain = torchckpt.checkpoint_chain(list(m.model.layers), snapshots=2)
    with pytest.raises(torchckpt.CheckpointError, match="use_cache=False"):
        m(LLAMA_IDS, labels=LLAMA_IDS)
    assert same(llama_grads(m, use_cache=False), llama_grads(plain, use_cache=False))
    assert chain.stats.advances > 0
    chain.remove()
