"""Checkpoint policies: what happens to the tensors a block saves for backward.

Policies are values, not strings (``checkpoint(block, policy=Offload(store))``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from torchckpt.codecs.base import Codec
from torchckpt.store import Store
from torchckpt.recompute.parts import check_parts
from torchckpt.recompute.selective import check_save

_DETERMINISM = ("default", "none")


def _check_store(owner: str, store: object) -> None:
    if store is not None and not isinstance(store, Store):
        raise TypeError(
            f"torchckpt: {owner}(store=...) expects a torchckpt.Store or None, got {type(store).__name__}; "
            "pass store=torchckpt.Store(gpu_bytes=...)."
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Recompute:
    """Save only the block's inputs; recompute its activations during backward.

    Non-reentrant semantics of ``torch.utils.checkpoint`` (which runs the recomputation):
    CPU and CUDA RNG state restored (dropout draws the same mask), autocast state restored,
    keyword arguments, nested checkpoints, inputs that do not require grad.

    Args:
        store: where the inputs saved at the block boundary go; ``None`` keeps them on the device.
        preserve_rng_state: restore the RNG state before recomputing.
        determinism_check: ``"default"`` compares shapes, dtypes and devices of recomputed
            tensors with the originals; ``"none"`` skips it.
        debug: on a mismatch, print the operators of both runs.
        save: keep these ops' outputs from the forward instead of recomputing them (selective
            recomputation, NOTE [ Selective recompute ]): aten op overloads (e.g.
            ``torch.ops.aten.mm.default``) and/or op positions in the block's forward (ints, as the
            planner names them). The kept outputs go through ``store`` when one is given.
            ``None``: recompute everything.
        codec: compress the kept outputs on their way to host memory with this
            ``torchckpt.codecs.Codec`` (needs ``save`` and ``store``; the inputs go as the store
            sends them). A lossy codec (e.g. ``TritonQuant``) makes the recomputation start from
            outputs within its stated guarantee, so gradients are within it too, not bit-exact.
        parts: recompute the block in parts (NOTE [ Recompute in parts ], recompute/parts.py): cuts
            ``(c1, ..., ck)``, increasing positions > 0 in the order the block's forward saves
            tensors for backward (0 first, parameters counted, as ``Offload(tensors=...)``
            numbers them), split those tensors into the parts ``[0, c1), ..., [ck, N)``. Backward
            recomputes the block once per part, from the last part back, each time from the
            block's start until that part's last saved tensor, keeping only that part's tensors
            and releasing each as backward uses it: the block holds its largest part's bytes at
            once instead of all it saves, for running its early ops more than once. Cut between the
            tensors of different ops (``torchckpt.recompute.parts.PartsStats.nodes``): one op's saved
            tensors come back together. Every cut must be below the number of tensors the block
            saves (checked at each forward). Works with
            ``save``, ``store`` and ``codec`` (kept outputs are handed to every recomputation that
            runs their op); the same RNG, autocast and determinism guarantees as without parts.
            The planner (``torchckpt.plan``) chooses them from a profile. Under ``torch.compile``
            the block is recomputed whole. ``None``: recompute the block whole
            (``torch.utils.checkpoint``).
        reentrant: run the forward without grad inside one autograd node of torchckpt's
            (NOTE [ Reentrant recompute ]): no saved-tensor hook and no autograd graph in the
            forward, so the forward costs the host about what the block's own forward does (where
            the non-reentrant frame's hooks make a host-bound model's forward the step's
            bottleneck). Gradients are plain autograd's bit for bit, ``torch.autograd.grad``
            included; a second order (``create_graph``) through the block is plain autograd's
            within rounding (another summation order); a block that uses a tensor needing grad that is neither an
            argument nor a parameter of its module raises ``CheckpointError`` in backward (it
            would get no gradient); every floating output then requires grad. Not with ``save``,
            ``parts``, ``codec``, ``determinism_check="none"`` or ``debug``.
        graphed: ``reentrant=True`` (implied) whose backward replays a CUDA graph of the block's
            recomputation and gradients (NOTE [ Graphed recompute ], recompute/graphed.py), captured
            at a call signature's second backward and checked bit for bit against the eager
            backward then: the backward costs the host a few copies and one launch instead of the
            block's ops. For blocks whose forward is a function of its arguments, parameters and
            buffers (Python attributes it reads are taken as they were at the capture) and does not
            communicate (not under FSDP); blocks that
            draw random numbers, read other tensors, or cannot be captured recompute eagerly
            (``torchckpt.recompute.graphed.stats()`` says why). Holds GPU memory beyond the
            allocator's count: the graphs' buffers and one pool of intermediates per device
            (``graphed.pool_bytes()``; ``graphed.clear()`` frees them). No effect off CUDA.

    Example::

        >>> import torchckpt
        >>> x = torch.randn(8, 8, requires_grad=True)
        >>> f = lambda x: x.exp().tanh().sin()
        >>> y = torchckpt.checkpoint(f, x, policy=torchckpt.Recompute(parts=(1,)))
        >>> y.sum().backward()
        >>> bool(torch.allclose(x.grad, torch.func.grad(lambda x: f(x).sum())(x.detach())))
        True
    """

    store: Store | None = None
    preserve_rng_state: bool = True
    determinism_check: str = "default"
    debug: bool = False
    save: frozenset[Any] | None = None
    codec: Codec | None = None
    parts: tuple[int, ...] | None = None
    reentrant: bool = False
    graphed: bool = False

    def __post_init__(self) -> None:
        _check_store("Recompute", self.store)
        object.__setattr__(self, "save", check_save("Recompute", self.save))
        object.__setattr__(self, "parts", check_parts("Recompute", self.parts))
        if self.codec is not None:
            if not isinstance(self.codec, Codec):
                raise TypeError(
                    f"torchckpt: Recompute(codec=...) expects a torchckpt.codecs.Codec or None, got "
                    f"{type(self.codec).__name__}; pass e.g. codec=torchckpt.codecs.TritonQuant(bits=8, mode='rel', "
                    "bound=1e-2).")
            if not self.save or self.store is None:
                raise ValueError(
                    "torchckpt: Recompute(codec=...) compresses the outputs kept by save=... on their way through "
                    "store=...; pass both (e.g. Recompute(store=store, save={torch.ops.aten.mm.default}, codec=codec)), "
                    "or use Offload(store, codec) to compress what a block saves.")
        for name in ("preserve_rng_state", "debug", "reentrant", "graphed"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"torchckpt: Recompute({name}=...) expects True or False, got {type(value).__name__} {value!r}."
                )
        if self.determinism_check not in _DETERMINISM:
            raise ValueError(
                f"torchckpt: Recompute(determinism_check=...) must be one of {_DETERMINISM}, "
                f"got {self.determinism_check!r}."
            )
        if self.graphed:  # NOTE [ Graphed recompute ]: the reentrant node's backward, graphed
            object.__setattr__(self, "reentrant", True)
        if self.reentrant:
            other = [n for n, v in (("save", self.save), ("parts", self.parts), ("codec", self.codec)) if v is not None]
            other += [n for n, v in (("determinism_check", self.determinism_check != "default"),
                                     ("debug", self.debug)) if v]
            if other:
                raise ValueError(
                    f"torchckpt: Recompute(reentrant=True) recomputes the block whole in one autograd node, with no "
                    f"hook in its forward; {', '.join(other)} need(s) the non-reentrant frame. Pass reentrant=False "
                    f"with {', '.join(other)}, or drop {', '.join(other)}.")


@dataclasses.dataclass(frozen=True, eq=False)
class Offload:
    """Send every tensor the block saves to a ``Store`` (GPU cache, then pinned host memory).

    Args:
        store: the store; ``None`` uses ``torchckpt.default_store()`` for the inputs' device.
        codec: compress this block's tensors on their way to host memory with this
            ``torchckpt.codecs.Codec`` (NOTE [ Store ] Rule 9); ``None``: the store's codec.
            A lossy codec (e.g. ``TritonQuant``) gives gradients within its stated guarantee,
            not bit-exact ones.
        tensors: offload only these of the tensors the block saves, by position in the order the
            block's forward saves them (0 first, parameters counted); the others stay on the
            device (version-checked, as autograd keeps them). ``None``: all of them. The planner
            (``torchckpt.plan``) sets this from a profiled step.
        expect: with ``tensors``, how many tensors the block's forward saves (as profiled). A
            forward that saves another number gets a warning, once, and from then on this policy
            offloads every tensor the block saves: the positions may name other tensors now
            (gradients stay exact either way; the memory figures of the plan would not hold).
    """

    store: Store | None = None
    codec: Codec | None = None
    tensors: frozenset[int] | None = None
    expect: int | None = None

    def __post_init__(self) -> None:
        _check_store("Offload", self.store)
        if self.tensors is not None:
            bad = not isinstance(self.tensors, (set, frozenset, list, tuple)) or any(
                isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in self.tensors)
            if bad:
                raise TypeError(
                    f"torchckpt: Offload(tensors=...) expects positions (ints >= 0) of the block's saved tensors or "
                    f"None, got {self.tensors!r}; pass e.g. tensors={{0, 3}}, or None to offload every saved tensor."
                )
            object.__setattr__(self, "tensors", frozenset(self.tensors))
        if self.expect is not None and (isinstance(self.expect, bool) or not isinstance(self.expect, int)
                                        or self.expect < 0):
            raise TypeError(f"torchckpt: Offload(expect=...) expects how many tensors the block saves (an int >= 0) "
                            f"or None, got {self.expect!r}.")
        if self.codec is not None and not isinstance(self.codec, Codec):
            raise TypeError(
                f"torchckpt: Offload(codec=...) expects a torchckpt.codecs.Codec or None, got "
                f"{type(self.codec).__name__}; pass e.g. codec=torchckpt.codecs.TritonQuant(bits=8, mode='rel', bound=1e-2)."
            )


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class Keep:
    """Keep the block's saved tensors on the device, as plain autograd does. Takes no arguments."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        if args or kwargs:
            given = ", ".join([type(a).__name__ for a in args] + [f"{k}=..." for k in kwargs])
            raise TypeError(
                f"torchckpt: Keep() takes no arguments, got Keep({given}); Keep leaves saved tensors where "
                "autograd puts them and uses no store. To send them to a store pass Offload(store), or "
                "Recompute(store=store) for the block's inputs."
            )


Policy = Recompute | Offload | Keep
