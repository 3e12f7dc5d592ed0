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


@pytest.mark.parametrize("owned", [False, True])
def test_place_writes_the_bytes_copy_would(owned: bool) -> None:
    """NOTE [ Cheap streams ] Rule 6: a slot written through the runtime's byte copies holds what ``Blob.write``'s
    ``copy_`` writes, on the sizes stream, after its waits (a spin on the compute stream before the write's event)."""
    from torchckpt._streams import copier
    from torchckpt.codecs import Identity
    from torchckpt.codecs.blob import Blob

    assert copier() is not None, "torch's CUDA runtime was not found by name"
    c = Identity()
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(1000, device="cuda", generator=g), torch.randint(0, 9, (77,), device="cuda", generator=g),
          torch.randn(3, 5, device="cuda", generator=g).t()]  # the last is not contiguous: copy_ for it
    packs = [c.compress(x) for x in xs]
    blob = Blob(packs)
    want = torch.zeros(blob.nbytes + 512, dtype=torch.uint8, device="cuda")
    blob.write(want, packs)
    m = Mover(torch.device("cuda"))
    dst = torch.full((blob.nbytes + 512,), 7, dtype=torch.uint8, device="cuda")
    dst.zero_()
    torch.cuda._sleep(20_000_000)  # the compute stream busy: the write must still follow the zeroing (after_all)
    ev = m.place(dst, blob, packs, after_all=True, owned=owned)
    ev.synchronize()
    assert torch.equal(dst, want)
    got = [c.decompress(p) for p in blob.read(dst)]
    assert all(torch.equal(a, b) for a, b in zip(got, xs))
