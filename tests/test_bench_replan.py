"""``benchmarks/replan.py``: planning offline from a profile the GPU machine wrote (no device, no optional library)."""
from __future__ import annotations

import json
import os
import pathlib
import sys

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


def test_replay_trials_predicts_every_plan_measured_again(tmp_path: pathlib.Path) -> None:
    """``benchmarks/replay_trials.py`` on the H100 zoo run at d095e8e (profiles written before trials were kept): the
    one-line policies are found by name and predict what they measured where the calibration fits them (every block
    ``Recompute()``), and verification's plans are found again from the lines the zoo kept; a profile with stored
    trials is read as written, each trial predicted by the calibrated chain."""
    run = os.path.join(ROOT, "docs", "results", "zoo_h100_2026-11-28_d095e8e")
    out = tmp_path / "rows.json"
    _run("replay_trials.py", run, "--json", str(out))
    rows = json.loads(out.read_text())
    t5 = [r for r in rows if r["model"] == "t5"]
    rec = [r for r in t5 if r["what"] == "every block Recompute()"]
    assert len(rec) == 1 and abs(rec[0]["err_pct"]) < 0.1
    ver = [r for r in t5 if r["what"] == "verification"]
    assert len(ver) >= 4 and all(not r["stored"] for r in t5)
    with open(os.path.join(run, "profile_llama.json")) as f:
        d = json.load(f)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from replan import load
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    from torchckpt.planner.costs import KEEP, RECOMPUTE
    from torchckpt.planner.trials import Trial, trials_to_records

    n = len(d["profile"]["names"])
    d["trials"] = trials_to_records([Trial("verification", (RECOMPUTE,) + (KEEP,) * (n - 1), 5 << 30, 0.2)])
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "profile_llama.json").write_text(json.dumps(d))
    _run("replay_trials.py", str(folder), "--json", str(out))
    rows = json.loads(out.read_text())
    _, chain, _, _ = load(str(folder / "profile_llama.json"))
    from torchckpt.planner.costs import predict

    want = predict(chain, (RECOMPUTE,) + (KEEP,) * (n - 1)).step_s
    assert len(rows) == 1 and rows[0]["stored"] and rows[0]["kind"] == "keep/recompute"
    assert abs(rows[0]["pred_step_s"] - want) < 1e-12 and abs(rows[0]["err_pct"] - (0.2 / want - 1) * 100) < 1e-9

