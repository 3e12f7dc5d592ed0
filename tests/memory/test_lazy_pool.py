"""LazyHostPool (NOTE [ Lazy host pool ]): chunk layout and states, blocks inside one chunk,
touch progress, strategies, copy gating, close, bad input, the factory. CUDA registration is
stubbed with register_mode="fake" / "fake_fail" (NOTE [ Native host pool ] Rule 7, csrc/host_pool.cpp)."""
from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_models import FakeEvent
import torchckpt.memory.factory as factory
import torchckpt.memory.lazy_pool as lp
import torchckpt.memory.sysinfo as sysinfo
from torchckpt._errors import CheckpointError
from torchckpt._native import host_pool_available
from torchckpt.memory.host_pool import ALIGN, HostPool, HostPoolBase
from torchckpt.memory.factory import make_host_pool
from torchckpt.memory.lazy_pool import FAILED, REGISTERED, TOUCHED, UNTOUCHED, LazyHostPool
from torchckpt.memory.link_model import LinkProfile, choose_strategy

MiB = 1 << 20
native = pytest.mark.skipif(not host_pool_available(), reason="torchckpt._C with csrc/host_pool.cpp is not built")


def make(capacity: int = 16 * MiB, chunk: int = 4 * MiB, first: int = MiB, mode: str = "fake", **kw: object) -> LazyHostPool:
    kw.setdefault("lock_path", os.path.join("/tmp", f"torchckpt-test-{os.getpid()}.lock"))
    return LazyHostPool(capacity_bytes=capacity, chunk_bytes=chunk, first_chunk_bytes=first, register_mode=mode,
                        strategy=kw.pop("strategy", "concurrent"), **kw)  # type: ignore[arg-type]


def wait_until(cond, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return bool(cond())


# -- runs everywhere ---------------------------------------------------------------------
def test_factory_without_pinning_is_python_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHCKPT_HOST_POOL", raising=False)
    p = make_host_pool(pin=False, capacity_bytes=8 * MiB, chunk_bytes=MiB)
    assert type(p) is HostPool and not p.pin
    monkeypatch.setenv("TORCHCKPT_HOST_POOL", "python")
    assert type(make_host_pool(pin=False, capacity_bytes=8 * MiB, chunk_bytes=MiB)) is HostPool
    monkeypatch.setenv("TORCHCKPT_HOST_POOL", "bogus")
    with pytest.raises(ValueError, match="^torchckpt: TORCHCKPT_HOST_POOL"):
        make_host_pool(pin=False)


def test_factory_pin_true_uses_lazy_only_where_it_can_register(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHCKPT_HOST_POOL", raising=False)
    monkeypatch.setattr(factory, "host_pool_available", lambda: False)
    # No native pool: the factory must not pick LazyHostPool (HostPool then decides about CUDA).
    if torch.cuda.is_available():
        p = make_host_pool(pin=True, capacity_bytes=8 * MiB, chunk_bytes=MiB)
        assert type(p) is HostPool
    else:
        with pytest.raises(CheckpointError, match="^torchckpt:"):
            make_host_pool(pin=True, capacity_bytes=8 * MiB, chunk_bytes=MiB)


def test_choose_strategy_model() -> None:
    G = 1e9
    fast = LinkProfile(55 * G, 54 * G, 13 * G, 2 * G, 40 * G, 400 * G)
    assert choose_strategy(fast) == "concurrent"  # touching barely disturbs copies
    slowed = LinkProfile(55 * G, 30 * G, 13 * G, 2 * G, 40 * G, 400 * G)
    assert choose_strategy(slowed, write_rate=1 * G) == "sequential"  # idle link, copies hurt by touching
    assert choose_strategy(slowed, write_rate=55 * G) == "concurrent"  # link always busy: it would never touch
    crushed = LinkProfile(55 * G, 10 * G, 13 * G, 2 * G, 40 * G, 400 * G)
    assert choose_strategy(crushed, write_rate=55 * G) == "sequential"  # pinned-while-touching below pageable
    with pytest.raises(ValueError, match="^torchckpt:"):
        LinkProfile(0.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="^torchckpt:"):
        choose_strategy(fast, write_rate=0.0)


def test_lazy_pool_without_native_says_how_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchckpt._native as ext

    monkeypatch.setattr(ext, "host_pool_available", lambda: False)
    monkeypatch.setattr(lp, "native_host_pool_class", ext.native_host_pool_class)
    with pytest.raises(CheckpointError, match="pip install --no-build-isolation"):
        LazyHostPool(capacity_bytes=8 * MiB, pin=False)


# -- native pool, CUDA stubbed -------------------------------------------------------------
@native
def test_chunk_layout_doubles_then_caps() -> None:
    p = make(capacity=27 * MiB, chunk=8 * MiB, first=MiB, mode="none")
    bounds = p.chunk_bounds()
    assert [s for _, s in bounds] == [MiB, 2 * MiB, 4 * MiB, 8 * MiB, 8 * MiB, 4 * MiB]
    off = 0
    for o, s in bounds:
        assert o == off and s % sysinfo.page_bytes() == 0
        off += s
    assert off == 27 * MiB
    p.close()


@native
def test_touch_progress_reaches_every_chunk_in_order() -> None:
    p = make(capacity=24 * MiB, chunk=4 * MiB, first=MiB, mode="none")
    assert p.wait_ready(timeout=30)
    assert p.chunk_states() == [TOUCHED] * len(p.chunk_bounds())
    s = p.lazy_stats()
    assert s.touched_bytes == 24 * MiB and s.registered_bytes == 0 and s.first_registered_s is None
    assert p.stats().reserved_bytes == 24 * MiB and p.stats().pinned_bytes == 0
    times = p._native.chunk_times()[: s.chunks]  # type: ignore[union-attr]
    assert all(t >= 0 for t in times) and times == sorted(times)
    p.close()


@native
def test_fake_registration_pins_every_chunk() -> None:
    p = make(capacity=16 * MiB, chunk=4 * MiB, first=MiB)
    b = p.alloc(1000)
    assert p.wait_pinned(b, timeout=30) and b.pinned
    assert p.wait_ready(timeout=30)
    assert p.chunk_states() == [REGISTERED] * len(p.chunk_bounds())
    st = p.stats()
    assert st.pinned_bytes == 16 * MiB and st.in_use_bytes == _round(1000)
    ls = p.lazy_stats()
    assert ls.registered_chunks == ls.chunks and ls.failed_chunks == 0 and ls.errors == ()
    assert ls.first_registered_s is not None and ls.all_registered_s is not None
    assert ls.first_registered_s <= ls.all_registered_s
    p.free(b)
    assert p.stats().in_use_bytes == 0
    p.close()


def _round(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@native
@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3 * MiB), st.booleans()), min_size=1, max_size=30))
def test_blocks_never_straddle_chunks(ops: list[tuple[int, bool]]) -> None:
    p = make(capacity=24 * MiB, chunk=4 * MiB, first=MiB, mode="none")
    bounds = p.chunk_bounds()
    base = p._base.data_ptr()  # type: ignore[union-attr]
    live = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the cap may be reached: pageable blocks
        for i, (n, free_one) in enumerate(ops):
            b = p.alloc(n)
            assert b.tensor.numel() == n
            if b.chunk >= 0:
                o, s = bounds[b.chunk]
                assert b.offset % ALIGN == 0 and b.offset + b.nbytes <= s, "block straddles a chunk"
                assert b.tensor.data_ptr() == base + o + b.offset
            b.tensor.fill_(i % 251)
            live.append((b, i % 251))
            if free_one and len(live) > 1:
                p.free(live.pop(len(live) // 2)[0])
    spans = sorted((b.chunk, b.offset, b.offset + b.nbytes) for b, _ in live if b.chunk >= 0)
    for (c1, _, e1), (c2, s2, _) in zip(spans, spans[1:]):
        assert c1 != c2 or e1 <= s2, "blocks overlap"
    for b, v in live:
        assert bool((b.tensor == v).all())
    for b, _ in live:
        p.free(b)
    s = p.stats()
    assert s.in_use_bytes == 0 and s.pageable_in_use_bytes == 0
    for c in p._blocks.chunks:
        assert c.free == [(0, c.size)]
    p.close()


@native
def test_registration_failure_warns_once_and_stays_pageable() -> None:
    p = make(capacity=8 * MiB, chunk=4 * MiB, first=MiB, mode="fake_fail")
    assert p.wait_ready(timeout=30)
    assert p.chunk_states() == [FAILED] * len(p.chunk_bounds())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        blocks = [p.alloc(MiB // 2) for _ in range(4)]
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1 and msgs[0].startswith("torchckpt:") and "pageable" in msgs[0]
    for i, b in enumerate(blocks):
        assert not b.pinned
        b.tensor.fill_(i + 1)
    assert [int(b.tensor[-1]) for b in blocks] == [1, 2, 3, 4]
    assert p.stats().pinned_bytes == 0 and p.lazy_stats().failed_chunks == len(p.chunk_bounds())
    p.close()


@native
def test_whole_strategy_touches_everything_before_one_registration() -> None:
    p = make(capacity=12 * MiB, chunk=4 * MiB, first=MiB, strategy="whole")
    assert p.wait_ready(timeout=30)
    n = len(p.chunk_bounds())
    assert p.chunk_states() == [REGISTERED] * n
    times = p._native.chunk_times()  # type: ignore[union-attr]
    assert max(times[:n]) <= min(times[n:])
    assert p._native.stats()["registrations"] == 1  # type: ignore[union-attr]
    p.close()


@native
def test_ahead_bytes_bounds_the_worker_and_alloc_moves_it() -> None:
    p = make(capacity=32 * MiB, chunk=4 * MiB, first=MiB, mode="none", ahead_bytes=0)
    assert wait_until(lambda: p.chunk_states()[0] == TOUCHED)
    time.sleep(0.1)
    assert p.chunk_states()[1:] == [UNTOUCHED] * (len(p.chunk_bounds()) - 1)  # limit = first chunk
    blocks = [p.alloc(3 * MiB) for _ in range(3)]  # chunks 2 (4 MiB), 3, 4
    assert [b.chunk for b in blocks] == [2, 3, 4]
    assert wait_until(lambda: all(s == TOUCHED for s in p.chunk_states()[:5]))
    assert p.chunk_states()[5:] == [UNTOUCHED] * (len(p.chunk_bounds()) - 5)
    p.close()


@native
def test_sequential_touches_only_while_no_copy_runs() -> None:
    p = make(capacity=32 * MiB, chunk=4 * MiB, first=MiB, mode="none", strategy="sequential", ahead_bytes=0)
    assert wait_until(lambda: p.chunk_states()[0] == TOUCHED)
    p.begin_copy()
    p._native.set_touch_limit(-1)  # type: ignore[union-attr]  # everything may be touched now...
    time.sleep(0.2)
    assert p.chunk_states()[1:] == [UNTOUCHED] * (len(p.chunk_bounds()) - 1)  # ...but a copy is in flight
    p.end_copy()
    assert p.wait_ready(timeout=30) and p.chunk_states() == [TOUCHED] * len(p.chunk_bounds())
    assert p.lazy_stats().paused_s > 0.1
    p.close()


@native
def test_close_joins_the_worker_and_keeps_held_blocks_valid() -> None:
    # 1 ms per fake registration of 256 chunks: the worker is still busy when close() comes.
    p = make(capacity=256 * MiB, chunk=MiB, first=MiB, mode="fake")
    b = p.alloc(4096)
    b.tensor.fill_(7)
    t = time.perf_counter()
    p.close()
    assert time.perf_counter() - t < 5.0
    assert p._native is None and p.stats().in_use_bytes == 0
    with pytest.raises(CheckpointError, match="^torchckpt: LazyHostPool.alloc after close"):
        p.alloc(10)
    assert int(b.tensor.sum()) == 7 * 4096  # still mapped: the tensor holds the native pool
    p.close()  # idempotent


@native
def test_parked_blocks_are_waited_for_not_grown() -> None:
    p = make(capacity=2 * MiB, chunk=MiB, first=MiB, mode="none")
    blocks = [p.alloc(MiB), p.alloc(MiB)]
    evs = [FakeEvent(), FakeEvent()]
    for b, e in zip(blocks, evs):
        p.free(b, e)
    assert p.stats().in_use_bytes == 2 * MiB  # parked
    b = p.alloc(MiB)
    assert b.chunk == 0 and evs[0].syncs == 1 and evs[1].syncs == 0
    p.free(b)
    p.close()
    assert evs[1].syncs == 1  # close waited for the last parked copy


@native
def test_oversize_and_overflow_go_pageable_with_one_warning() -> None:
    p = make(capacity=4 * MiB, chunk=2 * MiB, first=2 * MiB, mode="none")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        big = p.alloc(3 * MiB)  # larger than any chunk
        inside = [p.alloc(2 * MiB), p.alloc(2 * MiB)]
        over = p.alloc(MiB)  # the pool is full
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1 and msgs[0].startswith("torchckpt:") and "largest chunk" in msgs[0]
    assert big.chunk == -1 and over.chunk == -1 and [b.chunk for b in inside] == [0, 1]
    assert p.stats().pageable_fallbacks == 2 and p.stats().pageable_in_use_bytes == 4 * MiB
    for b in [big, over, *inside]:
        p.free(b)
    assert p.stats().pageable_in_use_bytes == 0 and p.stats().in_use_bytes == 0
    p.close()


@native
def test_bad_input_is_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    page = sysinfo.page_bytes()
    with pytest.raises(ValueError, match="^torchckpt: .*chunk_bytes must be a positive multiple"):
        make(chunk=4 * MiB + 1)
    with pytest.raises(ValueError, match="^torchckpt: .*first_chunk_bytes must be a positive multiple"):
        make(first=page + page // 2)
    with pytest.raises(ValueError, match="^torchckpt: .*strategy"):
        make(strategy="eager")
    with pytest.raises(ValueError, match="^torchckpt: .*ahead_bytes=None"):
        make(strategy="whole", ahead_bytes=MiB)
    with pytest.raises(CheckpointError, match="^torchckpt: .*does not fit this host"):
        make(capacity=2 * sysinfo.physical_memory_bytes() + MiB, ahead_bytes=MiB)
    monkeypatch.setattr(lp, "available_memory_bytes", lambda: 8 * MiB)
    with pytest.raises(CheckpointError, match="^torchckpt: .*does not fit this host"):
        make(capacity=16 * MiB)  # would touch 16 MiB with only 8 available
    p = make(capacity=16 * MiB, ahead_bytes=MiB)  # touches only what is used: fine
    p.close()
    if not torch.cuda.is_available():
        with pytest.raises(CheckpointError, match="^torchckpt: .*pin=False"):
            LazyHostPool(capacity_bytes=8 * MiB, pin=True)


@native
def test_lazy_pool_serves_a_snapshot_store() -> None:
    from torchckpt.adjoint import run_schedule
    from torchckpt.schedules import Revolve, Tier
    from torchckpt.store.snapshots import SnapshotStore

    host = make(capacity=8 * MiB, chunk=MiB, first=MiB, mode="fake")
    assert isinstance(host, HostPoolBase) and not isinstance(host, HostPool)  # composes Blocks, inherits no pool
    x, log = [torch.tensor([1.0])], []
    run_schedule(
        Revolve(6, 2, tier=Tier.HOST),
        forward=lambda n0, n1: x.__setitem__(0, x[0] * 2 ** (n1 - n0)),
        save=lambda n: x[0],
        restore=lambda n, t: x.__setitem__(0, t[0].clone()),
        backward=lambda n: log.append((n, x[0].item())),
        store=SnapshotStore("cpu", slots=2, host=host),
    )
    assert log == [(n, float(2**n)) for n in range(5, -1, -1)]
    host.close()


@native
def test_factory_env_lazy_forces_the_native_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHCKPT_HOST_POOL", "lazy")
    p = make_host_pool(pin=False, capacity_bytes=8 * MiB, chunk_bytes=MiB)
    assert isinstance(p, LazyHostPool) and not p.pin and p.ahead_bytes is None
    assert p.chunk_bounds()[0] == (0, MiB)
    p.close()


@native
@pytest.mark.parametrize("env, locked", [(None, True), ("1", True), ("0", False)])
def test_factory_serializes_registrations_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, env: str | None, locked: bool
) -> None:
    """make_host_pool's lazy pool takes the node lock by default; TORCHCKPT_NODE_LOCK=0 turns it off."""
    monkeypatch.setenv("TORCHCKPT_HOST_POOL", "lazy")
    monkeypatch.setenv("TORCHCKPT_REGISTER_LOCK", os.path.join(str(tmp_path), "reg.lock"))
    if env is None:
        monkeypatch.delenv("TORCHCKPT_NODE_LOCK", raising=False)
    else:
        monkeypatch.setenv("TORCHCKPT_NODE_LOCK", env)
    p = make_host_pool(pin=False, capacity_bytes=8 * MiB)
    assert isinstance(p, LazyHostPool)
    assert p._native is not None and p._native.lock_active() == locked
    assert p.chunk_bytes == 1 << 30  # the lazy pool's default chunk (docs/benchmarks.md)
    p.close()


def test_huge_page_bytes_sums_the_mappings_inside_the_range(tmp_path: object) -> None:
    from torchckpt.memory.sysinfo import huge_page_bytes

    smaps = os.path.join(str(tmp_path), "smaps")
    with open(smaps, "w") as f:
        f.write(
            "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n"
            "Size:               4096 kB\nAnonHugePages:      2048 kB\n"
            "7f0000400000-7f0000800000 rw-p 00000000 00:00 0 \n"
            "Size:               4096 kB\nAnonHugePages:      4096 kB\n"
            "7f0000800000-7f0000a00000 rw-p 00000000 00:00 0 \n"
            "Size:               2048 kB\nAnonHugePages:      2048 kB\n"
        )
    base = 0x7F0000000000
    assert huge_page_bytes(base, 8 << 20, smaps) == 6 << 20  # the first two, not the third
    assert huge_page_bytes(base + (4 << 20), 6 << 20, smaps) == 6 << 20  # the last two
    assert huge_page_bytes(base, 2 << 20, smaps) == 0  # no mapping lies wholly inside
    assert huge_page_bytes(base, 8 << 20, os.path.join(str(tmp_path), "missing")) is None


@native
def test_stats_report_huge_page_backing() -> None:
    p = make(capacity=32 * MiB, chunk=8 * MiB, first=8 * MiB, mode="none")
    assert p.wait_ready(timeout=30)
    s = p.lazy_stats()
    if os.path.exists("/proc/self/smaps"):
        assert s.huge_page_bytes is not None and 0 <= s.huge_page_bytes <= p.capacity_bytes
    assert p.lazy_stats(huge_pages=False).huge_page_bytes is None
    p.close()


class _Recorder:
    """Stands in for the native pool: forwards every call and records its name."""

    def __init__(self, native: object) -> None:
        self._native = native
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._native, name)
        if not callable(attr):
            return attr

        def call(*a: object) -> object:
            self.calls.append(name)
            return attr(*a)

        return call


class _Stream:
    cuda_stream = 0


@native
@pytest.mark.parametrize("strategy", ["sequential", "concurrent"])
def test_note_copy_tracks_only_under_sequential_and_only_until_done(strategy: str) -> None:
    """NOTE [ Lazy host pool ] Rule 7: the stores' per-copy report costs no native call unless the worker runs sequential."""
    p = make(capacity=8 * MiB, chunk=4 * MiB, first=4 * MiB, strategy=strategy, ahead_bytes=0)
    real = p._native
    rec = _Recorder(real)
    p._native = rec  # type: ignore[assignment]
    try:
        p.note_copy(_Stream())
        if strategy == "sequential":
            assert rec.calls == ["done", "track_copy"]
        else:
            assert rec.calls == []
        p._native = real
        p.alloc(3 * MiB), p.alloc(3 * MiB)  # blocks in both chunks: the worker may now finish the pool
        assert p.wait_ready(timeout=30)
        p._native = rec  # type: ignore[assignment]
        rec.calls.clear()
        p.note_copy(_Stream())
        p.note_copy(_Stream())
        assert rec.calls == (["done"] if strategy == "sequential" else [])  # done: tracking stops
    finally:
        p._native = real
        p.close()


@native
def test_unopenable_node_lock_warns_with_lock_advice(tmp_path: object) -> None:
    """A lock file that cannot be opened leaves registrations unserialized, and the warning says
    how to fix the lock (not the locked-memory limit)."""
    p = make(capacity=8 * MiB, chunk=4 * MiB, first=MiB, node_lock=True,
             lock_path=os.path.join(str(tmp_path), "missing-dir", "reg.lock"))
    assert p.wait_ready(timeout=30)
    assert p.chunk_states() == [REGISTERED] * len(p.chunk_bounds())  # still pinned, only not serialized
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p.alloc(MiB)
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1 and "node registration lock" in msgs[0] and "TORCHCKPT_REGISTER_LOCK" in msgs[0]
    assert "RLIMIT_MEMLOCK" not in msgs[0]
    p.close()


@native
def test_settle_waits_for_the_chunks_the_limit_reaches_and_no_further() -> None:
    # NOTE [ Lazy host pool ] Rule 11; 1 MiB chunks, 2 ms a fake registration: the limit (first chunk + 8 MiB) reaches 9.
    p = make(capacity=64 * MiB, chunk=MiB, first=MiB, mode="fake", ahead_bytes=8 * MiB)
    assert p.settle(timeout=10.0)
    states = p.chunk_states()
    assert states[:9] == [REGISTERED] * 9 and states[9:] == [UNTOUCHED] * (len(states) - 9)
    blocks = [p.alloc(MiB) for _ in range(12)]  # chunks 0-11: the limit moves to 12 + 8 MiB
    assert blocks[-1].chunk == 11
    assert p.settle(timeout=10.0)
    states = p.chunk_states()
    assert states[:20] == [REGISTERED] * 20 and states[20:] == [UNTOUCHED] * (len(states) - 20)
    for b in blocks:
        p.free(b)
    p.close()


@native
def test_settle_gives_up_after_its_timeout_and_is_true_without_pinning() -> None:
    p = make(capacity=16 * MiB, chunk=4 * MiB, first=MiB, mode="none")
    assert p.settle(timeout=0.0)  # nothing is registered without pinning: nothing to wait for
    p.close()
    q = make(capacity=256 * MiB, chunk=MiB, first=MiB, mode="fake")  # 2 ms a registration, 256 chunks
    assert not q.settle(timeout=0.01)
    assert q.settle(timeout=30.0)
    assert all(s == REGISTERED for s in q.chunk_states())
    q.close()
    assert HostPool(capacity_bytes=MiB, chunk_bytes=MiB, pin=False).settle(timeout=0.0)
