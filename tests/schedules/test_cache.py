"""The one cache model (NOTE [ Cache model ]) against a plain reference, in bytes and in slots."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchckpt.schedules.cache import Cache


class Reference:
    """The same rules written as plainly as possible: lists, no incremental counters."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: list[int] = []  # LRU first
        self.sizes: dict[int, int] = {}
        self.pins: dict[int, int] = {}
        self.peak = 0

    def used(self) -> int:
        return sum(self.sizes[k] for k in self.order)

    def victims(self, extra: int) -> list[int]:
        out, over = [], self.used() + extra - self.capacity
        for k in self.order:
            if over <= 0:
                break
            if self.pins.get(k, 0) == 0:
                out.append(k)
                over -= self.sizes[k]
        return out

    def can_take(self, size: int) -> bool:
        unpinned = sum(self.sizes[k] for k in self.order if self.pins.get(k, 0) == 0)
        return self.capacity - self.used() + unpinned >= size

    def insert(self, k: int, size: int) -> None:
        self.order.append(k)
        self.sizes[k] = size
        self.peak = max(self.peak, self.used())

    def remove(self, k: int) -> bool:
        if k not in self.order:
            return False
        self.order.remove(k)
        return self.pins.pop(k, 0) > 0


ops = st.lists(st.tuples(st.sampled_from(["admit", "insert", "pin", "use", "touch", "remove"]),
                         st.integers(0, 7), st.integers(1, 5)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(0, 12), seq=ops, slots=st.booleans())
def test_cache_matches_reference(capacity: int, seq: list[tuple[str, int, int]], slots: bool) -> None:
    c, r = Cache(capacity), Reference(capacity)
    for op, k, size in seq:
        size = 1 if slots else size
        if op == "admit":
            assert c.can_take(size) == r.can_take(size)
            if not c.can_take(size):
                continue
            if k in r.order:
                r.order.remove(k)
                r.order.append(k)
                assert c.admit(k, size) == []
                continue
            want = r.victims(size)
            for v in want:
                r.remove(v)
            r.insert(k, size)
            assert c.admit(k, size) == want
        elif op == "insert":
            if k in r.order:
                continue
            r.insert(k, size)
            c.insert(k, size)
        elif op == "pin":
            if k in r.order:
                r.pins[k] = r.pins.get(k, 0) + 1
            c.pin(k)
        elif op == "use":
            hit = k in r.order
            if hit:
                r.order.remove(k)
                r.order.append(k)
            if r.pins.get(k, 0) > 0:
                r.pins[k] -= 1
                if r.pins[k] == 0:
                    del r.pins[k]
            assert c.use(k) == hit
        elif op == "touch":
            if k not in r.order:
                continue
            r.order.remove(k)
            r.order.append(k)
            r.pins.pop(k, None)
            c.touch(k)
        else:
            assert c.remove(k) == r.remove(k)
        assert c.used == r.used() and c.peak == r.peak and len(c) == len(r.order)
        assert c.unpinned() == [k for k in r.order if r.pins.get(k, 0) == 0]
        assert c.pinned == len(r.pins)
        for extra in (0, 1, 3):
            assert c.victims(extra) == r.victims(extra)
            assert c.can_take(extra) == r.can_take(extra)


def test_pins_count_per_use_and_touch_ends_them_all() -> None:
    c = Cache(2)
    c.admit("a")
    c.pin("a")
    c.pin("a")
    c.admit("b")
    assert not c.can_take(2) and c.victims(1) == ["b"]
    assert c.use("a") and c.is_pinned("a")  # one pin left for the second use
    c.touch("a")
    assert not c.is_pinned("a") and c.victims(1) == ["b"]


def test_pin_of_absent_key_is_ignored() -> None:
    c = Cache(4)
    c.pin("x")
    assert c.pinned == 0 and "x" not in c


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_capacity_must_be_a_nonnegative_int(bad: object) -> None:
    with pytest.raises(ValueError, match="^torchckpt: a GPU cache's capacity must be an int >= 0"):
        Cache(bad)  # type: ignore[arg-type]
