"""Peer spill: moving one GPU's cache overflow to host and to a peer's spare memory at once (issue 14).

Run with one process per GPU of one node (``torchrun --nproc-per-node 2 benchmarks/peer_spill.py``). Rank 0 holds
``--overflow`` bytes that must leave its cache (chunks of ``--chunk`` bytes); rank 1 has ``--spare`` bytes free;
other ranks neither. Three ways to move the overflow off and back, in the same processes:

  all_to_host  every chunk to pinned host memory and back (what a single-GPU store does)
  greedy       ``exchange(..., greedy=True)``: the fastest destinations first (the MASCOTS'21 greedy split)
  maxflow      ``exchange(...)``: the min-time max-flow split (NOTE [ Peer spill ])

and, to see whether the two links overlap, the max-flow split's host part alone and its peer part alone (a split
is as fast as its slower part only if the host copies and the NCCL transfers do not slow each other).

Each split runs its host copies on a CUDA copy stream while ``PeerTier.send_round`` / ``fetch_round`` move the peer
part (torch.distributed point-to-point, NCCL on GPUs); the time is until both are done, out and back, median of
``--reps``. The links are measured first in the same run (pinned copies each way; a timed send between the first
two ranks) and given to the planner. Every chunk must come back bit for bit (exit status 1 otherwise). Rank 0
prints the table (time, ratio to all_to_host, bytes per link, the plan's predicted time) and writes
``peer_spill.json`` and ``peer_spill.png``. Without CUDA it runs on gloo with CPU tensors as a smoke test (times
mean nothing); without ``torchrun`` it starts two processes itself.

    torchrun --nproc-per-node 2 benchmarks/peer_spill.py [--overflow 8GiB] [--spare 8GiB] [--chunk 256MiB]
                                                          [--reps 3] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(1, os.path.dirname(HERE))  # the repo, when torchckpt is not installed

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import GiB, fmt, out_dir, plot_bars, print_table, write_json  # noqa: E402
from torchckpt._args import parse_bytes  # noqa: E402
from torchckpt.distributed import exchange  # noqa: E402
from torchckpt.memory import PeerTier  # noqa: E402
from torchckpt.schedules.spill import spill_time  # noqa: E402


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def measure_links(cuda: bool, dev: torch.device, tier: PeerTier, nbytes: int,
                  reps: int = 3) -> tuple[float, float]:
    """(host link bytes/s, the slower of its two directions; peer link bytes/s, rank 0 to rank 1), on every rank.

    Each figure is the median of ``reps`` timed copies after an untimed one (the first copy into fresh pinned
    memory and NCCL's first send pay set-up costs: without the warm-up the host link measured 35 GB/s where the
    8 GiB runs moved 55 GB/s)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    d2h, h2d = [], []
    for i in range(reps + 1):
        sync(cuda)
        t0 = time.perf_counter()
        host.copy_(buf, non_blocking=True)
        sync(cuda)
        t1 = time.perf_counter()
        buf.copy_(host, non_blocking=True)
        sync(cuda)
        t2 = time.perf_counter()
        if i:
            d2h.append(t1 - t0)
            h2d.append(t2 - t1)
    host_bw = nbytes / max(med(d2h), med(h2d), 1e-9)
    rank = dist.get_rank()
    times = []
    for i in range(reps + 1):
        dist.barrier()
        sync(cuda)
        t0 = time.perf_counter()
        tier.send_round({1: [("probe", buf)]} if rank == 0 else {})
        sync(cuda)
        if i:
            times.append(time.perf_counter() - t0)
        tier.drop_round({1: ["probe"]} if rank == 0 else {})
    peer = torch.tensor([nbytes / max(med(times), 1e-9)], dtype=torch.float64, device=dev)  # NCCL: device tensors
    dist.broadcast(peer, 0)  # rank 0's figure: the sender's view of the transfer
    return host_bw, float(peer.item())


def split(chunks: list[torch.Tensor], to_host: float,
          to_peer: tuple[float, ...]) -> tuple[list[int], dict[int, list[int]]]:
    """Chunks for host and for each peer, filling the plan's byte counts in order (whole chunks: the last one of a
    destination may go over its share by less than a chunk)."""
    shares = [(-1, to_host)] + [(j, b) for j, b in enumerate(to_peer) if b > 0]
    out_host: list[int] = []
    out_peer: dict[int, list[int]] = {}
    k = 0
    for j, want in shares:
        got = 0
        while k < len(chunks) and got < want - 1:
            (out_host if j < 0 else out_peer.setdefault(j, [])).append(k)
            got += chunks[k].numel()
            k += 1
    out_host += list(range(k, len(chunks)))  # rounding leftovers go to host
    return out_host, out_peer


def run(cuda: bool, dev: torch.device, tier: PeerTier, chunks: list[torch.Tensor], plan_host: float,
        plan_peer: tuple[float, ...]) -> tuple[float, float, int, int, bool]:
    """Move the chunks off (host copies on a side stream, peers by send_round) and back; (out s, back s, host bytes,
    peer bytes, exact)."""
    host_ix, peer_ix = split(chunks, plan_host, plan_peer)
    stream = torch.cuda.Stream() if cuda else None
    hosts = [torch.empty(chunks[k].shape, dtype=chunks[k].dtype, pin_memory=cuda) for k in host_ix]
    ref = [c.clone() for c in chunks]
    dist.barrier()
    sync(cuda)
    t0 = time.perf_counter()
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for h, k in zip(hosts, host_ix):
                h.copy_(chunks[k], non_blocking=True)
    else:
        for h, k in zip(hosts, host_ix):
            h.copy_(chunks[k])
    tier.send_round({j: [(k, chunks[k]) for k in ks] for j, ks in peer_ix.items()})
    sync(cuda)
    dist.barrier()
    t1 = time.perf_counter()
    for c in chunks:
        c.zero_()  # the cache's memory is reused: what comes back must come from host and peers
    sync(cuda)
    dist.barrier()
    t2 = time.perf_counter()
    if stream is not None:
        with torch.cuda.stream(stream):
            for h, k in zip(hosts, host_ix):
                chunks[k].copy_(h, non_blocking=True)
    else:
        for h, k in zip(hosts, host_ix):
            chunks[k].copy_(h)
    back = tier.fetch_round({j: list(ks) for j, ks in peer_ix.items()})
    for k, t in back.items():
        chunks[k].copy_(t)
    sync(cuda)
    dist.barrier()
    t3 = time.perf_counter()
    exact = all(torch.equal(a, b) for a, b in zip(chunks, ref))
    host_bytes = sum(chunks[k].numel() for k in host_ix)
    peer_bytes = sum(chunks[k].numel() for ks in peer_ix.values() for k in ks)
    return t1 - t0, t3 - t2, host_bytes, peer_bytes, exact


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    p.add_argument("--overflow", default="8GiB" if cuda else "16MiB")
    p.add_argument("--spare", default="8GiB" if cuda else "16MiB")
    p.add_argument("--chunk", default="256MiB" if cuda else "1MiB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if "RANK" not in os.environ:  # not under torchrun: start two processes on this machine
        import subprocess

        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), WORLD_SIZE="2")
        procs = [subprocess.Popen([sys.executable, *sys.argv], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
                 for r in range(2)]
        return max(pr.wait() for pr in procs)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tier = PeerTier(device=dev)
    over, spare, chunk = (parse_bytes(getattr(args, a), f"--{a}") for a in ("overflow", "spare", "chunk"))
    my_over = over if rank == 0 else 0
    my_spare = spare if rank == 1 else 0
    host_bw, peer_bw = measure_links(cuda, dev, tier, min(chunk * 4, 1 << 30))
    peer_row = [0.0 if j == rank else peer_bw for j in range(world)]
    g = torch.Generator(device=dev).manual_seed(rank)
    chunks = [torch.randint(0, 256, (min(chunk, my_over - i),), dtype=torch.uint8, device=dev, generator=g)
              for i in range(0, my_over, chunk)]
    plans = {"all_to_host": None, "greedy": exchange(my_over, my_spare, host_bw, peer_row, greedy=True),
             "maxflow": exchange(my_over, my_spare, host_bw, peer_row)}
    zero = tuple(0.0 for _ in range(world))
    runs: dict[str, tuple[Any, list[torch.Tensor], float, tuple[float, ...]]] = {
        name: (plan, chunks, float(my_over) if plan is None else plan.to_host, zero if plan is None else plan.to_peer)
        for name, plan in plans.items()}
    # Do the two links overlap? The max-flow split's host part and peer part, each moved alone.
    mf = plans["maxflow"]
    host_ix, peer_ix = split(chunks, mf.to_host, mf.to_peer)
    peer_chunks = [chunks[k] for ks in peer_ix.values() for k in ks]
    runs["maxflow_host_part_alone"] = (mf, [chunks[k] for k in host_ix], float(my_over), zero)
    runs["maxflow_peer_part_alone"] = (mf, peer_chunks, 0.0, mf.to_peer)
    rows, results, ok = [], [], True
    for name, (plan, mine, to_host, to_peer) in runs.items():
        outs, backs = [], []
        for _ in range(args.reps):
            o, b, hb, pb, exact = run(cuda, dev, tier, mine, to_host, to_peer)
            outs.append(o)
            backs.append(b)
            ok &= exact
        flags = torch.tensor([0 if ok else 1], dtype=torch.int64, device=dev)
        dist.all_reduce(flags)
        ok = ok and int(flags.item()) == 0
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        if "host_part" in name:
            predicted = hb / host_bw
        elif "peer_part" in name:
            predicted = pb / peer_bw
        elif plan is not None:
            predicted = plan.spill.time
        else:
            predicted = spill_time([float(my_over)] + [0.0] * (world - 1), [[0.0] * world for _ in range(world)],
                                   [host_bw] * world, [[0.0 if i == j else peer_bw for j in range(world)]
                                                       for i in range(world)])
        res = {"name": name, "out_s": med(outs), "back_s": med(backs), "host_bytes": hb, "peer_bytes": pb,
               "predicted_s": predicted, "exact": exact}
        results.append(res)
        base = results[0]
        rows.append([name, fmt(res["out_s"] * 1e3, ".1f"), fmt(res["back_s"] * 1e3, ".1f"),
                     fmt((res["out_s"] + res["back_s"]) / (base["out_s"] + base["back_s"]), ".2f"),
                     f"{hb / GiB:.2f}", f"{pb / GiB:.2f}", fmt(predicted * 1e3, ".1f"), "yes" if exact else "NO"])
    if rank == 0:
        dev_name = torch.cuda.get_device_name() if cuda else "cpu (gloo)"
        print(f"peer spill on {world} x {dev_name}: overflow {over / GiB:.2f} GiB on rank 0, spare "
              f"{spare / GiB:.2f} GiB on rank 1; host link {host_bw / 1e9:.1f} GB/s, peer link {peer_bw / 1e9:.1f} "
              "GB/s (measured in this run)", flush=True)
        print_table(["split", "out ms", "back ms", "x all_to_host", "to host GiB", "to peer GiB", "plan ms", "exact"],
                    rows)
        out = out_dir(args.out)
        write_json(os.path.join(out, "peer_spill.json"), {
            "device": dev_name, "world": world, "overflow_bytes": over, "spare_bytes": spare, "chunk_bytes": chunk,
            "host_Bps": host_bw, "peer_Bps": peer_bw, "runs": results, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "note": None if cuda else "CPU smoke test (gloo): times are not meaningful"})
        plot_bars(os.path.join(out, "peer_spill.png"), [r["name"] for r in results],
                  {"out + back, ms": [(r["out_s"] + r["back_s"]) * 1e3 for r in results],
                   "plan's predicted time, ms": [r["predicted_s"] * 1e3 for r in results]},
                  f"Overflow {over / GiB:.1f} GiB off one GPU ({dev_name})")
        if not ok:
            print("FAIL: a chunk came back different", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
