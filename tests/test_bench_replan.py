"""``benchmarks/replan.py``: planning offline from a profile the GPU machine wrote (no device, no optional library)."""
from __future__ import annotations

import os

from bench_run import ROOT, run_bench as _run


def test_replan_noise_names_the_plans_each_draw_chose() -> None:
    """``benchmarks/replan.py --noise``: on the H100's GPT-NeoX profile (with the policies its planner measured), each
    budget lists the distinct plans the draws chose, their counts summing to the draws, each with its step predicted
    by the calibration on the measurements as they were; without noise the same budget gives one plan."""
    prof = os.path.join(ROOT, "docs", "results", "zoo_h100_2026-11-27_rule10", "profile_gpt_neox.json")
    res = _run("replan.py", prof, "--budgets", "7.75,14", "--noise", "0.03", "--draws", "3")
    lines = res.stdout.splitlines()
    heads = [k for k, ln in enumerate(lines) if "distinct plans in 3 draws at 0.03 noise" in ln]
    assert len(heads) == 2
    for a, b in zip(heads, heads[1:] + [len(lines)]):
        counts = [int(ln.split("x", 1)[0]) for ln in lines[a + 1:b] if ln.strip()]
        assert sum(counts) == 3 and len(counts) == int(lines[a].split()[2])
        assert all(" ms  " in ln for ln in lines[a + 1:b] if ln.strip())
    plain = _run("replan.py", prof, "--budgets", "7.75").stdout
    assert "7.75 GiB  peak" in plain


def test_diag_revolve_rows_predicts_the_zoos_revolve_rows_again() -> None:
    """``benchmarks/diag_revolve_rows.py`` on the H100 zoo run of ViT-L: its plan at 1.21 GiB is found among the
    search's plans by its recorded prediction and predicted with both forms of NOTE [ Mechanism costs ] Rule 11; the
    measured Revolve policies predict what they measured under the rule as it is."""
    res = _run("diag_revolve_rows.py", os.path.join(ROOT, "docs", "results", "zoo_h100_2026-11-27_vit_l"))
    lines = res.stdout.splitlines()
    row = [ln for ln in lines if "vit_l 1.21 GiB" in ln]
    assert len(row) == 1 and "before 145.7 ms" in row[0] and "row 163.4 ms" in row[0], res.stdout
    measured = [ln for ln in lines if " measured checkpoint_chain" in ln]
    assert len(measured) == 2
    for ln in measured:
        ms = ln.split(": ")[1].split(" ms")[0]
        assert ln.endswith(f"after {ms}"), ln
