"""What a loop step reads from outside the loop: found by a probe, so closures get their gradients.

# NOTE [ Captured tensors ]
# 1. Captured tensors. Every tensor from outside the loop that a step reads differentiably
#    must be an input of the Function, or autograd never sends it a gradient. They are found
#    by a probe: step 0 runs once under grad, on a detached copy of the initial state, inside
#    a ``TorchFunctionMode`` (``_Reads``) that records each tensor argument that requires grad
#    and that the step did not make (no seen call returned it; a non-leaf's ``grad_fn`` is
#    older than the probe). The mode yields tensor objects, non-leaf ones included, which
#    exactness needs: for ``w2 = w * 2`` computed before the loop, ``w2`` is the input (its
#    summed gradient flows into ``w`` once, as in plain autograd), not ``w`` (each step would
#    back-propagate through ``w * 2`` again, round differently and free its buffers). The mode
#    sees Python-level calls on its own thread only: the ops inside a custom Function's
#    ``forward`` but not ``Function.apply`` itself, nothing inside TorchScript or compiled
#    code. So the probe's autograd graph, which is what plain autograd differentiates, is then
#    walked from its outputs to where it leaves the step (``exits``): a leaf it reaches that
#    the mode missed is added; an edge into an older non-leaf that no found tensor owns raises
#    (there is no tensor to make an input of) unless it is an output, returned untouched.
#    Which nodes are the step's (``Age``): sequence numbers are per thread, so a node is the
#    step's when its number is at least the probe's first, or when it has an edge to a node or
#    state leaf that is the step's (a node made on a worker thread, or by autograd's CUDA
#    device thread in a ``create_graph`` backward, with that thread's smaller numbers). When
#    the step runs autograd itself (``autograd.grad``, ``backward``, ``torch.func``), a node
#    made by such a backward can have edges to found tensors only, so every node reached is
#    taken as the step's. ``params=`` adds to what is found and never restricts it (a
#    restriction would be a silent partial gradient). The probe's output is state 1, where
#    the forward sweep starts: the probe costs an extra step only when ``n_steps == 1``. The
#    step must be deterministic and free of side effects (the schedule re-runs it anyway).
# 2. A found tensor computed from another found tensor (a step reading both ``w`` and
#    ``w2 = w * 2``) would let ``autograd.grad`` reach ``w`` through ``w2``'s history as well
#    as directly, and the Function's gradient for ``w2`` would then reach ``w`` a second time.
#    While a step is recorded, such a tensor is swapped for a detached leaf alias (``Swap``,
#    a ``TorchFunctionMode``), so that every recorded graph ends at the Function's inputs; the
#    alias's gradient is returned as the tensor's. Tensors with no found ancestor are used as
#    they are (no mode on the hot path). The forward's recorded last step is walked as the
#    probe was: any edge out of it to something other than an input (a read that depends on
#    the state and that step 0 did not make, a swap the mode could not see) raises.
# 3. Known limits. Reads are found on the first step and checked on the first and the last
#    (two graph walks per loop; walking every recorded step would cost a few microseconds per
#    node on every step): a tensor that only steps in between read (control flow on the state)
#    gets no gradient; list it in ``params=``. Work a step does on another thread from outside
#    tensors alone cannot be told from a read and raises. The loop is one autograd node, so a
#    found tensor that is also used outside the loop receives the loop's gradient as one sum.
#    Plain autograd adds a use recorded before the loop after all the loop's uses: then the
#    result is bit-identical. A use recorded after the loop (a regularizer on ``w`` in the
#    loss) is added by plain autograd before the loop's uses; here it is added to their sum,
#    which can differ in the last bit (tests/adjoint/test_loop_params.py checks both).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch._C import _functorch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

from torchckpt._errors import CheckpointError


def check_structure(took: Any, returned: Any) -> None:
    if returned != took:
        raise CheckpointError(
            f"torchckpt: step must return a state of the same structure as it takes; took {took}, returned {returned}."
        )


def flat_state(spec: Any, x: list[torch.Tensor], y: Any) -> list[torch.Tensor]:
    """The step's output ``y`` flattened, checked against its input ``x`` (structure, shapes, dtypes)."""
    if type(y) is torch.Tensor and spec.is_leaf():  # a tensor is a leaf: tree_flatten's answer, without its walk
        flat = [y]
    else:
        flat, out_spec = tree_flatten(y)
        check_structure(spec, out_spec)
    for a, b in zip(x, flat):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            raise CheckpointError(
                "torchckpt: step must return a state of the same shapes and dtypes as it takes; took "
                f"{tuple(a.shape)} {a.dtype}, returned {tuple(getattr(b, 'shape', ()))} {getattr(b, 'dtype', type(b))}."
            )
    return flat


def grad_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.is_floating_point() or t.is_complex())


# -- captured tensors (NOTE [ Captured tensors ] Rules 1-2) ------------------------------------
def node_mark() -> int:
    """Sequence number of a node made now: nodes made later on this thread have larger ones."""
    with torch.enable_grad():
        t = torch.zeros((), requires_grad=True) * 1
    assert t.grad_fn is not None
    return int(t.grad_fn._sequence_nr())


_BACKWARDS = (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward)


class _Reads(TorchFunctionMode):
    """Records the tensors that calls read, that require grad and that the step did not make
    (NOTE [ Captured tensors ] Rule 1)."""

    def __init__(self, mark: int) -> None:
        super().__init__()
        self.mark = mark
        self.found: dict[int, torch.Tensor] = {}
        self.made: dict[int, weakref.ref[torch.Tensor]] = {}  # what the calls returned
        self.backward = False  # the step ran autograd itself (NOTE [ Captured tensors ] Rule 1: nodes of other threads)

    def made_here(self, t: torch.Tensor) -> bool:
        r = self.made.get(id(t))
        return r is not None and r() is t

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.backward = self.backward or func in _BACKWARDS
        for a in tree_leaves((args, kwargs)):
            if (isinstance(a, torch.Tensor) and a.requires_grad and id(a) not in self.found
                    and not self.made_here(a)
                    and not _functorch.is_functorch_wrapped_tensor(a)  # a transform's view, inside torch.func
                    and (a.grad_fn is None or a.grad_fn._sequence_nr() < self.mark)):  # else the step made it
                self.found[id(a)] = a
        out = func(*args, **kwargs)
        for o in tree_leaves(out):
            if isinstance(o, torch.Tensor):
                self.made[id(o)] = weakref.ref(o)
        return out


class Swap(TorchFunctionMode):
    """Passes each swapped tensor's alias in its place (NOTE [ Captured tensors ] Rule 2)."""

    def __init__(self, swaps: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.swaps = swaps

    def _swap(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            s = self.swaps.get(id(a))
            if s is not None and s[0] is a:
                return s[1]
        return a

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = tree_map(self._swap, (tuple(args), kwargs or {}))
        return func(*args, **kwargs)


def owned_nodes(tensors: Iterable[torch.Tensor]) -> dict[tuple[int, int], Any]:
    """The graph edges of the non-leaf ``tensors``, keyed by ``(id(grad_fn), output_nr)`` (holds the nodes)."""
    return {(id(t.grad_fn), t.output_nr): t.grad_fn for t in tensors if t.grad_fn is not None}


class Age:
    """Tells the autograd nodes made since ``mark`` (during the step) from older ones
    (NOTE [ Captured tensors ] Rule 1).

    On this thread a node's sequence number says it. A node made on another thread (autograd's
    device threads running a backward of the step's; the step's own workers) carries that
    thread's numbers: it was made during the step when it has an edge to something that was
    (such a node, or a leaf in ``fresh``, the step's input state).
    """

    def __init__(self, mark: int, fresh: Iterable[torch.Tensor]) -> None:
        self.mark = mark
        self.fresh = {id(t) for t in fresh}
        self.memo: dict[int, bool] = {}
        self.keep: dict[int, Any] = {}  # holds the nodes, so their ids stay theirs

    def new(self, root: Any) -> bool:
        memo = self.memo
        if id(root) not in memo and root._sequence_nr() >= self.mark:
            memo[id(root)], self.keep[id(root)] = True, root
        if id(root) in memo:
            return memo[id(root)]
        self.keep[id(root)] = root
        stack = [(root, iter(root.next_functions))]
        while stack:  # depth first, children before parents; stops at the first new one
            node, it = stack[-1]
            if not memo.get(id(node), False):
                for child, _ in it:
                    if child is None:
                        continue
                    v = getattr(child, "variable", None)
                    if v is not None:
                        if id(v) in self.fresh:
                            memo[id(node)] = True
                            break
                    elif id(child) in memo:
                        if memo[id(child)]:
                            memo[id(node)] = True
                            break
                    elif child._sequence_nr() >= self.mark:
                        memo[id(child)] = memo[id(node)] = True
                        self.keep[id(child)] = child
                        break
                    else:
                        self.keep[id(child)] = child
                        stack.append((child, iter(child.next_functions)))
                        break
                else:
                    memo[id(node)] = False
                if stack[-1][0] is not node:
                    continue
            stack.pop()
            if memo[id(node)] and stack:
                memo[id(stack[-1][0])] = True
        return memo[id(root)]


def exits(outputs: Sequence[torch.Tensor], stop: dict[tuple[int, int], Any], age: Age,
           through_old: bool) -> tuple[list[torch.Tensor], dict[tuple[int, int], Any], set[tuple[int, int]]]:
    """Where the autograd graph of ``outputs`` leaves the step (NOTE [ Captured tensors ] Rule 1).

    Walks the step's nodes (``age``; with ``through_old`` every node reached), stopping at the
    edges in ``stop``. Returns the leaves they reach (``AccumulateGrad``), their other edges
    (into older nodes; an output's own edge when its node is older), keyed like ``stop``, and
    the keys of the ``stop`` edges reached.
    """
    leaves: dict[int, torch.Tensor] = {}
    edges: dict[tuple[int, int], Any] = {}
    stopped: set[tuple[int, int]] = set()
    seen: dict[int, Any] = {}
    stack: list[Any] = []

    def visit(node: Any, nr: int) -> None:
        if node is None:
            return
        if (id(node), nr) in stop:
            stopped.add((id(node), nr))
            return
        v = getattr(node, "variable", None)
        if v is not None:
            leaves.setdefault(id(v), v)
        elif not (through_old or age.new(node)):
            edges.setdefault((id(node), nr), node)
        elif id(node) not in seen:
            seen[id(node)] = node
            stack.append(node)

    for t in outputs:
        if t.requires_grad:
            if t.grad_fn is None:
                leaves.setdefault(id(t), t)
            else:
                visit(t.grad_fn, t.output_nr)
    while stack:
        for node, nr in stack.pop().next_functions:
            visit(node, nr)
    return list(leaves.values()), edges, stopped


def unfound(node: Any, where: str) -> CheckpointError:
    return CheckpointError(
        f"torchckpt: {where} of checkpointed_loop reads a tensor that requires grad, computed outside the loop (its "
        f"grad_fn is {node.name()}), that checkpointed_loop could not find: it was read through code a "
        "TorchFunctionMode does not see (TorchScript, compiled code, Function.apply), or only on some steps. Pass it "
        "with params=[...], or compute it inside the step (NOTE [ Captured tensors ] Rule 1)."
    )


def probe(call: Callable[[list[torch.Tensor]], list[torch.Tensor]], flat: list[torch.Tensor],
           given: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
    """Run step 0 under grad to find the tensors it reads from outside the loop (NOTE [ Captured tensors ] Rule 1).

    ``call`` is step 0 on flat lists: its inputs (the state, and a scan's ``xs[0]``) to its outputs
    (the next state, and a scan's ``y``). Returns the tensors found (``given`` first, each once),
    the outputs (detached) and whether the step ran autograd itself.
    """
    xin = [t.detach().requires_grad_(t.requires_grad) for t in flat]
    mark = node_mark()
    reads = _Reads(mark)
    with torch.enable_grad(), reads:
        out = call(xin)
    age = Age(mark, xin)
    found: dict[int, torch.Tensor] = {}
    for t in [*given, *(t for t in reads.found.values() if t.grad_fn is None or not age.new(t.grad_fn))]:
        found.setdefault(id(t), t)
    state = {id(t) for t in xin}
    leaves, edges, _ = exits(out, owned_nodes(found.values()), age, reads.backward)
    for v in leaves:  # leaves read where the mode does not see (TorchScript, compiled code)
        if id(v) not in state and not reads.made_here(v):
            found.setdefault(id(v), v)
    for t in out:  # a tensor from outside returned as part of the state, untouched
        if t.grad_fn is not None and edges.pop((id(t.grad_fn), t.output_nr), None) is not None:
            found.setdefault(id(t), t)
    if edges:
        raise unfound(next(iter(edges.values())), "step 0")
    memo: dict[int, torch.Tensor] = {}  # one tensor in two places stays one (NOTE [ Checkpointed loop ] Rule 5)
    return list(found.values()), [memo.setdefault(id(t), t.detach()) for t in out], reads.backward


def descendants(found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The found non-leaf tensors computed from another found tensor (NOTE [ Captured tensors ] Rule 2)."""
    if len(found) < 2 or all(t.grad_fn is None for t in found):
        return []
    leaves = {id(t) for t in found if t.grad_fn is None}
    owned = owned_nodes(found)
    out = []
    for b in found:
        if b.grad_fn is None:
            continue
        seen = {id(b.grad_fn): b.grad_fn}
        stack, hit = [b.grad_fn], False
        while stack and not hit:
            for node, nr in stack.pop().next_functions:
                if node is None:
                    continue
                v = getattr(node, "variable", None)
                if (id(v) in leaves) if v is not None else ((id(node), nr) in owned):
                    hit = True
                    break
                if v is None and id(node) not in seen:
                    seen[id(node)] = node
                    stack.append(node)
        if hit:
            out.append(b)
    return out
