"""plan, plans and auto on models whose forward changes state besides its outputs (NOTE [ Mutating forwards ]
Rules 5-6): transformers' ``use_cache`` is turned off for training forwards with a warning, as
``gradient_checkpointing_enable()`` does; any other block the profiling step sees change state is never
recomputed, with a warning. Gradients equal plain autograd's bit for bit, and no cache holds a token twice."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchckpt
from cache_models import (
    LLAMA_IDS, T, CacheNet, CountingBlock, batch, cache_of, grads, llama, llama_grads, same, toy,
)
from torchckpt.planner import plans

USE_CACHE = r"use_cache=False while torchckpt plans it"
CHANGES = r"changes state besides its outputs"


def _step(m: CacheNet, use_cache: bool | None = None) -> tuple[dict[str, torch.Tensor], list[int] | None]:
    m.zero_grad(set_to_none=True)
    out = m(batch(), use_cache=use_cache)
    out.loss.backward()
    return grads(m), out.cache.lengths() if out.cache is not None else None


def _floor(m: nn.Module, *args: object, **kwargs: object) -> torchckpt.planner.Plan:
    """The plan at the lowest peak the search reaches (every block recomputed where allowed)."""
    top = plans(m, *args, budgets=[1 << 50], **kwargs)[1 << 50]
    return torchckpt.plan(m, *args, budget=top.floor_bytes, **kwargs)


def test_plan_turns_use_cache_off_for_training_forwards() -> None:
    plain, m = toy()
    want, _ = _step(plain, use_cache=False)
    with pytest.warns(UserWarning, match=USE_CACHE):
        p = _floor(m, batch())
    assert p.revolve or any(b.mode == "recompute" for b in p.blocks), p.summary()
    applied = p.apply(m)
    try:
        for use_cache in (None, True):  # the config's default, and asked for: off in training, as transformers does
            got, lengths = _step(m, use_cache)
            assert lengths is None and same(got, want)
        with torch.no_grad():  # generation keeps its cache, filled once
            assert m(batch()).cache.lengths() == [T] * 4
        m.eval()  # evaluation with grad: the cache stays on, as transformers keeps it; a recomputed block refuses it
        with pytest.raises(torchckpt.CheckpointError, match="changed what it was called with"):
            m(batch())
        m.train()
    finally:
        applied.remove()
    assert _step(m)[1] == [T] * 4  # removed: the model as it was


def test_auto_turns_use_cache_off_for_training_forwards() -> None:
    plain, m = toy()
    with pytest.warns(UserWarning, match=USE_CACHE):
        top = plans(m, batch(), budgets=[1 << 50])[1 << 50]
    _, m = toy()
    a = torchckpt.auto(m, budget=top.floor_bytes)
    with pytest.warns(UserWarning, match=USE_CACHE):
        for step in range(2):
            want, _ = _step(plain, use_cache=False)
            got, lengths = _step(m)
            assert lengths is None and same(got, want), step
    assert a.plan is not None and (a.plan.revolve or any(b.mode == "recompute" for b in a.plan.blocks))
    a.remove()


def test_plan_never_recomputes_a_block_that_appends_to_a_cache_it_is_handed() -> None:
    plain, m = toy(config=False)  # no config.use_cache to turn off: the block itself is seen changing the cache
    want, want_len = _step(plain)
    with pytest.warns(UserWarning, match=CHANGES + r".*cache \(KVCache\)"):
        p = _floor(m, batch())
    assert not p.revolve and all(b.mode != "recompute" for b in p.blocks), p.summary()
    applied = p.apply(m)
    try:
        got, lengths = _step(m)
        assert lengths == want_len == [T] * 4 and same(got, want)
    finally:
        applied.remove()


def test_plan_never_recomputes_a_block_that_sets_its_attributes() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(*[CountingBlock() for _ in range(4)])
    x = torch.randn(8, 16, requires_grad=True)
    with pytest.warns(UserWarning, match=CHANGES + r".*calls \(int\)"):
        p = _floor(m, x)
    assert not p.revolve and all(b.mode != "recompute" for b in p.blocks), p.summary()
    counts = [b.calls for b in m]
    applied = p.apply(m)
    m(x).sum().backward()
    applied.remove()
    assert [b.calls for b in m] == [c + 1 for c in counts]  # one forward each: counted once


def test_profile_sees_no_change_in_plain_blocks() -> None:
    from ckpt_models import Block

    m = nn.Sequential(*[Block() for _ in range(3)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prof = torchckpt.planner.profile(m, (torch.randn(2, 8, 32),), {})
    assert prof.mutates == ("", "", "")
    with pytest.warns(UserWarning, match=CHANGES):  # and one that does change state, for contrast
        p = _floor(nn.Sequential(*[CountingBlock() for _ in range(3)]), torch.randn(4, 16))
    assert p.blocks


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_plan_on_llama_with_use_cache_recomputes_without_touching_the_cache(attn: str) -> None:
    plain, m = llama(attn)
    want = llama_grads(plain, use_cache=False)
    with pytest.warns(UserWarning, match=USE_CACHE):
        p = _floor(m, LLAMA_IDS, labels=LLAMA_IDS)
    assert p.revolve or any(b.mode == "recompute" for b in p.blocks), p.summary()
    assert p.blocks and all(b.mode == "recompute" for b in p.blocks)
    applied = p.apply(m)
    try:
        for step in range(2):
            m.zero_grad(set_to_none=True)
            out = m(LLAMA_IDS, labels=LLAMA_IDS)  # the config's default use_cache=True
            out.loss.backward()
            assert cache_of(out) is None, step
            assert same(grads(m), want), step
        with torch.no_grad():
            assert cache_of(m(LLAMA_IDS)).get_seq_length() == LLAMA_IDS.shape[1]
    finally:
        applied.remove()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_auto_on_llama_with_use_cache(attn: str) -> None:
    plain, m = llama(attn)
    with pytest.warns(UserWarning, match=USE_CACHE):
        top = plans(m, LLAMA_IDS, labels=LLAMA_IDS, budgets=[1 << 50])[1 << 50]
    _, m = llama(attn)
    a = torchckpt.auto(m, budget=top.floor_bytes)
    with pytest.warns(UserWarning, match=USE_CACHE):
        for step in range(2):
            want = llama_grads(plain, use_cache=False)
            m.zero_grad(set_to_none=True)
            out = m(LLAMA_IDS, labels=LLAMA_IDS)
            out.loss.backward()
            assert cache_of(out) is None and same(grads(m), want), step
    assert a.plan is not None and all(b.mode == "recompute" for b in a.plan.blocks), a.plan.summary()
    a.remove()
