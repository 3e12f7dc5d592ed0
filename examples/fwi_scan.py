"""Full-waveform-inversion gradient with ``checkpointed_scan``: receiver traces out of the scan, misfit outside it.

The scan's carry is the wavefield ``(u_n, u_{n-1})``; its per-step input is the source wavelet's sample (``xs``);
its per-step output is the trace at the receivers (``ys``, stacked over time). The misfit is computed from the
traces after the scan, J = 0.5 * ||traces - d_obs||^2, as one would without checkpointing: the step holds no index
tensor and no running misfit. The velocity model is read by the step from its closure (found by the scan, no
``params=``); the wavelet gets a gradient too (source estimation). Only the schedule's snapshots of the wavefield
are kept; the rest is recomputed in backward.

Checks, in float64 on a small grid (24^3, 60 steps; the PyTorch stencil of examples/wave.py): the traces and both
gradients equal plain autograd through the unrolled loop bit for bit, and the velocity gradient agrees with a
central finite difference of J along a random direction to < 1e-6. Exits non-zero if a check fails.

    python examples/fwi_scan.py [--grid 24] [--steps 60] [--snapshots 6] [--device cpu|cuda]
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
from torchckpt.schedules import Revolve, Tier  # noqa: E402
from wave import cfl_dt, dominant_frequency, layered_model, model_data, ricker, smooth, step_torch  # noqa: E402
from wave import surface_survey  # noqa: E402

DX = 10.0


def forward(vel2: torch.Tensor, survey, wavelet: torch.Tensor, scan=None):  # noqa: ANN001, ANN201
    """Receiver traces for ``wavelet`` in ``vel2``: through ``scan`` (``checkpointed_scan`` with its settings) or
    the plain unrolled loop (``scan=None``)."""
    src = torch.tensor([survey.src], device=vel2.device)

    def step(carry, w_n):  # noqa: ANN001, ANN202
        u, u_prev = carry
        u_next = step_torch(u, u_prev, vel2)
        u_next = u_next.view(-1).index_add(0, src, vel2.view(-1)[src] * w_n).view_as(u)  # NOTE [ Wave stencil ]
        return (u_next, u), u_next.view(-1)[survey.rec]

    z = torch.zeros(survey.shape, dtype=vel2.dtype, device=vel2.device)
    if scan is not None:
        return scan(step, (z, z.clone()), wavelet.unsqueeze(1))[1]
    carry, traces = (z, z.clone()), []
    for w_n in wavelet.unsqueeze(1):
        carry, y = step(carry, w_n)
        traces.append(y)
    return torch.stack(traces)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", type=int, default=24)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--snapshots", type=int, default=6)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--eps", type=float, default=1e-6, help="finite-difference step, relative to max |vel2|")
    args = p.parse_args()
    device, dtype = torch.device(args.device), torch.float64
    n, n_steps = args.grid, args.steps
    schedule = Revolve(n_steps, args.snapshots, tier=Tier.HOST)
    print(f"FWI gradient through checkpointed_scan: {n}^3 float64, {n_steps} steps on {device}; {schedule!r}",
          flush=True)

    vel = layered_model((n, n, n), DX, device, dtype)
    dt = cfl_dt(vel.max().item(), DX)
    survey = surface_survey((n, n, n), depth=2, stride=2, device=device)
    wavelet = torch.tensor(ricker(n_steps, dt, dominant_frequency(vel.min().item(), DX)), dtype=dtype, device=device)
    d_obs = model_data((vel * dt / DX).square(), survey, wavelet.tolist(), n_steps,
                       step=lambda u, up, v, out: out.copy_(step_torch(u, up, v)))[1:]  # traces of steps 1..N
    vel2 = (smooth(vel) * dt / DX).square().requires_grad_(True)
    w = wavelet.clone().requires_grad_(True)
    store = torchckpt.Store(device)

    def scan(step, init, xs):  # noqa: ANN001, ANN202
        return torchckpt.checkpointed_scan(step, init, xs, schedule=schedule, store=store)

    def misfit(traces: torch.Tensor) -> torch.Tensor:  # outside the scan, from the stacked traces
        return 0.5 * (traces - d_obs).square().sum()

    t0 = time.perf_counter()
    traces = forward(vel2, survey, w, scan)
    J = misfit(traces)
    g_vel, g_w = torch.autograd.grad(J, [vel2, w])
    t_scan = time.perf_counter() - t0

    t0 = time.perf_counter()
    traces_plain = forward(vel2, survey, w)
    J_plain = misfit(traces_plain)
    gp_vel, gp_w = torch.autograd.grad(J_plain, [vel2, w])
    t_plain = time.perf_counter() - t0
    exact = all(torch.equal(a, b) for a, b in ((traces, traces_plain), (g_vel, gp_vel), (g_w, gp_w)))

    gen = torch.Generator(device).manual_seed(0)
    direction = torch.randn(vel2.shape, generator=gen, dtype=dtype, device=device)
    h = args.eps * vel2.detach().abs().max().item()
    with torch.no_grad():
        fd = (misfit(forward(vel2 + h * direction, survey, w)) - misfit(forward(vel2 - h * direction, survey, w))) / (2 * h)
    ad = (g_vel * direction).sum().item()
    vs_fd = abs(fd.item() - ad) / abs(fd.item())

    print(f"traces {tuple(traces.shape)} (steps x receivers); misfit J = {J.item():.6e} (plain loop {J_plain.item():.6e})")
    print(f"traces, velocity gradient and wavelet gradient vs plain autograd: "
          f"{'bit-exact' if exact else 'NOT bit-exact'} (max |diff| of the velocity gradient "
          f"{(g_vel - gp_vel).abs().max().item():.1e})")
    print(f"directional derivative: autograd {ad:.12e}, central FD {fd.item():.12e} (h = {h:.1e}): relative error "
          f"{vs_fd:.1e}")
    print(f"time: checkpointed scan forward+backward {t_scan:.2f} s, plain autograd {t_plain:.2f} s")
    ok = exact and vs_fd < 1e-6
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
