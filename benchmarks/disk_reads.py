"""The disk tier's read path: bandwidth with 1 against K reads in flight (issue 26, Deliver 4).

One claim: keeping several reads of snapshot files in flight reads them back faster than one at a time. N
snapshots of S MiB are written by the tier itself, then read back in reverse order (as an adjoint's backward
does) in two ways, each with at most ``depth`` reads outstanding:

  tier    ``DiskTier.prefetch(key, block)`` ``depth`` keys ahead, ``DiskTier.read(key, block)`` to collect each
          one, into blocks of the host pool (what ``SnapshotStore`` does with its disk snapshots).
  store   ``SnapshotStore(disk=...)``: ``Prefetch(n, DISK, GPU)`` ``depth`` snapshots ahead (``depth + 1`` slots,
          as ``plan_prefetch`` pins at most ``slots - 1`` ahead), then ``restore(n, DISK, out=state)`` and ``free``;
          ``depth + 1`` later snapshots hold the slots, so each of the n is read from its file.

Printed and written per run: GB/s over the timed reads and the ratio to depth 1 of the same way, measured in the
same run; the tier's mode (O_DIRECT or buffered) and threads. Every block read back is checked bit for bit (the
check is outside the timed region; exit status 1 on a mismatch).

The page cache: dropping it needs root, which this script does not assume. With O_DIRECT (the tier's choice where
the file system takes it, e.g. ext4 or xfs) reads bypass the page cache, so the figures are the disk's. With
buffered I/O (tmpfs, or ``--buffered``) reads may come from the page cache unless N * S exceeds what stays
cached; the table says which mode ran, and buffered figures are then the page cache's, not the disk's.

    python benchmarks/disk_reads.py [--snapshots 16] [--mib 32] [--depths 1,2,4,8] [--reps 3] [--dir PATH]
                                    [--buffered] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(1, os.path.dirname(HERE))  # the repo, when torchckpt is not installed

import torch  # noqa: E402

from common import fmt, median, out_dir, plot_bars, print_table, write_json  # noqa: E402
from torchckpt.memory import DiskTier, HostPool  # noqa: E402
from torchckpt.schedules import Tier  # noqa: E402
from torchckpt.store import SnapshotStore  # noqa: E402


def snapshot(n: int, nbytes: int) -> torch.Tensor:
    """Snapshot ``n``'s bytes, every one a function of ``n``."""
    g = torch.Generator().manual_seed(1000 + n)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def tier_run(tier: DiskTier, pool: HostPool, n: int, nbytes: int, depth: int, check: bool) -> tuple[float, bool]:
    """Read keys n-1 .. 0 with ``depth`` prefetches outstanding; (seconds, every block right)."""
    order = list(range(n - 1, -1, -1))
    blocks: dict[int, Any] = {}
    ok = True
    t = 0.0
    nxt = 0
    for k in order:
        t0 = time.perf_counter()
        while nxt < len(order) and len(blocks) < depth:
            key = order[nxt]
            blocks[key] = pool.alloc(nbytes)
            tier.prefetch(key, blocks[key].tensor)
            nxt += 1
        block = blocks.pop(k)
        tier.read(k, block.tensor)
        t += time.perf_counter() - t0
        if check:
            ok &= torch.equal(block.tensor, snapshot(k, nbytes))
        pool.free(block)
    return t, ok


def store_run(tier: DiskTier, pool: HostPool, n: int, nbytes: int, depth: int, check: bool) -> tuple[float, bool]:
    """Save n snapshots to Tier.DISK, then ``depth + 1`` more that take every slot, wait for the writes, then restore
    the n in reverse (each from its file), ``depth`` prefetches ahead."""
    store = SnapshotStore("cpu", slots=depth + 1, host=pool, disk=tier, timing=False)
    try:
        for k in range(n + depth + 1):  # the last depth + 1 fill the slots: the first n are read from their files
            store.save(k, Tier.DISK, [snapshot(k, nbytes)])
        store.stats()  # waits for the writes (NOTE [ Snapshot disk tier ] Rule 3)
        state = [torch.empty(nbytes, dtype=torch.uint8)]
        order = list(range(n - 1, -1, -1))
        ok = True
        t = 0.0
        nxt = 0
        for i, k in enumerate(order):
            t0 = time.perf_counter()
            while nxt < len(order) and nxt - i < depth:
                store.prefetch(order[nxt], Tier.DISK, Tier.GPU)
                nxt += 1
            store.restore(k, Tier.DISK, out=state)
            store.free(k, Tier.DISK)
            t += time.perf_counter() - t0
            if check:
                ok &= torch.equal(state[0], snapshot(k, nbytes))
        return t, ok
    finally:
        store.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--snapshots", type=int, default=16)
    p.add_argument("--mib", type=int, default=32)
    p.add_argument("--depths", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="the disk tier's directory (default: a temporary one under /tmp)")
    p.add_argument("--buffered", action="store_true", help="DiskTier(direct=False): reads may hit the page cache")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = out_dir(args.out)
    n, nbytes = args.snapshots, args.mib << 20
    depths = [int(x) for x in args.depths.split(",")]
    directory = args.dir or tempfile.mkdtemp(prefix="torchckpt-disk-reads-")
    tier = DiskTier(directory, direct=False if args.buffered else None)
    pool = HostPool(pin=False)
    config = {k: getattr(tier, k) for k in ("threads", "reads") if hasattr(tier, k)}
    print(f"disk_reads: {n} snapshots of {args.mib} MiB in {directory} ({'O_DIRECT' if tier.direct else 'buffered'}, "
          f"{config}); {os.cpu_count()} CPUs; torch {torch.__version__}", flush=True)
    if not tier.direct:
        print("  buffered I/O: reads may come from the page cache (dropping it needs root); see the docstring",
              flush=True)
    rows: list[dict[str, Any]] = []
    ok = True
    try:
        for k in range(n):
            tier.write(k, snapshot(k, nbytes))
        tier.wait()
        tier.check()
        for way, run in (("tier", tier_run), ("store", store_run)):
            base = None
            for depth in depths:
                ts = []
                for r in range(args.reps):
                    t, good = run(tier, pool, n, nbytes, depth, check=r == 0)
                    ok &= good
                    ts.append(t)
                gbs = n * nbytes / median(ts) / 1e9
                base = gbs if base is None else base
                rows.append({"way": way, "depth": depth, "s": median(ts), "GB_s": gbs, "x_depth1": gbs / base,
                             "bit_exact": ok})
                print(f"  {way} depth {depth}: {gbs:.2f} GB/s", flush=True)
    finally:
        tier.close()
    print_table(["way", "reads in flight", "s", "GB/s", "x depth 1"],
                [[r["way"], r["depth"], fmt(r["s"], ".3f"), fmt(r["GB_s"], ".2f"), fmt(r["x_depth1"], ".2f")]
                 for r in rows])
    print(f"every block bit-exact: {ok}")
    write_json(os.path.join(out, "disk_reads.json"), {
        "snapshots": n, "mib": args.mib, "dir": directory, "direct": tier.direct, "tier": config,
        "cpus": os.cpu_count(), "torch": torch.__version__, "rows": rows, "bit_exact": ok})
    plot_bars(os.path.join(out, "disk_reads.png"), [f"{r['way']} {r['depth']}" for r in rows],
              {"GB/s": [r["GB_s"] for r in rows]},
              f"disk tier reads: {n} x {args.mib} MiB, {'O_DIRECT' if tier.direct else 'buffered'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
