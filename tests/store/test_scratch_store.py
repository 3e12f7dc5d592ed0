"""``SnapshotStore(defer_sizes=True)`` gives a settled snapshot's deferred buffers back to the codec's scratch, with
the events after their last uses (NOTE [ Snapshot sizes ] Rule 8, NOTE [ Codec streams ] Rule 5), on the CPU: saves of
one layout reuse a bounded set of raw-row buffers instead of allocating one per save, a buffer whose events are
pending (the settle's, or a restore's that decoded it while unsized) is not lent again, and every restore keeps the
codec's round trip bit for bit."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from ckpt_models import assert_bits_equal, small_pool
from test_snapshot_sizes import deferred, expected, never_sized, replay, wild
from torchckpt.codecs import TritonQuant
from torchckpt.schedules import Revolve, Save, Tier, Uniform, ZCut, plan_flushes, plan_prefetch
from torchckpt.store import SnapshotStore
from torchckpt.store.snapshot_codec import _MAX_UNSIZED


class FakeEvent:
    """A compute- or sizes-stream event whose completion the test decides."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


@pytest.mark.parametrize("sched", [Revolve(40, 4, tier=Tier.HOST), ZCut(40, tier=Tier.HOST),
                                   Uniform(40, 10, tier=Tier.HOST), Revolve(30, 4, tier=Tier.GPU)], ids=repr)
@pytest.mark.parametrize("lag", ["next action", "forced"])
def test_saves_reuse_a_bounded_set_of_raw_row_buffers(sched: Any, lag: str) -> None:
    """Many saves of one layout (two tensors): at most one buffer per tensor per snapshot that may be unsized at once
    (``_MAX_UNSIZED``, and the one being saved) is ever allocated; restores are the round trip; close clears."""
    c = TritonQuant(8, "abs", 1e-3)
    actions = list(plan_prefetch(sched, 3))
    store = SnapshotStore("cpu", defer_sizes=True, slots=3, host=small_pool(), codec=c, slot_margin=1.0)
    if lag == "forced":
        never_sized(store)
    memo: dict[int, list[torch.Tensor]] = {}
    assert replay(store, actions, lambda n: memo.setdefault(n, expected(c, n)), plan_flushes(actions, 3)) > 0
    store.stats()  # settles the rest
    saves = sum(isinstance(a, Save) for a in actions)
    bound = len(wild(0)) * (_MAX_UNSIZED + 1)
    assert saves - 1 > bound  # the first save is calibrate's exact compression
    assert c.scratch.made <= bound, (c.scratch.made, saves)
    assert c.scratch.made + c.scratch.reused == 2 * (saves - 1)
    assert c.scratch.idle == c.scratch.made  # every one given back
    store.close()
    assert c.scratch.idle == 0


def test_pending_events_of_the_settle_and_of_an_unsized_restore_keep_buffers_lent() -> None:
    """The buffers come back with the settle's event (recorded where it ran) and the event recorded after a restore
    decoded them while unsized; until both have completed, a save allocates new ones."""
    c = TritonQuant(8, "abs", 1e-3)
    store = deferred(c, 4)
    events: list[FakeEvent] = []

    def record() -> FakeEvent:
        events.append(FakeEvent())
        return events[-1]

    store._mover.record = record  # type: ignore[method-assign]
    store.save(0, Tier.HOST, wild(0))  # calibrate's: nothing lent
    store.save(1, Tier.HOST, wild(1))
    assert c.scratch.made == 2 and 1 in store._unsized
    assert_bits_equal([t.clone() for t in store.restore(1, Tier.HOST)], expected(c, 1))  # decodes the deferred form
    store.after_use()
    used = store._unsized[1].used
    assert isinstance(used, FakeEvent)
    mark = len(events)
    store._settle(store._unsized[1])  # given back with the settle's event and `used`
    assert c.scratch.idle == 2 and len(events) > mark
    for e in events:
        e.done = e is not used  # the settle's done, the restore's pending
    store.save(2, Tier.HOST, wild(2))
    assert c.scratch.made == 4 and c.scratch.reused == 0
    used.done = True
    store.save(3, Tier.HOST, wild(3))
    assert c.scratch.made == 4 and c.scratch.reused == 2  # snapshot 1's buffers
    for e in events:
        e.done = False
    store._settle_all()  # 2 and 3 given back, their events pending
    store.save(4, Tier.GPU, wild(4))
    assert c.scratch.made == 6 and c.scratch.reused == 2
    for e in events:
        e.done = True
    store.save(5, Tier.GPU, wild(5))
    assert c.scratch.made == 6 and c.scratch.reused == 4
    for n in (1, 2, 3, 4, 5, 0):
        tier = Tier.GPU if n >= 4 else Tier.HOST
        assert_bits_equal([t.clone() for t in store.restore(n, tier)], expected(c, n))
        store.after_use()
    store.close()


def test_a_snapshot_dropped_unsized_gives_back_at_its_turn_and_close_gives_nothing_back() -> None:
    store = deferred(TritonQuant(4, "abs", 1e-4), 3)
    c = store.codec
    for n in (0, 1):
        store.save(n, Tier.HOST, wild(n))
    store.free(1, Tier.HOST)  # dropped, unsized: settled in its turn only to be counted
    assert c.scratch.idle == 0
    store.stats()
    assert c.scratch.idle == 2
    store.save(2, Tier.GPU, wild(2))
    store.save(3, Tier.HOST, wild(3))
    assert c.scratch.reused == 2 and list(store._unsized) == [2, 3]
    store.close()  # the unsized ones are dropped, not given back; the idle ones cleared
    assert c.scratch.idle == 0 and len(c.scratch._lent) == 0  # nothing held


def test_a_codec_shared_by_stores_one_after_another() -> None:
    c = TritonQuant(8, "rel", 0.05, fmt="e4m3")
    for _ in range(2):
        store = SnapshotStore("cpu", defer_sizes=True, slots=2, host=small_pool(), codec=c)
        for n in range(8):
            store.save(n, Tier.GPU if n % 3 == 0 else Tier.HOST, wild(n))
        for n in range(8):
            assert_bits_equal([t.clone() for t in store.restore(n, Tier.GPU if n % 3 == 0 else Tier.HOST)],
                              expected(c, n))
            store.after_use()
        store.close()
    assert c.scratch.made <= 2 * 2 * (_MAX_UNSIZED + 1) and c.scratch.idle == 0
