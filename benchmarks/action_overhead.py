"""Per-action host time of the adjoint drivers: what the executor and the snapshot store cost per schedule action.

The claim (issue 26, Deliver 2): the Python that ``run_schedule`` (and ``checkpointed_loop``) spends per schedule
action (advance, save, restore, prefetch, free, adjoint) is small next to a step. A step here is one op on a tensor
of a few elements, so the run is all host time: per schedule (zCut, Revolve, Uniform), tier (``Tier.HOST`` through a
``SnapshotStore``'s slots, ``Tier.GPU`` on the device) and codec (none; ``quant8`` = TritonQuant(bits=8) where it
runs; ``identity`` = Identity()), the driver's time less that of the same step calls made in a bare loop, per
action, and the driver's time over a bare loop of the same steps with no checkpointing (forward, then backward,
every state kept). With ``--profile``, a cProfile of one run per row split by where the time goes (executor,
planned stream, store, mover, driver, the user's callbacks, torch). ``--sizes exact,deferred`` runs each codec row
with ``SnapshotStore(defer_sizes=False)`` and ``True`` (NOTE [ Snapshot sizes ]), labelled ``.../deferred``: the
host cost of deferring the sizes.

    python benchmarks/action_overhead.py [--steps 4000] [--snapshots 10] [--reps 5] [--profile] [--out DIR]
                                         [--schedules zcut,revolve,uniform] [--tiers host,gpu] [--codecs none,quant8]
                                         [--drivers run_schedule,loop] [--sizes exact,deferred]
Writes ``action_overhead.json`` and ``action_overhead.png``. Runs on the CPU (under a minute) and on a GPU.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(1, os.path.dirname(HERE))

import torch  # noqa: E402

from common import fmt, out_dir, plot_bars, print_table, write_json  # noqa: E402
from torchckpt.adjoint import checkpointed_loop, run_schedule  # noqa: E402
from torchckpt.memory import HostPool  # noqa: E402
from torchckpt.schedules import Revolve, Tier, Uniform, ZCut  # noqa: E402
from torchckpt.schedules.prefetch import PrefetchStream  # noqa: E402
from torchckpt.store import SnapshotStore  # noqa: E402

# where a function's own time goes, by the file it is in (first match)
PLACES = (
    ("executor", ("torchckpt/schedules/execute.py",)),
    ("stream", ("torchckpt/schedules/",)),  # Planned, PrefetchStream, packed decoding, the cache model
    ("codec", ("torchckpt/codecs/",)),
    ("store", ("torchckpt/store/snapshot", "torchckpt/store/lend.py", "torchckpt/memory/")),
    ("stats", ("torchckpt/store/stats.py",)),
    ("mover", ("torchckpt/store/streams.py",)),
    ("driver", ("torchckpt/adjoint/",)),
    ("callbacks", ("action_overhead.py",)),
)


class Wave:
    """A two-tensor state (u, u_prev) of a few elements and the callbacks of ``run_schedule``, all in place."""

    def __init__(self, dev: torch.device, n: int) -> None:
        self.u = torch.linspace(0.5, 1.0, n, device=dev)
        self.up = torch.zeros(n, device=dev)
        self.acc = torch.zeros(n, device=dev)

    def forward(self, n0: int, n1: int) -> None:
        u, up = self.u, self.up
        for _ in range(n0, n1):
            up.mul_(-1.0).add_(u, alpha=1.999)  # u_next = 1.999 u - u_prev, then swap roles
            u, up = up, u
        self.u, self.up = u, up

    def save(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.u, self.up

    def restore(self, n: int, t: list[torch.Tensor]) -> None:
        self.u.copy_(t[0])
        self.up.copy_(t[1])

    def backward(self, n: int) -> None:
        self.acc.add_(self.u)


def schedule(name: str, n: int, snaps: int, tier: Tier) -> Any:
    if name == "zcut":
        return ZCut(n, tier=tier)
    if name == "revolve":
        return Revolve(n, snaps, tier=tier)
    if name == "uniform":  # a snapshot every 10 steps: recomputation as Revolve's, not n / snaps per step
        return Uniform(n, max(snaps, -(-n // 10)), tier=tier)
    raise ValueError(f"unknown schedule {name!r}; pass zcut, revolve or uniform")


def codec_of(name: str) -> Any:
    if name == "none":
        return None
    if name == "quant8":
        from torchckpt.codecs import TritonQuant
        return TritonQuant(bits=8, mode="abs", bound=1e-3)
    if name == "identity":
        from torchckpt.codecs import Identity
        return Identity()
    raise ValueError(f"unknown codec {name!r}; pass none, quant8 or identity")


def counts(sched: Any) -> tuple[int, int]:
    """(forward step evaluations by advances, actions of the schedule itself, prefetches not included)."""
    p = sched.pack()
    return p.forward_steps(), len(p)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def best(fn: Callable[[], Any], reps: int, dev: torch.device) -> float:
    """The least wall time of ``fn()`` over ``reps`` runs after one warm-up."""
    fn()
    ts = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return min(ts)


def place(filename: str) -> str | None:
    f = filename.replace(os.sep, "/")
    for name, keys in PLACES:
        if any(k in f for k in keys):
            return name
    return None


def profile_split(fn: Callable[[], Any]) -> dict[str, float]:
    """Seconds of ``fn()`` by place: each function's own time under its file's place; a builtin's (C functions,
    torch ops) under its callers' places in proportion to what each call edge spent; the rest ``torch/other``."""
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    st = pstats.Stats(pr).stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for (file, _line, _name), (_cc, _nc, tt, _ct, callers) in st.items():
        where = place(file)
        if where is None and file == "~" and callers:
            total = sum(edge[2] for edge in callers.values()) or 1.0
            for (cf, _l, _n), edge in callers.items():
                k = place(cf) or "torch/other"
                out[k] = out.get(k, 0.0) + tt * edge[2] / total
            continue
        k = where or "torch/other"
        out[k] = out.get(k, 0.0) + tt
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--snapshots", type=int, default=10, help="Revolve's snapshots (Uniform: at least one per 10 steps)")
    p.add_argument("--elements", type=int, default=4, help="elements of each state tensor")
    p.add_argument("--slots", type=int, default=4, help="the SnapshotStore's slots")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--schedules", default="zcut,revolve,uniform")
    p.add_argument("--tiers", default="host,gpu")
    p.add_argument("--codecs", default="none,quant8")
    p.add_argument("--drivers", default="run_schedule,loop")
    p.add_argument("--sizes", default="exact", help="codec rows with SnapshotStore(defer_sizes=False) (exact) and/or "
                                                    "True (deferred), comma-separated")
    p.add_argument("--loop-steps", type=int, default=1000, help="steps of the checkpointed_loop rows (autograd)")
    p.add_argument("--profile", action="store_true", help="split each row's time by place (one cProfile'd run)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sizes = [z for z in args.sizes.split(",") if z]
    if not sizes or any(z not in ("exact", "deferred") for z in sizes):
        p.error(f"--sizes takes exact and/or deferred, got {args.sizes!r}")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    out = out_dir(args.out)
    N = args.steps
    w = Wave(dev, args.elements)

    def bare() -> None:  # the same steps with no checkpointing: forward, then every adjoint step
        w.forward(0, N - 1)
        for n in range(N - 1, -1, -1):
            w.backward(n)

    t_bare = best(bare, args.reps, dev)
    t_fwd = best(lambda: w.forward(0, N), args.reps, dev) / N  # one forward step
    t_adj = best(lambda: [w.backward(n) for n in range(N)], args.reps, dev) / N  # one adjoint step
    print(f"device {dev}, torch {torch.__version__}; {N} steps of 2 x {args.elements} elements: bare loop "
          f"{t_bare * 1e3:.2f} ms (forward step {t_fwd * 1e6:.2f} us, adjoint step {t_adj * 1e6:.2f} us)", flush=True)
    rows, table = [], []
    drivers = [d for d in args.drivers.split(",") if d]
    if "run_schedule" in drivers:
        for sname in [s for s in args.schedules.split(",") if s]:
            for tname in [t for t in args.tiers.split(",") if t]:
                tier = Tier.HOST if tname == "host" else Tier.GPU
                sched = schedule(sname, N, args.snapshots, tier)
                fsteps, nacts = counts(sched)
                for cname, defer in [(c, z == "deferred") for c in args.codecs.split(",") if c
                                     for z in (sizes if c != "none" else sizes[:1])]:
                    store = SnapshotStore(dev, slots=args.slots, host=HostPool(chunk_bytes=1 << 20, pin=cuda),
                                          codec=codec_of(cname), defer_sizes=defer)

                    def drive(sched: Any = sched, store: SnapshotStore = store) -> None:
                        run_schedule(sched, forward=w.forward, save=w.save, restore=w.restore, backward=w.backward,
                                     store=store)

                    t = best(drive, args.reps, dev)
                    # the driver's time less what its step calls cost in a bare loop, per action (prefetches
                    # included: one per off-GPU restore)
                    acts = sum(1 for _ in PrefetchStream(sched.pack(), args.slots))
                    steps_s = fsteps * t_fwd + N * t_adj
                    us = (t - steps_s) / acts * 1e6
                    row: dict[str, Any] = dict(driver="run_schedule", schedule=repr(sched), name=sname, tier=tname,
                                               codec=cname, defer_sizes=defer, actions=acts, forward_steps=fsteps,
                                               time_s=t, steps_s=steps_s, us_per_action=us, x_bare=t / t_bare)
                    if args.profile:
                        split = profile_split(drive)
                        row["profile_us_per_action"] = {k: v / acts * 1e6 for k, v in sorted(split.items())}
                    store.close()
                    rows.append(row)
                    label = f"{sname}/{tname}/{cname}" + ("/deferred" if defer else "")
                    table.append([label, str(acts), fmt(t * 1e3, ".2f"), fmt(us, ".2f"), fmt(t / t_bare, ".2f") + "x"]
                                 + ([" ".join(f"{k}={v:.2f}" for k, v in row["profile_us_per_action"].items())]
                                    if args.profile else []))
                    print("  ".join(table[-1]), flush=True)
    if "loop" in drivers:
        L = args.loop_steps
        x0 = torch.linspace(0.5, 1.0, args.elements, device=dev)
        wgt = torch.tensor(0.999, device=dev, requires_grad=True)

        def step(x: torch.Tensor) -> torch.Tensor:
            return x * wgt + 1e-3

        def bare_loop() -> None:
            x = x0.clone().requires_grad_()
            for _ in range(L):
                x = step(x)
            x.sum().backward()

        t_lb = best(bare_loop, args.reps, dev)
        for sname in [s for s in args.schedules.split(",") if s]:
            sched = schedule(sname, L, args.snapshots, Tier.HOST)
            fsteps, nacts = counts(sched)
            store = SnapshotStore(dev, slots=args.slots, host=HostPool(chunk_bytes=1 << 20, pin=cuda))

            def drive_loop(sched: Any = sched, store: SnapshotStore = store) -> None:
                x = x0.clone().requires_grad_()
                checkpointed_loop(step, x, L, schedule=sched, store=store).sum().backward()

            t = best(drive_loop, args.reps, dev)
            row = dict(driver="checkpointed_loop", schedule=repr(sched), name=sname, tier="host", codec="none",
                       actions=nacts, forward_steps=fsteps, time_s=t, bare_s=t_lb, x_bare=t / t_lb,
                       us_per_action=(t - t_lb) / nacts * 1e6)
            if args.profile:
                split = profile_split(drive_loop)
                row["profile_us_per_action"] = {k: v / nacts * 1e6 for k, v in sorted(split.items())}
            store.close()
            rows.append(row)
            table.append([f"loop {sname}/host/none", str(nacts), fmt(t * 1e3, ".2f"),
                          fmt(row["us_per_action"], ".2f"), fmt(t / t_lb, ".2f") + "x"]
                         + ([" ".join(f"{k}={v:.2f}" for k, v in row["profile_us_per_action"].items())]
                            if args.profile else []))
            print("  ".join(table[-1]), flush=True)
    print()
    print_table(["driver schedule/tier/codec", "actions", "time ms", "us/action", "x bare"]
                + (["profile: us/action by place"] if args.profile else []), table)
    write_json(os.path.join(out, "action_overhead.json"),
               dict(device=str(dev) if not cuda else torch.cuda.get_device_name(), torch=torch.__version__, steps=N,
                    elements=args.elements, snapshots=args.snapshots, slots=args.slots, reps=args.reps,
                    bare_s=t_bare, forward_step_s=t_fwd, adjoint_step_s=t_adj, rows=rows))
    labels = [f"{r['driver'][:4]} {r['name']}/{r['tier']}/{r['codec']}" + ("/deferred" if r.get("defer_sizes") else "")
              for r in rows]
    plot_bars(os.path.join(out, "action_overhead.png"), labels,
              {"us per action (driver less its steps)": [r["us_per_action"] for r in rows],
               "time / bare loop": [r["x_bare"] for r in rows]},
              f"per-action host time of the adjoint drivers on {dev} ({N} steps, {args.elements}-element states)")


if __name__ == "__main__":
    main()
