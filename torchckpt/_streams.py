"""Stream switching for the per-action paths (the store's copies, the codecs' launches), without ``torch.cuda``'s
per-call device lookups.

# NOTE [ Cheap streams ]
# On a host-bound adjoint (issue 26: the RTM's compressed runs with captured saves and steps, where the host's Python
# per action is as long as the device's work) ``torch.cuda.stream(s)`` and ``torch.cuda.current_stream(device)``
# were 22% of the host's profiled time: each looks the current device up through ``torch.cuda``'s
# device-attribute helpers (an environment read and ``is_available`` per call), 2900 and 9036 times in one zCut run.
# 1. ``current(index)`` is ``torch.cuda.current_stream`` with the device as an ``int``: the raw handle of the current
#    stream is read (one call into torch, no Python object made) and the ``Stream`` object made for that handle last
#    time is given again; a new one is made only when the handle differs. (``torch.cuda.current_stream`` builds a
#    new ``Stream`` through its Python ``__new__`` at every call: 9028 calls, 64 ms of a 0.82 s cProfile of the
#    RTM's zCut run with captured saves and steps on an H100.) A handle names one stream: torch never destroys the
#    streams of its pools, and a ``Stream`` object is only a handle and its ids.
# 2. ``on(stream)`` selects ``stream`` as ``torch.cuda.stream(stream)`` does, and restores the stream it replaced on
#    exit. When the current device is not the stream's, it is ``torch.cuda.stream(stream)`` itself (which switches
#    the device's stream without changing the current device).
# 3. ``index(device)``: a CUDA device's index (``None``: the current device's), once, where a mover or a codec call
#    starts, so that the per-action calls pass an ``int``.
# 4. ``on_device(device)`` is ``torch.cuda.device(device)``, or nothing when ``device`` is the current device already
#    (the common case: no device guard built per call).
# 5. Inside these, the current device and the stream switch are torch's own calls under ``torch.cuda.current_device``
#    and ``torch.cuda.set_stream`` (``torch._C._cuda_getDevice``, ``torch._C._cuda_setStream``), without their Python
#    wrappers' lazy-initialisation checks: a ``Stream`` or a CUDA device in hand means CUDA is initialised.
# 6. ``copier()`` gives ``copy_bytes(dst_ptr, src_ptr, nbytes, stream)``: one ``cudaMemcpyAsync`` on ``stream``, called
#    through ctypes into the CUDA runtime torch loaded (``libcudart.so.<major>``, by its name: the library the process
#    has loaded already), for the slot writes of settled snapshots
#    (``Blob.write_raw``, ``Mover.place``). A ``flat[off:off + n].copy_(src)`` is a slice, a strided view and a copy
#    through torch's dispatcher per buffer, each with its Python and dispatch cost and, in a trace, its record: in the
#    traced zCut run of the RTM (Bitcomp, captured saves and steps, H100) ``aten::copy_`` fell from 1920 calls to 8
#    and ``aten::slice`` from 5822 to 3862, the profile's recorded host calls from 54775 to 49475
#    (docs/notes/2026-11-27-raw-slot-writes-h100.md).
#    Byte copies between allocations torch owns change no tensor metadata; the caller keeps the buffers alive as it
#    did for ``copy_`` (``record_stream``, or buffers that outlive the stream's work). A runtime error raises
#    ``CheckpointError`` with its name; ``copier()`` is ``None`` where the runtime is not found (no CUDA build), and
#    the callers then use ``copy_`` (the same bytes).
"""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from typing import Any

import torch

from torchckpt._errors import CheckpointError

__all__ = ["copier", "current", "index", "on", "on_device"]

_SAME_DEVICE = contextlib.nullcontext()  # reusable
_CURRENT: dict[int, Any] = {}  # per device: the Stream of the handle last seen (NOTE [ Cheap streams ] Rule 1)


def index(device: torch.device | int | None) -> int:
    """The index of CUDA ``device`` (``None`` or an index-less ``cuda``: the current device) (NOTE [ Cheap streams ]
    Rule 3)."""
    if isinstance(device, int):
        return device
    if device is None or device.index is None:
        return torch.cuda.current_device()
    return device.index


def on_device(device: torch.device) -> Any:
    """``torch.cuda.device(device)`` for CUDA ``device``, or a shared null context when it is the current device
    (NOTE [ Cheap streams ] Rules 4-5)."""
    return _SAME_DEVICE if torch._C._cuda_getDevice() == device.index else torch.cuda.device(device)


def current(idx: int) -> Any:
    """The current stream of device ``idx`` (NOTE [ Cheap streams ] Rule 1)."""
    raw = torch._C._cuda_getCurrentRawStream(idx)
    s = _CURRENT.get(idx)
    if s is None or s.cuda_stream != raw:
        s = _CURRENT[idx] = torch.cuda.current_stream(idx)
    return s


class on:  # noqa: N801 - used as ``with on(stream):``, like ``torch.cuda.stream``
    """``torch.cuda.stream(stream)`` without its device lookups (NOTE [ Cheap streams ] Rule 2).

    Example::

        >>> import torch
        >>> if torch.cuda.is_available():
        ...     s = torch.cuda.Stream()
        ...     with on(s):
        ...         assert torch.cuda.current_stream() == s
    """

    __slots__ = ("stream", "_prev", "_full")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._prev: Any = None
        self._full: Any = None

    def __enter__(self) -> None:
        s = self.stream
        if torch._C._cuda_getDevice() != s.device_index:  # NOTE [ Cheap streams ] Rule 5
            self._full = torch.cuda.stream(s)
            self._full.__enter__()
            return
        self._prev = current(s.device_index)
        _set(s)

    def __exit__(self, *exc: object) -> None:
        if self._full is not None:
            self._full.__exit__(*exc)
            self._full = None
            return
        _set(self._prev)
        self._prev = None


def _set(s: Any) -> None:
    """``torch.cuda.set_stream(s)`` for a ``Stream`` ``s`` (NOTE [ Cheap streams ] Rule 5)."""
    torch._C._cuda_setStream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
_COPIER: list[Callable[[int, int, int, Any], None] | None] = []  # found once (NOTE [ Cheap streams ] Rule 6)


def copier() -> Callable[[int, int, int, Any], None] | None:
    """``copy_bytes(dst_ptr, src_ptr, nbytes, stream)``: one ``cudaMemcpyAsync`` on ``stream`` (a ``Stream``), or
    ``None`` where torch's CUDA runtime is not found (NOTE [ Cheap streams ] Rule 6)."""
    if not _COPIER:
        _COPIER.append(_load_copier())
    return _COPIER[0]


def _load_copier() -> Callable[[int, int, int, Any], None] | None:
    major = (torch.version.cuda or "").split(".")[0]
    if not major:
        return None
    try:
        lib = ctypes.CDLL(f"libcudart.so.{major}")  # the one torch loaded: the same library object, by its name
    except OSError:
        return None
    memcpy = lib.cudaMemcpyAsync
    memcpy.restype = ctypes.c_int
    memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    name = lib.cudaGetErrorName
    name.restype = ctypes.c_char_p
    name.argtypes = [ctypes.c_int]
    return _make_copier(memcpy, name)


def _make_copier(memcpy: Callable[..., int],
                 name: Callable[[int], bytes | None]) -> Callable[[int, int, int, Any], None]:
    """``copy_bytes`` over the runtime's ``cudaMemcpyAsync`` and ``cudaGetErrorName`` (the tests pass fakes)."""

    def copy_bytes(dst: int, src: int, nbytes: int, stream: Any) -> None:
        rc = memcpy(dst, src, nbytes, _MEMCPY_DEFAULT, stream.cuda_stream)
        if rc:
            raise CheckpointError(
                f"torchckpt: cudaMemcpyAsync of {nbytes} bytes failed with {(name(rc) or b'?').decode()} ({rc}): the "
                "CUDA runtime refused the copy (an error left by earlier device work shows here too: run with "
                "CUDA_LAUNCH_BLOCKING=1 to find where it started).")

    return copy_bytes
