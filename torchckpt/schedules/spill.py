"""Splitting GPUs' cache overflow between their host links and their peers' spare memory (pure Python).

# NOTE [ Peer spill ]
# Collaborative multi-level checkpointing (MASCOTS'21): when some GPUs' caches overflow while
# others have room, the overflow goes to host memory over each GPU's own link and to peers over
# NVLink, all links at once. The split that minimises the time of the slowest transfer is a
# min-time max-flow.
# 1. GPU i must move ``overflow[i]`` bytes; GPU j can take ``spare[j]`` bytes from peers; GPU i
#    moves to host at ``host[i]`` bytes/s and to peer j at ``peer[i][j]`` bytes/s (0: no link).
#    Host memory takes anything. Every link runs concurrently: a split's time is the largest
#    bytes/bandwidth over its links.
# 2. For a time T, a split within T exists iff the max flow of: source -> GPU i (overflow[i]),
#    i -> host (host[i] T), i -> j (peer[i][j] T), j -> sink (spare[j]), host -> sink (all) moves
#    every overflow byte. ``plan_spill`` bisects T between 0 and the all-to-host time and returns
#    the flow of the least feasible T it found (within ``rel_tol``).
# 3. ``greedy_spill`` is the baseline the paper compares: each GPU, largest overflow first, fills
#    its fastest destinations first (peers by bandwidth while they have room, then host).
"""
from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence

__all__ = ["Spill", "greedy_spill", "plan_spill", "spill_time"]


@dataclasses.dataclass(frozen=True)
class Spill:
    """A split of overflow (NOTE [ Peer spill ]).

    Attributes:
        to_host: bytes GPU i sends to host memory.
        to_peer: ``to_peer[i][j]``: bytes GPU i sends to GPU j.
        time: the slowest link's time, seconds.
    """

    to_host: tuple[float, ...]
    to_peer: tuple[tuple[float, ...], ...]
    time: float


def _check(overflow: Sequence[float], spare: Sequence[float], host: Sequence[float],
           peer: Sequence[Sequence[float]]) -> int:
    n = len(overflow)
    if not (len(spare) == len(host) == len(peer) == n and all(len(r) == n for r in peer)):
        raise ValueError(f"torchckpt: spill planning needs one overflow, spare, host bandwidth and peer row per GPU "
                         f"({n} overflows); pass lists of equal length and an n x n peer matrix.")
    if any(x < 0 for x in list(overflow) + list(spare)) or any(h <= 0 for h in host) or any(
            b < 0 for r in peer for b in r):
        raise ValueError("torchckpt: overflow and spare bytes must be >= 0, host bandwidths > 0 and peer bandwidths "
                         ">= 0 (0: no link).")
    return n


def spill_time(to_host: Sequence[float], to_peer: Sequence[Sequence[float]], host: Sequence[float],
               peer: Sequence[Sequence[float]]) -> float:
    """The slowest link's time of a split (NOTE [ Peer spill ] Rule 1)."""
    t = max((x / h for x, h in zip(to_host, host)), default=0.0)
    for i, row in enumerate(to_peer):
        for j, x in enumerate(row):
            if x > 0:
                t = max(t, x / peer[i][j] if peer[i][j] > 0 else float("inf"))
    return t


def _max_flow(adj: list[list[int]], cap: dict[tuple[int, int], float], s: int, t: int) -> tuple[float, dict]:
    """Edmonds-Karp over adjacency lists: the flow value and the flow on each edge ``(u, v)``."""
    flow: dict[tuple[int, int], float] = {}
    total = 0.0
    while True:
        parent = {s: s}
        q = deque([s])
        while q and t not in parent:
            u = q.popleft()
            for v in adj[u]:
                if v not in parent and cap.get((u, v), 0.0) - flow.get((u, v), 0.0) > 1e-9:
                    parent[v] = u
                    q.append(v)
        if t not in parent:
            return total, flow
        push = float("inf")
        v = t
        while v != s:
            u = parent[v]
            push = min(push, cap.get((u, v), 0.0) - flow.get((u, v), 0.0))
            v = u
        v = t
        while v != s:
            u = parent[v]
            flow[(u, v)] = flow.get((u, v), 0.0) + push
            flow[(v, u)] = flow.get((v, u), 0.0) - push
            v = u
        total += push


def _network(T: float, overflow: Sequence[float], spare: Sequence[float], host: Sequence[float],
             peer: Sequence[Sequence[float]]) -> tuple[list[list[int]], dict[tuple[int, int], float]]:
    n = len(overflow)
    src, h, sink = 2 * n, 2 * n + 1, 2 * n + 2  # GPU i as a sender: i; as a receiver: n + i
    cap: dict[tuple[int, int], float] = {}
    for i in range(n):
        if overflow[i] > 0:
            cap[src, i] = overflow[i]
            cap[i, h] = host[i] * T
            for j in range(n):
                if j != i and peer[i][j] > 0 and spare[j] > 0:
                    cap[i, n + j] = peer[i][j] * T
        if spare[i] > 0:
            cap[n + i, sink] = spare[i]
    cap[h, sink] = sum(overflow)
    adj: list[list[int]] = [[] for _ in range(2 * n + 3)]
    for u, v in cap:
        adj[u].append(v)
        adj[v].append(u)  # the residual edge
    return adj, cap


def plan_spill(overflow: Sequence[float], spare: Sequence[float], host: Sequence[float],
               peer: Sequence[Sequence[float]], rel_tol: float = 1e-3) -> Spill:
    """The split that minimises the slowest transfer (NOTE [ Peer spill ] Rule 2).

    Args:
        overflow: bytes each GPU must move off.
        spare: bytes each GPU can take from peers.
        host: each GPU's host-link bandwidth, bytes/s.
        peer: ``peer[i][j]``: GPU i to GPU j bandwidth, bytes/s (0: no link).
        rel_tol: the bisection stops within this fraction of the optimal time.

    Example::

        >>> s = plan_spill([8e9, 0], [0, 8e9], host=[50e9, 50e9], peer=[[0, 150e9], [150e9, 0]])
        >>> round(s.time * 1e3), [round(x / 1e9) for x in s.to_host], round(s.to_peer[0][1] / 1e9)
        (40, [2, 0], 6)
    """
    n = _check(overflow, spare, host, peer)
    need = float(sum(overflow))
    if need == 0:
        return Spill((0.0,) * n, tuple((0.0,) * n for _ in range(n)), 0.0)
    hi = max(o / h for o, h in zip(overflow, host))  # all to host is always feasible
    lo = max(max(o / (h + sum(r)) for o, h, r in zip(overflow, host, peer)),  # every link of GPU i at once
             (need - sum(spare)) / sum(host))  # what the peers cannot take goes to host
    best = None
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        got, flow = _max_flow(*_network(mid, overflow, spare, host, peer), 2 * n, 2 * n + 2)
        if got >= need * (1 - 1e-12):
            hi, best = mid, flow
        else:
            lo = mid
    if best is None:
        _, best = _max_flow(*_network(hi, overflow, spare, host, peer), 2 * n, 2 * n + 2)
    to_host = tuple(max(0.0, best.get((i, 2 * n + 1), 0.0)) for i in range(n))
    to_peer = tuple(tuple(max(0.0, best.get((i, n + j), 0.0)) if j != i else 0.0 for j in range(n)) for i in range(n))
    return Spill(to_host, to_peer, spill_time(to_host, to_peer, host, peer))


def greedy_spill(overflow: Sequence[float], spare: Sequence[float], host: Sequence[float],
                 peer: Sequence[Sequence[float]]) -> Spill:
    """The greedy baseline (NOTE [ Peer spill ] Rule 3).

    Example::

        >>> s = greedy_spill([8e9, 0], [0, 8e9], host=[50e9, 50e9], peer=[[0, 150e9], [150e9, 0]])
        >>> round(s.time * 1e3)
        53
    """
    n = _check(overflow, spare, host, peer)
    room = list(spare)
    to_host = [0.0] * n
    to_peer = [[0.0] * n for _ in range(n)]
    for i in sorted(range(n), key=lambda k: -overflow[k]):
        left = float(overflow[i])
        for j in sorted((j for j in range(n) if j != i and peer[i][j] > 0), key=lambda j: -peer[i][j]):
            if peer[i][j] <= host[i] or left <= 0:
                break
            x = min(left, room[j])
            to_peer[i][j] += x
            room[j] -= x
            left -= x
        to_host[i] = left
    return Spill(tuple(to_host), tuple(tuple(r) for r in to_peer), spill_time(to_host, to_peer, host, peer))
