"""The host pool's allocator under churn (NOTE [ Host pool ] Rule 2): placement identical to a plain first-fit list,
blocks aligned, disjoint and inside one chunk, coalescing back to whole chunks, and a search whose cost does not
grow with the number of free spans."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchckpt.memory.host_pool import ALIGN, Chunk, HostBlock, HostPool

MiB = 1 << 20


class FirstFit:
    """The reference model of Rule 2: a list of (offset, size) sorted by offset, searched from its start, coalesced
    on free."""

    def __init__(self, size: int) -> None:
        self.free = [(0, size)]

    def take(self, n: int) -> int | None:
        for i, (off, size) in enumerate(self.free):
            if size >= n:
                self.free[i : i + 1] = [] if size == n else [(off + n, size - n)]
                return off
        return None

    def give(self, off: int, n: int) -> None:
        spans = sorted(self.free + [(off, n)])
        merged: list[tuple[int, int]] = []
        for o, s in spans:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self.free = merged


def chunk(size: int) -> Chunk:
    return Chunk(torch.empty(size, dtype=torch.uint8), False)


# (granules to allocate, or None to free the live block at index k % live)
_ops = st.lists(st.one_of(st.tuples(st.just(True), st.integers(1, 300)), st.tuples(st.just(False), st.integers(0, 999))),
                min_size=1, max_size=300)


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_chunk_matches_first_fit_reference(ops: list[tuple[bool, int]]) -> None:
    size = 256 * ALIGN
    c, ref = chunk(size), FirstFit(size)
    live: list[tuple[int, int]] = []
    for is_alloc, k in ops:
        if is_alloc:
            n = k * ALIGN
            off = c.take(n)
            assert off == ref.take(n)  # the same placement as first-fit by offset
            if off is not None:
                live.append((off, n))
        elif live:
            off, n = live.pop(k % len(live))
            c.give(off, n)
            ref.give(off, n)
        assert c.free == ref.free
    spans = sorted(live)
    for (o1, n1), (o2, _) in zip(spans, spans[1:]):
        assert o1 + n1 <= o2  # disjoint
    for off, n in live:
        c.give(off, n)
    assert c.free == [(0, size)] and c.take(size) == 0  # coalesced back: the whole chunk in one block


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3 * MiB // 2), st.integers(0, 999), st.booleans()), min_size=1, max_size=200))
def test_pool_churn_invariants(ops: list[tuple[int, int, bool]]) -> None:
    p = HostPool(capacity_bytes=64 * MiB, chunk_bytes=MiB, pin=False)
    live: list[tuple[HostBlock, int]] = []
    for n, k, free in ops:
        if free and live:
            p.free(live.pop(k % len(live))[0])
            continue
        b = p.alloc(n)
        live.append((b, n))
        c = p._blocks.chunks[b.chunk]
        assert b.tensor.numel() == n and b.offset % ALIGN == 0 and b.nbytes % ALIGN == 0
        assert 0 <= b.offset and b.offset + b.nbytes <= c.size  # inside one chunk (Rule 2)
        assert b.tensor.data_ptr() == c.buf.data_ptr() + b.offset
    spans = sorted((b.chunk, b.offset, b.offset + b.nbytes) for b, _ in live)
    for (c1, _, e1), (c2, s2, _) in zip(spans, spans[1:]):
        assert c1 != c2 or e1 <= s2  # no two live blocks overlap
    for b, _ in live:
        p.free(b)
    for c in p._blocks.chunks:
        assert c.free == [(0, c.size)]
        assert c.take(c.size) == 0  # one allocation of the whole chunk succeeds


class CountingInt(int):
    """A request size that counts the comparisons made against it: the spans a search looks at."""

    seen = 0

    def _count(self) -> None:
        CountingInt.seen += 1

    def __lt__(self, other: Any) -> bool:
        self._count()
        return int(self) < other

    def __le__(self, other: Any) -> bool:
        self._count()
        return int(self) <= other

    def __gt__(self, other: Any) -> bool:
        self._count()
        return int(self) > other

    def __ge__(self, other: Any) -> bool:
        self._count()
        return int(self) >= other


@pytest.mark.parametrize("holes", [100, 3000])
def test_search_cost_does_not_grow_with_free_spans(holes: int) -> None:
    """``holes`` one-granule holes below the only span that fits: a first-fit scan from the start of the list looks
    at every hole; the search of Rule 2 looks at O(log spans) of them."""
    c = chunk(4 * holes * ALIGN)
    offs = [c.take(ALIGN) for _ in range(2 * holes)]
    for off in offs[::2]:
        assert off is not None
        c.give(off, ALIGN)  # a hole between two live blocks
    assert len(c.free) == holes + 1
    n = CountingInt(2 * ALIGN)
    CountingInt.seen = 0
    assert c.take(n) == 2 * holes * ALIGN
    assert CountingInt.seen <= 64, f"{CountingInt.seen} comparisons for {holes} free spans"
    # Still first fit once a lower span fits: free a block next to a hole.
    c.give(offs[1], ALIGN)
    assert c.take(CountingInt(2 * ALIGN)) == 0
