"""Triton kernels of TritonQuant. Imported only when a CUDA tensor is compressed (imports triton).

Each kernel mirrors ``_quant_ref`` / ``_dequant_ref`` (quant.py) operation for operation on every
block that is not raw, so the packed bytes are identical (NOTE [ Block quantization ] Rule 6):
IEEE division (``div_rn``) twice per block and none per element, no fused multiply-add
(launched with ``enable_fp_fusion=False``), rounding to nearest even as
``(v + 1.5 * 2**23) - 1.5 * 2**23``, fp32 -> e4m3 rounded to nearest even. Non-finite values
take part in the unmasked kernels' min/max, which only changes blocks that are raw anyway.

``raw_rows_kernel`` and ``put_raw_rows_kernel`` move ``compress_deferred``'s raw blocks to and from rows of their
own index, by the params' markers, with no count or rank (NOTE [ Block quantization ] Rule 5): bits as integers of
the element size, so NaN payloads survive.

Layout (NOTE [ Block quantization ] Rule 4): a program handles ``ROWS`` blocks. 4-bit codes pair element ``j`` of a block
with element ``j + BLOCK/2`` in one byte, so the kernels work on two contiguous half tiles and
never shuffle registers to pack or unpack. ``MASKED=False`` launches cover whole programs only
(no bounds checks); a second, masked launch starting at block ``row0`` takes the tail.
"""
# mypy: ignore-errors
from __future__ import annotations

import triton
import triton.language as tl

FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # 2**-126, the smallest normal fp32
DENORM_MIN = tl.constexpr(1.401298464324817e-45)  # 2**-149, the smallest positive fp32
E4M3_MAX = tl.constexpr(448.0)
ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2**23: r = t + ROUNDER holds rint(t) in its low bits
TWO23 = tl.constexpr(8388608.0)  # 2**23: bits(2**23) | q is 2**23 + q, for 0 <= q < 2**23
REL_SLACK = tl.constexpr(0.99999904632568359375)  # 1 - 2**-20 (NOTE [ Block quantization ] Rule 3)


@triton.jit
def _rows(row0, BIG: tl.constexpr, ROWS: tl.constexpr):
    if BIG:
        return row0 + tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    else:
        return row0 + tl.program_id(0) * ROWS + tl.arange(0, ROWS)


@triton.jit
def _load(ptr, offs, n, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        return tl.load(ptr + offs, eviction_policy="evict_first").to(tl.float32)


@triton.jit
def _stats(x, offs, n, FP8: tl.constexpr, MASKED: tl.constexpr):
    """Per row: (low, high): (min, max), or (0, max|x|) for e4m3.

    Unmasked tiles take every value: a NaN is skipped by min/max, an Inf can land in low or
    high, and either way the block is raw (see _encode), so only finite blocks' values count,
    as in the reference. Masked tiles leave out the padding.
    """
    if FP8:
        a = tl.abs(x)
        if MASKED:
            a = tl.where(offs < n, a, 0.0)
        return tl.zeros([x.shape[0]], tl.float32), tl.max(a, axis=1)
    else:
        if MASKED:
            v = offs < n
            return tl.min(tl.where(v, x, float("inf")), axis=1), tl.max(tl.where(v, x, -float("inf")), axis=1)
        else:
            return tl.min(x, axis=1), tl.max(x, axis=1)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _encode(x, offs, n, mn, step, inv, levels, FP8: tl.constexpr, OUT: tl.constexpr, MASKED: tl.constexpr):
    """(codes, per-row max |x - x'| with NaN propagated) for one tile (NOTE [ Block quantization ] Rules 1-2).

    A non-finite ``x`` always gives a NaN or Inf difference (Inf - x' is Inf or NaN), so
    its block fails the check in quant_kernel, whatever its low/high were.
    """
    if FP8:
        c = (x * inv[:, None]).to(tl.float8e4nv)  # |x * inv| <= 448 (1 + 2**-22): no clamp needed
        xr = (c.to(tl.float32) * step[:, None]).to(OUT).to(tl.float32)
        code = c.to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        # round to nearest (even) by adding 1.5 * 2**23: no conversion instruction (NOTE [ Block quantization ] Rule 1)
        r = (x - mn[:, None]) * inv[:, None] + ROUNDER
        q = r - ROUNDER
        xr = (mn[:, None] + q * step[:, None]).to(OUT).to(tl.float32)
        code = r.to(tl.int32, bitcast=True) & 255
    d = tl.abs(xr - x)
    if MASKED:
        d = tl.where(offs < n, d, 0.0)
    return code, tl.reduce(d, 1, _max_nan)


@triton.jit
def quant_kernel(x_ptr, codes_ptr, params_ptr, count_ptr, n, nblocks, bound, levels, row0,
                 REL: tl.constexpr, BITS: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr,
                 ROWS: tl.constexpr, OUT: tl.constexpr, MASKED: tl.constexpr, BIG: tl.constexpr):
    rows = _rows(row0, BIG, ROWS)
    if BITS == 4:
        H: tl.constexpr = BLOCK // 2
        cols = tl.arange(0, H)
        offa = rows[:, None] * BLOCK + cols[None, :]
        offb = offa + H
        xa = _load(x_ptr, offa, n, MASKED)
        xb = _load(x_ptr, offb, n, MASKED)
        lo_a, hi_a = _stats(xa, offa, n, FP8, MASKED)
        lo_b, hi_b = _stats(xb, offb, n, FP8, MASKED)
        lo = tl.minimum(lo_a, lo_b)
        hi = tl.maximum(hi_a, hi_b)
    else:
        cols = tl.arange(0, BLOCK)
        offa = rows[:, None] * BLOCK + cols[None, :]
        xa = _load(x_ptr, offa, n, MASKED)
        lo, hi = _stats(xa, offa, n, FP8, MASKED)
    if FP8:
        mn = lo
        amax = hi
        step = tl.maximum(tl.math.div_rn(amax, tl.full([ROWS], E4M3_MAX, tl.float32)), FLT_MIN)
    else:
        mn = lo + 0.0  # -0.0 -> +0.0, as in the reference (NOTE [ Block quantization ] Rule 6)
        amax = tl.maximum(tl.abs(mn), tl.abs(hi))
        step = tl.math.div_rn(hi - mn, tl.full([ROWS], levels, tl.float32))
    inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), tl.maximum(step, FLT_MIN))
    if REL:
        thr = (amax * bound) * REL_SLACK
    else:
        thr = tl.full([ROWS], bound, tl.float32)
    thr = tl.maximum(thr, DENORM_MIN)  # d < thr or d == 0 (NOTE [ Block quantization ] Rule 3), as one comparison
    ca, dmax = _encode(xa, offa, n, mn, step, inv, levels, FP8, OUT, MASKED)
    if BITS == 4:
        cb, dmax_b = _encode(xb, offb, n, mn, step, inv, levels, FP8, OUT, MASKED)
        dmax = _max_nan(dmax, dmax_b)
    raw = (dmax < thr) == 0  # NaN: raw
    if FP8:
        pv = tl.where(raw, -1.0, step)
    else:
        pv = tl.where(raw, 0.0, mn)
        ps = tl.where(raw, -1.0, step)
    # codes of raw blocks and of padding are 0 (NOTE [ Block quantization ] Rule 4)
    if MASKED:
        ca = tl.where(raw[:, None] | (offa >= n), 0, ca)
        if BITS == 4:
            cb = tl.where(raw[:, None] | (offb >= n), 0, cb)
    else:
        ca = tl.where(raw[:, None], 0, ca)
        if BITS == 4:
            cb = tl.where(raw[:, None], 0, cb)
    if BITS == 4:
        byte = (ca | (cb << 4)).to(tl.uint8)
        coffs = rows[:, None] * H + cols[None, :]
    else:
        byte = ca.to(tl.uint8)
        coffs = offa
    if MASKED:
        rmask = rows < nblocks
        tl.store(codes_ptr + coffs, byte, mask=rmask[:, None])
        if FP8:
            tl.store(params_ptr + rows, pv, mask=rmask)
        else:
            tl.store(params_ptr + rows * 2, pv, mask=rmask)
            tl.store(params_ptr + rows * 2 + 1, ps, mask=rmask)
    else:
        tl.store(codes_ptr + coffs, byte)
        if FP8:
            tl.store(params_ptr + rows, pv)
        else:
            tl.store(params_ptr + rows * 2, pv)
            tl.store(params_ptr + rows * 2 + 1, ps)
    nraw = tl.sum(raw.to(tl.int32), axis=0)
    tl.atomic_add(count_ptr, nraw, mask=nraw > 0)  # NOTE [ Block quantization ] Rule 5: one small read tells the host


@triton.jit
def _decode(q, mn, step, FP8: tl.constexpr, OUT: tl.constexpr):
    if FP8:
        return (q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * step[:, None]).to(OUT)
    else:
        qf = (q | 0x4B000000).to(tl.float32, bitcast=True) - TWO23  # float(q), no conversion instruction
        return (mn[:, None] + qf * step[:, None]).to(OUT)


@triton.jit
def dequant_kernel(codes_ptr, params_ptr, out_ptr, n, nblocks, row0,
                   BITS: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                   OUT: tl.constexpr, MASKED: tl.constexpr, BIG: tl.constexpr):
    rows = _rows(row0, BIG, ROWS)
    rmask = rows < nblocks
    if FP8:
        mn = tl.zeros([ROWS], tl.float32)
        step = tl.load(params_ptr + rows, mask=rmask, other=-1.0)
    else:
        mn = tl.load(params_ptr + rows * 2, mask=rmask, other=0.0)
        step = tl.load(params_ptr + rows * 2 + 1, mask=rmask, other=-1.0)
    keep = step >= 0.0
    if BITS == 4:
        H: tl.constexpr = BLOCK // 2
        cols = tl.arange(0, H)
        b = tl.load(codes_ptr + rows[:, None] * H + cols[None, :], mask=keep[:, None], other=0,
                    eviction_policy="evict_first").to(tl.int32)
        offa = rows[:, None] * BLOCK + cols[None, :]
        ya = _decode(b & 15, mn, step, FP8, OUT)
        yb = _decode(b >> 4, mn, step, FP8, OUT)
        if MASKED:
            tl.store(out_ptr + offa, ya, mask=keep[:, None] & (offa < n))
            tl.store(out_ptr + offa + H, yb, mask=keep[:, None] & (offa + H < n))
        else:
            tl.store(out_ptr + offa, ya, mask=keep[:, None])
            tl.store(out_ptr + offa + H, yb, mask=keep[:, None])
    else:
        cols = tl.arange(0, BLOCK)
        offa = rows[:, None] * BLOCK + cols[None, :]
        q = tl.load(codes_ptr + offa, mask=keep[:, None], other=0, eviction_policy="evict_first")
        if not FP8:
            q = q.to(tl.int32)
        y = _decode(q, mn, step, FP8, OUT)
        if MASKED:
            tl.store(out_ptr + offa, y, mask=keep[:, None] & (offa < n))
        else:
            tl.store(out_ptr + offa, y, mask=keep[:, None])


@triton.jit
def _raw_rows_at(params_ptr, nblocks, NPAR: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """This program's block rows, which of them are raw (params' marker < 0) and their elements' offsets: what
    ``raw_rows_kernel`` and ``put_raw_rows_kernel`` both walk."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < nblocks
    step = tl.load(params_ptr + rows * NPAR + (NPAR - 1), mask=rmask, other=0.0)
    raw = (step < 0.0) & rmask
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    return rows, raw, offs


@triton.jit
def raw_rows_kernel(x_ptr, params_ptr, raw_ptr, sizes_ptr, n, nblocks,
                    NPAR: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Copies each raw block (params' marker < 0) to its own row of ``raw`` (row ``i``: block ``i``; a partial last
    block padded with its last element); other rows are not written. The program holding the last block writes
    ``sizes[1]`` = whether it is raw."""
    rows, raw, offs = _raw_rows_at(params_ptr, nblocks, NPAR, BLOCK, ROWS)
    v = tl.load(x_ptr + tl.minimum(offs, n - 1), mask=raw[:, None])
    tl.store(raw_ptr + offs, v, mask=raw[:, None])
    last = rows == nblocks - 1
    tl.store(sizes_ptr + 1 + rows * 0, raw.to(tl.int64), mask=last)


@triton.jit
def put_raw_rows_kernel(raw_ptr, params_ptr, out_ptr, n, nblocks,
                        NPAR: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Writes each raw block's row of ``raw`` (row ``i``: block ``i``) back to its block of ``out`` (the padding of a
    partial last block left out); rows of other blocks are neither read nor written."""
    _, raw, offs = _raw_rows_at(params_ptr, nblocks, NPAR, BLOCK, ROWS)
    v = tl.load(raw_ptr + offs, mask=raw[:, None])
    tl.store(out_ptr + offs, v, mask=raw[:, None] & (offs < n))
