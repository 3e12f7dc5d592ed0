"""CUDA: NOTE [ Cheap streams ]: ``on(stream)`` selects a stream and gives the one it replaced back, as
``torch.cuda.stream`` does (nested, and when the body raises); ``current(index)`` is the current stream.

    python -m pytest -q -p no:cacheprovider tests/test_streams_cuda.py
"""
from __future__ import annotations

import pytest
import torch

from torchckpt._streams import current, index, on
from torchckpt.store.streams import Mover

pytestmark = pytest.mark.cuda


def test_on_selects_the_stream_and_gives_the_old_one_back() -> None:
    base = torch.cuda.current_stream()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    with on(a):
        assert torch.cuda.current_stream() == a
        with on(b):
            assert torch.cuda.current_stream() == b and current(index(None)) == b
        assert torch.cuda.current_stream() == a
    assert torch.cuda.current_stream() == base
    i = index(None)
    assert current(i) is current(i) and current(i) == base  # NOTE [ Cheap streams ] Rule 1: one object per handle
    with torch.cuda.stream(b):  # switched outside `on`: the handle differs, a new object is made
        assert current(i) == b
    assert current(i) == base
    with pytest.raises(RuntimeError, match="inside"):
        with on(a):
            raise RuntimeError("inside")
    assert torch.cuda.current_stream() == base


def test_work_queued_inside_runs_on_the_stream() -> None:
    """A kernel queued inside ``on(s)`` is ordered by ``s``, not by the stream current outside: while ``s`` still
    spins, the outer stream is idle and an event recorded on ``s`` is not done. A sleep kernel has been seen to finish
    at once in a fresh process (twice on H100 and H200), so the spin is tried longer up to three times; had ``on``
    left the sleep on the outer stream, ``s`` would be empty and every try would fail."""
    s = torch.cuda.Stream()
    outer = torch.cuda.current_stream()
    x = torch.zeros(1 << 20, device="cuda")
    held = False
    for cycles in (50_000_000, 400_000_000, 2_000_000_000):
        torch.cuda.synchronize()
        s.wait_stream(outer)
        with on(s):
            torch.cuda._sleep(cycles)
            x.add_(1)
            done = torch.cuda.Event()
            done.record(s)
        held = not done.query() and outer.query()
        if held:
            break
    assert held, "work inside on(s) did not stay queued on s behind the sleep"
    outer.wait_event(done)
    assert x[0].item() >= 1 and bool((x == x[0]).all())


def test_the_movers_compute_stream_is_the_current_one() -> None:
    m = Mover(torch.device("cuda"))
    s = torch.cuda.Stream()
    assert m.current() == torch.cuda.current_stream()
    with torch.cuda.stream(s):
        assert m.current() == s


def test_on_device_is_the_device_guard() -> None:
    """NOTE [ Cheap streams ] Rule 4: on the current device nothing changes; the device stays current inside."""
    from torchckpt._streams import on_device

    dev = torch.device("cuda", torch.cuda.current_device())
    with on_device(dev):
        assert torch.cuda.current_device() == dev.index
    assert torch.cuda.current_device() == dev.index
