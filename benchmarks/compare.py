"""Compare two runs of benchmarks/train_step.py and benchmarks/adjoint.py (for example before and after a change).

    python benchmarks/compare.py BEFORE_DIR AFTER_DIR [--tolerance 0.03] [--out DIR]

Each folder holds the ``train_step.json`` and ``adjoint.json`` the scripts wrote. Prints one row per mode
(training) and per schedule and cache size (adjoint): the time before, after, and after / before; writes
``compare.json`` and ``compare.png`` into ``--out`` (default AFTER_DIR). Exits 1 if a ratio leaves
1 +- tolerance, so it can gate a refactoring that must not change performance.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _rows(folder: str) -> dict[str, float]:
    out: dict[str, float] = {}
    t = json.load(open(os.path.join(folder, "train_step.json")))
    for name, m in t["modes"].items():
        out[f"train {name} step ms"] = m["step_ms"]
    a = json.load(open(os.path.join(folder, "adjoint.json")))
    for sched, s in a["schedules"].items():
        for key in ("a", "b"):
            if isinstance(s.get(key), dict) and "time_s" in s[key]:
                out[f"adjoint {sched} ({key}) s"] = s[key]["time_s"]
        for c in s.get("c", []):
            out[f"adjoint {sched} (c) k={c['k']} s"] = c["time_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--tolerance", type=float, default=0.03)
    p.add_argument("--out")
    args = p.parse_args(argv)
    before, after = _rows(args.before), _rows(args.after)
    rows = []
    bad = 0
    width = max(len(k) for k in before)
    print(f"{'figure':<{width}}  {'before':>9}  {'after':>9}  after/before")
    for k, b in before.items():
        if k not in after:
            print(f"{k:<{width}}  {b:9.3f}  {'-':>9}  missing")
            bad += 1
            continue
        r = after[k] / b
        ok = abs(r - 1) <= args.tolerance
        bad += not ok
        rows.append(dict(figure=k, before=b, after=after[k], ratio=r, within=ok))
        print(f"{k:<{width}}  {b:9.3f}  {after[k]:9.3f}  {r:6.3f}{'' if ok else '  OUTSIDE'}")
    print(f"{len(rows) - sum(not r['within'] for r in rows)} of {len(before)} figures within {args.tolerance:.0%}")
    out = args.out or args.after
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump(dict(before=args.before, after=args.after, tolerance=args.tolerance, rows=rows), f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 0.25 * len(rows) + 1.5))
        ax.barh([r["figure"] for r in rows], [r["ratio"] for r in rows],
                color=["tab:blue" if r["within"] else "tab:red" for r in rows])
        for x in (1 - args.tolerance, 1 + args.tolerance):
            ax.axvline(x, color="grey", ls="--", lw=0.8)
        ax.axvline(1, color="black", lw=0.8)
        lo = min([r["ratio"] for r in rows] + [1 - 2 * args.tolerance])
        hi = max([r["ratio"] for r in rows] + [1 + 2 * args.tolerance])
        ax.set_xlim(lo - 0.01, hi + 0.01)
        ax.set_xlabel("after / before (time; dashed: the tolerance)")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "compare.png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no compare.png")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
