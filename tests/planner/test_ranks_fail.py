"""NOTE [ One plan for all ranks ] Rules 5-7: ranks planning together fail together. Two gloo processes (CPU) plan a DDP
model; one rank is made to fail (by patching the planner's own functions on that rank, or a hook on one of its blocks)
and every rank must raise a ``torchckpt:`` error naming it within a bounded time rather than wait in a collective."""
from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchckpt
import torchckpt.planner.verify as verify
from spawn_ranks import spawn_ranks
from test_works_with import _blocks, _parallel

PG_TIMEOUT_S = 15  # a rank waiting in a collective gives up after this: the tests fail, not hang, on code that waits
JOIN_TIMEOUT_S = 60


@contextlib.contextmanager
def _patched(rank: int, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """``torchckpt.planner.verify.<name>`` replaced by ``make(it)`` on rank 1 only."""
    was = getattr(verify, name)
    if rank == 1:
        setattr(verify, name, make(was))
    try:
        yield
    finally:
        setattr(verify, name, was)


def _raises(e: BaseException) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(was: Callable[..., Any]) -> Callable[..., Any]:
        def fail(*a: Any, **kw: Any) -> Any:
            raise e
        return fail
    return make


def _outcome(fn: Callable[[], Any]) -> tuple[str, str, float]:
    """``("ok", repr of what fn returned, seconds)`` or ``("raised", "<type>: <message>", seconds)``."""
    t0 = time.perf_counter()
    try:
        got = fn()
        return "ok", repr(got), time.perf_counter() - t0
    except Exception as e:
        return "raised", f"{type(e).__name__}: {e}", time.perf_counter() - t0


def _modes(p: torchckpt.Plan) -> list[str]:
    return [b.mode for b in p.blocks]


def _init(rank: int, world: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    torch.set_num_threads(1)


def _leave(rank: int, tmp: str, res: dict[str, Any]) -> None:
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(res, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no collective on the way out: a rank left waiting must fail on its own (the timeout, a closed peer)


def _agreed_worker(rank: int, world: int, tmp: str) -> None:
    """Failures of rank 1 outside the steps the ranks run together, one after another on the same process group
    (each must leave the ranks in step for the next), then a plan both ranks make."""
    res: dict[str, Any] = {}
    try:
        _init(rank, world, tmp)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + rank))
        model = _parallel(_blocks(None, d=16), "ddp")

        def plan() -> list[str]:
            return _modes(torchckpt.plan(model, x, budget=1 << 40))

        with _patched(rank, "check_args", _raises(ValueError("this rank's own check failed (raised by the test)"))):
            res["check"] = _outcome(plan)
        with _patched(rank, "measure_link", _raises(torch.OutOfMemoryError("out of memory (raised by the test)"))):
            res["link"] = _outcome(plan)
        with _patched(rank, "search", _raises(ValueError("the search failed (raised by the test)"))):
            res["search"] = _outcome(plan)
        with _patched(rank, "_make", _raises(ValueError("making the plan failed (raised by the test)"))):
            res["verify"] = _outcome(lambda: {b: _modes(p) for b, p in torchckpt.planner.plans(
                model, x, budgets=[1 << 40]).items()})
        res["after"] = _outcome(plan)
        res["below_floor"] = _outcome(lambda: torchckpt.plan(model, x, budget=1))
        a = torchckpt.auto(model, budget=1 << 40)
        with _patched(rank, "_make", _raises(ValueError("making the plan failed in auto (raised by the test)"))):
            res["auto"] = _outcome(lambda: model(x.clone().requires_grad_()).square().mean().backward())
        a.remove()
    except Exception:
        res["traceback"] = traceback.format_exc()
    _leave(rank, tmp, res)


def _step_oom_worker(rank: int, world: int, tmp: str) -> None:
    """Rank 1 runs out of memory (raised by hand) in block 1's forward in the first profiling step, once."""
    res: dict[str, Any] = {}
    try:
        _init(rank, world, tmp)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + rank))
        m = _blocks(None, d=16)
        model = _parallel(m, "ddp")
        if rank == 1:
            left = [1]

            def oom(*_: Any) -> None:
                if left[0]:
                    left[0] -= 1
                    raise torch.OutOfMemoryError("out of memory (raised by the test)")

            m[1].register_forward_pre_hook(oom)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            res["plan"] = _outcome(lambda: _modes(torchckpt.plan(model, x, budget=1 << 40)))
        res["warnings"] = [str(w.message) for w in seen]
    except Exception:
        res["traceback"] = traceback.format_exc()
    _leave(rank, tmp, res)


def _gloo() -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


@pytest.fixture(scope="module")
def agreed_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    _gloo()
    return spawn_ranks(_agreed_worker, 2, str(tmp_path_factory.mktemp("agreed")), timeout_s=JOIN_TIMEOUT_S)


def _both_name_rank_1(ranks: list[dict[str, Any]], case: str, words: str) -> None:
    for r, res in enumerate(ranks):
        how, what, seconds = res[case]
        assert how == "raised" and what.startswith("RanksFailed: torchckpt: "), (r, what)
        assert "rank 1 raised" in what and words in what, (r, what)
        assert seconds < PG_TIMEOUT_S, (r, seconds)  # agreed at an exchange, not given up on after the timeout


@pytest.mark.parametrize("case,words", [
    ("check", "ValueError: this rank's own check failed (raised by the test)"),
    ("link", "OutOfMemoryError: out of memory (raised by the test)"),
    ("search", "ValueError: the search failed (raised by the test)"),
    ("verify", "ValueError: making the plan failed (raised by the test)"),
    ("auto", "ValueError: making the plan failed in auto (raised by the test)"),
])
def test_a_rank_failing_outside_a_step_raises_on_every_rank(agreed_ranks: list[dict[str, Any]], case: str,
                                                             words: str) -> None:
    """NOTE [ One plan for all ranks ] Rule 5: before the profiles are exchanged (the arguments checked, the link
    measured), after (the search), while verifying (``plans``) and in ``auto``'s first step: both ranks raise."""
    _both_name_rank_1(agreed_ranks, case, words)


def test_ranks_plan_together_after_an_agreed_failure(agreed_ranks: list[dict[str, Any]]) -> None:
    """After the failures above, on the same process group, both ranks still plan in step: the same plan, and a budget
    below the floor is ``PlanError`` on both (every rank failed alike: each raises its own, NOTE [ One plan for all ranks
    ] Rule 5)."""
    a, b = agreed_ranks
    assert a["after"][0] == "ok" and a["after"][:2] == b["after"][:2], (a["after"], b["after"])
    for res in agreed_ranks:
        assert res["below_floor"][0] == "raised" and res["below_floor"][1].startswith("PlanError: torchckpt: ")


def test_running_out_of_memory_in_the_profiling_step_on_one_rank() -> None:
    """NOTE [ One plan for all ranks ] Rules 6-7: rank 1 runs out of memory inside the profiling step, whose
    collectives rank 0 has gone on into: rank 1 does not profile block by block alone, and raises at once an error
    naming itself, the step and that the others wait until the process group's timeout; rank 0 is not left waiting
    (rank 1's process ends: gloo closes its connections) and says that another rank probably failed."""
    _gloo()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        r0, r1 = spawn_ranks(_step_oom_worker, 2, tmp, timeout_s=JOIN_TIMEOUT_S)
    how, what, seconds = r1["plan"]
    assert how == "raised" and what.startswith("RanksFailed: torchckpt: plan(model, ...)"), what
    assert "on rank 1 the profiling step" in what and "OutOfMemoryError: out of memory (raised by the test)" in what
    assert "until the process group's timeout" in what and "plan.save" in what, what
    assert not any("block by block" in w for w in r1["warnings"]), r1["warnings"]
    assert seconds < PG_TIMEOUT_S, seconds
    how, what, _ = r0["plan"]
    assert how == "raised" and what.startswith("RanksFailed: torchckpt: ") and "another rank probably failed" in what, what
