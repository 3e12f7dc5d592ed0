"""NOTE [ Captured saves ] Rule 9 without a GPU: ``SaveGraphs.close`` lets the graphs and their buffers go before
their pools (a pool's end empties only blocks no graph or tensor holds), with no reference left behind."""
from __future__ import annotations

import gc
import weakref

from torchckpt.store.snapshot_graphs import SaveGraphs


class _Thing:
    """Stands for a CUDAGraph, a deferred buffer or a MemPool: records when it goes."""


def test_close_drops_graphs_and_buffers_before_pools() -> None:
    gone: list[str] = []
    ring = SaveGraphs.__new__(SaveGraphs)  # the ring's state without CUDA (its __init__ makes a stream)
    graphs = [_Thing(), _Thing()]
    bufs = [_Thing(), _Thing()]
    pools = [_Thing(), _Thing()]
    for i, (g, b) in enumerate(zip(graphs, bufs)):
        weakref.finalize(g, gone.append, f"graph{i}")
        weakref.finalize(b, gone.append, f"buffer{i}")
    for i, p in enumerate(pools):
        weakref.finalize(p, gone.append, f"pool{i}")
    ring._graphs = [{("a",): (graphs[0], bufs[0], None)}, {("b",): (graphs[1], bufs[1], None)}]
    ring._free = [object(), None]
    ring.owner = [object(), object()]
    ring._pools = list(pools)
    del graphs, bufs, pools, g, b, p
    gc.disable()  # no cycle may hold them: plain reference counting frees them in close
    try:
        ring.close()
        assert sorted(gone[:4]) == ["buffer0", "buffer1", "graph0", "graph1"], gone
        assert sorted(gone[4:]) == ["pool0", "pool1"], gone
    finally:
        gc.enable()
    assert ring._graphs == [{}, {}] and ring._free == [None, None] and ring.owner == [None, None]
