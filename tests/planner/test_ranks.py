"""NOTE [ One plan for all ranks ]: the ranks' profiles combined into one, without processes (the 2-rank runs under DDP
and FSDP2 are in tests/test_works_with.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from torchckpt.planner import Link, Profile, SavedTensor, search
from torchckpt.planner.costs import CodecCost
from torchckpt.planner.op_timing import OpCost
from torchckpt.planner.ranks import agree, agreed, combine, together


def _profile(scale: float = 1.0, extra: int = 0, device: str = "cuda:0") -> Profile:
    """Two blocks of one kind, each saving an input and a hidden tensor, times and bytes scaled."""
    saved = (SavedTensor(0, 1024 + extra, (16, 16), "float32"), SavedTensor(1, 4096, (16, 64), "float32"),
             SavedTensor(2, 0, (64, 16), "float32", "parameter"))
    ops = (OpCost(0, "aten.addmm.default", 4096, 1e-4 * scale), OpCost(1, "aten.gelu.default", 4096, 5e-5 * scale))
    return Profile(names=("0", "1"), kinds=("Blk", "Blk"), saved=(saved, saved), input_bytes=(1024, 1024 + extra),
                   fwd_s=(2e-4 * scale, 2e-4), bwd_s=(4e-4, 4e-4 * scale), bwd_bytes=(8192, 8192 + extra),
                   ops=(ops, ops), other_saved_bytes=extra, other_fwd_s=1e-5, other_bwd_s=1e-5 * scale,
                   step_s=1.2e-3 * scale, peak_none=20000 + extra, device=device, bwd_start_bytes=(100, 200 + extra),
                   saved_after=((0, 1, 2), (0, 1, 2)), writes_buffers=(False, False), mutates=("", ""))


def test_combine_takes_each_figure_the_largest_of_any_rank() -> None:
    a, b = _profile(), _profile(scale=2.0, extra=512, device="cuda:1")
    c = combine([a, b], rank=1)
    assert c.fwd_s == (4e-4, 2e-4) and c.bwd_s == (4e-4, 8e-4)
    assert c.input_bytes == (1024, 1536) and c.bwd_bytes == (8192, 8704) and c.bwd_start_bytes == (100, 712)
    assert [t.nbytes for t in c.saved[0]] == [1536, 4096, 0] and c.saved[0][2].why_zero == "parameter"
    assert [o.seconds for o in c.ops[0]] == [2e-4, 1e-4]
    assert (c.step_s, c.peak_none, c.other_saved_bytes, c.other_bwd_s) == (2.4e-3, 20512, 512, 2e-5)
    assert c.device == "cuda:1"  # each rank keeps its own
    assert combine([b, a], rank=0) == dataclasses.replace(c, device="cuda:1")  # the same whatever the ranks' order


def test_combined_profiles_search_alike_on_every_rank() -> None:
    a, b = _profile(), _profile(scale=3.0, extra=256, device="cuda:1")
    link = Link(d2h=1e9, h2d=1e9)
    mine = search(combine([a, b], rank=0).chain(link)).plans
    theirs = search(combine([a, b], rank=1).chain(link)).plans
    assert mine == theirs and mine != search(a.chain(link)).plans


def test_combine_forgets_op_counts_that_differ() -> None:
    a = _profile()
    b = dataclasses.replace(a, saved_after=((0, 1, 2), (0, 2, 3)), writes_buffers=(True, False), mutates=("", "x"))
    c = combine([a, b])
    assert c.saved_after == ((0, 1, 2), ())  # NOTE [ One plan for all ranks ] Rule 3: block 1 not offered in parts
    assert c.writes_buffers == (True, False) and c.mutates == ("", "x")


@pytest.mark.parametrize("change,words", [
    (lambda p: dataclasses.replace(p, names=("0", "2")), "ran the blocks 0, 2"),
    (lambda p: dataclasses.replace(p, saved=(p.saved[0], p.saved[1][:2])), "block 1 saved 2 tensors where rank 0's saved 3"),
    (lambda p: dataclasses.replace(p, ops=(p.ops[0][:1], p.ops[1])), "block 0 ran 1 ops where rank 0's ran 2"),
    (lambda p: dataclasses.replace(p, by_blocks=True), "profiled block by block"),
])
def test_combine_refuses_profiles_of_another_shape(change, words: str) -> None:
    with pytest.raises(ValueError, match=r"^torchckpt: plans\(model, \.\.\.\) plans a DDP or FSDP2 model") as e:
        combine([_profile(), _profile(), change(_profile())], call="plans")
    assert "rank 2's profiling step differs from rank 0's" in str(e.value) and words in str(e.value)


def test_one_process_exchanges_nothing() -> None:
    model = torch.nn.Linear(4, 4)
    p, link = _profile(), Link(d2h=1e9, h2d=2e9)
    codec = CodecCost("q", 4.0, 1e10, 2e10, True)
    assert not together(model)
    assert agree(model, "plan", p, link, codec) == (p, link, codec)

    def step(plan: object) -> tuple[int, float] | None:
        return 1, 0.5

    assert agreed(model)(step) is step
