"""Recompute(save=...) on CUDA: what NOTE [ Selective recompute ] Rule 2 assumes of attention kernels, and exact gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import torchckpt
from torchckpt import Recompute

pytestmark = pytest.mark.cuda
aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def _qkv(dtype: torch.dtype) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(2, 4, 128, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_without_dropout_leaves_the_generator(backend: SDPBackend) -> None:
    """NOTE [ Selective recompute ] Rule 2 keeps a seeded attention kernel with dropout_p=0 because it draws nothing:
    the CUDA generator's offset does not move (with dropout it does, which shows the check can fail)."""
    q, k, v = _qkv(torch.bfloat16)
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    try:
        with sdpa_kernel([backend]):
            before = gen.get_offset()
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            assert gen.get_offset() == before
            F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
            assert gen.get_offset() != before
    except RuntimeError as e:
        if "No available kernel" in str(e):
            pytest.skip(f"{backend} not available here: {e}")
        raise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_attention_gives_plain_gradients(dtype: torch.dtype) -> None:
    """Attention kept, a dropout after it: the recomputation draws the forward's mask; gradients bit for bit."""
    q, k, v = _qkv(dtype)
    w = torch.randn(64, 64, device="cuda", dtype=dtype, requires_grad=True)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a = F.scaled_dot_product_attention(q @ w, k, v, is_causal=True)
        return F.dropout(a @ w, 0.3, training=True)

    def grads(run: object) -> list[torch.Tensor]:
        torch.manual_seed(3)
        out = run(q, k, v)  # type: ignore[operator]
        return list(torch.autograd.grad(out.float().square().sum(), [q, k, v, w]))

    keep = {getattr(aten, n).default for n in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                                              "_scaled_dot_product_cudnn_attention", "mm") if hasattr(aten, n)}
    ref = grads(f)
    got = grads(lambda *a: torchckpt.api.run(Recompute(save=keep), f, *a))
    assert all(torch.equal(x, y) for x, y in zip(ref, got))
