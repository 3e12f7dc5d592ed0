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
