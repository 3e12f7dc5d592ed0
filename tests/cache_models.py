"""Models whose forward changes state besides its outputs (NOTE [ Mutating forwards ]): a toy KV cache, a block
that counts its calls, and a transformers Llama built tiny from a config (tests/recompute/test_mutation.py,
tests/planner/test_mutation.py)."""
from __future__ import annotations

import copy
import dataclasses
import math
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

D, T = 16, 6  # width and tokens of the toy models


class KVCache:
    """A toy of transformers' ``DynamicCache``: per layer the keys and values seen so far; ``update`` appends the
    new ones and returns all of them, as attention reads them."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []

    def update(self, k: torch.Tensor, v: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.keys) <= i:
            self.keys.append(None)
            self.values.append(None)
        old_k, old_v = self.keys[i], self.values[i]
        self.keys[i] = k if old_k is None else torch.cat([old_k, k], dim=1)
        self.values[i] = v if old_v is None else torch.cat([old_v, v], dim=1)
        return self.keys[i], self.values[i]  # type: ignore[return-value]

    def lengths(self) -> list[int]:
        return [0 if k is None else k.shape[1] for k in self.keys]


class CacheBlock(nn.Module):
    """Causal attention over the cache and an MLP. The mask is made for the call's own tokens, as eager attention
    makes it: attention over keys appended twice fails with a size mismatch."""

    def __init__(self, i: int, d: int = D) -> None:
        super().__init__()
        self.i = i
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        if cache is not None:
            k, v = cache.update(k, v, self.i)
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf"), device=x.device).triu(1)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask, dim=-1) @ v
        x = x + self.o(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


@dataclasses.dataclass
class Out:
    loss: torch.Tensor
    cache: KVCache | None


class CacheNet(nn.Module):
    """A model that makes a cache when ``use_cache`` (by default ``config.use_cache``, as transformers' models do)
    and hands it to every block. ``config=False``: no config, and a cache on every call."""

    def __init__(self, n: int = 4, config: bool = True) -> None:
        super().__init__()
        if config:
            self.config = types.SimpleNamespace(use_cache=True)
        self.blocks = nn.ModuleList(CacheBlock(i) for i in range(n))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, use_cache: bool | None = None) -> Out:
        cfg = getattr(self, "config", None)
        if use_cache is None:
            use_cache = cfg.use_cache if cfg is not None else True
        cache = KVCache() if use_cache else None
        for b in self.blocks:
            x = b(x, cache=cache)
        return Out(self.head(x).square().mean(), cache)


class CountingBlock(nn.Module):
    """A block that counts its calls in an attribute: a recomputation would count twice."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.fc2(torch.tanh(self.fc1(x)))


def batch(seed: int = 3) -> torch.Tensor:
    return torch.randn(2, T, D, generator=torch.Generator().manual_seed(seed))


def toy(n: int = 4, config: bool = True) -> tuple[CacheNet, CacheNet]:
    """Two copies of one ``CacheNet``: one to run plainly, one to checkpoint."""
    torch.manual_seed(0)
    m = CacheNet(n, config)
    return m, copy.deepcopy(m)


def grads(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- transformers' Llama ----------------------------------------------------------------------------------------
LLAMA_IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(6))


def llama(attn: str) -> tuple[nn.Module, nn.Module]:
    """Two copies of one tiny ``LlamaForCausalLM`` (random weights, the config's default ``use_cache=True``), in
    training mode."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation=attn)
    assert cfg.use_cache
    m = transformers.LlamaForCausalLM(cfg).train()
    return m, copy.deepcopy(m)


def cache_of(out: Any) -> Any:
    """The cache a transformers output holds (``cache``, ``past_key_values`` before transformers 5), or ``None``."""
    return getattr(out, "cache", None) if hasattr(out, "cache") else getattr(out, "past_key_values", None)


def llama_grads(m: nn.Module, use_cache: bool | None = None) -> dict[str, torch.Tensor]:
    """One step's gradients (``use_cache=None``: as the config says); ``.grad`` is cleared first."""
    m.zero_grad(set_to_none=True)
    kw = {} if use_cache is None else {"use_cache": use_cache}
    m(LLAMA_IDS, labels=LLAMA_IDS, **kw).loss.backward()
    return grads(m)
