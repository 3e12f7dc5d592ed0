"""``Scratch``: the buffers ``compress_deferred`` borrows and the caller gives back after events (NOTE [ Codec streams ]
Rule 5), and TritonQuant's raw rows lent from it (NOTE [ Block quantization ] Rule 7): a buffer is handed out again
only once every event it was given back with has completed, consecutive deferred compressions of one size allocate
one buffer, and a buffer lent again (holding an earlier tensor's rows) gives the bytes and bits of a fresh one."""
from __future__ import annotations

import copy
import gc
import importlib.util
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from torchckpt.codecs import TritonQuant
from torchckpt.codecs.base import Scratch

from test_deferred import adversarial, check_deferred, same_bits, same_packed

CPU = torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeEvent:
    """An event whose completion the test decides; counts how often it was asked."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


def test_a_buffer_is_not_handed_out_again_before_its_events_complete() -> None:
    s = Scratch()
    a = s.take(4096, CPU)
    first, second = FakeEvent(), FakeEvent()
    assert s.give([a], after=[first, None, second]) == 1
    b = s.take(4096, CPU)  # both pending: a new buffer
    assert b is not a and s.made == 2 and s.reused == 0
    first.done = True
    c = s.take(4096, CPU)  # one still pending
    assert c is not a and s.made == 3
    second.done = True
    assert s.take(4096, CPU) is a and s.reused == 1
    assert s.idle == 0


def test_completed_events_are_not_asked_again_and_the_oldest_ready_comes_first() -> None:
    s = Scratch()
    bufs = [s.take(64, CPU) for _ in range(3)]
    evs = [FakeEvent() for _ in bufs]
    for b, ev in zip(bufs, evs):
        s.give([b], after=[ev])
    evs[1].done = evs[2].done = True
    assert s.take(64, CPU) is bufs[1]  # the oldest whose events completed
    assert evs[2].queries == 0  # not reached
    evs[0].done = True
    assert s.take(64, CPU) is bufs[0]
    q = evs[2].queries
    assert s.take(64, CPU) is bufs[2] and evs[2].queries == q + 1


def test_only_the_same_size_and_device_is_reused() -> None:
    s = Scratch()
    a = s.take(100, CPU)
    s.give([a], after=[])
    b = s.take(200, CPU)
    assert b is not a and b.numel() == 200 and b.dtype == torch.uint8
    assert s.take(100, CPU) is a


def test_only_lent_buffers_come_back_once() -> None:
    s = Scratch()
    a = s.take(16, CPU)
    assert s.give([torch.empty(16, dtype=torch.uint8), a[:0], a.view(torch.int32)], after=[]) == 0  # not lent
    assert s.give([a, a], after=[]) == 1 and s.give([a], after=[]) == 0 and s.idle == 1


def test_idle_buffers_are_bounded_oldest_dropped_first_and_cleared() -> None:
    s = Scratch(keep=2)
    bufs = [s.take(32, CPU) for _ in range(4)]
    s.give(bufs, after=[])
    assert s.idle == 2 and s.dropped == 2
    assert s.take(32, CPU) is bufs[2] and s.take(32, CPU) is bufs[3]
    s.give(bufs[2:], after=[])
    s.clear()
    assert s.idle == 0 and s.dropped == 4
    assert Scratch(keep=0).give([Scratch(keep=0).take(8, CPU)], after=[]) == 0  # another pool's buffer
    z = Scratch(keep=0)
    assert z.give([z.take(8, CPU)], after=[]) == 1 and z.idle == 0 and z.dropped == 1
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="torchckpt: Scratch"):
            Scratch(keep=bad)  # type: ignore[arg-type]


def test_lent_buffers_are_held_weakly() -> None:
    """A caller that never gives back: its buffers die with it (new ones are allocated, as without a pool)."""
    s = Scratch()
    for _ in range(100):
        s.take(1 << 10, CPU)
    gc.collect()
    assert len(s._lent) == 0 and len(s._key_of) <= 16 + 2
    a = s.take(1 << 10, CPU)
    assert s.give([a], after=[]) == 1


def test_pickles_and_copies_empty() -> None:
    s = Scratch(keep=3)
    s.give([s.take(8, CPU)], after=[])
    for t in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert isinstance(t, Scratch) and t.keep == 3 and t.idle == 0 and t.made == 0
    c = copy.deepcopy(TritonQuant(4, "abs", 1e-2))
    assert c.scratch is not None and c.scratch.idle == 0


# -- TritonQuant's raw rows (NOTE [ Block quantization ] Rule 7) -----------------------------------------------------
def give_back(c: TritonQuant, d: object, after: list[object] | None = None) -> int:
    assert c.scratch is not None
    return c.scratch.give(d.packed.buffers, after or [])  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_consecutive_deferred_compressions_allocate_one_buffer(dtype: torch.dtype) -> None:
    """N deferred compressions of one size, each settled and given back: one buffer, lent N times; every one settles
    to compress's bytes and decodes to its bits (before and after the next one reused its buffer)."""
    c = TritonQuant(8, "abs", 1e-3)
    assert c.scratch is not None and c.scratch.made == 0
    for k in range(12):
        x = adversarial(5000, dtype, seed=k)
        p = c.compress(x)
        d = c.compress_deferred(x)
        assert d.packed.buffers[3].untyped_storage().nbytes() == -(-5000 // 256) * 256 * x.element_size()
        s = c.settle(d, d.sizes.tolist())  # type: ignore[union-attr]
        assert same_packed(s, p)
        assert all(b.numel() == 0 or b.untyped_storage().data_ptr() != d.packed.buffers[3].data_ptr()
                   for b in s.buffers)  # the settled Packed views none of the lent rows
        assert give_back(c, d) == 1
        assert same_bits(c.decompress(s), c.decompress(p))
    assert c.scratch.made == 1 and c.scratch.reused == 11


def test_pending_events_keep_the_raw_rows_from_the_next_compression() -> None:
    c = TritonQuant(4, "abs", 1e-2)
    x = adversarial(3000, torch.float32)
    d0 = c.compress_deferred(x)
    ev = FakeEvent()
    give_back(c, d0, [ev])
    d1 = c.compress_deferred(x)
    assert d1.packed.buffers[3] is not d0.packed.buffers[3]  # d0's rows may still be read
    check_deferred(c, x)
    ev.done = True
    give_back(c, d1)
    d2 = c.compress_deferred(adversarial(3000, torch.float32, seed=5))
    assert d2.packed.buffers[3] is d0.packed.buffers[3]


def test_no_raw_block_settles_to_buffers_of_their_own() -> None:
    c = TritonQuant(8, "abs", 0.1)
    d = c.compress_deferred(torch.linspace(-1, 1, 4096))
    s = c.settle(d, d.sizes.tolist())  # type: ignore[union-attr]
    assert s.meta.params["raw_blocks"] == 0
    rows = d.packed.buffers[3]
    assert all(b.untyped_storage() is not rows.untyped_storage() and b.untyped_storage().nbytes() == 0
               for b in s.buffers[2:])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_reused_raw_rows_give_fresh_bytes_in_interpreter() -> None:
    """The Triton path (triton's CPU interpreter; ``_triton`` forced on for CPU tensors): its kernel writes the raw
    blocks' rows only, so a buffer lent again still holds an earlier tensor's rows elsewhere; each compression still
    settles to the reference's ``compress`` bytes and decodes (deferred and settled) to its bits. The earlier rows are
    checked to be there, so the test is not vacuous."""
    script = textwrap.dedent("""
        import torch
        from tests.codecs.test_deferred import adversarial, same_bits, same_packed
        from torchckpt.codecs import TritonQuant
        for dt in (torch.float32, torch.float16):
            for B in (64, 256):
                c = TritonQuant(8, "abs", 1e-3, block=B)
                c._triton = lambda device: True  # the kernels, on the CPU, in the interpreter
                ref = TritonQuant(8, "abs", 1e-3, block=B, use_triton=False)
                first = None
                stale = 0
                for k, n in enumerate((5000, 5000, 5000, 4999)):
                    x = adversarial(n, dt, seed=k) if k != 1 else torch.full((n,), float("nan"), dtype=dt)
                    if k == 2:
                        x = torch.linspace(-1, 1, n).to(dt)
                        x[::700] = float("inf")  # a few raw blocks, the rest quantized: rows left from k = 1
                    d = c.compress_deferred(x)
                    rows = d.packed.buffers[3]
                    first = rows if first is None else first
                    assert rows is first, (dt, B, k)  # lent again
                    p = ref.compress(x)
                    want = ref.decompress(p)
                    assert same_bits(c.decompress(d.packed), want), (dt, B, k)
                    s = c.settle(d, d.sizes.tolist())
                    assert same_packed(s, p), (dt, B, k)
                    assert same_bits(c.decompress(s), want), (dt, B, k)
                    if k == 2:  # rows of quantized blocks still hold k = 1's NaNs
                        nb = -(-n // B)
                        r = rows.view(x.dtype).view(nb, B)
                        quantized = s.buffers[1].view(torch.float32).view(nb, -1)[:, -1] >= 0
                        stale = int(torch.isnan(r[quantized]).all(1).sum())
                    assert c.scratch.give(d.packed.buffers, []) == 1
                assert stale > 0, (dt, B)
                assert c.scratch.made == 1, c.scratch.made
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
