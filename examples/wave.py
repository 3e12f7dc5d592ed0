"""3D acoustic wave equation: stencil (Triton and PyTorch), velocity model, source, RTM callbacks.

Shared by ``examples/adjoint_wave.py`` (reverse time migration), ``examples/wave_gradient.py``
(gradient of a waveform misfit) and ``benchmarks/adjoint.py``.

# NOTE [ Wave stencil ]
# 1. Second order in time and space on a grid of shape (nz, ny, nx), z the depth axis:
#        u_{n+1} = 2 u_n - u_{n-1} + vel2 * L(u_n) + vel2[s] * w_n * delta_s
#    with vel2 = (c dt / dx)^2 and L the 7-point Laplacian times dx^2 (six neighbours minus
#    six times the centre). Cells outside the grid are zero (Dirichlet), so L is symmetric.
# 2. Stable when max(c) dt / dx <= 1/sqrt(3) (``cfl_dt`` stays below that by ``courant``).
# 3. The state of step n is (u_n, u_{n-1}): two arrays. A step reads u_n, u_{n-1} and vel2
#    and writes u_{n+1}; each output cell reads u_{n-1} only at the same cell, so u_{n+1}
#    may overwrite u_{n-1} in place (``Wavefield.step`` does, then swaps the two buffers).
# 4. On CUDA one Triton kernel does the step in one pass (programs over (x block, y, z):
#    one x-row segment each, masked at the edges); elsewhere, and as the reference, the
#    same arithmetic in PyTorch (``step_torch``, differentiable). The sum is taken in the
#    same order in both; they agree to rounding (an FMA may differ).
#
# NOTE [ Wave adjoint ]
# 1. Data: d_k = R u_k (receivers R: a plane of cells near the surface), k = 0..N, d_0 = 0.
#    For J = sum_k r_k . d_k, the adjoint lambda_k = dJ/du_k obeys
#        lambda_k = 2 lambda_{k+1} - lambda_{k+2} + L(vel2 * lambda_{k+1}) + R^T r_k,
#    lambda_{N+1} = lambda_{N+2} = 0 (L is symmetric, vel2 a diagonal).
# 2. With p = vel2 * lambda this is the forward stencil run backward in time,
#        p_k = 2 p_{k+1} - p_{k+2} + vel2 * L(p_{k+1}) + vel2 * R^T r_k,
#    so the receiver wavefield uses the same kernel (the propagator is self-adjoint up to the
#    diagonal vel2): injection of the residual at the receivers, time reversed.
# 3. dJ/dw_k = p_{k+1}[s] (the source term enters u_{k+1}); ``adjoint_wave.py`` checks
#    <F w, r> = <w, F^T r> with it (a dot-product test).
# 4. RTM image (cross-correlation imaging condition): I = sum_{n=0}^{N-1} u_n * p_n. Adjoint
#    step n of a checkpoint schedule has the source state n = (u_n, u_{n-1}) current; it
#    computes p_n from (p_{n+1}, p_{n+2}) and adds u_n * p_n (``RTM.backward``). p_N is set
#    before the reverse sweep.
# 5. ``GraphedRTM``: the same steps replayed as CUDA graphs (issue 26: on a host-bound adjoint each launch is host
#    time). A step is capturable when everything it reads per step comes from the device: the source amplitude
#    (``src_amp * wavelet[n]``, a Python float in ``RTM``) and the residual row are indexed by a step counter on the
#    device, which each graph advances and the host sets (one small fill) only when a step does not follow the last
#    one (after a restore). The two buffers of a wavefield swap each step, so a source step has a graph per buffer
#    order (two) and an adjoint step one per pair of orders (four). Each graph runs the eager step's kernels on the
#    same values (the amplitude rounded to the dtype as ``add_`` rounds the float), so the image is the same bits.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchckpt.schedules import Revolve, Schedule, Tier, Uniform, ZCut

try:  # Triton is optional: the PyTorch step runs everywhere.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

__all__ = [
    "GraphedRTM", "RTM", "Survey", "Wavefield", "cfl_dt", "dominant_frequency", "laplacian", "layered_model", "model_data",
    "rtm_keep_all", "ricker", "smooth", "step_torch", "step_triton", "surface_survey", "triton_available",
    "wave_step",
]


# -- the stencil ---------------------------------------------------------------------------
def laplacian(u: torch.Tensor) -> torch.Tensor:
    """7-point Laplacian times dx^2 with zero cells outside the grid (NOTE [ Wave stencil ], Rule 1)."""
    p = F.pad(u, (1, 1, 1, 1, 1, 1))
    i = slice(1, -1)
    return ((p[i, i, :-2] + p[i, i, 2:]) + (p[i, :-2, i] + p[i, 2:, i]) + (p[:-2, i, i] + p[2:, i, i])) - 6.0 * u


def step_torch(u: torch.Tensor, u_prev: torch.Tensor, vel2: torch.Tensor) -> torch.Tensor:
    """One time step in PyTorch, out of place and differentiable: ``2u - u_prev + vel2 * L(u)``."""
    return 2.0 * u - u_prev + vel2 * laplacian(u)


if triton is not None:

    @triton.jit
    def _wave_step_kernel(u_ptr, up_ptr, v_ptr, out_ptr, nz, ny, nx, BLOCK: tl.constexpr):
        # One program: one segment of BLOCK cells of the x-row (z, y). Rows y+-1 and z+-1 are
        # read by the neighbouring programs too, so they mostly come from L2.
        x = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        y = tl.program_id(1)
        z = tl.program_id(2)
        m = x < nx
        sz = ny.to(tl.int64) * nx
        p = (z.to(tl.int64) * ny + y) * nx + x
        c = tl.load(u_ptr + p, mask=m, other=0.0)
        xm = tl.load(u_ptr + p - 1, mask=m & (x > 0), other=0.0)
        xp = tl.load(u_ptr + p + 1, mask=(x + 1) < nx, other=0.0)
        ym = tl.load(u_ptr + p - nx, mask=m & (y > 0), other=0.0)
        yp = tl.load(u_ptr + p + nx, mask=m & (y + 1 < ny), other=0.0)
        zm = tl.load(u_ptr + p - sz, mask=m & (z > 0), other=0.0)
        zp = tl.load(u_ptr + p + sz, mask=m & (z + 1 < nz), other=0.0)
        prev = tl.load(up_ptr + p, mask=m, other=0.0)
        v = tl.load(v_ptr + p, mask=m, other=0.0)
        lap = ((xm + xp) + (ym + yp) + (zm + zp)) - 6.0 * c
        tl.store(out_ptr + p, 2.0 * c - prev + v * lap, mask=m)


def triton_available(t: torch.Tensor) -> bool:
    """Whether ``step_triton`` can run on ``t`` (a CUDA tensor, Triton importable)."""
    return triton is not None and t.is_cuda


def step_triton(u: torch.Tensor, u_prev: torch.Tensor, vel2: torch.Tensor, out: torch.Tensor,
                block: int = 256) -> torch.Tensor:
    """One time step with the Triton kernel into ``out`` (which may be ``u_prev``: Rule 3).

    All four tensors: contiguous, same shape (nz, ny, nx), dtype and CUDA device.
    """
    if not triton_available(u):
        raise RuntimeError("step_triton needs a CUDA tensor and Triton; use step_torch elsewhere.")
    for t in (u_prev, vel2, out):
        if t.shape != u.shape or t.dtype != u.dtype or t.device != u.device or not t.is_contiguous():
            raise ValueError(f"step_triton: expected contiguous {tuple(u.shape)} {u.dtype} tensors on {u.device}, "
                             f"found {tuple(t.shape)} {t.dtype} on {t.device} (contiguous={t.is_contiguous()}).")
    if out is u:
        raise ValueError("step_triton: out must not be u (its neighbours are still being read); pass u_prev or a new tensor.")
    nz, ny, nx = u.shape
    block = min(block, triton.next_power_of_2(nx))
    _wave_step_kernel[(triton.cdiv(nx, block), ny, nz)](u, u_prev, vel2, out, nz, ny, nx, BLOCK=block,
                                                       num_warps=max(1, min(8, block // 64)))
    return out


def wave_step(u: torch.Tensor, u_prev: torch.Tensor, vel2: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One time step into ``out`` (may alias ``u_prev``): Triton on CUDA, else PyTorch."""
    if triton_available(u) and u.is_contiguous():
        return step_triton(u, u_prev, vel2, out)
    return out.copy_(step_torch(u, u_prev, vel2))


# -- model, source, geometry ---------------------------------------------------------------
def layered_model(shape: Sequence[int], dx: float = 10.0, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A synthetic velocity model (m/s): layers, a dipping reflector, a fault and a high-velocity lens.

    Interfaces sit at fixed fractions of the depth, so the model looks the same at any grid size.
    """
    nz, ny, nx = shape
    z = torch.arange(nz, dtype=torch.float64).view(-1, 1, 1) / nz
    y = torch.arange(ny, dtype=torch.float64).view(1, -1, 1) / ny
    x = torch.arange(nx, dtype=torch.float64).view(1, 1, -1) / nx
    v = torch.full((nz, ny, nx), 1800.0, dtype=torch.float64)
    v = torch.where(z >= 0.25 + 0.04 * torch.sin(2 * math.pi * y), 2200.0, v)  # gently folded
    dip = 0.42 + 0.22 * (x - 0.5) + 0.05 * (y - 0.5)  # dipping reflector
    v = torch.where(z >= dip, 2700.0, v)
    throw = torch.where(x > 0.6 + 0.3 * (z - 0.6), 0.06, 0.0)  # a normal fault offsets the deep layer
    v = torch.where(z >= 0.72 + throw, 3200.0, v)
    lens = ((z - 0.56) / 0.07) ** 2 + ((y - 0.5) / 0.22) ** 2 + ((x - 0.4) / 0.16) ** 2
    v = torch.where(lens <= 1.0, 3500.0, v)  # high-velocity lens
    return v.to(device=device, dtype=dtype)


def smooth(v: torch.Tensor, passes: int = 3, width: int = 5) -> torch.Tensor:
    """A smoothed copy (repeated box filter with replicated edges): a migration velocity model."""
    w = v[None, None]
    r = width // 2
    for _ in range(passes):
        w = F.avg_pool3d(F.pad(w, (r,) * 6, mode="replicate"), width, stride=1)
    return w[0, 0].contiguous()


def cfl_dt(vmax: float, dx: float, courant: float = 0.9) -> float:
    """A stable time step: ``courant`` times the 3D limit dx / (vmax * sqrt(3)) (Rule 2)."""
    return courant * dx / (vmax * math.sqrt(3.0))


def dominant_frequency(vmin: float, dx: float, points_per_wavelength: float = 5.0) -> float:
    """Ricker peak frequency whose highest frequency (~2.5 f0) keeps ``points_per_wavelength`` at vmin."""
    return vmin / (2.5 * points_per_wavelength * dx)


def ricker(n_steps: int, dt: float, f0: float, t0: float | None = None) -> list[float]:
    """Ricker wavelet samples w_n = (1 - 2a) exp(-a), a = (pi f0 (n dt - t0))^2, as Python floats."""
    t0 = 1.0 / f0 if t0 is None else t0
    out = []
    for n in range(n_steps):
        a = (math.pi * f0 * (n * dt - t0)) ** 2
        out.append((1.0 - 2.0 * a) * math.exp(-a))
    return out


@dataclass(frozen=True)
class Survey:
    """One source and a plane of receivers, as flat indices into the grid."""

    shape: tuple[int, int, int]
    src: int
    rec: torch.Tensor  # int64, flat indices

    @property
    def n_rec(self) -> int:
        return self.rec.numel()


def surface_survey(shape: Sequence[int], depth: int = 2, stride: int = 1,
                   device: str | torch.device = "cpu") -> Survey:
    """A source at the centre of the surface and receivers every ``stride`` cells, both ``depth`` cells down."""
    nz, ny, nx = shape
    ys = torch.arange(0, ny, stride)
    xs = torch.arange(0, nx, stride)
    rec = (depth * ny + ys.view(-1, 1)) * nx + xs.view(1, -1)
    return Survey((nz, ny, nx), (depth * ny + ny // 2) * nx + nx // 2, rec.reshape(-1).to(device))


# -- propagation -----------------------------------------------------------------------------
class Wavefield:
    """Two buffers holding (u_n, u_{n-1}); ``step`` overwrites u_{n-1} with u_{n+1} and swaps (Rule 3)."""

    def __init__(self, like: torch.Tensor, step: Callable[..., torch.Tensor] = wave_step) -> None:
        self.cur = torch.zeros_like(like)
        self.prev = torch.zeros_like(like)
        self._step = step

    def zero_(self) -> None:
        self.cur.zero_()
        self.prev.zero_()

    def step(self, vel2: torch.Tensor) -> None:
        self._step(self.cur, self.prev, vel2, self.prev)
        self.cur, self.prev = self.prev, self.cur

    def flat(self) -> torch.Tensor:
        return self.cur.view(-1)


def model_data(vel2: torch.Tensor, survey: Survey, wavelet: Sequence[float], n_steps: int,
               step: Callable[..., torch.Tensor] = wave_step) -> torch.Tensor:
    """Forward modelling: receiver traces d_k = R u_k, k = 0..n_steps, shape (n_steps + 1, n_rec)."""
    wf = Wavefield(vel2, step)
    amp = vel2.view(-1)[survey.src].item()
    d = torch.zeros(n_steps + 1, survey.n_rec, dtype=vel2.dtype, device=vel2.device)
    for n in range(n_steps):
        wf.step(vel2)
        wf.flat()[survey.src].add_(amp * wavelet[n])
        d[n + 1] = wf.flat().index_select(0, survey.rec)
    return d


class RTM:
    """Reverse time migration with the callbacks ``torchckpt.run_schedule`` drives (NOTE [ Wave adjoint ]).

    ``forward(n0, n1)`` advances the source wavefield, ``save(n)`` returns its state (u_n, u_{n-1}),
    ``restore(n, tensors)`` copies a snapshot back, ``backward(n)`` takes one receiver-wavefield
    step (p_n from p_{n+1}, p_{n+2}, injecting the residual r_n) and adds u_n * p_n to the image.
    Call ``reset()`` before each run.
    """

    def __init__(self, vel2: torch.Tensor, survey: Survey, wavelet: Sequence[float], residual: torch.Tensor,
                 step: Callable[..., torch.Tensor] = wave_step) -> None:
        self.vel2, self.survey, self.wavelet, self.residual = vel2, survey, list(wavelet), residual
        self.n_steps = residual.shape[0] - 1
        self.src_amp = vel2.view(-1)[survey.src].item()
        self.rec_vel2 = vel2.view(-1)[survey.rec]
        self.u = Wavefield(vel2, step)  # source wavefield, state n = (u_n, u_{n-1})
        self.p = Wavefield(vel2, step)  # receiver wavefield: (p_{n+1}, p_{n+2}) before backward(n)
        self.image = torch.zeros_like(vel2)
        self.reset()

    def reset(self) -> None:
        """State 0 of the source wavefield, p_N = vel2 R^T r_N, and an empty image."""
        self.u.zero_()
        self.p.zero_()
        self.p.flat().index_add_(0, self.survey.rec, self.rec_vel2 * self.residual[self.n_steps])
        self.image.zero_()

    def src_step(self, n: int) -> None:
        """Source-wavefield step n: state n -> n+1."""
        self.u.step(self.vel2)
        self.u.flat()[self.survey.src].add_(self.src_amp * self.wavelet[n])

    def forward(self, n0: int, n1: int) -> None:
        for n in range(n0, n1):
            self.src_step(n)

    def save(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.u.cur, self.u.prev

    def restore(self, n: int, tensors: Sequence[torch.Tensor]) -> None:
        self.u.cur.copy_(tensors[0])
        self.u.prev.copy_(tensors[1])

    def backward(self, n: int) -> None:
        self.p.step(self.vel2)  # p_n = 2 p_{n+1} - p_{n+2} + vel2 L(p_{n+1}) ...
        self.p.flat().index_add_(0, self.survey.rec, self.rec_vel2 * self.residual[n])  # ... + vel2 R^T r_n
        self.image.addcmul_(self.u.cur, self.p.cur)


class GraphedRTM(RTM):
    """``RTM`` whose source and adjoint steps replay CUDA graphs (NOTE [ Wave adjoint ] Rule 5): the same image bits,
    one graph launch per step. CUDA only."""

    def __init__(self, vel2: torch.Tensor, survey: Survey, wavelet: Sequence[float], residual: torch.Tensor,
                 step: Callable[..., torch.Tensor] = wave_step) -> None:
        if not vel2.is_cuda:
            raise ValueError("GraphedRTM replays CUDA graphs: pass CUDA tensors, or use RTM on the CPU.")
        super().__init__(vel2, survey, wavelet, residual, step)
        dev = vel2.device
        self._amp = torch.tensor([self.src_amp * w for w in self.wavelet], dtype=vel2.dtype, device=dev)
        self._kf = torch.zeros(1, dtype=torch.int64, device=dev)  # the source step the next graph takes
        self._kb = torch.zeros(1, dtype=torch.int64, device=dev)  # the adjoint step the next graph takes
        self._at: list[int | None] = [None, None]  # what the host knows the two counters hold
        self._graphs: dict[tuple[int, ...], torch.cuda.CUDAGraph] = {}
        self._side = torch.cuda.Stream(dev)

    def reset(self) -> None:
        super().reset()
        self._at = [None, None]

    def src_step(self, n: int) -> None:
        self._set(0, self._kf, n)
        u = self.u
        self._replay((u.cur.data_ptr(),), self._src_body)
        u.cur, u.prev = u.prev, u.cur
        self._at[0] = n + 1

    def backward(self, n: int) -> None:
        self._set(1, self._kb, n)
        self._replay((self.u.cur.data_ptr(), self.p.cur.data_ptr()), self._adj_body)
        self.p.cur, self.p.prev = self.p.prev, self.p.cur
        self._at[1] = n - 1

    def _src_body(self) -> None:
        u = self.u
        u._step(u.cur, u.prev, self.vel2, u.prev)  # u_{n+1} into u_{n-1}'s buffer: the next u.cur
        u.prev.view(-1)[self.survey.src].add_(self._amp.index_select(0, self._kf).squeeze(0))
        self._kf.add_(1)

    def _adj_body(self) -> None:
        p = self.p
        p._step(p.cur, p.prev, self.vel2, p.prev)  # p_n into p_{n+2}'s buffer: the next p.cur
        r = self.residual.index_select(0, self._kb).squeeze(0)  # r_n, as RTM's residual[n]
        p.prev.view(-1).index_add_(0, self.survey.rec, self.rec_vel2 * r)
        self.image.addcmul_(self.u.cur, p.prev)
        self._kb.sub_(1)

    def _set(self, i: int, counter: torch.Tensor, n: int) -> None:
        if self._at[i] != n:
            counter.fill_(n)

    def _replay(self, key: tuple[int, ...], body: Callable[[], None]) -> None:
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(body)
        g.replay()

    def _capture(self, body: Callable[[], None]) -> torch.cuda.CUDAGraph:
        cur = torch.cuda.current_stream(self.vel2.device)
        s = self._side
        s.wait_stream(cur)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            a, b = torch.zeros_like(self.vel2), torch.zeros_like(self.vel2)
            self.u._step(a, b, self.vel2, b)  # the stencil compiled outside the capture (its arguments as they will be)
            del a, b
            g.capture_begin(capture_error_mode="thread_local")
            try:
                body()
            finally:
                g.capture_end()
        cur.wait_stream(s)
        return g


def rtm_keep_all(rtm: RTM) -> torch.Tensor:
    """The reference RTM image: every source wavefield u_n kept in memory, no schedule."""
    rtm.reset()
    kept = []
    for n in range(rtm.n_steps):
        kept.append(rtm.u.cur.clone())
        rtm.src_step(n)
    for n in range(rtm.n_steps - 1, -1, -1):
        rtm.u.cur.copy_(kept.pop())
        rtm.backward(n)
    return rtm.image.clone()


def make_schedule(name: str, n_steps: int, snapshots: int, tier: Tier) -> Schedule:
    """Revolve and Uniform with ``snapshots`` slots; ZCut with at most that many, or its least peak."""
    if name == "revolve":
        return Revolve(n_steps, snapshots, tier=tier)
    if name == "uniform":
        return Uniform(n_steps, snapshots, tier=tier)
    try:
        return ZCut(n_steps, memory_slots=snapshots, tier=tier)
    except ValueError:  # fewer slots than ZCut can ever do with: use its smallest peak
        return ZCut(n_steps, tier=tier)
