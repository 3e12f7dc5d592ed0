"""TritonQuant: block-wise quantization (8-bit, 4-bit or fp8 e4m3 codes) with a per-element error bound.

# NOTE [ Block quantization ]
# 1. The flattened tensor is cut into blocks of ``block`` elements (the last one padded).
#    All arithmetic is fp32. Per block, over its finite values:
#    - ``fmt="int"`` (the default): ``mn``, ``mx``, ``step = (mx - mn) / L`` with
#      ``L = 2**bits - 1`` and ``inv = 1 / max(step, 2**-126)`` (two IEEE divisions per
#      block, none per element); codes ``q = ((x - mn) * inv + R) - R`` with ``R = 1.5 * 2**23``
#      (round to nearest, half to even, without a conversion instruction), decoded as
#      ``x' = (mn + q * step)`` rounded to the tensor's dtype. In a finite block
#      ``(x - mn) * inv <= L (1 + 2**-22)``, so ``0 <= q <= L`` without a clamp.
#    - ``fmt="e4m3"`` (8 bits): ``scale = max(max|x| / 448, 2**-126)``, ``inv = 1 / scale``;
#      codes ``c = e4m3(x * inv)`` (round to nearest even; ``|x * inv| <= 448 (1 + 2**-22)``
#      in a finite block, so no code saturates), decoded as ``x' = (float(c) * scale)``
#      rounded to the dtype.
#    ``inv`` is finite for every finite block, so no code is NaN; rounding ``x * inv`` may
#    differ from ``x / step`` by an ulp, which only moves an element's error, and Rule 2
#    checks the error.
# 2. The bound holds by construction because it is checked at compression: each element's
#    ``x'`` is computed exactly as decompress computes it and compared with ``x``. A block is
#    kept *raw* (its original bits, stored apart) when any element fails, when it holds a
#    NaN or an Inf, or when its range overflows fp32. So every element either comes back
#    bit-exact or meets the bound; NaN and Inf always survive (bit-exact, payload included).
# 3. ``mode="abs"``: ``|x - x'| < b`` where ``b`` is the largest fp32 <= ``bound``.
#    ``mode="rel"``: ``|x - x'| < b * max|x|`` over the element's block (the threshold is
#    computed in fp32 and lowered by 2**-20 relative, which covers its own rounding for
#    normal numbers). Exact reconstructions (``x' == x``, e.g. constant or all-zero blocks)
#    always pass. A quantized -0.0 may come back as +0.0 (numerically equal).
# 4. The packed form is four uint8 buffers: codes (``bits/8`` bytes per element, padded to
#    whole blocks; 4-bit codes put element ``j`` of a block in the low nibble of byte ``j``
#    and element ``j + block/2`` in its high nibble; codes of raw blocks and padding are 0),
#    params (fp32 per block: ``mn, step`` for ``"int"``, ``scale`` for ``"e4m3"``; a
#    negative ``step``/``scale`` (-1) marks a raw block), the int32 indices of raw blocks,
#    and those blocks' original bytes. With no raw blocks, fp32 is 264 bytes per 1024 at 8
#    bits (3.88x), 136 at 4 bits (7.53x) and 260 in e4m3 (3.94x) at block=256.
# 5. How many blocks are raw is known only after the kernel ran: the kernel adds its raw
#    blocks to a device counter. ``compress`` sizes its buffers exactly, so it reads that one
#    int32 back (one D2H copy into pinned memory, then an event wait: NOTE [ Codec streams ]
#    Rule 3); the compaction of raw blocks (``nonzero``, a gather) runs only when the count is
#    non-zero. ``compress_deferred`` reads nothing back and ranks nothing: each raw block's
#    bytes go to its own row (row ``i`` for block ``i``, a partial last block padded as
#    ``compress`` pads it) of a buffer with room for every block, the other rows unwritten,
#    and the params' markers say which rows hold a block (one Triton kernel after the
#    quantizer, which copies the raw blocks only; the reference copies every block). Its
#    ``sizes`` are ``[count, whether the last block is raw]`` (int64 on the device: the
#    quantizer's counter adds into the low word of ``sizes[0]``, the copy writes ``sizes[1]``),
#    and ``meta.params["raw_blocks"]`` is ``sizes[:1]``, a tensor: the mark of this form, which
#    ``decompress`` decodes as it is (the raw rows put back by their markers, on the device).
#    ``settle`` gives ``compress``'s Packed byte for byte: with no raw block, empty buffers and no
#    device work; otherwise the raw rows gathered in block order (a ``cumsum`` of the markers
#    and two index copies on the device, none read back). Until then the raw buffer takes as
#    much memory as the tensor. Blocks whose range needs more than ``L``
#    steps of ``2 * bound`` (or, in e4m3, whose elements' rounding errors exceed it) end up
#    raw: on such data the ratio falls towards 1, the bound never breaks.
# 6. The Triton kernels (_quant_triton.py) and the PyTorch reference (``_quant_ref``,
#    ``_dequant_ref``) do the same fp32 operations in the same order on every block that is
#    not raw, with IEEE division and no fused multiply-add, so their packed bytes are
#    identical (a raw block's intermediates may differ, e.g. the kernel does not filter
#    non-finite values out of min/max; its stored bytes are fixed: codes 0, marker -1).
#    Raw blocks and everything after the kernel are shared PyTorch code.
# 7. ``compress_deferred``'s raw-row buffer has room for every block: no bound below that follows
#    from the parameters, since any block may be raw (a NaN or an Inf, or a range wider than ``L``
#    steps of ``2 * bound``: data, not settings). So it is not allocated per call but lent by the
#    codec's ``scratch`` (NOTE [ Codec streams ] Rule 5; the snapshot store gives it back once
#    settled, NOTE [ Snapshot sizes ] Rule 8), and a buffer lent again still holds an earlier
#    tensor's rows where this one's blocks are not raw. No result reads them: ``decompress`` and
#    ``settle`` read a row only where its block's marker says raw (the Triton kernels mask by it, the
#    reference chooses by it, ``settle`` gathers the marked rows), and the reference writes every
#    row. So the bytes and bits are those of a fresh buffer's.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import math
import types
from collections.abc import Sequence
from typing import Any

import torch

from torchckpt._errors import internal_error
from torchckpt.codecs._launch import Launch
from torchckpt.codecs.base import Codec, Deferred, Guarantee, Meta, Packed, Scratch, on_stream

_log = logging.getLogger("torchckpt")

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FMTS = ("int", "e4m3")
_REL_SLACK = 1.0 - 2.0**-20  # see NOTE [ Block quantization ] Rule 3
_FLT_MIN = 2.0**-126  # see NOTE [ Block quantization ] Rule 1
_DENORM_MIN = 2.0**-149  # the smallest positive fp32
_ROUNDER = 1.5 * 2.0**23  # t + 1.5 * 2**23 in fp32 rounds t to an integer, half to even (NOTE [ Block quantization ] Rule 1)
_E4M3_MAX = 448.0
# Triton launch shapes, (blocks per program, warps) for compress and for decompress, per
# (element size, codes): the fastest measured (benchmarks/quant_throughput.py). Every shape
# gives the same bytes; only the speed depends on it.
_CFG: dict[tuple[int, str], tuple[int, int, int, int]] = {
    (4, "int8"): (8, 8, 4, 4), (4, "int4"): (8, 8, 8, 8), (4, "e4m3"): (8, 8, 8, 8),
    (2, "int8"): (8, 4, 16, 8), (2, "int4"): (16, 4, 16, 8), (2, "e4m3"): (8, 4, 16, 8),
}


def _fp32_at_most(v: float) -> float:
    """The largest fp32 value <= ``v``."""
    f = torch.tensor(v, dtype=torch.float64).float()
    if float(f) > v:
        f = torch.nextafter(f, torch.tensor(-math.inf))
    return float(f)


def _pad_blocks(flat: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(nblocks, block)`` view of ``flat`` padded with its last element, and the valid mask."""
    n = flat.numel()
    nb = -(-n // block)
    xf = flat.float()
    pad = nb * block - n
    if pad:
        xf = torch.cat([xf, xf[-1:].expand(pad)])
    valid = (torch.arange(nb * block, device=flat.device) < n).view(nb, block)
    return xf.view(nb, block), valid


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def _quant_ref(flat: torch.Tensor, bits: int, block: int, rel: bool, bound: float,
               fmt: str = "int") -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantizer (CPU or CUDA): ``(codes uint8, params fp32 (nblocks, 2 or 1))`` per
    NOTE [ Block quantization ] Rules 1-4."""
    dev = flat.device
    npar = 1 if fmt == "e4m3" else 2
    nb = -(-flat.numel() // block)
    if nb == 0:
        return torch.empty(0, dtype=torch.uint8, device=dev), torch.empty(0, npar, dtype=torch.float32, device=dev)
    xb, valid = _pad_blocks(flat, block)
    finite = torch.isfinite(xb)
    one = _f32(1.0, xb)
    if fmt == "e4m3":
        amax = torch.where(finite, xb.abs(), torch.zeros_like(xb)).amax(1)
        step = torch.maximum(amax / _f32(_E4M3_MAX, xb).expand_as(amax), _f32(_FLT_MIN, xb))
        mn = torch.zeros_like(amax)
        inv = one.expand_as(step) / step
        c = (xb * inv[:, None]).to(torch.float8_e4m3fn)  # finite blocks: |x * inv| <= 448 (1 + 2**-22)
        xr = (c.float() * step[:, None]).to(flat.dtype).float()
        q = c.view(torch.uint8)
    else:
        levels = _f32(float(2**bits - 1), xb)
        inf = torch.tensor(math.inf, device=dev)
        mn = torch.where(finite, xb, inf).amin(1)
        mx = torch.where(finite, xb, -inf).amax(1)
        mn = mn + torch.zeros((), device=dev)
        amax = torch.maximum(mn.abs(), mx.abs())
        step = (mx - mn) / levels.expand_as(mn)
        inv = one.expand_as(step) / torch.maximum(step, _f32(_FLT_MIN, xb))
        rounder = _f32(_ROUNDER, xb)
        r = (xb - mn[:, None]) * inv[:, None] + rounder  # rint by adding 1.5 * 2**23 (NOTE [ Block quantization ] Rule 1)
        qf = r - rounder
        xr = (mn[:, None] + qf * step[:, None]).to(flat.dtype).float()
        q = qf
    # NOTE [ Block quantization ] Rules 2-3: the block passes when every valid element has d < thr or d == 0, i.e. when
    # max(d) (NaN propagated: non-finite x) < max(thr, 2**-149)
    d = torch.where(valid, (xr - xb).abs(), torch.zeros_like(xb))
    b = _f32(bound, xb)
    thr = (amax * b) * _f32(_REL_SLACK, xb) if rel else b.expand_as(mn)
    thr = torch.maximum(thr, _f32(_DENORM_MIN, xb))
    raw = ~(d.amax(1) < thr) | ~finite.all(1)
    q = torch.where(raw[:, None] | ~valid, torch.zeros_like(q), q)
    qi = q.to(torch.uint8)
    if fmt == "e4m3":
        params = torch.where(raw, torch.full_like(step, -1.0), step)[:, None]
    else:
        params = torch.stack([torch.where(raw, torch.zeros_like(mn), mn),
                              torch.where(raw, torch.full_like(step, -1.0), step)], 1)
    if bits == 4:
        qi = qi.view(nb, 2, block // 2)
        qi = qi[:, 0] | (qi[:, 1] << 4)
    return qi.reshape(-1), params


def _dequant_ref(codes: torch.Tensor, params: torch.Tensor, out_flat: torch.Tensor, bits: int, block: int,
                 fmt: str = "int") -> None:
    """Reference decoder: writes every non-raw block of ``out_flat`` (raw ones are left as they are)."""
    n = out_flat.numel()
    nb = params.shape[0]
    if nb == 0:
        return
    if bits == 4:
        c = codes.view(nb, block // 2)
        q = torch.cat([c & 15, c >> 4], 1)
    else:
        q = codes.view(nb, block)
    step = params[:, -1]
    if fmt == "e4m3":
        xr = q.view(torch.float8_e4m3fn).float() * step[:, None]
    else:
        xr = params[:, 0, None] + q.float() * step[:, None]
    xr = xr.to(out_flat.dtype).reshape(-1)[:n]
    keep = (step >= 0)[:, None].expand(nb, block).reshape(-1)[:n]
    out_flat.copy_(torch.where(keep, xr, out_flat))


@functools.lru_cache(maxsize=None)
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None  # costs tens of microseconds: asked once


def _triton_reason() -> str | None:
    if not _has_triton():
        return "TritonQuant's GPU kernels need triton: pip install triton (the PyTorch reference path still runs)."
    if not torch.cuda.is_available():
        return ("TritonQuant's GPU kernels need a CUDA device, and torch.cuda.is_available() is False "
                "(CPU tensors use the PyTorch reference path).")
    return None


@functools.lru_cache(maxsize=None)
def _fast(kernel: Any) -> Launch:
    """``kernel``'s launches through its compiled kernels (NOTE [ Kernel launches ])."""
    return Launch(kernel)


def _launch(kernel: Any, n: int, nb: int, B: int, rows: int, args: tuple[Any, ...], **kw: Any) -> None:
    """Launch ``kernel`` unmasked over whole programs, then masked over the tail (_quant_triton.py)."""
    big = (nb + rows) * B >= 2**31
    full = n // (rows * B)
    go = _fast(kernel)
    if full:
        go((full,), *args, 0, MASKED=False, BIG=big, **kw)
    rest = nb - full * rows
    if rest > 0:
        go((-(-rest // rows),), *args, full * rows, MASKED=True, BIG=big, **kw)


class TritonQuant(Codec):
    """Block-wise quantization to 8-bit, 4-bit or fp8 e4m3 codes with an error bound that holds by construction.

    NOTE [ Block quantization ] says exactly what is guaranteed and how.

    Args:
        bits: 8 or 4 bits per element (``fmt="e4m3"`` needs 8).
        mode: ``"abs"`` (``|x - x'| <= bound``) or ``"rel"`` (``|x - x'| <= bound * max|x|``
            over the element's block).
        bound: the error bound, finite and > 0.
        block: elements per block (a power of two, 64 to 4096).
        use_triton: ``None`` uses the Triton kernels for CUDA tensors when triton imports,
            ``False`` always the PyTorch reference (same bytes, slower).
        fmt: ``"int"`` (default): uniform integer codes between the block's min and max;
            ``"e4m3"``: fp8 e4m3 codes scaled so that the block's max|x| maps to 448
            (finer near zero, coarser near the max: relative error of the codes up to 2**-4,
            so it suits looser bounds than ``"int"`` at the same 8 bits).

    Example::

        >>> c = TritonQuant(bits=8, mode="abs", bound=1e-2)
        >>> x = torch.linspace(-1, 1, 1000)
        >>> p = c.compress(x)
        >>> round(p.ratio, 2), bool((c.decompress(p) - x).abs().max() <= 1e-2)
        (3.79, True)
        >>> e = TritonQuant(bits=8, mode="rel", bound=0.05, fmt="e4m3")
        >>> p = e.compress(x)
        >>> round(p.ratio, 2), p.meta.params["raw_blocks"]
        (3.85, 0)
    """

    name = "triton_quant"
    dtypes = _DTYPES  # Codec.supports: the store sends other dtypes uncompressed
    scratch: Scratch  # compress_deferred's raw rows, lent (NOTE [ Block quantization ] Rule 7)

    def __init__(self, bits: int = 8, mode: str = "abs", bound: float = 1e-3, block: int = 256,
                 use_triton: bool | None = None, fmt: str = "int") -> None:
        if bits not in (4, 8) or isinstance(bits, bool):
            raise ValueError(f"torchckpt: TritonQuant bits must be 8 or 4, got {bits!r}.")
        if mode not in ("abs", "rel"):
            raise ValueError(f"torchckpt: TritonQuant mode must be 'abs' or 'rel', got {mode!r}.")
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not (0 < bound < math.inf):
            raise ValueError(f"torchckpt: TritonQuant bound must be a finite number > 0, got {bound!r}; "
                             "for a lossless copy use Identity().")
        if not isinstance(block, int) or block < 64 or block > 4096 or block & (block - 1):
            raise ValueError(f"torchckpt: TritonQuant block must be a power of two from 64 to 4096, got {block!r}.")
        if fmt not in _FMTS:
            raise ValueError(f"torchckpt: TritonQuant fmt must be 'int' or 'e4m3', got {fmt!r}.")
        if fmt == "e4m3" and bits != 8:
            raise ValueError(f"torchckpt: TritonQuant fmt='e4m3' stores 8-bit codes, got bits={bits!r}; "
                             "pass bits=8, or fmt='int' for 4-bit codes.")
        b32 = _fp32_at_most(float(bound))
        if b32 <= 0:
            raise ValueError(f"torchckpt: TritonQuant bound {bound!r} is below the smallest fp32; pass a larger bound.")
        self.bits = bits
        self.mode = mode
        self.bound = float(bound)
        self.block = block
        self.use_triton = use_triton
        self.fmt = fmt
        self._b32 = b32
        self.scratch = Scratch()

    def __repr__(self) -> str:
        f = f", fmt={self.fmt!r}" if self.fmt != "int" else ""
        return f"TritonQuant(bits={self.bits}, mode={self.mode!r}, bound={self.bound!r}, block={self.block}{f})"

    @property
    def guarantee(self) -> Guarantee:
        return Guarantee(self.mode, self.bound, self.block if self.mode == "rel" else None)

    def unavailable_reason(self) -> str | None:
        """What the GPU path lacks here (``None``: Triton kernels run). The reference path always runs."""
        return _triton_reason()

    def capturable(self, device: torch.device) -> bool:
        """On CUDA with triton, ``compress_deferred`` is kernels only (NOTE [ Captured saves ])."""
        return self._triton(device)

    def _triton(self, device: torch.device) -> bool:
        if device.type != "cuda" or self.use_triton is False:
            return False
        reason = _triton_reason()
        if reason is not None:
            if self.use_triton:
                raise ValueError(f"torchckpt: TritonQuant(use_triton=True): {reason} Pass use_triton=None.")
            _log.debug("TritonQuant falls back to the reference path: %s", reason)
            return False
        return True

    def _config(self, dtype: torch.dtype) -> tuple[int, int, int, int]:
        codes = "e4m3" if self.fmt == "e4m3" else f"int{self.bits}"
        return _CFG[(min(dtype.itemsize, 4), codes)]

    def _check_input(self, x: object) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"torchckpt: TritonQuant.compress needs a torch.Tensor, got {type(x).__name__}.")
        if x.dtype not in _DTYPES:
            raise TypeError(
                f"torchckpt: TritonQuant supports float32, float16 and bfloat16 tensors, got {x.dtype}; "
                "cast it (e.g. x.float()) or use a lossless codec such as Identity()."
            )

    def _meta(self, x: torch.Tensor, nb: int, raw_blocks: int | torch.Tensor, tail_raw: bool | None) -> Meta:
        return Meta(x.shape, x.dtype, self.name, types.MappingProxyType({
            "bits": self.bits, "mode": self.mode, "bound": self.bound, "block": self.block,
            "raw_blocks": raw_blocks, "blocks": nb, "fmt": self.fmt, "tail_raw": tail_raw,
        }))

    def _quantize(self, flat: torch.Tensor, n: int, nb: int,
                  count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Triton kernel's codes, params (fp32, (nb, 1 or 2)) and raw-block count (int32 on the device, added to
        ``count`` when given: zeros, int32)."""
        from torchckpt.codecs import _quant_triton as k

        B = self.block
        rows, warps, _, _ = self._config(flat.dtype)
        codes = torch.empty(nb * B * self.bits // 8, dtype=torch.uint8, device=flat.device)
        params = torch.empty(nb, 1 if self.fmt == "e4m3" else 2, dtype=torch.float32, device=flat.device)
        if count is None:
            count = torch.zeros(1, dtype=torch.int32, device=flat.device)
        _launch(k.quant_kernel, n, nb, B, rows,
                (flat, codes, params, count, n, nb, self._b32, float(2**self.bits - 1)),
                REL=self.mode == "rel", BITS=self.bits, FP8=self.fmt == "e4m3", BLOCK=B, ROWS=rows,
                OUT=_tl_dtype(flat.dtype), num_warps=warps, enable_fp_fusion=False)
        return codes, params, count

    def _flat(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """``x`` as one contiguous row, its elements and its blocks (NOTE [ Block quantization ])."""
        flat = x.detach().contiguous().reshape(-1)
        n = flat.numel()
        return flat, n, -(-n // self.block)

    def compress(self, x: torch.Tensor, stream: torch.cuda.Stream | None = None) -> Packed:
        """Quantize ``x`` (fp32, fp16 or bf16, any layout) on ``stream``; see NOTE [ Block quantization ]."""
        self._check_input(x)
        B = self.block
        with on_stream(stream, x.device, x):
            flat, n, nb = self._flat(x)
            if self._triton(x.device) and nb > 0:
                codes, params, count = self._quantize(flat, n, nb)
                # NOTE [ Block quantization ] Rule 5: one int32 to pinned memory, then wait for this stream only
                host = torch.empty(1, dtype=torch.int32, pin_memory=True)
                host.copy_(count, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
                # host work while the kernel runs
                none = (torch.empty(0, dtype=torch.uint8, device=x.device),
                        torch.empty(0, dtype=torch.uint8, device=x.device))
                params_u8 = params.view(-1).view(torch.uint8)
                done.synchronize()
                nraw = int(host[0])
            else:
                codes, params = _quant_ref(flat, self.bits, B, self.mode == "rel", self._b32, self.fmt)
                none = (torch.empty(0, dtype=torch.uint8, device=x.device),
                        torch.empty(0, dtype=torch.uint8, device=x.device))
                params_u8 = params.reshape(-1).view(torch.uint8)
                nraw = -1  # not counted: always look
            tail_raw = False
            if nraw:
                ids_u8, raw_u8, tail_raw = _gather_raw(flat, params, B, nraw)
            else:
                ids_u8, raw_u8 = none
        return Packed((codes, params_u8, ids_u8, raw_u8), self._meta(x, nb, ids_u8.numel() // 4, tail_raw))

    def compress_deferred(self, x: torch.Tensor, stream: torch.cuda.Stream | None = None) -> Deferred:
        """``compress`` with the raw-block count left on the device (NOTE [ Block quantization ] Rule 5).

        ``sizes`` is ``[raw blocks, whether the last block is raw]``; ``settle`` takes them back. The raw blocks sit
        in rows of their own index (none ranked here).
        """
        self._check_input(x)
        B = self.block
        with on_stream(stream, x.device, x):
            flat, n, nb = self._flat(x)
            if nb == 0:
                none = torch.empty(0, dtype=torch.uint8, device=x.device)
                return Deferred(Packed((none, none, none, none), self._meta(x, 0, 0, False)))
            # room for every block: any block may be raw (NOTE [ Block quantization ] Rule 7), lent on this stream
            rows = self.scratch.take(nb * B * flat.element_size(), x.device)
            if self._triton(x.device):
                sizes = torch.zeros(2, dtype=torch.int64, device=x.device)
                # the count in sizes[0]'s low word (little-endian; count < 2**31): no copy after the kernel
                codes, params, _ = self._quantize(flat, n, nb, count=sizes.view(torch.int32)[:1])
                _raw_rows_triton(flat, params, B, sizes, out=rows)
            else:
                codes, params = _quant_ref(flat, self.bits, B, self.mode == "rel", self._b32, self.fmt)
                _, sizes = _raw_rows_dev(flat, params, B, out=rows)
        params_u8 = params.reshape(-1).view(torch.uint8)
        # ids: none in this form (empty, a view); rows (the lent buffer itself, which the scratch knows): row i holds
        # block i when its marker says raw
        return Deferred(Packed((codes, params_u8, rows[:0], rows), self._meta(x, nb, sizes[:1], None)), sizes)

    def settle(self, d: Deferred, values: Sequence[int]) -> Packed:
        """``compress``'s ``Packed`` from ``compress_deferred``'s and its sizes read back: views of its buffers, and
        with raw blocks their rows gathered in order on the device (NOTE [ Block quantization ] Rule 5)."""
        if d.sizes is None:
            return d.packed
        self._check_packed(d.packed)
        count, last = (int(v) for v in values)
        meta = d.packed.meta
        nb, B = int(meta.params["blocks"]), int(meta.params["block"])
        if not 0 <= count <= nb or len(d.packed.buffers) != 4:
            raise internal_error(f"TritonQuant counted {count} raw blocks of {nb}")
        codes, params_u8, ids_u8, raw_u8 = d.packed.buffers
        tail_raw = count > 0 and meta.shape.numel() % B != 0 and bool(last)
        if count:
            ids_u8, raw_u8 = _rank_raw_rows(params_u8.view(torch.float32).view(nb, -1), raw_u8, B, count)
        else:  # buffers of their own: none views the raw rows, which go back to the scratch (NOTE [ Codec streams ] Rule 5)
            ids_u8 = raw_u8 = torch.empty(0, dtype=torch.uint8, device=raw_u8.device)
        return Packed((codes, params_u8, ids_u8, raw_u8),
                      dataclasses.replace(meta, params=types.MappingProxyType(
                          {**meta.params, "raw_blocks": count, "tail_raw": tail_raw})))

    def decompress(self, p: Packed, out: torch.Tensor | None = None,
                   stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Decode ``p`` into ``out`` (a new tensor when ``None``) on ``stream``."""
        self._check_packed(p)
        bits, B = int(p.meta.params["bits"]), int(p.meta.params["block"])
        fmt = str(p.meta.params.get("fmt", "int"))
        if len(p.buffers) != 4 or fmt not in _FMTS:
            raise internal_error(f"TritonQuant packed form has {len(p.buffers)} buffers and fmt {fmt!r}, "
                                 "expected 4 and 'int' or 'e4m3'")
        fp8 = fmt == "e4m3"
        out = self._output(p, out)
        codes, params_u8, ids_u8, raw_u8 = p.buffers
        with on_stream(stream, p.device, *p.buffers):
            flat = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
            n = flat.numel()
            params = params_u8.view(torch.float32).view(-1, 1 if fp8 else 2)
            nb = params.shape[0]
            if self._triton(p.device) and nb > 0:
                from torchckpt.codecs import _quant_triton as k

                _, _, rows, warps = _CFG[(min(out.dtype.itemsize, 4), "e4m3" if fp8 else f"int{bits}")]
                _launch(k.dequant_kernel, n, nb, B, rows, (codes, params, flat, n, nb),
                        BITS=bits, FP8=fp8, BLOCK=B, ROWS=rows, OUT=_tl_dtype(out.dtype),
                        num_warps=warps, enable_fp_fusion=False)
            else:
                _dequant_ref(codes, params, flat, bits, B, fmt)
            count = p.meta.params["raw_blocks"]
            if isinstance(count, torch.Tensor):  # compress_deferred's form (NOTE [ Block quantization ] Rule 5):
                # the raw blocks' rows put back by the markers
                if self._triton(p.device):
                    _put_raw_rows_triton(flat, params, raw_u8, B)
                else:
                    _put_raw_rows_dev(flat, params, raw_u8, B)
            elif ids_u8.numel():
                _scatter_raw(flat, ids_u8.view(torch.int32), raw_u8.view(out.dtype), B,
                             bool(p.meta.params.get("tail_raw", False)))
            if flat.data_ptr() != out.data_ptr() or not out.is_contiguous():
                out.copy_(flat.view(out.shape))
        return out


def _gather_raw(flat: torch.Tensor, params: torch.Tensor, B: int,
                nraw: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The raw blocks (NOTE [ Block quantization ] Rule 4): ``(ids, bytes, whether the last block is raw and partial)``.

    ``nraw`` is the kernel's count (``-1``: not counted). Whole blocks are gathered as rows; a
    raw partial last block (always the last id) is padded with its last element.
    """
    n = flat.numel()
    ids = (params[:, -1] < 0).nonzero().reshape(-1)  # sorted; reads the count to the host (NOTE [ Block quantization ] Rule 5)
    if nraw >= 0 and ids.numel() != nraw:
        raise internal_error(f"TritonQuant counted {nraw} raw blocks but params mark {ids.numel()}")
    nfull = n // B
    tail_raw = bool(ids.numel()) and n % B != 0 and bool(params[-1, -1] < 0)
    kf = ids.numel() - int(tail_raw)
    raw = flat.new_empty(ids.numel(), B)
    if kf:
        torch.index_select(flat[: nfull * B].view(nfull, B), 0, ids[:kf], out=raw[:kf])
    if tail_raw:
        raw[kf, : n - nfull * B] = flat[nfull * B:]
        raw[kf, n - nfull * B:] = flat[-1]
    return ids.to(torch.int32).view(torch.uint8), raw.view(-1).view(torch.uint8), tail_raw


def _scatter_raw(flat: torch.Tensor, ids: torch.Tensor, raw: torch.Tensor, B: int, tail_raw: bool) -> None:
    """Writes the raw blocks back into ``flat`` (the inverse of ``_gather_raw``)."""
    n = flat.numel()
    nfull = n // B
    raw = raw.view(-1, B)
    kf = ids.numel() - int(tail_raw)
    if kf:
        flat[: nfull * B].view(nfull, B).index_copy_(0, ids[:kf].long(), raw[:kf])
    if tail_raw:
        flat[nfull * B:] = raw[kf, : n - nfull * B]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size: copies that move bits, NaN payloads included."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _raw_rows_dev(flat: torch.Tensor, params: torch.Tensor, B: int,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``compress_deferred``'s raw rows in PyTorch (NOTE [ Block quantization ] Rule 5): ``(bytes, sizes)``; row ``i``
    of the bytes is block ``i`` (every block copied; a partial last block padded with its last element, as
    ``_gather_raw`` pads it), ``sizes`` is ``[count, whether the last block is raw]`` (int64). The bytes are written
    into ``out`` (uint8, ``nb * B`` elements' bytes) when given, else into a new buffer."""
    n, nb = flat.numel(), params.shape[0]
    src = _bits(flat)
    rows = src.new_empty(nb * B) if out is None else out.view(src.dtype)
    rows[:n].copy_(src)
    if nb * B > n:
        rows[n:].copy_(src[-1:].expand(nb * B - n))
    raw = params[:, -1] < 0
    sizes = torch.stack([raw.sum(), raw[-1].long()])
    return rows.view(torch.uint8), sizes


def _rank_raw_rows(params: torch.Tensor, rows: torch.Tensor, B: int,
                   count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_gather_raw``'s ``(ids, bytes)`` from the raw rows (row ``i``: block ``i``) and the raw-block ``count`` (known
    on the host, > 0): the raw blocks' indices and rows in block order, on the device, nothing read back."""
    nb, dev = params.shape[0], params.device
    raw = params[:, -1] < 0
    dst = torch.where(raw, torch.cumsum(raw, 0) - 1, count)  # a raw block's rank; the others to a spare slot
    ids = torch.empty(count + 1, dtype=torch.int32, device=dev)
    ids.index_copy_(0, dst, torch.arange(nb, dtype=torch.int32, device=dev))
    ids = ids[:count]
    got = rows.view(nb, -1).index_select(0, ids.long())
    return ids.view(torch.uint8), got.view(-1)


def _put_raw_rows_dev(flat: torch.Tensor, params: torch.Tensor, raw: torch.Tensor, B: int) -> None:
    """Writes the raw rows of ``_raw_rows_dev``'s layout back into their blocks of ``flat`` (contiguous), in PyTorch,
    reading nothing on the host: every block is chosen between itself and its row by its marker."""
    n, nb = flat.numel(), params.shape[0]
    bits = _bits(flat)
    rows = raw.view(bits.dtype).view(nb, B)
    have = params[:, -1] < 0
    full = n // B
    if full:
        blocks = bits[: full * B].view(full, B)
        blocks.copy_(torch.where(have[:full, None], rows[:full], blocks))
    if n > full * B:
        tail = bits[full * B:]
        tail.copy_(torch.where(have[full], rows[full, : n - full * B], tail))


def _small_rows(B: int) -> int:
    return max(1, 2048 // B)  # blocks per program of the raw-block kernels: tiles of about 2048 elements


def _raw_rows_triton(flat: torch.Tensor, params: torch.Tensor, B: int, sizes: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``_raw_rows_dev``'s bytes by a Triton kernel that copies the raw blocks only (the other rows unwritten: in
    ``out`` when given, whatever they held); it writes ``sizes[1]``, the quantizer counted into ``sizes[0]``."""
    from torchckpt.codecs import _quant_triton as k

    n, nb = flat.numel(), params.shape[0]
    src = _bits(flat)
    rows = src.new_empty(nb * B) if out is None else out.view(src.dtype)
    R = _small_rows(B)
    _fast(k.raw_rows_kernel)((triton_cdiv(nb, R),), src, params, rows, sizes, n, nb, NPAR=params.shape[1], BLOCK=B,
                             ROWS=R)
    return rows.view(torch.uint8)


def _put_raw_rows_triton(flat: torch.Tensor, params: torch.Tensor, raw: torch.Tensor, B: int) -> None:
    """``_put_raw_rows_dev`` by a Triton kernel that reads and writes the raw blocks only."""
    from torchckpt.codecs import _quant_triton as k

    bits = _bits(flat)
    nb, R = params.shape[0], _small_rows(B)
    _fast(k.put_raw_rows_kernel)((triton_cdiv(nb, R),), raw.view(bits.dtype), params, bits, bits.numel(), nb,
                                 NPAR=params.shape[1], BLOCK=B, ROWS=R)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _tl_dtype(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]
