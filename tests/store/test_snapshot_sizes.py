"""A ``SnapshotStore(defer_sizes=True)`` with a codec keeps compressed sizes on the device at save (NOTE [ Snapshot
sizes ]), on the CPU; without ``defer_sizes`` (the default) every save compresses exactly (Rules 4, 7).

Every restore gives ``decompress(compress(x))`` of the saved state bit for bit, whether it decodes a snapshot that
is still unsized (its deferred buffers), a slot or a host block; the tests keep snapshots unsized for as long as the
store lets them (``_sized`` is the seam) to reach every forced settle: more than ``_MAX_UNSIZED`` at once, an
eviction, ``free`` and a save again of an unsized snapshot, ``stats`` and ``close``.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_models import assert_bits_equal, replay_snapshots, small_pool
from torchckpt.codecs import Bitcomp, Codec, Identity, TritonQuant
from torchckpt.schedules import Multistage, Revolve, Save, Tier, Uniform, ZCut, plan_flushes, plan_prefetch
from torchckpt.store import SnapshotStore
from torchckpt.store import snapshot_codec


def wild(n: int) -> list[torch.Tensor]:
    """State n: smooth and wild float32/bf16 fields with NaN (payloads), Inf and subnormals; a function of n."""
    g = torch.Generator().manual_seed(3000 + n)
    a = torch.cumsum(torch.randn(2000, generator=g), 0) * 1e-2
    a[(n * 37) % 2000:][:300] = torch.randn(300, generator=g) * 10 ** (n % 7)  # blocks kept raw at tight bounds
    a[n % 11::503] = float("nan")
    a.view(torch.int32)[7::997] = 0x7F800003 + n  # NaN payloads
    a[900 + n % 5] = float("inf")
    a[1500:1510] = 1e-41
    b = (torch.randn(3, 333, generator=g) * (n + 1)).to(torch.bfloat16)
    b[0, n % 333] = float("-inf")
    return [a, b]


def codecs() -> list[Any]:
    out: list[Any] = [TritonQuant(8, "abs", 1e-3), TritonQuant(4, "rel", 0.1), TritonQuant(8, "rel", 0.05, fmt="e4m3"),
                      TritonQuant(8, "abs", 1e-9, block=64), Identity()]
    b = Bitcomp()
    out.append(b if b.is_available() else pytest.param(b, marks=pytest.mark.skip(reason=b.unavailable_reason() or "")))
    return out


def expected(codec: Codec, n: int) -> list[torch.Tensor]:
    """What a restore of snapshot n must give: the codec's round trip of the state, as before sizes were deferred."""
    return [codec.decompress(codec.compress(t)) for t in wild(n)]


def never_sized(store: SnapshotStore) -> SnapshotStore:
    """The store never finds a size on the host by itself: every settle is forced (NOTE [ Snapshot sizes ] Rule 3)."""
    store._sized = lambda rec: False  # type: ignore[method-assign]
    return store


def deferred(codec: Any, slots: int) -> SnapshotStore:
    """A CPU ``SnapshotStore(defer_sizes=True)`` with ``codec`` and ``slots``, every settle forced (``never_sized``)."""
    return never_sized(SnapshotStore("cpu", defer_sizes=True, slots=slots, host=small_pool(), codec=codec))


def replay(store: SnapshotStore, actions: list[Any], want: Callable[[int], list[torch.Tensor]],
           flushes: frozenset[int] | None = None, into: bool = False,
           state: Callable[[int], list[torch.Tensor]] = wild) -> int:
    """Run the actions; every restore (views, or into the caller's tensors) must give ``want(n)`` bit for bit."""
    return replay_snapshots(store, actions, state, flushes, want=want, into=into)


SCHEDULES = [Revolve(30, 4, tier=Tier.HOST), ZCut(30, tier=Tier.HOST), Uniform(30, 5, tier=Tier.HOST),
             Revolve(20, 4, tier=Tier.GPU), Multistage(30, gpu_slots=2, host_slots=3),
             Multistage(30, gpu_slots=1, host_slots=2, disk_slots=2)]


@pytest.mark.parametrize("codec", codecs(), ids=repr)
@pytest.mark.parametrize("sched", SCHEDULES, ids=repr)
@pytest.mark.parametrize("lag", ["next action", "forced"])
def test_every_restore_is_the_codecs_round_trip(codec: Codec, sched: Any, lag: str, tmp_path: Path) -> None:
    """Prefetched, write-back, with a disk tier: each restore is decompress(compress(x)) bit for bit, and the stats
    count the bytes compress gives."""
    slots = 3
    actions = list(plan_prefetch(sched, slots))
    flushes = plan_flushes(actions, slots)
    store = SnapshotStore("cpu", defer_sizes=True, slots=slots, host=small_pool(), codec=codec, disk=tmp_path)
    if lag == "forced":
        never_sized(store)
    memo: dict[int, list[torch.Tensor]] = {}
    restores = replay(store, actions, lambda n: memo.setdefault(n, expected(codec, n)), flushes)
    assert restores > 0
    st = store.stats()
    assert not store._unsized and not store._sizing
    saves = [a.n for a in actions if isinstance(a, Save)]
    assert st.saves == len(saves)
    assert st.raw_bytes == sum(t.nbytes for n in saves for t in wild(n))
    assert st.packed_bytes == sum(codec.compress(t).nbytes for n in saves for t in wild(n))
    deferring = codec.compress_deferred(wild(0)[0]).sizes is not None
    assert (st.size_waits > 0) == (lag == "forced" and deferring)
    store.close()


@pytest.mark.parametrize("codec", codecs()[:2], ids=repr)
def test_restore_into_the_callers_tensors(codec: Codec) -> None:
    sched = Revolve(25, 3, tier=Tier.HOST)
    for lag in ("next action", "forced"):
        store = SnapshotStore("cpu", defer_sizes=True, slots=2, host=small_pool(), codec=codec)
        if lag == "forced":
            never_sized(store)
        assert replay(store, list(plan_prefetch(sched, 2)), lambda n: expected(codec, n), into=True) > 0
        store.close()


def test_an_unsized_snapshot_lives_beside_its_slot_and_decodes_as_it_is() -> None:
    """Saved, a snapshot is unsized: the slot is not written, the host holds nothing; a restore decodes the deferred
    buffers; the next action settles it (the slot written, flushed to a block of the exact blob size)."""
    c = TritonQuant(8, "abs", 1e-6)
    store = SnapshotStore("cpu", defer_sizes=True, slots=2, host=small_pool(), codec=c)
    store.save(0, Tier.HOST, wild(0))  # calibrate's compression: settled at once
    assert not store._unsized and 0 in store._on_host
    store.save(1, Tier.HOST, wild(1))
    assert 1 in store._unsized and 1 not in store._on_host and 1 not in store._blobs
    assert_bits_equal([t.clone() for t in store.restore(1, Tier.HOST)], expected(c, 1))  # settles 1 first (CPU)
    store.after_use()
    assert not store._unsized and 1 in store._on_host
    assert store._on_host[1][0].tensor.numel() == store._blobs[1].nbytes
    store.save(2, Tier.HOST, wild(2))
    never_sized(store)
    assert_bits_equal([t.clone() for t in store.restore(2, Tier.HOST)], expected(c, 2))  # from the deferred buffers
    store.after_use()
    assert 2 in store._unsized
    assert store.stats().size_waits == 1 and not store._unsized  # stats waits for it
    store.close()


def test_forced_settles_bound_eviction_free_and_save_again() -> None:
    c = TritonQuant(4, "abs", 1e-4)
    store = deferred(c, 3)
    store.save(0, Tier.HOST, wild(0))
    for n in (1, 2):
        store.save(n, Tier.HOST, wild(n))
    assert list(store._unsized) == [1, 2] and store._c["size_waits"] == 0
    store.save(3, Tier.GPU, wild(3))  # a third: the oldest is settled (NOTE [ Snapshot sizes ] Rule 3)
    assert list(store._unsized) == [2, 3] and store._c["size_waits"] == 1 and 1 in store._on_host
    packed = store._c["packed_bytes"]
    store.save(2, Tier.HOST, wild(5))  # saved again while unsized: the old one is settled only to be counted
    assert list(store._unsized) == [3, 2] and store._c["size_waits"] == 2
    assert store._c["packed_bytes"] == packed + sum(c.compress(t).nbytes for t in wild(2))
    assert 2 not in store._on_host and 2 not in store._blobs  # the old compression never reached the slot or host
    store.free(3, Tier.GPU)  # freed while unsized
    assert list(store._unsized) == [2] and 3 not in store._packs
    store.save(4, Tier.HOST, wild(4))  # slots hold 0, 1, 2: the least recent (0) is evicted
    store.save(6, Tier.HOST, wild(6))  # evicts 1
    store.save(7, Tier.HOST, wild(7))  # evicts 2
    for n, state in ((2, 5), (0, 0), (4, 4), (7, 7), (1, 1)):
        assert_bits_equal([t.clone() for t in store.restore(n, Tier.HOST)], expected(c, state))
        store.after_use()
    store.free(6, Tier.HOST)
    st = store.stats()
    assert not store._unsized and not store._sizing
    assert st.packed_bytes == sum(c.compress(t).nbytes for n in (0, 1, 2, 3, 5, 4, 6, 7) for t in wild(n))
    store.close()


@pytest.mark.parametrize("flush", [True, False])
def test_an_evicted_unsized_snapshot_is_settled_and_flushed_first(flush: bool) -> None:
    c = TritonQuant(8, "abs", 1e-5)
    store = deferred(c, 2)
    store.save(0, Tier.HOST, wild(0))
    store.save(1, Tier.HOST, wild(1), flush=flush)
    store.save(2, Tier.HOST, wild(2), flush=flush)  # evicts 0 (settled at its save)
    assert list(store._unsized) == [1, 2]
    store.save(3, Tier.HOST, wild(3))  # evicts 1, unsized: settled, written, flushed (write-back too) first
    assert 1 not in store._unsized and 1 in store._on_host and store._c["size_waits"] == 1
    store.prefetch(1, Tier.HOST, Tier.GPU)  # evicts 2, unsized
    assert 2 not in store._unsized and 2 in store._on_host and store._c["size_waits"] == 2
    for n in (1, 3, 2, 0):
        assert_bits_equal([t.clone() for t in store.restore(n, Tier.HOST)], expected(c, n))
        store.after_use()
    store.close()


def test_close_with_unsized_snapshots() -> None:
    c = TritonQuant(8, "abs", 1e-3)
    store = deferred(c, 2)
    store.save(0, Tier.HOST, wild(0))
    store.save(1, Tier.HOST, wild(1))
    store.save(2, Tier.GPU, wild(2))
    assert list(store._unsized) == [1, 2]
    store.close()
    assert not store._unsized and not store._packs


def test_a_codec_that_defers_nothing_settles_at_save() -> None:
    store = SnapshotStore("cpu", defer_sizes=True, slots=2, host=small_pool(), codec=Identity())
    for n in range(4):
        store.save(n, Tier.HOST if n % 2 else Tier.GPU, wild(n))
        assert not store._unsized
    assert_bits_equal([t.clone() for t in store.restore(3, Tier.HOST)], wild(3))
    store.close()


def test_unsized_gpu_snapshots_keep_trimmed_copies_once_settled() -> None:
    """A settled GPU-tier snapshot holds buffers of compress's sizes, none viewing the deferred ones."""
    c = TritonQuant(8, "abs", 1e-9)  # most blocks raw: the deferred raw buffer is as large as the tensor
    store = SnapshotStore("cpu", defer_sizes=True, slots=1, host=small_pool(), codec=c)
    store.save(0, Tier.GPU, wild(0))
    store.save(1, Tier.GPU, wild(1))
    assert 1 in store._unsized
    store.restore(0, Tier.GPU)  # an action: 1 is settled
    assert not store._unsized
    for p, q in zip(store._packs[1], (c.compress(t) for t in wild(1))):
        assert [b.untyped_storage().nbytes() for b in p.buffers] == [b.nbytes for b in q.buffers]
    assert_bits_equal(store.restore(1, Tier.GPU), expected(c, 1))
    store.close()


def test_bound_is_small() -> None:
    assert 1 <= snapshot_codec._MAX_UNSIZED <= 4  # each unsized snapshot holds about its own size in deferred buffers


# -- the default: the exact compress (NOTE [ Snapshot sizes ] Rules 4, 7) --------------------------------------------
class _NoDeferral(TritonQuant):
    """TritonQuant whose ``compress_deferred`` must not be called."""

    def compress_deferred(self, x: torch.Tensor, stream: Any = None) -> Any:
        raise AssertionError("torchckpt test: compress_deferred called without defer_sizes")


def test_defer_sizes_is_off_by_default_and_a_bool() -> None:
    assert SnapshotStore("cpu").defer_sizes is False
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match=r"^torchckpt: SnapshotStore\(defer_sizes=\.\.\.\) expects True or False"):
            SnapshotStore("cpu", defer_sizes=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("sched", SCHEDULES, ids=repr)
def test_the_default_compresses_exactly_at_every_save(sched: Any, tmp_path: Path) -> None:
    """Without ``defer_sizes`` no save defers a size: ``compress_deferred`` is never called, no snapshot is unsized,
    and every restore is decompress(compress(x)) bit for bit."""
    c = _NoDeferral(8, "abs", 1e-4)
    actions = list(plan_prefetch(sched, 3))
    store = SnapshotStore("cpu", slots=3, host=small_pool(), codec=c, disk=tmp_path)
    assert replay(store, actions, lambda n: expected(c, n), plan_flushes(actions, 3)) > 0
    assert not store._unsized and not store._sizing
    st = store.stats()
    assert st.size_waits == 0
    assert st.packed_bytes == sum(c.compress(t).nbytes for a in actions if isinstance(a, Save) for t in wild(a.n))
    store.close()


@pytest.mark.parametrize("codec", codecs(), ids=repr)
@pytest.mark.parametrize("sched", SCHEDULES[:4], ids=repr)
def test_both_settings_give_the_same_bits(codec: Codec, sched: Any) -> None:
    """An adjoint loop (run_schedule, each state a function of the restored one) sees the same bits with and without
    ``defer_sizes``, forced settles included, and the stores count the same packed bytes."""
    from torchckpt.adjoint import run_schedule

    def run(store: SnapshotStore) -> tuple[dict[int, list[torch.Tensor]], Any]:
        state = wild(0)
        seen: dict[int, list[torch.Tensor]] = {}

        def forward(n0: int, n1: int) -> None:
            for k in range(n0, n1):
                nxt = wild(k + 1)
                for t, u in zip(state, nxt):  # state k+1 depends on state k (its round trip included)
                    t.copy_(u + torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0).to(t.dtype) * 1e-3)

        st = run_schedule(sched, forward=forward, save=lambda n: state, restore_into=lambda n: state,
                          backward=lambda n: seen.__setitem__(n, [t.clone() for t in state]), store=store)
        return seen, st

    got = {}
    for key in ("exact", "deferred", "forced"):
        store = SnapshotStore("cpu", slots=2, host=small_pool(), codec=codec, defer_sizes=key != "exact")
        if key == "forced":
            never_sized(store)
        got[key] = run(store)
        store.close()
    for key in ("deferred", "forced"):
        assert sorted(got[key][0]) == sorted(got["exact"][0])
        for n in got["exact"][0]:
            assert_bits_equal(got[key][0][n], got["exact"][0][n])
        assert got[key][1].packed_bytes == got["exact"][1].packed_bytes
    deferring = codec.compress_deferred(wild(0)[0]).sizes is not None
    assert got["exact"][1].size_waits == 0 and (got["forced"][1].size_waits > 0) == deferring


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("sched", [Revolve(30, 4, tier=Tier.HOST), ZCut(30, tier=Tier.HOST)], ids=repr)
def test_sizes_in_flight_bounds_the_unsized_snapshots(k: int, sched: Any) -> None:
    """NOTE [ Snapshot sizes ] Rule 3: with ``sizes_in_flight=k`` no action leaves more than ``k`` snapshots unsized
    (every settle forced, so the bound is what settles them), at least once ``k`` are, and each restore is still the
    codec's round trip."""
    codec = TritonQuant(8, "abs", 1e-3)
    store = never_sized(SnapshotStore("cpu", defer_sizes=True, slots=3, host=small_pool(), codec=codec,
                                      sizes_in_flight=k))
    seen: list[int] = []
    save = store.save

    def counted(*a: Any, **kw: Any) -> None:
        save(*a, **kw)
        seen.append(len(store._sizing))
    store.save = counted  # type: ignore[method-assign]
    actions = list(plan_prefetch(sched, 3))
    memo: dict[int, list[torch.Tensor]] = {}
    assert replay(store, actions, lambda n: memo.setdefault(n, expected(codec, n)), plan_flushes(actions, 3)) > 0
    assert max(seen) == k
    store.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_sizes_in_flight_must_be_a_positive_int(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"torchckpt: SnapshotStore\(sizes_in_flight=\.\.\.\) must be an int >= 1"):
        SnapshotStore("cpu", defer_sizes=True, codec=TritonQuant(8, "abs", 1e-3), sizes_in_flight=bad)
