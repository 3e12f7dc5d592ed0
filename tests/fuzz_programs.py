"""Random programs for the differential fuzzer (tests/test_fuzz.py): the vocabulary, the
interpreter, the policy/store settings and the comparison with plain autograd.

A ``Program`` is a few leaf inputs that require grad and a list of ``Op`` values applied to a
growing list of tensors; every tensor left at the end enters a scalar loss. An op names its
operands by position from the end of that list (``a``, ``b``, taken modulo its length) and
carries one small integer ``k`` that picks its variant, so every draw is a valid program and
hypothesis shrinks it freely. ``repr(program)`` is Python you can paste back::

    from fuzz_programs import *
    check(Program(...), device="cpu")              # every setting
    check(Program(...), settings=[Setting("ctx", "evicted")])

# NOTE [ Fuzzer semantics ]
# 1. Ops never fail on the tensors they get: each shapes its operands to what it needs with
#    ``take`` (a view of the flattened prefix; repeated when too short) and ``fp`` (the real
#    view of a complex tensor, cast to the program's dtype when needed).
# 2. An in-place op acts on a clone instead when plain autograd would refuse it or when it
#    would break a rule of checkpointing rather than of the store: the target is a leaf or a
#    view of one, an output of chunk/split/unbind or a view of one, a tensor whose storage
#    has such views, a tensor with internal overlap (expand, overlapping as_strided), or a
#    tensor whose storage was made before the current segment (a checkpointed function must
#    not modify its inputs). This depends only on the program and on the interpreter's state
#    at the segment's start, so every run, recomputations included, executes the same ops.
# 3. An in-place op that would modify a tensor autograd has saved also acts on a clone, unless
#    the op is marked ``clobber=True`` (drawn rarely; the ``clobber`` op always modifies what it
#    just saved). ``resolve`` finds those ops with a probe run of plain autograd that watches
#    the version counter and the bytes of every saved tensor. So most programs are valid, and
#    the invalid ones are deliberate: plain autograd raises "one of the variables needed for
#    gradient computation has been modified by an inplace operation", and so must every store
#    setting. An op that changes a saved tensor's bytes *without* bumping its version counter
#    (an in-place op on an ``unsafe_chunk`` piece of a tensor saved whole) always acts on a
#    clone: plain autograd then silently uses the new bytes while a copy holds the old ones;
#    that is the documented hazard of ``unsafe_chunk``, outside what any store can promise.
# 4. A setting runs the program's segments (``Program.cuts``) under a layout of policies. Its
#    *twin* is the same layout with each store replaced by reference hooks (``Hooks(None)``):
#    saved tensors kept by reference, their version checked at unpack as plain autograd does,
#    i.e. a perfect store. Offload(store) and offload(store) become those hooks,
#    Recompute(store=s) becomes Recompute() inside them. The twin is the reference for the
#    setting, bit for bit, errors included: inside a Recompute block torch.utils.checkpoint
#    recomputes, so a tensor modified there after it was saved raises nothing, in the twin
#    and in the setting alike. Each twin is checked against plain autograd: bit for bit when
#    it has no Recompute block (errors included); with one, only when plain autograd
#    succeeds, and gradients within ``RECOMPUTE_TOL``: torch.utils.checkpoint may add a
#    tensor's gradient contributions in another order than plain autograd does.
# 5. A setting with a store runs the program ``steps`` times with that one store: the first
#    step records the trace, later ones follow the prefetch plan made from it. Each step builds
#    fresh leaves and parameters (same seed) and seeds the RNG the same way (dropout).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import torchckpt
from torchckpt import Keep, Offload, Recompute
from torchckpt.codecs import Identity

VERSION_PHRASE = "modified by an inplace operation"
# torch.utils.checkpoint can sum a tensor's gradient contributions in another order than plain
# autograd (ulp-level differences): a Recompute twin's gradients are checked against plain
# autograd to this fraction of their largest magnitude, the setting against its twin bit for bit.
RECOMPUTE_TOL = 1e-2
CAP = 192  # elements: an op output longer than this is cut to a prefix view
SHAPES = ((4, 6), (3, 8), (2, 3, 4), (12,), (6, 4), (8,), (2, 8), (5, 4))
DTYPES = ("float32", "float64")


# -- programs ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Op:
    """One step: ``name`` applied to operands ``a`` and ``b`` (positions from the end), variant ``k``."""

    name: str
    a: int = 0
    b: int = 1
    k: int = 0
    clobber: bool = False  # NOTE [ Fuzzer semantics ] Rule 3

    def __repr__(self) -> str:
        tail = ", clobber=True" if self.clobber else ""
        return f"Op({self.name!r}, {self.a}, {self.b}, {self.k}{tail})"


@dataclasses.dataclass(frozen=True)
class Program:
    """Leaf inputs of ``shapes`` in ``dtype``, then ``ops``; ``cuts`` split the ops into segments."""

    ops: tuple[Op, ...]
    dtype: str = "float32"
    shapes: tuple[tuple[int, ...], ...] = ((4, 6),)
    cuts: tuple[int, ...] = ()
    seed: int = 0

    def __repr__(self) -> str:
        ops = ", ".join(map(repr, self.ops))
        return (f"Program(ops=({ops},), dtype={self.dtype!r}, shapes={self.shapes!r}, "
                f"cuts={self.cuts!r}, seed={self.seed})")

    @property
    def segments(self) -> list[tuple[int, int]]:
        bounds = [0, *sorted(c for c in set(self.cuts) if 0 < c < len(self.ops)), len(self.ops)]
        return list(zip(bounds[:-1], bounds[1:]))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


# -- shaping helpers (NOTE [ Fuzzer semantics ] Rule 1) ----------------------------------------
def take(x: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` elements of ``x`` as a flat tensor: a prefix view when ``x`` is long enough."""
    flat = x.reshape(-1)
    if flat.numel() >= n:
        return flat[:n]
    if flat.numel() == 0:
        return torch.zeros(n, dtype=x.dtype, device=x.device)
    return flat.repeat(-(-n // flat.numel()))[:n]


def real(x: torch.Tensor) -> torch.Tensor:
    """The real view of a complex tensor (resolving a conj bit first), else ``x``."""
    if x.is_complex():
        return torch.view_as_real(x.resolve_conj())
    return x


def fp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A real floating tensor of float32 or float64 (``dtype`` when a cast is needed)."""
    x = real(x)
    if x.dtype not in (torch.float32, torch.float64):
        x = x.to(dtype)
    return x


def like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` shaped as ``x`` (elementwise partner), real unless ``x`` is complex."""
    if y.is_complex() and not x.is_complex():
        y = y.real
    if x.is_complex() and not y.is_complex() and x.dtype == torch.complex64 and y.dtype == torch.float64:
        y = y.float()
    return take(y, x.numel()).view(x.shape)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 8) + 1) if n % d == 0]


def two_d(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` as a matrix (r, n // r) with r a divisor of numel picked by ``k``."""
    n = x.numel()
    ds = divisors(n) or [1]
    r = ds[k % len(ds)]
    return x.reshape(r, n // r)


# -- run state ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Meta:
    """Where a tensor's storage was made (segment; -1: a leaf) and which storage it is (the
    index of the first value that held it)."""

    seg: int
    sid: int


class Invalidates(Exception):
    """Raised by the probe: the op at ``index`` modified a tensor autograd had saved."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


class Ctx:
    """What an op sees while it runs: its parameters, the program dtype, the in-place rules."""

    def __init__(self, prog: Program, params: dict[int, dict[str, Any]], clones: frozenset[int],
                 probe: list[tuple[torch.Tensor, int]] | None) -> None:
        self.prog = prog
        self.dtype = prog.torch_dtype
        self.params = params
        self.clones = clones
        self.probe = probe  # saved tensors, while resolving (Rule 3)
        self.seg = 0
        self.index = 0
        self.op: Op = prog.ops[0] if prog.ops else Op("id")
        self._before: list[tuple[int, torch.Tensor]] | None = None
        self.lines: list[str] = []
        self.multi_sids: set[int] = set()  # storages with multi-output views

    @property
    def p(self) -> dict[str, Any]:
        return self.params[self.index]

    def target(self, x: torch.Tensor, meta: Meta) -> torch.Tensor:
        """The tensor an in-place op modifies: ``x``, or a clone of it (Rules 2-3)."""
        base = x._base if x._base is not None else x
        structural = (
            meta.seg != self.seg
            or meta.sid in self.multi_sids
            or (base.is_leaf and base.requires_grad)
            or torch._debug_has_internal_overlap(x) != 0
        )
        if structural or self.index in self.clones:
            return x.clone()
        if self.probe is not None:
            self._before = [(t._version, _bits(t)) for t, _ in self.probe]
        return x

    def modified(self) -> None:
        """Called after the in-place op: in the probe, find out whether it hit a saved tensor."""
        if self._before is not None and self.probe is not None:
            before, self._before = self._before, None
            for (t, _), (v, b) in zip(self.probe, before):
                if t._version != v and not self.op.clobber:
                    raise Invalidates(self.index)  # Rule 3
                if t._version == v and not torch.equal(_bits(t), b):
                    raise Invalidates(self.index)  # Rule 3: bytes changed behind the version counter


# -- the vocabulary ----------------------------------------------------------------------------
# Each op: fn(ctx, x, y, k) -> tensor or list of tensors. ``x``/``y`` are (tensor, Meta) pairs
# where an op modifies in place; others get plain tensors. VIEW ops return views of ``x``.
OPS: dict[str, Callable[..., Any]] = {}
INPLACE: set[str] = set()
MULTI: set[str] = set()  # outputs are views that autograd forbids modifying in place
PARAMS: dict[str, Callable[[torch.Generator, torch.dtype, int], dict[str, Any]]] = {}


def op(name: str, inplace: bool = False, multi: bool = False,
       params: Callable[[torch.Generator, torch.dtype, int], dict[str, Any]] | None = None) -> Callable:
    def deco(fn: Callable) -> Callable:
        OPS[name] = fn
        if inplace:
            INPLACE.add(name)
        if multi:
            MULTI.add(name)
        if params is not None:
            PARAMS[name] = params
        return fn
    return deco


def _randn(g: torch.Generator, dtype: torch.dtype, *shape: int, scale: float = 0.5) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


@op("view")
def _view(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    n = x.numel()
    ds = divisors(n)
    d = ds[k % len(ds)]
    shapes = [(n,), (d, n // d), (n // d, d), (1, d, n // d)]
    return x.reshape(shapes[(k // 8) % len(shapes)])


@op("transpose")
def _transpose(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    if x.dim() < 2:
        x = two_d(x, k + 1)
    if k % 3 == 0:
        return x.transpose(0, -1)
    if k % 3 == 1:
        return x.mT
    return x.permute(*reversed(range(x.dim())))


@op("slice")
def _slice(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    if x.dim() == 0:
        x = x.reshape(1)
    d = k % x.dim()
    step = 1 + (k // 4) % 3
    start = (k // 16) % 2 if x.shape[d] > 1 else 0
    return x[(slice(None),) * d + (slice(start, None, step),)]


def _pieces(x: torch.Tensor, k: int) -> tuple[torch.Tensor, int, int]:
    if x.dim() == 0:
        x = x.reshape(1)
    d = k % x.dim()
    n = 2 + (k // 4) % 3
    return x, d, n


@op("unbind", multi=True)
def _unbind(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> list[torch.Tensor]:
    x, d, _ = _pieces(x, k)
    return list(x.narrow(d, 0, min(x.shape[d], 4)).unbind(d))


@op("chunk", multi=True)
def _chunk(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> list[torch.Tensor]:
    x, d, n = _pieces(x, k)
    return list(x.chunk(n, d))


@op("split", multi=True)
def _split(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> list[torch.Tensor]:
    x, d, n = _pieces(x, k)
    return list(x.split(max(1, x.shape[d] // n), d))[:4]


@op("unsafe_chunk")
def _unsafe_chunk(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> list[torch.Tensor]:
    x, d, n = _pieces(x, k)
    if k % 2:
        return list(torch.Tensor.unsafe_split(x, max(1, x.shape[d] // n), d))[:4]
    return list(torch.Tensor.unsafe_chunk(x, n, d))


@op("expand")
def _expand(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    d = k % (x.dim() + 1)
    u = x.unsqueeze(d)
    size = list(u.shape)
    size[d] = 2 + k % 2
    return u.expand(*size)


@op("as_strided")
def _as_strided(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    c = x if x.is_contiguous() else x.contiguous()
    n = c.numel()
    off = c.storage_offset()
    if n < 3:
        return c.as_strided((n,), (1,), off)
    mode = k % 3
    if mode == 0:  # every other element
        return c.as_strided(((n + 1) // 2,), (2,), off)
    if mode == 1:  # a transposed matrix view
        r = 2 if n % 2 == 0 else 1
        return c.as_strided((n // r, r), (1, n // r), off)
    return c.as_strided((n - 1, 2), (1, 1), off)  # overlapping windows


@op("dtype_view")
def _dtype_view(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """Dtype views: an integer view round trip, and a reinterpreted storage saved as a factor."""
    xr = fp(x, ctx.dtype)
    d = xr.detach().resolve_neg()  # a tensor with the neg bit set has no dtype views
    mode = k % 3
    if mode == 0:  # truncate mantissas through an int view of a fresh copy, then multiply
        c = d.clone()
        iv = c.view(torch.int32 if c.dtype == torch.float32 else torch.int64)
        iv.bitwise_and_(~0xFFF)
        return xr * iv.view(c.dtype)
    if mode == 1:  # float view round trip of the same storage (no copy) as a saved factor
        it = torch.int32 if d.dtype == torch.float32 else torch.int64
        return xr * d.view(it).view(d.dtype)
    # float32 storage seen as float64 (and back): both views saved
    c = take(d, 2 * max(1, xr.numel() // 2)).to(torch.float32).clone()
    wide = c.view(torch.float64)
    narrow = wide.view(torch.float32)
    t = take(xr, c.numel())
    return (t * narrow).to(torch.float64)[: wide.numel()] * wide[: t.numel()]


@op("complex")
def _complex(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """Into and out of complex: view_as_complex, .real/.imag, view_as_real."""
    if x.is_complex():
        mode = k % 4
        if mode == 0:
            return x.real
        if mode == 1:
            return x.imag
        if mode == 2:
            return torch.view_as_real(x.resolve_conj())
        return x.abs()
    xr = fp(x, ctx.dtype)
    n = 2 * max(1, xr.numel() // 2)
    t = take(xr, n)
    if t.storage_offset() % 2 or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return torch.view_as_complex(t.view(n // 2, 2))


@op("conj")
def _conj(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """Conj and neg views: ``.conj()``, ``.conj().imag`` (neg bit), products with them."""
    if not x.is_complex():
        xr = fp(x, ctx.dtype)
        n = 2 * max(1, xr.numel() // 2)
        x = torch.view_as_complex(take(xr, n).clone().view(n // 2, 2))
    mode = k % 5
    if mode == 0:
        return x.conj()
    if mode == 1:
        return x.conj().imag  # neg bit
    if mode == 2:
        w = like(y, x) if y.is_complex() else x
        return x * w.conj()  # mul saves the conj view
    if mode == 3:
        return x.conj().imag * fp(like(y, x.real), x.real.dtype)  # saves a neg view
    m = two_d(x, k // 5)
    return m @ m.mH  # saves a conj-transposed view


@op("fft", params=lambda g, dt, k: {"w": torch.complex(_randn(g, dt, 2, 3), _randn(g, dt, 2, 3))})
def _fft(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """The spectral convolution of a Fourier neural operator: rfft, keep modes, weight, irfft."""
    if x.is_complex() and k % 2:
        return torch.fft.irfft(take(x, 5).view(1, 5), n=8)
    xr = take(fp(x, ctx.dtype), 16).view(2, 8).to(ctx.dtype)
    xf = torch.fft.rfft(xr, dim=-1)
    if k % 3 == 0:
        return xf
    out = xf[:, :3] * ctx.p["w"]
    return torch.fft.irfft(out, n=8, dim=-1)


@op("unary")
def _unary(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    if x.is_complex():
        fns: list[Callable[[torch.Tensor], torch.Tensor]] = [torch.sin, torch.exp, lambda t: t * t, torch.tanh]
        return fns[k % len(fns)](x * 0.5)
    fns = [torch.sin, torch.tanh, torch.sigmoid, lambda t: t * t, lambda t: torch.exp(t.tanh()),
           lambda t: torch.rsqrt(t * t + 1), torch.relu, F.gelu, lambda t: torch.softmax(t, -1),
           lambda t: t.abs().pow(1.5), lambda t: t.sum(-1, keepdim=True)]
    return fns[k % len(fns)](x)


@op("layer_norm")
def _layer_norm(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    xr = fp(x, ctx.dtype)
    if xr.dim() == 0:
        xr = xr.reshape(1)
    return F.layer_norm(xr, xr.shape[-1:]) if k % 2 else torch.logsumexp(xr, -1)


@op("binary")
def _binary(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    w = like(y, x)
    fns: list[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = [
        torch.mul, torch.add, lambda a, b: a / (b * b + 1), torch.sub, lambda a, b: a * b.tanh() + a]
    if not x.is_complex() and not w.is_complex():
        fns += [torch.maximum, lambda a, b: torch.where(b > 0, a, a * b), torch.atan2]
    return fns[k % len(fns)](x, w)


@op("matmul", params=lambda g, dt, k: {"w": _randn(g, dt, 8, 4), "lw": _randn(g, dt, 4, 8), "lb": _randn(g, dt, 4)})
def _matmul(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    mode = k % 4
    if x.is_complex() and mode >= 2:
        x = x.real
    if mode == 0:
        m = two_d(x, k // 4)
        return m @ (m.mH if m.is_complex() else m.mT)  # saves a tensor and its transpose
    if mode == 1:
        m = two_d(x, k // 4)
        return (m.mH if m.is_complex() else m.mT) @ m
    xr = take(fp(x, ctx.dtype), 16).view(2, 8).to(ctx.dtype)
    if mode == 2:
        return xr @ ctx.p["w"]
    return F.linear(xr, ctx.p["lw"], ctx.p["lb"])  # saves weight.t(): a view of a parameter


@op("cast")
def _cast(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    if x.is_complex():
        return x.to(torch.complex128 if x.dtype == torch.complex64 else torch.complex64)
    targets = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
    t = targets[k % len(targets)]
    if t == x.dtype:
        t = torch.float32 if x.dtype == torch.float64 else torch.float64
    out = x.to(t)
    return out * out if k % 3 == 0 else out


@op("dropout")
def _dropout(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    xr = fp(x, ctx.dtype)
    if k % 2:
        return nn.functional.dropout(xr, p=0.3, training=True)
    return torch.nn.Dropout(0.5)(xr * 1.0)


@op("sdpa")
def _sdpa(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    b, h, t, d = 1, 2, 4, 4
    q, kk, v = take(fp(x, ctx.dtype), 3 * b * h * t * d).view(3, b, h, t, d).unbind(0)
    if k % 4 == 3:  # keys and values from the other operand
        kk = take(fp(y, ctx.dtype), b * h * t * d).view(b, h, t, d).to(q.dtype)
    return F.scaled_dot_product_attention(q, kk, v, is_causal=bool(k % 2), dropout_p=0.2 if k % 4 == 2 else 0.0)


def _bn_params(g: torch.Generator, dt: torch.dtype, k: int) -> dict[str, Any]:
    m = nn.BatchNorm1d(3)
    with torch.no_grad():
        m.weight.copy_(1 + _randn(g, torch.float32, 3))
        m.bias.copy_(_randn(g, torch.float32, 3))
    m = m.to(dt)
    return {"m": m, "w": m.weight, "b": m.bias, "rm": torch.zeros(3, dtype=dt), "rv": torch.ones(3, dtype=dt)}


@op("batch_norm", params=_bn_params)
def _batch_norm(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    xr = take(fp(x, ctx.dtype), 24).to(ctx.dtype)
    xr = xr.view(2, 3, 4) if k % 2 else xr.view(8, 3)
    p = ctx.p
    if k % 4 < 2:
        return p["m"](xr)  # train mode: batch statistics, running stats updated
    return F.batch_norm(xr, p["rm"], p["rv"], p["w"], p["b"], training=True, momentum=0.1)


RNN_IN, RNN_H = 4, 5


def _rnn_params(g: torch.Generator, dt: torch.dtype, k: int) -> dict[str, Any]:
    kind = [nn.GRUCell, nn.LSTMCell, nn.GRU, nn.LSTM][k % 4]
    m = kind(RNN_IN, RNN_H)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(_randn(g, torch.float32, *p.shape))
    return {"m": m.to(dt)}


@op("rnn", params=_rnn_params)
def _rnn(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> list[torch.Tensor]:
    """nn.GRUCell, nn.LSTMCell, nn.GRU, nn.LSTM (ATen's cells split gates with unsafe_chunk)."""
    m = ctx.p["m"]
    dt = ctx.dtype
    with_h = (k // 4) % 2 == 1
    if k % 4 < 2:
        inp = take(fp(x, dt), 2 * RNN_IN).view(2, RNN_IN).to(dt)
        h = take(fp(y, dt), 2 * RNN_H).view(2, RNN_H).to(dt).contiguous() if with_h else None
        if k % 4 == 0:
            return [m(inp, h)]
        return list(m(inp, None if h is None else (h, h * 0.5)))
    inp = take(fp(x, dt), 3 * 2 * RNN_IN).view(3, 2, RNN_IN).to(dt)
    h = take(fp(y, dt), 2 * RNN_H).view(1, 2, RNN_H).to(dt).contiguous() if with_h else None  # cuDNN wants it
    if k % 4 == 2:
        out, hn = m(inp, h)
        return [out, hn]
    out, (hn, cn) = m(inp, None if h is None else (h, h.tanh()))
    return [out, hn, cn]


@op("lstm_cell", params=lambda g, dt, k: {"w": _randn(g, dt, 4 * RNN_H, RNN_IN), "u": _randn(g, dt, 3 * RNN_H, RNN_H)})
def _lstm_cell(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Gates as ATen's cells make them: unsafe_chunk, then in-place activations on each chunk."""
    dt = ctx.dtype
    inp = take(fp(x, dt), 2 * RNN_IN).view(2, RNN_IN).to(dt)
    cx = take(fp(y, dt), 2 * RNN_H).view(2, RNN_H).to(dt)
    if k % 2 == 0:
        gates = F.linear(inp, ctx.p["w"])
        i, f, g, o = gates.unsafe_chunk(4, 1)
        i.sigmoid_()
        f.sigmoid_()
        g.tanh_()
        o.sigmoid_()
        c = f * cx + i * g
        return [o * c.tanh(), c]
    gi = F.linear(inp, ctx.p["w"][: 3 * RNN_H])
    gh = F.linear(cx, ctx.p["u"])
    ir, iz, in_ = gi.unsafe_chunk(3, 1)
    hr, hz, hn = gh.unsafe_chunk(3, 1)
    r = ir.add_(hr).sigmoid_()
    z = iz.add_(hz).sigmoid_()
    n = in_.addcmul_(r, hn).tanh_()
    return [(cx - n).mul_(z).add_(n)]


@op("inplace", inplace=True)
def _inplace(ctx: Ctx, x: tuple[torch.Tensor, Meta], y: tuple[torch.Tensor, Meta], k: int) -> list[torch.Tensor]:
    """An in-place op on an existing tensor or on a view of it (slice, unsafe_chunk piece,
    transpose), or a write through ``.data`` (no version counter moves, as optimizers and
    torchdiffeq's stage buffers do)."""
    t = ctx.target(*x)
    via = k // 8
    v = t
    if via == 1 and t.dim() > 0 and t.shape[0] > 1:
        v = t[1::2]
    elif via == 2 and t.dim() > 0 and t.shape[-1] > 1:
        v = torch.Tensor.unsafe_chunk(t, 2, -1)[k % 2]
    elif via == 3 and t.dim() > 1:
        v = t.transpose(0, -1)
    elif via == 5:
        v = t.data
    elif via == 6 and t.dim() > 0 and t.shape[0] > 1:
        v = t.data[1::2]
    w = like(y[0], v)
    if not v.requires_grad:
        w = w.detach()
    if w.untyped_storage().data_ptr() == v.untyped_storage().data_ptr():
        w = w.clone()  # a partly overlapping operand is refused by in-place ops
    if w.dtype.is_floating_point and v.dtype.is_floating_point and w.dtype != v.dtype:
        w = w.to(v.dtype)
    if v.is_complex() and w.is_complex() and w.dtype != v.dtype:
        w = w.to(v.dtype)
    if v.is_complex() and not w.is_complex() and w.dtype != v.real.dtype:
        w = w.to(v.real.dtype)
    mode = k % 8
    if mode == 0:
        v.add_(w)
    elif mode == 1:
        v.mul_(w)
    elif mode == 2:
        v.sigmoid_()
    elif mode == 3:
        v.mul_(1.5)
    elif mode == 4:
        v.tanh_()
    elif mode == 5:
        v.addcmul_(w, w, value=0.5)
    elif mode == 6:
        v.div_(w * w + 1) if not v.is_complex() else v.sub_(w)
    else:
        v.exp_() if v.is_complex() else v.clamp_(min=-0.5)
    ctx.modified()
    return [t] if v is t else [t, v]


@op("dropout_", inplace=True)
def _dropout_inplace(ctx: Ctx, x: tuple[torch.Tensor, Meta], y: tuple[torch.Tensor, Meta], k: int) -> torch.Tensor:
    t = ctx.target(*x)
    if t.is_complex() or not t.dtype.is_floating_point:
        t = t.clone().mul_(2)
    else:
        F.dropout(t, p=0.25, training=True, inplace=True)
    ctx.modified()
    return t


@op("clobber")
def _clobber(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """Deliberately modify a tensor autograd just saved (plain autograd raises at backward)."""
    xr = fp(x, ctx.dtype)
    mode = k % 6
    if mode == 0:  # sigmoid saves its result
        s = xr.sigmoid()
        s.mul_(1.5)
        return s
    if mode == 1:  # mul saves its operand; modify it through a slice view
        p = xr * 1.0
        out = p * p.tanh()
        p.reshape(-1)[::2].add_(1.0)
        return out
    if mode == 2:  # through a detached integer view (shares the version counter)
        s = xr.exp()
        s.detach().view(torch.int32 if s.dtype == torch.float32 else torch.int64).bitwise_xor_(1)
        return s
    if mode == 3:  # a saved unsafe_chunk piece
        g = take(xr, 8).view(2, 4) * 1.0
        a, b = g.unsafe_chunk(2, 1)
        a.sigmoid_()
        b.tanh_()
        out = a * b
        a.mul_(2.0)
        return out
    if mode == 4:  # a conj view saved by mul, modified through the base
        n = 2 * max(1, xr.numel() // 2)
        z = torch.view_as_complex(take(xr, n).clone().view(n // 2, 2))
        out = z * z.conj()
        z.mul_(2)
        return out
    t = xr * 1.0  # sin saves its input; the input is modified
    out = torch.sin(t)
    t.add_(1.0)
    return out


# -- building and running ------------------------------------------------------------------------
def seed_all(seed: int, device: str) -> None:
    """Seed the RNGs the program draws from (dropout). Not ``torch.manual_seed``: without CUDA
    initialized, that queues a lazy CUDA seeding call (with a stack trace) every time."""
    torch.default_generator.manual_seed(seed)
    if device != "cpu":
        torch.cuda.manual_seed_all(seed)


def build(prog: Program, device: str) -> tuple[list[torch.Tensor], dict[int, dict[str, Any]]]:
    """Fresh leaf inputs and per-op parameters, the same for every call with the same program."""
    g = torch.Generator().manual_seed(prog.seed)
    dt = prog.torch_dtype
    leaves = [(torch.randn(*s, generator=g, dtype=torch.float64)).to(dt).to(device).requires_grad_(True)
              for s in prog.shapes]
    params: dict[int, dict[str, Any]] = {}
    for i, o in enumerate(prog.ops):
        make = PARAMS.get(o.name)
        if make is None:
            continue
        pg = torch.Generator().manual_seed(prog.seed * 7919 + i)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(prog.seed + i)
            p = make(pg, dt, o.k)
        moved: dict[str, Any] = {}
        for name, v in p.items():
            if isinstance(v, nn.Module):
                moved[name] = v.to(device)
            elif isinstance(v, nn.Parameter):
                continue  # a module's parameter: taken from the moved module below
            else:
                moved[name] = v.to(device).requires_grad_(v.is_floating_point() or v.is_complex()) \
                    if name not in ("rm", "rv") else v.to(device)
        if "m" in moved and "w" in p and isinstance(p["w"], nn.Parameter):
            moved["w"], moved["b"] = moved["m"].weight, moved["m"].bias
        params[i] = moved
    return leaves, params


def param_tensors(params: dict[int, dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor that gets a gradient, named ``op<i>.<name>``, in a fixed order."""
    out: list[tuple[str, torch.Tensor]] = []
    for i in sorted(params):
        seen: set[int] = set()
        for name, v in params[i].items():
            ts = list(v.named_parameters()) if isinstance(v, nn.Module) else [("", v)]
            for sub, t in ts:
                if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in seen:
                    seen.add(id(t))
                    out.append((f"op{i}.{name}{'.' + sub if sub else ''}", t))
    return out


def _apply(ctx: Ctx, vals: list[torch.Tensor], metas: list[Meta], i: int) -> None:
    """Run op ``i``, appending its outputs (and their metas) to ``vals``."""
    o = ctx.prog.ops[i]
    ctx.index, ctx.op = i, o
    n = len(vals)
    ia, ib = n - 1 - o.a % n, n - 1 - o.b % n
    fn = OPS[o.name]
    if o.name in INPLACE:
        res = fn(ctx, (vals[ia], metas[ia]), (vals[ib], metas[ib]), o.k)
    else:
        res = fn(ctx, vals[ia], vals[ib], o.k)
    outs = res if isinstance(res, list) else [res]
    for t in outs:
        if t.numel() > CAP:
            t = t.reshape(-1)[:CAP]
        meta = Meta(ctx.seg, len(vals))
        if t.numel() > 0:  # a view of a storage some live value holds: that storage's meta
            ptr = t.untyped_storage().data_ptr()
            for v, m in zip(reversed(vals), reversed(metas)):
                if v.numel() > 0 and v.untyped_storage().data_ptr() == ptr:
                    meta = m
                    break
        if o.name in MULTI:
            ctx.multi_sids.add(meta.sid)
        vals.append(t)
        metas.append(meta)
    names = ", ".join(f"v{j}" for j in range(n, len(vals)))
    ctx.lines.append(f"{names} = {o.name}(v{ia}, v{ib}, k={o.k}){'  # clobber' if o.clobber else ''}"
                     f"{'  # cloned (Rule 3)' if i in ctx.clones else ''}")


class Plain:
    """Call the block as it is."""

    def call(self, fn: Callable[..., Any], *args: torch.Tensor) -> Any:
        return fn(*args)

    def __repr__(self) -> str:
        return "Plain()"


def _ref_pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    return t, t._version


def _ref_unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    t, version = packed
    if t._version != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been {VERSION_PHRASE} "
            f"(fuzzer reference hooks: version {t._version}, saved at {version})")
    return t


class Hooks:
    """``torchckpt.offload(store)`` around the block; with no store, the reference hooks: saved
    tensors kept by reference and their version checked at unpack, as plain autograd does
    (NOTE [ Fuzzer semantics ] Rule 4)."""

    def __init__(self, store: torchckpt.Store | None) -> None:
        self.store = store

    def cm(self) -> Any:
        if self.store is None:
            return torch.autograd.graph.saved_tensors_hooks(_ref_pack, _ref_unpack)
        return torchckpt.offload(self.store)

    def call(self, fn: Callable[..., Any], *args: torch.Tensor) -> Any:
        with self.cm():
            return fn(*args)

    def __repr__(self) -> str:
        return "Hooks(store)" if self.store is not None else "Hooks(None)"


class Pol:
    """``torchckpt.checkpoint(fn, *args, policy=policy)``, optionally inside ``Hooks(None)``."""

    def __init__(self, policy: Any, ref_hooks: bool = False) -> None:
        self.policy = policy
        self.ref_hooks = ref_hooks

    def call(self, fn: Callable[..., Any], *args: torch.Tensor) -> Any:
        if self.ref_hooks:
            with Hooks(None).cm():
                return torchckpt.checkpoint(fn, *args, policy=self.policy)
        return torchckpt.checkpoint(fn, *args, policy=self.policy)

    def __repr__(self) -> str:
        p = type(self.policy).__name__
        return f"Hooks(None)+{p}" if self.ref_hooks else p


# A layout: (outer, per-segment runners); the per-segment tuple repeats when shorter.
Layout = tuple[Any, tuple[Any, ...]]
PLAIN: Layout = (Plain(), (Plain(),))


def execute(prog: Program, layout: Layout, leaves: list[torch.Tensor], ctx: Ctx) -> list[torch.Tensor]:
    """Run the program's segments under ``layout``; returns every value (leaves first)."""
    outer, per_seg = layout
    segs = prog.segments
    # The interpreter's state at each segment's start: a Recompute block re-runs its segment
    # from the same state (NOTE [ Fuzzer semantics ] Rule 2 depends on it).
    metas_at: list[tuple[list[Meta], frozenset[int]]] = [([Meta(-1, j) for j in range(len(leaves))], frozenset())]

    def segment(j: int, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lo, hi = segs[j]
        vals = list(ts)
        metas = list(metas_at[j][0])
        ctx.seg, ctx.multi_sids = j, set(metas_at[j][1])
        for i in range(lo, hi):
            _apply(ctx, vals, metas, i)
        if len(metas_at) == j + 1:
            metas_at.append((metas, frozenset(ctx.multi_sids)))
        return tuple(vals[len(ts):])

    def body(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vals = list(ts)
        for j in range(len(segs)):
            new = per_seg[j % len(per_seg)].call(functools.partial(segment, j), *vals)
            vals.extend(new)
        return tuple(vals)

    return list(outer.call(body, *leaves))


def loss_of(vals: Sequence[torch.Tensor], seed: int) -> torch.Tensor:
    """A scalar from every value: fixed random weights, so every value gets its own gradient."""
    g = torch.Generator().manual_seed(seed + 1)
    total = None
    for v in vals:
        r = real(v).to(torch.float64)
        w = torch.randn(r.shape, generator=g, dtype=torch.float64).to(r.device)
        term = (r * w).sum()
        total = term if total is None else total + term
    assert total is not None
    return total


def resolve(prog: Program, device: str = "cpu") -> frozenset[int]:
    """The in-place ops that would modify a saved tensor in plain autograd (Rule 3)."""
    clones: set[int] = set()
    for _ in range(len(prog.ops) + 1):
        saved: list[tuple[torch.Tensor, int]] = []
        leaves, params = build(prog, device)
        ctx = Ctx(prog, params, frozenset(clones), saved)

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append((t, t._version))
            return t

        try:
            seed_all(prog.seed, device)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                execute(prog, PLAIN, leaves, ctx)
        except Invalidates as e:
            clones.add(e.index)
            continue
        return frozenset(clones)
    raise RuntimeError("fuzzer bug: resolve did not converge")


# -- outcomes ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    """What one run gave: every value, the loss, every gradient; or the error it raised."""

    values: list[torch.Tensor] = dataclasses.field(default_factory=list)
    loss: torch.Tensor | None = None
    grads: list[tuple[str, torch.Tensor | None]] = dataclasses.field(default_factory=list)
    error: tuple[type, str] | None = None  # (type, message): no traceback keeps the graph alive
    phase: str = ""
    lines: list[str] = dataclasses.field(default_factory=list)


def _snap(t: torch.Tensor) -> torch.Tensor:
    """A detached, CPU, conj/neg-resolved copy, with its flags noted in the attributes."""
    s = t.detach().resolve_conj().resolve_neg().to("cpu", copy=True)
    s._fz_flags = (t.is_conj(), t.is_neg())  # type: ignore[attr-defined]
    return s


def run(prog: Program, layout: Layout, clones: frozenset[int], device: str = "cpu") -> Outcome:
    """One step of ``prog`` under ``layout``: forward, loss, backward."""
    leaves, params = build(prog, device)
    ctx = Ctx(prog, params, clones, None)
    out = Outcome(lines=ctx.lines)
    phase = "forward"
    try:
        seed_all(prog.seed, device)
        vals = execute(prog, layout, leaves, ctx)
        loss = loss_of(vals, prog.seed)
        out.values = [_snap(v) for v in vals]
        out.loss = _snap(loss)
        phase = "backward"
        loss.backward()
        del vals, loss
    except Exception as e:  # noqa: BLE001 - compared with the reference's error
        out.error, out.phase = (type(e), str(e)), phase
        return out
    named = [(f"input{i}", t) for i, t in enumerate(leaves)] + param_tensors(params)
    out.grads = [(n, None if t.grad is None else _snap(t.grad)) for n, t in named]
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))  # stride 1, whatever t's strides
    return flat.view(torch.uint8)


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit-for-bit equality (NaN and -0.0 included), with dtype, shape and conj/neg flags."""
    if a is None or b is None:
        return a is None and b is None
    return (a.dtype == b.dtype and a.shape == b.shape
            and getattr(a, "_fz_flags", None) == getattr(b, "_fz_flags", None)
            and torch.equal(_bits(a), _bits(b)))


def _describe(a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    if a is None or b is None:
        return f"{'None' if a is None else 'tensor'} vs {'None' if b is None else 'tensor'}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if getattr(a, "_fz_flags", None) != getattr(b, "_fz_flags", None):
        return f"conj/neg flags {a._fz_flags} vs {b._fz_flags}"  # type: ignore[attr-defined]
    bad = (_bits(a) != _bits(b)).sum().item()
    diff = ""
    if a.is_floating_point() or a.is_complex():
        d = (a.to(torch.complex128 if a.is_complex() else torch.float64)
             - b.to(torch.complex128 if b.is_complex() else torch.float64)).abs()
        diff = f", max abs diff {d.nan_to_num(nan=float('inf')).max().item():.3g}"
    return f"{bad} of {_bits(a).numel()} bytes differ{diff}"


def close(a: torch.Tensor | None, b: torch.Tensor | None, tol: float) -> bool:
    """Equal up to ``tol`` times the larger magnitude in the tensor (NaN where NaN, inf where inf)."""
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return same(a, b)
    wide = torch.complex128 if a.is_complex() else torch.float64
    x, y = a.to(wide), b.to(wide)
    if not torch.equal(x.isnan(), y.isnan()) or not torch.equal(x.isinf(), y.isinf()):
        return False
    ok = x.isfinite()
    if not torch.equal(x[~ok & ~x.isnan()], y[~ok & ~y.isnan()]):
        return False
    x, y = x[ok], y[ok]
    scale = max(x.abs().max().item(), y.abs().max().item(), 1e-30) if x.numel() else 1.0
    return bool(((x - y).abs() <= tol * scale).all())


def compare(ref: Outcome, got: Outcome, grad_tol: float | None = None) -> list[str]:
    """Differences of ``got`` from ``ref`` (empty when they agree): bit for bit, or gradients
    within ``grad_tol`` of their largest magnitude when it is given (NOTE [ Fuzzer semantics ] Rule 4)."""
    if ref.error is not None or got.error is not None:
        if ref.error is None:
            assert got.error is not None
            return [f"raised in {got.phase} where the reference did not: {got.error[0].__name__}: {got.error[1]}"]
        if got.error is None:
            return [f"raised nothing where the reference raised in {ref.phase}: "
                    f"{ref.error[0].__name__}: {ref.error[1][:200]}"]
        msgs = []
        if not issubclass(got.error[0], ref.error[0]):
            msgs.append(f"raised {got.error[0].__name__} where the reference raised {ref.error[0].__name__}: {got.error[1]}")
        if VERSION_PHRASE in ref.error[1] and VERSION_PHRASE not in got.error[1]:
            msgs.append(f"error lacks {VERSION_PHRASE!r}: {got.error[1]}")
        return msgs
    msgs = []
    if len(ref.values) != len(got.values):
        msgs.append(f"{len(got.values)} values, reference has {len(ref.values)}")
    for j, (va, vb) in enumerate(zip(ref.values, got.values)):
        if not same(va, vb):
            msgs.append(f"value v{j}: {_describe(va, vb)}")
    if not same(ref.loss, got.loss):
        msgs.append(f"loss: {_describe(ref.loss, got.loss)}")
    for (n, a), (_, b) in zip(ref.grads, got.grads):
        if not (same(a, b) if grad_tol is None else close(a, b, grad_tol)):
            msgs.append(f"grad of {n}: {_describe(a, b)}")
    return msgs


# -- settings -----------------------------------------------------------------------------------
def small_host_pool(device: str) -> torchckpt.HostPool:
    """A host pool with 1 MiB chunks (pinned when the store is on CUDA)."""
    return torchckpt.HostPool(capacity_bytes=256 << 20, chunk_bytes=1 << 20, pin=device != "cpu")


BUDGET = 1536  # bytes: a cache that holds a few of the fuzzer's tensors, so some are evicted
STORES: dict[str, dict[str, Any]] = {
    "resident": dict(gpu_bytes=64 << 20, min_bytes=0),
    "evicted": dict(gpu_bytes=0, min_bytes=0),
    "budget": dict(gpu_bytes=BUDGET, min_bytes=0),
    "min_bytes": dict(gpu_bytes=BUDGET, min_bytes=128),
    "identity": dict(gpu_bytes=0, min_bytes=0, codec="identity"),
    "identity_budget": dict(gpu_bytes=BUDGET, min_bytes=0, codec="identity"),
    "no_prefetch": dict(gpu_bytes=BUDGET, min_bytes=0, prefetch=False),
}


def make_store(name: str, device: str) -> torchckpt.Store:
    kw = dict(STORES[name])
    if kw.get("codec") == "identity":
        kw["codec"] = Identity()
    return torchckpt.Store(device=device, host=small_host_pool(device), **kw)


@dataclasses.dataclass(frozen=True)
class Setting:
    """A policy layout (``structure``, see ``layout``) with a store configuration (``STORES``)."""

    structure: str
    store: str | None = None

    def __repr__(self) -> str:
        return f"Setting({self.structure!r}, {self.store!r})"

    def layout(self, store: torchckpt.Store | None, nseg: int) -> Layout:
        """(outer, per-segment runners); with ``store=None``, the twin (NOTE [ Fuzzer semantics ] Rule 4)."""
        s = store
        twin = s is None
        hooks = Hooks(s)
        off: Any = hooks if twin else Pol(Offload(s))
        rec_store: Any = Pol(Recompute(), ref_hooks=True) if twin else Pol(Recompute(store=s))
        rec, plain = Pol(Recompute()), Plain()
        mid = min(1, nseg - 1)

        def at_mid(p: Any) -> tuple[Any, ...]:
            return tuple(p if j == mid else plain for j in range(nseg))

        st = self.structure
        if st == "ctx":
            return (hooks, (plain,))
        if st == "ctx_rec":  # a Recompute block inside an offload() region
            return (hooks, at_mid(rec))
        if st == "off":
            return (plain, (off,))
        if st == "off_codec":
            return (plain, (hooks if twin else Pol(Offload(s, codec=Identity())),))
        if st == "rec":
            return (plain, (rec,))
        if st == "rec_store":
            return (plain, (rec_store,))
        if st == "keep":
            return (plain, (Pol(Keep()),))
        if st == "rec_in_off":  # a Recompute block inside an Offload block
            return (off, at_mid(rec))
        if st == "off_in_rec":  # an Offload block inside a Recompute block
            return (rec, at_mid(off))
        if st == "mixed":  # Offload, Recompute(store), Keep, one per segment
            return (plain, (off, rec_store, Pol(Keep())))
        raise ValueError(f"unknown structure {st!r}")


def default_settings() -> list[Setting]:
    """Every store configuration under offload(), and each policy layout with one or more."""
    out = [Setting("ctx", name) for name in STORES]
    out += [Setting("ctx_rec", "budget"), Setting("off", "resident"), Setting("off", "evicted"),
            Setting("off", "budget"), Setting("off_codec", "evicted"), Setting("off_codec", "budget"),
            Setting("rec"), Setting("rec_store", "evicted"), Setting("rec_store", "budget"), Setting("keep"),
            Setting("rec_in_off", "evicted"), Setting("rec_in_off", "budget"),
            Setting("off_in_rec", "evicted"), Setting("off_in_rec", "resident"), Setting("mixed", "budget"),
            Setting("mixed", "evicted")]
    return out


def _key(layout: Layout) -> str:
    return f"{layout[0]!r}|{','.join(map(repr, layout[1]))}"


def check(prog: Program, settings: Sequence[Setting] | None = None, device: str = "cpu", steps: int = 3) -> list[str]:
    """Run ``prog`` under plain autograd and every setting; return every difference found.

    Returns:
        Lines describing each mismatch ("" when none). ``assert not check(...)`` in a test.
    """
    settings = list(default_settings() if settings is None else settings)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention
    try:
        return _check(prog, settings, device, steps)
    finally:
        torch.set_num_threads(threads)


def _check(prog: Program, settings: list[Setting], device: str, steps: int) -> list[str]:
    clones = resolve(prog, device)
    nseg = len(prog.segments)
    plain = run(prog, PLAIN, clones, device)
    problems: list[str] = []
    if plain.error is not None and VERSION_PHRASE not in plain.error[1]:
        raise AssertionError(f"fuzzer bug: plain autograd raised {plain.error[0].__name__}: {plain.error[1]}\n"
                             f"{prog!r}\n" + "\n".join(plain.lines))
    again = run(prog, PLAIN, clones, device)
    for d in compare(plain, again):
        problems.append(f"plain autograd is not reproducible: {d}")
    twins: dict[str, Outcome] = {_key(PLAIN): plain}
    for s in settings:
        tl = s.layout(None, nseg)
        key = _key(tl)
        if key not in twins:
            twins[key] = run(prog, tl, clones, device)
            recompute = "Recompute" in key
            if plain.error is None or not recompute:  # Rule 4
                for d in compare(plain, twins[key], grad_tol=RECOMPUTE_TOL if recompute else None):
                    problems.append(f"twin of {s!r} ({key}) vs plain autograd: {d}")
        ref = twins[key]
        store = make_store(s.store, device) if s.store is not None else None
        layout = s.layout(store, nseg)
        for step in range(steps if store is not None else 1):
            got = run(prog, layout, clones, device)
            for d in compare(ref, got):
                problems.append(f"{s!r} step {step + 1}: {d}")
    if problems:
        problems.append("program:\n    " + "\n    ".join(plain.lines))
    return problems


def report(prog: Program, problems: Sequence[str], device: str = "cpu", per_setting: int = 3) -> str:
    """``check``'s findings condensed: a line to reproduce, the program as it ran, then for each
    setting the steps that failed and the first few differences of the first of them."""
    by: dict[str, dict[str, list[str]]] = {}
    listing = ""
    for p in problems:
        if p.startswith("program:"):
            listing = p
            continue
        who, _, rest = p.partition(": ")
        setting, _, step = who.partition(" step ")
        by.setdefault(setting, {}).setdefault(step or "-", []).append(rest)
    bad = [w for w in by if w.startswith("Setting(")]
    out = [f"{len(by)} setting(s) disagree with their reference; reproduce with",
           f"    check({prog!r}, device={device!r}, settings=[{', '.join(bad)}])", listing]
    for who, steps in by.items():
        first = next(iter(steps.values()))
        more = f" (+{len(first) - per_setting} more)" if len(first) > per_setting else ""
        label = who if list(steps) == ["-"] else f"{who} steps {', '.join(steps)}"
        out.append(f"{label}: " + "; ".join(first[:per_setting]) + more)
    return "\n".join(out)


# -- the hypothesis strategy ---------------------------------------------------------------------
def programs(max_ops: int = 8) -> Any:
    """A hypothesis strategy of ``Program`` values (imported lazily: hypothesis is a test dependency)."""
    from hypothesis import strategies as st

    names = sorted(n for n in OPS if n != "clobber")
    names += ["inplace"] * 3 + ["dropout_"]  # in-place ops more often
    operand = st.one_of(st.just(0), st.integers(0, 5))  # the newest value half of the time

    @st.composite
    def op_st(draw: Any) -> Op:
        name = draw(st.sampled_from(names))
        a, b, k = draw(operand), draw(operand), draw(st.integers(0, 63))
        return Op(name, a, b, k, clobber=name in INPLACE and draw(st.integers(0, 15)) == 0)

    @st.composite
    def prog(draw: Any) -> Program:
        ops = draw(st.lists(op_st(), min_size=1, max_size=max_ops))
        if draw(st.integers(0, 9)) == 0:  # now and then, a deliberate modification of a saved tensor
            at = draw(st.integers(0, len(ops)))
            ops.insert(at, Op("clobber", draw(st.integers(0, 5)), 0, draw(st.integers(0, 63))))
        n_in = draw(st.integers(1, 3))
        shapes = tuple(draw(st.sampled_from(SHAPES)) for _ in range(n_in))
        cuts = tuple(sorted(set(draw(st.lists(st.integers(1, max(1, len(ops) - 1)), max_size=2)))))
        return Program(ops=tuple(ops), dtype=draw(st.sampled_from(DTYPES)), shapes=shapes,
                       cuts=tuple(c for c in cuts if c < len(ops)), seed=draw(st.integers(0, 1 << 16)))

    return prog()
