"""What the planner prints: ``Plan.explain`` (compact by default, per tensor when verbose), sizes that never read
alike in one message, and ``auto(progress=True)``."""
from __future__ import annotations

import dataclasses
import io
import re

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.planner import Decision, Link, PlanError, profile
from torchckpt.planner.costs import Prediction
from torchckpt.planner.verify import _make, _Profiled

D = 32


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.h = nn.ModuleList(Blk() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.h:
            x = b(x)
        return x


def _offload_all(n: int = 12) -> torchckpt.planner.Plan:
    """A plan that sends every saved tensor of ``n`` blocks to host (as a ViT's many small tensors)."""
    m, x = Net(n), torch.randn(16, D)
    prof = profile(m, (x,), {})
    pred = Prediction(0, 1.0, 0.0, 0.0, 0, 0, "")
    decisions = [Decision("offload", offload=tuple(k for k, s in enumerate(saved) if s.nbytes)) for saved in prof.saved]
    return _make(prof, decisions, pred, 0, pred, 1 << 40, Link(1e9, 1e9), None)


def test_explain_prints_once_and_returns_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    p = _offload_all(3)
    assert p.explain() is None  # a REPL shows the table once
    out = capsys.readouterr().out
    assert out == p.summary() + "\n" and str(p) == p.summary()
    f = io.StringIO()
    p.explain(file=f, verbose=True)
    assert f.getvalue() == p.summary(verbose=True) + "\n"
    assert capsys.readouterr().out == ""


def test_explain_is_one_row_per_block_unless_verbose() -> None:
    p = _offload_all(12)
    compact = p.summary().splitlines()
    rows = [line for line in compact if re.match(r"h\.\d+ ", line)]
    assert [r.split()[0] for r in rows] == [f"h.{i}" for i in range(12)]
    assert len(compact) <= 12 + 4  # header, link, column names, the hint
    assert not any(line.lstrip().startswith("tensor") for line in compact)
    assert compact[-1] == "explain(verbose=True) lists the tensors sent to host of each block"
    assert "20.12 KiB" in rows[0] and "MiB" not in p.summary(verbose=True)  # sizes in their own unit, not 0.0 MiB
    verbose = p.summary(verbose=True).splitlines()
    tensors = [line for line in verbose if line.lstrip().startswith("tensor ")]
    small = [line for line in verbose if line.lstrip().startswith("and ")]
    assert len(small) == 12  # per block, the layer norm's statistics (64 B against 16 KiB) summed on one line
    assert all(re.search(r"and 2 tensors under \S+ B each: 128 B to host", line) for line in small)
    moved = sum(len(b.offload) for b in p.blocks)
    assert len(tensors) + 2 * 12 == moved


def test_sizes_in_the_header_never_read_alike() -> None:
    p = dataclasses.replace(_offload_all(2), budget=1509949, peak_bytes=1509949 - 900, floor_bytes=1509950,
                            none_peak_bytes=3 << 30)
    head = p.summary().splitlines()[0]
    assert "budget 1509949 B, predicted peak 1.439 MiB" in head and "floor 1509950 B" in head, head
    assert "3.00 GiB" in head


def test_plan_error_names_a_floor_that_reads_unlike_the_budget() -> None:
    m, x = Net(3), torch.randn(16, D)
    planned = _Profiled.prepare(m, (x,), {}, None, None, None, Link(1e9, 1e9))
    floor = planned.found.floor
    with pytest.raises(PlanError) as e:
        planned.plan(floor - 1)
    asked, lowest = re.match(r"torchckpt: no plan fits a budget of (.+?): the lowest peak this model reaches is (.+?) \(",
                             str(e.value)).groups()
    assert asked != lowest, str(e.value)


def test_auto_prints_progress_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    m, x = Net(3), torch.randn(16, D)
    a = torchckpt.auto(m, budget="1GiB", progress=True)
    m(x).square().mean().backward()
    err = capsys.readouterr().err
    assert "torchckpt: profiling one step of Net: 3 blocks" in err and "torchckpt: searched" in err
    a.remove()
    q = torchckpt.auto(Net(3), budget="1GiB")  # quiet by default, as plan()
    q.model(x).square().mean().backward()
    assert capsys.readouterr().err == ""
    q.remove()
    with pytest.raises(TypeError, match=r"^torchckpt: auto\(progress=...\) expects True or False"):
        torchckpt.auto(Net(3), budget="1GiB", progress="yes")  # type: ignore[arg-type]
