"""NOTE [ Mechanism costs ] Rule 14 on what an H100 measured: the zoo's ResNet-152 run at 88059af
(docs/results/zoo_h100_2026-11-28_offload_host: its profile, with every policy measured while planning) calibrated
offline. A change to the calibration that loses the offloads' host work, or prices it off what was measured, fails
here on the CPU."""
from __future__ import annotations

import pytest
from recorded import recorded_run

from torchckpt.planner import predict
from torchckpt.planner.calibrate import KEEP_ALL, OFFLOAD_ALL, calibrate, offload_policy
from torchckpt.planner.costs import StepCosts
from torchckpt.planner.optimize import simple_policies


@pytest.fixture(scope="module")
def measured_run() -> tuple[StepCosts, dict[str, tuple[int | None, float]]]:
    return recorded_run("zoo_h100_2026-11-28_offload_host", "resnet152")


def test_the_h100s_offload_policy_predicts_what_it_measured(measured_run: tuple[StepCosts, dict]) -> None:
    """Every Bottleneck sending its smallest saved tensor measured 98.9 ms where keep everything measured 71.8: the
    model's copies of that policy (next to nothing over the link) say far less, the rest is each block's ``off_s``
    (27 ms over 50 blocks, by the tensors each saves), and the calibrated model predicts the policy's step as
    measured, keep everything's as measured too."""
    bare, measured = measured_run
    assert measured[OFFLOAD_ALL][1] == pytest.approx(0.0989, abs=5e-4) and measured[KEEP_ALL][1] < 0.075
    chain = calibrate(bare, simple_policies(bare), measured)
    policy = offload_policy(chain)
    assert policy is not None and len(policy) == 50 and all(d.mode == "offload" for d in policy)
    assert predict(chain, policy).d2h_bytes < 2**30 // 20  # the host's work alone: well under 50 MiB a step
    assert sum(b.off_s for b in chain.blocks) == pytest.approx(0.027, abs=2e-3)
    assert all(b.off_s > 0 for b in chain.blocks)
    assert predict(chain, policy).step_s == pytest.approx(measured[OFFLOAD_ALL][1], rel=1e-3)
    assert predict(chain, simple_policies(chain)[0][1]).step_s == pytest.approx(measured[KEEP_ALL][1], rel=1e-3)
    without = calibrate(bare, simple_policies(bare), {k: v for k, v in measured.items() if k != OFFLOAD_ALL})
    assert predict(without, policy).step_s < measured[OFFLOAD_ALL][1] - 0.02  # the model alone: 20+ ms short
