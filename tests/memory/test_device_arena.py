"""Device arena on CPU: argument checks, capability messages, the fallback, and the Python
bookkeeping of ``DeviceArena`` / ``ArenaSlots`` over a stub of the native class."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import torchckpt._native as native
import torchckpt.memory.device_arena as da
from torchckpt._errors import CheckpointError
from torchckpt._native import native_available

GRAN = 4096


class FakeNative:
    """Mimics ``torch.classes.torchckpt.DeviceArena`` on CPU memory (NOTE [ VMM device arena ]).

    Chunks follow the native layout (NOTE [ VMM device arena ] Rule 2); nothing maps in the background: ``wait`` maps
    chunks in address order until its range is covered, as the native thread would, and
    ``progress`` maps one more chunk.
    """

    instances: list[FakeNative] = []

    def __init__(self, nbytes: int, device: int, chunk: int, first: int, background: bool, delay_us: int) -> None:
        self.init_err = "" if nbytes > 0 else f"torchckpt: DeviceArena expected nbytes > 0, found {nbytes}."
        self.device_index = device
        self._chunk = (chunk + GRAN - 1) // GRAN * GRAN
        self.reserved = (nbytes + GRAN - 1) // GRAN * GRAN
        self.nbytes = nbytes
        self.sizes: list[int] = []
        off = 0
        if first > 0:
            self.sizes.append(min((first + GRAN - 1) // GRAN * GRAN, self.reserved))
            off = self.sizes[0]
        while off < self.reserved:
            self.sizes.append(min(self._chunk, self.reserved - off))
            off += self.sizes[-1]
        self.mapped = len(self.sizes) if not background else (1 if first > 0 else 0)
        self.buf = torch.zeros(self.reserved, dtype=torch.uint8)
        self.fail_at: int | None = None
        self.is_closed = False
        self.waits: list[tuple[int, int]] = []
        FakeNative.instances.append(self)

    def _end(self, k: int) -> int:
        return sum(self.sizes[:k])

    def init_error(self) -> str:
        return self.init_err

    def progress(self) -> str:
        if self.fail_at is not None and self.mapped == self.fail_at:
            return "torchckpt: DeviceArena could not map chunk (fake out of memory)."
        self.mapped += 1
        return ""

    def wait(self, offset: int, n: int) -> str:
        self.waits.append((offset, n))
        if n == 0:
            return ""
        while self._end(self.mapped) < offset + n:
            err = self.progress()
            if err:
                return err
        return ""

    def wait_all(self) -> str:
        return self.wait(0, self.nbytes)

    def view(self, offset: int, n: int, wait: bool) -> torch.Tensor:
        assert not wait, "the wrapper waits itself (NOTE [ VMM device arena ] Rule 10)"
        assert self._end(self.mapped) >= offset + n, "view of an unmapped range"
        return self.buf[offset : offset + n]

    def close(self) -> None:
        self.is_closed = True

    def closed(self) -> bool:
        return self.is_closed

    def chunk_bytes(self) -> int:
        return self._chunk

    def granularity(self) -> int:
        return GRAN

    def reserved_bytes(self) -> int:
        return self.reserved

    def num_chunks(self) -> int:
        return len(self.sizes)

    def mapped_bytes(self) -> int:
        return self._end(self.mapped)

    def mapped_chunks(self) -> int:
        return self.mapped

    def ready(self) -> bool:
        return self.mapped == len(self.sizes)

    def error(self) -> str:
        return ""

    def live_views(self) -> int:
        return 0

    def all_mapped_s(self) -> float:
        return 0.01 if self.ready() else -1.0


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> type[FakeNative]:
    """Make the VMM path think it has a GPU and a native arena: the stub above."""
    FakeNative.instances = []
    monkeypatch.setattr(da, "_native_class", lambda: FakeNative)
    monkeypatch.setattr(da, "_native_loaded", lambda: None)
    monkeypatch.setattr(da, "_native_status", lambda index: "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return FakeNative


# -- argument checks (no native part needed) -------------------------------------------------
@pytest.mark.parametrize("nbytes", [0, -1])
def test_arena_rejects_nonpositive_nbytes(nbytes: int) -> None:
    with pytest.raises(ValueError, match="torchckpt: nbytes must be >= 1"):
        da.DeviceArena(nbytes, "cuda:0")


@pytest.mark.parametrize("kw,exc,msg", [
    ({"chunk_bytes": 0}, ValueError, "chunk_bytes must be >= 1"),
    ({"chunk_bytes": 1.5}, TypeError, "chunk_bytes must be an int"),
    ({"first_bytes": -1}, ValueError, "first_bytes must be >= 0"),
    ({"first_bytes": 1 << 21}, ValueError, "first_bytes <= nbytes"),
    ({"background": 1}, TypeError, "background must be a bool"),
])
def test_arena_rejects_bad_arguments(kw: dict[str, Any], exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        da.DeviceArena(1 << 20, "cuda:0", **kw)


def test_arena_rejects_bool_and_float_sizes() -> None:
    with pytest.raises(TypeError, match="nbytes must be an int"):
        da.DeviceArena(True, "cuda:0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nbytes must be an int"):
        da.make_device_slots(1e6, "cpu")  # type: ignore[arg-type]


def test_slot_stride_is_256_aligned() -> None:
    assert [da.slot_stride(n) for n in (1, 255, 256, 257, 1000)] == [256, 256, 256, 512, 1024]
    with pytest.raises(ValueError, match="slot_bytes must be >= 1"):
        da.slot_stride(0)


# -- capability messages ------------------------------------------------------------------------
def test_unavailable_reason_cpu_device() -> None:
    why = da.unavailable_reason("cpu")
    assert why is not None and why.startswith("torchckpt:") and "use_vmm=False" in why
    assert not da.is_available("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_unavailable_reason_without_gpu() -> None:
    why = da.unavailable_reason("cuda")
    assert why is not None and why.startswith("torchckpt:")
    assert ("torch.cuda.is_available() is False" in why) or ("not loaded" in why)
    with pytest.raises(CheckpointError, match="torchckpt:"):
        da.DeviceArena(1 << 20, "cuda:0")


def test_unavailable_reason_missing_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_error", "No module named 'torchckpt._C'")
    why = da.unavailable_reason("cuda:0")
    assert why is not None
    assert "torchckpt._C is not loaded" in why and "pip install --no-build-isolation -e ." in why
    assert "No module named" in why


def test_unavailable_reason_driver_without_vmm(monkeypatch: pytest.MonkeyPatch) -> None:
    msg = "torchckpt: device 0 does not support CUDA virtual memory management (...). Fix: ..."
    monkeypatch.setattr(da, "_native_loaded", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(da, "_native_status", lambda index: msg)
    assert da.unavailable_reason("cuda:0") == msg
    with pytest.raises(CheckpointError, match="does not support CUDA virtual memory"):
        da.make_device_slots(1 << 20, "cuda:0", use_vmm=True)


@pytest.mark.skipif(not native_available() or torch.cuda.is_available(), reason="needs the built extension, no GPU")
def test_native_status_and_checks_without_gpu() -> None:
    status = torch.ops.torchckpt.vmm_status(0)
    assert status.startswith("torchckpt:") and ("no CUDA device" in status or "without CUDA" in status)
    cls = torch.classes.torchckpt.DeviceArena
    for args, msg in [((0, 0, 1 << 20, 0, True, 0), "torchckpt: DeviceArena expected nbytes > 0"),
                      ((1 << 20, 0, 0, 0, True, 0), "torchckpt: DeviceArena expected chunk_bytes > 0"),
                      ((1 << 20, 0, 1 << 20, 0, True, 0), "torchckpt: no CUDA device")]:
        a = cls(*args)  # NOTE [ VMM device arena ] Rule 10: the constructor records, it does not throw
        err = a.init_error()
        assert err.startswith(msg) or "without CUDA" in err, err
        assert a.closed() and a.mapped_bytes() == 0
        assert a.wait(0, 1).startswith("torchckpt:")


# -- the fallback ------------------------------------------------------------------------------------
def test_fallback_on_cpu() -> None:
    m = da.make_device_slots(10_000, "cpu")
    assert isinstance(m, da.CachingAllocatorBuffer) and m.kind == "torch.empty"
    assert m.ready() and m.mapped_bytes == 10_000 and m.is_mapped(0, 10_000)
    m.wait()
    s = m.slot(3, 1000)
    s.fill_(7)
    assert torch.equal(m.view(3 * 1024, 1000), torch.full((1000,), 7, dtype=torch.uint8))
    with pytest.raises(IndexError, match="slot 9 of 1000 bytes"):
        m.slot(9, 1000)
    with pytest.raises(ValueError, match="inside \\[0, 10000\\)"):
        m.view(9_999, 2)
    m.close()
    assert m.closed and m.mapped_bytes == 0
    with pytest.raises(CheckpointError, match="after close"):
        m.view(0, 1)


def test_fallback_refused_when_vmm_required_on_cpu() -> None:
    with pytest.raises(CheckpointError, match="lives on a CUDA device"):
        da.make_device_slots(1 << 20, "cpu", use_vmm=True)
    with pytest.raises(TypeError, match="use_vmm must be None, True or False"):
        da.make_device_slots(1 << 20, "cpu", use_vmm=1)  # type: ignore[arg-type]


def test_arena_slots_fallback_reinterprets_like_layout() -> None:
    arena, slots = da.arena_slots("cpu", 3, 1000)
    assert arena is None and len(slots) == 3 and slots.stride == 1024
    for i, s in enumerate(slots):
        assert s.dtype == torch.uint8 and s.numel() == 1000
        s.view(torch.float32)[:] = float(i)  # _Layout.views reinterprets slots as any dtype
    assert [float(s.view(torch.float32)[0]) for s in slots] == [0.0, 1.0, 2.0]
    assert slots[-1].data_ptr() == slots[2].data_ptr() and len(slots[0:2]) == 2
    with pytest.raises(IndexError):
        slots[3]


def test_arena_slots_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="slots must be >= 1"):
        da.arena_slots("cpu", 0, 1000)
    with pytest.raises(ValueError, match="slot_bytes must be >= 1"):
        da.arena_slots("cpu", 2, 0)
    with pytest.raises(ValueError, match="need 2024 bytes, the memory has 2000"):
        da.ArenaSlots(da.CachingAllocatorBuffer(2000, "cpu"), 2, 1000)


# -- bookkeeping over the stub -----------------------------------------------------------------------
def test_arena_layout_and_lazy_mapping(fake: type[FakeNative]) -> None:
    a = da.DeviceArena(12 * GRAN + 5, "cuda:0", chunk_bytes=3 * GRAN - 1, first_bytes=GRAN + 1)
    native = fake.instances[-1]
    assert a.chunk_bytes == 3 * GRAN  # rounded up, not refused (NOTE [ Device arena ] Rule 1)
    assert native.sizes == [2 * GRAN, 3 * GRAN, 3 * GRAN, 3 * GRAN, 2 * GRAN]  # last one shorter
    assert a.reserved_bytes == 13 * GRAN and a.num_chunks == 5
    assert a.mapped_bytes == 2 * GRAN and a.mapped_chunks == 1 and not a.ready()
    assert a.is_mapped(0, 2 * GRAN) and not a.is_mapped(GRAN, 2 * GRAN)
    assert a.all_mapped_s is None
    v = a.view(4 * GRAN, 2)  # needs chunk 1 (bytes [2, 5) granules) only
    assert v.numel() == 2 and a.mapped_chunks == 2
    a.wait()
    assert a.ready() and a.mapped_bytes == a.reserved_bytes and a.all_mapped_s == 0.01
    assert "mapped=" in repr(a)
    a.close()
    a.close()
    assert a.closed and native.is_closed and a.mapped_bytes == 0 and not a.ready()
    with pytest.raises(CheckpointError, match="view\\(\\) after close"):
        a.view(0, 1)
    with pytest.raises(CheckpointError, match="wait\\(\\) after close"):
        a.wait(0, 1)


def test_arena_range_checks(fake: type[FakeNative]) -> None:
    with da.DeviceArena(4 * GRAN, "cuda:0", chunk_bytes=GRAN) as a:
        with pytest.raises(ValueError, match="inside \\[0, 16384\\)"):
            a.view(4 * GRAN - 1, 2)
        with pytest.raises(ValueError, match="offset must be >= 0"):
            a.view(-1, 2)
        with pytest.raises(IndexError, match="does not fit"):
            a.slot(4, GRAN)
        assert a.view(0, 0).numel() == 0
    assert a.closed


def test_arena_slots_wait_only_for_their_slot(fake: type[FakeNative]) -> None:
    slot_bytes = 2 * GRAN + 100  # stride 2 * GRAN + 256
    arena, slots = da.arena_slots("cuda:0", 8, slot_bytes, chunk_bytes=GRAN)
    native = fake.instances[-1]
    assert arena is not None and arena.kind == "vmm"
    assert native.sizes[0] == 3 * GRAN  # the first slot, mapped by the constructor
    assert slots.is_ready(0) and not slots.is_ready(1)
    s0 = slots[0]
    assert native.mapped == 1 and native.waits == [(0, slot_bytes)]  # no extra chunk for slot 0
    s3 = slots[3]
    stride = da.slot_stride(slot_bytes)
    assert native.waits[-1] == (3 * stride, slot_bytes)
    assert arena.mapped_bytes >= 3 * stride + slot_bytes and not arena.ready()
    assert slots.is_ready(3) and slots.is_ready(1)  # mapped in address order
    s3.fill_(9)
    s0.fill_(1)
    assert int(native.buf[3 * stride]) == 9 and int(native.buf[3 * stride + slot_bytes]) == 0
    assert slots[3] is s3  # made once, then kept
    slots.release()
    arena.close()


def test_make_device_slots_prefers_vmm(fake: type[FakeNative]) -> None:
    m = da.make_device_slots(1 << 20, "cuda:0", chunk_bytes=GRAN, first_bytes=GRAN)
    assert isinstance(m, da.DeviceArena) and m.kind == "vmm"
    m.close()


def test_background_failure_is_a_checkpoint_error(fake: type[FakeNative]) -> None:
    a = da.DeviceArena(8 * GRAN, "cuda:0", chunk_bytes=GRAN, first_bytes=GRAN)
    fake.instances[-1].fail_at = 3
    a.view(0, 3 * GRAN)  # chunks 0..2: fine
    with pytest.raises(CheckpointError, match="could not map chunk"):
        a.view(5 * GRAN, 1)
    a.close()


def test_native_error_messages_keep_prefix() -> None:
    assert str(da._native_error(RuntimeError("torchckpt: x"))) == "torchckpt: x"
    assert str(da._native_error(RuntimeError("boom"))) == "torchckpt: DeviceArena: boom"


