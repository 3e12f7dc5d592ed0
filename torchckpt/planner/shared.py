"""Storages that several blocks reference, counted once at each sample of the step model (pure Python, no torch).

# NOTE [ Shared storages ]
# 1. The step model counts bytes per block (NOTE [ Step model ] Rule 3): a kept block's saved tensors, where a
#    storage saved by several blocks counts in the first that saved it (NOTE [ Profiling step ] Rule 2), and a
#    recomputed block's inputs, each block's in full. A storage that several blocks reference is one allocation,
#    on the device while any of them holds it: a block's output that the next block saves too (a ResNet block's
#    last ReLU saves its output, the next block's convolutions save it as their input), a tensor handed to many
#    blocks (T5's position bias, the encoder's output in its decoder). Per block, the model freed such a storage
#    with its first saver though a kept block still held it, and counted it once per recomputed block taking it.
# 2. So the profile says which storage each saved tensor and each input is, and each block lists those another
#    block references too (``Block.shared``: the storage, its bytes, where the block saved it or that it took it
#    as an input). At each sample the replay counts each such storage once where some block holds it, and takes
#    off the copies the blocks' own terms counted there. In the forward, after block i: held if a block up to i
#    holds it between its forward and its backward (a kept block that saved it, an offloaded one that saved it and
#    did not send it, a recomputed block taking it as an input on the device). In the backward of block i: held if
#    a block before i holds it, or if block i uses it there (it saved it, or it is recomputed and takes it); the
#    terms count it where block i's bytes there include it (its saved bytes, where it saved it first; its inputs,
#    where it is recomputed in parts: NOTE [ Step model ] Rule 2c).
# 3. Revolve over the chain (NOTE [ Step model ] Rule 5) holds inputs of its own choosing: its plans are left as the
#    blocks' terms say. Kept ops' outputs (NOTE [ Step model ] Rule 2b) and offloaded tensors in flight are not
#    followed.
# 4. A profile that numbered no storages (block by block, NOTE [ Profiling step ] Rule 6, where each block runs
#    alone; or recorded before they were numbered) lists none, and the model counts per block, as Rule 1 says.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Ref", "corrections", "refs", "shared_of"]

# storage, bytes; held from forward to backward, counted there; used in the block's backward, counted there
Ref = tuple[int, int, bool, int, bool, int]


def refs(shared: Sequence[tuple[int, int, int]], saved: Sequence[int], mode: str, offload: Sequence[int], host: bool,
         parts: bool) -> tuple[Ref, ...]:
    """One block's references to storages another block references too, under a decision's ``mode``, ``offload``,
    ``host`` and ``parts`` (NOTE [ Shared storages ] Rule 2); ``shared`` and ``saved`` are ``Block``'s."""
    out: dict[int, list[int]] = {}
    sent = set(offload)
    rec = mode == "recompute"
    for storage, nbytes, position in shared:
        if position >= 0:  # saved here; its bytes are in this block's terms where it saved it first
            first = int(saved[position] > 0)
            on = mode == "keep" or (mode == "offload" and position not in sent)
            held, counted, used, counted_b = on, first * on, True, first
        else:  # an input: a recomputed block keeps it (on the device unless it goes to host), its terms count it
            held = rec and not host
            counted, used, counted_b = int(held), rec, int(rec and parts)
        got = out.setdefault(storage, [nbytes, 0, 0, 0, 0])
        got[1] |= held
        got[2] += counted
        got[3] |= used
        got[4] += counted_b
    return tuple((s, v[0], bool(v[1]), v[2], bool(v[3]), v[4]) for s, v in out.items())


def corrections(per: Sequence[tuple[Ref, ...]]) -> tuple[list[int], list[int]] | None:
    """Bytes to add at each block's sample, forward and backward, so that each shared storage counts once where held
    (NOTE [ Shared storages ] Rule 2); ``per``: each block's ``refs``. ``None``: nothing to add."""
    n = len(per)
    by: dict[int, list[tuple[int, Ref]]] = {}
    for i, rs in enumerate(per):
        for r in rs:
            by.setdefault(r[0], []).append((i, r))
    fwd, bwd, point = [0] * (n + 1), [0] * (n + 1), [0] * n  # differences over the blocks; point: block i's own
    for found in by.values():
        if len(found) < 2:  # one block alone: its own terms count it right
            continue
        first = next((i for i, r in found if r[2]), n)
        nbytes = found[0][1][1]
        fwd[first] += nbytes  # held from the first block that holds it on
        bwd[min(n, first + 1)] += nbytes  # in the backward of the blocks after it
        for i, (_, _, _, counted, used, counted_b) in found:
            fwd[i] -= nbytes * counted
            bwd[i + 1] -= nbytes * counted
            point[i] += nbytes * (int(used and first >= i) - counted_b)
    if not any(fwd) and not any(bwd) and not any(point):
        return None
    f, b, acc_f, acc_b = [], [], 0, 0
    for i in range(n):
        acc_f += fwd[i]
        acc_b += bwd[i]
        f.append(acc_f)
        b.append(acc_b + point[i])
    return f, b


def shared_of(saved: Sequence[Sequence[tuple[int, int]]],
              inputs: Sequence[Sequence[tuple[int, int]]]) -> list[tuple[tuple[int, int, int], ...]]:
    """Each block's ``Block.shared`` (NOTE [ Shared storages ] Rule 2) from what the profiling step recorded: per block,
    ``(storage, bytes)`` of each saved tensor, by position (storage ``-1``: not followed, a parameter's), and of each
    input. A storage's bytes are those of the block that saved it first, else of an input."""
    nbytes: dict[int, int] = {}
    users: dict[int, set[int]] = {}
    for i, (sv, ins) in enumerate(zip(saved, inputs)):
        for s, nb in list(sv) + list(ins):
            if s >= 0:
                nbytes[s] = max(nbytes.get(s, 0), nb)
                users.setdefault(s, set()).add(i)
    out = []
    for sv, ins in zip(saved, inputs):
        mine = [(s, nbytes[s], k) for k, (s, _) in enumerate(sv) if s >= 0 and len(users[s]) > 1 and nbytes[s]]
        mine += [(s, nbytes[s], -1) for s in dict.fromkeys(s for s, _ in ins) if s >= 0 and len(users[s]) > 1
                 and nbytes[s]]
        out.append(tuple(mine))
    return out
