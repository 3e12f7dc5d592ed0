"""Peer spill across processes (NOTE [ Capacity exchange ], NOTE [ Peer tier ]): gloo on CPU, 2 and 3 ranks."""
from __future__ import annotations

import os
import pickle
import traceback

import pytest
import torch
import torch.distributed as dist

from spawn_ranks import spawn_ranks
from torchckpt._errors import CheckpointError
from torchckpt.distributed import DEFAULT_PEER_BANDWIDTH, exchange
from torchckpt.memory import PeerTier
from torchckpt.schedules.spill import greedy_spill, plan_spill

G = 1e9
JOIN_TIMEOUT_S = 90


def _inputs(n: int) -> tuple[list[int], list[int], list[float], list[list[float]]]:
    overflow = [int(x * G) for x in [8, 0, 3][:n]]
    spare = [int(x * G) for x in [0, 6, 2][:n]]
    host = [x * G for x in [50, 25, 50][:n]]
    peer = [[0.0 if i == j else (150 + 50 * i + 10 * j) * G for j in range(n)] for i in range(n)]
    return overflow, spare, host, peer


def _tensors(rank: int, dest: int) -> list[tuple[object, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 * rank + dest)
    base = torch.randn(6, 10, dtype=torch.float32, generator=g)
    out: list[tuple[object, torch.Tensor]] = [
        ("f64", torch.randn(5, 7, dtype=torch.float64, generator=g)),
        (("bf16", 3), torch.randn(4, 3, 2, generator=g).to(torch.bfloat16)),
        ("i64", torch.randint(-2**62, 2**62, (33,), dtype=torch.int64, generator=g)),
        ("noncontig", base.t()[::2]),
        ("scalar", torch.tensor(float("nan"))),
        ("empty", torch.empty(0, 4, dtype=torch.float16)),
        ("bool", torch.rand(9, generator=g) > 0.5),
    ]
    assert not out[3][1].is_contiguous()
    return [((dest, k), t) for k, t in out]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def _worker(rank: int, n: int, tmp: str) -> None:
    res: dict[str, object] = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=n)
        overflow, spare, host, peer = _inputs(n)
        # (a) one exchange, the same plan everywhere
        plan = exchange(overflow[rank], spare[rank], host[rank], peer[rank])
        res["plan"] = (plan.spill, plan.rank, plan.overflow, plan.spare)
        res["greedy"] = exchange(overflow[rank], spare[rank], host[rank], peer[rank], greedy=True).spill
        res["default_peer"] = exchange(overflow[rank], spare[rank], host[rank]).spill
        # (b) every rank sends a mix of dtypes to every other rank, then fetches them all back in one round
        tier = PeerTier()
        sent = {d: _tensors(rank, d) for d in range(n) if d != rank}
        tier.send_round(sent)
        res["held_after_send"] = tier.held_bytes()
        res["held_keys"] = sorted(tier.held_keys(), key=repr)
        back = tier.fetch_round({d: [k for k, _ in items] for d, items in sent.items()})
        res["exact"] = [all(_same_bits(back[k], t) for k, t in items) for items in sent.values()]
        res["n_back"] = len(back)
        res["held_after_fetch"] = tier.held_bytes()
        # (c) rank 0 asks rank 1 for a key it never sent (and one it did): it raises, the others fetch normally
        tier.send_round({(rank + 1) % n: [("x", torch.arange(5.0) + rank)]})
        try:
            out = tier.fetch_round({1: ["nope", "x"]} if rank == 0 else {(rank + 1) % n: ["x"]})
            res["c"] = ("ok", {k: v.tolist() for k, v in out.items()})
        except CheckpointError as e:
            res["c"] = ("error", str(e))
        # nothing was lost for rank 0: it asks again, correctly
        again = tier.fetch_round({1: ["x"]} if rank == 0 else {})
        res["c_again"] = {k: v.tolist() for k, v in again.items()}
        res["held_end"] = tier.held_bytes()
        # a bad argument on the last rank (sending to itself) raises there only
        try:
            tier.send_round({rank if rank == n - 1 else rank + 1: [("y", torch.ones(2))]})
            res["bad_arg"] = "ok"
        except ValueError as e:
            res["bad_arg"] = str(e)
        res["held_y"] = tier.held_bytes()
        tier.drop_round({(rank + 1) % n: ["y"]} if rank != n - 1 else {})
        res["held_after_drop"] = tier.held_bytes()
        dist.destroy_process_group()
    except BaseException:
        res["traceback"] = traceback.format_exc()
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(res, f)


def _run(n: int, tmp: str) -> list[dict]:
    return spawn_ranks(_worker, n, tmp, timeout_s=JOIN_TIMEOUT_S)


@pytest.mark.parametrize("n", [2, 3])
def test_peer_spill_ranks(n: int, tmp_path) -> None:
    results = _run(n, str(tmp_path))
    overflow, spare, host, peer = _inputs(n)
    # (a) every rank holds the plan the parent computes from the same inputs
    want = plan_spill(overflow, spare, host, peer)
    uniform = [[0.0 if i == j else DEFAULT_PEER_BANDWIDTH for j in range(n)] for i in range(n)]
    for r, res in enumerate(results):
        assert res["plan"] == (want, r, tuple(overflow), tuple(spare))
        assert res["greedy"] == greedy_spill(overflow, spare, host, peer)
        assert res["default_peer"] == plan_spill(overflow, spare, host, uniform)
    assert want.to_peer[0][1] > 0  # the instance does spill to a peer
    # (b) bit-exact round trips; holders empty afterwards
    for r, res in enumerate(results):
        senders = [s for s in range(n) if s != r]
        assert res["held_after_send"] == sum(t.numel() * t.element_size() for s in senders for _, t in _tensors(s, r))
        assert res["held_keys"] == sorted(((s, k) for s in senders for k, _ in _tensors(s, r)), key=repr)
        assert res["exact"] == [True] * (n - 1), r
        assert res["n_back"] == 7 * (n - 1)
        assert res["held_after_fetch"] == 0
    # (c) the asking rank gets the torchckpt error; the others fetch normally; nothing lost
    kind, msg = results[0]["c"]
    assert kind == "error" and msg.startswith("torchckpt:") and "nope" in msg
    assert results[0]["c_again"] == {"x": [0.0, 1.0, 2.0, 3.0, 4.0]}
    for r in range(1, n):
        assert results[r]["c"] == ("ok", {"x": [float(i + r) for i in range(5)]}), r
        assert results[r]["c_again"] == {}
    for res in results:
        assert res["held_end"] == 0
    # the bad argument raised on the last rank only; drop_round empties the holders
    for r, res in enumerate(results):
        if r == n - 1:
            assert isinstance(res["bad_arg"], str) and res["bad_arg"].startswith("torchckpt:")
        else:
            assert res["bad_arg"] == "ok"
        assert res["held_y"] == (0 if r == 0 else 8)  # rank n - 1 sent nothing to rank 0
        assert res["held_after_drop"] == 0


def test_not_initialized() -> None:
    # (d)
    assert not dist.is_initialized()
    with pytest.raises(CheckpointError, match=r"^torchckpt: .*init_process_group"):
        exchange(0, 0, 50e9)
    with pytest.raises(CheckpointError, match=r"^torchckpt: .*init_process_group"):
        PeerTier()


def test_bad_arguments_one_rank() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"^torchckpt: .*overflow_bytes"):
            exchange(-1, 0, 50e9)
        with pytest.raises(ValueError, match=r"^torchckpt: .*host_bandwidth"):
            exchange(0, 0, 0.0)
        with pytest.raises(ValueError, match=r"^torchckpt: .*peer_bandwidth"):
            exchange(0, 0, 50e9, [1.0, 2.0])
        tier = PeerTier()
        with pytest.raises(ValueError, match=r"^torchckpt: .*peer rank 0"):
            tier.send_round({0: [("k", torch.ones(1))]})
        with pytest.raises(ValueError, match=r"^torchckpt: .*peer rank 3"):
            tier.fetch_round({3: ["k"]})
        assert tier.fetch_round({}) == {} and tier.held_bytes() == 0
    finally:
        dist.destroy_process_group()
