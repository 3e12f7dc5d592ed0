"""Triton kernels of TritonQuant. Imported only when a CUDA tensor is compressed (imports triton).

Each kernel mirrors ``_quant_ref`` / ``_dequant_ref`` (quant.py) operation for operation, so the
packed bytes are identical (NOTE [ Block quantization ] Rule 6): IEEE division (``div_rn``),
no fused multiply-add (launched with ``enable_fp_fusion=False``), ``floor(v + 0.5)`` rounding.
"""
# mypy: ignore-errors
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def quant_kernel(x_ptr, codes_ptr, params_ptr, n, nblocks, bound, levels,
                 REL: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                 OUT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    offs = rows[:, None] * BLOCK + cols[None, :]
    valid = offs < n
    xf = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    finite = tl.abs(xf) < float("inf")
    use = valid & finite
    mn = tl.min(tl.where(use, xf, float("inf")), axis=1)
    mx = tl.max(tl.where(use, xf, -float("inf")), axis=1)
    mn = mn + 0.0  # -0.0 -> +0.0, as in the reference (Rule 6)
    rng = mx - mn
    lv = tl.full([ROWS], levels, tl.float32)
    step = tl.math.div_rn(rng, lv)
    safe = tl.where(step > 0.0, step, 1.0)
    q = tl.floor(tl.math.div_rn(xf - mn[:, None], tl.broadcast_to(safe[:, None], [ROWS, BLOCK])) + 0.5)
    q = tl.minimum(tl.maximum(q, 0.0), levels)
    q = tl.where(step[:, None] > 0.0, q, 0.0)
    xr = (mn[:, None] + q * step[:, None]).to(OUT).to(tl.float32)
    d = tl.abs(xr - xf)
    if REL:
        amax = tl.maximum(tl.abs(mn), tl.abs(mx))
        thr = (amax * bound) * 0.99999904632568359375  # 1 - 2**-20
    else:
        thr = tl.full([ROWS], bound, tl.float32)
    ok = ((d < thr[:, None]) | (d == 0.0)) & finite
    ok = ok | (valid == 0)
    raw = tl.min(ok.to(tl.int32), axis=1) == 0
    q = tl.where(raw[:, None] | (valid == 0), 0.0, q)
    qi = q.to(tl.int32)
    rmask = rows < nblocks
    tl.store(params_ptr + rows * 2, tl.where(raw, 0.0, mn), mask=rmask)
    tl.store(params_ptr + rows * 2 + 1, tl.where(raw, -1.0, step), mask=rmask)
    if BITS == 8:
        tl.store(codes_ptr + offs, qi.to(tl.uint8), mask=rmask[:, None])
    else:
        lo, hi = tl.split(tl.reshape(qi, [ROWS, BLOCK // 2, 2]))
        byte = (lo | (hi << 4)).to(tl.uint8)
        hcols = tl.arange(0, BLOCK // 2)
        tl.store(codes_ptr + rows[:, None] * (BLOCK // 2) + hcols[None, :], byte, mask=rmask[:, None])


@triton.jit
def dequant_kernel(codes_ptr, params_ptr, out_ptr, n, nblocks,
                   BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, OUT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < nblocks
    mn = tl.load(params_ptr + rows * 2, mask=rmask, other=0.0)
    step = tl.load(params_ptr + rows * 2 + 1, mask=rmask, other=-1.0)
    cols = tl.arange(0, BLOCK)
    offs = rows[:, None] * BLOCK + cols[None, :]
    if BITS == 8:
        q = tl.load(codes_ptr + offs, mask=rmask[:, None], other=0).to(tl.float32)
    else:
        hcols = tl.arange(0, BLOCK // 2)
        b = tl.load(codes_ptr + rows[:, None] * (BLOCK // 2) + hcols[None, :], mask=rmask[:, None], other=0)
        b = b.to(tl.int32)
        q = tl.reshape(tl.join(b & 15, b >> 4), [ROWS, BLOCK]).to(tl.float32)
    xr = (mn[:, None] + q * step[:, None]).to(OUT)
    tl.store(out_ptr + offs, xr, mask=(offs < n) & (step[:, None] >= 0.0))
