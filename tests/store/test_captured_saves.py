"""``SnapshotStore(graphs=True)``'s arguments, on any machine (NOTE [ Captured saves ] Rule 1); its CUDA behaviour:
tests/store/test_captured_saves_cuda.py."""
from __future__ import annotations

import pytest
import torch

from torchckpt.codecs import Identity, TritonQuant
from torchckpt.schedules import Tier
from torchckpt.store import SnapshotStore


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
