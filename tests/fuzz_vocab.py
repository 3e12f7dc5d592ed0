"""The differential fuzzer's programs: ``Op``/``Program`` values, the vocabulary of ops and the
interpreter state they run in (tests/fuzz_programs.py builds, runs and compares them under NOTE [ Fuzzer semantics ];
tests/test_fuzz.py draws them with hypothesis).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


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
        self.probe = probe  # saved tensors, while resolving (NOTE [ Fuzzer semantics ] Rule 3)
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
        """The tensor an in-place op modifies: ``x``, or a clone of it (NOTE [ Fuzzer semantics ] Rules 2-3)."""
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
            self._before = [(t._version, bits(t)) for t, _ in self.probe]
        return x

    def modified(self) -> None:
        """Called after the in-place op: in the probe, find out whether it hit a saved tensor."""
        if self._before is not None and self.probe is not None:
            before, self._before = self._before, None
            for (t, _), (v, b) in zip(self.probe, before):
                if t._version != v and not self.op.clobber:
                    raise Invalidates(self.index)  # NOTE [ Fuzzer semantics ] Rule 3
                if t._version == v and not torch.equal(bits(t), b):
                    raise Invalidates(self.index)  # NOTE [ Fuzzer semantics ] Rule 3: bytes changed behind the version counter


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


@op("single")
def _single(ctx: Ctx, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """One element (none when ``k % 5 == 4``) with a stride other than 1, squared (so autograd saves it): a layout
    torch calls contiguous that has no dtype view (``Identity.compress`` raised on it until ``codecs.base.flat_bytes``;
    tests/codecs/test_identity_codec.py)."""
    f = x.reshape(-1)
    if f.numel() < 2:
        f = torch.cat([f, f, f])
    n = f.numel()
    one = f[n:: n] if k % 5 == 4 else f[(k % n):: n]
    return one * one


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
    """Attention: ``dropout_p=0.2`` when ``k % 4 == 2`` (the math path, a random op), else ``dropout_p=0``: a kernel
    that draws nothing and that ``Recompute(save=...)`` may keep (NOTE [ Selective recompute ] Rule 2). Every other
    variant applies a dropout to the result, so a recomputation that replays the RNG wrongly around a kept kernel
    draws another mask and shows."""
    b, h, t, d = 1, 2, 4, 4
    q, kk, v = take(fp(x, ctx.dtype), 3 * b * h * t * d).view(3, b, h, t, d).unbind(0)
    if k % 4 == 3:  # keys and values from the other operand
        kk = take(fp(y, ctx.dtype), b * h * t * d).view(b, h, t, d).to(q.dtype)
    out = F.scaled_dot_product_attention(q, kk, v, is_causal=bool(k % 2), dropout_p=0.2 if k % 4 == 2 else 0.0)
    if (k // 4) % 2:
        out = F.dropout(out, p=0.3, training=True)
    return out


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


def bits(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))  # stride 1, whatever t's strides
    return flat.view(torch.uint8)
