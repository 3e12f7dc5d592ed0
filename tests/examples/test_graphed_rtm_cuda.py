"""CUDA: examples/wave.py's ``GraphedRTM`` (the fifth rule of its note on the wave adjoint) replays its steps as CUDA graphs and gives
the eager ``RTM``'s image bit for bit, through schedules whose restores break the run of steps, with a store whose
saves are graphs too (NOTE [ Captured saves ])."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from torchckpt.adjoint import run_schedule
from torchckpt.codecs import TritonQuant
from torchckpt.memory import HostPool
from torchckpt.schedules import Revolve, Tier, ZCut
from torchckpt.store import SnapshotStore

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
from wave import (GraphedRTM, RTM, cfl_dt, dominant_frequency, layered_model, model_data, ricker,  # noqa: E402
                  rtm_keep_all, smooth, surface_survey)


def problem(n: int = 32, steps: int = 60) -> tuple:
    shape = (n, n, n)
    vel = layered_model(shape, 10.0, "cuda", torch.float64)
    dt = cfl_dt(vel.max().item(), 10.0)
    wavelet = ricker(steps, dt, dominant_frequency(vel.min().item(), 10.0))
    survey = surface_survey(shape, depth=2, stride=2, device="cuda")
    vel2 = (vel * dt / 10.0).square().float().contiguous()
    mig = (smooth(vel) * dt / 10.0).square().float().contiguous()
    return mig, survey, wavelet, model_data(vel2, survey, wavelet, steps)


def run(rtm: RTM, sched: object, store: SnapshotStore) -> torch.Tensor:
    rtm.reset()
    run_schedule(sched, forward=rtm.forward, save=rtm.save, restore_into=lambda n: (rtm.u.cur, rtm.u.prev),
                 backward=rtm.backward, store=store)
    store.close()
    return rtm.image.clone()


def test_the_image_is_the_eager_steps_bits() -> None:
    args = problem()
    eager, graphed = RTM(*args), GraphedRTM(*args)
    assert torch.equal(rtm_keep_all(graphed), rtm_keep_all(eager))
    assert len(graphed._graphs) >= 3  # both source-step orders, and adjoint steps
    pool = HostPool(capacity_bytes=256 << 20, chunk_bytes=8 << 20, pin=True)
    for sched in (Revolve(60, 5, tier=Tier.HOST), ZCut(60, tier=Tier.HOST)):
        want = run(eager, sched, SnapshotStore("cuda", slots=3, host=pool))
        assert torch.equal(run(graphed, sched, SnapshotStore("cuda", slots=3, host=pool)), want)
        codec = TritonQuant(4, "abs", 1e-3)
        want = run(eager, sched, SnapshotStore("cuda", slots=3, host=pool, codec=codec))
        got = run(graphed, sched, SnapshotStore("cuda", slots=3, host=pool, codec=codec, defer_sizes=True, graphs=True))
        assert torch.equal(got, want)
    assert len(graphed._graphs) <= 2 + 4  # two source-step orders, four adjoint-step pairs: nothing captured again


def test_graphed_rtm_needs_cuda() -> None:
    mig, survey, wavelet, data = problem(16, 10)
    with pytest.raises(ValueError, match="GraphedRTM replays CUDA graphs"):
        GraphedRTM(mig.cpu(), survey, wavelet, data.cpu())
