"""The peer side of ``SnapshotStore``: its ``Tier.HOST`` snapshots sent to other ranks' spare memory and taken back.

``SnapshotStore`` (store/snapshots.py, NOTE [ Snapshot store ]) takes these methods from ``PeerSide``. The bytes
move in ``PeerTier`` rounds (NOTE [ Peer tier ], memory/peer_tier.py) by the group's ``SpillPlan``
(NOTE [ Capacity exchange ], distributed/capacity.py; NOTE [ Peer spill ], schedules/spill.py): collaborative
multi-level checkpointing (Maurya et al., MASCOTS'21) on a checkpoint schedule's snapshots.

Known gaps: a fetch takes the snapshot back from its holder, so a snapshot restored again after its slot was
reused comes back from host memory, not from the peer (NOTE [ Snapshot peer tier ] Rule 5); the split follows the
plan's bytes, not the links' measured times; ``Tier.DISK`` snapshots never go to peers; a rank that skips an action
is not detected, the others wait until the process group's timeout (NOTE [ Snapshot peer tier ] Rule 2).

# NOTE [ Snapshot peer tier ]
# 1. With ``peers=`` (a ``PeerSpill``: a ``PeerTier`` and the group's ``SpillPlan``) the use is SPMD and every rank
#    calls the store's actions in the same order: each save/restore/free of a ``Tier.HOST`` snapshot, prefetch from
#    HOST, and ``close`` first gathers every rank's (count, action, n) on the tier's metadata group, then every rank
#    enters the rounds some rank needs (send, fetch, drop, in that order; its own part possibly empty:
#    NOTE [ Peer tier ] Rule 1). Nothing else talks.
# 2. Ranks whose (count, action, n) differ all raise the same ``torchckpt:`` error and the peer side stops (later
#    actions raise; ``close`` is local). A rank that skips an action (an error of its own, a GPU-tier save where
#    others save to HOST) is not seen: the others wait until the process group's timeout; so an exception leaving
#    a ``with`` block stops the peer side locally.
# 3. A save that copies off the GPU (``flush=True``, or straight to host) is split, by whole snapshots and from this
#    rank's plan row and history only: it goes to the peer furthest below its share of the bytes split so far
#    (``to_peer[j] / overflow``, this save included) among those where this store's copies would stay within
#    ``to_peer[j]`` bytes (to ``PLAN_SLACK``); else to host. Write-back saves (NOTE [ Snapshot store ] Rule 6) go
#    to host if evicted.
# 4. A peer copy is the save's flush: the slot's bytes (with a codec its blob, NOTE [ Snapshot store ] Rule 8) go in
#    the send round on the offload stream, whose event is the slot's flush event (NOTE [ Snapshot store ] Rule 3); a
#    re-save elsewhere drops the old copy.
# 5. ``prefetch`` fetches a peer snapshot into the slot it takes (on the prefetch stream; the fill is
#    NOTE [ Snapshot store ] Rule 3's); with no slot to take, ``restore`` fetches it on demand on the compute stream
#    (so every rank's restore of a HOST snapshot enters a fetch round when any rank misses). A fetch takes the copy
#    back from its holder: the slot then holds the only one, as a write-back snapshot flushed to host if evicted (a
#    later restore reads host); with no slot at all the fetched bytes are copied to a host block.
# 6. ``free`` of a HOST snapshot drops its peer copy (``drop_round``), ``close`` all left; ``stats()`` counts ``peer_*``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from torchckpt._errors import CheckpointError
from torchckpt.distributed.capacity import SpillPlan, exchange
from torchckpt.memory import HostBlock, HostPoolBase, PeerTier
from torchckpt.schedules.actions import Tier
from torchckpt.schedules.cache import Cache

__all__ = ["PeerSide", "PeerSpill"]

PLAN_SLACK = 1e-3
"""A peer has room while this store's copies there stay within ``(1 + PLAN_SLACK) * to_peer[j]`` bytes: the plan's
bytes are as exact as its bisection (``plan_spill``'s ``rel_tol``), and a share a hair under whole snapshots
should still hold them (NOTE [ Snapshot peer tier ] Rule 3)."""


@dataclasses.dataclass(frozen=True)
class PeerSpill:
    """Where a ``SnapshotStore`` may send ``Tier.HOST`` snapshots besides host memory: a tier and the group's plan.

    Pass it as ``SnapshotStore(..., peers=...)``, one per store, on every rank (NOTE [ Snapshot peer tier ] Rules 1-6).

    Args:
        tier: the ``PeerTier`` the snapshots travel through, on the store's device.
        plan: the group's ``SpillPlan`` (``torchckpt.distributed.exchange`` on the tier's group; or
            ``PeerSpill.exchange``, which calls it): this rank's copies held by rank ``j`` total at most
            ``plan.to_peer[j]`` bytes at a time, and the bytes it copies off the GPU are split in the plan's
            proportions (NOTE [ Snapshot peer tier ] Rule 3).

    Example::

        >>> import torch.distributed as dist
        >>> from torchckpt.memory import HostPool, PeerTier
        >>> from torchckpt.schedules import Revolve, Tier, simulate
        >>> from torchckpt.store import SnapshotStore
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> schedule = Revolve(20, 4, tier=Tier.HOST)
        >>> snapshot_bytes = 4 * 1024  # the bytes of one snapshot (one slot)
        >>> overflow = simulate(schedule).peak_snapshots[Tier.HOST] * snapshot_bytes
        >>> peers = PeerSpill.exchange(PeerTier(), overflow, spare_bytes=0, host_bandwidth=55e9)
        >>> peers.plan.to_peer  # one rank alone: no peer, everything goes to host
        (0.0,)
        >>> store = SnapshotStore("cpu", slots=2, host=HostPool(chunk_bytes=1 << 20, pin=False), peers=peers)
        >>> store.save(0, Tier.HOST, [torch.arange(4.0)])  # every rank saves snapshot 0 here
        >>> store.restore(0, Tier.HOST)[0]
        tensor([0., 1., 2., 3.])
        >>> store.free(0, Tier.HOST); store.close(); dist.destroy_process_group()
    """

    tier: PeerTier
    plan: SpillPlan

    def __post_init__(self) -> None:
        if not isinstance(self.tier, PeerTier):
            raise TypeError(f"torchckpt: PeerSpill(tier=...) expects a torchckpt.memory.PeerTier, got "
                            f"{type(self.tier).__name__}; pass PeerTier(group) made on every rank.")
        if not isinstance(self.plan, SpillPlan):
            raise TypeError(f"torchckpt: PeerSpill(plan=...) expects a torchckpt.distributed.SpillPlan, got "
                            f"{type(self.plan).__name__}; pass exchange(...)'s result, or use PeerSpill.exchange.")
        if self.plan.rank != self.tier.rank or len(self.plan.to_peer) != self.tier.world_size:
            raise ValueError(f"torchckpt: PeerSpill's plan is for rank {self.plan.rank} of {len(self.plan.to_peer)} "
                             f"but its tier is rank {self.tier.rank} of {self.tier.world_size}; make the plan with "
                             "exchange(..., group=tier.group) on this rank (PeerSpill.exchange does).")

    @classmethod
    def exchange(cls, tier: PeerTier, overflow_bytes: int, spare_bytes: int, host_bandwidth: float,
                 peer_bandwidth: Sequence[float] | None = None, *, greedy: bool = False) -> PeerSpill:
        """Gather every rank's capacity on ``tier``'s group and plan the split (collective: every rank calls it).

        Args:
            tier: the ``PeerTier`` the store will use.
            overflow_bytes: bytes of this rank's ``Tier.HOST`` snapshots held at once, which the GPU cannot keep:
                ``simulate(schedule).peak_snapshots[Tier.HOST] * snapshot_bytes`` (0 on a rank that spills nothing).
            spare_bytes: bytes of device memory this rank lends to its peers' snapshots.
            host_bandwidth, peer_bandwidth, greedy: as for ``torchckpt.distributed.exchange``.

        Returns:
            A ``PeerSpill`` holding ``tier`` and the group's plan.
        """
        if not isinstance(tier, PeerTier):
            raise TypeError(f"torchckpt: PeerSpill.exchange(tier=...) expects a torchckpt.memory.PeerTier, got "
                            f"{type(tier).__name__}; pass PeerTier(group) made on every rank.")
        plan = exchange(overflow_bytes, spare_bytes, host_bandwidth, peer_bandwidth, group=tier.group, greedy=greedy)
        return cls(tier, plan)


@dataclasses.dataclass
class _Pending:
    """A save's agreed rounds, entered by ``_peer_end`` (NOTE [ Snapshot peer tier ] Rules 1, 3)."""

    dest: int | None  # the peer this rank's copy goes to; None: host (or no copy)
    old: int | None  # the peer that held the snapshot's previous copy, if another: dropped
    send: bool  # some rank sends: every rank enters the send round
    drop: bool  # some rank drops: every rank enters the drop round


class PeerSide:
    """The peer methods of ``SnapshotStore``, over the store's state (declared here, set by the store)."""

    peers: PeerSpill | None
    device: torch.device
    cuda: bool
    codec: Any
    host: HostPoolBase
    _uid: int
    _c: dict[str, Any]
    _mover: Any
    _rank: Cache[int]
    _slot_of: dict[int, int]
    _on_host: dict[int, tuple[HostBlock, Any]]
    _dirty: set[int]
    _flush_ev: list[Any]
    _fill_ev: list[Any]
    _fill_of: list[int | None]
    _use_ev: list[Any]
    _slots: Any
    _pending_use: int | None

    def _size(self, n: int) -> int:  # DiskSide's: bytes of off-GPU snapshot n
        raise NotImplementedError

    def _ensure_room(self, s: int, nbytes: int) -> bool:  # CodecSide's (NOTE [ Snapshot store ] Rule 9)
        raise NotImplementedError

    def _views(self, n: int, flat: torch.Tensor) -> list[torch.Tensor]:  # SnapshotStore's (NOTE [ Snapshot store ] Rule 8)
        raise NotImplementedError

    def _take_slot(self, n: int) -> int:  # SnapshotStore's
        raise NotImplementedError

    def _wait(self, ev: Any) -> Any:  # SnapshotStore's
        raise NotImplementedError

    # -- state ---------------------------------------------------------------------------------------------------
    def _peer_init(self, peers: PeerSpill | None) -> None:
        if peers is not None and not isinstance(peers, PeerSpill):
            raise TypeError(f"torchckpt: SnapshotStore(peers=...) expects a torchckpt.store.snapshot_peer.PeerSpill, "
                            f"got {type(peers).__name__}; pass PeerSpill.exchange(PeerTier(), overflow_bytes=..., "
                            "spare_bytes=..., host_bandwidth=...), or None.")
        if peers is not None:
            d = peers.tier.device
            if d.type != self.device.type or (d.index is not None and d.index != self.device.index):
                raise ValueError(f"torchckpt: SnapshotStore(peers=...) moves snapshots on {self.device}, but its "
                                 f"PeerTier holds tensors on {d}; make the tier with PeerTier(device="
                                 f"{str(self.device)!r}) (under NCCL: torch.cuda.set_device first).")
        self.peers = peers
        w = peers.tier.world_size if peers is not None else 0
        self._peer_of: dict[int, tuple[int, int]] = {}  # snapshot -> (holder rank, bytes) (NOTE [ Snapshot peer tier ] Rule 3)
        self._peer_held = [0] * w  # bytes of this store's copies per holder
        self._peer_split = [0] * (w + 1)  # bytes of split saves sent per peer, host last (NOTE [ Snapshot peer tier ] Rule 3)
        self._peer_seq = 0  # actions agreed so far (NOTE [ Snapshot peer tier ] Rule 1)
        self._peer_stop: str | None = None  # why the peer side stopped (NOTE [ Snapshot peer tier ] Rule 2)
        self._peer_pending: _Pending | None = None

    def _peer_key(self, n: int) -> Hashable:
        return (self._uid, n)

    # -- agreement and rounds (NOTE [ Snapshot peer tier ] Rules 1, 2) -------------------------------------------
    def _peer_agree(self, what: str, n: int, send: bool = False, fetch: bool = False,
                    drop: bool = False) -> tuple[bool, bool, bool]:
        """One gather of every rank's (count, action, n) and needs; raises on every rank if they differ
        (NOTE [ Snapshot peer tier ] Rule 2).

        Returns which rounds some rank needs (send, fetch, drop): every rank enters those, in that order.
        """
        assert self.peers is not None
        if self._peer_stop is not None:
            raise CheckpointError(self._peer_stop)
        self._peer_seq += 1
        me = (self._peer_seq, what, n)
        t0 = time.perf_counter()
        got = self.peers.tier.gather((me, send, fetch, drop))
        self._c["peer_wait_s"] += time.perf_counter() - t0
        self._c["peer_actions"] += 1
        if any(g[0] != me for g in got):
            acts = ", ".join(f"rank {r}: {_act(g[0])}" for r, g in enumerate(got))
            self._peer_stop = (
                f"torchckpt: the ranks called their SnapshotStore(peers=...) in different orders ({acts}). Every "
                "rank must call save/restore/free of Tier.HOST snapshots, prefetch from Tier.HOST and close() with "
                "the same n in the same order (the same schedule on every rank; NOTE [ Snapshot peer tier ] Rule 1). "
                "This store's peer side has stopped on every rank: close() it (locally; what it left on peers "
                "stays there until PeerTier.close()) and make a new store.")
            raise CheckpointError(self._peer_stop)
        return any(g[1] for g in got), any(g[2] for g in got), any(g[3] for g in got)

    def _peer_round(self, fn: Any, part: Mapping[int, Any], stream: Any = None) -> Any:
        """Enter one ``PeerTier`` round with this rank's part (on ``stream`` under CUDA,
        NOTE [ Snapshot peer tier ] Rule 4)."""
        t0 = time.perf_counter()
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            out = fn(part)
        self._c["peer_wait_s"] += time.perf_counter() - t0
        self._c["peer_rounds"] += 1
        return out

    def _peer_event(self, stream: Any) -> Any:
        if stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def _peer_forget(self, n: int) -> int | None:
        """Drop the record of ``n``'s peer copy; its holder, or None."""
        old = self._peer_of.pop(n, None)
        if old is None:
            return None
        self._peer_held[old[0]] -= old[1]
        self._c["peer_held_bytes"] -= old[1]
        return old[0]

    # -- save (NOTE [ Snapshot peer tier ] Rules 3, 4) -----------------------------------------------------------
    def _peer_begin(self, n: int, tier: Tier, size: int, split: bool) -> None:
        """Agree on a save with the other ranks; pick where this rank's copy goes
        (NOTE [ Snapshot peer tier ] Rule 3)."""
        self._peer_pending = None
        if self.peers is None or tier is not Tier.HOST:
            return
        old = self._peer_forget(n)
        dest = self._peer_pick(size) if split else None
        send, _, drop = self._peer_agree("save", n, send=dest is not None, drop=old is not None and old != dest)
        self._peer_pending = _Pending(dest, old if old != dest else None, send, drop)

    def _peer_pick(self, size: int) -> int | None:
        """The peer furthest below its share of the split bytes and with room for ``size`` more; None: host."""
        assert self.peers is not None
        plan = self.peers.plan
        total = plan.overflow[plan.rank]
        if total <= 0:
            return None
        sent = self._peer_split
        after = sum(sent) + size
        best, lag = None, plan.to_host / total * after - sent[-1]  # host first on a tie
        for j, share in enumerate(plan.to_peer):
            room = self._peer_held[j] + size <= share * (1 + PLAN_SLACK)
            if share > 0 and room and share / total * after - sent[j] > lag:
                best, lag = j, share / total * after - sent[j]
        sent[best if best is not None else -1] += size
        return best

    def _peer_end(self, n: int, src: torch.Tensor, s: int | None) -> bool:
        """Enter the save's agreed rounds; True when this rank's copy went to a peer (then it is the flush)."""
        p, self._peer_pending = self._peer_pending, None
        if p is None:
            return False
        assert self.peers is not None
        tier = self.peers.tier
        key = self._peer_key(n)
        size = self._size(n)
        ev = None
        if p.send:
            part: dict[int, list[tuple[Hashable, torch.Tensor]]] = {}
            stream = self._mover.offload if self.cuda else None
            if p.dest is not None:
                part = {p.dest: [(key, src[:size])]}
                if stream is not None:
                    stream.wait_stream(self._mover.current())  # the bytes were written on the compute stream
            self._peer_round(tier.send_round, part, stream)
            ev = self._peer_event(stream)
        if p.drop:
            self._peer_round(tier.drop_round, {p.old: [key]} if p.old is not None else {})
            self._c["peer_drops"] += p.old is not None
        if p.dest is None:
            return False
        self._peer_of[n] = (p.dest, size)
        self._peer_held[p.dest] += size
        c = self._c
        c["peer_saves"] += 1
        c["peer_bytes_sent"] += size
        c["peer_held_bytes"] += size
        old = self._on_host.pop(n, None)  # an earlier copy of n on host is stale now
        if old is not None:
            self.host.free(old[0], old[1])
        self._dirty.discard(n)
        if s is not None:
            self._flush_ev[s] = ev  # NOTE [ Snapshot store ] Rule 3: the slot is overwritten only after the send
        elif ev is not None:
            self._mover.current().wait_event(ev)  # src is a temporary: it must outlive the send
        return True

    # -- prefetch and restore (NOTE [ Snapshot peer tier ] Rule 5) -----------------------------------------------
    def _peer_take(self, what: str, n: int, tier: Tier) -> torch.Tensor | None:
        """Agree on a prefetch from or restore of a HOST snapshot; fetch ``n`` back when this rank needs it now.

        A prefetch fetches only into a slot it can take; a restore fetches whatever misses the slots.
        Returns the fetched bytes (flat ``uint8`` on the device), or None.
        """
        if self.peers is None or tier is not Tier.HOST:
            return None
        want = n in self._peer_of and n not in self._slot_of and (what == "restore" or self._rank.can_take())
        _, fetch, _ = self._peer_agree(what, n, fetch=want)
        if not fetch:
            return None
        holder = self._peer_of[n][0] if want else None
        key = self._peer_key(n)
        stream = self._mover.prefetch if self.cuda and what == "prefetch" else None
        got = self._peer_round(self.peers.tier.fetch_round, {holder: [key]} if holder is not None else {}, stream)
        if holder is None:
            return None
        self._peer_forget(n)
        buf = got[key]
        if self.cuda:
            self._mover.keep_alive(buf)  # filled from on the prefetch stream, copied to host on the offload one
        self._c["peer_fetches"] += 1
        self._c["peer_bytes_fetched"] += buf.numel()
        return buf

    def _peer_fill(self, s: int, n: int, buf: torch.Tensor, on_compute: bool) -> Any:
        """Copy fetched bytes into slot ``s`` as a host fill does (NOTE [ Snapshot store ] Rule 3); the slot then holds
        the only copy.

        ``on_compute``: the fetch ran on the compute stream (a restore's), so the fill waits for that stream;
        a prefetch's fetch ran on the prefetch stream, where the fill follows it anyway.
        """
        grown = buf.numel() > self._slots[s].numel()
        self._ensure_room(s, buf.numel())
        slot = self._slots[s]
        ev = self._mover.fill(slot[: buf.numel()], buf, (self._flush_ev[s], self._use_ev[s]),
                              after_all=self._use_ev[s] is None or grown or on_compute)
        self._fill_ev[s] = ev
        self._fill_of[s] = n
        self._dirty.add(n)  # NOTE [ Snapshot peer tier ] Rule 5: written back to host if evicted before its free
        return ev

    def _peer_restore(self, n: int, buf: torch.Tensor) -> list[torch.Tensor]:
        """A restore that fetched ``n`` on demand: into a slot, or kept on host with no slot to take
        (NOTE [ Snapshot peer tier ] Rule 5)."""
        self._c["misses"] += 1
        if self._rank.can_take():
            s = self._take_slot(n)
            self._wait(self._peer_fill(s, n, buf, on_compute=True))
            self._pending_use = s
            return self._views(n, self._slots[s])
        block = self.host.alloc(buf.numel())  # the fetched bytes are the only copy left
        self._c["bytes_to_host"] += buf.numel()
        self._on_host[n] = (block, self._mover.to_host(block.tensor, buf))
        return self._views(n, buf)

    # -- free and close (NOTE [ Snapshot peer tier ] Rule 6) -----------------------------------------------------
    def _peer_free(self, n: int, tier: Tier) -> None:
        """Agree on a free of a HOST snapshot and drop its peer copy."""
        if self.peers is None or tier is not Tier.HOST:
            return
        holder = self._peer_of[n][0] if n in self._peer_of else None
        _, _, drop = self._peer_agree("free", n, drop=holder is not None)
        if drop:
            self._peer_round(self.peers.tier.drop_round, {holder: [self._peer_key(n)]} if holder is not None else {})
        if holder is not None:
            self._peer_forget(n)
            self._c["peer_drops"] += 1

    def _peer_close(self) -> CheckpointError | None:
        """Drop every peer copy of this store (collective, unless the peer side stopped:
        NOTE [ Snapshot peer tier ] Rule 6).

        Returns the mismatch error (NOTE [ Snapshot peer tier ] Rule 2) for ``close`` to raise once its local part is done.
        """
        if self.peers is None:
            return None
        mine: dict[int, list[Hashable]] = {}
        for n, (j, _) in self._peer_of.items():
            mine.setdefault(j, []).append(self._peer_key(n))
        err = None
        try:
            if self._peer_stop is None:
                _, _, drop = self._peer_agree("close", -1, drop=bool(mine))
                if drop:
                    self._peer_round(self.peers.tier.drop_round, mine)
                    self._c["peer_drops"] += sum(len(k) for k in mine.values())
        except CheckpointError as e:
            err = e
        finally:
            for n in list(self._peer_of):
                self._peer_forget(n)
            if self._peer_stop is None:
                self._peer_stop = ("torchckpt: this SnapshotStore was closed, and with it its peer side; make a new "
                                   "SnapshotStore(peers=...) on every rank.")
        return err

    def _peer_abandon(self) -> None:
        """Stop the peer side locally (an exception on this rank may not be on the others:
        NOTE [ Snapshot peer tier ] Rule 2)."""
        if self.peers is not None and self._peer_stop is None:
            self._peer_stop = ("torchckpt: this SnapshotStore's peer side stopped when an exception left its `with` "
                               "block; make a new SnapshotStore(peers=...) on every rank.")


def _act(me: Any) -> str:
    seq, what, n = me
    return f"#{seq} {what}()" if what == "close" else f"#{seq} {what}({n})"
