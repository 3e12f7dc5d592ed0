"""The mover: every copy between device and host memory that the stores make.

# NOTE [ Mover ]
# ``Store`` (saved tensors) and ``SnapshotStore`` (snapshots) copy through one ``Mover``.
# 1. On CUDA it owns two dedicated streams: ``offload`` (device to host) and ``prefetch``
#    (host to device). A copy first makes its stream wait for the compute stream (the data
#    it reads was written there, and a buffer it writes may still be read there) and for
#    the events the caller names; it then records an event that its consumers wait on.
# 2. Consumers wait on the device, never on the host: ``wait(event)`` makes the compute
#    stream wait. With ``timing`` it returns an event recorded just before the wait, so that
#    ``need.elapsed_time(done)`` is how late the copy was (the stores' lateness figures).
# 3. After every copy to or from host memory the host pool hears of it
#    (``HostPool.note_copy``): the lazy pool tracks copies while it still pins memory.
# 4. Every copy runs inside an NVTX range named ``torchckpt.<what>`` (visible in Nsight
#    Systems); ranges are pushed only when CUDA is available.
# 5. On the CPU (the simulated two-tier store) copies are synchronous, events are ``None``,
#    and ``wait`` does nothing.
# 6. A third stream, ``sizes``, carries the few bytes of compressed sizes the snapshot store reads
#    back (``read_back``, NOTE [ Snapshot sizes ] Rule 1), behind the compute stream's current
#    work and never behind a flush, so a size is on the host as soon as its compression has run;
#    and ``place``, which writes a settled snapshot's buffers into its slot (a device-to-device
#    copy) after the events it is given only, not after the compute stream's later work nor
#    behind the flushes (NOTE [ Snapshot sizes ] Rule 2). ``to_host(..., after=place's event,
#    after_compute=False)`` then flushes the slot. What ``Codec.settle`` queues on the device (TritonQuant
#    gathers its raw blocks) runs on this stream too (``on_sizes``), before the ``place`` that reads it:
#    queued on the compute stream, behind the steps queued since the save, ``place`` (waiting for the save's
#    events only) had read its output before it was written (on an H100, zCut's image with deferred sizes
#    differed from the exact path's, 84.7 against 116.9 dB).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from torchckpt._streams import copier, current, index, on
from torchckpt.codecs.base import Codec, Packed
from torchckpt.codecs.blob import Blob

__all__ = ["Mover", "nvtx_range", "timed_wait"]

_NVTX = torch.cuda.is_available()


class _Range:
    """An NVTX range as a context manager (a class: no generator per range, as ``contextlib.contextmanager`` makes)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        torch.cuda.nvtx.range_push(self.name)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.nvtx.range_pop()


_NO_RANGE = contextlib.nullcontext()  # reusable: what every range is without CUDA


def nvtx_range(name: str, n: int | None = None) -> contextlib.AbstractContextManager[None]:
    """Mark ``name`` (with ``n``: ``f"{name} {n}"``, formatted only when ranges are pushed) as an NVTX range on the
    calling thread (no-op without CUDA; NOTE [ Mover ] Rule 4).

    Example::

        >>> with nvtx_range("torchckpt.save", 3):
        ...     pass
    """
    if not _NVTX:
        return _NO_RANGE
    return _Range(name if n is None else f"{name} {n}")


def _read_on(s: Any, tensors: Iterable[torch.Tensor]) -> None:
    """``tensors`` (allocated on another stream) kept from reuse until ``s``'s work queued so far has read them (an
    empty one is not read)."""
    for t in tensors:
        if t.numel():
            t.record_stream(s)


def timed_wait(stream: Any, done: Any, timing: bool) -> Any:
    """Make ``stream`` wait for the event ``done`` on the device; with ``timing``, return an event
    recorded on ``stream`` just before the wait (NOTE [ Mover ] Rule 2)."""
    need = None
    if timing:
        need = torch.cuda.Event(enable_timing=True)
        need.record(stream)
    stream.wait_event(done)
    return need


class Mover:
    """Copies between device and host for the stores (NOTE [ Mover ]).

    Args:
        device: the store's device; ``cpu`` simulates both tiers with synchronous copies.
        timing: record timing events so that late copies can be measured (CUDA only).
        host: the host pool whose memory the copies read and write (told of each copy).

    Example::

        >>> m = Mover(torch.device("cpu"))
        >>> dst = torch.empty(3)
        >>> m.to_host(dst, torch.arange(3.0)) is None, dst
        (True, tensor([0., 1., 2.]))
    """

    def __init__(self, device: torch.device, timing: bool = False, host: Any = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.timing = bool(timing) and self.cuda
        self.host = host
        self.delay: Callable[[str, Any], None] | None = None  # test hook: runs on the copy stream before each copy
        self.offload: Any = torch.cuda.Stream(device) if self.cuda else None
        self.prefetch: Any = torch.cuda.Stream(device) if self.cuda else None
        self.sizes: Any = torch.cuda.Stream(device) if self.cuda else None  # NOTE [ Mover ] Rule 6
        self._idx = index(device) if self.cuda else -1  # the device of its streams (NOTE [ Cheap streams ] Rule 3)

    # -- the compute stream ---------------------------------------------------------------
    def current(self) -> Any:
        return current(self._idx)  # NOTE [ Cheap streams ] Rule 1

    def record(self) -> Any:
        """An event at the compute stream's current position (``None`` on the CPU)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.current())
        return ev

    def wait(self, done: Any) -> Any:
        """The compute stream waits for ``done``; returns a timing event, or ``None`` (NOTE [ Mover ] Rule 2)."""
        if not self.cuda or done is None:
            return None
        return timed_wait(self.current(), done, self.timing)

    def drain(self) -> None:
        """The compute stream waits for every copy issued so far."""
        if self.cuda:
            cur = self.current()
            cur.wait_stream(self.offload)
            cur.wait_stream(self.prefetch)
            cur.wait_stream(self.sizes)  # the slot writes of settled snapshots (NOTE [ Captured saves ] Rule 8)

    def keep_alive(self, t: torch.Tensor) -> None:
        """Keep ``t``'s memory from reuse until the copies issued so far on the copy streams are done."""
        if self.cuda:
            t.record_stream(self.offload)
            t.record_stream(self.prefetch)
            t.record_stream(self.sizes)

    # -- copies --------------------------------------------------------------------------
    def _event(self, stream: Any) -> Any:
        ev = torch.cuda.Event(enable_timing=self.timing)
        ev.record(stream)
        return ev

    def _heard(self, stream: Any) -> None:
        if self.host is not None:
            self.host.note_copy(stream)  # NOTE [ Mover ] Rule 3

    def _copy(self, s: Any, kind: str, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Issue ``dst.copy_(src)`` on stream ``s`` (its waits already queued); its event
        (NOTE [ Mover ] Rules 1, 3, 4)."""
        with on(s), nvtx_range("torchckpt." + kind):
            if self.delay is not None:
                self.delay(kind, s)
            dst.copy_(src, non_blocking=True)
            ev = self._event(s)
        self._heard(s)
        return ev

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None, after_compute: bool = True) -> Any:
        """Copy ``src`` into host memory ``dst`` on the offload stream, after ``after`` (and, unless
        ``after_compute`` is False, the compute stream's work so far); returns its event."""
        if not self.cuda:
            dst.copy_(src)
            return None
        s = self.offload
        if after_compute:
            s.wait_stream(self.current())
        if after is not None:
            s.wait_event(after)
        return self._copy(s, "d2h", dst, src)

    def to_device(self, src: torch.Tensor, nbytes: int, after: Any) -> tuple[torch.Tensor, Any, Any]:
        """Copy host bytes ``src`` into a new device buffer on the prefetch stream, after ``after``.

        Returns the buffer, the copy's event and the compute stream the buffer was allocated on
        (``None``, ``None`` on the CPU, where the buffer is a clone).
        """
        if not self.cuda:
            return src.clone(), None, None
        cur = self.current()
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)  # allocated on cur
        s = self.prefetch
        s.wait_stream(cur)
        if after is not None:
            s.wait_event(after)
        return buf, self._copy(s, "h2d", buf, src), cur

    def fill(self, dst: torch.Tensor, src: torch.Tensor, after: Iterable[Any] = (), after_all: bool = False) -> Any:
        """Copy host bytes ``src`` into the existing device buffer ``dst`` on the prefetch stream.

        The copy waits for the events ``after`` (``None`` entries are skipped), and with ``after_all`` for
        everything issued on the compute stream so far. Returns its event (``None`` on the CPU).
        """
        if not self.cuda:
            dst.copy_(src)
            return None
        p = self.prefetch
        self._wait_for(p, after, after_all)
        return self._copy(p, "h2d", dst, src)

    def read_back(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Any:
        """Copy the few device bytes ``src`` into pinned ``dst`` on the sizes stream, after the compute stream's
        work so far (``after``: an event recorded there after ``src`` was written, which saves recording another);
        returns its event (NOTE [ Mover ] Rule 6)."""
        if not self.cuda:
            dst.copy_(src)
            return None
        s = self.sizes
        if after is None:
            s.wait_stream(self.current())
        else:
            s.wait_event(after)
        with on(s):
            if self.delay is not None:
                self.delay("sizes", s)
            dst.copy_(src, non_blocking=True)
            src.record_stream(s)
            ev = torch.cuda.Event()
            ev.record(s)
        return ev

    def on_sizes(self, after: Any, reads: Iterable[torch.Tensor]) -> contextlib.AbstractContextManager[Any]:
        """Work queued inside runs on the sizes stream after the event ``after``; ``reads`` (allocated on the compute
        stream) are kept for it (NOTE [ Mover ] Rule 6: a settle's own kernels, which ``place`` then follows)."""
        if not self.cuda:
            return contextlib.nullcontext()
        s = self.sizes
        self._wait_for(s, (after,))
        _read_on(s, reads)
        return on(s)

    def place(self, dst: torch.Tensor, blob: Blob, packs: Sequence[Packed], after: Iterable[Any] = (),
              after_all: bool = False, owned: bool = False) -> Any:
        """Write ``packs`` into the device buffer ``dst`` at ``blob``'s offsets on the sizes stream, after the
        events ``after`` (``None`` entries skipped) and, with ``after_all``, the compute stream's work so far;
        returns its event (NOTE [ Mover ] Rule 6). ``owned``: the buffers of ``packs`` outlive the mover's work
        (NOTE [ Captured saves ] Rule 8), so none is recorded on the sizes stream."""
        if not self.cuda:
            blob.write(dst, packs)
            return None
        s = self.sizes
        self._wait_for(s, after, after_all)
        with on(s), nvtx_range("torchckpt.place"):
            if self.delay is not None:
                self.delay("place", s)
            raw = copier() if dst.is_cuda else None
            if raw is None:
                blob.write(dst, packs, non_blocking=True)
            else:  # NOTE [ Cheap streams ] Rule 6
                blob.write_raw(dst, packs, raw, s)
            if not owned:
                _read_on(s, (b for p in packs for b in p.buffers))  # allocated on the compute stream, read here
            return self._event(s)

    def _wait_for(self, s: Any, after: Iterable[Any], after_all: bool = False) -> None:
        """Stream ``s`` waits for the events ``after`` (``None`` entries skipped) and, with ``after_all``, for the
        compute stream's work so far."""
        for ev in after:
            if ev is not None:
                s.wait_event(ev)
        if after_all:
            s.wait_stream(self.current())

    def to_host_packed(self, codec: Codec, x: torch.Tensor, alloc: Callable[[int], Any]) -> tuple[Any, Blob, Any]:
        """Compress ``x`` on the offload stream and copy the result into a new host block from ``alloc``.

        Each packed buffer is copied straight to its place in the block; the buffers were allocated on
        the offload stream, so their memory is reused only after these copies. Returns the block, its
        layout and the event of the last copy.
        """
        if not self.cuda:
            p = codec.compress(x)
            blob = Blob([p])
            block = alloc(blob.nbytes)
            blob.write(block.tensor, [p])
            return block, blob, None
        s = self.offload
        s.wait_stream(self.current())
        with on(s), nvtx_range("torchckpt.compress+d2h"):
            if self.delay is not None:
                self.delay("d2h", s)
            p = codec.compress(x, stream=s)
            blob = Blob([p])
            block = alloc(blob.nbytes)
            blob.write(block.tensor, [p], non_blocking=True)
            ev = self._event(s)
        self._heard(s)
        return block, blob, ev

    def to_device_packed(self, codec: Codec, blob: Blob, src: torch.Tensor, nbytes: int, dtype: torch.dtype,
                         after: Any) -> tuple[torch.Tensor, Any, Any]:
        """Copy a compressed entry back (``to_device``) and decompress it on the prefetch stream."""
        if not self.cuda:
            out = torch.empty(nbytes, dtype=torch.uint8)
            codec.decompress(blob.read(src)[0], out=out.view(dtype))
            return out, None, None
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)  # on cur, before to_device's wait
        staged, _, cur = self.to_device(src, src.numel(), after)
        s = self.prefetch
        with on(s), nvtx_range("torchckpt.decompress"):
            codec.decompress(blob.read(staged)[0], out=out.view(dtype), stream=s)
            staged.record_stream(s)  # allocated on cur, read here
            ev = self._event(s)
        return out, ev, cur
