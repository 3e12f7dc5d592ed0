"""The host link's bandwidths, measured once per device, and the model that picks the lazy pool's strategy.

# NOTE [ Lazy pool strategy model ]
# ``strategy="auto"`` chooses between the paper's two strategies with a small model fed by
# bandwidths measured once per process and device (``measure_link_profile``, 16 MiB copies, ~tens of ms,
# run in a background thread once the pool's first chunk is registered, so that neither creating
# the pool nor its first pinned copy waits for it; the pool runs "concurrent" until the model has
# spoken):
#   b_pin       pinned D2H into a registered chunk, link otherwise idle
#   b_pin_busy  the same while another thread touches fresh pages (touching competes with the
#               copy for memory bandwidth and the page-table lock)
#   b_page      pageable D2H into already touched memory (b_untouched is kept for reports)
#   r           bytes/s the worker makes ready: 1 / (1/touch_rate + 1/register_rate)
#   w           the checkpoint write rate: ``write_rate`` if given, else b_pin / 2
# Concurrent: the ready frontier advances at v_c = r, copies into ready memory run at b_pin_busy.
# Sequential: the worker touches only while no tracked copy runs, a fraction (1 - d) of the time
# with duty d = min(1, w / b_pin): v_s = r (1 - d), copies into ready memory run at b_pin.
# While the pool warms up, a fraction f = min(1, v / w) of the written bytes lands in ready
# memory and the rest in pageable memory, so the copy time per written byte is
#   t(v, b) = f / b + (1 - f) / b_page.
# "auto" picks sequential only when t(v_s, b_pin) < t(v_c, b_pin_busy): a slow write rate and
# copies that suffer from touching. Sequential needs copies to be tracked (``track_copy``;
# the stores do it, NOTE [ Lazy host pool ] Rule 7); untracked, it behaves as concurrent.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from torchckpt._errors import CheckpointError
from torchckpt._native import native_host_pool
from torchckpt.memory.node_lock import default_lock_path
from torchckpt.memory.sysinfo import device_index, page_bytes

__all__ = ["LinkProfile", "cached_profile", "choose_strategy", "measure_link_profile"]

_MiB = 1 << 20
_REGISTERED = 2  # the native pool's chunk state once registered (csrc/host_pool.cpp)


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """Bandwidths (bytes/s) the strategy model uses (NOTE [ Lazy pool strategy model ])."""

    pinned_d2h: float
    pinned_busy_d2h: float
    touched_d2h: float
    untouched_d2h: float
    touch_rate: float
    register_rate: float

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not v > 0:
                raise ValueError(f"torchckpt: LinkProfile.{f.name} must be a positive rate in bytes/s, got {v}.")

    @property
    def ready_rate(self) -> float:
        """Bytes/s the background worker makes pinned (touch, then register)."""
        return 1.0 / (1.0 / self.touch_rate + 1.0 / self.register_rate)


def choose_strategy(profile: LinkProfile, write_rate: float | None = None) -> str:
    """The model of NOTE [ Lazy pool strategy model ]: ``"concurrent"`` or ``"sequential"``.

    Args:
        profile: measured bandwidths (``measure_link_profile``).
        write_rate: checkpoint bytes written per second (``None``: half the pinned D2H bandwidth).

    Returns:
        The strategy with the smaller modelled copy time per written byte (ties: concurrent).

    Example::

        >>> G = 1e9
        >>> choose_strategy(LinkProfile(55 * G, 50 * G, 13 * G, 2 * G, 40 * G, 400 * G))
        'concurrent'
        >>> choose_strategy(LinkProfile(55 * G, 10 * G, 13 * G, 2 * G, 40 * G, 400 * G), write_rate=1 * G)
        'sequential'
    """
    w = write_rate if write_rate is not None else profile.pinned_d2h / 2
    if not w > 0:
        raise ValueError(f"torchckpt: write_rate must be positive bytes/s, got {write_rate}.")
    r = profile.ready_rate

    def per_byte(v: float, b: float) -> float:
        f = min(1.0, v / w)
        return f / b + (1.0 - f) / profile.touched_d2h

    duty = min(1.0, w / profile.pinned_d2h)
    t_con = per_byte(r, profile.pinned_busy_d2h)
    t_seq = per_byte(r * (1.0 - duty), profile.pinned_d2h)
    return "sequential" if t_seq < t_con else "concurrent"


_profiles: dict[int, LinkProfile] = {}
_profile_lock = threading.Lock()


def measure_link_profile(device: int | torch.device | None = None, nbytes: int = 16 * _MiB) -> LinkProfile:
    """Measure the bandwidths of NOTE [ Lazy pool strategy model ] on ``device`` (cached per device).

    Args:
        device: a CUDA device (``None``: the current one).
        nbytes: bytes per timed copy.

    Returns:
        A ``LinkProfile``.

    Example::

        >>> if torch.cuda.is_available() and host_pool_can_register():  # doctest: +SKIP
        ...     measure_link_profile().pinned_d2h > 0
        True
    """
    if not torch.cuda.is_available():
        raise CheckpointError("torchckpt: measure_link_profile needs CUDA; torch.cuda.is_available() is False.")
    idx = device_index(device)
    dev = torch.device("cuda", idx)
    with _profile_lock:
        if idx in _profiles:
            return _profiles[idx]

    def native(nbytes: int, chunk: int, mode: str, lock: bool, lock_path: str, device: int, limit: int) -> Any:
        return native_host_pool(nbytes=nbytes, chunk_bytes=chunk, first_chunk_bytes=chunk, strategy="concurrent",
                                register_mode=mode, node_lock=lock, lock_path=lock_path, device=device,
                                huge_pages=True, touch_threads=1, populate=True, touch_limit=limit,
                                fake_register_us=0)

    nbytes = -(-nbytes // page_bytes()) * page_bytes()
    lock = default_lock_path()
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)

    def d2h(dst: torch.Tensor) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record(stream)
            dst.copy_(src, non_blocking=True)
            b.record(stream)
        b.synchronize()
        return nbytes / max(a.elapsed_time(b) * 1e-3, 1e-9)

    # A small registered pool: touch and register rates, and pinned D2H into it.
    pinned = native(2 * nbytes, nbytes, "cuda", True, lock, idx, -1)
    pinned.wait_done(-1)
    st = pinned.stats()
    pt = pinned.tensor()
    ok = all(s == _REGISTERED for s in pinned.states())
    b_pin = max(d2h(pt[:nbytes]) for _ in range(3)) if ok else 0.0
    # Untouched, then touched pageable memory (the worker never touches: touch limit 0).
    cold = native(nbytes, nbytes, "none", False, "", idx, 0)
    ct = cold.tensor()
    b_untouched = d2h(ct)
    b_touched = max(d2h(ct) for _ in range(2))
    # Pinned D2H while another worker touches fresh pages.
    busy = native(256 * _MiB, 64 * _MiB, "none", False, "", idx, -1)
    b_busy = min(d2h(pt[:nbytes]) for _ in range(3)) if ok else 0.0
    busy.close()
    del pt, ct, cold, busy
    pinned.close()
    del pinned
    if not ok:  # registration refused: the model has nothing to choose between
        b_pin = b_busy = b_touched
    prof = LinkProfile(
        pinned_d2h=b_pin,
        pinned_busy_d2h=b_busy,
        touched_d2h=b_touched,
        untouched_d2h=b_untouched,
        touch_rate=2 * nbytes / max(st["touch_s"], 1e-9),
        register_rate=2 * nbytes / max(st["register_s"], 1e-9),
    )
    with _profile_lock:
        _profiles[idx] = prof
    return prof


def cached_profile(index: int) -> LinkProfile | None:
    """The profile ``measure_link_profile`` measured for device ``index``, if it has."""
    with _profile_lock:
        return _profiles.get(index)
