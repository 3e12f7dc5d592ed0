"""TritonQuant: block-wise 8- or 4-bit quantization with a per-element error bound.

# NOTE [ Block quantization ]
# 1. The flattened tensor is cut into blocks of ``block`` elements (the last one padded).
#    Per block: ``mn`` and ``mx`` of its finite values, ``step = (mx - mn) / L`` with
#    ``L = 2**bits - 1``, codes ``q = clamp(floor((x - mn) / step + 0.5), 0, L)``, decoded
#    as ``x' = (mn + q * step)`` rounded to the tensor's dtype. All arithmetic is fp32.
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
#    whole blocks), params (fp32 ``mn``, ``step`` per block; ``step = -1`` marks a raw
#    block), the int32 indices of raw blocks, and those blocks' original bytes. With no raw
#    blocks, fp32 8-bit is 264 bytes per 1024 (3.88x) and 4-bit 136 (7.53x) at block=256.
# 5. How many blocks are raw is known only after the kernel ran: compress reads that count
#    to the host (NOTE [ Codec streams ] Rule 3). Blocks whose range needs more than
#    ``L`` steps of ``2 * bound`` end up raw: on data with a huge range per block the ratio
#    falls towards 1, the bound never breaks.
# 6. The Triton kernels (_quant_triton.py) and the PyTorch reference (``_quant_ref``,
#    ``_dequant_ref``) do the same fp32 operations in the same order, with IEEE division and
#    no fused multiply-add, so their packed bytes are identical; raw blocks and everything
#    after the kernel are shared PyTorch code.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import types
from typing import Any

import torch

from torchckpt._errors import internal_error
from torchckpt.codecs.base import Codec, Guarantee, Meta, Packed, on_stream

_log = logging.getLogger("torchckpt")

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_REL_SLACK = 1.0 - 2.0**-20  # see Rule 3
_ROWS = 16  # blocks per Triton program


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


def _quant_ref(flat: torch.Tensor, bits: int, block: int, rel: bool, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantizer (CPU or CUDA): ``(codes uint8, params fp32 (nblocks, 2))`` per Rule 1-3."""
    dev = flat.device
    levels = float(2**bits - 1)
    nb = -(-flat.numel() // block)
    if nb == 0:
        return torch.empty(0, dtype=torch.uint8, device=dev), torch.empty(0, 2, dtype=torch.float32, device=dev)
    xb, valid = _pad_blocks(flat, block)
    finite = torch.isfinite(xb)
    inf = torch.tensor(math.inf, device=dev)
    mn = torch.where(finite, xb, inf).amin(1)
    mx = torch.where(finite, xb, -inf).amax(1)
    mn = mn + torch.zeros((), device=dev)
    step = (mx - mn) / torch.full_like(mn, levels)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.floor((xb - mn[:, None]) / safe[:, None].expand_as(xb) + 0.5)
    q = torch.clamp(q, 0.0, levels)
    q = torch.where(step[:, None] > 0, q, torch.zeros_like(q))
    xr = (mn[:, None] + q * step[:, None]).to(flat.dtype).float()
    d = (xr - xb).abs()
    b = torch.tensor(bound, dtype=torch.float32, device=dev)
    if rel:
        amax = torch.maximum(mn.abs(), mx.abs())
        thr = (amax * b) * torch.tensor(_REL_SLACK, dtype=torch.float32, device=dev)
    else:
        thr = b.expand_as(mn)
    ok = ((d < thr[:, None]) | (d == 0)) & finite
    ok = ok | ~valid
    raw = ~ok.all(1)
    q = torch.where(raw[:, None] | ~valid, torch.zeros_like(q), q)
    params = torch.stack([torch.where(raw, torch.zeros_like(mn), mn),
                          torch.where(raw, torch.full_like(step, -1.0), step)], 1)
    qi = q.to(torch.uint8)
    if bits == 4:
        qi = qi.view(nb, block // 2, 2)
        qi = qi[..., 0] | (qi[..., 1] << 4)
    return qi.reshape(-1), params


def _dequant_ref(codes: torch.Tensor, params: torch.Tensor, out_flat: torch.Tensor, bits: int, block: int) -> None:
    """Reference decoder: writes every non-raw block of ``out_flat`` (raw ones are left as they are)."""
    n = out_flat.numel()
    nb = params.shape[0]
    if nb == 0:
        return
    if bits == 4:
        c = codes.view(nb, block // 2)
        q = torch.stack([c & 15, c >> 4], 2).view(nb, block)
    else:
        q = codes.view(nb, block)
    mn, step = params[:, 0], params[:, 1]
    xr = (mn[:, None] + q.float() * step[:, None]).to(out_flat.dtype).reshape(-1)[:n]
    keep = (step >= 0)[:, None].expand(nb, block).reshape(-1)[:n]
    out_flat.copy_(torch.where(keep, xr, out_flat))


def _triton_reason() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "TritonQuant's GPU kernels need triton: pip install triton (the PyTorch reference path still runs)."
    if not torch.cuda.is_available():
        return ("TritonQuant's GPU kernels need a CUDA device, and torch.cuda.is_available() is False "
                "(CPU tensors use the PyTorch reference path).")
    return None


class TritonQuant(Codec):
    """Block-wise quantization to 8 or 4 bits with an error bound that holds by construction.

    NOTE [ Block quantization ] says exactly what is guaranteed and how.

    Args:
        bits: 8 or 4 bits per element.
        mode: ``"abs"`` (``|x - x'| <= bound``) or ``"rel"`` (``|x - x'| <= bound * max|x|``
            over the element's block).
        bound: the error bound, finite and > 0.
        block: elements per block (a power of two, 64 to 4096).
        use_triton: ``None`` uses the Triton kernels for CUDA tensors when triton imports,
            ``False`` always the PyTorch reference (same bytes, slower).

    Example::

        >>> c = TritonQuant(bits=8, mode="abs", bound=1e-2)
        >>> x = torch.linspace(-1, 1, 1000)
        >>> p = c.compress(x)
        >>> round(p.ratio, 2), bool((c.decompress(p) - x).abs().max() <= 1e-2)
        (3.79, True)
    """

    name = "triton_quant"

    def __init__(self, bits: int = 8, mode: str = "abs", bound: float = 1e-3, block: int = 256,
                 use_triton: bool | None = None) -> None:
        if bits not in (4, 8) or isinstance(bits, bool):
            raise ValueError(f"torchckpt: TritonQuant bits must be 8 or 4, got {bits!r}.")
        if mode not in ("abs", "rel"):
            raise ValueError(f"torchckpt: TritonQuant mode must be 'abs' or 'rel', got {mode!r}.")
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not (0 < bound < math.inf):
            raise ValueError(f"torchckpt: TritonQuant bound must be a finite number > 0, got {bound!r}; "
                             "for a lossless copy use Identity().")
        if not isinstance(block, int) or block < 64 or block > 4096 or block & (block - 1):
            raise ValueError(f"torchckpt: TritonQuant block must be a power of two from 64 to 4096, got {block!r}.")
        b32 = _fp32_at_most(float(bound))
        if b32 <= 0:
            raise ValueError(f"torchckpt: TritonQuant bound {bound!r} is below the smallest fp32; pass a larger bound.")
        self.bits = bits
        self.mode = mode
        self.bound = float(bound)
        self.block = block
        self.use_triton = use_triton
        self._b32 = b32

    def __repr__(self) -> str:
        return f"TritonQuant(bits={self.bits}, mode={self.mode!r}, bound={self.bound!r}, block={self.block})"

    @property
    def guarantee(self) -> Guarantee:
        return Guarantee(self.mode, self.bound, self.block if self.mode == "rel" else None)

    def unavailable_reason(self) -> str | None:
        """What the GPU path lacks here (``None``: Triton kernels run). The reference path always runs."""
        return _triton_reason()

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

    def compress(self, x: torch.Tensor, stream: torch.cuda.Stream | None = None) -> Packed:
        """Quantize ``x`` (fp32, fp16 or bf16, any layout) on ``stream``; see NOTE [ Block quantization ]."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"torchckpt: TritonQuant.compress needs a torch.Tensor, got {type(x).__name__}.")
        if x.dtype not in _DTYPES:
            raise TypeError(
                f"torchckpt: TritonQuant supports float32, float16 and bfloat16 tensors, got {x.dtype}; "
                "cast it (e.g. x.float()) or use a lossless codec such as Identity()."
            )
        B = self.block
        with on_stream(stream, x.device, x):
            flat = x.detach().contiguous().reshape(-1)
            n = flat.numel()
            nb = -(-n // B)
            if self._triton(x.device) and nb > 0:
                from torchckpt.codecs import _quant_triton as k

                codes = torch.empty(nb * B * self.bits // 8, dtype=torch.uint8, device=x.device)
                params = torch.empty(nb, 2, dtype=torch.float32, device=x.device)
                k.quant_kernel[(triton_cdiv(nb, _ROWS),)](
                    flat, codes, params, n, nb, self._b32, float(2**self.bits - 1),
                    REL=self.mode == "rel", BITS=self.bits, BLOCK=B, ROWS=_ROWS, OUT=_tl_dtype(x.dtype),
                    num_warps=8, enable_fp_fusion=False,
                )
            else:
                codes, params = _quant_ref(flat, self.bits, B, self.mode == "rel", self._b32)
            ids = (params[:, 1] < 0).nonzero().reshape(-1)  # reads the count to the host: Rule 5
            if ids.numel():
                idx = ids[:, None] * B + torch.arange(B, device=x.device)
                raw = flat[idx.clamp(max=n - 1)]  # the last block is padded with its last element
            else:
                raw = flat.new_empty(0, B)
            data = (codes, params.reshape(-1).view(torch.uint8), ids.to(torch.int32).view(torch.uint8),
                    raw.reshape(-1).view(torch.uint8))
        meta = Meta(x.shape, x.dtype, self.name, types.MappingProxyType({
            "bits": self.bits, "mode": self.mode, "bound": self.bound, "block": B, "raw_blocks": int(ids.numel()),
            "blocks": nb,
        }))
        return Packed(data, meta)

    def decompress(self, p: Packed, out: torch.Tensor | None = None,
                   stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Decode ``p`` into ``out`` (a new tensor when ``None``) on ``stream``."""
        self._check_packed(p)
        bits, B = int(p.meta.params["bits"]), int(p.meta.params["block"])
        if len(p.buffers) != 4:
            raise internal_error(f"TritonQuant packed form has {len(p.buffers)} buffers, expected 4")
        out = self._output(p, out)
        codes, params_u8, ids_u8, raw_u8 = p.buffers
        with on_stream(stream, p.device, *p.buffers):
            flat = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
            n = flat.numel()
            params = params_u8.view(torch.float32).view(-1, 2)
            nb = params.shape[0]
            if self._triton(p.device) and nb > 0:
                from torchckpt.codecs import _quant_triton as k

                k.dequant_kernel[(triton_cdiv(nb, _ROWS),)](
                    codes, params, flat, n, nb, BITS=bits, BLOCK=B, ROWS=_ROWS, OUT=_tl_dtype(out.dtype),
                    num_warps=8, enable_fp_fusion=False,
                )
            else:
                _dequant_ref(codes, params, flat, bits, B)
            ids = ids_u8.view(torch.int32)
            if ids.numel():
                idx = (ids.long()[:, None] * B + torch.arange(B, device=p.device)).clamp(max=n - 1)
                # padded slots point at element n-1 and carry its value: duplicate writes agree
                flat.index_put_((idx.reshape(-1),), raw_u8.view(out.dtype))
            if flat.data_ptr() != out.data_ptr() or not out.is_contiguous():
                out.copy_(flat.view(out.shape))
        return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tl_dtype(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]
