"""Gradient of a waveform misfit with respect to the velocity model, through ``checkpointed_loop``.

The misfit J = 0.5 * sum_k ||R u_k - d_obs,k||^2 over all time steps, with u simulated in a
smoothed model and d_obs recorded in the true one (wave.py). The loop state is
``(u_n, u_{n-1}, n, J_n)``: the step index (an int64 tensor, so that the source sample and the
observed trace are picked on the device, with no host sync) and a running misfit, so that the
loss is read off the final state. ``checkpointed_loop`` keeps only the schedule's snapshots and
recomputes the rest during backward; gradients flow to ``vel2 = (c dt / dx)^2`` via ``params=``.
The step is the PyTorch one (differentiable; the Triton kernel has no autograd formula).

Checks, in float64 on a small grid (24^3, 60 steps): the gradient equals plain autograd through
the unrolled loop (bit for bit, or to ~1e-15), and agrees with a central finite difference of J
along a random direction to < 1e-6. Exits non-zero if a check fails.

    python examples/wave_gradient.py [--grid 24] [--steps 60] [--schedule revolve|zcut|uniform]
                                     [--snapshots 6] [--tier host|gpu] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # the repo, when torchckpt is not installed

import torch  # noqa: E402

import torchckpt  # noqa: E402
from torchckpt.adjoint import checkpointed_loop  # noqa: E402
from torchckpt.schedules import Revolve, Tier, Uniform, ZCut, simulate  # noqa: E402
from wave import cfl_dt, dominant_frequency, layered_model, model_data, ricker, smooth, step_torch  # noqa: E402
from wave import surface_survey  # noqa: E402

DX = 10.0


class Misfit:
    """The loop's step ``(u, u_prev, n, J) -> (u_next, u, n + 1, J + 0.5 ||R u_next - d_obs[n+1]||^2)``."""

    def __init__(self, vel2: torch.Tensor, survey, wavelet: torch.Tensor, d_obs: torch.Tensor) -> None:
        self.vel2, self.survey, self.wavelet, self.d_obs = vel2, survey, wavelet, d_obs
        self.src = torch.tensor([survey.src], device=vel2.device)

    def __call__(self, state):
        u, u_prev, n, J = state
        v = self.vel2
        u_next = step_torch(u, u_prev, v)
        amp = v.view(-1)[self.src] * self.wavelet.index_select(0, n)  # vel2[s] w_n, NOTE [ Wave stencil ]
        u_next = u_next.view(-1).index_add(0, self.src, amp).view_as(u)
        r = u_next.view(-1)[self.survey.rec] - self.d_obs.index_select(0, n + 1)[0]
        return u_next, u, n + 1, J + 0.5 * r.square().sum()

    def initial(self):
        z = torch.zeros(self.survey.shape, dtype=self.vel2.dtype, device=self.vel2.device)
        n = torch.zeros(1, dtype=torch.int64, device=self.vel2.device)
        return z, z.clone(), n, torch.zeros((), dtype=self.vel2.dtype, device=self.vel2.device)

    def loss_plain(self, n_steps: int) -> torch.Tensor:
        state = self.initial()
        for _ in range(n_steps):
            state = self(state)
        return state[3]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", type=int, default=24)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--schedule", choices=("revolve", "zcut", "uniform"), default="revolve")
    p.add_argument("--snapshots", type=int, default=6)
    p.add_argument("--tier", choices=("host", "gpu"), default="host")
    p.add_argument("--slots", type=int, default=2, help="device cache slots in front of host snapshots")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--eps", type=float, default=1e-6, help="finite-difference step, relative to max |vel2|")
    args = p.parse_args()
    device, dtype = torch.device(args.device), torch.float64
    n, n_steps = args.grid, args.steps
    tier = Tier.HOST if args.tier == "host" else Tier.GPU
    schedule = {"revolve": lambda: Revolve(n_steps, args.snapshots, tier=tier),
                "uniform": lambda: Uniform(n_steps, args.snapshots, tier=tier),
                "zcut": lambda: ZCut(n_steps, tier=tier)}[args.schedule]()
    sim = simulate(schedule)
    print(f"wave gradient: {n}^3 float64, {n_steps} steps on {device}; {schedule!r} "
          f"({sim.forward_steps} forward advances, peak {sim.peak_total} snapshots)", flush=True)

    vel = layered_model((n, n, n), DX, device, dtype)
    dt = cfl_dt(vel.max().item(), DX)
    survey = surface_survey((n, n, n), depth=2, stride=2, device=device)
    wavelet = torch.tensor(ricker(n_steps, dt, dominant_frequency(vel.min().item(), DX)), dtype=dtype, device=device)
    d_obs = model_data((vel * dt / DX).square(), survey, wavelet.tolist(), n_steps,
                       step=lambda u, up, v, out: out.copy_(step_torch(u, up, v)))
    vel2 = (smooth(vel) * dt / DX).square().requires_grad_(True)
    f = Misfit(vel2, survey, wavelet, d_obs)

    # Checkpointed gradient.
    store = torchckpt.Store(device)
    t0 = time.perf_counter()
    out = checkpointed_loop(f, f.initial(), n_steps, schedule=schedule, store=store, slots=args.slots, params=[vel2])
    J = out[3]
    (g_ckpt,) = torch.autograd.grad(J, vel2)
    t_ckpt = time.perf_counter() - t0

    # Plain autograd through the unrolled loop.
    t0 = time.perf_counter()
    J_plain = f.loss_plain(n_steps)
    (g_plain,) = torch.autograd.grad(J_plain, vel2)
    t_plain = time.perf_counter() - t0
    scale = g_plain.abs().max().item()
    vs_autograd = (g_ckpt - g_plain).abs().max().item() / scale
    exact = torch.equal(g_ckpt, g_plain)

    # Central finite difference along a random direction.
    gen = torch.Generator(device).manual_seed(0)
    direction = torch.randn(vel2.shape, generator=gen, dtype=dtype, device=device)
    h = args.eps * vel2.detach().abs().max().item()
    with torch.no_grad():
        fd = (f_at(f, vel2.detach() + h * direction, n_steps) - f_at(f, vel2.detach() - h * direction, n_steps)) / (2 * h)
    ad = (g_ckpt * direction).sum().item()
    vs_fd = abs(fd - ad) / abs(fd)

    print(f"misfit J = {J.item():.6e} (plain loop {J_plain.item():.6e})")
    print(f"gradient vs plain autograd: max |diff| / max |grad| = {vs_autograd:.1e}"
          f" ({'bit-exact' if exact else 'not bit-exact'})")
    print(f"directional derivative: autograd {ad:.12e}, central FD {fd:.12e} (h = {h:.1e}): relative error {vs_fd:.1e}")
    print(f"time: checkpointed forward+backward {t_ckpt:.2f} s, plain autograd {t_plain:.2f} s")
    ok = vs_autograd <= 1e-14 and vs_fd < 1e-6 and torch.equal(J, J_plain)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def f_at(f: Misfit, vel2: torch.Tensor, n_steps: int) -> float:
    """J for another velocity model (no gradient)."""
    g = Misfit(vel2, f.survey, f.wavelet, f.d_obs)
    return g.loss_plain(n_steps).item()


if __name__ == "__main__":
    sys.exit(main())
