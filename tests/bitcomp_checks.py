"""Helpers of the Bitcomp tests, CPU and GPU (a plain module: tests/ is on sys.path; no hypothesis)."""
from __future__ import annotations

import torch

from torchckpt.codecs.bitcomp import Bitcomp

LOSSY = [torch.float16, torch.float32, torch.float64, torch.bfloat16]
LOSSLESS_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16, torch.int32,
                   torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn]
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers (NaN-safe equality)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    x = torch.randn(shape, dtype=torch.float64) * 100
    if dtype.is_complex:
        return torch.complex(x, -x / 3).to(dtype)
    if dtype == torch.bool:
        return x > 0
    return x.to(dtype)


def check_bound(c: Bitcomp, x: torch.Tensor, y: torch.Tensor) -> None:
    """NOTE [ Bitcomp ] Rules 3-5: finite elements within the guarantee, NaN and Inf bit-exact."""
    assert y.shape == x.shape and y.dtype == x.dtype
    bound = c.guarantee.bound
    assert bound is not None
    xf, yf = x.contiguous().reshape(-1), y.contiguous().reshape(-1)
    fin = torch.isfinite(xf)
    ity = INT_VIEW[x.element_size()]
    assert torch.equal(xf.view(ity)[~fin], yf.view(ity)[~fin]), "NaN or Inf did not come back bit-exact"
    assert torch.isfinite(yf[fin]).all(), "a finite value came back as NaN or Inf"
    d = (xf[fin].double() - yf[fin].double()).abs()
    bad = d > bound
    assert not bad.any(), (f"bound {bound} broken at {bad.nonzero()[:5].flatten().tolist()}: "
                           f"x={xf[fin][bad][:5].tolist()}, x'={yf[fin][bad][:5].tolist()}")
