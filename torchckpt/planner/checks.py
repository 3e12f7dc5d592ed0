"""The arguments of ``plan``, ``plans``, ``auto`` and ``Plan.apply``, checked at the call, and the error for a batch
the model rejects while it is profiled (STYLE.md 6: what was expected, what was found, what to pass)."""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn

from torchckpt._args import check_flag, check_module, found
from torchckpt._errors import CheckpointError
from torchckpt.codecs.base import Codec
from torchckpt.planner.costs import Link
from torchckpt.planner.profiling import StepRaised
from torchckpt.planner.sharded import unsupported

__all__ = ["check_args", "check_batch", "check_codec", "rejected"]


def check_args(call: str, model: nn.Module, batch: tuple[tuple[Any, ...], dict[str, Any]] | None, codec: object,
                blocks: object, loss_fn: object, link: object, verify: object, progress: object) -> None:
    """The arguments of ``plan``, ``plans`` and ``auto`` (``call``), checked at the call (STYLE.md 6); ``batch``:
    the example batch of ``plan`` and ``plans`` (``auto`` gets the model's own call)."""
    check_module(f"{call}(model, ...)", model, "pass the model to plan (an nn.Module; its repeated blocks are found); "
                 "to checkpoint a function, use torchckpt.checkpoint(fn, *args, policy=...)")
    check_codec(f"{call}(codec=...)", codec)
    sharded = unsupported(model)
    if sharded:  # NOTE [ Sharded parameters ] Rule 4
        raise CheckpointError(
            f"torchckpt: {call}(model, ...) plans models sharded with fully_shard alone (FSDP2), and this one holds "
            f"{sharded}: its forward runs on DTensors, whose memory the profile cannot read. Plan the model before "
            "tensor parallelism is applied (on one rank, with the per-rank batch), save the plan "
            "(plan.save('plan.json')), and on every rank apply it before parallelizing: "
            "Plan.load('plan.json').apply(model); or put a policy on each block yourself (torchckpt.checkpoint(block, "
            "policy=torchckpt.Recompute())).")
    if blocks is not None:
        if not isinstance(blocks, (list, tuple, nn.ModuleList, nn.Sequential)):
            raise TypeError(f"torchckpt: {call}(blocks=...) expects a list of the model's blocks (submodules, in forward "
                            f"order) or None, got {found(blocks)}; pass e.g. blocks=list(model.layers), or None to "
                            "find them.")
        if len(blocks) == 0:
            raise ValueError(f"torchckpt: {call}(blocks=...) got no blocks; pass the blocks to plan in forward order "
                             "(e.g. blocks=list(model.layers)), or None to find them.")
        names = {id(m) for _, m in model.named_modules()}
        bad = next((k for k, b in enumerate(blocks) if not isinstance(b, nn.Module) or id(b) not in names), None)
        if bad is not None:
            raise ValueError(f"torchckpt: {call}(blocks=...) must be submodules of the model, in forward order; item "
                             f"{bad}, {found(blocks[bad])}, is not one. Pass modules of this model, e.g. "
                             "blocks=list(model.layers).")
        if len({id(b) for b in blocks}) != len(blocks):
            raise ValueError(f"torchckpt: {call}(blocks=...) got a module twice; pass each block once, in forward order.")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"torchckpt: {call}(loss_fn=...) expects a function of the model's output returning a scalar "
                        f"loss, or None, got {found(loss_fn)}; pass e.g. loss_fn=lambda out: out.loss.")
    if link is not None and not isinstance(link, Link):
        raise TypeError(f"torchckpt: {call}(link=...) expects a torchckpt.planner.Link or None (measured), got "
                        f"{found(link)}; pass e.g. link=torchckpt.planner.Link(d2h=25e9, h2d=25e9) in bytes/s.")
    check_flag(call, "verify", verify)
    check_flag(call, "progress", progress)
    if batch is not None:
        check_batch(call, model, *batch)


def check_codec(where: str, codec: object) -> None:
    if codec is not None and not isinstance(codec, Codec):
        raise TypeError(f"torchckpt: {where} expects a torchckpt.codecs.Codec or None, got {found(codec)}; pass e.g. "
                        "codec=torchckpt.codecs.TritonQuant(bits=4).")


def check_batch(call: str, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """An example batch that cannot be bound to ``model.forward``'s parameters, or one dict whose keys are those
    parameters (the batch of a transformers model, to be passed as ``**batch``), is an error at the call."""
    if model._forward_pre_hooks:  # a hook may rewrite the arguments before forward sees them
        return
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    bare = [q.replace(annotation=inspect.Parameter.empty) for q in sig.parameters.values()]
    name = f"{type(model).__name__}.forward{sig.replace(parameters=bare, return_annotation=inspect.Signature.empty)}"
    if len(args) == 1 and not kwargs and isinstance(args[0], Mapping) and args[0] and all(
            isinstance(k, str) and k in sig.parameters for k in args[0]) and next(iter(sig.parameters), None) in args[0]:
        first = next(iter(sig.parameters))
        raise TypeError(f"torchckpt: {call}(model, batch, ...) got one {type(args[0]).__name__} whose keys "
                        f"({', '.join(args[0])}) are arguments of {name}; pass them as keyword arguments, as the model "
                        f"is called: {call}(model, **batch, ...) (or, if {first} is that dict itself, "
                        f"{call}(model, {first}=batch, ...)).")
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        got = _batch_words(args, kwargs)
        raise TypeError(f"torchckpt: {call}(model, *batch, ...) calls {name} with {got}, which does not fit it ({e}); "
                        f"pass an example batch of the shape training uses, as the model is called: model(*args, "
                        f"**kwargs) is planned by {call}(model, *args, ..., **kwargs).") from None


def _batch_words(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    items = [found(a) for a in args] + [f"{k}={found(v)}" for k, v in kwargs.items()]
    return f"the batch ({'; '.join(items)})" if items else "no batch"


def rejected(call: str, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              e: StepRaised) -> CheckpointError:
    """The error for a profiling step the model, the loss or the backward failed (NOTE [ Profiling step ] Rule 8)."""
    if e.where == "the backward of the loss":
        fix = ("planning runs plain training steps: check that loss_fn(model(*args, **kwargs)).backward() runs "
               "without torchckpt on this batch, or pass another loss_fn=... (a scalar loss of the model's output)")
    elif e.where != "the model's forward":
        fix = ("pass loss_fn=... returning a scalar loss of the model's output (default: its .loss, the output if it is "
               "a scalar, else the mean square of its tensors)")
    elif len(args) == 1 and not kwargs and isinstance(args[0], Mapping):
        fix = (f"the batch is one {type(args[0]).__name__}: if its keys are the model's arguments (input_ids=..., "
               f"labels=...), pass them as keyword arguments: {call}(model, **batch, ...)")
    else:
        fix = (f"pass an example batch the model takes, as training calls it: model(*args, **kwargs) is planned by "
               f"{call}(model, *args, ..., **kwargs)")
    return CheckpointError(f"torchckpt: {call}(model, ...) profiles a training step of {type(model).__name__} on "
                           f"{_batch_words(args, kwargs)}, and {e.where} raised {type(e.error).__name__}: {e.error}; "
                           f"{fix}.")
