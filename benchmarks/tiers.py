"""Snapshots beyond host memory: a disk tier against Revolve with only the snapshots that fit (issue 14).

An RTM adjoint (examples/wave.py, as in benchmarks/adjoint.py) whose schedule wants more snapshots than a host
cap the benchmark sets. Each run uses ``run_schedule`` with a ``SnapshotStore`` of ``--slots`` device slots, in one
process:

  host_cap   ``Revolve(N, s_cap, tier=HOST)``: the snapshots that fit the cap (s_cap = cap / snapshot bytes), so
             more recomputation.
  disk       ``Revolve(N, s_disk, tier=DISK)`` through ``SnapshotStore(disk=DIR)``: ``--disk-snapshots`` of them,
             written behind to files and read ahead (host memory holds only those in flight).
  disk_into  the same as ``disk`` with ``DiskTier(device_reads=True)``: the prefetches read the files straight into
             the device's slots, through cuFile on CUDA (NOTE [ cuFile reads ]; left out where cuFile cannot open).
  host_all   ``Revolve(N, s_disk, tier=HOST)``: the same schedule with no cap, when the machine's available
             memory holds it twice over (the reference: what the disk costs against unlimited host memory).

Printed and written per run: time, its ratio to ``host_cap`` (the claim: below 1 means the disk tier beats
recomputing), forward advances (the recomputation, from ``simulate``), bytes and waits of the disk tier; the disk's
write and read bandwidth measured in the same run (``DiskTier.measure_bandwidth``) and the host link's. Every run's
image must equal ``host_cap``'s bit for bit (exit status 1 otherwise). Writes ``tiers.json`` and ``tiers.png``.
Without CUDA it runs a tiny version (24^3, 60 steps) as a smoke test; its times mean nothing.

    python benchmarks/tiers.py [--grid 192] [--steps 2000] [--host-cap 2GiB] [--disk-snapshots 160] [--slots 4]
                               [--dir PATH] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(1, ROOT)  # the repo, when torchckpt is not installed
sys.path.insert(2, os.path.join(ROOT, "examples"))  # wave.py

import torch  # noqa: E402

from adjoint import Bench  # noqa: E402  (the RTM of benchmarks/adjoint.py)
from common import GiB, fmt, out_dir, pinned_bandwidth, plot_bars, print_table, write_json  # noqa: E402
from torchckpt._args import parse_bytes  # noqa: E402
from torchckpt.adjoint import run_schedule  # noqa: E402
from torchckpt import CheckpointError  # noqa: E402
from torchckpt.memory import DiskTier, gds  # noqa: E402
from torchckpt.memory.sysinfo import available_memory_bytes  # noqa: E402
from torchckpt.schedules import Revolve, Tier, simulate  # noqa: E402
from torchckpt.store import SnapshotStore  # noqa: E402


def main() -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", type=int, default=192 if cuda else 24)
    p.add_argument("--steps", type=int, default=2000 if cuda else 60)
    p.add_argument("--host-cap", default="2GiB" if cuda else "400KiB", help="host bytes for snapshots in host_cap")
    p.add_argument("--disk-snapshots", type=int, default=160 if cuda else 16)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--dir", default=None, help="the disk tier's directory (default: a temporary one)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = out_dir(args.out)
    bench = Bench(argparse.Namespace(grid=args.grid, steps=args.steps), cuda)
    snap = bench.snap_bytes
    cap = parse_bytes(args.host_cap, "--host-cap")
    s_cap = max(1, cap // snap)
    s_disk = max(args.disk_snapshots, s_cap + 1)
    n = args.steps
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"tiers: RTM {args.grid}^3 fp32, {n} steps, snapshot {snap / 2**20:.1f} MiB on {gpu}; host cap "
          f"{cap / GiB:.2f} GiB -> {s_cap} snapshots; disk tier {s_disk} snapshots ({s_disk * snap / GiB:.2f} GiB)",
          flush=True)

    directory = args.dir or tempfile.mkdtemp(prefix="torchckpt-tiers-")
    disk = DiskTier(directory)
    bw_w, bw_r = disk.measure_bandwidth(256 << 20 if cuda else 4 << 20)
    link = pinned_bandwidth() if cuda else None
    print(f"disk {directory}: {'O_DIRECT' if disk.direct else 'buffered'}, write {bw_w / 1e9:.2f} GB/s, read "
          f"{bw_r / 1e9:.2f} GB/s (page cache may serve buffered reads)" +
          (f"; host link {link[0] / 1e9:.1f} GB/s to host, {link[1] / 1e9:.1f} back" if link else ""), flush=True)
    bench.alloc_host(s_disk + 4, args.slots)  # the pool: grown once, outside the timed runs

    into = DiskTier(directory, device_reads=True)
    try:
        use_into = into.reads_into(torch.device(bench.dev))
        how = gds.probe(into.root, into.direct)[1] if cuda else "CPU slots"
    except CheckpointError as e:
        use_into, how = False, str(e)
    print(f"disk_into: {'reads into the slots (' + how + ')' if use_into else 'skipped: ' + how}", flush=True)
    runs: list[tuple[str, Revolve, DiskTier | None]] = [("host_cap", Revolve(n, s_cap, tier=Tier.HOST), None),
                                                         ("disk", Revolve(n, s_disk, tier=Tier.DISK), disk)]
    if use_into:
        runs.append(("disk_into", Revolve(n, s_disk, tier=Tier.DISK), into))
    if s_disk * snap * 2 < available_memory_bytes():
        runs.append(("host_all", Revolve(n, s_disk, tier=Tier.HOST), None))
    else:
        print(f"host_all skipped: {s_disk * snap / GiB:.1f} GiB of snapshots, twice over, exceed available memory",
              flush=True)
    rows, results, ref, ok = [], [], None, True
    for name, sched, tier in runs:
        sim = simulate(sched)
        store = SnapshotStore(bench.dev, slots=args.slots, host=bench.pool, disk=tier)
        try:
            t, _ = bench.timed(lambda: run_schedule(sched, forward=bench.rtm.forward, save=bench.rtm.save,
                                                    restore=bench.rtm.restore, backward=bench.rtm.backward,
                                                    store=store, slots=args.slots))
            st = store.stats()
        finally:
            store.close()
        img = bench.rtm.image.clone()
        exact = ref is None or torch.equal(img, ref)
        ok &= exact
        ref = img if ref is None else ref
        d = st.disk
        res = {"name": name, "schedule": repr(sched), "time_s": t, "forward_steps": sim.forward_steps,
               "recompute_factor": sim.forward_steps / n, "exact": exact,
               "disk": None if d is None else {"writes": d.writes, "reads": d.reads, "bytes_written": d.bytes_written,
                                               "bytes_read": d.bytes_read, "read_waits": d.read_waits,
                                               "read_wait_s": d.read_wait_s, "direct": d.direct,
                                               "bytes_to_device": st.bytes_to_device}}
        results.append(res)
        base = results[0]["time_s"]
        rows.append([name, repr(sched), fmt(t * 1e3, ".0f"), fmt(t / base, ".2f"), fmt(sim.forward_steps / n, ".2f"),
                     "-" if d is None else f"{d.bytes_written / GiB:.2f} / {d.bytes_read / GiB:.2f}",
                     "-" if d is None else f"{d.read_waits} ({d.read_wait_s * 1e3:.0f} ms)",
                     "yes" if exact else "NO"])
        print(f"{name}: {t * 1e3:.0f} ms, {t / base:.2f}x host_cap", flush=True)
    disk.close()
    into.close()
    if args.dir is None:
        try:
            os.rmdir(directory)
        except OSError:
            pass
    print_table(["run", "schedule", "ms", "x host_cap", "advances/N", "disk GiB w / r", "read waits", "exact"], rows)
    write_json(os.path.join(out, "tiers.json"), {
        "device": gpu, "torch": torch.__version__, "grid": args.grid, "steps": n, "snapshot_bytes": snap,
        "host_cap_bytes": cap, "slots": args.slots, "disk_direct": disk.direct, "disk_write_Bps": bw_w,
        "disk_read_Bps": bw_r, "link_Bps": link, "disk_into": how, "runs": results, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "note": None if cuda else "CPU smoke test: times are not meaningful"})
    plot_bars(os.path.join(out, "tiers.png"), [r["name"] for r in results],
              {"time / host_cap": [r["time_s"] / results[0]["time_s"] for r in results],
               "forward advances / N": [r["recompute_factor"] for r in results]},
              f"RTM {args.grid}^3, {n} steps, snapshots beyond a {cap / GiB:.2f} GiB host cap ({gpu})")
    if not ok:
        print("FAIL: an image differs from host_cap's", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
