"""VMM device arena on a GPU: bit-exact data, waits on unmapped ranges, many chunks, close while a
kernel runs, two arenas, errors, and a background mapping failure (NOTE [ VMM device arena ])."""
from __future__ import annotations

import gc
import time

import pytest
import torch

import torchckpt.memory.device_arena as da
from torchckpt._errors import CheckpointError
from torchckpt.store.snapshot_slots import Layout as _Layout

pytestmark = pytest.mark.cuda

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _needs_vmm() -> None:
    why = da.unavailable_reason("cuda")
    if why is not None:
        pytest.skip(why)


def _free() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def test_available_on_this_gpu() -> None:
    assert da.is_available("cuda") and da.unavailable_reason(torch.device("cuda", 0)) is None


def test_slots_read_back_bit_exact() -> None:
    slot_bytes = 5 * MiB + 100
    arena, slots = da.arena_slots("cuda", 6, slot_bytes, chunk_bytes=4 * MiB)
    assert arena is not None and arena.kind == "vmm"
    g = torch.Generator(device="cuda").manual_seed(1)
    src = [torch.randint(0, 256, (slot_bytes,), dtype=torch.uint8, device="cuda", generator=g) for _ in range(6)]
    for i in (0, 5, 2, 1, 4, 3):  # out of address order: each waits for its own range
        s = slots[i]
        assert s.device == torch.device("cuda", torch.cuda.current_device())
        assert s.data_ptr() % 256 == 0 and s.numel() == slot_bytes and s.dtype == torch.uint8
        s.copy_(src[i])
    for i in range(6):
        assert torch.equal(slots[i].cpu(), src[i].cpu())
    slots.release()
    arena.close()


def test_layout_views_reinterpret_a_slot() -> None:
    state = [torch.randn(1000, device="cuda"), torch.randn(33, 7, device="cuda").bfloat16(),
             torch.arange(17, device="cuda", dtype=torch.int64)]
    lay = _Layout(state)
    arena, slots = da.arena_slots("cuda", 3, lay.nbytes, chunk_bytes=2 * MiB)
    for k in range(3):
        for dst, src in zip(lay.views(slots[k]), state):
            dst.copy_(src * (k + 1))
    for k in range(3):
        for got, src in zip(lay.views(slots[k]), state):
            assert torch.equal(got, src * (k + 1))
    slots.release()
    assert arena is not None
    arena.close()


def test_write_to_unmapped_range_waits_then_succeeds() -> None:
    delay_us = 20_000  # 20 ms before each background chunk: 15 chunks take >= 300 ms
    a = da.DeviceArena(16 * MiB, "cuda", chunk_bytes=1, first_bytes=1, _delay_us=delay_us)
    gran = a.granularity
    assert a.chunk_bytes == gran  # chunk_bytes=1 is rounded up to the granularity, not refused
    n = a.num_chunks
    assert n == 16 * MiB // gran and n >= 4
    assert a.mapped_chunks < n and not a.ready() and not a.is_mapped(3 * gran, 1)
    t0 = time.perf_counter()
    v3 = a.view(3 * gran, 4096)  # waits for chunk 3 only
    waited = time.perf_counter() - t0
    assert a.is_mapped(3 * gran, 4096) and a.mapped_chunks >= 4
    if n >= 8:
        assert not a.ready()  # returned before the whole arena was mapped
    assert waited >= 1.5 * delay_us / 1e6  # chunks 1..3 each wait 20 ms in the background first
    v3.fill_(0xA5)
    last = a.view(a.nbytes - 4096, 4096)  # waits for the last chunk
    assert a.ready() and a.mapped_bytes == a.reserved_bytes
    last.fill_(0x5A)
    assert int(v3.sum()) == 0xA5 * 4096 and int(last.sum()) == 0x5A * 4096
    assert a.all_mapped_s is not None and a.all_mapped_s >= (n - 1) * delay_us / 1e6 * 0.9
    del v3, last
    a.close()


def test_many_chunks_and_accounting_outside_the_caching_allocator() -> None:
    free0 = _free()
    alloc0 = torch.cuda.memory_allocated()
    a = da.DeviceArena(1 << 30, "cuda", chunk_bytes=1)  # one chunk per granule: 512 chunks of 2 MiB on H100
    assert a.num_chunks == a.reserved_bytes // a.granularity and a.num_chunks >= 256
    a.wait()
    assert a.ready() and a.mapped_bytes == 1 << 30 and a.error() is None
    assert torch.cuda.memory_allocated() == alloc0  # NOTE [ Device arena ] Rule 3: PyTorch's allocator does not count it
    assert free0 - torch.cuda.mem_get_info()[0] >= (1 << 30) - 64 * MiB  # the driver does
    whole = a.view(0, 1 << 30).view(torch.int32)
    whole.copy_(torch.arange(whole.numel(), device="cuda", dtype=torch.int32))
    step = a.granularity // 4
    probe = whole[step - 1 :: step]  # last int of every granule
    assert torch.equal(probe, torch.arange(step - 1, whole.numel(), step, device="cuda", dtype=torch.int32))
    assert a.live_views >= 1
    del whole, probe
    a.close()
    assert _free() >= free0 - 64 * MiB  # memory went back to the driver


def test_close_while_a_kernel_runs() -> None:
    """close() with work queued on the arena: release synchronizes the device first (NOTE [ Device arena ] Rule 4)."""
    n = 4096
    nb = n * n * 4
    a = da.DeviceArena(3 * nb, "cuda", chunk_bytes=8 * MiB)
    x, y, z = (a.view(k * nb, nb).view(torch.float32).view(n, n) for k in range(3))
    x.copy_(torch.eye(n, device="cuda") * 0.5)
    y.fill_(1.0)
    out = torch.empty(n, n, device="cuda")
    torch.mm(x, y, out=z)  # warm cuBLAS up (its workspace and kernels take device memory once)
    y.fill_(1.0)
    torch.cuda.synchronize()
    for _ in range(10):  # 20 GEMMs queued, still running when close() returns
        torch.mm(x, y, out=z)
        torch.mm(x, z, out=y)
    out.copy_(y)
    want = torch.full((n, n), 0.5**20, device="cuda")
    a.close()
    assert a.closed
    held = torch.cuda.mem_get_info()[0]
    del x, y, z  # the last views: the memory goes back now, after the device finished the GEMMs
    torch.cuda.synchronize()  # would raise if a kernel had touched unmapped memory
    freed = torch.cuda.mem_get_info()[0] - held  # before anything else allocates (torch.equal may take a segment)
    assert torch.equal(out, want)
    assert freed >= 3 * nb - 16 * MiB


def test_two_arenas_at_once() -> None:
    a = da.DeviceArena(512 * MiB, "cuda", chunk_bytes=8 * MiB, first_bytes=MiB)
    b = da.DeviceArena(512 * MiB, "cuda", chunk_bytes=2 * MiB, first_bytes=MiB)
    va, vb = a.view(0, 512 * MiB), b.view(0, 512 * MiB)
    assert va.data_ptr() + va.numel() <= vb.data_ptr() or vb.data_ptr() + vb.numel() <= va.data_ptr()
    va.fill_(1)
    vb.fill_(2)
    assert int(va.sum(dtype=torch.int64)) == 512 * MiB and int(vb.sum(dtype=torch.int64)) == 2 * 512 * MiB
    assert a.ready() and b.ready()
    del va, vb
    a.close()
    b.close()


def test_views_outlive_close() -> None:
    a = da.DeviceArena(64 * MiB, "cuda", chunk_bytes=16 * MiB)
    v = a.view(MiB, MiB)
    v.fill_(3)
    a.close()
    assert int(v.sum()) == 3 * MiB  # still mapped: the view holds the memory (NOTE [ Device arena ] Rule 4)
    with pytest.raises(CheckpointError, match="after close"):
        a.view(0, 1)


def test_errors() -> None:
    with pytest.raises(ValueError, match="nbytes must be >= 1"):
        da.DeviceArena(0, "cuda")
    cls = torch.classes.torchckpt.DeviceArena
    raw = cls(-5, torch.cuda.current_device(), MiB, 0, True, 0)  # NOTE [ VMM device arena ] Rule 10: recorded, not thrown
    assert raw.init_error().startswith("torchckpt: DeviceArena expected nbytes > 0") and raw.closed()
    with pytest.raises(CheckpointError, match="expected a device index"):
        da.DeviceArena(MiB, torch.cuda.device_count())
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(CheckpointError, match="does not fit"):
        da.DeviceArena(2 * total, "cuda")
    a = da.DeviceArena(8 * MiB, "cuda", chunk_bytes=3 * MiB)
    assert a.chunk_bytes % a.granularity == 0 and a.chunk_bytes >= 3 * MiB  # rounded up
    with pytest.raises(ValueError, match="inside"):
        a.view(8 * MiB - 1, 2)
    a.close()


def test_background_out_of_memory_is_reported_and_mapped_part_stays_usable() -> None:
    free0 = _free()
    chunk = 1 << 30
    nbytes = int(free0 * 0.6) // chunk * chunk
    if nbytes < 4 * chunk:
        pytest.skip("needs a GPU with more than ~7 GiB free")
    a = da.DeviceArena(nbytes, "cuda", chunk_bytes=chunk, first_bytes=chunk, _delay_us=50_000)
    hog = torch.empty(int(free0 * 0.5), dtype=torch.uint8, device="cuda")  # takes memory the arena needs
    first = a.view(0, MiB)
    first.fill_(7)
    with pytest.raises(CheckpointError, match="could not map chunk .*OUT_OF_MEMORY"):
        a.view(nbytes - MiB, MiB)
    assert a.error() is not None and not a.ready()
    assert int(first.sum()) == 7 * MiB
    del hog, first
    a.close()
    assert _free() >= free0 - 64 * MiB


def test_fallback_on_cuda_uses_the_caching_allocator() -> None:
    before = torch.cuda.memory_allocated()
    arena, slots = da.arena_slots("cuda", 2, MiB, use_vmm=False)
    assert arena is None and slots.memory.kind == "cudaMalloc"
    assert torch.cuda.memory_allocated() - before >= 2 * MiB
    slots[1].fill_(4)
    assert int(slots[1].sum()) == 4 * MiB
