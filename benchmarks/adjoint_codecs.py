"""RTM adjoint with compressed snapshots: how much faster than synchronous host checkpointing?

The claim (issue 26): with the best codec, the adjoint run is at least 7x faster than
the synchronous host baseline for Revolve and at least 8x for zCut (GPUZIP's best), with the
image's PSNR reported. Same RTM, schedules and baseline as ``benchmarks/adjoint.py``, in one process:

(a) ``Tier.GPU``, uncompressed: every snapshot in GPU memory; its image is the reference.
(b) GPUZIP's baseline: blocking copies to and from pinned host buffers (``adjoint.run_sync_host``).
(d) torchckpt: ``Tier.HOST`` snapshots through ``SnapshotStore(gpu_bytes=B, codec=c)``: every
    snapshot is compressed on the GPU at save, held compressed in the slots and in host memory,
    decompressed at restore (NOTE [ Snapshot store ] Rules 8, 9), straight into the wavefield's state
    (``run_schedule(restore_into=...)``, NOTE [ Snapshot store ] Rule 11). The GPU budget B is the same
    for every codec (``--budget-slots`` uncompressed snapshots, 6 by default = 768 MiB at 256^3),
    so a codec's ratio becomes more slots. ``none`` is the uncompressed store with the same budget
    (= (c) of adjoint.py at k = budget slots). ``--sizes exact,deferred`` runs each codec's (d) with
    ``SnapshotStore(defer_sizes=False)`` (``exact``, the default: each save reads its compressed sizes back)
    and ``defer_sizes=True`` (``deferred``: sizes left on the device, NOTE [ Snapshot sizes ]), in turns in
    this process; a deferred row is labelled ``(d) <codec> deferred`` (JSON key ``<codec>+deferred``), its
    image compared bit for bit with the exact row's (``image_equal_exact``: the restores decode the same
    bits either way). ``graphs``: ``defer_sizes=True, graphs=True``, each save's compression a CUDA graph
    replayed (NOTE [ Captured saves ]; CUDA only), labelled ``(d) <codec> graphs``. ``deferred:K`` and
    ``graphs:K``: with ``sizes_in_flight=K`` (default 2: snapshots whose sizes may be on the device at once, NOTE
    [ Snapshot sizes ] Rule 3). ``none`` has no sizes to defer and runs once.

Codecs: ``quant8`` = TritonQuant(bits=8, mode="rel", bound=1e-2), ``quant4`` = TritonQuant(bits=4,
mode="rel", bound=0.1) (lossy; per element |x - x'| <= bound * max|x| of its 256-element block),
``quant8a`` / ``quant4a`` = TritonQuant(bits=8 / 4, mode="abs", bound=2e-3 / 1e-2 x the wavefield's
peak |u|, measured by one untimed forward sweep) (lossy; per element |x - x'| <= bound),
plus ``bitcomp``/``zfp`` when their modules are importable and available (skipped with the reason
otherwise). PSNR of the image against (a)'s: 20 log10(peak-to-peak of (a)'s image / RMS difference).

    python benchmarks/adjoint_codecs.py [--grid 256] [--steps 1000] [--snapshots 48] [--budget-slots 6]
                                        [--codecs none,quant8,quant4] [--schedules revolve,zcut,uniform] [--out DIR]
                                        [--sizes exact,deferred,graphs] [--profile [--profile-turns K] [--trace-dir DIR]] [--pyprofile]
                                        [--memstats] [--turns K [--ab-launches]]
Writes ``adjoint_codecs.json`` and ``adjoint_codecs.png``. On CPU: a tiny smoke test.

``--turns K``: every (d) configuration run K more times, in turns (each configuration once a turn), its median
beside its single figure and the targets judged on the medians: on the H100 machines one configuration's time varied
by up to 1.6x between processes minutes apart. ``--ab-launches`` adds, in the same turns, each TritonQuant
configuration with its kernels launched through Triton's JIT (NOTE [ Kernel launches ]): a before/after of the
compiled launches in one process.

``--memstats``: each (d) run's caching-allocator figures over its timed run (``torch.cuda.memory_stats()`` after
minus before: allocator retries, ``cudaMalloc``/``cudaFree`` calls, synchronisations of all streams, allocations,
segments; the peak of inactive split blocks and of reserved memory) and the Python collector's collections per
generation, in its JSON record (``memstats``; each ``--turns`` turn's in ``turns_memstats``) and one line per run and
turn; without CUDA, not measured (``memstats`` is ``None``).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(1, os.path.dirname(HERE))
sys.path.insert(2, os.path.join(os.path.dirname(HERE), "examples"))

import torch  # noqa: E402

from adjoint import Bench, stats_dict  # noqa: E402
from common import (GiB, device_gaps, device_idle, fmt, out_dir, pinned_bandwidth, plot_bars,  # noqa: E402
                    print_table, profiler_events, write_json)
from torchckpt.adjoint import run_schedule  # noqa: E402
from torchckpt.codecs import TritonQuant  # noqa: E402
from torchckpt.schedules import Revolve, Tier, simulate  # noqa: E402
from torchckpt.store import SnapshotStore  # noqa: E402
from wave import RTM, GraphedRTM, make_schedule  # noqa: E402

SCHEDULES = ("revolve", "zcut", "uniform")
TARGETS = {"revolve": 7.0, "zcut": 8.0}


def make_codec(name: str, peak: float = 1.0):
    """(codec or None, reason it is unavailable or None). ``peak``: the wavefield's largest |u|."""
    if name == "none":
        return None, None
    if name == "quant8a":  # absolute bounds scaled to the data: what a seismic user states
        return TritonQuant(bits=8, mode="abs", bound=2e-3 * peak), None
    if name == "quant4a":
        return TritonQuant(bits=4, mode="abs", bound=1e-2 * peak), None
    if name == "quant8":
        return TritonQuant(bits=8, mode="rel", bound=1e-2), None
    if name == "quant4":
        return TritonQuant(bits=4, mode="rel", bound=0.1), None
    if name.startswith("bitcomp"):
        try:
            mod = importlib.import_module("torchckpt.codecs.bitcomp")
            c = mod.Bitcomp(delta=float(name.split(":")[1])) if ":" in name else mod.Bitcomp()
        except Exception as e:  # noqa: BLE001
            return None, f"{type(e).__name__}: {e}"
    elif name.startswith("zfp"):
        try:
            mod = importlib.import_module("torchckpt.codecs.zfp")
            c = mod.ZFP(rate=float(name.split(":")[1]) if ":" in name else 8.0)
        except Exception as e:  # noqa: BLE001
            return None, f"{type(e).__name__}: {e}"
    else:
        raise SystemExit(f"unknown codec {name!r}")
    why = c.unavailable_reason()
    return (c, None) if why is None else (None, why)


# torch.cuda.memory_stats() counters reported by --memstats as the change over a run
MEM_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams",
                "allocation.all.allocated", "segment.all.allocated")
MEM_PEAKS = ("inactive_split.all.peak",)  # peaks since the run's start (the peaks are reset before it)


def memstats_delta(before: dict, after: dict, max_reserved: int | None) -> dict:
    """``--memstats``'s record of a run from ``torch.cuda.memory_stats()`` before and after it (peaks reset before):
    the change of each of ``MEM_COUNTERS``, each of ``MEM_PEAKS`` as it is after, and ``max_memory_reserved`` (bytes);
    ``None`` for a figure this torch does not report."""
    rec: dict = {k: after[k] - before.get(k, 0) if k in after else None for k in MEM_COUNTERS}
    rec.update({k: after.get(k) for k in MEM_PEAKS})
    rec["max_memory_reserved"] = max_reserved
    return rec


def memstats_line(rec: dict) -> str:
    """One line of ``memstats_delta``'s figures."""
    def num(k: str, sign: bool = True) -> str:
        v = rec.get(k)
        return "-" if v is None else (f"{v:+d}" if sign else str(v))
    mr = rec.get("max_memory_reserved")
    return (f"alloc retries {num('num_alloc_retries')}, cudaMalloc {num('num_device_alloc')}, cudaFree "
            f"{num('num_device_free')}, sync all streams {num('num_sync_all_streams')}, allocations "
            f"{num('allocation.all.allocated')}, segments {num('segment.all.allocated')}; peak inactive splits "
            f"{num('inactive_split.all.peak', False)}, max reserved " + ("-" if mr is None else f"{mr / GiB:.3f} GiB")
            + ("" if rec.get("gc_collections") is None else f"; Python gc collections {rec['gc_collections']}"))


def with_memstats(fn, into: dict | None):
    """``fn()``; with ``into`` (a dict, CUDA only), ``memstats_delta`` over it is written into ``into``."""
    if into is None:
        return fn()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()
    gc_before = [g["collections"] for g in gc.get_stats()]
    try:
        return fn()
    finally:
        into.update(memstats_delta(before, torch.cuda.memory_stats(), torch.cuda.max_memory_reserved()))
        into["gc_collections"] = [g["collections"] - b for g, b in zip(gc.get_stats(), gc_before)]  # per generation


def store_kw(mode: str) -> dict:
    """``SnapshotStore``'s size settings for a ``--sizes`` mode: ``exact``, ``deferred[:K]`` or ``graphs[:K]`` (K:
    ``sizes_in_flight``, the store's default where not given); ``ValueError`` for any other."""
    base, _, k = mode.partition(":")
    if not (mode == "exact" or base in ("deferred", "graphs") and (not k or k.isdigit() and int(k) >= 1)):
        raise ValueError(mode)
    return dict(defer_sizes=mode != "exact", graphs=base == "graphs", **({"sizes_in_flight": int(k)} if k else {}))


def psnr(img: torch.Tensor, ref: torch.Tensor) -> float:
    mse = (img.double() - ref.double()).square().mean().item()
    rng = (ref.max() - ref.min()).item()
    return math.inf if mse == 0 else 20 * math.log10(rng / math.sqrt(mse))


WINDOW = "adjoint_codecs: traced run"


def profile_light(fn) -> dict:
    """Run ``fn`` once more traced with the device's activity only (``ProfilerActivity.CUDA``: kernels, copies, sets
    and the runtime calls, no op recorded on the host, so less of the profiler's own host time in a host-bound run),
    between two ``torch.cuda.synchronize()`` calls that mark the window: ``common.device_idle``'s figures and
    ``run_s``, as ``profile_run`` returns them (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        run_s = fn()[0]
        torch.cuda.synchronize()
    events, window = profiler_events(prof, None, marker="cudaDeviceSynchronize")
    fig = device_idle(events, window)
    fig["run_s"] = run_s
    return fig


def profile_run(path: str, fn, untraced_s: float, trace: str | None = None) -> dict:
    """Run ``fn`` (a run: returns its time first) once more under torch.profiler, inside
    ``record_function(WINDOW)``; write where its time went to ``path``: the device's idle fraction over the
    window, the ops by device time and by host time, and the host's synchronizations (each makes the host wait for
    the device: launches stop running ahead); the raw trace to ``trace`` if given (Chrome trace JSON).

    Returns:
        ``run_s`` (the traced run's own timed region) and ``common.device_idle``'s figures over the window (the
        whole call: the store's set-up and close included): ``wall_s``, ``busy_s`` (union of the device's kernels,
        memcpys and memsets), ``idle_fraction``, ``syncs``, ``sync_calls``; without a device only ``wall_s`` and
        ``run_s`` are measured, the others are ``None``.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        with record_function(WINDOW):
            run_s = fn()[0]
    events, window = profiler_events(prof, WINDOW)
    gaps = None
    if cuda:
        fig = device_idle(events, window)
        gaps = device_gaps(events, window)
        fig["idle_by_tenth"] = gaps["idle_by_part"]
        head = (f"traced window {fig['wall_s']:.3f} s (timed run {run_s:.3f} s); device busy {fig['busy_s']:.3f} s "
                f"(union of kernels, memcpys, memsets), idle {fig['idle_fraction']:.1%}; host synchronisations "
                + (", ".join(f"{k} {v}" for k, v in fig["syncs"].items()) or "none") + "\n")
    else:
        fig = dict(wall_s=window[1] - window[0], busy_s=None, idle_fraction=None, syncs=None, sync_calls=None)
        head = f"traced window {fig['wall_s']:.3f} s (timed run {run_s:.3f} s); no device: idle fraction not measured\n"
    fig["run_s"] = run_s
    ka = prof.key_averages()
    dev_us = sum(e.self_device_time_total for e in ka)
    syncs = [e for e in ka if "Synchronize" in e.key or e.key in ("aten::item", "aten::_local_scalar_dense")]
    with open(path, "w") as f:
        f.write(f"untraced run {untraced_s:.3f} s; device time of all ops {dev_us / 1e6:.3f} s\n" + head)
        for e in syncs:
            f.write(f"sync {e.key}: {e.count} calls, host {e.cpu_time_total / 1e6:.3f} s\n")
        if gaps is not None:  # where the idle was: over the window, and between which device work
            f.write("\n== device idle by tenth of the window: "
                    + ", ".join(f"{x:.0%}" for x in gaps["idle_by_part"]) + "\n== largest gaps, by the device work "
                    "before and after them (any stream)\n")
            for g in gaps["gaps"]:
                f.write(f"{g['idle_s'] * 1e3:9.1f} ms {g['count']:6d} gaps  {g['before']}  ->  {g['after']}\n")
        f.write("\n== by device time\n" + ka.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
        f.write("\n== by host time\n" + ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    print(f"wrote {path}", flush=True)
    if trace is not None:
        prof.export_chrome_trace(trace)
        print(f"wrote {trace}", flush=True)
    return fig


def median_traced(figs: list[dict]) -> dict:
    """Of several traced runs of one configuration (``--profile-turns``), the one with the median idle fraction (the
    lower middle of an even count; the median window where no device measured one), with each turn's idle, window
    and timed run beside it under ``turns``, in the order they ran."""
    if not figs:
        raise ValueError("median_traced needs at least one traced run")
    measured = all(f["idle_fraction"] is not None for f in figs)
    ranked = sorted(figs, key=(lambda f: f["idle_fraction"]) if measured else (lambda f: f["wall_s"]))
    fig = dict(ranked[(len(ranked) - 1) // 2])
    fig["turns"] = [dict(idle_fraction=f["idle_fraction"], wall_s=f["wall_s"], run_s=f["run_s"]) for f in figs]
    return fig


def py_profile(path: str, fn, untraced_s: float) -> None:
    """Run ``fn`` (a run: returns its time first) once more under cProfile; write the functions with the most own
    time and the most cumulative time to ``path`` (the host's Python, which torch.profiler leaves as self time), and the
    whole profile beside it (``.prof``)."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    run_s = fn()[0]
    pr.disable()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    buf.write(f"untraced run {untraced_s:.3f} s; this run under cProfile {run_s:.3f} s\n\n== by own time\n")
    st.sort_stats("tottime").print_stats(40)
    buf.write("\n== by cumulative time\n")
    st.sort_stats("cumulative").print_stats(40)
    with open(path, "w") as f:
        f.write(buf.getvalue())
    pr.dump_stats(os.path.splitext(path)[0] + ".prof")  # the whole profile, for pstats' callers and callees
    print(f"wrote {path} and its .prof", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--snapshots", type=int)
    p.add_argument("--budget-slots", type=int, default=6, help="GPU budget in uncompressed snapshots (default 6)")
    p.add_argument("--codecs", default="none,quant8,quant4,quant8a,quant4a,bitcomp:0.001,zfp:8")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--profile", action="store_true",
                   help="also run each run ((a), (b), each (d)) once more under torch.profiler; report per run the "
                        "traced window's wall time, the device's busy time (union of kernels, memcpys, memsets), its "
                        "idle fraction and the host's synchronisations (table and JSON); write "
                        "profile_<schedule>_<run>.txt (where the time goes: kernels, synchronizations)")
    p.add_argument("--profile-turns", type=int, default=1,
                   help="with --profile: trace each run this many times and report the trace with the median idle "
                        "fraction, every turn's idle beside it (a host-bound run's idle differs from trace to trace; "
                        "default 1); the profiles of turns after the first go to profile_<schedule>_<run>_turnK.txt")
    p.add_argument("--profile-light", action="store_true",
                   help="with --profile: trace each run again with the device's activity only (no op recorded on "
                        "the host: less of the profiler's own host cost in a host-bound run), as many times as "
                        "--profile-turns, and report the median window and idle fraction beside the full trace's "
                        "(CUDA only)")
    p.add_argument("--sizes", default="exact",
                   help="comma-separated SnapshotStore size settings to run each codec's (d) with: exact "
                        "(defer_sizes=False, the default), deferred (defer_sizes=True) and/or graphs (defer_sizes=True, "
                        "graphs=True: CUDA only), in turns")
    p.add_argument("--graphed-steps", action="store_true",
                   help="also (a), (b) and every (d) with the RTM's steps replayed as CUDA graphs (examples/wave.py's "
                        "GraphedRTM, NOTE [ Wave adjoint ] Rule 5; CUDA only): each such (d) judged against (b) with "
                        "the same steps, each image compared bit for bit with the eager steps' run")
    p.add_argument("--pyprofile", action="store_true",
                   help="also run each (d) once more under cProfile and write pyprofile_<schedule>_<run>.txt: the "
                        "host's Python time by function (own time and cumulative), where torch.profiler shows only "
                        "the ops")
    p.add_argument("--trace-dir", help="with --profile: also write each traced run's raw trace (Chrome trace JSON, "
                                       "trace_<schedule>_<run>.json) to this directory")
    p.add_argument("--memstats", action="store_true",
                   help="record each (d) run's torch.cuda.memory_stats() changes over its timed run (allocator "
                        "retries, cudaMalloc/cudaFree calls, synchronisations of all streams, allocations, segments) "
                        "and its peaks (inactive split blocks, reserved memory) in its JSON record and print one line "
                        "per run; not measured without CUDA")
    p.add_argument("--out")
    p.add_argument("--jit-launches", action="store_true",
                   help="launch TritonQuant's kernels through Triton's JIT every time, not through the kernels it "
                        "compiled (NOTE [ Kernel launches ]): the host's cost before that change, for a before/after")
    p.add_argument("--turns", type=int, default=1,
                   help="run every (d) configuration this many more times, in turns, and report each one's median "
                        "(and judge the targets on the medians): the host's speed varies between spells")
    p.add_argument("--ab-launches", action="store_true",
                   help="with --turns: each TritonQuant configuration also with its kernels launched through Triton's "
                        "JIT, in the same turns (NOTE [ Kernel launches ]: a before/after in one process)")
    args = p.parse_args()
    if args.ab_launches and args.turns < 2:
        p.error("--ab-launches needs --turns 2 or more (the two launch paths are compared in turns)")
    if args.jit_launches:
        from torchckpt.codecs import _launch
        _launch.ENABLED = False
    sizes = [z for z in args.sizes.split(",") if z]
    def size_mode(z: str) -> bool:
        try:
            return bool(store_kw(z))
        except ValueError:
            return False
    if not sizes or not all(size_mode(z) for z in sizes) or len(set(sizes)) != len(sizes):
        p.error(f"--sizes takes exact, deferred and/or graphs (the latter two with :K, K >= 1 snapshots whose sizes may "
                f"be on the device at once), comma-separated, got {args.sizes!r}")
    if args.graphed_steps and not torch.cuda.is_available():
        p.error("--graphed-steps replays CUDA graphs (examples/wave.py's GraphedRTM): it needs a CUDA device")
    if any(z.startswith("graphs") for z in sizes) and not torch.cuda.is_available():
        p.error("--sizes graphs replays CUDA graphs (SnapshotStore(graphs=True)): it needs a CUDA device")
    if args.trace_dir and not args.profile:
        p.error("--trace-dir writes the traces of --profile: pass --profile too, or leave --trace-dir out")
    if args.profile_turns < 1 or (args.profile_turns > 1 and not args.profile):
        p.error("--profile-turns is how many times --profile traces each run: pass a count of 1 or more, with --profile")
    if args.profile_light and not args.profile:
        p.error("--profile-light traces each run of --profile once more: pass --profile too")
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    cuda = torch.cuda.is_available()
    args.grid = args.grid or (256 if cuda else 24)
    args.steps = args.steps or (1000 if cuda else 50)
    args.snapshots = args.snapshots or (48 if cuda else 6)
    args.slots = str(args.budget_slots)
    out = out_dir(args.out)
    device = torch.cuda.get_device_name() if cuda else "CPU"
    n, N = args.grid, args.steps
    names = [s for s in args.schedules.split(",") if s]
    print(f"adjoint_codecs: {device}, torch {torch.__version__}; {n}^3, {N} steps, {args.snapshots} snapshots, "
          f"GPU budget {args.budget_slots} uncompressed snapshots", flush=True)
    bench = Bench(args, cuda)
    peak = 0.0
    bench.rtm.reset()
    for k in range(0, N, 10):  # one untimed forward sweep: the wavefield's peak amplitude
        bench.rtm.forward(k, min(N, k + 10))
        peak = max(peak, max(float(t.abs().max()) for t in bench.rtm.save(k)))
    print(f"wavefield peak |u| over the forward sweep: {peak:.4g}", flush=True)
    codecs = {}
    skipped = {}
    for name in [c for c in args.codecs.split(",") if c]:
        c, why = make_codec(name, peak)
        if why is not None:
            skipped[name] = why
            print(f"codec {name}: skipped ({why})", flush=True)
        else:
            codecs[name] = c
    res: dict = dict(device=device, torch=torch.__version__, grid=n, steps=N, snapshots=args.snapshots, peak_u=peak,
                     budget_slots=args.budget_slots, codecs={k: repr(v) for k, v in codecs.items()}, skipped=skipped,
                     sizes=sizes)
    # the (d) runs: (JSON key, label, codec's name, codec, sizes mode, graphed steps); exact rows (and none's) keep the
    # codec's name
    runs = [(name, name, name, c, "exact", False) if z == "exact" or c is None else
            (f"{name}+{z}", f"{name} {z}", name, c, z, False)
            for name, c in codecs.items() for z in (sizes if c is not None else sizes[:1])]
    graphed = None
    if args.graphed_steps:  # NOTE [ Wave adjoint ] Rule 5: the same runs with the user's steps captured
        graphed = GraphedRTM(bench.rtm.vel2, bench.rtm.survey, bench.rtm.wavelet, bench.rtm.residual)
        runs += [(f"{key}+gsteps", f"{label}, graphed steps", cn, c, z, True) for key, label, cn, c, z, _ in runs]
    if cuda:
        d2h, h2d = pinned_bandwidth(GiB)
        res["bandwidth_GBps"] = dict(d2h=d2h / 1e9, h2d=h2d / 1e9)
        print(f"pinned D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s", flush=True)
    sb = bench.snap_bytes
    budget = args.budget_slots * sb
    scheds = {s: (make_schedule(s, N, args.snapshots, Tier.GPU), make_schedule(s, N, args.snapshots, Tier.HOST))
              for s in names}
    peak = max(simulate(h, snapshot_bytes=sb).peak_snapshots[Tier.HOST] for _, h in scheds.values())
    bench.alloc_host(peak, args.budget_slots)

    @contextlib.contextmanager
    def steps(g: bool):
        """The block runs with the graphed RTM (``g``) or the one in place."""
        old = bench.rtm
        bench.rtm = graphed if g else old
        try:
            yield
        finally:
            bench.rtm = old

    def run_codec(sched, codec, mode="exact", mem=None, g=False):
        """One (d) run (``mode``: exact, deferred or graphs sizes; ``g``: the RTM's graphed steps): its time, stats,
        slots and the image of the RTM it ran (overwritten by that RTM's next run); with ``mem`` (a dict) its
        --memstats figures are written into it."""
        store = SnapshotStore(bench.dev, gpu_bytes=budget, codec=codec, host=bench.pool, slot_margin=0.05,
                              **store_kw(mode))
        with steps(g):
            return run_store(sched, store, mem)

    def run_store(sched, store, mem):
        try:
            t, st = bench.timed(lambda: with_memstats(
                lambda: run_schedule(sched, forward=bench.rtm.forward, save=bench.rtm.save,
                                     restore_into=lambda n: (bench.rtm.u.cur, bench.rtm.u.prev),
                                     backward=bench.rtm.backward, store=store), mem))
            return t, st, store.nslots, bench.rtm.image  # read while bench.rtm is the RTM that ran
        finally:
            store.close()

    # warm-up (Triton compilation of the stencil and the codecs), untimed
    main_rtm = bench.rtm
    warm = Revolve(min(N, 20), 4, tier=Tier.HOST)
    bench.rtm = RTM(main_rtm.vel2, main_rtm.survey, main_rtm.wavelet, main_rtm.residual[: warm.n_steps + 1])
    bench.run_gpu(Revolve(warm.n_steps, 4))
    bench.run_sync(warm)
    for _, _, _, c, mode, g in runs:
        run_codec(warm, c, mode, g=g)
    bench.rtm = main_rtm
    if graphed is not None:  # the graphs of (a) and (b) captured untimed too
        with steps(True):
            bench.run_gpu(Revolve(warm.n_steps, 4))
            bench.run_sync(warm)

    def median_of(figs: list[dict], what: str = "") -> tuple[dict, str, str]:
        """The trace with the median idle of ``figs`` (``median_traced``; the only one when one), the words that list
        every turn's idle after its figure, and the table's suffix ("" for one trace)."""
        if len(figs) == 1:
            return figs[0], "", ""
        return (median_traced(figs), f" (the median of {len(figs)}{what}: "
                + ", ".join(f"{f['idle_fraction']:.1%}" for f in figs) + ")", f" (median of {len(figs)})")

    def traced(s: str, key: str, run: str, fn, untraced_s: float) -> dict:
        """``profile_run`` of one run, its figures printed and tabled; ``key`` names it in the files."""
        tag = f"{s}_{key}".replace(":", "_").replace("+", "_")
        figs = [profile_run(os.path.join(out, f"profile_{tag}{f'_turn{i}' if i else ''}.txt"), fn, untraced_s,
                            os.path.join(args.trace_dir, f"trace_{tag}.json") if args.trace_dir and not i else None)
                for i in range(args.profile_turns)]
        if figs[0]["idle_fraction"] is None:
            fig, of, suffix = (median_traced(figs) if len(figs) > 1 else figs[0]), "", ""
            print(f"[{s} {run} traced] window {fig['wall_s']:.3f} s; no device: idle fraction not measured", flush=True)
        else:
            fig, of, suffix = median_of(figs, " traced runs")
            print(f"[{s} {run} traced] window {fig['wall_s']:.3f} s, device busy {fig['busy_s']:.3f} s, idle "
                  f"{fig['idle_fraction']:.1%}{of}; {fig['sync_calls']} host synchronisations {fig['syncs']}", flush=True)
        light, light_suffix = None, ""
        if args.profile_light and fig["idle_fraction"] is not None:
            try:  # as many device-only traces as full ones, the median kept (each turn's beside it)
                light, of, light_suffix = median_of([profile_light(fn) for _ in range(args.profile_turns)])
                fig["light"] = light
                print(f"[{s} {run} traced, device activity only] window {light['wall_s']:.3f} s, device busy "
                      f"{light['busy_s']:.3f} s, idle {light['idle_fraction']:.1%}{of}", flush=True)
            except RuntimeError as e:  # a trace without the marker calls: said, not invented
                print(f"[{s} {run} traced, device activity only] not measured: {e}", flush=True)
        prows.append([s, run, fmt(untraced_s, ".3f"), fmt(fig["run_s"], ".3f"), fmt(fig["wall_s"], ".3f"),
                      fmt(fig["busy_s"], ".3f"), "-" if fig["idle_fraction"] is None else f"{fig['idle_fraction']:.1%}"
                      + suffix, "-" if fig["sync_calls"] is None else str(fig["sync_calls"]),
                      "-" if light is None else f"{light['wall_s']:.3f} s, {light['idle_fraction']:.1%}{light_suffix}"])
        return fig

    def turns_of(s: str, sh, base: dict, r: dict) -> None:
        """``--turns``: every (d) run again, in turns (with ``--ab-launches`` each TritonQuant run twice a turn, its
        kernels launched through the JIT and through their compiled kernels), so that a slow spell of the host hits
        every configuration alike; the medians go beside each run's single figure."""
        from torchckpt.codecs import _launch
        variants = [(name, label, c, mode, True, g) for name, label, _, c, mode, g in runs]
        if args.ab_launches:
            variants += [(f"{name}+jit", f"{label}, JIT launches", c, mode, False, g)
                         for name, label, _, c, mode, g in runs if isinstance(c, TritonQuant)]
        times: dict = {v[0]: [] for v in variants}
        mems: dict = {v[0]: [] for v in variants}  # --memstats: each turn's figures
        for _ in range(args.turns):
            for key, _, c, mode, fast, g in variants:
                _launch.ENABLED = fast
                mem: dict | None = {} if memstats else None
                try:
                    times[key].append(run_codec(sh, c, mode, mem, g=g)[0])
                finally:
                    _launch.ENABLED = True
                if mem is not None:
                    mems[key].append(mem)
        for key, label, _, _, _, g in variants:
            tb = base[g]  # (b) with the same steps
            med = statistics.median(times[key])
            d = r["d"].setdefault(key, {})
            d.update(turns_s=times[key], median_s=med, median_speedup_over_b=tb / med)
            print(f"[{s} (d) {label}, {args.turns} turns] median {med:.3f} s = {tb / med:.2f}x faster than (b); turns "
                  f"{', '.join(f'{t:.3f}' for t in times[key])}", flush=True)
            if mems[key]:
                d["turns_memstats"] = mems[key]
                for t, m in zip(times[key], mems[key]):
                    print(f"[{s} (d) {label}, turn {t:.3f} s memstats] {memstats_line(m)}", flush=True)
            rows.append([s, f"(d) {label}, median of {args.turns}", fmt(med, ".3f"), f"{tb / med:.2f}x", "-", "-", "-",
                         "-", "-"])

    memstats = args.memstats and cuda
    if args.memstats and not cuda:
        print("memstats: not measured (no CUDA device)", flush=True)
    rows, prows, results, ok = [], [], {}, True
    for s, (sg, sh) in scheds.items():
        r: dict = dict(schedule=repr(sh))
        ta, _ = bench.run_gpu(sg)
        ref = bench.rtm.image.clone()
        tb, _ = bench.run_sync(sh)
        exact_b = torch.equal(bench.rtm.image, ref)
        ok &= exact_b
        r["a"], r["b"] = dict(time_s=ta), dict(time_s=tb, image_equal=exact_b)
        if args.profile:
            r["a"]["profile"] = traced(s, "a_gpu", "(a) GPU tier", lambda: bench.run_gpu(sg), ta)
            r["b"]["profile"] = traced(s, "b_sync", "(b) sync host", lambda: bench.run_sync(sh), tb)
        print(f"\n== {s}: (a) {ta:.3f} s, (b) {tb:.3f} s", flush=True)
        rows.append([s, "(a) GPU tier", fmt(ta, ".3f"), fmt(tb / ta, ".2f") + "x", "-", "-", "-", "-", "ref"])
        rows.append([s, "(b) sync host", fmt(tb, ".3f"), "1.00x", "-", "-", "-", "-", "inf" if exact_b else "DIFF"])
        r["d"] = {}
        images: dict = {}  # codec -> its exact row's image
        base, base_a = {False: tb}, {False: ta}
        if graphed is not None:  # (a) and (b) with the graphed steps: the same image bits, (b) the graphed rows' baseline
            with steps(True):
                tag, tbg = bench.run_gpu(sg)[0], bench.run_sync(sh)[0]
                same_a = torch.equal(bench.rtm.image, ref)  # (b)'s image is (a)'s (exact_b), so (a)'s with these steps
            ok &= same_a
            base[True], base_a[True] = tbg, tag
            r["a_gsteps"], r["b_gsteps"] = dict(time_s=tag), dict(time_s=tbg, image_equal=same_a)
            print(f"== {s}, graphed steps: (a) {tag:.3f} s, (b) {tbg:.3f} s; image {'==' if same_a else '!='} the "
                  "eager steps'", flush=True)
            rows.append([s, "(a) GPU tier, graphed steps", fmt(tag, ".3f"), fmt(tbg / tag, ".2f") + "x", "-", "-", "-",
                         "-", "ref"])
            rows.append([s, "(b) sync host, graphed steps", fmt(tbg, ".3f"), "1.00x", "-", "-", "-", "-",
                         "inf" if same_a else "DIFF"])
        for name, label, codec_name, c, mode, g in runs:
            mem: dict | None = {} if memstats else None
            t, st, slots, img = run_codec(sh, c, mode, mem, g)
            tb, ta = base[g], base_a[g]  # (a) and (b) with the same steps
            q = psnr(img, ref)
            same = None
            if mode == "exact" and not g:
                images[codec_name] = img.clone()
            elif codec_name in images:  # the same restores, bit for bit (NOTE [ Snapshot sizes ] Rule 5)
                same = torch.equal(img, images[codec_name])
                ok &= same
            fig = traced(s, name, f"(d) {label}", lambda: run_codec(sh, c, mode, g=g), t) if args.profile else None
            if args.pyprofile:
                py_profile(os.path.join(out, f"pyprofile_{s}_{name}.txt".replace(":", "_").replace("+", "_")),
                           lambda: run_codec(sh, c, mode, g=g), t)
            if c is None or c.guarantee.kind == "lossless":
                ok &= q == math.inf
            d = dict(time_s=t, speedup_over_b=tb / t, over_a=t / ta, slots=slots, ratio=st.ratio, psnr_db=q,
                     graphed_steps=g, stats=stats_dict(st), **store_kw(mode))
            if same is not None:
                d["image_equal_exact"] = same
            if fig is not None:
                d["profile"] = fig
            if args.memstats:
                d["memstats"] = mem  # None: no CUDA, not measured
            r["d"][name] = d
            print(f"[{s} (d) {label}] {t:.3f} s = {tb / t:.2f}x faster than (b), {t / ta:.2f}x (a); {slots} slots, "
                  f"ratio {st.ratio:.2f}x, hit rate {st.hit_rate:.3f}, {st.misses} misses, late "
                  f"{st.late_prefetches} ({st.late_wait_s * 1e3:.1f} ms), slot grows {st.slot_grows}; "
                  f"{st.bytes_to_host / GiB:.3g} GiB to host; image PSNR {q:.1f} dB"
                  + ("" if same is None else f", image {'==' if same else '!='} exact's"), flush=True)
            if mem is not None:
                print(f"[{s} (d) {label} memstats] {memstats_line(mem)}", flush=True)
            rows.append([s, f"(d) {label}", fmt(t, ".3f"), f"{tb / t:.2f}x", str(slots), f"{st.ratio:.2f}x",
                         f"{st.hit_rate:.3f}", fmt(st.bytes_to_host / GiB, ".3g"), "inf" if q == math.inf else f"{q:.1f}"])
        if args.turns > 1 and runs:
            turns_of(s, sh, base, r)
        if r["d"]:
            score = "median_speedup_over_b" if args.turns > 1 else "speedup_over_b"
            best = max((k for k, *_ in runs), key=lambda k: r["d"][k].get(score, 0.0))  # not the JIT twins
            r["best"] = best
            if s in TARGETS and cuda:
                sp = r["d"][best][score]
                r["target"] = dict(want=TARGETS[s], got=sp, codec=best, psnr_db=r["d"][best]["psnr_db"],
                                   verdict="PASS" if sp >= TARGETS[s] else "FAIL")
        results[s] = r
    res["schedules"] = results
    print()
    print_table(["schedule", "run", "time s", "vs (b)", "slots", "ratio", "hit rate", "to host GiB", "image PSNR dB"], rows)
    if prows:
        print("\ntraced runs (torch.profiler): the window is the whole call; busy = union of the device's kernels, "
              "memcpys and memsets; idle = 1 - busy / window")
        print_table(["schedule", "run", "time s", "traced run s", "window s", "device busy s", "device idle",
                     "host syncs", "device only: window, idle"], prows)
    for s, r in results.items():
        if "target" in r:
            t = r["target"]
            print(f"target {s}: >= {t['want']:.0f}x faster than (b): {t['verdict']} ({t['got']:.2f}x with {t['codec']}, "
                  f"image PSNR {t['psnr_db']:.1f} dB)")
    write_json(os.path.join(out, "adjoint_codecs.json"), res)
    labels = ["(a) GPU tier", "(b) sync host"] + [f"(d) {label}" for _, label, *_ in runs]
    panels = {f"{s}: time (s)": [r["a"]["time_s"], r["b"]["time_s"]] + [r["d"][k]["time_s"] for k, *_ in runs]
              for s, r in results.items()}
    plot_bars(os.path.join(out, "adjoint_codecs.png"), labels, panels,
              f"{device}, RTM {n}^3 fp32, {N} steps, GPU budget {budget / GiB:.2f} GiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
