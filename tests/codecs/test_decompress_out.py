"""``Codec.decompress(p, out=...)`` decodes in place (the contract NOTE [ Snapshot store ] Rule 11 relies on), CPU.

Every codec that runs here: the result is ``out`` itself, bit-identical to ``decompress(p)``; a contiguous
``out`` costs no allocation of its size (TritonQuant's CPU path is its PyTorch reference, which builds
temporaries: its in-place kernel is checked in tests/store/test_snapshot_restore_into_cuda.py); a
non-contiguous ``out`` is still right.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchckpt.codecs import ZFP, Bitcomp, Codec, Identity, TritonQuant


def _case(c: Codec, dtype: torch.dtype) -> Any:
    reason = None if isinstance(c, TritonQuant) else c.unavailable_reason()  # TritonQuant: the reference path runs here
    return pytest.param(c, dtype, marks=pytest.mark.skip(reason=reason)) if reason else (c, dtype)


CASES = [_case(Identity(), torch.float64), _case(TritonQuant(bits=8, mode="abs", bound=1e-3), torch.float32),
         _case(TritonQuant(bits=4, mode="rel", bound=0.1), torch.bfloat16), _case(Bitcomp(), torch.float32),
         _case(Bitcomp(delta=1e-3), torch.float32), _case(Bitcomp(delta=1e-3), torch.bfloat16),
         _case(ZFP(rate=12), torch.float32)]


class _Allocs(TorchDispatchMode):
    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes, self.n = nbytes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__.startswith("empty") and out.numel() * out.element_size() >= self.nbytes:
            self.n += 1
        return out


@pytest.mark.parametrize("codec,dtype", CASES, ids=lambda v: repr(v))
def test_decompress_into_out(codec: Codec, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.cumsum(torch.randn(64, 32, 32, generator=g), 2).to(dtype)
    x.view(-1)[::1001] = float("nan") if not isinstance(codec, ZFP) else 0.0
    p = codec.compress(x)
    want = codec.decompress(p)
    out = torch.full_like(x, 3.0)
    ptr = out.data_ptr()
    with _Allocs(out.numel() * out.element_size() // 2) as a:
        got = codec.decompress(p, out=out)
    assert got is out and out.data_ptr() == ptr
    assert torch.equal(out.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
    if isinstance(codec, Bitcomp) and codec.guarantee.kind != "lossless" and dtype == torch.bfloat16:
        assert a.n == 1  # lossy bf16 decodes through fp32 (NOTE [ Bitcomp ] Rule 5)
    elif not isinstance(codec, TritonQuant):
        assert a.n == 0
    strided = torch.full((32, 32, 64), 3.0, dtype=dtype).transpose(0, 2)  # not contiguous: a temporary, then a copy
    assert codec.decompress(p, out=strided) is strided
    assert torch.equal(strided.contiguous().view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
