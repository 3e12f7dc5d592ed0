"""``SnapshotStore(peers=...)`` (NOTE [ Snapshot peer tier ] Rules 1-6): HOST snapshots split between host memory and
other ranks' spare memory by the group's spill plan, over gloo with 2 and 3 spawned processes.

Every rank replays the same schedule (SPMD) with its own snapshots; every restore is compared bit for bit with what
was saved, the bytes that went to peers are counted on both sides, the holders' memory is checked empty at the end
and never above the plan, and the cache's bookkeeping (hits, misses, prefetches) is the one a store without peers
has. Ranks that call different actions must all raise, none hang. Loops and scans through a store with peers give
the gradients of the plain unrolled loop bit for bit. ``test_snapshot_peer_cuda.py`` runs the replay over NCCL.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import random
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ckpt_models import assert_bits_equal, replay_snapshots, small_pool
from spawn_ranks import spawn_ranks
from torchckpt import CheckpointError, SnapshotStore, checkpointed_loop, checkpointed_scan
from torchckpt.codecs import Identity
from torchckpt.distributed import SpillPlan, exchange
from torchckpt.memory import HostPool, PeerTier
from torchckpt.schedules import Action, Revolve, Tier, plan_flushes, plan_prefetch, simulate
from torchckpt.schedules.spill import Spill
from torchckpt.store.snapshot_peer import PLAN_SLACK, PeerSpill

JOIN_TIMEOUT_S = 60
HOST_BW, PEER_BW = 55e9, 300e9  # benchmarks/peer_spill.py on 2 H100s
SLOTS = 2


# -- what every rank runs ------------------------------------------------------------------------------------------
def state(rank: int, n: int, device: str = "cpu") -> list[torch.Tensor]:
    """Snapshot n of rank ``rank``: several dtypes, every bit a function of (rank, n)."""
    g = torch.Generator().manual_seed(1000 * rank + n)
    out = [
        torch.randn(40, 9, generator=g, dtype=torch.float64),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randint(-(2**62), 2**62, (5,), generator=g),
        torch.randn(33, generator=g) > 0,
        torch.tensor([float("nan"), -0.0, float("inf")]) + n,
    ]
    return [t.to(device) for t in out]


def snapshot_bytes(device: str = "cpu") -> int:
    """Bytes of one snapshot in a slot (what the plan is sized in)."""
    s = SnapshotStore(device, slots=1, host=small_pool())
    s.calibrate(state(0, 0, device))
    nb = s.slot_bytes
    s.close()
    assert nb is not None
    return nb


def host_in_use(pool: HostPool) -> int:
    pool.free(pool.alloc(1))  # reclaims parked blocks
    return pool.stats().in_use_bytes


def peer_row(rank: int, world: int) -> list[float]:
    return [0.0 if j == rank else PEER_BW - 20e9 * j for j in range(world)]


def replay(store: SnapshotStore, tier: PeerTier, acts: list[Action], flushes: frozenset[int] | None, rank: int,
           device: str = "cpu") -> dict[str, Any]:
    """Run the actions one by one (each restore checked bit for bit); the most bytes this store had on peers and
    the most its tier held for peers, after any action (read from the counters: ``stats()`` would synchronize)."""
    restores, mine, held = 0, 0, 0
    for i, a in enumerate(acts):
        one = None if flushes is None else (frozenset({0}) if i in flushes else frozenset())
        restores += replay_snapshots(store, [a], lambda n: state(rank, n, device), one)
        mine = max(mine, store._c["peer_held_bytes"])
        held = max(held, tier.held_bytes())
    return {"restores": restores, "peak_mine": mine, "peak_held": held}


def stats_dict(store: SnapshotStore) -> dict[str, Any]:
    st = store.stats()
    return {f.name: getattr(st, f.name) for f in dataclasses.fields(st) if f.name != "disk"}


OVERFLOW = {2: [1, 0], 3: [1, 0, 0.5]}  # in units of the schedule's HOST peak
SPARE = {2: [0, 10], 3: [0, 3, 2]}  # in snapshots


def run_replay(rank: int, world: int, mode: str, greedy: bool, device: str = "cpu",
               tier: PeerTier | None = None) -> dict[str, Any]:
    """One schedule replayed on a store with peers and on one without; rank 0 (and 2) overflow, others lend.

    On CUDA the store's host copies and fills are held back by random device sleeps (as in the disk tier's CUDA
    tests), so a restore or a send that did not wait for its event would see wrong bits."""
    sched = Revolve(30, 6, tier=Tier.HOST)
    acts = list(plan_prefetch(sched, SLOTS)) if mode != "plain" else list(sched)
    flushes = frozenset(plan_flushes(acts, SLOTS)) if mode == "write-back" else None
    codec = Identity() if mode == "codec" else None
    nb = snapshot_bytes(device)
    peak = simulate(sched).peak_snapshots[Tier.HOST]
    tier = tier if tier is not None else PeerTier()
    peers = PeerSpill.exchange(tier, int(OVERFLOW[world][rank] * peak * nb), SPARE[world][rank] * nb, HOST_BW,
                               peer_row(rank, world), greedy=greedy)
    pool = small_pool() if device == "cpu" else HostPool(capacity_bytes=256 << 20, chunk_bytes=1 << 20, pin=True)
    store = SnapshotStore(device, slots=SLOTS, host=pool, codec=codec, peers=peers)
    if device != "cpu":
        rng = random.Random(rank)
        store._mover.delay = lambda kind, stream: torch.cuda._sleep(rng.randint(0, 2_000_000))
    res = replay(store, tier, acts, flushes, rank, device)
    res["stats"] = stats_dict(store)
    res["to_peer"] = peers.plan.to_peer
    res["to_host"] = peers.plan.to_host
    res["from_peer"] = peers.plan.from_peer
    res["held_end"] = tier.held_bytes()
    if device != "cpu":
        torch.cuda.synchronize()  # host blocks freed behind copies still in flight come back once those end
    res["host_end"] = host_in_use(pool)
    res["snapshot_bytes"] = nb
    store.close()
    res["held_after_close"] = tier.held_bytes()
    plain = SnapshotStore(device, slots=SLOTS, host=small_pool() if device == "cpu" else pool, codec=codec)
    for i, a in enumerate(acts):  # the same actions on a store without peers (local, no rounds)
        one = None if flushes is None else (frozenset({0}) if i in flushes else frozenset())
        replay_snapshots(plain, [a], lambda n: state(rank, n, device), one)
    res["plain"] = stats_dict(plain)
    plain.close()
    return res


def run_mismatch(rank: int, world: int) -> dict[str, Any]:
    """Ranks that call different actions all raise; nothing hangs; a with-block left by an exception closes locally."""
    res: dict[str, Any] = {}
    tier = PeerTier()
    nb = snapshot_bytes()
    peers = PeerSpill.exchange(tier, 4 * nb if rank == 0 else 0, 0 if rank == 0 else 4 * nb, HOST_BW,
                               peer_row(rank, world), greedy=True)
    s = SnapshotStore("cpu", slots=1, host=small_pool(), peers=peers)
    s.save(0, Tier.HOST, state(rank, 0))  # rank 0's copy goes to rank 1 (greedy: all to the peer)
    try:  # a different n
        s.save(1 if rank == 0 else 2, Tier.HOST, state(rank, 1))
        res["n"] = "no error"
    except CheckpointError as e:
        res["n"] = str(e)
    try:  # the peer side has stopped
        s.restore(0, Tier.HOST)
        res["stopped"] = "no error"
    except CheckpointError as e:
        res["stopped"] = str(e)
    res["held_after_mismatch"] = tier.held_bytes()
    s.close()  # local now
    tier.close()
    s2 = SnapshotStore("cpu", slots=1, host=small_pool(), peers=peers)
    s2.save(0, Tier.HOST, state(rank, 0))
    try:  # a different action
        if rank == 0:
            s2.free(0, Tier.HOST)
        else:
            s2.restore(0, Tier.HOST)
        res["action"] = "no error"
    except CheckpointError as e:
        res["action"] = str(e)
    s2.close()
    tier.close()
    try:  # an exception leaving a with block (on every rank here): close is local, nobody waits
        with SnapshotStore("cpu", slots=1, host=small_pool(), peers=peers) as s3:
            s3.save(0, Tier.HOST, state(rank, 0))
            raise KeyError("boom")
    except KeyError:
        res["with"] = "left"
    tier.close()
    s4 = SnapshotStore("cpu", slots=1, host=small_pool(), peers=peers)  # the tier still works for a new store
    s4.save(3, Tier.HOST, state(rank, 3))
    assert_bits_equal([t.clone() for t in s4.restore(3, Tier.HOST)], state(rank, 3))
    res["s4_exact"] = True
    s4.free(3, Tier.HOST)
    s4.close()
    res["held_end"] = tier.held_bytes()
    dist.barrier()
    return res


def run_loops(rank: int, world: int) -> dict[str, Any]:
    """checkpointed_loop and checkpointed_scan through one store with peers: the plain loop's gradients, bit for bit."""
    res: dict[str, Any] = {}
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(16, 16, generator=g) * 0.3).requires_grad_()  # shared; each rank its own sub-domain
    x0 = torch.randn(16, generator=torch.Generator().manual_seed(100 + rank)).requires_grad_()
    forcing = torch.randn(24, 16, generator=torch.Generator().manual_seed(200 + rank))
    steps = 24
    sched = Revolve(steps, 4, tier=Tier.HOST)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(w @ x) + 0.5 * x

    def scan_step(x: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tanh(w @ x) + 0.5 * x + f
        return x, x.square().sum()

    x = x0
    for _ in range(steps):
        x = step(x)
    want = torch.autograd.grad(x.square().sum(), [w, x0])
    x, ys = x0, []
    for k in range(steps):
        x, y = scan_step(x, forcing[k])
        ys.append(y)
    want_scan = torch.autograd.grad(x.sum() + torch.stack(ys).sum(), [w, x0])

    tier = PeerTier()
    peak = simulate(sched).peak_snapshots[Tier.HOST]
    nb = 256  # one 16-float state in a slot (256-byte aligned)
    peers = PeerSpill.exchange(tier, peak * nb if rank == 0 else 0, 0 if rank == 0 else 4 * nb, HOST_BW,
                               peer_row(rank, world))
    store = SnapshotStore("cpu", slots=1, host=small_pool(), peers=peers)
    y = checkpointed_loop(step, x0, steps, schedule=sched, store=store)
    got = torch.autograd.grad(y.square().sum(), [w, x0])
    res["loop_exact"] = [torch.equal(a, b) for a, b in zip(got, want)]
    after_loop = store.stats()
    res["loop_sent"] = after_loop.peer_saves
    res["loop_fetched"] = after_loop.peer_fetches
    res["held_after_loop"] = tier.held_bytes()
    c, ys = checkpointed_scan(scan_step, x0, forcing, schedule=sched, store=store, prefetch=False)
    got = torch.autograd.grad(c.sum() + ys.sum(), [w, x0])
    res["scan_exact"] = [torch.equal(a, b) for a, b in zip(got, want_scan)]
    res["scan_sent"] = store.stats().peer_saves - after_loop.peer_saves
    res["held_after_scan"] = tier.held_bytes()
    res["store_held"] = store.stats().peer_held_bytes
    store.close()
    return res


def run_both_plans(rank: int, world: int, mode: str, device: str = "cpu") -> dict[str, Any]:
    """``run_replay`` with the max-flow plan, then with the greedy one, through one tier (one spawn: faster)."""
    tier = PeerTier()
    return {"maxflow": run_replay(rank, world, mode, False, device, tier),
            "greedy": run_replay(rank, world, mode, True, device, tier)}


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {"replay": run_replay, "both": run_both_plans,
                                                         "mismatch": run_mismatch, "loops": run_loops}


def _worker(rank: int, world: int, tmp: str, backend: str, scenario: str, kwargs: dict[str, Any]) -> None:
    res: dict[str, Any] = {}
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
        try:
            res = SCENARIOS[scenario](rank, world, **kwargs)
        finally:
            dist.destroy_process_group()
    except BaseException:
        res["traceback"] = traceback.format_exc()
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(res, f)


def run(world: int, tmp: str, scenario: str, backend: str = "gloo", **kwargs: Any) -> list[dict[str, Any]]:
    """Spawn ``world`` ranks running ``scenario``; their results, or the first rank's traceback."""
    return spawn_ranks(_worker, world, tmp, backend, scenario, kwargs, timeout_s=JOIN_TIMEOUT_S)


def check_both_plans(both: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two ranks' replays under the max-flow and the greedy plan, rank 0 overflowing into rank 1: each checked as
    ``check_replay`` does; returns (max-flow results, greedy results)."""
    best, greedy = [res["maxflow"] for res in both], [res["greedy"] for res in both]
    for results in (best, greedy):
        check_replay(results, 2)
        assert results[0]["stats"]["peer_saves"] > 0 and results[1]["stats"]["peer_saves"] == 0
        assert results[1]["peak_held"] > 0
    # the min-time plan keeps part of the overflow on rank 0's own host link; greedy sends it all to the faster peer
    assert best[0]["to_host"] > 0 and greedy[0]["to_host"] == 0
    return best, greedy


def check_replay(results: list[dict[str, Any]], world: int) -> None:
    """What every replay must show, whatever the plan and the backend."""
    nb = results[0]["snapshot_bytes"]
    for r, res in enumerate(results):
        st, plain = res["stats"], res["plain"]
        assert res["restores"] == 29, r  # Revolve(30, ...) restores n - 1 times, each bit for bit
        assert (st["hits"], st["misses"], st["prefetches"]) == (plain["hits"], plain["misses"], plain["prefetches"]), r
        assert st["peer_actions"] == results[0]["stats"]["peer_actions"] > 0, r  # every rank agreed on each action
        sends = [j for j, b in enumerate(res["to_peer"]) if b * (1 + PLAN_SLACK) >= nb]
        if sends:
            assert st["peer_saves"] > 0 and st["peer_bytes_sent"] >= st["peer_saves"] * nb, r
            assert st["peer_fetches"] + st["peer_drops"] == st["peer_saves"], r  # each copy fetched or dropped
            assert st["peer_bytes_fetched"] == st["peer_fetches"] * (st["peer_bytes_sent"] // st["peer_saves"]), r
        else:
            assert st["peer_saves"] == st["peer_bytes_sent"] == st["peer_fetches"] == 0, r
        # this store's copies never above the plan's bytes on all peers together, nor a holder above its spare
        # (both to the plan's own precision, NOTE [ Snapshot peer tier ] Rule 3)
        assert res["peak_mine"] <= sum(res["to_peer"]) * (1 + PLAN_SLACK), r
        assert res["peak_held"] <= SPARE[world][r] * nb * (1 + PLAN_SLACK), r
        if max(res["from_peer"]) * (1 + PLAN_SLACK) >= nb:
            assert res["peak_held"] > 0, r  # bytes really arrived here
        assert st["peer_held_bytes"] == 0 and res["held_end"] == 0 and res["held_after_close"] == 0, r
        assert res["host_end"] == 0, r
    assert sum(res["stats"]["peer_bytes_sent"] for res in results) > 0


@pytest.mark.parametrize("mode", ["plain", "write-back", "codec"])
def test_replay_two_ranks_maxflow_and_greedy(tmp_path: Any, mode: str) -> None:
    """Rank 0 overflows, rank 1 lends: Revolve on HOST, restored bit for bit, with both plans."""
    best, greedy = check_both_plans(run(2, str(tmp_path), "both", mode=mode))
    assert greedy[0]["stats"]["peer_saves"] >= best[0]["stats"]["peer_saves"]
    if mode == "plain":
        assert best[0]["stats"]["misses"] > 0 and best[0]["stats"]["peer_fetches"] > 0  # fetched on demand
    else:
        assert best[0]["stats"]["prefetches"] > 0


def test_replay_three_ranks(tmp_path: Any) -> None:
    """Ranks 0 and 2 overflow, ranks 1 and 2 lend: every split by the max-flow plan, bit for bit."""
    results = run(3, str(tmp_path), "replay", mode="plain", greedy=False)
    check_replay(results, 3)
    assert results[0]["stats"]["peer_saves"] > 0 and results[2]["stats"]["peer_saves"] > 0  # both overflowing ranks
    assert results[1]["stats"]["peer_saves"] == 0
    assert results[1]["peak_held"] > 0 and results[2]["peak_held"] > 0  # both lending ranks held copies


def test_mismatched_actions_raise_on_every_rank(tmp_path: Any) -> None:
    results = run(2, str(tmp_path), "mismatch")
    for r, res in enumerate(results):
        for key in ("n", "action"):
            msg = res[key]
            assert msg.startswith("torchckpt: the ranks called their SnapshotStore(peers=...) in different orders"), \
                (r, key, msg)
            assert "same n in the same order" in msg
        assert "rank 0: #2 save(1)" in results[r]["n"] and "rank 1: #2 save(2)" in results[r]["n"]
        assert "rank 0: #2 free(0)" in results[r]["action"] and "rank 1: #2 restore(0)" in results[r]["action"]
        assert res["stopped"] == res["n"]  # every later peer action raises the same
        assert res["with"] == "left" and res["s4_exact"] and res["held_end"] == 0
    assert results[1]["held_after_mismatch"] > 0 and results[0]["held_after_mismatch"] == 0  # until PeerTier.close()


def test_loop_and_scan_through_peers_match_plain_gradients(tmp_path: Any) -> None:
    results = run(2, str(tmp_path), "loops")
    for r, res in enumerate(results):
        assert res["loop_exact"] == [True, True] and res["scan_exact"] == [True, True], r
        assert res["held_after_loop"] == res["held_after_scan"] == res["store_held"] == 0, r
    assert results[0]["loop_sent"] > 0 and results[0]["scan_sent"] > 0 and results[0]["loop_fetched"] > 0
    assert results[1]["loop_sent"] == results[1]["scan_sent"] == 0


# -- one process ---------------------------------------------------------------------------------------------------
@pytest.fixture
def one_rank() -> Any:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_peers_argument_errors(one_rank: Any) -> None:
    tier = PeerTier()
    with pytest.raises(TypeError, match=r"^torchckpt: SnapshotStore\(peers=...\) expects .*PeerSpill.*"
                                        r"PeerSpill.exchange\(PeerTier\(\)"):
        SnapshotStore("cpu", slots=1, host=small_pool(), peers=tier)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^torchckpt: PeerSpill\(plan=...\) expects .*SpillPlan"):
        PeerSpill(tier, "plan")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^torchckpt: PeerSpill\(tier=...\) expects .*PeerTier"):
        PeerSpill("tier", exchange(0, 0, HOST_BW))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^torchckpt: PeerSpill.exchange\(tier=...\)"):
        PeerSpill.exchange(None, 0, 0, HOST_BW)  # type: ignore[arg-type]
    other = SpillPlan(Spill((0.0, 0.0), ((0.0, 0.0), (0.0, 0.0)), 0.0), 1, (0, 0), (0, 0))
    with pytest.raises(ValueError, match=r"^torchckpt: PeerSpill's plan is for rank 1 of 2 but its tier is rank 0 "
                                         r"of 1; make the plan with exchange\(..., group=tier.group\)"):
        PeerSpill(tier, other)
    elsewhere = PeerSpill(PeerTier(device="cuda:0"), exchange(0, 0, HOST_BW))  # needs no GPU: only a device name
    with pytest.raises(ValueError, match=r"^torchckpt: SnapshotStore\(peers=...\) moves snapshots on cpu, but its "
                                         r"PeerTier holds tensors on cuda:0; make the tier with PeerTier\(device='cpu'\)"):
        SnapshotStore("cpu", slots=1, host=small_pool(), peers=elsewhere)


def test_one_rank_keeps_everything_on_host(one_rank: Any) -> None:
    """A group of one has no peer: the store behaves as without peers, and still agrees (with itself) per action."""
    tier = PeerTier()
    sched = Revolve(12, 3, tier=Tier.HOST)
    acts = list(plan_prefetch(sched, SLOTS))
    peers = PeerSpill.exchange(tier, 10 << 20, 0, HOST_BW)
    s = SnapshotStore("cpu", slots=SLOTS, host=small_pool(), peers=peers)
    plain = SnapshotStore("cpu", slots=SLOTS, host=small_pool())
    assert replay_snapshots(s, acts, lambda n: state(0, n)) == replay_snapshots(plain, acts, lambda n: state(0, n))
    a, b = s.stats(), plain.stats()
    host_actions = sum(1 for x in acts if getattr(x, "tier", None) is Tier.HOST or getattr(x, "src", None) is Tier.HOST)
    assert a.peer_actions == host_actions and a.peer_rounds == 0 and a.peer_saves == 0
    assert dataclasses.replace(a, peer_actions=0, peer_wait_s=0.0, save_wait_s=0.0, miss_wait_s=0.0) == \
        dataclasses.replace(b, save_wait_s=0.0, miss_wait_s=0.0)
    s.close()
    with pytest.raises(CheckpointError, match=r"^torchckpt: this SnapshotStore was closed.*make a new"):
        s.save(0, Tier.HOST, state(0, 0))
    s.close()  # twice: nothing left to do
    plain.close()
