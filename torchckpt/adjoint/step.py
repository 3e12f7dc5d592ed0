"""One step of a checkpointed loop or scan on flat lists of tensors, and the structure of what it carries.

``checkpointed_scan`` and ``checkpointed_loop`` (adjoint/loop.py) drive a ``Step``: ``(k, state, xs[k]) ->
(state, y)`` on the tensor leaves of the carry (``Tree`` holds the rest); NOTE [ Checkpointed loop ] Rules 4-5 there.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchckpt._errors import CheckpointError
from torchckpt.adjoint.captures import flat_state, grad_leaf

__all__ = ["Step", "Tree", "aliases", "detached", "firsts"]


class Step:
    """One step on flat lists (NOTE [ Checkpointed loop ] Rule 4): ``(k, state, xs[k]) -> (state, y)``, for the scan or the loop."""

    def __init__(self, step: Callable[..., Any], carry: Tree, xs: list[torch.Tensor], xs_tree: Tree | None,
                 index: bool, loop: bool) -> None:
        self.step, self.carry, self.xs, self.xs_tree = step, carry, xs, xs_tree
        self.index, self.loop = index, loop
        self.y: Tree | None = None  # the structure of y, fixed by step 0

    def x_at(self, k: int, grad: bool = False) -> list[torch.Tensor]:
        """``xs[k]``, as leaves of their own when ``grad`` and the slice requires grad
        (NOTE [ Checkpointed loop ] Rule 4)."""
        return [grad_leaf(t[k]) if grad and t.requires_grad else t[k].detach() for t in self.xs]

    def __call__(self, k: int, x: list[torch.Tensor],
                 xk: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        carry = self.carry.build(x)
        if self.loop:
            return flat_state(self.carry.spec, x, self.step(carry)), []
        xt = self.xs_tree.build(xk) if self.xs_tree is not None else None
        got = self.step(carry, xt, k) if self.index else self.step(carry, xt)
        if not isinstance(got, tuple) or len(got) != 2:
            raise CheckpointError(
                f"torchckpt: checkpointed_scan's step must return a pair (carry, y), got {type(got).__name__}; return "
                "(carry, None) when a step has no output.")
        out = self.carry.tensors(got[0], x)
        if self.y is None:
            self.y = Tree(got[1], "y", "step's output y")
        return out, self.y.tensors(got[1])


class Tree:
    """A pytree's tensor leaves as a flat list; its other leaves are held as they are
    (NOTE [ Checkpointed loop ] Rule 4)."""

    def __init__(self, tree: Any, name: str, where: str) -> None:
        leaves, self.spec = tree_flatten(tree)
        self.name, self.where = name, where
        self.pos = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self.rest = [(i, v) for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)]
        self.like = [leaves[i] for i in self.pos]
        self.n = len(leaves)
        # the tree is one tensor: building and flattening it need no pytree walk (a step's host time)
        self.one = self.spec.is_leaf() and self.pos == [0]

    def build(self, tensors: list[torch.Tensor]) -> Any:
        if self.one:
            return tensors[0]
        leaves: list[Any] = [None] * self.n
        for i, t in zip(self.pos, tensors):
            leaves[i] = t
        for i, v in self.rest:
            leaves[i] = v
        return tree_unflatten(leaves, self.spec)

    def tensors(self, tree: Any, like: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The tensor leaves of ``tree``, checked against the structure (and shapes, dtypes) this was made from."""
        if self.one and type(tree) is torch.Tensor:
            leaves, spec = [tree], self.spec  # what tree_flatten gives a tensor
        else:
            leaves, spec = tree_flatten(tree)
        if spec != self.spec:
            raise CheckpointError(f"torchckpt: the {self.where} must keep its structure from step to step; took "
                                  f"{self.spec}, returned {spec}.")
        for i, v in self.rest:
            if not _same(leaves[i], v):
                raise CheckpointError(
                    f"torchckpt: a non-tensor part of the {self.where} changed ({v!r} became {leaves[i]!r}): it is "
                    "passed through unchanged, not checkpointed. Make it a tensor, or compute it from the step index "
                    "(checkpointed_scan(..., index=True) passes it as a Python int).")
        out = [leaves[i] for i in self.pos]
        for a, b in zip(like if like is not None else self.like, out):
            if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
                raise CheckpointError(
                    f"torchckpt: the {self.where} must keep its shapes and dtypes from step to step; took "
                    f"{tuple(a.shape)} {a.dtype}, returned {tuple(getattr(b, 'shape', ()))} "
                    f"{getattr(b, 'dtype', type(b))}.")
        return out


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects whose == is not a truth value are compared by identity
        return False


def aliases(x: Sequence[torch.Tensor]) -> list[int] | None:
    """NOTE [ Checkpointed loop ] Rule 5: for each position, the first position holding the same tensor object; ``None``
    when none repeats."""
    seen: dict[int, int] = {}
    pattern = [seen.setdefault(id(v), i) for i, v in enumerate(x)]
    return pattern if len(seen) < len(x) else None


def firsts(x: Sequence[torch.Tensor]) -> list[bool]:
    seen: set[int] = set()
    out = []
    for v in x:
        out.append(id(v) not in seen)
        seen.add(id(v))
    return out


def detached(x: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    memo: dict[int, torch.Tensor] = {}
    return [memo.setdefault(id(v), v.detach()) for v in x]
