"""Tensors other ranks spilled here, moved between ranks in collective rounds of torch.distributed point-to-point.

# NOTE [ Peer tier ]
# The peer half of NOTE [ Peer spill ]: a rank whose cache overflows sends snapshots to peers with spare memory
# (the plan: ``torchckpt.distributed.exchange``) and later fetches them back.
# 1. Every move is a *round* that every rank of the group enters together, each with its own (possibly empty)
#    part: ``send_round``, ``fetch_round``, ``drop_round``. A round is one ``all_gather_object`` of metadata,
#    then (send and fetch) one ``batch_isend_irecv`` of the ``P2POp``s both sides derive from that metadata in
#    the same order (peer by peer in rank order, tensors in list order), then a wait on every request.
# 2. A holder keys what it holds by ``(sender rank in the group, key)``; a rank fetches and drops only what it
#    sent. Sending a key again to the same holder replaces the held tensor. Keys must pickle (they travel in
#    the metadata) and be unique within one round's list for one destination, and a fetch round's keys unique
#    across holders (its result is one ``{key: tensor}``).
# 3. Tensors travel as their bytes: made contiguous, flattened and viewed as ``uint8``, so every dtype moves
#    bit-exact over any backend; the sender keeps shape and dtype in the metadata and the fetched tensor comes
#    back contiguous with them (strides are not kept). Empty tensors need no message.
# 4. Failures are exchanged, never left to hang a peer. A rank whose own arguments are bad contributes an error
#    marker instead of its part, takes part in the rest of the round with nothing, and raises its
#    ``torchckpt:`` error after it; the others finish normally. ``fetch_round`` gathers the requests, then the
#    holders' replies (held or missing); a rank that asked for any key a holder lacks gets nothing in that round
#    (no holder sends it anything or drops its tensors, so it can ask again) and raises, naming the missing keys.
# 5. The same calls run NCCL on GPUs: received buffers are allocated on ``device`` (default: the current CUDA
#    device under NCCL, else CPU) and the transfers run on torch.distributed's own streams; callers set
#    ``torch.cuda.set_device`` per rank, as NCCL point-to-point requires. The constructor runs one
#    all-reduce on the group, so a ``batch_isend_irecv`` is never the group's first collective. ``SnapshotStore``
#    sends its ``Tier.HOST`` snapshots through a tier by the plan and fetches them ahead (``peers=``, NOTE
#    [ Snapshot peer tier ] Rules 1-6); it agrees on each action with ``gather`` before it enters a round.
# 6. Under NCCL the rounds' metadata goes over a gloo group of the same ranks, made by the constructor (which is
#    therefore collective: every rank constructs its tier together). Over NCCL, ``all_gather_object`` reads its
#    result back with a device-to-host copy, which queues behind the device-to-host copies already issued (a
#    store spilling the rest of its overflow to host): on 2 H100s the peer transfer then started only after
#    1.25 GiB of host copies had ended, 45 ms for what took 25 and 21 ms each alone. Without gloo the
#    metadata stays on the tensors' group.
"""
from __future__ import annotations

import pickle
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchckpt._errors import CheckpointError

__all__ = ["PeerTier"]

_Meta = tuple[Hashable, tuple[int, ...], torch.dtype, int]  # key, shape, dtype, bytes


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat contiguous ``uint8`` tensor (NOTE [ Peer tier ] Rule 3)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:  # "contiguous", yet no dtype view (see codecs.base.flat_bytes)
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


class PeerTier:
    """Tensors that other ranks sent here, and the collective rounds that move them (NOTE [ Peer tier ]).

    Args:
        group: the process group; ``None``: the world.
        device: where received tensors are held; ``None``: the current CUDA device under NCCL, else CPU.

    Example::

        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> tier = PeerTier()
        >>> tier.send_round({})  # one rank alone has no peer: an empty round
        >>> tier.fetch_round({}), tier.held_bytes()
        ({}, 0)
        >>> dist.destroy_process_group()
    """

    def __init__(self, group: Any = None, device: torch.device | str | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError("torchckpt: PeerTier moves tensors over torch.distributed, but no process group "
                                  "is initialized; call torch.distributed.init_process_group(...) on every rank first.")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if device is None:
            nccl = str(dist.get_backend(group)).lower() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        # NOTE [ Peer tier ] Rule 6: the rounds' metadata over a CPU group when the tensors go over NCCL (collective:
        # every rank constructs its PeerTier together, as it enters rounds together).
        self._meta_group = group
        if str(dist.get_backend(group)).lower() == "nccl" and dist.is_gloo_available():
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self._meta_group = dist.new_group(ranks=ranks, backend="gloo")
        if str(dist.get_backend(group)).lower() == "nccl":  # NOTE [ Peer tier ] Rule 5: the communicator exists before any round
            dist.all_reduce(torch.zeros(1, device=self.device), group=group)
        self._held: dict[tuple[int, Hashable], torch.Tensor] = {}  # (sender, key) -> its bytes (NOTE [ Peer tier ] Rule 3)
        self._meta: dict[tuple[int, Hashable], tuple[tuple[int, ...], torch.dtype]] = {}

    # -- local ---------------------------------------------------------------------------------------------------

    def held_bytes(self) -> int:
        """Bytes this rank holds for its peers."""
        return sum(int(b.numel()) for b in self._held.values())

    def held_keys(self) -> list[tuple[int, Hashable]]:
        """``(sender rank, key)`` of every tensor held here."""
        return list(self._held)

    def close(self) -> None:
        """Drop everything held here (local; peers that fetch it later get the missing-key error)."""
        self._held.clear()
        self._meta.clear()

    def __repr__(self) -> str:
        return f"PeerTier(rank={self.rank}, world_size={self.world_size}, held={len(self._held)}, device={self.device})"

    # -- helpers -------------------------------------------------------------------------------------------------

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in group order, over the rounds' metadata group (collective;
        NOTE [ Peer tier ] Rule 6).

        For callers that agree on what each rank does before they enter a round (the snapshot store's peer side).
        """
        return self._gather(obj)

    def _gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._meta_group)
        return out

    def _peers(self, what: str, by_rank: Any) -> str | None:
        """The error for a mapping of peer ranks that is not one, else None (NOTE [ Peer tier ] Rule 4)."""
        if not isinstance(by_rank, Mapping):
            return f"torchckpt: {what} needs a dict {{peer rank: list}}, got {type(by_rank).__name__}."
        for r in by_rank:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.world_size or r == self.rank:
                return (f"torchckpt: {what} got peer rank {r!r}; pass ranks of the group other than this one "
                        f"(0..{self.world_size - 1}, not {self.rank}).")
        return None

    def _keys_ok(self, what: str, keys: Sequence[Any], r: int) -> str | None:
        try:
            if len(set(keys)) != len(keys):
                return f"torchckpt: {what} got a key twice for rank {r}; pass each key once per rank and round."
            pickle.dumps(list(keys))
        except Exception as e:  # unhashable or unpicklable keys
            return f"torchckpt: {what} needs hashable, picklable keys (they travel as metadata); got {e!r}."
        return None

    def _p2p(self, ops: list[dist.P2POp]) -> None:
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()

    # -- rounds --------------------------------------------------------------------------------------------------

    def send_round(self, outgoing: Mapping[int, Sequence[tuple[Hashable, torch.Tensor]]]) -> None:
        """Send this rank's tensors to peers, and hold what peers send here (collective; NOTE [ Peer tier ] Rule 1).

        Args:
            outgoing: ``{peer rank: [(key, tensor), ...]}``, possibly empty; tensors on ``device``.
        """
        err = self._peers("send_round", outgoing)
        meta: dict[int, list[_Meta]] = {}
        if err is None:
            for r, items in outgoing.items():
                try:
                    pairs = [(k, t) for k, t in items]
                except (TypeError, ValueError):
                    err = f"torchckpt: send_round needs a list of (key, tensor) pairs for rank {r}."
                    break
                if any(not isinstance(t, torch.Tensor) for _, t in pairs):
                    err = f"torchckpt: send_round needs torch.Tensor values for rank {r}; pass (key, tensor) pairs."
                    break
                bad = [t.device for _, t in pairs if not self._on_device(t)]
                if bad:
                    err = (f"torchckpt: send_round got a tensor on {bad[0]}, but this tier moves tensors on "
                           f"{self.device}; move it there or make the tier with device={str(bad[0])!r}.")
                    break
                err = self._keys_ok("send_round", [k for k, _ in pairs], r)
                if err is not None:
                    break
                meta[r] = [(k, tuple(t.shape), t.dtype, t.numel() * t.element_size()) for k, t in pairs]
        all_meta = self._gather(None if err is not None else meta)  # NOTE [ Peer tier ] Rule 4: an error sends nothing
        ops: list[dist.P2POp] = []
        received: list[tuple[tuple[int, Hashable], torch.Tensor, tuple[int, ...], torch.dtype]] = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            if err is None:
                for (k, shape, dtype, nbytes), (_, t) in zip(meta.get(r, []), outgoing.get(r, [])):
                    if nbytes:
                        ops.append(dist.P2POp(dist.isend, _as_bytes(t), self._global(r), self.group))
            theirs = all_meta[r]
            for k, shape, dtype, nbytes in (theirs or {}).get(self.rank, []):
                buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                if nbytes:
                    ops.append(dist.P2POp(dist.irecv, buf, self._global(r), self.group))
                received.append(((r, k), buf, shape, dtype))
        self._p2p(ops)
        for hk, buf, shape, dtype in received:
            self._held[hk] = buf
            self._meta[hk] = (shape, dtype)
        if err is not None:
            raise ValueError(err)

    def fetch_round(self, wanted: Mapping[int, Sequence[Hashable]]) -> dict[Hashable, torch.Tensor]:
        """Take back tensors this rank sent to peers; the holders send them and drop them (collective;
        NOTE [ Peer tier ] Rule 4).

        Args:
            wanted: ``{holder rank: [key, ...]}``, possibly empty.

        Returns:
            ``{key: tensor}``, each bit-exact with shape and dtype as sent.
        """
        err = self._peers("fetch_round", wanted)
        asks: dict[int, list[Hashable]] = {}
        if err is None:
            asks = {r: list(keys) for r, keys in wanted.items()}
            flat = [k for keys in asks.values() for k in keys]
            err = self._keys_ok("fetch_round", flat, -1)  # one dict of results: keys unique across holders
            if err is not None:
                err = err.replace("for rank -1", "across holders")
        all_asks = self._gather(None if err is not None else asks)
        # Round 2: each holder replies to each asker with the metadata of what it holds, or the keys it lacks.
        reply: dict[int, tuple[list[_Meta], list[Hashable]]] = {}
        for a in range(self.world_size):
            keys = (all_asks[a] or {}).get(self.rank, []) if a != self.rank else []
            if keys:
                have = [(k, *self._meta[(a, k)], int(self._held[(a, k)].numel())) for k in keys if (a, k) in self._held]
                reply[a] = (have, [k for k in keys if (a, k) not in self._held])
        replies = self._gather(reply)
        failed = {a for a in range(self.world_size) for rep in replies if rep.get(a, ([], []))[1]}
        ops: list[dist.P2POp] = []
        to_drop: list[tuple[int, Hashable]] = []
        got: list[tuple[Hashable, torch.Tensor, tuple[int, ...], torch.dtype]] = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            if r not in failed:  # serve asker r
                for k, _shape, _dtype, nbytes in reply.get(r, ([], []))[0]:
                    if nbytes:
                        ops.append(dist.P2POp(dist.isend, self._held[(r, k)], self._global(r), self.group))
                    to_drop.append((r, k))
            if self.rank not in failed:  # receive from holder r
                for k, shape, dtype, nbytes in replies[r].get(self.rank, ([], []))[0]:
                    buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                    if nbytes:
                        ops.append(dist.P2POp(dist.irecv, buf, self._global(r), self.group))
                    got.append((k, buf, shape, dtype))
        self._p2p(ops)
        for hk in to_drop:
            del self._held[hk], self._meta[hk]
        if err is not None:
            raise ValueError(err)
        if self.rank in failed:
            missing = {r: rep[self.rank][1] for r, rep in enumerate(replies) if rep.get(self.rank, ([], []))[1]}
            raise CheckpointError(f"torchckpt: fetch_round asked for keys their holders do not have: {missing} "
                                  "({holder rank: keys}); nothing was fetched this round. Ask only for keys this "
                                  "rank sent to that holder with send_round and has not fetched or dropped since.")
        return {k: buf.view(dtype).reshape(shape) for k, buf, shape, dtype in got}

    def drop_round(self, dropped: Mapping[int, Iterable[Hashable]]) -> None:
        """Tell holders to drop tensors this rank sent them and no longer needs (collective; metadata only).

        Args:
            dropped: ``{holder rank: [key, ...]}``, possibly empty; keys a holder lacks are ignored.
        """
        err = self._peers("drop_round", dropped)
        asks: dict[int, list[Hashable]] | None = None
        if err is None:
            asks = {r: list(keys) for r, keys in dropped.items()}
            err = next((e for r, ks in asks.items() if (e := self._keys_ok("drop_round", ks, r))), None)
        all_asks = self._gather(None if err is not None else asks)
        for a, ask in enumerate(all_asks):
            for k in (ask or {}).get(self.rank, []) if a != self.rank else []:
                self._held.pop((a, k), None)
                self._meta.pop((a, k), None)
        if err is not None:
            raise ValueError(err)

    def _on_device(self, t: torch.Tensor) -> bool:
        d = self.device
        return t.device.type == d.type and (d.index is None or t.device.index in (d.index, None))
