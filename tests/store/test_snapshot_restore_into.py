"""``SnapshotStore.restore(n, tier, out=...)`` on device="cpu" (NOTE [ Snapshot store ] Rule 11).

Two stores replay the same schedule, one restoring into the caller's tensors, one returning views
that are copied: every restore must be bit-identical between them, in every tier (GPU, HOST, DISK
with and without a disk tier, every slot pinned) and with every codec that runs on the CPU; the
caller's tensors are the ones written (same storage), the store's memory is never lent, and no
copy or allocation beyond the codec's own decode is made (counted with a dispatch mode).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_models import assert_bits_equal, small_pool
from torchckpt import CheckpointError, SnapshotStore
from torchckpt.codecs import ZFP, Bitcomp, Codec, Identity, TritonQuant
from torchckpt.schedules import Free, Prefetch, Restore, Revolve, Save, Tier, ZCut, plan_prefetch

from test_snapshots import mixed


def floats(n: int) -> list[torch.Tensor]:
    """State n for the lossy codecs: two float32 fields, every bit a function of n."""
    g = torch.Generator().manual_seed(2000 + n)
    return [torch.cumsum(torch.randn(6, 40, generator=g), 1), torch.randn(3, 64, generator=g) * (n + 1)]


def _codecs() -> list[object]:
    out: list[object] = [None, Identity(), TritonQuant(bits=8, mode="abs", bound=1e-3), TritonQuant(bits=4, mode="rel", bound=0.1)]
    for c in (Bitcomp(), Bitcomp(delta=1e-3), ZFP(rate=12)):
        out.append(c if c.is_available() else pytest.param(c, marks=pytest.mark.skip(reason=c.unavailable_reason() or "")))
    return out


def _store(codec: Codec | None, slots: int, disk: Path | None = None) -> SnapshotStore:
    return SnapshotStore("cpu", slots=slots, host=small_pool(), codec=codec, disk=disk)


def _empty_like(state: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in state]


def _replay(schedule: list, state: Callable[[int], list[torch.Tensor]], plain: SnapshotStore,
            into: SnapshotStore) -> int:
    """Both stores run ``schedule``; each restore into ``out`` is checked against the plain one's views."""
    restores = 0
    for a in schedule:
        if isinstance(a, Save):
            plain.save(a.n, a.tier, state(a.n))
            into.save(a.n, a.tier, state(a.n))
        elif isinstance(a, Restore):
            want = [t.clone() for t in plain.restore(a.n, a.tier)]
            plain.after_use()
            out = _empty_like(want)
            ptrs = [t.data_ptr() for t in out]
            got = into.restore(a.n, a.tier, out=out)
            assert all(g is o for g, o in zip(got, out)) and [t.data_ptr() for t in out] == ptrs
            assert_bits_equal(out, want)
            assert into._pending_use is None  # the store recorded the slot's use itself (Rule 11)
            restores += 1
        elif isinstance(a, Prefetch):
            plain.prefetch(a.n, a.src, a.dst)
            into.prefetch(a.n, a.src, a.dst)
        elif isinstance(a, Free):
            plain.free(a.n, a.tier)
            into.free(a.n, a.tier)
    return restores


@pytest.mark.parametrize("codec", _codecs(), ids=repr)
@pytest.mark.parametrize("tier", [Tier.GPU, Tier.HOST, Tier.DISK])
@pytest.mark.parametrize("slots", [1, 3])
def test_restore_into_is_bit_identical_to_the_plain_restore(codec: Codec | None, tier: Tier, slots: int,
                                                             tmp_path: Path) -> None:
    state = mixed if codec is None or isinstance(codec, Identity) else floats
    for disk in ([None, tmp_path] if tier is Tier.DISK else [None]):
        sched = list(plan_prefetch(list(Revolve(12, 3, tier=tier)), slots)) + list(ZCut(7, tier=tier))
        plain, into = _store(codec, slots, disk), _store(codec, slots, disk)
        assert _replay(sched, state, plain, into) > 10
        a, b = plain.stats(), into.stats()
        assert (a.restores, a.hits, a.misses, a.bytes_to_device) == (b.restores, b.hits, b.misses, b.bytes_to_device)
        plain.close()
        into.close()


@pytest.mark.parametrize("codec", [None, Identity(), TritonQuant(bits=8, mode="abs", bound=1e-3)], ids=repr)
def test_restore_into_when_every_slot_is_pinned(codec: Codec | None) -> None:
    """NOTE [ Snapshot store ] Rule 4: no slot to fill, the host block goes straight into ``out``."""
    state = mixed if codec is None else floats
    plain, into = _store(codec, 1), _store(codec, 1)
    sched = [Save(0, Tier.HOST), Prefetch(0, Tier.GPU, Tier.GPU), Save(1, Tier.HOST), Restore(1, Tier.HOST),
             Restore(1, Tier.HOST), Restore(0, Tier.HOST)]
    assert _replay(sched, state, plain, into) == 3
    assert (plain.stats().misses, into.stats().misses) == (2, 2)


@pytest.mark.parametrize("codec", [None, Identity()], ids=repr)
def test_the_store_never_lends_its_memory(codec: Codec | None) -> None:
    """Overwriting ``out`` after a restore leaves the snapshot as it was, in every tier (GPU held uncompressed too)."""
    s = _store(codec, 2)
    for n, tier in [(0, Tier.GPU), (1, Tier.HOST)]:
        s.save(n, tier, mixed(n))
    for _ in range(2):
        for n, tier in [(0, Tier.GPU), (1, Tier.HOST)]:
            out = _empty_like(mixed(n))
            s.restore(n, tier, out=out)
            assert_bits_equal(out, mixed(n))
            for t in out:
                t.zero_()  # the caller's own state, overwritten by its next step
    s.close()


class _Count(TorchDispatchMode):
    """Counts copies and allocations of at least ``nbytes`` bytes."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes, self.copies, self.allocs = nbytes, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        big = isinstance(out, torch.Tensor) and out.numel() * out.element_size() >= self.nbytes
        if name in ("copy_", "clone", "_to_copy") and big:
            self.copies += 1
        elif name.startswith("empty") and big:
            self.allocs += 1
        return out


def _count(fn: Callable[[], object], nbytes: int) -> tuple[int, int]:
    with _Count(nbytes) as c:
        fn()
    return c.copies, c.allocs


@pytest.mark.parametrize("tier", [Tier.GPU, Tier.HOST])
def test_no_extra_copy_without_a_codec(tier: Tier) -> None:
    """One copy per tensor (the restore's), no allocation; the plain restore plus the caller's copy_ is the same
    count only because the caller copies: the views alone copy nothing."""
    x = [torch.randn(256, 256), torch.randn(256, 256)]
    s = _store(None, 2)
    s.save(0, tier, x)
    out = _empty_like(x)
    assert _count(lambda: s.restore(0, tier, out=out), 1 << 18) == (2, 0)
    assert_bits_equal(out, x)
    assert _count(lambda: (s.restore(0, tier), s.after_use()), 1 << 18) == (0, 0)


def _codec_restore_counts(codec: Codec, tier: Tier) -> tuple[tuple[int, int], tuple[int, int]]:
    x = [torch.cumsum(torch.randn(256, 256), 1)]
    s = _store(codec, 2)
    s.save(0, tier, x)
    out = _empty_like(x)
    into = _count(lambda: s.restore(0, tier, out=out), 1 << 18)

    def plain() -> None:
        for o, v in zip(out, s.restore(0, tier)):
            o.copy_(v)
        s.after_use()

    return into, _count(plain, 1 << 18)


@pytest.mark.parametrize("tier", [Tier.GPU, Tier.HOST])
def test_identity_codec_decodes_into_out(tier: Tier) -> None:
    """Identity's decode is its one copy: into ``out`` there is nothing else; decoding into a fresh tensor
    and copying it into the state costs an allocation and a second copy."""
    into, plain = _codec_restore_counts(Identity(), tier)
    assert into == (1, 0) and plain == (2, 1)


@pytest.mark.parametrize("tier", [Tier.GPU, Tier.HOST])
def test_bitcomp_decodes_into_out(tier: Tier) -> None:
    if not Bitcomp().is_available():
        pytest.skip(Bitcomp().unavailable_reason() or "")
    into, plain = _codec_restore_counts(Bitcomp(), tier)
    assert into == (0, 0) and plain == (1, 1)


def test_out_version_is_bumped_so_autograd_sees_the_overwrite() -> None:
    """Bitcomp's host decoder writes through a pointer; the store bumps ``out``'s version, so a tensor
    autograd saved and a restore overwrote fails the backward instead of giving wrong gradients."""
    if not Bitcomp().is_available():
        pytest.skip(Bitcomp().unavailable_reason() or "")
    s = _store(Bitcomp(), 2)
    s.save(0, Tier.GPU, [torch.arange(8.0)])
    buf = torch.ones(8)
    w = torch.ones(8, requires_grad=True)
    y = (w * buf).sum()  # saves buf
    v = buf._version
    s.restore(0, Tier.GPU, out=[buf])
    assert buf._version > v and torch.equal(buf, torch.arange(8.0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def _bad_outs() -> Iterator[tuple[str, object]]:
    """(what the message shows of it, a bad ``out``) for a snapshot of shapes (4,) and (3, 2), float32."""
    yield r"got \['\(4,\) torch.float32 cpu'\]", torch.empty(4)  # not a list
    yield r"got \['\(4,\) torch.float32 cpu', 'str'\]", [torch.empty(4), "u"]
    yield r"got \[\]", []
    yield r"got \['\(4,\) torch.float32 cpu'\]", [torch.empty(4)]
    yield r"cpu', '\(1,\) torch.float32 cpu'\]", [torch.empty(4), torch.empty(3, 2), torch.empty(1)]
    yield r"got \['\(5,\) torch.float32 cpu'", [torch.empty(5), torch.empty(3, 2)]
    yield r"got \['\(4,\) torch.float64 cpu'", [torch.empty(4, dtype=torch.float64), torch.empty(3, 2)]
    yield r"'\(3, 2\) torch.float32 cpu non-contiguous'", [torch.empty(4), torch.empty(2, 3).t()]
    yield r"'\(4,\) torch.float32 cpu requires grad'", [torch.empty(4, requires_grad=True), torch.empty(3, 2)]
    both = torch.empty(10)
    yield r"got overlapping \[", [both[:4], both[3:9].view(3, 2)]


@pytest.mark.parametrize("what,out", list(_bad_outs()))
@pytest.mark.parametrize("tier", [Tier.GPU, Tier.HOST])
def test_bad_out_says_what_to_pass(tier: Tier, what: str, out: object) -> None:
    s = _store(None, 2)
    s.save(0, tier, [torch.arange(4.0), torch.ones(3, 2)])
    with pytest.raises(ValueError, match=f"torchckpt: SnapshotStore.restore\\(0, {tier.name}, out=...\\) needs a list of "
                                         f"one tensor per tensor of the snapshot.*{what}.*Pass the state's own tensors"):
        s.restore(0, tier, out=out)  # type: ignore[arg-type]
    good = [torch.empty(4), torch.empty(3, 2)]
    s.restore(0, tier, out=good)  # the store is still usable
    assert torch.equal(good[0], torch.arange(4.0))


def test_restore_into_before_any_save() -> None:
    with pytest.raises(CheckpointError, match="never saved"):
        _store(None, 2).restore(0, Tier.HOST, out=[torch.empty(1)])
