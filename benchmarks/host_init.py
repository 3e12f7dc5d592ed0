"""Host pool initialization: how much does getting pinned host memory block checkpointing?

The method of Maurya et al., "Towards Efficient Cache Allocation for High-Frequency
Checkpointing" (HiPC'22), on one GPU: an application writes ``--count`` checkpoints of
``--ckpt`` bytes (256 x 128 MiB = a 32 GiB host pool, the paper's large-host configuration)
with ``--interval`` ms of compute between them (a calibrated ``torch.cuda._sleep`` on the compute
stream; the host waits for it, as an application waits for its step), then restores them in
reverse order, again with compute in between.

* A checkpoint is a device-to-device copy into a small GPU cache (``--slots`` x ``--ckpt``, 1 GiB by
  default). A flush thread copies each cached checkpoint to the host pool on its own stream; a
  checkpoint blocks only while its cache slot still waits for the flush of an older one.
* Restores read checkpoints from the cache (the last ``--slots`` ones are still there) or from the
  host pool, prefetched in reverse order by a prefetch thread on its own stream into the slot
  freed by the restore just done; a restore blocks until its prefetch has landed.
* Blocking is host wall time inside checkpoint / restore calls, plus the time to create the host
  pool (direct pinning allocates it before the first checkpoint).

Approaches, in one run:
  direct_pin  ``cudaHostAlloc`` of the whole pool up front (``torch.empty(pin_memory=True)``);
              allocated once and charged, with its measured time, to every interval setting.
  unified     ``cudaMallocManaged`` with preferred location host and access by the GPU; sized at
              most to the GPU's free memory minus 4 GiB (never more managed memory than the card
              has free); checkpoints past that size reuse the region from its start.
  memset      pageable memory, each checkpoint's pages touched (one byte per page) just before
              its first flush, no pinning.
  whole       the paper's lazy pinning: mmap + THP, flush into pageable memory at once, touch the
              whole pool in the background, then register it in one ``cudaHostRegister``
              (``LazyHostPool(strategy="whole")``).
  chunked     torchckpt: ``LazyHostPool`` registering chunk by chunk (first 128 MiB, doubling up
              to ``--chunk``), strategy ``--strategy`` (auto: NOTE [ Lazy pool strategy model ]).
  chunked@S   the same with chunks of S bytes (e.g. ``chunked@256M``): chunk sizes compared in one run.

Also reported: the application's slowdown (pool creation plus forward and restore wall time beyond
their compute), which catches costs that do not show as blocking (unified memory's page faults
slow the compute stream itself). Also measured: the time from creating a ``--count`` x ``--ckpt`` ``LazyHostPool`` until the first
checkpoint-sized D2H copy into it has completed at pinned bandwidth (target: 50 ms for 32 GiB).
Targets (the paper's averages): chunked checkpoint blocking >= 12x lower and checkpoint+restore
blocking >= 8x lower than direct_pin, and both lower than whole. Every restored checkpoint is
checked against the value written (exit status 1 if one differs).

    python benchmarks/host_init.py [--count 256] [--ckpt 128M] [--slots 8] [--intervals 5,20,50]
        [--approaches direct_pin,unified,memset,whole,chunked] [--strategy auto] [--tag h100] [--out DIR]
    python benchmarks/host_init.py --merge a.json b.json --tag h100 --out DIR   # join runs of several intervals
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(1, ROOT)  # the repo, when torchckpt is not installed

import torch  # noqa: E402

from common import GiB, fmt, out_dir, parse_bytes, print_table, pyplot, save_figure, write_json  # noqa: E402
from torchckpt._native import host_pool_can_register, touch_pages  # noqa: E402
from torchckpt.memory.lazy_pool import LazyHostPool  # noqa: E402

MiB = 1 << 20
APPROACHES = ("direct_pin", "whole", "chunked", "unified", "memset")  # slowest to run last


# -- the simulated application ---------------------------------------------------------------
class Sleeper:
    """GPU compute of a given length: ``torch.cuda._sleep`` calibrated against CUDA events."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        cycles = 20_000_000
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)  # warm-up
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            torch.cuda._sleep(cycles)
            b.record(stream)
        b.synchronize()
        self.cycles_per_ms = cycles / a.elapsed_time(b)

    def compute(self, ms: float) -> None:
        if ms > 0:
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(int(ms * self.cycles_per_ms))
        self.stream.synchronize()  # the application waits for its own step


class Approach:
    """Where flushed checkpoints go. ``create`` is timed as blocking."""

    name = "?"

    def __init__(self, count: int, ckpt: int, args: argparse.Namespace) -> None:
        self.count, self.ckpt, self.args = count, ckpt, args
        self.pinned_flushes = 0

    def create(self) -> None:
        raise NotImplementedError

    def dest(self, i: int) -> torch.Tensor:
        """The host (or managed) tensor holding checkpoint ``i`` (called by the flush thread first)."""
        raise NotImplementedError

    def flushing(self, i: int) -> torch.Tensor:
        """``dest(i)`` for its flush: counts flushes into pinned memory."""
        t = self.dest(i)
        self.pinned_flushes += int(self.is_pinned(i, t))
        return t

    def is_pinned(self, i: int, t: torch.Tensor) -> bool:
        return False

    def after_copy(self, stream: torch.cuda.Stream) -> None:
        pass

    def valid(self, i: int) -> bool:
        """Whether checkpoint ``i`` is still held when restores begin."""
        return True

    def info(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class DirectPin(Approach):
    name = "direct_pin"
    shared: torch.Tensor | None = None
    create_s: float | None = None

    def create(self) -> None:
        if DirectPin.shared is None or DirectPin.shared.numel() != self.count * self.ckpt:
            t = time.perf_counter()
            DirectPin.shared = torch.empty(self.count * self.ckpt, dtype=torch.uint8, pin_memory=True)
            DirectPin.create_s = time.perf_counter() - t
        # else: allocated by an earlier interval; run() charges its measured time again (docstring)
        self.base = DirectPin.shared

    def dest(self, i: int) -> torch.Tensor:
        return self.base[i * self.ckpt : (i + 1) * self.ckpt]

    def is_pinned(self, i: int, t: torch.Tensor) -> bool:
        return True

    @staticmethod
    def release() -> None:
        DirectPin.shared = None
        torch.cuda.synchronize()
        torch._C._host_emptyCache()


class _Cudart:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcudart.so.13") if _has_lib("libcudart.so.13") else ctypes.CDLL("libcudart.so")

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            self.lib.cudaGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what} failed: {self.lib.cudaGetErrorString(rc).decode()}")


def _has_lib(name: str) -> bool:
    try:
        ctypes.CDLL(name)
        return True
    except OSError:
        return False


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Managed:
    """A ``__cuda_array_interface__`` over a managed allocation, for ``torch.as_tensor``."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": None}


class Unified(Approach):
    name = "unified"

    def create(self) -> None:
        rt = _Cudart()
        free, _ = torch.cuda.mem_get_info()
        want = self.count * self.ckpt
        self.size = min(want, max(self.ckpt, (free - 4 * GiB) // self.ckpt * self.ckpt))
        if self.size < self.ckpt:
            raise RuntimeError("not enough free GPU memory for one managed checkpoint")
        ptr = ctypes.c_void_p()
        rt.lib.cudaMallocManaged.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        rt.check(rt.lib.cudaMallocManaged(ctypes.byref(ptr), ctypes.c_size_t(self.size), 1), "cudaMallocManaged")
        self.ptr, self.rt = ptr, rt
        rt.lib.cudaMemAdvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, _MemLocation]
        dev = torch.cuda.current_device()
        self.advice = []
        for advice, loc in ((3, _MemLocation(2, 0)), (5, _MemLocation(1, dev))):  # preferred: host; accessed by GPU
            rc = rt.lib.cudaMemAdvise(ptr, ctypes.c_size_t(self.size), advice, loc)
            self.advice.append(int(rc))
        self.base = torch.as_tensor(_Managed(int(ptr.value or 0), self.size), device="cuda")
        self.slots = self.size // self.ckpt

    def dest(self, i: int) -> torch.Tensor:
        j = i % self.slots
        return self.base[j * self.ckpt : (j + 1) * self.ckpt]

    def valid(self, i: int) -> bool:
        return i >= self.count - self.slots

    def info(self) -> dict[str, Any]:
        return {"managed_bytes": self.size, "wraps": self.slots < self.count, "advise_rc": self.advice}

    def close(self) -> None:
        torch.cuda.synchronize()
        del self.base
        self.rt.lib.cudaFree.argtypes = [ctypes.c_void_p]
        self.rt.check(self.rt.lib.cudaFree(self.ptr), "cudaFree")


class Memset(Approach):
    name = "memset"

    def create(self) -> None:
        self.base = torch.empty(self.count * self.ckpt, dtype=torch.uint8)  # untouched pageable pages
        self.touched: set[int] = set()

    def dest(self, i: int) -> torch.Tensor:
        t = self.base[i * self.ckpt : (i + 1) * self.ckpt]
        if i not in self.touched:
            touch_pages(t)  # first use: one byte per page (incremental memset)
            self.touched.add(i)
        return t


class Lazy(Approach):
    def __init__(self, count: int, ckpt: int, args: argparse.Namespace, strategy: str, node_lock: bool = True,
                 chunk: int | None = None, name: str | None = None) -> None:
        super().__init__(count, ckpt, args)
        self.strategy = strategy
        self.node_lock = node_lock
        self.chunk = args.chunk if chunk is None else chunk
        self.name = name or ("whole" if strategy == "whole" else "chunked")
        self.blocks: dict[int, Any] = {}

    def create(self) -> None:
        chunk = self.chunk
        first = self.ckpt if self.strategy != "whole" else chunk
        self.pool = LazyHostPool(capacity_bytes=self.count * self.ckpt, chunk_bytes=chunk, first_chunk_bytes=first,
                                 strategy=self.strategy, node_lock=self.node_lock, pin=True)

    def dest(self, i: int) -> torch.Tensor:
        b = self.blocks.get(i)
        if b is None:
            b = self.blocks[i] = self.pool.alloc(self.ckpt)
        return b.tensor

    def is_pinned(self, i: int, t: torch.Tensor) -> bool:
        return bool(self.blocks[i].pinned)

    def after_copy(self, stream: torch.cuda.Stream) -> None:
        self.pool.track_copy(stream)

    def info(self) -> dict[str, Any]:
        s = self.pool.lazy_stats()
        return {"strategy": s.strategy, "all_registered_s": s.all_registered_s,
                "first_registered_s": s.first_registered_s, "touch_s": s.touch_s, "register_s": s.register_s,
                "lock_wait_s": s.lock_wait_s, "paused_s": s.paused_s, "huge_pages": s.huge_pages,
                "huge_page_bytes": s.huge_page_bytes,
                "failed_chunks": s.failed_chunks, "errors": list(s.errors[:2]),
                "profile_gbps": ({k: v / 1e9 for k, v in vars(self.pool.profile).items()}
                                 if self.pool.profile is not None else None)}

    def close(self) -> None:
        torch.cuda.synchronize()
        for b in self.blocks.values():
            self.pool.free(b)
        self.blocks.clear()
        self.pool.close()


def make_approach(name: str, args: argparse.Namespace, node_lock: bool = True) -> Approach:
    if name == "direct_pin":
        return DirectPin(args.count, args.ckpt, args)
    if name == "unified":
        return Unified(args.count, args.ckpt, args)
    if name == "memset":
        return Memset(args.count, args.ckpt, args)
    if name == "whole":
        return Lazy(args.count, args.ckpt, args, "whole", node_lock)
    if name == "chunked":
        return Lazy(args.count, args.ckpt, args, args.strategy, node_lock)
    if name.startswith("chunked@"):  # another chunk size, e.g. chunked@256M
        return Lazy(args.count, args.ckpt, args, args.strategy, node_lock, chunk=parse_bytes(name[8:]), name=name)
    raise SystemExit(f"unknown approach {name!r}; choose from {APPROACHES}")


# -- one run: forward checkpoints, then reverse restores --------------------------------------
class Harness:
    """GPU buffers shared by every run: the cache slots, the activation, the streams."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.slots = [torch.empty(args.ckpt, dtype=torch.uint8, device="cuda") for _ in range(args.slots)]
        self.act = torch.empty(args.ckpt, dtype=torch.uint8, device="cuda")
        self.comp = torch.cuda.Stream()
        self.d2h = torch.cuda.Stream()
        self.h2d = torch.cuda.Stream()
        self.sleeper = Sleeper(self.comp)

    def run(self, ap: Approach, interval: float) -> dict[str, Any]:
        K, N = self.args.slots, self.args.count
        slots, act, comp, d2h, h2d = self.slots, self.act, self.comp, self.d2h, self.h2d
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ap.create()
        create_s = time.perf_counter() - t0
        if isinstance(ap, DirectPin):
            create_s = DirectPin.create_s or create_s
        issued = [threading.Event() for _ in range(K)]
        for e in issued:
            e.set()
        flushed: list[Any] = [None] * K
        q: queue.Queue[tuple[int, int, Any] | None] = queue.Queue()
        errors: list[BaseException] = []

        def flusher() -> None:
            try:
                while (item := q.get()) is not None:
                    i, s, ev = item
                    dst = ap.flushing(i)
                    d2h.wait_event(ev)
                    with torch.cuda.stream(d2h):
                        dst.copy_(slots[s], non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(d2h)
                    ap.after_copy(d2h)
                    flushed[s] = done
                    issued[s].set()
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
                for ev_ in issued:
                    ev_.set()

        th = threading.Thread(target=flusher, daemon=True)
        th.start()
        ckpt_block = create_s
        t_fwd = time.perf_counter()
        for i in range(N):
            self.sleeper.compute(interval)
            t = time.perf_counter()
            s = i % K
            issued[s].wait()
            if flushed[s] is not None:
                flushed[s].synchronize()
            with torch.cuda.stream(comp):
                act.fill_(i % 251)
                slots[s].copy_(act)
                ev = torch.cuda.Event()
                ev.record(comp)
            issued[s].clear()
            q.put((i, s, ev))
            ckpt_block += time.perf_counter() - t
        fwd_s = time.perf_counter() - t_fwd
        q.put(None)

        # Reverse restores: the last K checkpoints are still in their slots; the prefetcher
        # refills the slot freed by restore i with checkpoint i - K.
        consumed = [threading.Event() for _ in range(N)]
        consumed_ev: list[Any] = [None] * N
        ready = [threading.Event() for _ in range(N)]
        fetched: list[Any] = [None] * N
        for i in range(max(0, N - K), N):
            ready[i].set()

        def prefetcher() -> None:
            try:
                for j in range(N - K - 1, -1, -1):
                    s = j % K
                    consumed[j + K].wait()
                    issued[s].wait()  # the flush that last read this slot has been issued...
                    src = ap.dest(j)
                    h2d.wait_event(consumed_ev[j + K])
                    if flushed[s] is not None:
                        h2d.wait_event(flushed[s])  # ...and it finishes before the slot is overwritten
                    with torch.cuda.stream(h2d):
                        slots[s].copy_(src, non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(h2d)
                    fetched[j] = ev
                    ready[j].set()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                for r in ready:
                    r.set()

        pt = threading.Thread(target=prefetcher, daemon=True)
        pt.start()
        bad = torch.zeros((), dtype=torch.int64, device="cuda")
        rest_block = 0.0
        t_rest = time.perf_counter()
        for i in range(N - 1, -1, -1):
            self.sleeper.compute(interval)
            t = time.perf_counter()
            s = i % K
            ready[i].wait()
            if fetched[i] is not None:
                fetched[i].synchronize()
            with torch.cuda.stream(comp):
                act.copy_(slots[s])
                ev = torch.cuda.Event()
                ev.record(comp)
            consumed_ev[i] = ev
            consumed[i].set()
            rest_block += time.perf_counter() - t
            if ap.valid(i):
                with torch.cuda.stream(comp):  # verification, off the clock
                    bad += (act[:: 1 << 16] != (i % 251)).sum()
        rest_s = time.perf_counter() - t_rest
        th.join()
        pt.join()
        torch.cuda.synchronize()
        if errors:
            raise errors[0]
        wrong = int(bad)
        res = {
            "approach": ap.name, "interval_ms": interval, "create_s": create_s,
            "ckpt_blocking_s": ckpt_block, "restore_blocking_s": rest_block,
            "total_blocking_s": ckpt_block + rest_block, "forward_s": fwd_s, "restore_s": rest_s,
            # the application's whole slowdown: pool creation plus both phases beyond their compute
            "overhead_s": create_s + fwd_s + rest_s - 2 * N * interval / 1e3,
            "pinned_flushes": ap.pinned_flushes, "checkpoints": N, "wrong_bytes_sampled": wrong,
            **ap.info(),
        }
        return res


def first_pinned(args: argparse.Namespace) -> dict[str, Any]:
    """Time from creating a count x ckpt LazyHostPool to the first ckpt-sized D2H done at pinned speed."""
    src = torch.empty(args.ckpt, dtype=torch.uint8, device="cuda")

    def copy_ms(dst: torch.Tensor) -> float:  # one D2H of src into dst, waited for, in ms of GPU time
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    ref = torch.empty(args.ckpt, dtype=torch.uint8, pin_memory=True)
    ref_ms = [copy_ms(ref) for _ in range(3)]
    del ref
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pool = LazyHostPool(capacity_bytes=args.count * args.ckpt, chunk_bytes=args.chunk, first_chunk_bytes=args.ckpt,
                        strategy=args.strategy, pin=True)
    blk = pool.alloc(args.ckpt)
    pool.wait_pinned(blk)
    first_ms = copy_ms(blk.tensor)
    total_ms = (time.perf_counter() - t0) * 1e3
    states = pool.chunk_states()
    pool.free(blk)
    pool.close()
    ref_bw = args.ckpt / (min(ref_ms) * 1e-3)
    return {"pool_bytes": args.count * args.ckpt, "ms_to_first_pinned_copy": total_ms, "copy_ms": first_ms,
            "copy_gbps": args.ckpt / (first_ms * 1e-3) / 1e9, "pinned_ref_gbps": ref_bw / 1e9,
            "at_pinned_bandwidth": args.ckpt / (first_ms * 1e-3) >= 0.85 * ref_bw,
            "chunks_registered_then": sum(1 for s in states if s == 2), "chunks": len(states)}


# -- reporting -------------------------------------------------------------------------------
def report(results: list[dict[str, Any]], meta: dict[str, Any], out: str, tag: str) -> bool:
    ok = True
    targets = []
    for iv in sorted({r["interval_ms"] for r in results}):
        rows = [r for r in results if r["interval_ms"] == iv]
        base = next((r for r in rows if r["approach"] == "direct_pin"), None)
        table = []
        for r in rows:
            rc = base["ckpt_blocking_s"] / r["ckpt_blocking_s"] if base and r["ckpt_blocking_s"] > 0 else float("nan")
            rt = base["total_blocking_s"] / r["total_blocking_s"] if base and r["total_blocking_s"] > 0 else float("nan")
            r["ckpt_ratio_vs_direct_pin"], r["total_ratio_vs_direct_pin"] = rc, rt
            table.append([r["approach"], fmt(r["create_s"], ".3f"), fmt(r["ckpt_blocking_s"], ".3f"),
                          fmt(r["total_blocking_s"], ".3f"), fmt(rc, ".1f"), fmt(rt, ".1f"),
                          fmt(r.get("overhead_s"), ".3f"),
                          f"{r['pinned_flushes']}/{r['checkpoints']}", str(r.get("strategy", "")),
                          fmt(r.get("all_registered_s"), ".2f")])
        print(f"\n== compute interval {iv:g} ms, {meta['count']} x {meta['ckpt'] >> 20} MiB checkpoints, "
              f"{meta['slots']} GPU cache slots")
        print_table(["approach", "create s", "ckpt block s", "ckpt+restore s", "ckpt x", "total x", "slowdown s",
                     "pinned flushes",
                     "strategy", "all reg s"], table)
        wh = next((r for r in rows if r["approach"] == "whole"), None)
        for ch in [r for r in rows if r["approach"].startswith("chunked")]:
            if not base:
                break
            t = {"interval_ms": iv, "approach": ch["approach"], "ckpt_12x": ch["ckpt_ratio_vs_direct_pin"] >= 12,
                 "total_8x": ch["total_ratio_vs_direct_pin"] >= 8}
            if wh:
                t["below_whole"] = (ch["ckpt_blocking_s"] < wh["ckpt_blocking_s"]
                                    and ch["total_blocking_s"] < wh["total_blocking_s"])
            targets.append(t)
            print(f"targets ({ch['approach']}):",
                  " ".join(f"{k}={'PASS' if v else 'FAIL'}" for k, v in t.items() if k not in ("interval_ms", "approach")))
    for r in results:
        if r["wrong_bytes_sampled"]:
            print(f"WRONG DATA: {r['approach']} at {r['interval_ms']} ms: {r['wrong_bytes_sampled']} sampled bytes differ")
            ok = False
    fp = meta.get("first_pinned")
    if fp:
        print(f"\nfirst {meta['ckpt'] >> 20} MiB checkpoint at pinned bandwidth: {fp['ms_to_first_pinned_copy']:.1f} ms "
              f"after creating a {fp['pool_bytes'] / GiB:.0f} GiB pool (copy {fp['copy_gbps']:.1f} GB/s, pinned "
              f"reference {fp['pinned_ref_gbps']:.1f} GB/s); target 50 ms: "
              f"{'PASS' if fp['ms_to_first_pinned_copy'] <= 50 and fp['at_pinned_bandwidth'] else 'FAIL'}")
    write_json(os.path.join(out, f"host_init_{tag}.json"), {"meta": meta, "results": results, "targets": targets})
    plot(results, meta, os.path.join(out, f"host_init_{tag}.png"))
    return ok


def plot(results: list[dict[str, Any]], meta: dict[str, Any], path: str) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    ivs = sorted({r["interval_ms"] for r in results})
    names = list(dict.fromkeys(r["approach"] for r in results))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    w = 0.8 / max(1, len(names))
    for ax, key, title in ((axes[0], "ckpt_blocking_s", "checkpoint blocking"),
                           (axes[1], "total_blocking_s", "checkpoint + restore blocking"),
                           (axes[2], "overhead_s", "application slowdown (wall - compute)")):
        for k, a in enumerate(names):
            vals = [next((r.get(key, float("nan")) for r in results if r["approach"] == a and r["interval_ms"] == iv), float("nan"))
                    for iv in ivs]
            ax.bar([x + k * w for x in range(len(ivs))], vals, w, label=a)
        ax.set_xticks([x + w * (len(names) - 1) / 2 for x in range(len(ivs))], [f"{iv:g} ms" for iv in ivs])
        ax.set_yscale("log")
        ax.set_ylabel("seconds (log)")
        ax.set_xlabel("compute interval")
        ax.set_title(title)
    axes[2].legend(fontsize=8, loc="upper right", ncol=2)
    fig.suptitle(f"{meta.get('gpu', '')}: {meta['count']} x {meta['ckpt'] >> 20} MiB checkpoints, "
                 f"{meta['slots']}-slot GPU cache", fontsize=10)
    save_figure(fig, path)


def merge(paths: list[str], out: str, tag: str) -> None:
    results: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        results += d["results"]
        meta = {**d["meta"], **meta}
        if "first_pinned" in d["meta"]:
            meta["first_pinned"] = d["meta"]["first_pinned"]
    meta["merged_from"] = [os.path.basename(p) for p in paths]
    report(results, meta, out, tag)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=256)
    ap.add_argument("--ckpt", type=parse_bytes, default=128 * MiB)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--chunk", type=parse_bytes, default=1 << 30)
    ap.add_argument("--intervals", default="5,20,50")
    ap.add_argument("--approaches", default=",".join(APPROACHES))
    ap.add_argument("--strategy", default="auto", choices=("auto", "concurrent", "sequential"))
    ap.add_argument("--no-first-pinned", action="store_true", help="skip the time-to-first-pinned measurement")
    ap.add_argument("--first-pinned-reps", type=int, default=1,
                    help="repeat the time-to-first-pinned measurement (the first may pay a fresh machine's first touch)")
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", nargs="+", default=None, help="JSON files of earlier runs to join into one report")
    args = ap.parse_args(argv)
    out = out_dir(args.out)
    if args.merge:
        merge(args.merge, out, args.tag)
        return 0
    if not torch.cuda.is_available() or not host_pool_can_register():
        print("host_init needs CUDA and torchckpt._C built with the CUDA host pool; nothing to measure here.")
        return 0
    intervals = [float(x) for x in args.intervals.split(",") if x]
    names = [a for a in args.approaches.split(",") if a]
    torch.cuda.init()
    h = Harness(args)
    meta: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "count": args.count,
                            "ckpt": args.ckpt, "slots": args.slots, "chunk": args.chunk, "strategy": args.strategy,
                            "intervals_ms": intervals, "cycles_per_ms": h.sleeper.cycles_per_ms,
                            "thp": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
                            if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") else None,
                            "cpus": os.cpu_count()}
    print(f"{meta['gpu']}: {args.count} x {args.ckpt >> 20} MiB checkpoints ({args.count * args.ckpt / GiB:.1f} GiB "
          f"host pool), {args.slots} GPU cache slots, intervals {intervals} ms, THP {meta['thp']}", flush=True)
    if not args.no_first_pinned:
        reps = [first_pinned(args) for _ in range(max(1, args.first_pinned_reps))]
        meta["first_pinned"] = reps[0]
        if len(reps) > 1:
            meta["first_pinned_reps"] = reps
        for r in reps:
            print("first pinned:", r, flush=True)
    results = []
    for name in names:
        for iv in intervals:
            a = make_approach(name, args)
            t = time.perf_counter()
            try:
                r = h.run(a, iv)
            finally:
                a.close()
            r["wall_s"] = time.perf_counter() - t
            write_json(os.path.join(out, f"host_init_{args.tag}.partial.json"), {"meta": meta, "results": results + [r]})
            print(f"{name:>10} {iv:>4g} ms: ckpt block {r['ckpt_blocking_s']:.3f} s, +restore "
                  f"{r['total_blocking_s']:.3f} s (create {r['create_s']:.3f} s, pinned flushes "
                  f"{r['pinned_flushes']}/{r['checkpoints']}, wall {r['wall_s']:.1f} s) "
                  f"{ {k: r[k] for k in ('strategy', 'all_registered_s', 'huge_page_bytes', 'managed_bytes') if k in r} }", flush=True)
            results.append(r)
        if name == "direct_pin":
            DirectPin.release()
    return 0 if report(results, meta, out, args.tag) else 1


if __name__ == "__main__":
    sys.exit(main())
