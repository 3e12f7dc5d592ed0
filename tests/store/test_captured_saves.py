"""``SnapshotStore(graphs=True)``'s arguments, on any machine (NOTE [ Captured saves ] Rule 1); its CUDA behaviour:
tests/store/test_captured_saves_cuda.py."""
from __future__ import annotations

import pytest
import torch

from torchckpt.codecs import Identity, TritonQuant
from torchckpt.schedules import Tier
from torchckpt.store import SnapshotStore
from torchckpt.store.streams import Mover


@pytest.mark.parametrize("kw", [dict(), dict(codec=TritonQuant(4, "abs", 1e-2)),
                                dict(codec=TritonQuant(4, "abs", 1e-2), defer_sizes=True)], ids=repr)
def test_graphs_need_cuda_a_codec_and_deferred_sizes(kw: dict) -> None:
    with pytest.raises(ValueError, match=r"torchckpt: SnapshotStore\(graphs=True\) .*device='cuda', a codec and "
                                         r"defer_sizes=True .*pass graphs=False"):
        SnapshotStore("cpu", graphs=True, **kw)


def test_graphs_is_a_flag() -> None:
    with pytest.raises(TypeError, match=r"SnapshotStore\(graphs=\.\.\.\) expects True or False, got 1"):
        SnapshotStore("cpu", graphs=1)  # type: ignore[arg-type]


def test_a_codec_is_not_capturable_unless_it_says_so() -> None:
    cpu = torch.device("cpu")
    assert not Identity().capturable(cpu) and not TritonQuant(4, "abs", 1e-2).capturable(cpu)


def test_without_graphs_nothing_is_replayed() -> None:
    store = SnapshotStore("cpu", slots=2, defer_sizes=True, codec=TritonQuant(8, "abs", 1e-3))
    for n in range(4):
        store.save(n, Tier.HOST, [torch.linspace(-1, 1, 3000) * n])
    st = store.stats()
    assert st.host_saves == 4 and st.graph_saves == 0 and st.graph_captures == 0
    store.close()


def test_close_drains_every_copy_stream_before_it_drops_the_graphs() -> None:
    """NOTE [ Captured saves ] Rule 8: the sizes stream's settles and slot writes read the graphs' buffers with no
    ``record_stream``, so ``close`` makes the compute stream wait for the offload, prefetch *and sizes* streams before it
    drops the ring and releases the slots (a slot write still queued there would otherwise write memory given back).
    Streams faked: the order of the calls is what is checked."""
    store = SnapshotStore("cpu", slots=2, defer_sizes=True, codec=TritonQuant(8, "abs", 1e-3))
    store.save(0, Tier.HOST, [torch.linspace(-1, 1, 3000)])
    waited: list[str] = []

    class Ring:  # what a CUDA store holds after its first captured save; close() after the drain (NOTE [ Captured saves ] Rule 9)
        def close(self) -> None:
            waited.append("ring closed")

    ring = Ring()
    store._graphs = ring  # type: ignore[assignment]
    graphs_at_drain: list[object] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: "Stream") -> None:
            waited.append(other.name)
            graphs_at_drain.append(store._graphs)

    m = store._mover
    compute = Stream("compute")
    m.cuda, m.offload, m.prefetch, m.sizes = True, Stream("offload"), Stream("prefetch"), Stream("sizes")
    m.current = lambda: compute  # type: ignore[method-assign]
    m.drain()
    assert sorted(waited) == ["offload", "prefetch", "sizes"]
    waited.clear(), graphs_at_drain.clear()
    m.cuda = False  # close's own CPU work from here
    m.drain = lambda: (setattr(m, "cuda", True), Mover.drain(m), setattr(m, "cuda", False))  # type: ignore[method-assign]
    store.close()
    assert sorted(waited[:3]) == ["offload", "prefetch", "sizes"] and all(g is ring for g in graphs_at_drain)
    assert waited[3:] == ["ring closed"] and store._graphs is None
    assert store._graphs is None
