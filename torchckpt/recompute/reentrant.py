"""``Recompute(reentrant=True)``: a block's forward without grad inside one autograd node, recomputed in backward.

# NOTE [ Reentrant recompute ]
# 1. The non-reentrant frame (``torch.utils.checkpoint(use_reentrant=False)``, ``Recompute()``'s) runs the block's
#    forward with grad and a saved-tensor hook: a Python call for each tensor the forward saves, and an autograd
#    graph built, then dropped. On an H100 a ConvNeXt-B's forward took the device 27.7 ms keeping everything and
#    43-97 ms under every block ``Recompute()``, the device waiting for the host
#    (docs/notes/2026-11-27-h100-host-bound-forward-launches.md). Here the forward runs under ``no_grad`` inside
#    one autograd ``Function`` (``_Node``), whose backward runs it again with grad (RNG, autocast and device
#    context as the forward had them: ``ForwardState``) and takes the gradients of the recomputed graph.
# 2. The node's inputs are the tensors found anywhere in the call's arguments (pytree leaves of ``args`` and
#    ``kwargs``), then the parameters of the block's module that require grad; its outputs are the tensors of the
#    block's result (pytree leaves), the rest of the result (structure, non-tensor leaves) being the forward's,
#    rebuilt around them. A recomputation whose result has another structure raises ``CheckpointError``.
# 3. Gradients as plain autograd's, bit for bit: the backward takes them with ``torch.autograd.grad`` for the inputs
#    autograd asks for (``ctx.needs_input_grad``), which sums a tensor's contributions in the recomputed graph as
#    plain autograd sums them, and hands them to autograd, which accumulates the parameters' as it would (torch's
#    reentrant checkpoint instead backpropagates into ``.grad`` of detached inputs, whose layout contract and
#    accumulation changed one gradient of torchvision's ConvNeXt by 2.3e-10). So ``torch.autograd.grad``,
#    ``backward(inputs=...)`` and a second order (``create_graph``) work as without it (Rule 7).
# 4. A tensor that requires grad and is reached by the recomputed graph but is neither an input of the node (an
#    argument, a parameter of the module) nor reached through one (a closure's tensor, another module's parameter)
#    would get no gradient: the backward walks the recomputed graph's leaves and raises ``CheckpointError`` naming
#    it (the walk costs the backward a Python step per node of the block's graph). With no argument and no
#    parameter that requires grad the call is left to the non-reentrant frame (``run_reentrant`` returns
#    ``(False, None)``; the same values and gradients, the hooks' cost): a closure's tensor could still need one.
# 5. What the node saves (its tensor inputs) goes through any saved-tensor hooks in force, so
#    ``Recompute(store=..., reentrant=True)`` sends them to the store as ``Recompute(store=...)`` does; the closure
#    holds no tensor of the call. The buffer guard (NOTE [ Buffers written in a forward ]) and the check of mutating
#    forwards (NOTE [ Mutating forwards ]) wrap the block's function around this as around the non-reentrant frame.
# 6. Every floating tensor of the result requires grad (the node's outputs), where plain autograd may say
#    ``requires_grad=False`` of one computed from tensors that need none; its gradient is then zero.
# 7. A backward with ``create_graph`` (grad mode on in it) recomputes from views of the saved inputs (``view_as``,
#    one per argument, so that an input passed twice gets each use's gradient; a leaf itself at its first use,
#    Rule 8), not detached copies: the gradients
#    it returns then depend on the inputs through the recomputed block, as plain autograd's do, and a second order
#    through the block is plain autograd's within rounding (its graph sums the terms in another order: 5e-7 in
#    float32 on a CPU test; with detached copies it lost every term through the block's nonlinearity, 0.22 in that
#    test). The first order stays bit for bit. Rule 4's walk stops at those views.
# 8. An input is a leaf in the recomputation where it was one in the forward, and a view (of a detached copy
#    without ``create_graph``) where it was not (``_inputs``): autocast caches its lower-precision cast of a leaf
#    that requires grad, so one cast serves every op that reads it and their gradients are summed in bfloat16
#    before the cast's backward, where a non-leaf is cast once per op and its gradients summed in float32. With
#    every input a detached leaf, BERT's layers under bf16 autocast (inputs: the previous layer's outputs) gave
#    gradients off by up to 1.5e-5 (tests/test_zoo.py on an H100 and on the CPU). A view is neither a leaf nor
#    cached.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchckpt._errors import CheckpointError
from torchckpt.recompute.forward_state import ForwardState

__all__ = ["gradients", "run_reentrant"]


class _Call:
    """One call: the block, the arguments' structure with their tensors taken out, the forward's result."""

    __slots__ = ("fn", "leaves", "spec", "at", "n_args", "state", "result", "graphs")

    def __init__(self, fn: Callable[..., Any], leaves: list[Any], spec: Any, at: list[int], state: ForwardState) -> None:
        self.fn, self.spec, self.at, self.state = fn, spec, at, state
        self.leaves = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self.n_args = len(at)
        self.result: tuple[list[Any], Any, list[int]] | None = None
        self.graphs: Any = None  # a BlockGraphs where the backward may replay a CUDA graph (NOTE [ Graphed recompute ])

    def run(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The block on ``tensors`` (the arguments' tensors), its result's tensors (NOTE [ Reentrant recompute ] Rule 2)."""
        if self.spec is None:  # tensor arguments alone, no keyword: the tensors are the arguments
            out = self.fn(*tensors)
        else:
            vals = list(self.leaves)
            for i, t in zip(self.at, tensors):
                vals[i] = t
            a, k = tree_unflatten(vals, self.spec)
            out = self.fn(*a, **k)
        out_leaves, out_spec = ([out], None) if isinstance(out, torch.Tensor) else tree_flatten(out)
        where = [i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor)]
        if self.result is None:
            self.result = ([None if isinstance(x, torch.Tensor) else x for x in out_leaves], out_spec, where)
        elif out_spec != self.result[1] or where != self.result[2]:
            raise CheckpointError(
                f"torchckpt: Recompute(reentrant=True): the recomputation returned {out_spec}, the forward "
                f"{self.result[1]}; a block recomputed must return the same structure. Make the forward deterministic "
                "in what it returns, or use Recompute() (reentrant=False).")
        return tuple(out_leaves[i] for i in where)


def _leaves(roots: list[Any], stop: set[Any]) -> list[torch.Tensor]:
    """The tensors that ``roots``' graph accumulates into (the ``variable`` of each ``AccumulateGrad``), not walking
    past the nodes in ``stop``."""
    seen, stack, found = set(), list(roots), []
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            found.append(var)
            continue
        stack.extend(n for n, _ in node.next_functions)
    return found


class _Node(torch.autograd.Function):
    """NOTE [ Reentrant recompute ] Rules 1-3."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        outs = call.run(tensors[:call.n_args])
        ctx.call = call
        # the arguments through any saved-tensor hooks (NOTE [ Reentrant recompute ] Rule 5); the parameters are the
        # module's, read as they are
        ctx.save_for_backward(*tensors[:call.n_args])
        ctx.params = tensors[call.n_args:]
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        call: _Call = ctx.call
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[1:]
        if call.graphs is not None and not torch.is_grad_enabled():  # NOTE [ Graphed recompute ]
            got = call.graphs.backward(call, saved, ctx.params, grads, need)
            if got is not None:
                return (None, *got)
        return (None, *gradients(call, saved, ctx.params, grads, need))


def _inputs(saved: Sequence[torch.Tensor], graph: bool) -> tuple[torch.Tensor, ...]:
    """The saved inputs as the recomputation's inputs, each a leaf where plain autograd's was one and a view
    otherwise (NOTE [ Reentrant recompute ] Rules 7-8); with ``graph`` (``create_graph``) hanging off the saved
    tensors' own history, a leaf itself at its first use."""
    seen: set[int] = set()
    out = []
    for t in saved:
        if not t.requires_grad:
            out.append(t.detach())
        elif graph:
            out.append(t if t.is_leaf and id(t) not in seen else t.view_as(t))
        else:
            a = t.detach().requires_grad_(True)
            out.append(a if t.is_leaf else a.view_as(a))
        seen.add(id(t))
    return tuple(out)


def gradients(call: _Call, saved: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
              grads: Sequence[torch.Tensor | None], need: tuple[bool, ...], rng: bool = True) -> list[torch.Tensor | None]:
    """The gradients of the node's inputs (``saved``, the arguments' tensors, then ``params``) for the outputs'
    ``grads``, the block run again (NOTE [ Reentrant recompute ] Rules 3-4); ``None`` where ``need`` says none.
    ``rng=False`` leaves the RNG states as they are (a capture, NOTE [ Graphed recompute ] Rule 3)."""
    graph = torch.is_grad_enabled()  # a second order (NOTE [ Reentrant recompute ] Rule 7)
    with torch.enable_grad():  # a view made without grad would not carry it
        args = _inputs(saved, graph)
    with call.state.replayed(rng), torch.enable_grad():
        outs = call.run(args)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    inputs = args + tuple(params)
    wanted = [i for i, (t, w) in enumerate(zip(inputs, need)) if w and t.requires_grad]
    known = {id(t) for t in inputs}
    # the walk ends at the inputs (NOTE [ Reentrant recompute ] Rule 7's views)
    stop = {a.grad_fn for a in args if a.grad_fn is not None}
    stray = [t for t in _leaves([o.grad_fn for o, _ in pairs], stop) if t.requires_grad and id(t) not in known]
    if stray:
        shapes = ", ".join(str(tuple(t.shape)) for t in stray[:3])
        raise CheckpointError(
            f"torchckpt: Recompute(reentrant=True): the block uses {len(stray)} tensor(s) that need grad and are "
            f"neither its arguments nor its module's parameters (shapes {shapes}): they would get no gradient. "
            "Pass them as arguments, or use Recompute() (reentrant=False).")
    got: list[torch.Tensor | None] = [None] * len(inputs)
    if pairs and wanted:
        res = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted], [g for _, g in pairs],
                                  allow_unused=True, create_graph=torch.is_grad_enabled())
        for i, g in zip(wanted, res):
            got[i] = g
    return got


def _params(mod: nn.Module) -> list[nn.Parameter]:
    """``mod``'s parameters that require grad, each once, in ``mod.parameters()``'s order."""
    return [p for p in mod.parameters() if p.requires_grad]


def _module_of(fn: Callable[..., Any], module: nn.Module | None) -> nn.Module | None:
    """The block's module: ``module``, or the one ``fn`` is a bound method of or a partial binds first (transformers'
    checkpointing hook passes ``functools.partial(forward, layer, **kwargs)`` in 5.x, ``partial(layer.__call__,
    ...)`` before), or ``None``."""
    if module is not None:
        return module
    while isinstance(fn, functools.partial):
        if fn.args and isinstance(fn.args[0], nn.Module):
            return fn.args[0]
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def run_reentrant(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], preserve_rng_state: bool,
                  module: nn.Module | None = None, graphs: Callable[[nn.Module], Any] | None = None) -> tuple[bool, Any]:
    """``(True, fn(*args, **kwargs))`` run through one node (NOTE [ Reentrant recompute ]), or ``(False, None)`` where
    NOTE [ Reentrant recompute ] Rule 4 leaves the call to the non-reentrant frame (nothing ran). ``graphs``: the
    block's module to the graphs its backward may replay (NOTE [ Graphed recompute ]); a call with no module
    recomputes eagerly."""
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):  # the common call, module(x): no tree to walk
        leaves, spec = list(args), None
    else:
        leaves, spec = tree_flatten((args, kwargs))
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = [leaves[i] for i in at]
    mod = _module_of(fn, module)
    params = _params(mod) if mod is not None else []
    if not any(t.requires_grad for t in tensors) and not params:
        return False, None
    call = _Call(fn, leaves, spec, at, ForwardState(tensors, preserve_rng_state))
    if graphs is not None and mod is not None:
        call.graphs = graphs(mod)  # NOTE [ Graphed recompute ]: its backward may replay a CUDA graph
    outs = _Node.apply(call, *tensors, *params)
    assert call.result is not None
    out_leaves, out_spec, where = call.result
    if out_spec is None:  # a tensor
        return True, outs[0]
    vals = list(out_leaves)
    for i, t in zip(where, outs):
        vals[i] = t
    return True, tree_unflatten(vals, out_spec)
