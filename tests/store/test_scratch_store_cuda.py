"""CUDA: ``SnapshotStore(defer_sizes=True)`` with TritonQuant's kernels lends the raw rows from the codec's scratch
(NOTE [ Snapshot sizes ] Rule 8, NOTE [ Codec streams ] Rule 5, NOTE [ Block quantization ] Rule 7): a loop of saves
reuses a few buffers instead of allocating (and freeing under ``record_stream``) one per save, a buffer is not lent
again while the sizes stream has yet to gather from it, and every restore is the exact path's, bit for bit.

    python -m pytest -q -p no:cacheprovider tests/store/test_scratch_store_cuda.py
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from ckpt_models import assert_bits_equal
from test_nosync_save_cuda import cuda_state, expected, pool, step
from torchckpt.codecs import TritonQuant
from torchckpt.schedules import Free, Prefetch, Restore, Revolve, Save, Tier, ZCut, plan_flushes, plan_prefetch
from torchckpt.store import SnapshotStore
from torchckpt.store.snapshot_codec import _MAX_UNSIZED

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("codec", [TritonQuant(4, "abs", 1e-2), TritonQuant(8, "abs", 1e-9, block=64)], ids=repr)
@pytest.mark.parametrize("sched", [ZCut(40, tier=Tier.HOST), Revolve(40, 5, tier=Tier.HOST),
                                   Revolve(30, 4, tier=Tier.GPU)], ids=repr)
def test_a_loop_reuses_the_raw_rows_and_keeps_the_exact_bits(codec: TritonQuant, sched: Any) -> None:
    codec = copy.deepcopy(codec)  # a scratch of its own (the parameters are shared by the cases)
    actions = list(plan_prefetch(sched, 3))
    flushes = plan_flushes(actions, 3)
    saves = [a.n for a in actions if isinstance(a, Save)]
    want = {n: expected(codec, n) for n in set(saves)}
    store = SnapshotStore("cuda", defer_sizes=True, slots=3, host=pool(), codec=codec, slot_margin=1.0)
    x = torch.randn(1 << 20, device="cuda")
    for i, a in enumerate(actions):
        step(x)  # device work between actions
        if isinstance(a, Save):
            store.save(a.n, a.tier, cuda_state(a.n), flush=i in flushes)
        elif isinstance(a, Prefetch):
            store.prefetch(a.n, a.src, a.dst)
        elif isinstance(a, Restore):
            assert_bits_equal([t.clone() for t in store.restore(a.n, a.tier)], want[a.n])
            store.after_use()
        elif isinstance(a, Free):
            store.free(a.n, a.tier)
    store.stats()
    sc = codec.scratch
    lent = 2 * (len(saves) - 1)  # two tensors a snapshot; the first is calibrate's exact compression
    assert sc.made + sc.reused == lent
    assert sc.reused > 0 and sc.made < lent / 2, (sc.made, sc.reused)
    assert sc.made <= 2 * (_MAX_UNSIZED + 3), (sc.made, sc.reused)
    store.close()
    assert sc.idle == 0


def test_no_buffer_is_lent_while_the_sizes_stream_has_yet_to_gather_from_it() -> None:
    """The sizes stream held busy (a sleep before each size read-back): a forced settle waits for its own read-back
    only, and its gathering is queued behind the later saves' sleeps, so it has not run when the next save comes;
    that save gets new buffers. Had the settled snapshot's been lent again, the next compression (on the compute
    stream, at once) would overwrite raw rows still to be gathered, and its restore would differ from the exact
    path's. Once the device is idle, the next save lends the earlier buffers again."""
    codec = TritonQuant(8, "abs", 1e-9, block=64)  # every block raw: each settle gathers every row
    warm = TritonQuant(8, "abs", 1e-9, block=64)  # the kernels compiled before the timing matters
    for t in cuda_state(0):
        d = warm.compress_deferred(t)
        warm.decompress(warm.settle(d, d.sizes.tolist()))  # type: ignore[union-attr]
    want = {n: expected(codec, n) for n in range(6)}
    torch.cuda.synchronize()
    store = SnapshotStore("cuda", defer_sizes=True, slots=8, host=pool(), codec=codec, slot_margin=1.0)
    store._mover.delay = lambda kind, stream: torch.cuda._sleep(100_000_000) if kind == "sizes" else None
    for n in range(5):  # 0: calibrate's; 1-4 deferred, 1 and 2 settled by force at the saves of 3 and 4
        store.save(n, Tier.HOST, cuda_state(n))
    sc = codec.scratch
    assert list(store._unsized) == [3, 4]
    assert sc.reused == 0 and sc.made == 8, (sc.made, sc.reused)  # 1's gathering still queued at 4's save
    store._mover.delay = None
    for n in range(5):
        assert_bits_equal([t.clone() for t in store.restore(n, Tier.HOST)], want[n])
        store.after_use()
    torch.cuda.synchronize()
    store.save(5, Tier.HOST, cuda_state(5))  # everything done: earlier buffers lent again
    assert sc.reused == 2 and sc.made == 8, (sc.made, sc.reused)
    assert_bits_equal([t.clone() for t in store.restore(5, Tier.HOST)], want[5])
    store.close()
