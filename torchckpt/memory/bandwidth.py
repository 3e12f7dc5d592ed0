"""The snapshot tiers' bandwidths, measured once per process: the host link by a copy, the disk by its files.

What ``AutoSchedule`` ranks the tiers by (the autotuner of a multilayer buffer system, MLBS: layers ranked
by measured bandwidth; NOTE [ Multi-tier Revolve ] Rule 4, schedules/multistage.py).

# NOTE [ Tier bandwidths ]
# 1. A tier's bandwidth is the rate of a snapshot's round trip from the device through it and
#    back, 2 / (1/out + 1/in) bytes per second. The host tier's is a device-to-host copy into a
#    host buffer (pinned when the store's host pool pins; not taken from the pool, whose cap
#    stays the store's) and the copy back.
#    A disk snapshot passes through host memory on its way to its file (NOTE [ Snapshot disk tier ]
#    Rule 1), so the disk tier's time per byte is the host link's plus the files' (written and
#    read back by ``DiskTier.measure_bandwidth``): 1/disk = 1/host + 1/file. Measured so, the
#    disk never ranks above the host tier of the same store; given rates (``AutoSchedule(bandwidths=...)``)
#    can say otherwise.
# 2. Measured once per process and key: the host link per (device, pinned or not), the disk per
#    file system (the ``st_dev`` of the tier's directory), each with one snapshot's bytes clamped
#    to [1 MiB, 64 MiB]. A later call with another size reuses the first figure.
# 3. One measurement of the host link (``host_link``), which the planner's link model reads too: on CUDA
#    the copies run on a side stream, timed by events, the median of 5 each way after Rule 4's warm-up; on
#    the CPU (the simulated store) they are memory copies timed by the host clock, after one warm-up copy.
#    With buffered I/O the files' read may come from the page cache and overstate the disk (``DiskTier.direct``).
# 4. One short measurement can catch the link slow: on an H100 one process measured 28.1 GB/s each way after one
#    warm-up round trip of 64 MiB, where the next process on that machine, two minutes later, and 38 other
#    measurements measured 42-55 GB/s, and the planner then priced every copy at twice its time
#    (docs/notes/2026-11-28-offload-costs-h100.md). 28.1 GB/s is PCIe 4's rate, and a GPU's PCIe link changes its
#    speed with the load as a power saving; whatever the cause, on CUDA the round trips run untimed until their
#    copies have kept the link busy for ``_WARM_S`` (0.25 s; at most ``_WARM_MOST`` round trips), then the timed
#    ones (``_warmed``).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch

from torchckpt.memory.disk import DiskTier
from torchckpt.memory.host_pool import HostPoolBase
from torchckpt.schedules.actions import Tier

__all__ = ["disk_file_bandwidth", "host_link", "host_link_bandwidth", "tier_bandwidths"]

_MIN, _MAX = 1 << 20, 64 << 20
_WARM_S = 0.25  # NOTE [ Tier bandwidths ] Rule 4: seconds of copies before the timed ones (CUDA)
_WARM_MOST = 200  # round trips at most in the warm-up, whatever their times
_lock = threading.Lock()
_host: dict[tuple[str, int | None, bool], tuple[float, float]] = {}
_disk: dict[int, float] = {}


def _size(nbytes: int) -> int:
    return min(max(int(nbytes), _MIN), _MAX)


def _round_trip(out_bps: float, in_bps: float) -> float:
    return 2.0 / (1.0 / out_bps + 1.0 / in_bps)


def host_link(device: torch.device, pinned: bool, nbytes: int = _MAX, reps: int = 5) -> tuple[float, float]:
    """Bytes/s of a copy from ``device`` to host memory and of one back: the one host-link measurement
    (NOTE [ Tier bandwidths ] Rules 2-3; cached per device and pinning). The planner's link model and
    ``host_link_bandwidth`` read it.

    Args:
        device: the device (``cpu``: memory copies, what an offload there does).
        pinned: whether the host buffer is pinned (only on CUDA).
        nbytes: bytes per copy (clamped to [1 MiB, 64 MiB]).
        reps: copies timed each way, after one warm-up copy; the median counts.

    Returns:
        ``(device_to_host, host_to_device)`` bytes per second.

    Example::

        >>> d2h, h2d = host_link(torch.device("cpu"), pinned=False, nbytes=1 << 20)
        >>> d2h > 0 and h2d > 0
        True
    """
    n = _size(nbytes)
    pinned = bool(pinned) and device.type == "cuda"
    key = (device.type, device.index, pinned)
    with _lock:
        if key in _host:
            return _host[key]
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)  # not from a pool: its cap stays for the store
    src = torch.zeros(n, dtype=torch.uint8, device=device)
    times: tuple[list[float], list[float]] = ([], [])
    if device.type == "cuda":
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))

        def round_trip() -> tuple[float, float]:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record(stream)
            dst.copy_(src, non_blocking=True)
            ev[1].record(stream)
            src.copy_(dst, non_blocking=True)
            ev[2].record(stream)
            ev[2].synchronize()
            return ev[0].elapsed_time(ev[1]) * 1e-3, ev[1].elapsed_time(ev[2]) * 1e-3

        with torch.cuda.stream(stream):
            times = _warmed(round_trip, reps)
    else:
        dst.copy_(src)  # warm-up (touches the pages)
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            t1 = time.perf_counter()
            src.copy_(dst)
            t2 = time.perf_counter()
            times[0].append(t1 - t0)
            times[1].append(t2 - t1)
    d2h, h2d = (n / max(sorted(ts)[len(ts) // 2], 1e-9) for ts in times)
    with _lock:
        return _host.setdefault(key, (d2h, h2d))


def _warmed(round_trip: Callable[[], tuple[float, float]], reps: int, warm_s: float = _WARM_S,
            most: int = _WARM_MOST) -> tuple[list[float], list[float]]:
    """NOTE [ Tier bandwidths ] Rule 4: ``round_trip()`` (the seconds of a copy out and of one back) untimed until
    their copies add up to ``warm_s`` (at least once, at most ``most`` times), then ``reps`` times: those times,
    each way.

    Example::

        >>> slow = iter([(2.0, 2.0)] * 3)  # a link that starts at half its speed
        >>> out, back = _warmed(lambda: next(slow, (1.0, 1.0)), reps=3, warm_s=10.0)
        >>> out, back
        ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    """
    spent = 0.0
    for _ in range(most):
        a, b = round_trip()
        spent += a + b
        if spent >= warm_s:
            break
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        a, b = round_trip()
        times[0].append(a)
        times[1].append(b)
    return times


def host_link_bandwidth(device: torch.device, pool: HostPoolBase, nbytes: int = _MAX) -> float:
    """Round-trip bytes/s of a copy from ``device`` to host memory and back (NOTE [ Tier bandwidths ] Rules 1-3; cached).

    Args:
        device: the store's device (``cpu`` simulates: memory copies).
        pool: the store's host pool: the host buffer is pinned when the pool pins.
        nbytes: bytes per copy (clamped to [1 MiB, 64 MiB]).

    Returns:
        Bytes per second.

    Example::

        >>> from torchckpt.memory import HostPool
        >>> host_link_bandwidth(torch.device("cpu"), HostPool(chunk_bytes=1 << 20, pin=False), 1 << 20) > 0
        True
    """
    return _round_trip(*host_link(device, bool(pool.pin), nbytes))


def disk_file_bandwidth(disk: DiskTier, nbytes: int = _MAX) -> float:
    """Round-trip bytes/s of ``disk``'s files: ``measure_bandwidth``, cached per file system
    (NOTE [ Tier bandwidths ] Rules 1-3).

    Args:
        disk: the disk tier.
        nbytes: bytes written and read back (clamped to [1 MiB, 64 MiB]).

    Returns:
        Bytes per second.

    Example::

        >>> import tempfile
        >>> with DiskTier(tempfile.mkdtemp(), direct=False) as tier:
        ...     disk_file_bandwidth(tier, 1 << 20) > 0
        True
    """
    key = os.stat(disk.root).st_dev
    with _lock:
        if key in _disk:
            return _disk[key]
    w, r = disk.measure_bandwidth(_size(nbytes))
    with _lock:
        return _disk.setdefault(key, _round_trip(w, r))


def tier_bandwidths(device: torch.device, pool: HostPoolBase, disk: DiskTier, nbytes: int) -> dict[Tier, float]:
    """``{Tier.HOST: host, Tier.DISK: disk}`` round-trip bytes/s as NOTE [ Tier bandwidths ] Rule 1 defines them.

    Args:
        device: the store's device.
        pool: its host pool.
        disk: its disk tier.
        nbytes: one snapshot's bytes (the size measured, clamped).

    Returns:
        Bytes per second per off-GPU tier (measured once per process, NOTE [ Tier bandwidths ] Rule 2).

    Example::

        >>> import tempfile
        >>> from torchckpt.memory import HostPool
        >>> with DiskTier(tempfile.mkdtemp(), direct=False) as tier:
        ...     bw = tier_bandwidths(torch.device("cpu"), HostPool(chunk_bytes=1 << 20, pin=False), tier, 1 << 20)
        >>> bw[Tier.HOST] > bw[Tier.DISK] > 0
        True
    """
    host = host_link_bandwidth(device, pool, nbytes)
    files = disk_file_bandwidth(disk, nbytes)
    return {Tier.HOST: host, Tier.DISK: 1.0 / (1.0 / host + 1.0 / files)}
