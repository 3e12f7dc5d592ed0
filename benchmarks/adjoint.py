"""RTM-style adjoint of a 3D wave equation under Revolve, zCut and Uniform: where should snapshots live?

One reverse time migration (examples/wave.py: the forward step is one fused Triton stencil
pass; ``backward(n)`` is one receiver-wavefield stencil step of the same cost plus the imaging
condition) is run through each schedule three ways, in one process:

(a) ``Tier.GPU``: every snapshot in GPU memory (the compute-only reference, where it fits).
(b) GPUZIP's baseline: snapshots in pinned host buffers, saved and restored with blocking
    ``copy_`` (what ``.cpu()`` / ``.to()`` do, without allocating), no cache, no overlap. A
    plain action loop of this script; torchckpt is not involved.
(c) torchckpt: ``Tier.HOST`` snapshots through ``SnapshotStore(device, slots=k, host=HostPool())``
    with prefetches planned by ``plan_prefetch`` (``run_schedule``'s default), k = 2..6.

A snapshot is the state (u_n, u_{n-1}): two fp32 grids (2 x 64 MiB = 128 MiB at 256^3), saved and
restored as one. Revolve and Uniform get ``--snapshots`` slots (48 by default for 1000 steps:
Revolve advances 1950 forward steps, 1.95x, a moderate recomputation; Uniform, with the same
slots, recomputes ~11x). zCut cannot reverse 1000 steps in fewer than its least peak (62
snapshots), so it gets ``memory_slots=--snapshots`` when that fits, else its least peak. All of
them hold far more snapshots than the k cache slots.

Link bound of (c): max(time of (a), bytes_to_host / D2H + bytes_to_device / H2D), with the run's
own byte counts (every Save to host plus every host-to-device copy, prefetched or missed) and the
pinned bandwidth measured in this run (1 GiB copies timed with CUDA events). Targets: (c) >= 3x
faster than (b) for every schedule, and within 1.2x of its link bound. The best any
implementation of (c) could do against (b) is (b) / link bound; it is printed, so a target the
link makes unreachable is visible as such. Every run's image is compared with (a)'s: the
snapshots must come back bit for bit.

Exit status 1 only for a wrong result (an image that differs, the Triton check); the timing
targets are printed as PASS/FAIL. Writes ``adjoint.json`` and ``adjoint.png`` (per schedule: (a), (b), best (c), link bound).
Without CUDA it runs a tiny version (24^3, 50 steps, 6 snapshots, k = 2..3) as a smoke test.

    python benchmarks/adjoint.py [--grid 256] [--steps 1000] [--snapshots 48] [--slots 2,3,4,5,6]
                                 [--schedules revolve,zcut,uniform] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(1, ROOT)  # the repo, when torchckpt is not installed
sys.path.insert(2, os.path.join(ROOT, "examples"))  # wave.py

import torch  # noqa: E402

import torchckpt  # noqa: E402
from common import GiB, fmt, out_dir, pinned_bandwidth, plot_bars, print_table, write_json  # noqa: E402
from torchckpt.adjoint import run_schedule  # noqa: E402
from torchckpt.schedules import (  # noqa: E402
    Adjoint, Advance, End, EndForward, Free, Restore, Revolve, Save, Tier, simulate,
)
from torchckpt.memory import HostPool  # noqa: E402
from torchckpt.store import SnapshotStore  # noqa: E402
from wave import (  # noqa: E402
    RTM, make_schedule, cfl_dt, dominant_frequency, layered_model, model_data, ricker, smooth, step_torch, step_triton,
    surface_survey, triton_available,
)

SCHEDULES = ("revolve", "zcut", "uniform")
CPU_NOTE = "CPU: times are not meaningful (smoke test at a tiny size; no link bound)"
DX = 10.0




def run_sync_host(schedule, rtm: RTM, bufs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Baseline (b): a plain action loop; Save/Restore are blocking copies to/from pinned buffers."""
    free = list(range(len(bufs)))
    held: dict[int, int] = {}
    for a in schedule:
        t = type(a)
        if t is Advance:
            rtm.forward(a.n0, a.n1)
        elif t is Adjoint:
            rtm.backward(a.n)
        elif t is Save:
            i = free.pop()
            held[a.n] = i
            bufs[i][0].copy_(rtm.u.cur)  # blocking device-to-host (the stream is synchronised)
            bufs[i][1].copy_(rtm.u.prev)
        elif t is Restore:
            hu, hp = bufs[held[a.n]]
            rtm.u.cur.copy_(hu)  # blocking host-to-device
            rtm.u.prev.copy_(hp)
        elif t is Free:
            free.append(held.pop(a.n))
        elif t in (EndForward, End):
            pass
        else:
            raise TypeError(f"unexpected action {a!r}")


class Bench:
    def __init__(self, args: argparse.Namespace, cuda: bool) -> None:
        self.args, self.cuda = args, cuda
        self.dev = torch.device("cuda" if cuda else "cpu")
        n, N = args.grid, args.steps
        shape = (n, n, n)
        vel = layered_model(shape, DX, self.dev, torch.float64)
        dt = cfl_dt(vel.max().item(), DX)
        wavelet = ricker(N, dt, dominant_frequency(vel.min().item(), DX))
        survey = surface_survey(shape, depth=2, stride=2, device=self.dev)
        vel2_true = (vel * dt / DX).square().float().contiguous()
        vel2_mig = (smooth(vel) * dt / DX).square().float().contiguous()
        del vel
        self.sync()
        t0 = time.perf_counter()
        data = model_data(vel2_true, survey, wavelet, N)
        self.sync()
        self.model_s = time.perf_counter() - t0
        del vel2_true
        self.rtm = RTM(vel2_mig, survey, wavelet, data)
        self.snap_bytes = 2 * n**3 * 4

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn) -> tuple[float, object]:
        self.rtm.reset()
        self.sync()
        t0 = time.perf_counter()
        r = fn()
        self.sync()
        return time.perf_counter() - t0, r

    def run_gpu(self, sched) -> tuple[float, object]:
        store = SnapshotStore(self.dev, slots=1, host=self.pool)
        try:
            return self.timed(lambda: run_schedule(sched, forward=self.rtm.forward, save=self.rtm.save,
                                                   restore=self.rtm.restore, backward=self.rtm.backward,
                                                   store=store, slots=1))
        finally:
            store.close()

    def run_host(self, sched, k: int) -> tuple[float, object]:
        store = SnapshotStore(self.dev, slots=k, host=self.pool)
        try:
            # slots=k: run_schedule plans prefetches for its own `slots` argument, not the store's.
            return self.timed(lambda: run_schedule(sched, forward=self.rtm.forward, save=self.rtm.save,
                                                   restore=self.rtm.restore, backward=self.rtm.backward,
                                                   store=store, slots=k))
        finally:
            store.close()

    def run_sync(self, sched) -> tuple[float, object]:
        return self.timed(lambda: run_sync_host(sched, self.rtm, self.bufs))

    def alloc_host(self, peak: int, kmax: int) -> float:
        """Pinned buffers of (b) and a pre-grown pool for (c), outside every timed region."""
        t0 = time.perf_counter()
        like = self.rtm.u.cur
        self.bufs = [(torch.empty(like.shape, dtype=like.dtype, pin_memory=self.cuda),
                      torch.empty(like.shape, dtype=like.dtype, pin_memory=self.cuda)) for _ in range(peak)]
        self.pool = HostPool() if self.cuda else HostPool(pin=False, chunk_bytes=1 << 20)
        # Live snapshots (<= peak) plus blocks freed while their copy is still in flight: the host
        # thread runs far ahead of the GPU, so up to about as many again are parked (measured at 256^3).
        blocks = [self.pool.alloc(self.snap_bytes) for _ in range(2 * peak + 16 + 4 * kmax)]
        for b in blocks:
            self.pool.free(b)
        return time.perf_counter() - t0

    def image_diff(self, ref: torch.Tensor | None) -> float:
        if ref is None:
            return float("nan")
        img = self.rtm.image
        return 0.0 if torch.equal(img, ref) else ((img - ref).abs().max() / ref.abs().max()).item()


def stats_dict(st) -> dict:
    d = dataclasses.asdict(st)
    d["hit_rate"] = st.hit_rate
    return d


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", type=int, help="cube edge in cells (default 256; 24 on CPU)")
    p.add_argument("--steps", type=int, help="time steps (default 1000; 50 on CPU)")
    p.add_argument("--snapshots", type=int, help="snapshot slots of Revolve/Uniform (default 48; 6 on CPU)")
    p.add_argument("--slots", help="device cache slots k of (c), comma-separated (default 2,3,4,5,6; 2,3 on CPU)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of " + ",".join(SCHEDULES))
    p.add_argument("--out", help="output folder (default $OUT, else benchmarks/results)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    args.grid = args.grid or (256 if cuda else 24)
    args.steps = args.steps or (1000 if cuda else 50)
    args.snapshots = args.snapshots or (48 if cuda else 6)
    ks = [int(k) for k in (args.slots or ("2,3,4,5,6" if cuda else "2,3")).split(",")]
    names = [s for s in args.schedules.split(",") if s]
    if any(s not in SCHEDULES for s in names) or min(ks) < 1 or args.steps < 2:
        p.error("--schedules takes a subset of " + ",".join(SCHEDULES) + "; --slots values >= 1; --steps >= 2")
    out = out_dir(args.out)
    device = torch.cuda.get_device_name() if cuda else "CPU"
    n, N = args.grid, args.steps
    print(f"adjoint: {device}, torch {torch.__version__}, torchckpt {torchckpt.__version__}; {n}^3 fp32 grid, "
          f"{N} steps; snapshot (u_n, u_n-1) = {2 * n**3 * 4 / 2**20:.1f} MiB; k = {ks}", flush=True)
    if not cuda:
        print(CPU_NOTE, flush=True)
    res: dict = dict(device=device, cuda=cuda, torch=torch.__version__, torchckpt=torchckpt.__version__,
                     note=None if cuda else CPU_NOTE, grid=n, steps=N, snapshots=args.snapshots, slots=ks,
                     snapshot="(u_n, u_n-1), one snapshot of two fp32 grids")
    ok = True

    if cuda:
        g = torch.Generator("cuda").manual_seed(0)
        shape = (67, 45, 300)  # odd sizes: every masked edge
        u, up = (torch.randn(shape, device="cuda", generator=g) for _ in range(2))
        v = torch.rand(shape, device="cuda", generator=g) * 0.3
        ref = step_torch(u, up, v)
        err = ((step_triton(u, up, v, torch.empty_like(u)) - ref).abs().max() / ref.abs().max()).item()
        print(f"Triton step vs PyTorch step (fp32): max relative error {err:.2e} "
              f"({'ok' if err < 1e-5 else 'FAIL: > 1e-5'})", flush=True)
        res["triton_rel_err"] = err
        if err >= 1e-5:
            return 1
        del u, up, v, ref
        d2h, h2d = pinned_bandwidth(GiB)
        print(f"pinned 1 GiB copies: D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s", flush=True)
    else:
        d2h = h2d = float("nan")
        res["triton_rel_err"] = None
    res["bandwidth_GBps"] = dict(d2h=d2h / 1e9, h2d=h2d / 1e9)

    bench = Bench(args, cuda)
    print(f"forward modelling of the data: {bench.model_s:.2f} s; "
          f"stencil via {'Triton' if triton_available(bench.rtm.vel2) else 'PyTorch'}", flush=True)
    sb = bench.snap_bytes
    scheds = {s: (make_schedule(s, N, args.snapshots, Tier.GPU), make_schedule(s, N, args.snapshots, Tier.HOST))
              for s in names}
    sims = {s: simulate(h, snapshot_bytes=sb) for s, (_, h) in scheds.items()}
    peak = max(sim.peak_snapshots[Tier.HOST] for sim in sims.values())
    t_alloc = bench.alloc_host(peak, max(ks))
    print(f"host memory: {peak} pinned snapshot buffers for (b), pool of {bench.pool.stats().reserved_bytes / GiB:.1f} GiB "
          f"for (c), in {t_alloc:.1f} s (untimed)", flush=True)

    # Warm-up: Triton compilation, streams, allocator, pool; not timed.
    main_rtm = bench.rtm
    warm = Revolve(min(N, 20), 4, tier=Tier.HOST)
    bench.rtm = RTM(main_rtm.vel2, main_rtm.survey, main_rtm.wavelet, main_rtm.residual[: warm.n_steps + 1])
    bench.run_gpu(Revolve(warm.n_steps, 4))
    bench.run_sync(warm)
    bench.run_host(warm, max(ks))
    bench.rtm = main_rtm

    rows: list[list[str]] = []
    results: dict = {}
    for s, (sg, sh) in scheds.items():
        sim = sims[s]
        r: dict = dict(schedule=repr(sh), forward_steps=sim.forward_steps, recompute=sim.recompute_ratio,
                       peak_snapshots=sim.peak_snapshots[Tier.HOST], saves=sim.saves[Tier.HOST],
                       restores=sim.restores[Tier.HOST])
        print(f"\n== {s}: {sh!r}: {sim.forward_steps} forward advances ({sim.recompute_ratio:.2f}x) + {N} adjoint "
              f"steps; peak {r['peak_snapshots']} snapshots ({r['peak_snapshots'] * sb / GiB:.2f} GiB); "
              f"{r['saves']} saves, {r['restores']} restores", flush=True)
        ref = None
        try:
            print(f"[{s} (a) GPU tier] running", flush=True)
            ta, _ = bench.run_gpu(sg)
            ref = bench.rtm.image.clone()
            r["a"] = dict(time_s=ta)
            print(f"[{s} (a) GPU tier] {ta:.3f} s", flush=True)
        except torch.cuda.OutOfMemoryError as e:
            ta = float("nan")
            r["a"] = dict(time_s=ta, error=f"out of memory: {e}".splitlines()[0])
            print(f"[{s} (a) GPU tier] does not fit: {r['a']['error']}", flush=True)
            torch.cuda.empty_cache()

        print(f"[{s} (b) sync host] running", flush=True)
        tb, _ = bench.run_sync(sh)
        if ref is None:
            ref = bench.rtm.image.clone()
        moved_b = (r["saves"] + r["restores"]) * sb
        r["b"] = dict(time_s=tb, image_diff=bench.image_diff(ref), bytes_moved=moved_b)
        print(f"[{s} (b) sync host] {tb:.3f} s, {moved_b / GiB:.3g} GiB moved, "
              f"image {'== (a)' if r['b']['image_diff'] == 0 else 'diff ' + fmt(r['b']['image_diff'], '.1e')}",
              flush=True)
        ab = (lambda t: fmt(t / ta, ".2f") + "x"), (lambda t: fmt(tb / t, ".2f") + "x")
        rows.append([s, "(a) GPU tier", fmt(ta, ".3f"), "1.00x", fmt(tb / ta, ".2f") + "x", "-", "-", "-", "-", "-",
                     "-", "-", "ref"])
        rows.append([s, "(b) sync host", fmt(tb, ".3f"), ab[0](tb), "1.00x", "-", "-", "-",
                     fmt(r["saves"] * sb / GiB, ".3g"), fmt(r["restores"] * sb / GiB, ".3g"), "-", "-",
                     "==" if r["b"]["image_diff"] == 0 else fmt(r["b"]["image_diff"], ".1e")])
        r["c"] = []
        for k in ks:
            grown = bench.pool.stats().chunk_allocations
            print(f"[{s} (c) torchckpt k={k}] running", flush=True)
            tc, st = bench.run_host(sh, k)
            grown = bench.pool.stats().chunk_allocations - grown
            bound = max(ta, st.bytes_to_host / d2h + st.bytes_to_device / h2d) if cuda else float("nan")
            c = dict(k=k, time_s=tc, over_a=tc / ta, speedup_over_b=tb / tc, link_bound_s=bound,
                     over_bound=tc / bound, best_possible_speedup_over_b=tb / bound, image_diff=bench.image_diff(ref),
                     pool_chunks_grown=grown, stats=stats_dict(st))
            r["c"].append(c)
            late = f"{st.late_prefetches} ({st.late_wait_s * 1e3:.1f} ms)" if cuda else "n/a"
            print(f"[{s} (c) torchckpt k={k}] {tc:.3f} s = {fmt(tc / ta, '.2f')}x (a), {tb / tc:.2f}x faster than (b); "
                  f"hit rate {st.hit_rate:.3f}, {st.prefetches} prefetches, late {late}, {st.misses} misses "
                  f"({st.miss_wait_s * 1e3:.1f} ms), {st.save_waits} save waits ({st.save_wait_s * 1e3:.1f} ms); "
                  f"{st.bytes_to_host / GiB:.3g} GiB to host, {st.bytes_to_device / GiB:.3g} GiB to device; "
                  + (f"link bound {bound:.3f} s ({tc / bound:.2f}x)" if cuda else "link bound n/a")
                  + (f"; host pool grew by {grown} chunks during the run" if grown else ""), flush=True)
            rows.append([s, f"(c) torchckpt k={k}", fmt(tc, ".3f"), ab[0](tc), ab[1](tc), f"{st.hit_rate:.3f}",
                         late, str(st.misses), fmt(st.bytes_to_host / GiB, ".3g"), fmt(st.bytes_to_device / GiB, ".3g"),
                         fmt(bound, ".3f"), fmt(tc / bound, ".2f") + "x" if cuda else "n/a",
                         "==" if c["image_diff"] == 0 else fmt(c["image_diff"], ".1e")])
        best = min(r["c"], key=lambda c: c["time_s"])
        r["best_k"] = best["k"]
        images_ok = r["b"]["image_diff"] == 0 and all(c["image_diff"] == 0 for c in r["c"])
        ok &= images_ok
        if cuda:
            t3 = best["speedup_over_b"] >= 3.0
            t12 = best["over_bound"] <= 1.2
            r["targets"] = {
                "(c) >= 3x faster than (b)": dict(
                    verdict="PASS" if t3 else "FAIL",
                    detail=f"k={best['k']}: {tb:.3f} / {best['time_s']:.3f} s = {best['speedup_over_b']:.2f}x; "
                           f"the link allows at most {best['best_possible_speedup_over_b']:.2f}x"),
                "(c) within 1.2x of its link bound": dict(
                    verdict="PASS" if t12 else "FAIL",
                    detail=f"k={best['k']}: {best['time_s']:.3f} / {best['link_bound_s']:.3f} s = {best['over_bound']:.2f}x"),
            }
        else:
            r["targets"] = {"(c) >= 3x faster than (b)": dict(verdict="n/a (CPU)", detail=""),
                            "(c) within 1.2x of its link bound": dict(verdict="n/a (CPU)", detail="")}
        r["targets"]["images equal (a)'s bit for bit"] = dict(verdict="PASS" if images_ok else "FAIL", detail="")
        results[s] = r
    res["schedules"] = results

    print()
    if not cuda:
        print(CPU_NOTE)
    print_table(["schedule", "run", "time s", "x (a)", "vs (b)", "hit rate", "late (ms)", "misses", "to host GiB",
                 "to dev GiB", "link bound s", "x bound", "image"], rows)
    if cuda:
        print(f"pinned D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s; link bound = max((a), to host / D2H + "
              "to device / H2D); 'vs (b)' = (b) time / this time")
    for s, r in results.items():
        for name, t in r["targets"].items():
            print(f"target {s}: {name}: {t['verdict']}" + (f"  ({t['detail']})" if t["detail"] else ""))
    sys.stdout.flush()

    write_json(os.path.join(out, "adjoint.json"), res)
    labels = ["(a) GPU tier", "(b) sync host", "(c) torchckpt, best k", "link bound of (c)"]
    panels = {}
    for s, r in results.items():
        best = next(c for c in r["c"] if c["k"] == r["best_k"])
        panels[f"{s}: time (s), best k={best['k']}"] = [r["a"]["time_s"], r["b"]["time_s"], best["time_s"],
                                                         best["link_bound_s"]]
    plot_bars(os.path.join(out, "adjoint.png"), labels, panels,
              f"{device}, torch {torch.__version__}, RTM {n}^3 fp32, {N} steps, {sb / 2**20:.0f} MiB snapshots"
              + ("\n" + CPU_NOTE if not cuda else ""))
    # Exit status: correctness only (images, Triton check); the timing targets are reported above.
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
