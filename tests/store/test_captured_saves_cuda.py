"""CUDA: ``SnapshotStore(defer_sizes=True, graphs=True)`` replays each off-GPU save's compression as CUDA graphs (NOTE
[ Captured saves ]; issue 26, Deliver 2): every restore gives the eager store's bits, under delayed copies, forced
settles and a busy compute stream; a save issues no host synchronisation; the saves launch graphs, not the codec's
kernels one by one.

    python -m pytest -q -p no:cacheprovider tests/store/test_captured_saves_cuda.py

``TORCHCKPT_GRAPH_FUZZ_EXAMPLES`` (default 40) sets the differential fuzz's random schedules.
"""
from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_models import assert_bits_equal
from test_nosync_save_cuda import counting, cuda_state, expected, lagged, no_host_sync, pool, step
from test_snapshot_sizes import never_sized, replay
from torchckpt.adjoint import run_schedule
from torchckpt.codecs import Bitcomp, Codec, Identity, TritonQuant
from torchckpt.schedules import Multistage, Revolve, Save, Tier, Uniform, ZCut, plan_flushes, plan_prefetch
from torchckpt.store import SnapshotStore
from torchckpt.store.snapshot_graphs import KEYS

pytestmark = pytest.mark.cuda


def codecs() -> list[Any]:
    """TritonQuant with and without raw blocks (its settle gathers them), and Bitcomp where nvCOMP loads."""
    out: list[Any] = [TritonQuant(4, "abs", 1e-2), TritonQuant(8, "abs", 1e-9, block=64)]
    b = Bitcomp(delta=1e-3)
    out.append(b if b.is_available() else pytest.param(b, marks=pytest.mark.skip(reason=b.unavailable_reason() or "")))
    return out


def fixed_state() -> Callable[[int], list[torch.Tensor]]:
    """State n written into the same two buffers at every save (a loop updating its state in place)."""
    bufs = [t.clone() for t in cuda_state(0)]

    def state(n: int) -> list[torch.Tensor]:
        for b, t in zip(bufs, cuda_state(n)):
            b.copy_(t)
        return bufs
    return state


@pytest.mark.parametrize("codec", codecs(), ids=repr)
@pytest.mark.parametrize("sched", [Revolve(30, 4, tier=Tier.HOST), ZCut(30, tier=Tier.HOST), Uniform(30, 5, tier=Tier.HOST),
                                   Multistage(30, gpu_slots=1, host_slots=2)], ids=repr)
@pytest.mark.parametrize("lag", ["as it comes", "forced", "compute busy"])
def test_every_restore_is_the_eager_bits(codec: Codec, sched: Any, lag: str) -> None:
    """Prefetched and written back, copies and size reads delayed at random (or every settle forced, or the compute
    stream busy before each action): each restore, as views and into the caller's tensors, gives the exact store's
    bits, and the off-GPU saves after the first were replayed (NOTE [ Captured saves ] Rules 3, 5)."""
    for into in (False, True):
        actions = list(plan_prefetch(sched, 2))
        store = SnapshotStore("cuda", defer_sizes=True, graphs=True, slots=2, host=pool(), codec=codec)
        lagged(store, lag, random.Random(11))
        memo: dict[int, list[torch.Tensor]] = {}
        assert replay(store, actions, lambda n: memo.setdefault(n, expected(codec, n)), plan_flushes(actions, 2),
                      into=into, state=fixed_state()) > 0
        store._mover.delay = None
        st = store.stats()
        assert 0 < st.graph_saves <= st.host_saves - 1  # not the first (calibrate's), nor one that finds every slot pinned
        assert 0 < st.graph_captures <= 3 * 2  # ring entries x the state's two buffers
        store.close()


@pytest.mark.parametrize("codec", codecs(), ids=repr)
def test_a_save_replays_graphs_and_never_syncs(codec: Codec) -> None:
    """After the ring's captures, each save runs with no host synchronisation and launches two graphs (one per
    tensor), with fewer kernel launches than the eager store's saves; the restores are the eager bits."""
    def saves(graphs: bool) -> tuple[list[str], SnapshotStore]:
        store = SnapshotStore("cuda", defer_sizes=True, graphs=graphs, slots=3, host=pool(), codec=codec)
        state = fixed_state()
        x = torch.randn(1 << 16, device="cuda")
        for n in range(8):  # warm-up: the first snapshot sizes the slots, then every ring entry is captured
            store.save(n, Tier.HOST, state(n))
            step(x)
        for n in range(8):
            store.free(n, Tier.HOST)
        calls: list[str] = []
        for n in range(10, 22):  # 12 saves under the synchronisation check, then 12 whose calls are counted
            s = state(n)
            torch.cuda.synchronize()  # outside the block: the sizes of the saves before are on the host
            with no_host_sync():
                store.save(n, Tier.HOST, s)
                step(x)
        for n in range(10, 22):
            store.free(n, Tier.HOST)
        for n in range(30, 42):
            s = state(n)
            torch.cuda.synchronize()
            with counting(calls, every=True):
                store.save(n, Tier.HOST, s)
                step(x)
        return calls, store

    eager_calls, eager = saves(False)
    eager.close()
    calls, store = saves(True)
    assert calls.count("cudaGraphLaunch") == 2 * 12, calls
    assert "cudaGraphLaunch" not in eager_calls
    assert _launches(calls) < _launches(eager_calls), (_launches(calls), _launches(eager_calls))
    assert store.stats().graph_saves >= 24
    for n in range(41, 29, -1):
        assert_bits_equal([t.clone() for t in store.restore(n, Tier.HOST)], expected(codec, n))
        store.after_use()
    store.close()


@pytest.mark.parametrize("codec", codecs(), ids=repr)
def test_a_replayed_save_reads_no_size_back(codec: Codec) -> None:
    """NOTE [ Captured saves ] Rule 7: once every entry is captured, a save's sizes come back through its graphs' own
    pinned rows (the mover reads nothing back for it), under delayed copies and a busy compute stream; each restore
    is the eager bits."""
    store = SnapshotStore("cuda", defer_sizes=True, graphs=True, slots=3, host=pool(), codec=codec)
    state = fixed_state()
    x = torch.randn(1 << 16, device="cuda")
    for n in range(8):  # the first snapshot sizes the slots, then every ring entry is captured
        store.save(n, Tier.HOST, state(n))
    for n in range(8):
        store.free(n, Tier.HOST)
    reads: list[int] = []
    read_back = store._mover.read_back
    store._mover.read_back = lambda *a, **k: (reads.append(1), read_back(*a, **k))[1]
    rng = random.Random(5)
    store._mover.delay = lambda kind, stream: torch.cuda._sleep(rng.randint(0, 2_000_000))
    before = store.stats().graph_saves
    for n in range(10, 22):
        torch.cuda._sleep(rng.randint(0, 4_000_000))  # the compute stream busy: the rows are written late
        store.save(n, Tier.HOST, state(n))
        step(x)
    assert reads == [] and store.stats().graph_saves - before == 12
    for n in range(21, 9, -1):
        assert_bits_equal([t.clone() for t in store.restore(n, Tier.HOST)], expected(codec, n))
        store.after_use()
    store.close()


def _launches(calls: list[str]) -> int:
    return sum(1 for c in calls if c in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"))


@pytest.mark.parametrize("codec", [TritonQuant(4, "abs", 1e-2), TritonQuant(8, "abs", 1e-9, block=64)], ids=repr)
@pytest.mark.parametrize("sched", [ZCut(60, tier=Tier.HOST), Revolve(60, 6, tier=Tier.HOST)], ids=repr)
def test_a_loop_sees_the_eager_states(codec: Codec, sched: Any) -> None:
    """run_schedule over a state updated in place (``restore_into``): every state the adjoint sees is the eager
    store's, and every off-GPU save after the first replayed graphs."""
    init = torch.linspace(-1, 1, 8192, device="cuda")
    init[::1000] = float("nan")
    u = init.clone()
    seen: dict[int, torch.Tensor] = {}

    def forward(n0: int, n1: int) -> None:
        for k in range(n0, n1):
            u.copy_(torch.sin(u * 1.01 + k))
            step(u)

    def run(store: SnapshotStore) -> tuple[dict[int, torch.Tensor], Any]:
        u.copy_(init)
        seen.clear()
        st = run_schedule(sched, forward=forward, save=lambda n: u, restore_into=lambda n: u,
                          backward=lambda n: seen.__setitem__(n, u.clone()), store=store)
        store.close()
        return dict(seen), st

    want, _ = run(SnapshotStore("cuda", defer_sizes=True, slots=3, host=pool(), codec=codec, timing=False))
    got, st = run(SnapshotStore("cuda", defer_sizes=True, graphs=True, slots=3, host=pool(), codec=codec, timing=False))
    assert sorted(got) == sorted(want) == list(range(60))
    for n in want:
        assert_bits_equal([got[n]], [want[n]])
    assert 0 < st.graph_saves <= st.host_saves - 1 and 0 < st.graph_captures <= 3  # one tensor, three ring entries


def test_a_state_at_new_addresses_is_compressed_eagerly_with_a_warning() -> None:
    """More than ``KEYS`` distinct tensors per ring entry: the rest are compressed eagerly (the same bits), with one
    warning that says to keep the state in place (NOTE [ Captured saves ] Rule 1)."""
    codec = TritonQuant(4, "abs", 1e-2)
    store = SnapshotStore("cuda", defer_sizes=True, graphs=True, slots=4, host=pool(), codec=codec)
    kept = []
    with pytest.warns(RuntimeWarning, match="distinct addresses"):
        for n in range(3 * KEYS + 8):
            s = cuda_state(n)  # fresh tensors each time
            kept.append(s)  # alive, so no address comes back
            store.save(n, Tier.HOST, s)
            if n >= 3:
                store.free(n - 3, Tier.HOST)
    st = store.stats()
    assert st.graph_saves == 3 * KEYS // 2  # each ring entry filled by two saves of two fresh tensors, then eager
    for n in range(3 * KEYS + 5, 3 * KEYS + 8):
        assert_bits_equal([t.clone() for t in store.restore(n, Tier.HOST)], expected(codec, n))
        store.after_use()
    store.close()


def test_graphs_need_a_capturable_codec() -> None:
    with pytest.raises(ValueError, match=r"torchckpt: SnapshotStore\(graphs=True\): Identity"):
        SnapshotStore("cuda", defer_sizes=True, graphs=True, codec=Identity())
    with pytest.raises(ValueError, match="defer_sizes=True"):
        SnapshotStore("cuda", graphs=True, codec=TritonQuant(4, "abs", 1e-2))
    assert not TritonQuant(4, "abs", 1e-2, use_triton=False).capturable(torch.device("cuda"))


@settings(max_examples=int(os.environ.get("TORCHCKPT_GRAPH_FUZZ_EXAMPLES", "40")), deadline=None)
@given(kind=st.sampled_from(["revolve", "zcut", "uniform", "multistage"]), n=st.integers(6, 40),
       snaps=st.integers(2, 6), slots=st.integers(1, 4), codec=st.sampled_from([0, 1]),
       forced=st.booleans(), into=st.booleans(), seed=st.integers(0, 2**16))
def test_random_schedules_restore_the_eager_bits(kind: str, n: int, snaps: int, slots: int, codec: int,
                                                 forced: bool, into: bool, seed: int) -> None:
    """Differential fuzz of NOTE [ Captured saves ]: a random schedule, slot count and codec, settles forced or not,
    copies delayed at random; graphed saves restore the bits of the codec's exact round trip at every restore."""
    sched = {"revolve": lambda: Revolve(n, snaps, tier=Tier.HOST), "zcut": lambda: ZCut(n, tier=Tier.HOST),
             "uniform": lambda: Uniform(n, snaps, tier=Tier.HOST),
             "multistage": lambda: Multistage(n, gpu_slots=1, host_slots=snaps)}[kind]()
    c = [TritonQuant(4, "abs", 1e-2), TritonQuant(8, "abs", 1e-9, block=64)][codec]
    actions = list(plan_prefetch(sched, slots))
    store = SnapshotStore("cuda", defer_sizes=True, graphs=True, slots=slots, host=pool(), codec=c)
    rng = random.Random(seed)
    store._mover.delay = lambda kind, stream: torch.cuda._sleep(rng.randint(0, 1_000_000))
    if forced:
        never_sized(store)
    memo: dict[int, list[torch.Tensor]] = {}
    replay(store, actions, lambda k: memo.setdefault(k, expected(c, k)), plan_flushes(actions, slots), into=into,
           state=fixed_state())
    store._mover.delay = None
    assert store.stats().graph_captures <= 3 * 2
    store.close()


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("lag", ["as it comes", "forced"])
def test_the_ring_follows_sizes_in_flight(k: int, lag: str) -> None:
    """NOTE [ Captured saves ] Rule 2: with ``sizes_in_flight=k`` the ring has ``k + 1`` entries (each captured for
    both state buffers at most), and every restore is still the exact round trip's bits."""
    codec = TritonQuant(8, "abs", 1e-9, block=64)
    sched = ZCut(40, tier=Tier.HOST)
    actions = list(plan_prefetch(sched, 3))
    store = SnapshotStore("cuda", defer_sizes=True, graphs=True, slots=3, host=pool(), codec=codec, sizes_in_flight=k)
    if lag == "forced":
        never_sized(store)
    memo: dict[int, list[torch.Tensor]] = {}
    assert replay(store, actions, lambda n: memo.setdefault(n, expected(codec, n)), plan_flushes(actions, 3),
                  state=fixed_state()) > 0
    st = store.stats()
    assert store._graphs is not None and len(store._graphs._graphs) == k + 1
    assert 0 < st.graph_captures <= 2 * (k + 1) and st.graph_saves > 0
    store.close()


def test_close_gives_the_graphs_memory_back() -> None:
    """The ring's graphs hold their deferred buffers in pools of their own; ``close`` lets them go, with the garbage
    collector off (no reference cycle keeps them): the allocated memory returns to what it was before the store,
    and a store made after reuses it."""
    import gc

    codec = TritonQuant(4, "abs", 1e-2)
    state = fixed_state()
    state(0)
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    gc.disable()
    try:
        for _ in range(2):
            store = SnapshotStore("cuda", defer_sizes=True, graphs=True, slots=2, host=pool(), codec=codec)
            for n in range(8):
                store.save(n, Tier.HOST, state(n))
                if n >= 2:
                    store.free(n - 2, Tier.HOST)
            assert store.stats().graph_captures > 0
            held = torch.cuda.memory_allocated()
            assert held > before
            store.close()
            del store
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == before, (torch.cuda.memory_allocated(), before)
    finally:
        gc.enable()


@pytest.mark.parametrize("codec", codecs(), ids=repr)
def test_close_gives_the_graphs_memory_back_to_the_driver(codec: Codec) -> None:
    """NOTE [ Captured saves ] Rule 9: the ring's graphs capture into pools of their own that ``close`` empties: after
    each store's close no segment of a private pool is left beyond those there before (with the pools of
    ``capture_begin``'s own handles, each store's graphs left theirs cached: hundreds of MiB here)."""
    import gc

    def private() -> int:
        """Bytes of the allocator's segments in private pools (CUDA graphs', MemPools')."""
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg["segment_pool_id"]) != (0, 0))

    big = [torch.empty(16 << 20, device="cuda") for _ in range(2)]  # 64 MiB each
    gc.collect()
    torch.cuda.empty_cache()
    before = private()
    for _ in range(3):
        store = SnapshotStore("cuda", defer_sizes=True, graphs=True, slots=2, host=pool(), codec=codec)
        for n in range(6):
            g = torch.Generator("cuda").manual_seed(n)
            for i, b in enumerate(big):
                b.normal_(generator=g).mul_(i + 1)
            store.save(n, Tier.HOST, big)
            if n >= 2:
                store.free(n - 2, Tier.HOST)
        assert store.stats().graph_captures > 0
        assert private() > before  # the graphs' buffers
        store.close()
        del store
        torch.cuda.synchronize()
        assert private() == before, (private(), before)


@pytest.mark.parametrize("codec", codecs(), ids=repr)
def test_a_capture_short_of_memory_empties_the_cache_and_captures_again(codec: Codec) -> None:
    """NOTE [ Captured saves ] Rule 6: a destroyed graph (here one of the caller's own) leaves its memory in the
    allocator's cache, which it does not give back during a capture. With a memory limit set after a store's first
    eager warm-up (Rule 4) that leaves room only in that cache, its first capture runs out of memory, the cache is
    emptied and the capture made again, and the restore is the exact round trip's bits."""
    import gc

    big = [torch.empty(16 << 20, device="cuda") for _ in range(2)]  # 64 MiB each: each capture needs tens of MiB

    def state(n: int) -> list[torch.Tensor]:
        g = torch.Generator("cuda").manual_seed(n)
        for i, b in enumerate(big):
            b.normal_(generator=g).mul_(i + 1)
        return big

    def saves(store: SnapshotStore, count: int) -> None:
        for n in range(count):
            store.save(n, Tier.HOST, state(n))
            if n >= 2:
                store.free(n - 2, Tier.HOST)

    gc.collect()
    torch.cuda.empty_cache()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a destroyed graph of someone else's, its pool's 640 MiB left cached
        other = torch.cuda.CUDAGraph()
        other.capture_begin()
        scratch = torch.empty(640 << 20, dtype=torch.uint8, device="cuda")  # room for the ring's six captures
        scratch.fill_(1)
        other.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    del scratch, other
    torch.cuda.synchronize()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    assert cached > 64 << 20, cached  # the destroyed graph's pool, still reserved

    eager = codec.compress_deferred
    limited: list[bool] = []

    def warm_then_limit(t: torch.Tensor, *args: Any) -> Any:
        """The codec's own call; after the ring's first eager warm-up (on its own stream, not capturing) the process
        may reserve only 16 MiB more than it holds (cached blocks included)."""
        d = eager(t, *args)
        on_ring = torch.cuda.current_stream() != torch.cuda.default_stream()
        if on_ring and not limited and not torch.cuda.is_current_stream_capturing():
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (16 << 20)) / total)
            limited.append(True)
        return d

    setattr(codec, "compress_deferred", warm_then_limit)  # noqa: B010 - this codec's only, undone below
    try:
        second = SnapshotStore("cuda", defer_sizes=True, graphs=True, slots=2, host=pool(), codec=codec)
        saves(second, 6)
        st = second.stats()
        assert limited and st.graph_retries == 1 and st.graph_saves > 0, st
        got = [t.clone() for t in second.restore(5, Tier.HOST)]
        second.close()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        del codec.compress_deferred
    assert_bits_equal(got, [codec.decompress(codec.compress(t)) for t in state(5)])
