"""``benchmarks/zoo.py``, ``benchmarks/plan_time.py``, ``benchmarks/plan_stability.py`` and
``benchmarks/fsdp_frontier.py`` end to end on their tiny models (CPU; fsdp_frontier on 2 gloo ranks), and the
summary's choice of the eager method a plan is compared with.

transformers, timm and torchvision are not torchckpt dependencies: without them these tests skip.
"""
from __future__ import annotations

import importlib
import json
import os
import pathlib
import sys

import pytest

pytest.importorskip("transformers")

from bench_run import BENCH, run_bench  # noqa: E402

MODELS = ["llama", "t5", "vit_l", "resnet152"]
EAGER = ["none", "library", "sac", "every_other", "recompute"]


_run = run_bench


def test_zoo_tiny_runs_every_method_and_summarizes(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("timm")
    pytest.importorskip("torchvision")
    res = _run("zoo.py", "--tiny", "--models", ",".join(MODELS), "--budgets", "3", "--pair-rounds", "2",
               "--pair-max", "2", "--out", str(tmp_path))
    for name in MODELS:
        with open(tmp_path / f"zoo_{name}.json") as f:
            result = json.load(f)
        assert result["size"] == "tiny" and result["device"] == "cpu"
        rows = {r["name"]: r for r in result["rows"]}
        for method in [*EAGER, "none_end"]:
            assert method in rows, f"{name}: no {method} row"
        for r in result["rows"]:
            assert ("step_s" in r and r["step_s"] > 0) or r.get("error"), f"{name}: {r}"
        for method in ("none", "library", "recompute"):
            assert "error" not in rows[method], f"{name} {method}: {rows[method].get('error')}"
            assert rows[method]["peak_GiB"] is None  # the CPU has no allocator statistics
        plans = [r for r in result["rows"] if r["method"] == "plan"]
        assert plans and all(r["budget_GiB"] > 0 for r in plans), f"{name}: {plans}"
        measured = [r for r in plans if "step_s" in r]
        assert measured, f"{name}: no plan measured"
        for r in measured:
            assert len(r["decisions"]) == result["blocks"]
            assert r["pred_peak_GiB"] <= r["budget_GiB"]  # the search never returns a plan over its budget
            assert r["pred_step_s"] > 0
        planner = result["planner"]
        assert 0 < planner["floor_GiB"] <= planner["none_peak_GiB"]
        assert isinstance(planner["verification"], list)  # verification's lines (none on the CPU: nothing measured)
        budgets = [r["budget_GiB"] for r in plans]
        assert budgets == sorted(budgets) and budgets[0] >= planner["floor_GiB"]
        assert os.path.exists(tmp_path / f"zoo_{name}.png")
        assert f"{name}: " in res.stdout  # the time per model is printed

    with open(tmp_path / "zoo_summary.json") as f:
        summary = json.load(f)
    by_model = {}
    for name in MODELS:
        with open(tmp_path / f"zoo_{name}.json") as f:
            by_model[name] = json.load(f)
    assert sorted(summary["models"]) == sorted(MODELS)
    for name in MODELS:
        assert summary["models"][name]["plan_s"] > 0
        rows = [s for s in summary["budgets"] if s["model"] == name]
        assert rows, name
        for s in rows:
            assert "ratio" in s and "best_eager" in s
            if s["best_eager"] is not None and s.get("plan_step_s") is not None:
                assert s["ratio_unpaired"] == pytest.approx(s["plan_step_s"] / s["best_eager_step_s"])
                row = next(r for r in by_model[name]["rows"] if r.get("budget_GiB") == s["budget_GiB"])
                paired = row["paired"]  # measured in turns with the same eager method: the ratio is theirs
                assert paired["eager"] == s["best_eager"] and len(paired["turns"]["plan"]) == 2
                assert s["ratio"] == pytest.approx(paired["plan_step_s"] / paired["eager_step_s"])
        # the largest budget admits at least one eager method, so that budget has a ratio
        assert rows[-1]["ratio"] is not None and rows[-1]["ratio"] > 0, rows[-1]
    assert "summary" in res.stdout and "ratio" in res.stdout


def test_plan_time_tiny(tmp_path: pathlib.Path) -> None:
    res = _run("plan_time.py", "--tiny", "--out", str(tmp_path))
    with open(tmp_path / "plan_time.json") as f:
        r = json.load(f)
    assert r["device"] == "cpu" and len(r["decisions"]) == 4
    assert 0 < r["budget_bytes"] < r["none_peak_bytes"]
    assert r["pred_peak_bytes"] <= r["budget_bytes"]
    lines = [p["line"] for p in r["phases"]]
    assert any("profiled in" in line for line in lines) and any("searched" in line for line in lines), lines
    assert r["phases_total_s"] == pytest.approx(sum(p["s"] for p in r["phases"]))
    assert r["end_to_end_s"] > 0 and r["prepare_s"] > 0
    assert "torchckpt.plan end to end" in res.stdout


def test_fsdp_frontier_tiny_on_two_gloo_ranks(tmp_path: pathlib.Path) -> None:
    """FSDP2 over 2 CPU processes: every method measured on the one sharded model, plans made on both ranks together
    (NOTE [ One plan for all ranks ]) for every budget, each within its budget and the same on both ranks."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    res = _run("fsdp_frontier.py", "--tiny", "--out", str(tmp_path))
    with open(tmp_path / "fsdp_frontier.json") as f:
        result = json.load(f)
    assert result["device"] == "cpu" and result["world_size"] == 2 and result["backend"] == "gloo"
    rows = {r["name"]: r for r in result["rows"]}
    for method in ("none", "checkpoint", "sac", "none_end"):
        assert method in rows, f"no {method} row"
        assert "error" not in rows[method], rows[method]["error"]
    for r in result["rows"]:
        assert ("step_s" in r and r["step_s"] > 0) or r.get("error"), r
        if "step_s" in r:  # the same weights and batches under every method: the same loss on each rank
            assert r["ranks_loss"] == pytest.approx(rows["none"]["ranks_loss"], rel=1e-5), r["name"]
    budgets = result["planner"]["budgets_GiB"]
    plans = [r for r in result["rows"] if r["method"] == "plan"]
    assert len(budgets) == 4 and [r["budget_GiB"] for r in plans] == budgets
    probe = result["probe"]
    assert 0 < probe["floor_GiB"] <= probe["none_peak_GiB"] and budgets[0] >= probe["floor_GiB"]
    assert budgets == sorted(budgets) and budgets[-1] <= probe["none_peak_GiB"]
    measured = [r for r in plans if "step_s" in r]
    assert measured, plans
    for r in measured:
        assert r["pred_peak_GiB"] <= r["budget_GiB"]  # the search never returns a plan over its budget
        assert len(r["decisions"]) == 4  # the tiny Llama's decoder layers
        h = r["ranks_plan_hash"]
        assert len(h) == 2 and h[0] == h[1], r["name"]  # one plan for all ranks
    try:
        importlib.import_module("matplotlib")
    except ImportError:  # CI runs without it: no figure
        pass
    else:
        assert os.path.exists(tmp_path / "fsdp_frontier.png")
    assert "none_end" in res.stdout and "ratio" in res.stdout


def test_summary_compares_with_the_fastest_eager_method_within_the_budget() -> None:
    sys.path.insert(0, BENCH)
    try:
        import zoo
    finally:
        sys.path.remove(BENCH)
    rows = [
        {"name": "none", "method": "none", "step_s": 1.0, "peak_GiB": 10.0},
        {"name": "library", "method": "library", "step_s": 1.3, "peak_GiB": 3.0},
        {"name": "sac", "method": "sac", "step_s": 1.1, "peak_GiB": 6.0},
        {"name": "every_other", "method": "every_other", "step_s": 1.2, "peak_GiB": 6.5},
        {"name": "recompute", "method": "recompute", "error": "OutOfMemoryError: ..."},
        {"name": "plan_4", "method": "plan", "budget_GiB": 4.0, "floor_GiB": 2.0, "step_s": 1.25, "peak_GiB": 3.9,
         "pred_step_s": 1.2, "pred_peak_GiB": 3.8, "verified_step_s": 1.25, "verified_peak_GiB": 3.8},
        {"name": "plan_7", "method": "plan", "budget_GiB": 7.0, "floor_GiB": 2.0, "step_s": 1.12, "peak_GiB": 7.2,
         "pred_step_s": 1.12, "pred_peak_GiB": 6.9},
        {"name": "plan_1", "method": "plan", "budget_GiB": 1.0, "floor_GiB": 2.0, "error": "PlanError: ..."},
    ]
    s4, s7, s1 = zoo.summarize({"model": "m", "device": "gpu", "rows": rows})
    assert (s4["best_eager"], s4["ratio"]) == ("library", pytest.approx(1.25 / 1.3))
    assert s4["within_budget"] is True and s4["peak_err_pct"] == pytest.approx((3.8 / 3.9 - 1) * 100)
    assert (s7["best_eager"], s7["ratio"]) == ("sac", pytest.approx(1.12 / 1.1))  # every_other fits, but is slower
    assert s7["within_budget"] is False and s7["step_err_pct"] == pytest.approx(0.0)
    assert s1["best_eager"] is None and s1["error"].startswith("PlanError") and s1["ratio"] is None
    assert s4["recompute_peak_GiB"] is None and s4["floor_le_recompute"] is None  # recompute ran out of memory
    assert zoo.budgets_between(100, 1000, 3) == [103, 536, 970]
    assert zoo.budgets_between(100, 90, 5) == [103]


def test_plan_stability_tiny_measures_every_process_plan_in_turns(tmp_path: pathlib.Path) -> None:
    """``benchmarks/plan_stability.py``: two processes plan, a third measures both processes' plans of each budget in
    turns; the JSON holds each process's own figures and the turns'."""
    res = _run("plan_stability.py", "--tiny", "--model", "llama", "--procs", "2", "--turns", "2", "--reps", "1",
               "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    with open(tmp_path / "plan_stability_llama.json") as f:
        got = json.load(f)
    assert got["procs"] == 2 and len(got["budgets"]) == 2
    for b in got["budgets"]:
        assert len(b["runs"]) == 2 and all("plan" not in r and len(r["blocks"]) == 4 for r in b["runs"])
        assert [len(t) for t in b["turns"]] == [2, 2] and all(m > 0 for m in b["turn_medians_s"])
        assert b["turn_spread"] == max(b["turn_medians_s"]) / min(b["turn_medians_s"]) - 1
        assert isinstance(b["same_decisions"], bool)
    assert "measured in turns in one process" in res.stdout
    for k in range(2):  # each process's profile and measured policies, for benchmarks/replan.py
        with open(tmp_path / f"profile_llama_proc{k}.json") as f:
            prof = json.load(f)
        assert set(prof) == {"link", "codec", "profile", "measured"} and len(prof["profile"]["names"]) == 4
        log = (tmp_path / f"plan_llama_proc{k}.log").read_text()  # its planner's messages
        assert "torchckpt: profiling one step of" in log and "searched" in log
    assert "profile" not in json.dumps(got["budgets"])


def test_ratio_error_compares_the_models_ratio_with_the_paired_turns() -> None:
    """``ratio_err_pct``: the plan's predicted step over its paired eager method's predicted step, against the ratio
    their turns measured (the host's drift between planning and the zoo's rows falls on both sides); ``None``
    without turns or without the eager method's prediction."""
    sys.path.insert(0, BENCH)
    try:
        import zoo
    finally:
        sys.path.remove(BENCH)
    rows = [
        {"name": "none", "method": "none", "step_s": 1.0, "peak_GiB": 10.0, "pred_step_s": 1.0},
        {"name": "library", "method": "library", "step_s": 1.3, "peak_GiB": 3.0, "pred_step_s": 1.5},
        {"name": "plan_4", "method": "plan", "budget_GiB": 4.0, "floor_GiB": 2.0, "step_s": 1.25, "peak_GiB": 3.9,
         "pred_step_s": 1.2, "pred_peak_GiB": 3.8, "paired": {"eager": "library", "ratio": 0.9}},
        {"name": "plan_5", "method": "plan", "budget_GiB": 5.0, "floor_GiB": 2.0, "step_s": 1.25, "peak_GiB": 3.9,
         "pred_step_s": 1.2, "pred_peak_GiB": 3.8},
    ]
    s4, s5 = zoo.summarize({"model": "m", "device": "gpu", "rows": rows})
    assert s4["ratio"] == 0.9 and s4["ratio_err_pct"] == pytest.approx((1.2 / 1.5 / 0.9 - 1) * 100)
    assert s4["own_spread_pct"] is None  # one figure of the plan: nothing to spread
    assert s5["ratio_err_pct"] is None
    del rows[1]["pred_step_s"]
    assert zoo.summarize({"model": "m", "device": "gpu", "rows": rows})[0]["ratio_err_pct"] is None


def test_own_spread_is_how_far_the_plans_own_figures_moved_in_its_process() -> None:
    """``own_spread_pct``: the largest of the plan's step figures in its process (verification's, its row's, the median
    of its paired turns') over the smallest, less 1, in %; the eager side's turns do not count."""
    sys.path.insert(0, BENCH)
    try:
        import zoo
    finally:
        sys.path.remove(BENCH)
    row = {"name": "plan_4", "method": "plan", "budget_GiB": 4.0, "floor_GiB": 2.0, "step_s": 0.0961,
           "peak_GiB": 3.9, "pred_step_s": 0.0877, "pred_peak_GiB": 3.8, "verified_step_s": 0.0737,
           "paired": {"eager": "library", "ratio": 0.5, "turns": {"plan": [0.084, 0.0841, 0.09], "eager": [0.3] * 3}}}
    s = zoo.summarize({"model": "m", "device": "gpu", "rows": [row]})[0]
    assert s["own_spread_pct"] == pytest.approx((0.0961 / 0.0737 - 1) * 100)
    assert s["step_err_pct"] == pytest.approx((0.0877 / ((0.0841 + 0.09) / 2) - 1) * 100)  # row and turns pooled
    del row["verified_step_s"], row["paired"]
    assert zoo.own_spread(row) is None
