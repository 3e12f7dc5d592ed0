"""The step model's peaks against what an H100 measured: the zoo's run 6 (docs/results/zoo_h100_run6, profiles and
measured peaks of eight models) replayed offline through ``benchmarks/peak_check.py`` (NOTE [ Step model ],
NOTE [ Shared storages ], NOTE [ Mechanism costs ]). A change to the peak model that moves a prediction away from
the measured peak fails here, on the CPU, without a GPU run."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "docs", "results", "zoo_h100_run6")
EAGER = {"none", "library", "sac", "every_other", "recompute"}
# The plans that run 6 measured off their prediction by more than 3% (docs/benchmarks.md, the zoo's verdict):
# Mixtral's offloading plan at 10.12 GiB (-12%), the floors of ViT-L (+5%) and ResNet-152 (+5%).
KNOWN = {("moe", "10.1"), ("vit_l", "1.29"), ("resnet152", "1.83")}


@pytest.fixture(scope="module")
def rows() -> list[list[str]]:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import peak_check
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    return peak_check.check(RUN)


def test_every_model_and_method_is_replayed(rows: list[list[str]]) -> None:
    models = {r[0] for r in rows}
    assert models == {"llama", "qwen2", "gpt_neox", "moe", "t5", "vit_l", "convnext", "resnet152"}
    assert sum(1 for r in rows if r[1] not in EAGER) == 39  # every plan the zoo measured (ConvNeXt-B's lowest refused)


def test_the_simple_policies_peaks_are_predicted_within_one_percent(rows: list[list[str]]) -> None:
    """The eager methods that are the search's simple policies (measured while planning, NOTE [ Mechanism costs ])."""
    errs = {(r[0], r[1]): float(r[6]) for r in rows if r[1] in EAGER}
    assert len(errs) >= 32
    assert all(abs(e) <= 1.0 for e in errs.values()), {k: e for k, e in errs.items() if abs(e) > 1.0}


def test_the_plans_peaks_are_predicted_within_three_percent(rows: list[list[str]]) -> None:
    """Every plan the zoo measured, but the three that run 6 found off (``KNOWN``, the verdict's misses)."""
    errs = {(r[0], r[1]): float(r[6]) for r in rows if r[1] not in EAGER}
    off = {k: e for k, e in errs.items() if abs(e) > 3.0 and k not in KNOWN}
    assert not off, off


# What the floors in parts measured on the H100 in run 6 (bytes): ConvNeXt-B's, refused at 1.94 GiB (its PlanError in
# zoo_moe_cnn.log names the peak), and the floor rows of ResNet-152 and ViT-L (their verification's peak).
FLOORS = {"convnext": 2138302976, "resnet152": "1.83", "vit_l": "1.29"}


@pytest.mark.parametrize("model", sorted(FLOORS))
def test_the_floor_in_parts_measured_predicts_it_and_moves_no_other_plan(model: str) -> None:
    """NOTE [ Mechanism costs ] Rule 12 replayed on run 6: with the floor's plan in parts measured (as the planner
    now measures it while planning), its prediction is its measured peak (within 0.1%: it was 5% low on ConvNeXt-B,
    5% high on ResNet-152 and ViT-L), the search's floor moves to it, and every plan the zoo measured above the floor
    predicts what it did before."""
    import json

    from torchckpt.planner import CodecCost, Link, Profile, predict
    from torchckpt.planner.calibrate import PARTS_FLOOR, calibrate, parts_floor
    from torchckpt.planner.optimize import search, simple_policies

    with open(os.path.join(RUN, f"profile_{model}.json")) as f:
        d = json.load(f)
    prof = Profile.from_json(json.dumps(d["profile"]))
    bare = prof.chain(Link(*d["link"]), CodecCost(**d["codec"]) if d.get("codec") else None)
    policies = simple_policies(bare)
    measured = {k: tuple(v) for k, v in d["measured"].items()}
    chain = calibrate(bare, policies, measured)
    plan = parts_floor(chain)
    assert plan is not None
    with open(os.path.join(RUN, f"zoo_{model}.json")) as f:
        rows = [r for r in json.load(f)["rows"] if r.get("method") == "plan" and "peak_GiB" in r]
    want = FLOORS[model]
    peak = want if isinstance(want, int) else next(int(r["verified_peak_GiB"] * 2**30) for r in rows
                                                   if f"{r['budget_GiB']:.3g}" == want)
    assert abs(predict(chain, plan).peak_bytes / peak - 1) > 0.04  # what the model alone said
    cal = calibrate(bare, policies, {**measured, PARTS_FLOOR: (peak, 0.0)})
    assert abs(predict(cal, plan).peak_bytes / peak - 1) <= 1e-3
    assert abs(search(cal).floor / peak - 1) <= 1e-3
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import peak_check
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    found = search(chain)
    for r in rows:
        if r["peak_GiB"] > peak / 2**30 * 1.5:  # the plans above the floor
            dec, _ = peak_check.zoo_plan(chain, found, r)
            assert predict(cal, dec).peak_bytes == predict(chain, dec).peak_bytes
