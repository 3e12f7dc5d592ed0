"""Bitcomp: nvCOMP's Bitcomp codec, lossless for any dtype or lossy with an absolute bound.

nvCOMP 6 (``nvidia-libnvcomp-cu13==6.0.0.12``) through its native C API, called with ctypes
(torchckpt/_native/nvcomp.py): the device functions for CUDA tensors, the host twins (``bitcompHost*``,
which need no GPU) for CPU tensors. Bitcomp is the lossy mode GPUZIP (Maltempi 2025) used
with cuZFP for adjoint snapshots.

# NOTE [ Bitcomp ]
# 1. The packed form is one uint8 buffer holding nvCOMP's Bitcomp stream. Host and device
#    functions write and read the same format: each decodes the other's output to the same
#    values (the GPU tests check it). Their bytes differ (same header, different body on an
#    H100), so compare decoded values, never packed bytes, across devices. ``meta.params``
#    says how it was made; any ``Bitcomp`` decodes any Bitcomp Packed from its meta.
# 2. Lossless (``Bitcomp()``): the bytes are compressed as integers of the element size,
#    signed for signed integer and floating dtypes, unsigned otherwise, complex dtypes by
#    component. The integer type only changes the ratio; every dtype round-trips bit-exact.
# 3. Lossy (``Bitcomp(delta=d)``), fp16/fp32/fp64: with ``p`` the largest power of two
#    <= ``d``, every finite element satisfies ``|x - x'| <= p / 2`` (the stated guarantee).
#    nvCOMP quantizes to integer multiples of the step it is given, rounded down to a power
#    of two; we pass ``step = min(p, cap)`` exactly, where ``cap`` is the spacing of the
#    dtype's largest finite values (fp16 2**5, fp32 2**104, fp64 2**971): with a coarser
#    step a value near the maximum can round to a multiple past it and come back as Inf
#    (seen with fp32 and step 2**105). When ``p`` is below the dtype's smallest subnormal
#    the tensor is compressed losslessly (quantization could not lose anything anyway).
# 4. NaN, +Inf, -Inf and values too large to quantize are kept by nvCOMP element by element
#    (its header promises it and the tests check it): NaN payloads and infinities come back
#    bit-exact. A quantized -0.0 comes back as +0.0 (numerically equal).
# 5. bf16 is not a Bitcomp type. Lossy bf16 is upcast to fp32 (exact) and compressed with
#    ``step = min(p, 2**104)``. nvCOMP divides by the step and keeps integers (its header),
#    so it returns ``x'' = q * step`` with ``|x'' - x| <= step / 2``, and ``x''`` is itself a
#    bf16 value: where bf16's spacing at ``x`` is >= ``step``, ``x`` is a multiple of the
#    step and ``x'' = x``; where it is finer, ``|x| < 2**8 * step`` so ``|q| <= 2**8`` and
#    ``q * step`` has at most 8 significant bits. The conversion back is then exact and the
#    bound is the same ``p / 2`` (the tests check it on adversarial bf16 input; were
#    ``x''`` not a multiple of the step, rounding to the nearest bf16 could at most double
#    the error, since ``x`` is a bf16 candidate no farther from ``x''``).
#    torch's fp32 -> bf16 conversion makes every NaN the canonical one, so NaN elements take
#    the top 16 bits of their fp32 bits instead (exact: nvCOMP kept them raw). The ratio is
#    counted against the bf16 bytes, so it is about half what fp32 data would get. When
#    ``p`` is below bf16's smallest subnormal, bf16 is compressed losslessly.
# 6. The compressed size is known only once the kernel ran: the kernel writes into a scratch
#    buffer of ``bitcompMaxBuflen`` bytes and ``bitcompGetCompressedSizeAsync`` writes the size
#    into an int64 on the device. ``compress`` reads it back, which synchronizes that stream only
#    (NOTE [ Codec streams ] Rule 3) and so waits for what it waits on (the producer of ``x``);
#    its Packed holds a copy of the first ``size`` bytes, so it occupies only its compressed
#    size. ``compress_deferred`` on CUDA reads nothing back: its Packed is the whole scratch
#    buffer (it decodes as it is: the stream's header says its length) with the size as its
#    ``sizes``, and ``settle`` makes it a view of the first ``size`` bytes. Decompress never
#    synchronizes.
# 7. Device plans are cached per (device, nbytes, type, mode, algorithm), 256 at most (least
#    recently used evicted). A plan carries its stream (``bitcompSetStream``) and is not safe
#    to use from two streams at once, so one lock covers set-stream and launch (both only
#    enqueue work): the cache is safe across threads and streams. An evicted plan is
#    destroyed once an event recorded on its last stream has completed. Host calls create a
#    plan per call (nothing shared) and never set a stream on it. A plan used while its stream
#    captures a CUDA graph (NOTE [ Captured saves ]) is never evicted: the graph may launch its
#    kernels with whatever the plan holds, for as long as the graph lives.
# 8. Compressed buffers must be 8-byte aligned; inputs and outputs whose address is not a
#    multiple of 16 bytes go through a fresh buffer (a copy), others are used in place.
# 9. fp16 with a step below fp16's smallest normal (2**-14) goes the bf16 way: nvCOMP takes
#    the fp16 step as fp16 bits, and with a subnormal step it keeps every element raw. So
#    such fp16 is upcast to fp32 (exact) and compressed with step p. The argument of Rule 5
#    holds with 11 significant bits: where fp16's spacing at ``x`` is >= the step, ``x'' = x``;
#    where it is finer, ``|q| <= 2**11`` and ``q * step`` (a multiple of 2**-24 below 2**-3)
#    is an fp16 value, so the conversion back is exact and the bound is still ``p / 2``. NaN
#    elements take their fp16 bits from the fp32 bits (torch's conversion would make every
#    NaN the canonical one). The ratio is counted against the fp16 bytes.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import math
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from torchckpt._errors import internal_error
from torchckpt._native import nvcomp as nv
from torchckpt._streams import current, on_device
from torchckpt.codecs.base import Codec, Deferred, Guarantee, Meta, Packed, on_stream

_ALIGN = 16  # NOTE [ Bitcomp ] Rule 8
_PLAN_CACHE_SIZE = 256  # NOTE [ Bitcomp ] Rule 7

# dtype -> (Bitcomp type, smallest subnormal, largest exact step): NOTE [ Bitcomp ] Rule 3
_LOSSY: dict[torch.dtype, tuple[int, float, float]] = {
    torch.float16: (nv.FP16, 2.0**-24, 2.0**5),
    torch.float32: (nv.FP32, 2.0**-149, 2.0**104),
    torch.float64: (nv.FP64, 2.0**-1074, 2.0**971),
}
_BF16_SUBNORMAL = 2.0**-133  # NOTE [ Bitcomp ] Rule 5
_FP16_NORMAL = 2.0**-14  # NOTE [ Bitcomp ] Rule 9


def _pow2_floor(v: float) -> float:
    """The largest power of two <= ``v`` (``v`` finite and > 0), exactly."""
    m, e = math.frexp(v)  # v = m * 2**e, 0.5 <= m < 1
    return math.ldexp(1.0, e - 1)


def _lossless_type(dtype: torch.dtype) -> int:
    """NOTE [ Bitcomp ] Rule 2: the integer type a dtype's bytes are compressed as."""
    size = dtype.itemsize // 2 if dtype.is_complex else dtype.itemsize
    signed = dtype.is_signed  # False for bool and unsigned integers, True for floating dtypes
    table = {1: (nv.U8, nv.S8), 2: (nv.U16, nv.S16), 4: (nv.U32, nv.S32), 8: (nv.U64, nv.S64)}
    pair = table.get(size)
    return nv.U8 if pair is None else pair[int(bool(signed))]


@dataclasses.dataclass(frozen=True, slots=True)
class _Recipe:
    """How one dtype is compressed: the dtype handed to nvCOMP, its Bitcomp type, mode and step."""

    work: torch.dtype
    btype: int
    mode: int
    step: float | None  # the quantization step passed to nvCOMP (lossy only)


def _recipe(dtype: torch.dtype, delta: float | None) -> _Recipe:
    if delta is None:
        return _Recipe(dtype, _lossless_type(dtype), nv.LOSSLESS, None)
    p = _pow2_floor(delta)
    if dtype == torch.bfloat16:  # NOTE [ Bitcomp ] Rule 5
        step = min(p, _LOSSY[torch.float32][2])
        if step < _BF16_SUBNORMAL:
            return _Recipe(dtype, _lossless_type(dtype), nv.LOSSLESS, None)
        return _Recipe(torch.float32, nv.FP32, nv.LOSSY_FP_TO_SIGNED, step)
    if dtype not in _LOSSY:
        raise TypeError(
            f"torchckpt: lossy Bitcomp(delta={delta!r}) supports float16, float32, float64 and bfloat16 tensors, "
            f"got {dtype}; pass Bitcomp() (lossless, any dtype) for this tensor, or cast it to a float dtype."
        )
    btype, tiny, cap = _LOSSY[dtype]
    if p < tiny:  # NOTE [ Bitcomp ] Rule 3
        return _Recipe(dtype, _lossless_type(dtype), nv.LOSSLESS, None)
    if dtype == torch.float16 and p < _FP16_NORMAL:  # NOTE [ Bitcomp ] Rule 9
        return _Recipe(torch.float32, nv.FP32, nv.LOSSY_FP_TO_SIGNED, p)
    return _Recipe(dtype, btype, nv.LOSSY_FP_TO_SIGNED, min(p, cap))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) if its address is a multiple of 16 bytes, else an aligned copy (NOTE [ Bitcomp ] Rule 8)."""
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


def _half_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float16).view(torch.int16).item()) & 0xFFFF


def _delta_arg(r: _Recipe) -> Any:
    """The step as nvCOMP's lossy entry point for ``r.btype`` takes it (fp16: its bits)."""
    if r.step is None:
        raise internal_error("a lossless Bitcomp recipe reached a lossy entry point")
    return _half_bits(r.step) if r.btype == nv.FP16 else r.step


def _trimmed(scratch: torch.Tensor, n: int, copy: bool = True) -> torch.Tensor:
    """The first ``n`` bytes of the worst-case buffer, in a buffer of their own or (``copy=False``) a view
    (NOTE [ Bitcomp ] Rule 6)."""
    if not 0 < n <= scratch.numel():
        raise internal_error(f"Bitcomp reported a compressed size of {n} bytes for a buffer of {scratch.numel()}")
    return scratch[:n].clone() if copy else scratch[:n]


def _to_bf16(y32: torch.Tensor) -> torch.Tensor:
    """Round fp32 to bf16 (nearest even), keeping NaN bits from the fp32 bits (NOTE [ Bitcomp ] Rule 5)."""
    yb = y32.to(torch.bfloat16)
    nan = torch.isnan(y32)
    top = torch.bitwise_right_shift(y32.view(torch.int32), 16).to(torch.int16)
    return torch.where(nan, top, yb.view(torch.int16)).view(torch.bfloat16)


def _to_fp16(y32: torch.Tensor) -> torch.Tensor:
    """Round fp32 to fp16 (nearest even), keeping NaN bits from the fp32 bits (NOTE [ Bitcomp ] Rule 9)."""
    yh = y32.to(torch.float16)
    nan = torch.isnan(y32)
    b = y32.view(torch.int32)
    sign = torch.bitwise_and(torch.bitwise_right_shift(b, 16), 0x8000)
    mant = torch.bitwise_and(torch.bitwise_right_shift(b, 13), 0x3FF)
    bits = torch.bitwise_or(torch.bitwise_or(sign, 0x7C00), mant).to(torch.int16)
    return torch.where(nan, bits, yh.view(torch.int16)).view(torch.float16)


def _narrow(y32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 decoded for a bf16 (NOTE [ Bitcomp ] Rule 5) or fp16 (NOTE [ Bitcomp ] Rule 9) tensor, back in ``dtype``."""
    return _to_bf16(y32) if dtype == torch.bfloat16 else _to_fp16(y32)


# -- device plans (NOTE [ Bitcomp ] Rule 7) -------------------------------------------------
class _PlanCache:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._plans: collections.OrderedDict[tuple[int, ...], tuple[ctypes.c_void_p, torch.cuda.Stream | None]] = (
            collections.OrderedDict())
        self._retired: list[tuple[ctypes.c_void_p, torch.cuda.Event]] = []
        self._captured: set[tuple[int, ...]] = set()  # plans a graph captured: never evicted (NOTE [ Bitcomp ] Rule 7)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def use(self, device: torch.device, nbytes: int, btype: int, mode: int, algo: int,
            stream: torch.cuda.Stream) -> Iterator[ctypes.c_void_p]:
        """The plan for these settings, bound to ``stream``, held under the lock while the body enqueues work."""
        lib = nv.library()
        key = (device.index or 0, nbytes, btype, mode, algo)
        with self._lock:
            self._reap(lib)
            entry = self._plans.pop(key, None)
            if entry is None:
                h = ctypes.c_void_p()
                nv.check(lib.bitcompCreatePlan(ctypes.byref(h), nbytes, btype, mode, algo), "bitcompCreatePlan")
                entry = (h, None)
            h, last = entry
            if last is not stream and (last is None or last != stream):  # NOTE [ Cheap streams ] Rule 1
                nv.check(lib.bitcompSetStream(h, ctypes.c_void_p(stream.cuda_stream)), "bitcompSetStream")
            self._plans[key] = (h, stream)
            if key not in self._captured and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
                self._captured.add(key)
            while len(self._plans) > max(self._capacity, len(self._captured)):
                gone = next(k for k in self._plans if k not in self._captured)  # least recently used, not captured
                old, old_stream = self._plans.pop(gone)
                ev = torch.cuda.Event()
                ev.record(old_stream if old_stream is not None else stream)
                self._retired.append((old, ev))
            yield h

    def _reap(self, lib: ctypes.CDLL) -> None:
        keep = []
        for h, ev in self._retired:
            if ev.query():
                lib.bitcompDestroyPlan(h)
            else:
                keep.append((h, ev))
        self._retired = keep

    def __len__(self) -> int:
        return len(self._plans)


_PLANS = _PlanCache(_PLAN_CACHE_SIZE)


@contextlib.contextmanager
def _host_plan(nbytes: int, btype: int, mode: int, algo: int) -> Iterator[ctypes.c_void_p]:
    lib = nv.library()
    h = ctypes.c_void_p()
    nv.check(lib.bitcompCreatePlan(ctypes.byref(h), nbytes, btype, mode, algo), "bitcompCreatePlan")
    try:
        yield h
    finally:
        lib.bitcompDestroyPlan(h)


_COMPRESS = {nv.FP16: "CompressLossy_fp16", nv.FP32: "CompressLossy_fp32", nv.FP64: "CompressLossy_fp64"}


def _compress_call(lib: Any, prefix: str, h: Any, r: _Recipe, src: torch.Tensor, dst: torch.Tensor) -> int:
    """nvCOMP's compress entry for the recipe: ``prefix`` "bitcomp" (device) or "bitcompHost"."""
    if r.mode == nv.LOSSLESS:
        return getattr(lib, prefix + "CompressLossless")(h, src.data_ptr(), dst.data_ptr())
    return getattr(lib, prefix + _COMPRESS[r.btype])(h, src.data_ptr(), dst.data_ptr(), _delta_arg(r))


class Bitcomp(Codec):
    """nvCOMP Bitcomp: lossless for any dtype, or lossy for fp16/fp32/fp64/bf16 with ``|x - x'| <= p/2``.

    ``p`` is the largest power of two <= ``delta``. NOTE [ Bitcomp ] says exactly what is
    guaranteed and how. CUDA tensors are compressed by nvCOMP's kernels on the given stream,
    CPU tensors by its host functions; both write the same format.

    Args:
        delta: ``None`` for lossless (bit-exact, any dtype), else the quantization step of the
            lossy mode, a finite number > 0.
        sparse: use Bitcomp's algorithm for very sparse data (mostly zeros).

    Example::

        >>> c = Bitcomp(delta=1e-3)
        >>> c.guarantee.describe()
        "lossy: |x - x'| <= 0.000488281 per element"
        >>> x = torch.sin(torch.linspace(0, 20, 100_000))
        >>> p = c.compress(x)
        >>> bool((c.decompress(p) - x).abs().max() <= c.guarantee.bound), p.ratio > 2
        (True, True)
        >>> torch.equal(Bitcomp().decompress(Bitcomp().compress(x)), x)
        True
    """

    name = "bitcomp"

    def __init__(self, delta: float | None = None, *, sparse: bool = False) -> None:
        if delta is not None:
            if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not (0 < delta < math.inf):
                raise ValueError(
                    f"torchckpt: Bitcomp delta must be a finite number > 0 (the lossy quantization step), got "
                    f"{delta!r}; for a lossless codec pass delta=None, i.e. Bitcomp()."
                )
            delta = float(delta)
        if not isinstance(sparse, bool):
            raise TypeError(f"torchckpt: Bitcomp sparse must be True or False, got {sparse!r}.")
        self.delta = delta
        self.sparse = sparse

    def __repr__(self) -> str:
        args = [] if self.delta is None else [f"delta={self.delta!r}"]
        if self.sparse:
            args.append("sparse=True")
        return f"Bitcomp({', '.join(args)})"

    @property
    def guarantee(self) -> Guarantee:
        """Lossless, or ``Guarantee("abs", p / 2)`` with ``p`` the largest power of two <= delta
        (NOTE [ Bitcomp ] Rules 3, 5)."""
        if self.delta is None:
            return Guarantee("lossless")
        return Guarantee("abs", _pow2_floor(self.delta) / 2)

    def supports(self, dtype: torch.dtype) -> bool:
        """Every dtype losslessly; fp16, bf16, fp32 and fp64 with a ``delta``."""
        return self.delta is None or dtype in _LOSSY or dtype == torch.bfloat16

    def unavailable_reason(self) -> str | None:
        """``None`` when nvCOMP's library loads (both paths), else what to install."""
        return nv.unavailable_reason()

    def capturable(self, device: torch.device) -> bool:
        """On CUDA with nvCOMP, ``compress_deferred`` is kernels only once its stream's plan exists (NOTE [ Captured
        saves ] Rule 4)."""
        return device.type == "cuda" and self.unavailable_reason() is None

    @property
    def _algo(self) -> int:
        return nv.SPARSE_ALGO if self.sparse else nv.DEFAULT_ALGO

    def compress(self, x: torch.Tensor, stream: torch.cuda.Stream | None = None) -> Packed:
        """Compress ``x`` (any layout, read as if contiguous) on ``stream``; see NOTE [ Bitcomp ]."""
        return self._compress(x, stream, deferred=False).packed

    def compress_deferred(self, x: torch.Tensor, stream: torch.cuda.Stream | None = None) -> Deferred:
        """``compress`` with a CUDA tensor's compressed size left on the device (NOTE [ Bitcomp ] Rule 6)."""
        return self._compress(x, stream, deferred=True)

    def settle(self, d: Deferred, values: Sequence[int]) -> Packed:
        """``compress``'s ``Packed`` from ``compress_deferred``'s and its size read back (a view of its buffer)."""
        if d.sizes is None:
            return d.packed
        self._check_packed(d.packed)
        (size,) = (int(v) for v in values)
        return Packed(_trimmed(d.packed.buffers[0], size, copy=False), d.packed.meta)

    def _compress(self, x: torch.Tensor, stream: torch.cuda.Stream | None, deferred: bool) -> Deferred:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"torchckpt: Bitcomp.compress needs a torch.Tensor, got {type(x).__name__}.")
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError(f"torchckpt: Bitcomp compresses CPU or CUDA tensors, got one on {x.device}; "
                             "move it with .cpu() or .cuda() first.")
        r = _recipe(x.dtype, self.delta)
        nv.library()  # a missing library is reported before any work
        with on_stream(stream, x.device, x):
            src = x.detach().contiguous().reshape(-1)
            if r.work != x.dtype:
                src = src.to(r.work)
            nbytes = src.numel() * src.element_size()
            size = None
            if nbytes == 0:
                data = torch.empty(0, dtype=torch.uint8, device=x.device)
            elif x.device.type == "cuda":
                data, size = self._compress_cuda(_aligned(src), r, nbytes)
                if not deferred:
                    data = _trimmed(data, int(size.item()))  # .item() waits for this stream only: NOTE [ Bitcomp ] Rule 6
                    size = None
            else:
                data = self._compress_host(_aligned(src), r, nbytes)
        meta = Meta(x.shape, x.dtype, self.name, types.MappingProxyType({
            "mode": "lossless" if r.mode == nv.LOSSLESS else "lossy",
            "delta": self.delta,
            "step": r.step,
            "bound": None if self.delta is None else self.guarantee.bound,
            "work_dtype": r.work,
            "bitcomp_type": r.btype,
            "bitcomp_mode": r.mode,
            "algo": self._algo,
            "nbytes": nbytes,
        }))
        return Deferred(Packed(data, meta), size)

    def _compress_cuda(self, src: torch.Tensor, r: _Recipe, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The worst-case buffer nvCOMP wrote and the compressed size (int64 on the device), nothing read back."""
        lib = nv.library()
        dev = src.device
        with on_device(dev):  # NOTE [ Cheap streams ] Rule 4
            s = current(dev.index)  # NOTE [ Cheap streams ] Rule 1
            scratch = torch.empty(lib.bitcompMaxBuflen(nbytes), dtype=torch.uint8, device=dev)
            size = torch.empty(1, dtype=torch.int64, device=dev)
            with _PLANS.use(dev, nbytes, r.btype, r.mode, self._algo, s) as h:
                nv.check(_compress_call(lib, "bitcomp", h, r, src, scratch), "Bitcomp compression")
                nv.check(lib.bitcompGetCompressedSizeAsync(scratch.data_ptr(), size.data_ptr(),
                                                           ctypes.c_void_p(s.cuda_stream)),
                         "bitcompGetCompressedSizeAsync")
            return scratch, size

    def _compress_host(self, src: torch.Tensor, r: _Recipe, nbytes: int) -> torch.Tensor:
        lib = nv.library()
        scratch = torch.empty(lib.bitcompMaxBuflen(nbytes), dtype=torch.uint8)
        with _host_plan(nbytes, r.btype, r.mode, self._algo) as h:
            nv.check(_compress_call(lib, "bitcompHost", h, r, src, scratch), "Bitcomp host compression")
        size = ctypes.c_size_t()
        nv.check(lib.bitcompGetCompressedSize(scratch.data_ptr(), ctypes.byref(size)), "bitcompGetCompressedSize")
        return _trimmed(scratch, int(size.value))

    def decompress(self, p: Packed, out: torch.Tensor | None = None,
                   stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Decode ``p`` into ``out`` (a new tensor when ``None``) on ``stream``; never synchronizes."""
        self._check_packed(p)
        if len(p.buffers) != 1:
            raise internal_error(f"Bitcomp packed form has {len(p.buffers)} buffers, expected 1")
        prm = p.meta.params
        work, btype, mode, algo, nbytes = (prm["work_dtype"], int(prm["bitcomp_type"]), int(prm["bitcomp_mode"]),
                                           int(prm["algo"]), int(prm["nbytes"]))
        out = self._output(p, out)
        if nbytes != out.numel() * work.itemsize:
            raise internal_error(f"Bitcomp meta says {nbytes} bytes for {out.numel()} elements of {work}")
        if nbytes == 0:
            return out
        nv.library()
        buf = p.buffers[0]
        with on_stream(stream, p.device, buf):
            buf = buf if buf.data_ptr() % 8 == 0 else buf.clone()  # NOTE [ Bitcomp ] Rule 8
            direct = work == out.dtype and out.is_contiguous() and out.data_ptr() % _ALIGN == 0
            flat = out.view(-1) if direct else torch.empty(out.numel(), dtype=work, device=out.device)
            if p.device.type == "cuda":
                self._decompress_cuda(buf, flat, btype, mode, algo, nbytes)
            else:
                self._decompress_host(buf, flat, btype, mode, algo, nbytes)
            if not direct:
                y = _narrow(flat, out.dtype) if work != out.dtype else flat
                out.copy_(y.view(out.shape))
        return out

    def _decompress_cuda(self, buf: torch.Tensor, flat: torch.Tensor, btype: int, mode: int, algo: int,
                         nbytes: int) -> None:
        lib = nv.library()
        dev = flat.device
        with on_device(dev):  # NOTE [ Cheap streams ] Rule 4
            s = current(dev.index)  # NOTE [ Cheap streams ] Rule 1
            with _PLANS.use(dev, nbytes, btype, mode, algo, s) as h:
                nv.check(lib.bitcompUncompress(h, buf.data_ptr(), flat.data_ptr()), "Bitcomp decompression")

    def _decompress_host(self, buf: torch.Tensor, flat: torch.Tensor, btype: int, mode: int, algo: int,
                         nbytes: int) -> None:
        lib = nv.library()
        csize, usize = ctypes.c_size_t(buf.numel()), ctypes.c_size_t()
        ty, md, al = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        rc = lib.bitcompGetCompressedInfo(buf.data_ptr(), ctypes.byref(csize), ctypes.byref(usize), ctypes.byref(ty),
                                          ctypes.byref(md), ctypes.byref(al))
        if rc != 0 or usize.value != nbytes or ty.value != btype or md.value != mode:
            raise ValueError(
                f"torchckpt: this Bitcomp buffer does not hold what its meta says (expected {nbytes} bytes of "
                f"type {btype}, mode {mode}; the stream header says "
                f"{'unreadable' if rc else f'{usize.value} bytes of type {ty.value}, mode {md.value}'}). "
                "Pass the Packed returned by Bitcomp.compress, unmodified."
            )
        with _host_plan(nbytes, btype, mode, algo) as h:
            nv.check(lib.bitcompHostUncompress(h, buf.data_ptr(), flat.data_ptr()), "Bitcomp host decompression")
