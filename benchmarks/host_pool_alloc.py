"""Per-allocation host time of a long-lived ``HostPool`` under churn.

Claim (NOTE [ Host pool ] Rule 2): a pool reused for many runs of small blocks keeps its per-allocation
host cost bounded; it does not grow with the number of free spans the churn leaves behind.

A pool (``pin=False``, so it runs on the CPU; the allocator is the same with pinned chunks) holds a
ring of ``--live`` blocks of mixed sizes (``--sizes``, drawn with a fixed seed); each operation
frees one block and allocates another in its place, ``--ops`` times, in one of three orders:

* ``fifo``: frees the oldest block (a snapshot store saving and dropping snapshots in turn);
* ``random``: frees a live block at random (schedules that keep some snapshots much longer);
* ``lifo``: a stack instead of a ring, each operation a push (alloc) or a pop (free) at random, its
  depth kept between ``--live``/2 and 3/2 ``--live`` (nested checkpoints unwinding in reverse).

Prints, per pattern, the mean host time of ``alloc`` and of ``free`` over the first and the last 1%
of operations, their ratio, and the free list length (free spans over all chunks) at the end; the
best of ``--reps`` runs counts. Writes JSON and a plot of us/alloc over time to ``--out``.

    python benchmarks/host_pool_alloc.py [--ops 200000] [--live 2000] [--reps 3] [--tag cpu] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from common import out_dir, print_table, pyplot, save_figure, write_json  # noqa: E402
from torchckpt.memory.host_pool import HostBlock, HostPool  # noqa: E402

PATTERNS = ("fifo", "random", "lifo")
_WINDOWS = 100  # the run is cut into this many windows: the first and the last are its first and last 1%


def free_spans(pool: HostPool) -> int:
    """Free spans over all the pool's chunks (the free list length)."""
    return sum(len(c.free) for c in pool._blocks.chunks)


def churn(pattern: str, ops: int, live: int, sizes: list[int], seed: int) -> dict[str, Any]:
    """One run: ``live`` blocks allocated, then ``ops`` operations (free one, allocate one); the per-window mean
    host time of alloc and free in microseconds and the free list length after each window."""
    rng = random.Random(seed)
    pool = HostPool(capacity_bytes=64 << 30, pin=False)
    ring: list[HostBlock] = [pool.alloc(rng.choice(sizes)) for _ in range(live)]
    head = 0  # fifo: index of the oldest block in ring
    win = max(1, ops // _WINDOWS)
    alloc_us, free_us, spans = [], [], []
    ta = tf = na = nf = 0
    clock = time.perf_counter_ns
    for i in range(ops):
        if pattern == "lifo":
            # A stack whose depth wanders between live/2 and 3*live/2: push or pop the top.
            if len(ring) > live // 2 and (len(ring) >= 3 * live // 2 or rng.random() < 0.5):
                victim = ring.pop()
                t0 = clock()
                pool.free(victim)
                tf += clock() - t0
                nf += 1
            else:
                n = rng.choice(sizes)
                t0 = clock()
                blk = pool.alloc(n)
                ta += clock() - t0
                na += 1
                ring.append(blk)
        else:
            slot = head if pattern == "fifo" else rng.randrange(live)
            head = (head + 1) % live
            n = rng.choice(sizes)
            t0 = clock()
            pool.free(ring[slot])
            t1 = clock()
            ring[slot] = pool.alloc(n)
            t2 = clock()
            tf += t1 - t0
            ta += t2 - t1
            na += 1
            nf += 1
        if (i + 1) % win == 0:
            alloc_us.append(ta / max(na, 1) / 1e3)
            free_us.append(tf / max(nf, 1) / 1e3)
            spans.append(free_spans(pool))
            ta = tf = na = nf = 0
    for b in ring:
        pool.free(b)
    whole = all(c.free == [(0, c.size)] for c in pool._blocks.chunks)
    st = pool.stats()
    pool.close()
    return {"alloc_us": alloc_us, "free_us": free_us, "free_spans": spans, "chunks": st.chunks,
            "coalesced_after": whole}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=200_000)
    ap.add_argument("--live", type=int, default=2000)
    ap.add_argument("--sizes", default="512,1536,4096,12288,65536,200000",
                    help="comma-separated block sizes in bytes, drawn uniformly")
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default=platform.node() or "run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    out = out_dir(args.out)
    results: dict[str, Any] = {}
    rows = []
    for pat in args.patterns.split(","):
        if pat not in PATTERNS:
            raise SystemExit(f"torchckpt: unknown pattern {pat!r}; pass some of {', '.join(PATTERNS)}.")
        runs = [churn(pat, args.ops, args.live, sizes, args.seed) for _ in range(args.reps)]
        # Best of the runs, window by window (the same seed: the same operations in every run).
        best = {k: [min(r[k][w] for r in runs) for w in range(len(runs[0][k]))] for k in ("alloc_us", "free_us")}
        r0 = runs[0]
        first_a, last_a = best["alloc_us"][0], best["alloc_us"][-1]
        first_f, last_f = best["free_us"][0], best["free_us"][-1]
        results[pat] = {**best, "free_spans": r0["free_spans"], "chunks": r0["chunks"],
                        "coalesced_after": r0["coalesced_after"], "first_alloc_us": first_a, "last_alloc_us": last_a,
                        "first_free_us": first_f, "last_free_us": last_f}
        rows.append([pat, f"{first_a:.2f}", f"{last_a:.2f}", f"{last_a / first_a:.2f}", f"{first_f:.2f}",
                     f"{last_f:.2f}", str(r0["free_spans"][0]), str(r0["free_spans"][-1]), str(r0["chunks"])])
        print(f"{pat}: alloc {first_a:.2f} -> {last_a:.2f} us, free list {r0['free_spans'][-1]}", flush=True)
    print(f"\nHostPool(pin=False), {args.live} live blocks of {args.sizes} bytes, {args.ops} ops, best of "
          f"{args.reps}; first / last 1% of the ops")
    print_table(["pattern", "alloc us first", "alloc us last", "last/first", "free us first", "free us last",
                 "spans first", "spans last", "chunks"], rows)
    meta = {"ops": args.ops, "live": args.live, "sizes": sizes, "reps": args.reps, "seed": args.seed,
            "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    write_json(os.path.join(out, f"host_pool_alloc_{args.tag}.json"), {"meta": meta, "patterns": results})
    path = os.path.join(out, f"host_pool_alloc_{args.tag}.png")
    plt = pyplot(path)
    if plt is not None:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        x = [(w + 1) * args.ops / _WINDOWS for w in range(_WINDOWS)]
        for pat, r in results.items():
            ax.plot(x[: len(r["alloc_us"])], r["alloc_us"], label=pat)
            ax2.plot(x[: len(r["free_spans"])], r["free_spans"], label=pat)
        ax.set_xlabel("operations")
        ax.set_ylabel("us per alloc (window mean, best of runs)")
        ax2.set_xlabel("operations")
        ax2.set_ylabel("free spans")
        for a in (ax, ax2):
            a.grid(alpha=0.3)
            a.legend(fontsize=8)
        fig.suptitle(f"HostPool allocation under churn ({args.live} live blocks)", fontsize=10)
        save_figure(fig, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
