"""Small helpers shared by the benchmark scripts: clocks, bandwidth, formatting, JSON, plots."""
from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

GiB = 2**30


def parse_bytes(s: str) -> int:
    """``"512M"``, ``"1.5G"``, ``"64K"`` or plain bytes -> bytes."""
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def fmt_bytes(n: int) -> str:
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % (m // 4 or 1) == 0:
            return f"{n / m:g}{unit}"
    return str(n)


def out_dir(arg: str | None) -> str:
    """``--out``, else ``$OUT``, else ``benchmarks/results`` (created)."""
    d = arg or os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(d, exist_ok=True)
    return d


class Clock:
    """Device-side marks: CUDA events on CUDA, host time on CPU (where ops are synchronous)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def ms(self, a: Any, b: Any) -> float:
        """Milliseconds between two marks (call after ``sync``)."""
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def measure_steps(step: Any, reps: int, cuda: bool, warmup: int = 2) -> dict[str, float | None]:
    """``step()``'s median time over ``reps`` runs after ``warmup``, each between two synchronisations, and the
    allocator's peak over them less what was allocated before them, in GiB (``None`` on the CPU)."""
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    ts = sorted(step_times(step, reps, cuda))
    return {"step_s": ts[len(ts) // 2], "peak_GiB": (torch.cuda.max_memory_allocated() - base) / GiB if cuda else None}


def step_times(step: Any, reps: int, cuda: bool) -> list[float]:
    """``step()``'s time, ``reps`` times in a row, each between two synchronisations (in the order they ran)."""
    ts = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return ts


def more_turns(times: dict[str, list[float]], most: int, spread: float = 0.10) -> bool:
    """Whether methods measured in turns (``times``: each side's turn figures, as many turns a side) need another
    turn: fewer than ``most`` turns so far and some side's turns spread over ``spread`` (largest over smallest, less
    1). On a host-bound model one policy's turns spread 20-40% on an H100 machine (ResNet-152's
    ``torch.utils.checkpoint``: 137-197 ms in five turns), where five turns do not settle a ratio to 2%."""
    turns = min((len(v) for v in times.values()), default=0)
    if turns >= most:
        return False
    return any(v and max(v) > min(v) * (1.0 + spread) for v in times.values())


def measured_under(setup: Callable[[], Any], measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measure()``'s figures with ``setup()`` in force (its return value, if callable, undoes it after), and
    ``wall_s``; a method that raises (out of memory) gives ``error`` instead, with its traceback printed, so a run
    goes on to its other methods."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        undo = setup()
        try:
            out.update(measure())
        finally:
            if callable(undo):
                undo()
    except Exception as e:  # noqa: BLE001 - recorded; the other methods still run
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        traceback.print_exc()
    out["wall_s"] = time.perf_counter() - t0
    return out


def pinned_bandwidth(nbytes: int = GiB, reps: int = 5) -> tuple[float, float]:
    """(D2H, H2D) bytes/s: non_blocking copies between a device buffer and a pinned host
    buffer of ``nbytes``, timed with CUDA events; median over ``reps`` after one warm-up."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = []
    for dst, src in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        out.append(nbytes / median(ts))
    del dev, host
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return out[0], out[1]


def fmt(x: float | None, spec: str = ".1f") -> str:
    """A table cell: ``-`` for None, ``n/a`` for NaN."""
    if x is None:
        return "-"
    if isinstance(x, float) and x != x:
        return "n/a"
    return format(x, spec)


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    w = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w[i]) if i else str(c).ljust(w[i]) for i, c in enumerate(r))  # noqa: E731
    print(line(header))
    print("  ".join("-" * n for n in w))
    for r in rows:
        print(line(r))


def _clean(o: Any) -> Any:
    if isinstance(o, float) and o != o:
        return None  # strict JSON has no NaN
    if isinstance(o, float) and o in (float("inf"), float("-inf")):
        return "inf" if o > 0 else "-inf"  # e.g. the PSNR of an identical image
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(_clean(obj), f, indent=1, default=str, allow_nan=False)
    print(f"wrote {path}", flush=True)


DEVICE_WORK = ("kernel", "memcpy", "memset")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def is_sync_call(name: str) -> bool:
    """Whether a CUDA runtime call makes the host wait for the device: the three synchronisations, and the
    non-async copies (``cudaMemcpy``, ``cudaMemcpy2D``, ...; never ``cudaMemcpyAsync``)."""
    return name in SYNC_CALLS or (name.startswith("cudaMemcpy") and "Async" not in name)


def device_idle(events: Iterable[tuple[float, float, str, str]], window: tuple[float, float]) -> dict[str, Any]:
    """The device's busy time and idle fraction over ``window``, and the host's synchronisations in it.

    Args:
        events: ``(start, end, kind, name)``; ``kind`` ``"kernel"``, ``"memcpy"`` or ``"memset"`` is work on the
            device (on any stream), anything else (``"runtime"``, ``"cpu"``, ...) is the host's; times in seconds.
        window: ``(start, end)`` of the traced run, in the events' clock.

    Returns:
        ``wall_s`` (the window's length), ``busy_s`` (the length of the union of the device's work clipped to the
        window: overlapping kernels on two streams count once, gaps not at all), ``idle_fraction``
        (1 - busy / wall; ``None`` for an empty window), ``syncs`` (calls per name, see ``is_sync_call``, of the
        host's events that start in the window) and ``sync_calls`` (their total).

    Example::

        >>> r = device_idle([(0.0, 2.0, "kernel", "a"), (1.0, 3.0, "kernel", "b"), (5.0, 6.0, "memcpy", "c"),
        ...                  (3.0, 5.0, "runtime", "cudaStreamSynchronize")], (0.0, 8.0))
        >>> r["busy_s"], r["idle_fraction"], r["sync_calls"]
        (4.0, 0.5, 1)
    """
    t0, t1 = window
    if t1 < t0:
        raise ValueError(f"device_idle: window {window!r} ends before it starts")
    events = list(events)
    busy = (t1 - t0) - sum(b - a for a, b, _, _ in _idle_stretches(events, window))
    syncs: dict[str, int] = {}
    for s, _, kind, name in events:
        if kind not in DEVICE_WORK and t0 <= s <= t1 and is_sync_call(name):
            syncs[name] = syncs.get(name, 0) + 1
    wall = t1 - t0
    return {"wall_s": wall, "busy_s": busy, "idle_fraction": 1 - busy / wall if wall > 0 else None,
            "syncs": dict(sorted(syncs.items())), "sync_calls": sum(syncs.values())}


def _idle_stretches(events: Iterable[tuple[float, float, str, str]],
                    window: tuple[float, float]) -> Iterator[tuple[float, float, str, str]]:
    """The stretches of ``window`` with no device work on any stream, in order: ``(start, end, before, after)``, named
    by the work that ended last before the stretch and the work that ends it (``"(start)"``, ``"(end)"`` at the
    window's ends). ``device_idle`` and ``device_gaps`` both sweep the device's work through here."""
    t0, t1 = window
    end, last = t0, "(start)"
    for s, e, _, name in sorted(ev for ev in events if ev[2] in DEVICE_WORK):
        s, e = max(s, t0), min(e, t1)
        if e <= s:
            continue  # outside the window, or empty
        if s > end:
            yield end, s, last, name
        if e > end:
            end, last = e, name
    if t1 > end:
        yield end, t1, last, "(end)"


def device_gaps(events: Iterable[tuple[float, float, str, str]], window: tuple[float, float], parts: int = 10,
                top: int = 12) -> dict[str, Any]:
    """Where the device was idle over ``window``: the idle fraction of each of ``parts`` equal parts of it, and the
    gaps grouped by the device work before and after them (the work that ended last before a gap, on any stream, and
    the work that started it), the largest groups first.

    Args:
        events, window: as ``device_idle`` takes them.

    Returns:
        ``idle_by_part`` (``parts`` fractions) and ``gaps``: up to ``top`` dicts ``before``, ``after`` (names, cut to
        60 characters; ``"(start)"`` and ``"(end)"`` at the window's ends), ``idle_s`` and ``count``.

    Example::

        >>> g = device_gaps([(0.0, 1.0, "kernel", "a"), (2.0, 3.0, "kernel", "b"), (3.5, 4.0, "memcpy", "a")],
        ...                 (0.0, 4.0), parts=2)
        >>> g["idle_by_part"], [(x["before"], x["after"], x["idle_s"], x["count"]) for x in g["gaps"]]
        ([0.5, 0.25], [('a', 'b', 1.0, 1), ('b', 'a', 0.5, 1)])
    """
    t0, t1 = window
    if t1 <= t0 or parts < 1:
        raise ValueError(f"device_gaps: window {window!r} must have a length and parts {parts} must be 1 or more")
    width = (t1 - t0) / parts
    per = [0.0] * parts
    groups: dict[tuple[str, str], list[float]] = {}
    for a, b, before, after in _idle_stretches(events, window):
        g = groups.setdefault((before[:60], after[:60]), [0.0, 0])
        g[0] += b - a
        g[1] += 1
        for i in range(int((a - t0) / width), min(parts, int((b - t0) / width) + 1)):
            lo, hi = t0 + i * width, t0 + (i + 1) * width
            per[i] += max(0.0, min(b, hi) - max(a, lo))
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {"idle_by_part": [p / width for p in per],
            "gaps": [dict(before=k[0], after=k[1], idle_s=v[0], count=int(v[1])) for k, v in ranked]}


def profiler_events(prof: Any, window_name: str | None,
                    marker: str | None = None) -> tuple[list[tuple[float, float, str, str]], tuple[float, float]]:
    """A finished ``torch.profiler.profile``'s events as ``device_idle`` takes them (seconds), and the window of its
    ``record_function(window_name)`` range, or (``marker``, for a trace of device activity only, where no range is
    recorded) from the start of the first host call named ``marker`` to the end of the last. Work on a CUDA device
    is a kernel, a memcpy or a memset by its name (kineto's ``Memcpy ...``/``Memset ...``); the device's mirror of
    user annotations and CUPTI's synchronisation records (``... Sync``, ``Stream Wait Event``) are left out: they are
    not work."""
    from torch.autograd import DeviceType

    events: list[tuple[float, float, str, str]] = []
    window = None
    marks: list[tuple[float, float]] = []
    for e in prof.events():
        s, t = e.time_range.start / 1e6, e.time_range.end / 1e6
        if e.device_type == DeviceType.CPU:
            if e.is_user_annotation and e.name == window_name:
                window = (s, t)
            if marker is not None and e.name == marker:
                marks.append((s, t))
            events.append((s, t, "cpu", e.name))
        elif e.device_type == DeviceType.CUDA and not e.is_user_annotation:
            if e.name.startswith("Memcpy"):
                kind = "memcpy"
            elif e.name.startswith("Memset"):
                kind = "memset"
            elif e.name.endswith(" Sync") or e.name == "Stream Wait Event":
                kind = "device_sync"
            else:
                kind = "kernel"
            events.append((s, t, kind, e.name))
    if marker is not None:
        if len(marks) < 2:
            raise RuntimeError(f"profiler_events: fewer than two {marker!r} calls in the trace to mark its window")
        window = (min(m[0] for m in marks), max(m[1] for m in marks))
    if window is None:
        raise RuntimeError(f"profiler_events: no record_function({window_name!r}) range in the trace")
    return events, window


class GPTBlock(torch.nn.Module):
    """The block of shared/bench/peers_train.py (pre-LN attention + 4x MLP), shared by the training benchmarks."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        nn = torch.nn
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.h, d // self.h).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def pyplot(path: str) -> Any:
    """``matplotlib.pyplot`` on the Agg backend; ``None``, with a message, when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not importable: skipping {path}", flush=True)
        return None
    return plt


def save_figure(fig: Any, path: str, dpi: int = 120) -> None:
    """Lay out, write and close ``fig``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


def block_decisions(plan: Any) -> list[str]:
    """A plan's decisions, one word per block (``recompute+keep5+host``, ``offload3c``, ...): what the planner
    benchmarks write to their JSON."""
    return [b.mode + (f"{len(b.offload)}" if b.offload else "") + ("c" if b.compress else "")
            + (f"+keep{len(b.keep_ops)}" if b.keep_ops else "") + (f"+parts{len(b.parts)}" if b.parts else "")
            + ("+host" if b.host else "") + ("+revolve" if b.revolve else "") for b in plan.blocks]


def finish_figure(fig: Any, ax: Any, path: str) -> None:
    """The plots' common end: a light grid, a small legend, the figure saved to ``path``."""
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def plot_frontier(path: str, rows: Sequence[dict[str, Any]], peak: Callable[[dict[str, Any]], float | None],
                  markers: dict[str, str], floor: float | None, xlabel: str, title: str) -> None:
    """Step time over none's (``x_none``) against ``peak(row)`` in GiB: each row whose ``method`` has a marker as
    one, the ``plan`` rows a line with their budgets (``budget_GiB``) as faint verticals, the planner's ``floor`` as
    a dashed one; rows without a peak or ``x_none`` are left out; skipped without matplotlib."""
    rows = [r for r in rows if r.get("x_none") is not None and peak(r) is not None]
    if not rows:
        return
    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        if r["method"] in markers:
            ax.plot([peak(r)], [r["x_none"]], markers[r["method"]], ms=8, label=r["name"])
    plans = sorted((r for r in rows if r["method"] == "plan"), key=lambda r: r["budget_GiB"])
    if plans:
        ax.plot([peak(r) for r in plans], [r["x_none"] for r in plans], "o-", color="k", label="plan")
        for r in plans:
            ax.axvline(r["budget_GiB"], color="k", alpha=0.12, lw=1)
    if floor:
        ax.axvline(floor, color="tab:red", ls="--", lw=1, label="planner floor")
    measured = all(r.get("peak_GiB") is not None for r in rows)
    ax.set_xlabel(xlabel + ("" if measured else " (planner's predictions)"))
    ax.set_ylabel("step time / no checkpointing (same run)")
    ax.set_title(title, fontsize=9)
    finish_figure(fig, ax, path)


def plot_bars(path: str, labels: Sequence[str], panels: dict[str, Sequence[float]], title: str) -> None:
    """One bar chart per panel (NaN bars drawn empty); skipped with a message without matplotlib."""
    plt = pyplot(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (name, vals) in zip(axes[0], panels.items()):
        v = [0.0 if x != x else x for x in vals]
        bars = ax.bar(range(len(labels)), v, color="tab:blue")
        ax.bar_label(bars, labels=[fmt(x, ".3g") for x in vals], fontsize=8)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        ax.set_title(name)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def profile_record(planned: Any) -> dict[str, Any]:
    """What ``benchmarks/replan.py`` plans from offline: a ``_Profiled``'s host link, measured profile and the
    policies it measured on the device (NOTE [ Mechanism costs ], by name); no codec. With ``trials``: every plan
    measured so far, with its decisions (``torchckpt.planner.trials``; ``benchmarks/replay_trials.py`` reads them)."""
    from torchckpt.planner.trials import trials_to_records

    rec = {"link": [planned.link.d2h, planned.link.h2d], "codec": None, "profile": json.loads(planned.prof.to_json()),
           "measured": planned.measured}
    if getattr(planned, "trials", None):
        rec["trials"] = trials_to_records(planned.trials)
    return rec
