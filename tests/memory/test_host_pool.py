"""HostPool (NOTE [ Host pool ]): chunking, alignment, coalescing, reuse, the cap, parking."""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_models import FakeEvent
import torchckpt
from torchckpt.memory.host_pool import ALIGN, HostPool

MiB = 1 << 20


def pool(capacity: int = 64 * MiB, chunk: int = MiB) -> HostPool:
    return HostPool(capacity_bytes=capacity, chunk_bytes=chunk, pin=False)


def check_block(p: HostPool, b: torchckpt.HostBlock, n: int) -> None:
    assert b.tensor.numel() == n and b.tensor.dtype == torch.uint8
    assert b.chunk >= 0
    c = p._blocks.chunks[b.chunk]
    assert b.offset % ALIGN == 0 and b.nbytes % ALIGN == 0 and b.nbytes >= n
    assert 0 <= b.offset and b.offset + b.nbytes <= c.size  # never straddles chunks
    assert b.tensor.data_ptr() == c.buf.data_ptr() + b.offset


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3 * MiB // 2), st.booleans()), min_size=1, max_size=40))
def test_blocks_aligned_disjoint_inside_one_chunk(ops: list[tuple[int, bool]]) -> None:
    p = pool()
    live: list[tuple[torchckpt.HostBlock, int, int]] = []
    for i, (n, free_one) in enumerate(ops):
        b = p.alloc(n)
        check_block(p, b, n)
        b.tensor.fill_(i % 251)
        live.append((b, n, i % 251))
        if free_one and len(live) > 1:
            blk, _, _ = live.pop(len(live) // 2)
            p.free(blk)
    spans = sorted((b.chunk, b.offset, b.offset + b.nbytes) for b, _, _ in live)
    for (c1, _, e1), (c2, s2, _) in zip(spans, spans[1:]):
        assert c1 != c2 or e1 <= s2, "blocks overlap"
    for b, _, v in live:
        assert bool((b.tensor == v).all()), "a block was overwritten by another"
    assert p.stats().in_use_bytes == sum(b.nbytes for b, _, _ in live)
    for b, _, _ in live:
        p.free(b)
    # Coalescing: everything free -> one free span per chunk.
    for c in p._blocks.chunks:
        assert c.free == [(0, c.size)]
    assert p.stats().in_use_bytes == 0


def test_large_request_gets_own_power_of_two_chunk() -> None:
    p = pool()
    b = p.alloc(3 * MiB // 2)
    assert p._blocks.chunks[b.chunk].size == 2 * MiB and b.offset == 0
    assert p.stats().reserved_bytes == 2 * MiB


def test_reuse_across_cycles() -> None:
    p = pool()
    sizes = [1000, 200_000, 513, 700_000, 4096, 300_000, 1, 900_000]
    for cycle in range(10):
        blocks = [p.alloc(n) for n in sizes]
        for b, n in zip(blocks, sizes):
            check_block(p, b, n)
        for b in reversed(blocks) if cycle % 2 else blocks:
            p.free(b)
        s = p.stats()
        if cycle == 0:
            first = s
        assert s.in_use_bytes == 0
        assert s.chunk_allocations == first.chunk_allocations and s.reserved_bytes == first.reserved_bytes
    for c in p._blocks.chunks:
        assert c.free == [(0, c.size)]


def test_coalescing_frees_in_any_order() -> None:
    p = pool()
    blocks = [p.alloc(ALIGN) for _ in range(8)]
    for i in (1, 3, 5, 7, 0, 2, 6, 4):
        p.free(blocks[i])
    assert p._blocks.chunks[0].free == [(0, MiB)]


def test_cap_warns_once_and_goes_pageable() -> None:
    p = pool(capacity=2 * MiB)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        inside = [p.alloc(MiB) for _ in range(2)]
        outside = [p.alloc(MiB) for _ in range(3)] + [p.alloc(100)]
    runtime = [x for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(runtime) == 1 and str(runtime[0].message).startswith("torchckpt:")
    assert all(b.chunk >= 0 for b in inside)
    assert all(b.chunk == -1 and not b.pinned for b in outside)
    assert outside[0].tensor.numel() == MiB
    s = p.stats()
    assert s.reserved_bytes == 2 * MiB and s.pageable_fallbacks == 4
    assert s.pageable_in_use_bytes == 3 * MiB + 100
    for b in inside + outside:
        p.free(b)
    s = p.stats()
    assert s.in_use_bytes == 0 and s.pageable_in_use_bytes == 0


def test_zero_capacity_is_all_pageable() -> None:
    p = pool(capacity=0)
    with pytest.warns(RuntimeWarning, match="^torchckpt:"):
        b = p.alloc(10)
    assert b.chunk == -1 and p.stats().chunks == 0


@pytest.mark.parametrize("chunk", [0, 1000, MiB // 2, 3 * MiB, MiB + ALIGN])
def test_invalid_chunk_size(chunk: int) -> None:
    with pytest.raises(ValueError, match="^torchckpt:"):
        HostPool(chunk_bytes=chunk, pin=False)


def test_negative_capacity() -> None:
    with pytest.raises(ValueError, match="^torchckpt:"):
        HostPool(capacity_bytes=-1, pin=False)


@pytest.mark.parametrize("n", [0, -5])
def test_alloc_non_positive(n: int) -> None:
    with pytest.raises(ValueError, match="^torchckpt:"):
        pool().alloc(n)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_pin_without_cuda() -> None:
    with pytest.raises(RuntimeError, match="^torchckpt:") as e:
        HostPool(pin=True)
    assert isinstance(e.value, torchckpt.CheckpointError)


def test_pin_none_follows_cuda() -> None:
    assert HostPool(capacity_bytes=MiB, chunk_bytes=MiB).pin == torch.cuda.is_available()


def test_parked_block_not_reused_until_its_copy_ends() -> None:
    p = pool()
    a = p.alloc(MiB)  # fills the first chunk
    ev = FakeEvent()
    p.free(a, ev)
    assert p.stats().in_use_bytes == MiB  # parked counts as in use
    b = p.alloc(MiB)  # parked bytes suffice: wait for the copy rather than grow (NOTE [ Host pool ] Rule 3)
    assert ev.syncs == 1 and b.chunk == 0 and p.stats().chunk_allocations == 1


def test_grows_when_parked_blocks_cannot_serve() -> None:
    p = pool()
    a = p.alloc(MiB // 2)
    keep = p.alloc(MiB // 2)  # the chunk is full
    ev = FakeEvent()
    p.free(a, ev)
    b = p.alloc(MiB)  # half a MiB parked cannot serve a MiB: grow, do not wait
    assert ev.syncs == 0 and b.chunk == 1 and keep.chunk == 0
    ev.done = True
    c = p.alloc(MiB // 2)  # reclaimed without waiting: reuses chunk 0
    assert c.chunk == 0 and ev.syncs == 0


def test_at_cap_waits_for_parked_blocks_instead_of_pageable() -> None:
    p = pool(capacity=MiB)
    a = p.alloc(MiB)
    ev = FakeEvent()
    p.free(a, ev)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no pageable fallback warning
        b = p.alloc(MiB)
    assert ev.syncs == 1 and b.chunk == 0


def test_free_with_completed_event_releases_at_once() -> None:
    p = pool()
    ev = FakeEvent()
    ev.done = True
    p.free(p.alloc(4096), ev)
    assert p.stats().in_use_bytes == 0 and p._blocks.chunks[0].free == [(0, MiB)]


def test_close_waits_and_drops_chunks() -> None:
    p = pool()
    ev = FakeEvent()
    p.free(p.alloc(100), ev)
    p.alloc(100)
    p.close()
    s = p.stats()
    assert ev.syncs == 1 and s.chunks == 0 and s.reserved_bytes == 0 and s.in_use_bytes == 0


def test_docstring_example() -> None:
    p = HostPool(capacity_bytes=64 << 20, chunk_bytes=1 << 20, pin=False)
    block = p.alloc(1000)
    assert block.tensor.numel() == 1000
    p.free(block)
    assert p.stats().in_use_bytes == 0
