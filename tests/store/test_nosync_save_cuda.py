"""CUDA: with ``SnapshotStore(defer_sizes=True)`` a save with a codec issues no host synchronisation, and every restore
is what the default (exact) save path gives (issue 26, Deliver 1; NOTE [ Snapshot sizes ], NOTE [ Codec streams ]
Rule 3).

How "no host synchronisation" is checked (``no_host_sync``), in torch 2.11:
- ``torch.cuda.set_sync_debug_mode("error")`` raises on torch's own synchronising calls (``.item()``, ``nonzero``,
  blocking copies, ``Stream.synchronize``, ``torch.cuda.synchronize``), but not on ``cudaEventSynchronize``
  (``torch.cuda.Event.synchronize`` does not ask the debug mode; it is what TritonQuant's exact ``compress`` waits
  with), so:
- ``torch.cuda.Event.synchronize``, ``torch.cuda.Stream.synchronize`` and ``torch.cuda.synchronize`` are replaced by
  functions that raise, for the block; and
- the block runs under ``torch.profiler`` and the CUDA runtime and driver calls recorded in its
  ``record_function`` window are counted with ``benchmarks/common.py``'s definition of a synchronisation (the one
  ``adjoint_codecs.py --profile`` reports: ``cudaStreamSynchronize``, ``cudaEventSynchronize``,
  ``cudaDeviceSynchronize``, blocking ``cudaMemcpy*``; here also the driver's ``cu*Synchronize``), which also sees
  native libraries (nvCOMP, Triton's launcher). A control test checks that this count does see the old save
  path's synchronisations, so a trace without runtime calls cannot pass vacuously.

    python -m pytest -q -p no:cacheprovider tests/store/test_nosync_save_cuda.py tests/codecs/test_deferred.py \
        tests/store/test_snapshot_sizes.py
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ckpt_models import assert_bits_equal
from test_snapshot_sizes import never_sized, replay, wild
from torchckpt.adjoint import run_schedule
from torchckpt.codecs import Bitcomp, Codec, Identity, TritonQuant
from torchckpt.memory import HostPool
from torchckpt.schedules import Multistage, Revolve, Save, Tier, Uniform, ZCut, plan_flushes, plan_prefetch
from torchckpt.store import SnapshotStore

pytestmark = pytest.mark.cuda

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("bench_common_nosync", os.path.join(ROOT, "benchmarks", "common.py"))
assert _spec is not None and _spec.loader is not None
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

_DRIVER_SYNCS = ("cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize")
_WINDOW = "torchckpt.test.nosync"


def codecs(reference: bool = False) -> list[Any]:
    """The codecs that defer their sizes on CUDA; with ``reference``, TritonQuant's PyTorch path too (correct but not
    free of synchronisations: its quantizer builds fp32 constants on the device from host scalars)."""
    out: list[Any] = [TritonQuant(8, "abs", 1e-3), TritonQuant(4, "rel", 0.1), TritonQuant(8, "rel", 0.05, fmt="e4m3"),
                      TritonQuant(8, "abs", 1e-9, block=64)]
    if reference:
        out.append(TritonQuant(8, "abs", 1e-3, use_triton=False))
    for c in (Bitcomp(), Bitcomp(delta=1e-3)):
        out.append(c if c.is_available() else pytest.param(c, marks=pytest.mark.skip(reason=c.unavailable_reason() or "")))
    return out


def cuda_state(n: int) -> list[torch.Tensor]:
    return [t.cuda() for t in wild(n)]


def expected(codec: Codec, n: int) -> list[torch.Tensor]:
    """The old behaviour: the exact ``compress`` (which reads its sizes back) and ``decompress``, on the GPU."""
    return [codec.decompress(codec.compress(t)) for t in cuda_state(n)]


def pool() -> HostPool:
    return HostPool(capacity_bytes=512 << 20, chunk_bytes=8 << 20, pin=True)


@contextlib.contextmanager
def counting(found: list[str], every: bool = False) -> Iterator[None]:
    """Profile the block; ``found`` gets the host synchronisations (runtime and driver calls) recorded in it (``every``:
    every runtime and driver call)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(_WINDOW):
            yield
    events, window = common.profiler_events(prof, _WINDOW)
    found += [name for s, _, kind, name in events if kind not in common.DEVICE_WORK and window[0] <= s <= window[1]
              and (every or common.is_sync_call(name) or name in _DRIVER_SYNCS)]


def _raise(name: str) -> Callable[..., None]:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"torchckpt test: a host synchronisation ({name}) on a path that must have none")
    return forbidden


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """The block must not make the host wait for the device (see the module's docstring for how this is checked)."""
    found: list[str] = []
    mp = pytest.MonkeyPatch()
    mode = torch.cuda.get_sync_debug_mode()
    with counting(found):
        mp.setattr(torch.cuda.Event, "synchronize", _raise("Event.synchronize"))
        mp.setattr(torch.cuda.Stream, "synchronize", _raise("Stream.synchronize"))
        mp.setattr(torch.cuda, "synchronize", _raise("torch.cuda.synchronize"))
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(mode)
            mp.undo()
    assert not found, f"host synchronisations in the block: {found}"


def lagged(store: SnapshotStore, lag: str, rng: random.Random) -> None:
    """Delay ``store``'s work as ``lag`` says: copies and size reads delayed at random (``"as it comes"``), that and
    every settle forced (``"forced"``), or the compute stream busy a random while before each action instead
    (``"compute busy"``, so what a settle queues there runs late; NOTE [ Mover ] Rule 6)."""
    store._mover.delay = lambda kind, stream: torch.cuda._sleep(rng.randint(0, 2_000_000))
    if lag == "forced":
        never_sized(store)
    if lag == "compute busy":
        store._mover.delay = None
        for name in ("save", "restore", "prefetch", "free"):
            def busy(*a: Any, _act: Any = getattr(store, name), **k: Any) -> Any:
                torch.cuda._sleep(rng.randint(0, 4_000_000))  # on the compute stream
                return _act(*a, **k)
            setattr(store, name, busy)


def step(x: torch.Tensor) -> None:
    """Some device work between saves (what a time step would queue)."""
    for _ in range(4):
        x.mul_(0.999).add_(torch.sin(x))


# -- the detector ----------------------------------------------------------------------------------------------------
def test_the_count_sees_the_old_save_paths_synchronisations() -> None:
    x = cuda_state(0)[0]
    c = TritonQuant(8, "abs", 1e-3)
    c.compress(x)  # warm (kernels compiled)
    found: list[str] = []
    with counting(found):
        c.compress(x)  # the exact path: an event wait for the raw-block count
    assert "cudaEventSynchronize" in found, found
    found = []
    with counting(found):
        torch.cuda.current_stream().synchronize()
    assert "cudaStreamSynchronize" in found, found
    with pytest.raises(AssertionError, match="Event.synchronize"):
        with no_host_sync():
            c.compress(x)
    if Bitcomp().is_available():
        Bitcomp().compress(x)
        found = []
        with counting(found):
            Bitcomp().compress(x)  # the exact path: .item() of the size
        assert found, "Bitcomp.compress reads its size back"


# -- codecs ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", codecs(reference=True), ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compress_deferred_is_bit_identical_and_never_syncs(codec: Codec, dtype: torch.dtype) -> None:
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tests", "codecs"))
    from test_deferred import adversarial, check_deferred

    if not codec.supports(dtype):
        pytest.skip(f"{codec!r} does not take {dtype}")
    reference = isinstance(codec, TritonQuant) and codec.use_triton is False
    for n in (1, 255, 3000, 100_003):
        x = adversarial(n, dtype).cuda()
        # settled bytes == compress's (Bitcomp's GPU bytes: not asserted deterministic); decoded bits == decompress's
        check_deferred(codec, x, same_bytes=isinstance(codec, TritonQuant))
        codec.decompress(codec.compress_deferred(x).packed)  # warm
        with contextlib.nullcontext() if reference else no_host_sync():
            d = codec.compress_deferred(x)
            y = codec.decompress(d.packed)
            out = torch.empty_like(x)
            codec.decompress(d.packed, out=out)
        want = codec.decompress(codec.compress(x))
        assert_bits_equal([y, out], [want, want])
        if isinstance(codec, TritonQuant):  # the CPU reference decodes the GPU's settled bytes the same
            ref = TritonQuant(codec.bits, codec.mode, codec.bound, block=codec.block, use_triton=False, fmt=codec.fmt)
            p = codec.settle(d, d.sizes.tolist() if d.sizes is not None else [])
            cpu = ref.decompress(type(p)(tuple(b.cpu() for b in p.buffers), p.meta))
            assert_bits_equal([cpu], [want.cpu()])


# -- the snapshot store ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", codecs() + [Identity()], ids=repr)
@pytest.mark.parametrize("tier", [Tier.HOST, Tier.GPU])
def test_a_save_issues_no_host_sync(codec: Codec, tier: Tier) -> None:
    """After a warm-up, each save (with the settling, slot writes and flushes of the saves before it) runs with no
    host synchronisation; every snapshot then restores to the old behaviour's bits."""
    store = SnapshotStore("cuda", defer_sizes=True, slots=3, host=pool(), codec=codec)
    x = torch.randn(1 << 16, device="cuda")
    for n in range(6):  # warm-up: kernels compiled, pinned rows, host chunks, cached device blocks
        store.save(n, tier, cuda_state(n))
        step(x)
    for n in range(6):
        store.free(n, tier)
    waits = store._c["size_waits"]
    for n in range(10, 22):
        state = cuda_state(n)
        torch.cuda.synchronize()  # outside the block: the sizes of the saves before are on the host, none is forced
        with no_host_sync():
            store.save(n, tier, state)
            step(x)
    assert store._c["size_waits"] == waits
    for n in range(21, 9, -1):
        assert_bits_equal([t.clone() for t in store.restore(n, tier)], expected(codec, n))
        store.after_use()
    store.close()


@pytest.mark.parametrize("codec", [TritonQuant(4, "abs", 1e-2), TritonQuant(8, "abs", 1e-9, block=64)]
                         + codecs()[-2:], ids=repr)
@pytest.mark.parametrize("sched", [ZCut(60, tier=Tier.HOST), Revolve(60, 6, tier=Tier.HOST)], ids=repr)
def test_a_loop_syncs_only_for_late_sizes(codec: Codec, sched: Any) -> None:
    """A whole loop (run_schedule, prefetches planned, no explicit synchronisation): the only host waits are the
    store's lagging size waits (``stats().size_waits``, each on an earlier save's event), and the adjoint sees the
    old behaviour's states."""
    init = torch.linspace(-1, 1, 8192, device="cuda")
    init[::1000] = float("nan")  # blocks kept raw in every setting
    u = init.clone()
    seen: dict[int, torch.Tensor] = {}
    want: dict[int, torch.Tensor] = {}
    states: dict[int, torch.Tensor] = {}

    def forward(n0: int, n1: int) -> None:
        for k in range(n0, n1):
            u.copy_(torch.sin(u * 1.01 + k))  # state k+1 from state k (restored states carry the codec's round trip)
            step(u)

    def backward(n: int) -> None:
        seen[n] = u.clone()

    def run(store: SnapshotStore, out: dict[int, torch.Tensor]) -> Any:
        u.copy_(init)
        seen.clear()
        st = run_schedule(sched, forward=forward, save=lambda n: u, restore_into=lambda n: u, backward=backward,
                          store=store)
        out.update(seen)
        return st

    old = SnapshotStore("cuda", slots=3, host=pool(), codec=codec, timing=False)
    run(old, states)  # the default, exact save path (NOTE [ Snapshot sizes ] Rule 4), and the warm-up
    old.close()
    store = SnapshotStore("cuda", defer_sizes=True, slots=3, host=pool(), codec=codec, timing=False)
    store.calibrate([u])  # the first snapshot's exact compression sizes the slots: once, before the window
    found: list[str] = []
    with counting(found):
        st = run(store, want)
    assert set(found) <= {"cudaEventSynchronize"}, found
    assert len(found) <= st.size_waits, (found, st)
    assert sorted(want) == sorted(states) == list(range(60))
    for n in want:  # the old save path's bits
        assert_bits_equal([want[n]], [states[n]])
    store.close()


@pytest.mark.parametrize("codec", codecs(), ids=repr)
@pytest.mark.parametrize("sched", [Revolve(30, 4, tier=Tier.HOST), ZCut(30, tier=Tier.HOST), Uniform(30, 5, tier=Tier.HOST),
                                   Revolve(20, 4, tier=Tier.GPU), Multistage(30, gpu_slots=1, host_slots=2)], ids=repr)
@pytest.mark.parametrize("lag", ["as it comes", "forced", "compute busy"])
def test_every_restore_is_the_old_behaviour_under_delays(codec: Codec, sched: Any, lag: str) -> None:
    """Prefetched and written back, copies and size reads delayed at random (``compute busy``: the compute stream
    instead, before each action, so what a settle queues there runs late; NOTE [ Mover ] Rule 6): each restore
    (views, and into the caller's tensors) gives the old exact path's bits, NaN payloads, infinities and subnormals
    included."""
    for into in (False, True):
        actions = list(plan_prefetch(sched, 2))
        store = SnapshotStore("cuda", defer_sizes=True, slots=2, host=pool(), codec=codec)
        lagged(store, lag, random.Random(7))
        memo: dict[int, list[torch.Tensor]] = {}
        assert replay(store, actions, lambda n: memo.setdefault(n, expected(codec, n)), plan_flushes(actions, 2),
                      into=into, state=cuda_state) > 0
        store._mover.delay = None
        st = store.stats()
        assert not store._sizing and st.raw_bytes > 0
        if isinstance(codec, TritonQuant):  # its sizes are a function of the input
            saves = [a.n for a in actions if isinstance(a, Save)]
            assert st.packed_bytes == sum(codec.compress(t).nbytes for n in saves for t in cuda_state(n))
        store.close()


@pytest.mark.parametrize("codec", [TritonQuant(8, "abs", 1e-9, block=64), TritonQuant(4, "abs", 1e-2)], ids=repr)
@pytest.mark.parametrize("into", [False, True])
def test_a_settle_that_gathers_raw_blocks_is_written_after_them(codec: Codec, into: bool) -> None:
    """NOTE [ Mover ] Rule 6, NOTE [ Snapshot sizes ] Rule 2: the compute stream is busy when a snapshot with raw
    blocks is settled; the slot's write must come after the settle's own gathering of the raw rows (on an H100 the
    write, on the sizes stream, had run before that gathering, queued on the busy compute stream, and zCut's
    restored image differed from the exact path's)."""
    store = SnapshotStore("cuda", defer_sizes=True, slots=2, host=pool(), codec=codec)
    store.save(0, Tier.HOST, cuda_state(0))  # the first sizes the slots (exact)
    state = cuda_state(1)
    want = expected(codec, 1)
    assert codec.compress(state[0]).meta.params["raw_blocks"] > 0  # something for the settle to gather
    store.save(1, Tier.HOST, state)
    assert 1 in store._unsized
    torch.cuda.synchronize()  # its sizes are on the host: the next action settles it without waiting
    torch.cuda._sleep(200_000_000)  # the compute stream busy for a while (~0.1 s)
    got = store.restore(1, Tier.HOST, out=[torch.empty_like(t) for t in state] if into else None)
    assert 1 not in store._unsized  # settled by the restore, which then read its slot
    assert_bits_equal(got, want)
    store.close()
