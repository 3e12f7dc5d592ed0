"""``Identity`` round trips every layout, tensors of one element or none with any strides among them (found by
tests/test_streams.py's random packs: ``torch.arange(2.0)[::2]`` is contiguous to torch yet has no byte view), and
the peer tier's byte view takes them too."""
from __future__ import annotations

import pytest
import torch

from torchckpt.codecs import Identity
from torchckpt.codecs.base import flat_bytes
from torchckpt.memory.peer_tier import _as_bytes


def layouts() -> list[torch.Tensor]:
    return [torch.empty(0), torch.empty(0)[::2], torch.empty(3, 0)[:, ::2], torch.empty(0, 4).t(),
            torch.arange(2.0)[::2], torch.arange(6.0).view(3, 2)[1:2, ::2], torch.arange(4.0).view(2, 2)[:1].t()[:1],
            torch.arange(12.0).view(3, 4).t(), torch.arange(10.0)[::3], torch.ones(5, dtype=torch.bfloat16)]


@pytest.mark.parametrize("x", layouts(), ids=lambda x: f"{tuple(x.shape)}/{x.stride()}")
def test_identity_round_trips_every_layout(x: torch.Tensor) -> None:
    c = Identity()
    p = c.compress(x)
    assert p.nbytes == x.numel() * x.element_size()
    y = c.decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype and torch.equal(y, x)
    out = torch.full((2 * x.numel() + 1,), 7, dtype=x.dtype)[: 2 * x.numel() : 2].view(x.shape) if x.numel() > 1 \
        else torch.full((2,), 7, dtype=x.dtype)[: 2 * x.numel() : 2].view(x.shape)  # one element or none, stride 2
    assert c.decompress(p, out=out) is out and torch.equal(out, x)


@pytest.mark.parametrize("x", layouts(), ids=lambda x: f"{tuple(x.shape)}/{x.stride()}")
def test_byte_views_of_every_layout(x: torch.Tensor) -> None:
    for b in (flat_bytes(x), _as_bytes(x)):
        assert b.dtype == torch.uint8 and b.dim() == 1 and b.numel() == x.numel() * x.element_size()
        assert torch.equal(b.view(x.dtype), x.reshape(-1))  # the same values, read through the bytes
