"""Running a test's ranks as spawned processes: each writes ``rank{r}.pkl`` into ``tmp`` (its result, or a
``traceback`` entry), and the test reads them all back, failing on a hung rank or the first traceback."""
from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def spawn_ranks(target: Callable[..., None], world: int, tmp: str, *args: Any, timeout_s: float = 60) -> list[Any]:
    """Start ``target(rank, world, tmp, *args)`` for every rank, wait up to ``timeout_s`` each, return the results."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, tmp, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} hung"
    out = []
    for r in range(world):
        with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
            res = pickle.load(f)
        assert "traceback" not in res, f"rank {r}:\n{res['traceback']}"
        out.append(res)
    return out
