"""Reverse time migration (RTM) of a 3D acoustic survey, driven by ``torchckpt.run_schedule``.

1. Forward modelling: a Ricker source at the surface of a synthetic layered model (a dipping
   reflector, a fault, a high-velocity lens); a plane of receivers records the pressure. The
   direct wave (modelled in a homogeneous model of the top layer's velocity) is subtracted.
2. RTM in a smoothed (migration) model: the source wavefield runs forward under a checkpoint
   schedule, the receiver wavefield runs backward from the recorded data, and each adjoint step
   adds u_n * p_n to the image (NOTE [ Wave adjoint ] in wave.py). torchckpt saves, caches,
   prefetches and restores the source snapshots (u_n, u_{n-1}); the callbacks do the compute.
3. Checks: the image equals the one computed with every source wavefield kept; the receiver
   propagation is the adjoint of the modelling (a dot-product test, float64); on CUDA the
   Triton step matches the PyTorch one.

Writes ``rtm_image.png`` (slices through the middle of the velocity model and the image).

    python examples/adjoint_wave.py [--schedule revolve|zcut|uniform] [--snapshots 8] [--tier host|gpu]
                                    [--slots 3] [--grid 48] [--steps 250] [--codec none|quant8|quant4] [--out DIR]

``--codec`` holds every snapshot compressed on the device (``SnapshotStore(codec=...)``): quant8 =
``TritonQuant(bits=8, mode="rel", bound=1e-2)``, quant4 = ``TritonQuant(bits=4, mode="rel",
bound=0.1)``, both **lossy**; the image is then checked by its PSNR against the reference
(>= 50 dB) instead of to 1e-6.

On the CPU it runs a 48^3 grid for 250 steps in seconds; on CUDA a 256^3 grid for 1000 steps.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # the repo, when torchckpt is not installed

import torch  # noqa: E402

from torchckpt.adjoint import run_schedule  # noqa: E402
from torchckpt.codecs import TritonQuant  # noqa: E402
from torchckpt.schedules import Tier, simulate  # noqa: E402
from torchckpt.memory import HostPool  # noqa: E402
from torchckpt.store import SnapshotStore  # noqa: E402
from wave import (  # noqa: E402
    RTM, make_schedule, cfl_dt, dominant_frequency, laplacian, layered_model, model_data, ricker, rtm_keep_all, smooth,
    step_torch, step_triton, surface_survey, triton_available,
)

CODECS = {
    "none": lambda: None,
    "quant8": lambda: TritonQuant(bits=8, mode="rel", bound=1e-2),
    "quant4": lambda: TritonQuant(bits=4, mode="rel", bound=0.1),
}
DX = 10.0  # m




class Problem:
    """Models, survey, wavelet and the recorded data (direct wave removed) for one grid."""

    def __init__(self, n: int, n_steps: int, device: torch.device, dtype: torch.dtype = torch.float32,
                 step=None) -> None:
        shape = (n, n, n)
        vel = layered_model(shape, DX, device, torch.float64)
        vmin, vmax = vel.min().item(), vel.max().item()
        self.dt = cfl_dt(vmax, DX)
        self.f0 = dominant_frequency(vmin, DX)
        self.vel = vel.to(dtype)
        to_vel2 = lambda v: (v * self.dt / DX).square().to(dtype).contiguous()  # noqa: E731
        self.vel2_true = to_vel2(vel)
        self.vel2_mig = to_vel2(smooth(vel))
        self.vel2_direct = to_vel2(torch.full_like(vel, vel[0].min().item()))
        self.survey = surface_survey(shape, depth=2, stride=1, device=device)
        self.wavelet = ricker(n_steps, self.dt, self.f0)
        self.n_steps = n_steps
        self.step = step
        self.data: torch.Tensor | None = None

    def model(self) -> torch.Tensor:
        """Record the survey in the true model minus the direct wave (its reflections only)."""
        kw = {} if self.step is None else dict(step=self.step)
        d = model_data(self.vel2_true, self.survey, self.wavelet, self.n_steps, **kw)
        d -= model_data(self.vel2_direct, self.survey, self.wavelet, self.n_steps, **kw)
        self.data = d
        return d

    def rtm(self) -> RTM:
        assert self.data is not None
        kw = {} if self.step is None else dict(step=self.step)
        return RTM(self.vel2_mig, self.survey, self.wavelet, self.data, **kw)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dot_product_test(n: int = 16, n_steps: int = 40) -> float:
    """<F w, r> against <w, F^T r> in float64 (NOTE [ Wave adjoint ], Rule 3); returns the relative gap."""
    g = torch.Generator().manual_seed(1)
    vel = layered_model((n, n, n), DX, "cpu", torch.float64)
    dt = cfl_dt(vel.max().item(), DX)
    vel2 = (vel * dt / DX).square()
    survey = surface_survey((n, n, n), depth=2, stride=2)
    w = torch.randn(n_steps, generator=g, dtype=torch.float64)
    r = torch.randn(n_steps + 1, survey.n_rec, generator=g, dtype=torch.float64)
    r[0] = 0
    step = lambda u, up, v, out: out.copy_(step_torch(u, up, v))  # noqa: E731
    fw = model_data(vel2, survey, w.tolist(), n_steps, step=step)
    rtm = RTM(vel2, survey, [0.0] * n_steps, r, step=step)
    ftr = torch.empty(n_steps, dtype=torch.float64)
    ftr[n_steps - 1] = rtm.p.flat()[survey.src]  # dJ/dw_{N-1} = p_N[s]
    for k in range(n_steps - 1, 0, -1):  # backward(k) makes p_k; dJ/dw_{k-1} = p_k[s]
        rtm.backward(k)
        ftr[k - 1] = rtm.p.flat()[survey.src]
    lhs, rhs = (fw * r).sum().item(), (w * ftr).sum().item()
    return abs(lhs - rhs) / max(abs(lhs), abs(rhs))


def triton_check(device: torch.device) -> float:
    """Max relative error of the Triton step against the PyTorch step, fp32 (0 without CUDA)."""
    if not triton_available(torch.empty(0, device=device)):
        return 0.0
    g = torch.Generator(device).manual_seed(0)
    shape = (67, 45, 300)  # odd sizes: every masked edge
    u, up = (torch.randn(shape, device=device, generator=g) for _ in range(2))
    v = torch.rand(shape, device=device, generator=g) * 0.3
    ref = step_torch(u, up, v)
    out = step_triton(u, up, v, torch.empty_like(u))
    return ((out - ref).abs().max() / ref.abs().max()).item()


def save_png(path: str, prob: Problem, image: torch.Tensor, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not importable: skipping {path}")
        return
    n = image.shape[1]
    extent = (0, image.shape[2] * DX / 1e3, image.shape[0] * DX / 1e3, 0)
    vel = prob.vel[:, n // 2].float().cpu()
    raw = image[:, n // 2].float().cpu()
    filt = -laplacian(image.double())[:, n // 2].float().cpu()  # removes the low-wavenumber backscatter
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    im = axes[0].imshow(vel, cmap="viridis", extent=extent)
    fig.colorbar(im, ax=axes[0], label="m/s")
    axes[0].set_title("velocity (true), y = middle")
    for ax, img, name in ((axes[1], raw, "RTM image"), (axes[2], filt, "RTM image, Laplacian filtered")):
        img = img.clone()
        img[:4] = 0  # the source and receiver depth
        c = torch.quantile(img.abs().flatten(), 0.99).item() or 1.0
        ax.imshow(img, cmap="gray", vmin=-c, vmax=c, extent=extent)
        ax.set_title(name)
    for ax in axes:
        ax.set_xlabel("x (km)")
        ax.set_ylabel("depth (km)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def table(rows: list[tuple[str, str]]) -> None:
    w = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"  {a.ljust(w)}  {b}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", choices=("revolve", "zcut", "uniform"), default="revolve")
    p.add_argument("--snapshots", type=int, help="snapshot slots (default 8 on CPU, 48 on CUDA)")
    p.add_argument("--tier", choices=("host", "gpu"), default="host", help="where snapshots live (default host)")
    p.add_argument("--slots", type=int, default=3, help="device cache slots in front of host snapshots")
    p.add_argument("--grid", type=int, help="cube edge in cells (default 48 on CPU, 256 on CUDA)")
    p.add_argument("--steps", type=int, help="time steps (default 250 on CPU, 1000 on CUDA)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--check-bytes", type=float, default=4.0,
                   help="GiB the keep-everything reference may hold; past it the check runs on 48^3 x 250 steps")
    p.add_argument("--codec", choices=tuple(CODECS), default="none", help="compress the snapshots (lossy)")
    p.add_argument("--out", help="output folder (default $OUT, else ./out)")
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    n = args.grid or (256 if cuda else 48)
    n_steps = args.steps or (1000 if cuda else 250)
    snapshots = args.snapshots or (48 if cuda else 8)
    tier = Tier.HOST if args.tier == "host" else Tier.GPU
    out = args.out or os.environ.get("OUT") or "out"
    os.makedirs(out, exist_ok=True)
    schedule = make_schedule(args.schedule, n_steps, snapshots, tier)
    snap_bytes = 2 * n**3 * 4
    sim = simulate(schedule, snapshot_bytes=snap_bytes)
    print(f"RTM: {n}^3 fp32 grid, {n_steps} steps on {torch.cuda.get_device_name(device) if cuda else 'CPU'}; "
          f"{schedule!r}; snapshot (u_n, u_n-1) {snap_bytes / 2**20:.1f} MiB; "
          f"{args.slots} device slots" + (" (host tier)" if tier is Tier.HOST else " (unused: GPU tier)"), flush=True)
    ok = True

    err = triton_check(device)
    if cuda:
        print(f"Triton step vs PyTorch step: max relative error {err:.2e}", flush=True)
        ok &= err < 1e-5

    prob = Problem(n, n_steps, device)
    print(f"model: v {prob.vel.min().item():.0f}..{prob.vel.max().item():.0f} m/s, dx {DX:g} m, dt {prob.dt * 1e3:.3f} ms, "
          f"Ricker f0 {prob.f0:.1f} Hz, {prob.survey.n_rec} receivers", flush=True)
    sync(device)
    t0 = time.perf_counter()
    prob.model()
    sync(device)
    t_model = time.perf_counter() - t0
    print(f"forward modelling (true model and direct wave): {t_model:.2f} s", flush=True)

    rtm = prob.rtm()
    pool = HostPool(pin=cuda) if cuda else HostPool(pin=False, chunk_bytes=1 << 20)
    if tier is Tier.HOST:  # grow (pin) the pool before the clock starts: pinning is a one-time cost
        blocks = [pool.alloc(snap_bytes) for _ in range(sim.peak_snapshots[tier] + 2 * args.slots)]
        for b in blocks:
            pool.free(b)
    codec = CODECS[args.codec]()
    store = SnapshotStore(device, slots=args.slots, host=pool, codec=codec)
    sync(device)
    t0 = time.perf_counter()
    # slots=: run_schedule plans prefetches for `slots`, not for the store's own slot count.
    st = run_schedule(schedule, forward=rtm.forward, save=rtm.save, restore=rtm.restore, backward=rtm.backward,
                      store=store, slots=args.slots)
    sync(device)
    t_rtm = time.perf_counter() - t0
    store.close()
    image = rtm.image.clone()

    # The keep-everything reference, on this problem if it fits, else on a small one.
    if n_steps * n**3 * 4 <= args.check_bytes * 2**30:
        ref_prob, ref_rtm, ref_sched = prob, rtm, None
    else:
        ref_prob = Problem(48, 250, device)
        ref_prob.model()
        ref_rtm = ref_prob.rtm()
        ref_sched = make_schedule(args.schedule, 250, 8, tier)
        run_schedule(ref_sched, forward=ref_rtm.forward, save=ref_rtm.save, restore=ref_rtm.restore,
                     backward=ref_rtm.backward, store=SnapshotStore(device, slots=args.slots, host=pool, codec=codec),
                     slots=args.slots)
    got = ref_rtm.image.clone()
    sync(device)
    t0 = time.perf_counter()
    ref = rtm_keep_all(ref_rtm)
    sync(device)
    t_ref = time.perf_counter() - t0
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    where = "" if ref_sched is None else f" (on 48^3 x 250 steps, {ref_sched!r})"
    print(f"image vs keep-every-wavefield reference{where}: max relative difference {rel:.2e}", flush=True)
    if codec is None:
        ok &= rel <= 1e-6
    else:
        mse = (got.double() - ref.double()).square().mean().item()
        psnr = float("inf") if mse == 0 else 10 * math.log10((ref.max() - ref.min()).item() ** 2 / mse)
        print(f"lossy snapshots ({codec!r}, ratio {st.ratio:.2f}x): image PSNR {psnr:.1f} dB (>= 50 dB required)",
              flush=True)
        ok &= psnr >= 50.0
    dot = dot_product_test()
    print(f"adjoint dot-product test (float64, 16^3, 40 steps): relative gap {dot:.2e}", flush=True)
    ok &= dot < 1e-12

    print()
    print("timing" + ("" if cuda else " (CPU)"))
    gib = 2**30
    table([
        ("forward modelling (2 runs)", f"{t_model:.2f} s"),
        ("RTM under the schedule", f"{t_rtm:.2f} s  ({sim.forward_steps} forward advances + {n_steps} adjoint steps, "
                                   f"recompute {sim.recompute_ratio:.2f}x)"),
        ("reference RTM, all wavefields kept", f"{t_ref:.2f} s" + where),
        ("snapshots saved / restored", f"{st.saves} / {st.restores} ({st.host_saves} to host)"),
        ("cache hit rate", f"{st.hit_rate:.3f} ({st.hits} hits, {st.misses} misses, {st.prefetches} prefetches)"),
        ("late prefetches", f"{st.late_prefetches} ({st.late_wait_s * 1e3:.1f} ms waited)" if cuda else "n/a (CPU)"),
        ("bytes moved", f"{st.bytes_to_host / gib:.3f} GiB to host, {st.bytes_to_device / gib:.3f} GiB to device"),
    ])
    save_png(os.path.join(out, "rtm_image.png"), prob, image,
             f"RTM, {n}^3, {n_steps} steps, {schedule!r}, max |image - reference| / max |reference| = {rel:.1e}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
