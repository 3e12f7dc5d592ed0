"""``SnapshotStore("cuda", disk=...)`` (NOTE [ Snapshot disk tier ] Rules 1-3) with delayed copy streams.

The copies to and from host memory are held back by random device sleeps, so a disk write that
did not wait for its flush's event, or a fill issued before its read ended, would restore wrong
bits; every restore is compared bit for bit, and loops against the plain unrolled loop.
"""
from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch

from torchckpt import SnapshotStore, checkpointed_loop
from torchckpt.memory import DiskTier, HostPool
from torchckpt.schedules import (
    Free, Prefetch, Restore, Revolve, Save, Tier, Uniform, ZCut, plan_flushes, plan_prefetch,
)

pytestmark = pytest.mark.cuda


def state(n: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(300 + n)
    return [torch.randn(256, 1024, device="cuda", generator=g),
            torch.randn(77, device="cuda", generator=g, dtype=torch.float64).to(torch.bfloat16)]


def pool() -> HostPool:
    return HostPool(capacity_bytes=256 << 20, chunk_bytes=1 << 20, pin=True)


def delayed(store: SnapshotStore, seed: int) -> None:
    rng = random.Random(seed)
    store._mover.delay = lambda kind, stream: torch.cuda._sleep(rng.randint(0, 3_000_000))


@pytest.mark.parametrize("direct", [None, False])
@pytest.mark.parametrize("mode", ["plain", "prefetch", "write-back"])
def test_disk_schedules_bit_exact_under_delays(tmp_path: Any, direct: bool | None, mode: str) -> None:
    for k, sched in enumerate([Revolve(30, 4, tier=Tier.DISK), Uniform(30, 4, tier=Tier.DISK),
                               ZCut(30, tier=Tier.DISK)]):
        acts = list(plan_prefetch(sched, 2)) if mode != "plain" else list(sched)
        flushes = frozenset(plan_flushes(acts, 2)) if mode == "write-back" else None
        tier = DiskTier(tmp_path, direct=direct)
        s = SnapshotStore("cuda", slots=2, host=pool(), disk=tier)
        delayed(s, k)
        for i, a in enumerate(acts):
            if isinstance(a, Save):
                s.save(a.n, a.tier, state(a.n), flush=flushes is None or i in flushes)
            elif isinstance(a, Restore):
                got = [t.clone() for t in s.restore(a.n, a.tier)]
                s.after_use()
                for x, y in zip(got, state(a.n)):
                    assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (sched, i, a)
            elif isinstance(a, Prefetch):
                s.prefetch(a.n, a.src, a.dst)
            elif isinstance(a, Free):
                s.free(a.n, a.tier)
        st = s.stats()
        assert st.disk is not None and st.disk.writes > 0 and st.disk.reads > 0
        assert tier.files() == []
        s.close()
        tier.close()
    assert os.listdir(tmp_path) == []


def test_loop_on_cuda_with_disk_snapshots(tmp_path: Any) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    w0 = (torch.randn(512, 512, device="cuda", generator=g) * 0.05)
    x00 = torch.randn(64, 512, device="cuda", generator=g)

    def run(store: SnapshotStore | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        w, x0 = w0.clone().requires_grad_(), x00.clone().requires_grad_()

        def step(x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x @ w) + 0.5 * x

        if store is None:
            x = x0
            for _ in range(40):
                x = step(x)
        else:
            x = checkpointed_loop(step, x0, 40, schedule=Revolve(40, 4, tier=Tier.DISK), store=store, slots=2)
        return x.detach(), list(torch.autograd.grad(x.square().sum(), [w, x0]))

    ref, g_ref = run(None)
    with SnapshotStore("cuda", slots=2, host=pool(), disk=tmp_path) as snaps:
        delayed(snaps, 5)
        out, got = run(snaps)
        assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(got, g_ref))
        st = snaps.stats()
        assert st.disk is not None and st.disk.writes > 0 and st.disk.reads > 0
    assert os.listdir(tmp_path) == []
