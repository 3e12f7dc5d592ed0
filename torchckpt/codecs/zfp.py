"""ZFP: fixed-rate zfp 1.0.1 compression of fp32/fp64 fields, cuZFP on the GPU, serial zfp on the CPU.

Lossy with **no error bound**: every value costs ``rate`` bits whatever the data, and the
error depends on the data (small for smooth fields such as wavefield snapshots, large for
noise). This is what GPUZIP (Maltempi 2025) used for adjoint snapshots. zfp: Lindstrom,
"Fixed-Rate Compressed Floating-Point Arrays", IEEE TVCG 2014; cuZFP is zfp's CUDA back end.

The native part is the optional extension ``torchckpt._zfp``, built from zfp's sources fetched
at build time (never committed): ``TORCHCKPT_BUILD_ZFP=1 pip install --no-build-isolation -e .``.

# NOTE [ ZFP fixed rate ]
# 1. Format. One uint8 buffer: the zfp 1.0.1 fixed-rate stream of the field with no zfp
#    header; each block of 4^d values takes exactly B = max(floor(4^d * rate + 0.5), 9 for fp32
#    | 12 for fp64) bits (zfp_stream_set_rate, not word aligned), blocks in zfp order (x
#    fastest), S = ceil(blocks * B / 64) * 8 bytes. Then one zero 64-bit word: cuZFP's decoder
#    may read one word past the last block. Then, with ``nonfinite="nan"``, one bit per block
#    (LSB first, same block order): the block held a NaN or an Inf (Rule 5). zfp's stream is the
#    same whatever the execution policy (zfp FAQ), so CPU zfp checks cuZFP byte for byte.
# 2. Field. The tensor is read as if contiguous and compressed as ONE zfp field of 1-3 dims:
#    size-1 dims are dropped; if more than three are left, the leading ones are merged into the
#    slowest, (a, b, ..., y, x) -> (a*b*..., y, x). So an (N, Z, Y, X) batch is one
#    (N*Z, Y, X) field: when Z % 4 != 0 some blocks straddle two samples, which changes the
#    error there, not the size. zfp pads partial blocks, so the rate is per value of the field
#    padded to multiples of 4 per dim (a (5,) vector takes two 4-value blocks). 0-d tensors are
#    refused; empty tensors pack to zero bytes.
# 3. The packed size depends only on shape, dtype, rate and ``nonfinite``: compress allocates it
#    exactly and neither direction reads anything back to the host (NOTE [ Codec streams ]
#    Rule 3 is not needed), except ``nonfinite="raise"`` (Rule 5).
# 4. Streams. cuZFP 1.0.1 takes no stream: it enqueues a cudaMemset and its kernel on the LEGACY
#    default stream. With device pointers (always, here) it allocates nothing and does not
#    block the host (its timing code is compiled out). torch's side streams are non-blocking,
#    never ordered with the legacy stream implicitly, so the op makes the legacy stream wait
#    for an event on the caller's stream ``s`` before zfp runs and ``s`` wait for an event on the
#    legacy stream after (csrc/zfp/zfp_ops.cpp, LegacyStreamOrder). Work queued on ``s``
#    afterwards sees the result, and NOTE [ Codec streams ] Rules 1-2 hold as for any codec.
#    The cost: the zfp kernel itself runs on the legacy stream, i.e. torch's default stream, so
#    it serializes with everything queued there (and with any blocking stream). It overlaps
#    compute only if that compute runs on non-default streams; lifting this needs cuZFP
#    launches that take a stream, which 1.0.1 does not have.
# 5. NaN and Inf. Fixed-rate zfp cannot represent them: a block holding one is coded from an
#    undefined exponent and comes back finite and wrong (a NaN was seen to return as 1.9995),
#    and CPU and GPU bytes may differ in that block. Never silently: with ``nonfinite="nan"``
#    (default) compress records one flag per block on the device (one extra pass over the
#    input, no host read) and decompress writes NaN over every flagged block, so NaN and Inf
#    come back as NaN together with the other values of their 4^d block; all other blocks are
#    exact zfp output (blocks are coded independently). ``nonfinite="raise"`` instead checks
#    ``torch.isfinite(x).all()`` at compress and raises ValueError: a host read that waits for
#    ``s`` (not the whole device); its packed form has no flags.
# 6. Limits: float32 and float64 only; rate in (0, 32] for float32 and (0, 64] for float64;
#    a padded field of at most 2**31 - 1 values (cuZFP indexes with 32-bit integers).
"""
from __future__ import annotations

import math
import types
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from torchckpt._errors import CheckpointError, internal_error
from torchckpt._native import ops, zfp_error
from torchckpt.codecs.base import Codec, Guarantee, Meta, Packed, on_stream

_BITS = {torch.float32: 32, torch.float64: 64}
_MIN_BLOCK_BITS = {torch.float32: 1 + 8, torch.float64: 1 + 11}  # zfp_stream_set_rate's floor
_MAX_PADDED = 2**31 - 1  # NOTE [ ZFP fixed rate ] Rule 6
_MODES = ("nan", "raise")
_BUILD = "TORCHCKPT_BUILD_ZFP=1 pip install --no-build-isolation -e ."

def ext_has_cuda() -> bool:
    """Whether ``torchckpt._zfp`` is loaded and was built with cuZFP (a CUDA toolkit at build time)."""
    return zfp_error() is None and ops.zfp_has_cuda()


def field_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The zfp field (1 to 3 sizes, slowest first) a tensor of ``shape`` is compressed as.

    NOTE [ ZFP fixed rate ] Rule 2: size-1 dims dropped, leading dims merged beyond three.

    Args:
        shape: a tensor shape with at least one dimension and at least one element.

    Returns:
        The field's sizes, slowest first.

    Example::

        >>> field_shape((1, 64, 1, 32)), field_shape((8, 6, 5, 4, 3))
        ((64, 32), (240, 4, 3))
    """
    dims = [int(d) for d in shape if d != 1]
    if not dims:
        return (1,)
    if len(dims) > 3:
        dims = [math.prod(dims[:-2]), dims[-2], dims[-1]]
    return tuple(dims)


def packed_layout(field: Sequence[int], dtype: torch.dtype, rate: float, flags: bool) -> tuple[int, int, int]:
    """``(bits_per_block, stream_bytes, total_bytes)`` of a field (NOTE [ ZFP fixed rate ] Rule 1).

    Example::

        >>> packed_layout((64, 64, 64), torch.float32, 8.0, flags=True)
        (512, 262144, 262664)
    """
    d = len(field)
    bits = max(int(math.floor((4**d) * float(rate) + 0.5)), _MIN_BLOCK_BITS[dtype])
    blocks = math.prod(-(-n // 4) for n in field)
    stream = -(-(blocks * bits) // 64) * 8
    return bits, stream, stream + 8 + (-(-blocks // 8) if flags else 0)


def _block_grid(field: Sequence[int]) -> tuple[int, ...]:
    return tuple(-(-n // 4) for n in field)


def _flags_pack(f: torch.Tensor) -> torch.Tensor:
    """One bit per zfp block of the field ``f``: the block holds a NaN or an Inf (NOTE [ ZFP fixed rate ] Rule 5)."""
    bad = ~torch.isfinite(f)
    pad: list[int] = []
    for n in reversed(f.shape):
        pad += [0, (-n) % 4]
    if any(pad):
        bad = F.pad(bad, pad)
    grid = _block_grid(f.shape)
    split = [s for b in grid for s in (b, 4)]
    blk = bad.view(split).any(dim=tuple(range(1, 2 * len(grid), 2))).reshape(-1)
    nbytes = -(-blk.numel() // 8)
    if nbytes * 8 != blk.numel():
        blk = torch.cat([blk, blk.new_zeros(nbytes * 8 - blk.numel())])
    shifts = torch.arange(8, dtype=torch.uint8, device=f.device)
    return (blk.view(nbytes, 8).to(torch.uint8) << shifts).sum(1, dtype=torch.uint8)


def _flags_apply(flags: torch.Tensor, f: torch.Tensor) -> None:
    """Write NaN over every block of the field ``f`` whose flag is set (NOTE [ ZFP fixed rate ] Rule 5)."""
    grid = _block_grid(f.shape)
    nblocks = math.prod(grid)
    shifts = torch.arange(8, dtype=torch.uint8, device=f.device)
    blk = ((flags[:, None] >> shifts) & 1).reshape(-1)[:nblocks].bool().view(grid)
    b6 = [s for b in grid for s in (b, 1)]
    if all(n % 4 == 0 for n in f.shape):
        f.view([s for b in grid for s in (b, 4)]).masked_fill_(blk.view(b6), float("nan"))
        return
    mask = blk.view(b6).expand([s for b in grid for s in (b, 4)]).reshape([4 * b for b in grid])
    mask = mask[tuple(slice(0, n) for n in f.shape)]
    f.masked_fill_(mask, float("nan"))


class ZFP(Codec):
    """zfp fixed-rate compression: ``rate`` bits per value, lossy, NO error bound.

    cuZFP on CUDA tensors, serial zfp on CPU tensors, same bytes (NOTE [ ZFP fixed rate ]).
    float32 and float64 tensors are compressed as one zfp field of 1 to 3 dims (NOTE [ ZFP fixed rate ] Rule 2 says
    how other shapes map to one). The error depends on the data: small on smooth fields
    (wavefields, images), large on noise; check it on your data. NaN and Inf cannot be coded:
    see NOTE [ ZFP fixed rate ] Rule 5 for what ``nonfinite`` does with them. Needs the optional extension
    ``torchckpt._zfp``: ``TORCHCKPT_BUILD_ZFP=1 pip install --no-build-isolation -e .``.

    Args:
        rate: bits per value, in (0, 32] for float32 and (0, 64] for float64 (checked at
            compress). zfp rounds it to whole bits per block of 4^d values, at least 9 (fp32)
            or 12 (fp64): ``p.meta.params["rate_effective"]`` has the rate actually used.
        nonfinite: ``"nan"`` (blocks holding NaN/Inf come back all NaN; no host sync) or
            ``"raise"`` (a ValueError at compress; one host read per compress).

    Example::

        >>> c = ZFP(rate=16)
        >>> x = torch.sin(torch.linspace(0, 3, 32 * 32)).view(32, 32)
        >>> p = c.compress(x)
        >>> p.ratio > 1.9, bool((c.decompress(p) - x).abs().max() < 1e-3)
        (True, True)
    """

    name = "zfp"
    dtypes = (torch.float32, torch.float64)  # Codec.supports: the store moves others as they are

    def __init__(self, rate: float = 8.0, nonfinite: str = "nan") -> None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (0 < rate <= 64):
            raise ValueError(
                f"torchckpt: ZFP rate must be a number of bits per value in (0, 64] (at most 32 for float32), "
                f"got {rate!r}; e.g. ZFP(rate=8) stores float32 at 4x. For a lossless copy use Identity()."
            )
        if nonfinite not in _MODES:
            raise ValueError(f"torchckpt: ZFP nonfinite must be one of {_MODES}, got {nonfinite!r}.")
        self.rate = float(rate)
        self.nonfinite = nonfinite

    def __repr__(self) -> str:
        return f"ZFP(rate={self.rate:g}, nonfinite={self.nonfinite!r})"

    @property
    def guarantee(self) -> Guarantee:
        """``fixed_rate``: ``rate`` bits per value, no error bound."""
        return Guarantee("fixed_rate", self.rate)

    def unavailable_reason(self) -> str | None:
        """``None`` when ZFP runs here: the extension is built (with cuZFP where a GPU is visible)."""
        err = zfp_error()
        if err is not None:
            return (f"ZFP needs the optional extension torchckpt._zfp, which is not built here ({err}). "
                    f"Build it with `{_BUILD}` (fetches the zfp 1.0.1 sources, see tools/fetch_zfp.py).")
        if torch.cuda.is_available() and not ext_has_cuda():
            return ("torchckpt._zfp was built without CUDA (no toolkit with headers at build time), so ZFP cannot "
                    f"compress CUDA tensors; rebuild with CUDA_HOME set: `{_BUILD}`.")
        return None

    # -- checks ------------------------------------------------------------------------
    def _require_ext(self, device: torch.device) -> None:
        err = zfp_error()
        if err is not None:
            raise CheckpointError(
                f"torchckpt: ZFP needs the optional extension torchckpt._zfp, which is not built ({err}). "
                f"Build it with `{_BUILD}`, or use another codec (TritonQuant, Identity)."
            )
        if device.type == "cuda" and not ext_has_cuda():
            raise CheckpointError(
                "torchckpt: torchckpt._zfp was built without CUDA, so ZFP cannot compress CUDA tensors; "
                f"rebuild it where a CUDA toolkit is found (`{_BUILD}`), or compress on the CPU."
            )
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"torchckpt: ZFP compresses CPU or CUDA tensors, got one on {device}.")

    def _check_input(self, x: torch.Tensor) -> tuple[int, ...] | None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"torchckpt: ZFP.compress needs a torch.Tensor, got {type(x).__name__}.")
        if x.dtype not in _BITS:
            raise TypeError(
                f"torchckpt: ZFP compresses float32 and float64 tensors, got {x.dtype}; cast it (x.float()) "
                "or use TritonQuant (fp16/bf16) or a lossless codec such as Identity()."
            )
        if self.rate > _BITS[x.dtype]:
            raise ValueError(
                f"torchckpt: ZFP(rate={self.rate:g}) spends more bits per value than {x.dtype} has "
                f"({_BITS[x.dtype]}); pass a rate <= {_BITS[x.dtype]}, or use Identity() for a lossless copy."
            )
        if x.dim() == 0:
            raise ValueError("torchckpt: ZFP compresses tensors of 1 or more dimensions, got a 0-d tensor; "
                             "pass x.reshape(1), or use Identity() for scalars.")
        if x.numel() == 0:
            return None
        field = field_shape(x.shape)
        padded = math.prod(4 * b for b in _block_grid(field))
        if padded > _MAX_PADDED:
            raise ValueError(
                f"torchckpt: ZFP compresses fields of at most 2**31 - 1 values (padded to multiples of 4 per dim); "
                f"{tuple(x.shape)} is the field {field} ({padded} padded values). Split the tensor and compress the parts."
            )
        return field

    # -- codec -------------------------------------------------------------------------
    def compress(self, x: torch.Tensor, stream: torch.cuda.Stream | None = None) -> Packed:
        """Compress ``x`` (float32/float64, >= 1 dim, any layout) on ``stream``; lossy, no error bound."""
        field = self._check_input(x)
        flags = self.nonfinite == "nan"
        params: dict[str, object] = {"rate": self.rate, "nonfinite": self.nonfinite, "field": field}
        if field is None:
            with on_stream(stream, x.device, x):
                data = torch.empty(0, dtype=torch.uint8, device=x.device)
            params.update(bits_per_block=0, stream_bytes=0, rate_effective=self.rate)
            return Packed(data, Meta(x.shape, x.dtype, self.name, types.MappingProxyType(params)))
        self._require_ext(x.device)
        bits, sbytes, total = packed_layout(field, x.dtype, self.rate, flags)
        with on_stream(stream, x.device, x):
            f = x.detach().contiguous().view(field)
            if not flags and not bool(torch.isfinite(f).all()):  # host read: NOTE [ ZFP fixed rate ] Rule 5
                raise ValueError(
                    "torchckpt: ZFP(nonfinite='raise') got a tensor holding NaN or Inf, which fixed-rate zfp cannot "
                    "code; clean the tensor, or pass nonfinite='nan' (blocks holding them come back as NaN)."
                )
            data = torch.empty(total, dtype=torch.uint8, device=x.device)
            data[max(sbytes - 8, 0):sbytes + 8].zero_()  # the last, maybe partial, word and the pad word: NOTE [ ZFP fixed rate ] Rule 1
            ops.zfp_compress(f, field, self.rate, data)
            if flags:
                data[sbytes + 8:] = _flags_pack(f)
        params.update(bits_per_block=bits, stream_bytes=sbytes, rate_effective=bits / 4 ** len(field))
        return Packed(data, Meta(x.shape, x.dtype, self.name, types.MappingProxyType(params)))

    def decompress(self, p: Packed, out: torch.Tensor | None = None,
                   stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Decompress ``p`` into ``out`` (a new tensor when ``None``) on ``stream``."""
        self._check_packed(p)
        if len(p.buffers) != 1:
            raise internal_error(f"ZFP packed form has {len(p.buffers)} buffers, expected 1")
        out = self._output(p, out)
        field = p.meta.params["field"]
        if field is None:
            return out
        self._require_ext(p.device)
        rate = float(p.meta.params["rate"])
        flags = p.meta.params["nonfinite"] == "nan"
        _, sbytes, total = packed_layout(field, p.meta.dtype, rate, flags)
        data = p.buffers[0]
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != total:
            raise ValueError(
                f"torchckpt: this ZFP Packed holds a {tuple(data.shape)} {data.dtype} buffer, its meta needs "
                f"({total},) uint8; pass the Packed that ZFP.compress returned, with its buffer unchanged."
            )
        with on_stream(stream, p.device, data):
            dst = out if out.is_contiguous() else torch.empty(p.meta.shape, dtype=out.dtype, device=out.device)
            f = dst.view(field)
            ops.zfp_decompress(data, field, rate, f)
            if flags:
                _flags_apply(data[sbytes + 8:], f)
            if dst is not out:
                out.copy_(dst)
        return out
