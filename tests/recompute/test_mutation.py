"""Recompute and checkpoint_chain on blocks whose forward changes what it is called with (NOTE [ Mutating forwards ]
Rules 1-4): a clear ``torchckpt:`` error in the forward, never a cache holding tokens twice, a size mismatch inside
backward or a wrong gradient; Offload and Keep run the forward once and need no check."""
from __future__ import annotations

import enum
import functools
from typing import Any

import pytest
import torch

import torchckpt
from torchckpt.recompute.buffers import BufferGuard
from torchckpt.recompute.mutation import CallState, watched
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


class _Mode(enum.Enum):
    A = 1


FIXED_ROOTS = {  # NOTE [ Mutating forwards ] Rule 7: roots whose token depends on the object alone
    "tensor": lambda: torch.ones(2), "int": lambda: 3, "float nan": lambda: float("nan"), "str": lambda: "a",
    "None": lambda: None, "bool": lambda: True, "dtype": lambda: torch.float16, "device": lambda: torch.device("cpu"),
    "enum": lambda: _Mode.A, "module": lambda: torch.nn.Linear(2, 2), "function": lambda: _append,
    "builtin": lambda: len, "class": lambda: list, "partial": lambda: functools.partial(_append),
}
WALKED_ROOTS = {  # roots Rule 1 walks into: a change inside them is a change
    "list": lambda: [], "dict": lambda: {}, "set": lambda: set(), "tuple of a tensor": lambda: (torch.ones(2),),
    "object": lambda: _StaticCache(), "empty tuple": lambda: (),
}


@pytest.mark.parametrize("kind", list(FIXED_ROOTS) + list(WALKED_ROOTS))
@pytest.mark.parametrize("where", ["argument", "keyword", "bound argument", "bound keyword"])
def test_watched_skips_only_calls_whose_state_cannot_change(kind: str, where: str) -> None:
    """NOTE [ Mutating forwards ] Rule 7: ``watched`` is ``None`` exactly where every root is a tensor, a value or an
    object counted by identity, and there ``CallState.of`` has one token per root and nothing below it."""
    x = {**FIXED_ROOTS, **WALKED_ROOTS}[kind]()
    fn: Any = lambda *a, **k: None  # noqa: E731
    args: tuple[Any, ...] = (torch.ones(2),)
    kwargs: dict[str, Any] = {}
    if where == "argument":
        args += (x,)
    elif where == "keyword":
        kwargs["x"] = x
    elif where == "bound argument":
        fn = functools.partial(fn, x)
    else:
        fn = functools.partial(functools.partial(fn, y=1), x=x)
    for f in (fn, BufferGuard(fn, [], [])):  # the block as api.run hands it, or as checkpoint_chain guards it
        state = watched(f, args, kwargs)
        if kind in FIXED_ROOTS:
            assert state is None
            full = CallState.of(f, args, kwargs)
            assert len(full.before) == len(full.roots) and all(t[0] in ("value", "object") for t in full.before.values())
        else:
            assert isinstance(state, CallState) and state.changes() == []


def test_recompute_still_refuses_an_in_place_write_through_a_tuple() -> None:
    """A tuple is walked (NOTE [ Mutating forwards ] Rule 1), so Rule 7 does not skip it: a tensor inside it
    written in place is a change (NOTE [ Mutating forwards ] Rule 2)."""
    lin = torch.nn.Linear(4, 4)

    def block(x: torch.Tensor, pair: tuple[torch.Tensor, ...]) -> torch.Tensor:
        pair[0].add_(1)
        return lin(x) * pair[1]

    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(torchckpt.CheckpointError, match=r"argument 1 `pair` \(tuple\): argument 1\[0\]"):
        torchckpt.checkpoint(block, x, (torch.zeros(4), torch.ones(4)), policy=torchckpt.Recompute())
