"""checkpointed_loop finds the tensors a step reads from outside the loop (NOTE [ Captured tensors ]).

Every case runs the same step twice from identical fresh tensors: as a plain unrolled loop and
through ``checkpointed_loop`` with no ``params=``; outputs and gradients must be equal bit for bit.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ckpt_models import small_pool
from torchckpt import CheckpointError, Store, checkpointed_loop
from torchckpt.schedules import Multistage, Revolve, Schedule, Tier, ZCut

D = torch.float64
Case = tuple[Callable[[Any], Any], Any, Callable[[Any], torch.Tensor], list[torch.Tensor]]


def schedules(n: int) -> list[Schedule]:
    return [Revolve(n, min(3, n), tier=Tier.HOST), Revolve(n, n), ZCut(n, tier=Tier.HOST),
            Multistage(n, gpu_slots=1, host_slots=2)]


def grads(loss: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return list(torch.autograd.grad(loss, leaves, allow_unused=True))


def assert_equal(a: Any, b: Any) -> None:
    fa, fb = tree_flatten(a)[0], tree_flatten(b)[0]
    assert len(fa) == len(fb)
    for i, (x, y) in enumerate(zip(fa, fb)):
        if x is None or y is None:
            assert x is None and y is None, f"{i}: {x} vs {y}"
            continue
        assert torch.equal(x.detach(), y.detach()), f"{i}: max abs diff {(x - y).abs().max().item()}"


def check(make: Callable[[], Case], n: int, **kw: Any) -> None:
    """``make()`` builds (step, state, loss, leaves) from a fixed seed: plain and checkpointed agree exactly."""
    step, state, loss, leaves = make()
    for _ in range(n):
        state = step(state)
    ref, g_ref = state, grads(loss(state), leaves)
    assert any(g is not None for g in g_ref)
    for sched in schedules(n):
        step, state, loss, leaves = make()
        out = checkpointed_loop(step, state, n, schedule=sched, store=Store("cpu", host=small_pool()), slots=2, **kw)
        assert_equal(out, ref)
        assert_equal(grads(loss(out), leaves), g_ref)


def sq(x: torch.Tensor) -> torch.Tensor:
    return (x**2).sum()


# -- closures ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 9])
def test_closure_over_leaf_weight(n: int) -> None:
    def make() -> Case:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        x0 = torch.randn(6, dtype=D, requires_grad=True)
        return (lambda x: torch.sin(w * x) + 0.1 * x), x0, sq, [x0, w]

    check(make, n)


@pytest.mark.parametrize("n", [1, 9])
def test_closure_over_leaf_weight_only(n: int) -> None:
    """The state needs no gradient, only the captured weight does: the loop is still differentiable."""

    def make() -> Case:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        return (lambda x: torch.sin(w * x) + 0.1 * x), torch.randn(6, dtype=D), sq, [w]

    check(make, n)


@pytest.mark.parametrize("n", [2, 9])
def test_closure_over_module_parameters(n: int) -> None:
    """A lambda calling an nn.Module: its parameters reach the step through F.linear."""

    def make() -> Case:
        torch.manual_seed(1)
        m = nn.Sequential(nn.Linear(5, 5, dtype=D), nn.Tanh(), nn.Linear(5, 5, dtype=D))
        x0 = torch.randn(3, 5, dtype=D, requires_grad=True)
        return (lambda x: x + 0.1 * m(x)), x0, sq, [x0, *m.parameters()]

    check(make, n)


@pytest.mark.parametrize("n", [1, 9])
def test_closure_over_derived_non_leaf(n: int) -> None:
    """``w2 = f(w)`` computed before the loop: the loop's gradient of w2 flows on into w once."""

    def make() -> Case:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        w2 = w.exp() * 0.3
        x0 = torch.randn(6, dtype=D, requires_grad=True)
        return (lambda x: torch.sin(w2 * x) + 0.1 * x), x0, sq, [x0, w]

    check(make, n)


@pytest.mark.parametrize("n", [2, 9])
def test_closure_over_weight_and_tensor_derived_from_it(n: int) -> None:
    """NOTE [ Captured tensors ] Rule 2: a step reading w and w2 = f(w): w2 is swapped for an alias, w's gradient is not
    counted twice."""

    def make() -> Case:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        w2 = w.exp() * 0.3
        v = torch.randn(6, dtype=D, requires_grad=True)
        v2, v3 = (v * 2).unbind(0)[:2]  # two outputs of one node, from another leaf
        x0 = torch.randn(6, dtype=D, requires_grad=True)
        return (lambda x: torch.sin(w2 * x) + w * x * 0.1 + v2 * v3 * x), x0, sq, [x0, w, v]

    check(make, n)


def test_derived_tensor_with_scalar_backward_not_counted_twice() -> None:
    """``w * 2`` saves no tensor: reaching w through it twice would raise nothing, only double w's gradient."""
    w = torch.tensor([0.5, 0.25], dtype=D, requires_grad=True)
    w2 = w * 2

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * w2 + w

    out = checkpointed_loop(step, torch.ones(2, dtype=D), 3, schedule=Revolve(3, 2), store=Store("cpu"))
    (g,) = torch.autograd.grad(out.sum(), w)
    # x3 = x0 * w2**3 + w * (w2**2 + w2 + 1), w2 = 2w: d/dw = 24 w**2 + 12 w**2 + 4 w + 1 = 36 w**2 + 4 w + 1
    assert torch.equal(g, 36 * w.detach() ** 2 + 4 * w.detach() + 1)


def test_captured_tensor_without_grad_is_ignored() -> None:
    def make() -> Case:
        torch.manual_seed(1)
        c = torch.randn(6, dtype=D)  # needs no gradient
        w = torch.randn(6, dtype=D, requires_grad=True)
        x0 = torch.randn(6, dtype=D, requires_grad=True)
        return (lambda x: torch.sin(w * x) * c), x0, sq, [x0, w]

    check(make, 9)


def test_nothing_needs_grad_gives_a_plain_result() -> None:
    """Neither the state nor what the step reads needs grad: no snapshots, no graph, as a plain loop."""
    c = torch.randn(6, dtype=D)
    calls = []

    def step(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.sin(c * x)

    x0 = torch.randn(6, dtype=D)
    ref = x0
    for _ in range(7):
        ref = torch.sin(c * ref)
    out = checkpointed_loop(step, x0, 7, store=Store("cpu"))
    assert torch.equal(out, ref) and not out.requires_grad and len(calls) == 7


class Scale(torch.autograd.Function):
    """x * w with a hand-written backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g * w, g * x


@pytest.mark.parametrize("derived", [False, True])
def test_custom_function_with_captured_weight(derived: bool) -> None:
    """``Function.apply`` is not seen by a TorchFunctionMode: its weight is found inside forward or by the graph."""

    def make() -> Case:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        wu = w * 1.5 if derived else w
        x0 = torch.randn(6, dtype=D, requires_grad=True)
        return (lambda x: torch.sin(Scale.apply(x, wu)) + 0.1 * x), x0, sq, [x0, w]

    check(make, 9)


def test_custom_function_of_derived_tensor_and_its_leaf() -> None:
    """NOTE [ Captured tensors ] Rule 2's swap cannot reach into Function.apply: it raises at the call; a torch op first fixes it.

    (Without the check, the first backward raises autograd's "backward through the graph a second time".)
    """

    def make(fixed: bool) -> Case:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        w2 = w * 1.5
        x0 = torch.randn(6, dtype=D, requires_grad=True)

        def step(x: torch.Tensor) -> torch.Tensor:
            return torch.sin(Scale.apply(x, w2.view_as(w2) if fixed else w2)) + w * 0.01

        return step, x0, sq, [x0, w]

    step, x0, _, _ = make(False)
    with pytest.raises(CheckpointError, match="^torchckpt: .*cannot be cut"):
        checkpointed_loop(step, x0, 5, schedule=Revolve(5, 2), store=Store("cpu"))
    check(lambda: make(True), 5)


def test_torch_func_transform_inside_step() -> None:
    """A step taking a gradient with torch.func.grad: its wrapped tensors are not taken for captured ones."""

    def make() -> Case:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        x0 = torch.randn(6, dtype=D, requires_grad=True)
        return (lambda x: x - 0.1 * torch.func.grad(lambda r: torch.sin(w * r).sum())(x)), x0, sq, [x0, w]

    check(make, 6)


def test_step_running_autograd_itself() -> None:
    """A step computing a force as a gradient (create_graph=True): its second-order nodes are the step's own.

    (On CUDA autograd makes them on its device thread, with that thread's sequence numbers:
    NOTE [ Captured tensors ] Rule 1.)
    """

    def make() -> Case:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        w2 = w.exp()
        x0 = torch.randn(6, dtype=D, requires_grad=True)

        def step(x: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                q = x if x.requires_grad else x.detach().requires_grad_()
                (f,) = torch.autograd.grad((torch.sin(w * q) * q).sum() + (w2 * q).sum(), q, create_graph=True)
            return x - 0.1 * f

        return step, x0, sq, [x0, w]

    check(make, 6)


def test_step_computing_on_another_thread() -> None:
    """Nodes made on a worker thread carry that thread's sequence numbers: they are the step's by their edges."""
    pool = ThreadPoolExecutor(1)
    for _ in range(200):  # this thread's sequence numbers run ahead of the worker's
        torch.ones(1, requires_grad=True) * 2

    def make() -> Case:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        x0 = torch.randn(6, dtype=D, requires_grad=True)
        return (lambda x: pool.submit(lambda: torch.sin(w * x)).result() + 0.1 * x), x0, sq, [x0, w]

    check(make, 6)
    pool.shutdown()


def scripted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sin(w * x)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_torchscript_leaf_found_from_the_graph() -> None:
    fn = torch.jit.script(scripted)

    def make() -> Case:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        x0 = torch.randn(6, dtype=D, requires_grad=True)
        return (lambda x: fn(x, w)), x0, sq, [x0, w]

    check(make, 6)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_torchscript_non_leaf_raises_then_params_works() -> None:
    """A non-leaf read where the mode cannot see it has no tensor to make an input of: raise, naming params=."""
    fn = torch.jit.script(scripted)

    def make() -> Case:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        w2 = w * 2
        x0 = torch.randn(6, dtype=D, requires_grad=True)
        return (lambda x: fn(x, w2)), x0, sq, [x0, w, w2]

    step, x0, _, _ = make()
    with pytest.raises(CheckpointError, match="^torchckpt: step 0 .*params="):
        checkpointed_loop(step, x0, 4, schedule=Revolve(4, 2), store=Store("cpu"))
    step, x0, loss, (x0, w, w2) = make()
    ref = x0
    for _ in range(4):
        ref = step(ref)
    g_ref = grads(loss(ref), [x0, w])
    step, x0, loss, (x0, w, w2) = make()
    out = checkpointed_loop(step, x0, 4, schedule=Revolve(4, 2), store=Store("cpu"), params=[w2])
    assert_equal(grads(loss(out), [x0, w]), g_ref)


def test_read_only_on_the_last_step_raises() -> None:
    """NOTE [ Captured tensors ] Rule 2: the last step's graph is checked too: a read that step 0 did not make raises."""
    w = torch.randn(4, dtype=D, requires_grad=True)
    v = torch.randn(4, dtype=D, requires_grad=True)

    def step(s: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, t = s
        return torch.sin(w * x) + (v if int(t) >= 4 else 0), t + 1

    with pytest.raises(CheckpointError, match="^torchckpt: the last step .*params="):
        checkpointed_loop(step, (torch.ones(4, dtype=D), torch.tensor(0)), 5, schedule=Revolve(5, 2),
                          store=Store("cpu"))
    out = checkpointed_loop(step, (torch.ones(4, dtype=D), torch.tensor(0)), 5, schedule=Revolve(5, 2),
                            store=Store("cpu"), params=[v])
    (gv,) = torch.autograd.grad(out[0].sum(), v)
    assert torch.equal(gv, torch.ones(4, dtype=D))


# -- also used outside the loop ---------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 9])
def test_param_also_used_before_the_loop(n: int) -> None:
    """A use recorded before the loop: plain autograd adds it after the loop's uses, as the loop does
    (NOTE [ Captured tensors ] Rule 3)."""

    def make() -> Case:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        reg = (w.cos() ** 2).sum()
        x0 = torch.randn(6, dtype=D, requires_grad=True)
        return (lambda x: torch.sin(w * x) + 0.1 * x), x0, (lambda x: sq(x) + reg), [x0, w]

    check(make, n)


def test_param_also_used_after_the_loop_sum_is_complete() -> None:
    """A use recorded after the loop: the sum is complete, and may differ from plain autograd's in the last bit."""

    def make() -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor]:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        return (lambda x: torch.sin(w * x) + 0.1 * x), torch.randn(6, dtype=D, requires_grad=True), w

    step, x, w = make()
    for _ in range(9):
        x = step(x)
    (g_ref,) = torch.autograd.grad(sq(x) + (w.cos() ** 2).sum(), w)
    (g_out,) = torch.autograd.grad((w.cos() ** 2).sum(), w)
    step, x0, w = make()
    out = checkpointed_loop(step, x0, 9, schedule=Revolve(9, 3, tier=Tier.HOST), store=Store("cpu", host=small_pool()))
    (g,) = torch.autograd.grad(sq(out) + (w.cos() ** 2).sum(), w)
    torch.testing.assert_close(g, g_ref, rtol=1e-14, atol=1e-15)
    assert not torch.allclose(g_out, g_ref, rtol=1e-6, atol=0)  # without the loop's part it would fail


# -- params= and nn.Module steps ----------------------------------------------------------------
def test_explicit_params_are_extended_by_what_is_found() -> None:
    """params=[w] given, the step also reads v: v gets its gradient too (never a silent partial one)."""

    def make() -> Case:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        v = torch.randn(6, dtype=D, requires_grad=True)
        x0 = torch.randn(6, dtype=D, requires_grad=True)
        return (lambda x: torch.sin(w * x) + v * 0.1), x0, sq, [x0, w, v]

    step, x0, loss, leaves = make()
    ref = x0
    for _ in range(7):
        ref = step(ref)
    g_ref = grads(loss(ref), leaves)
    step, x0, loss, leaves = make()
    out = checkpointed_loop(step, x0, 7, schedule=Revolve(7, 2), store=Store("cpu"), params=[leaves[1]])
    assert_equal(grads(loss(out), leaves), g_ref)


def test_explicit_leaf_param_with_derived_tensor_read() -> None:
    """params=[w] while the step reads only w2 = f(w): w's gradient arrives once, through w2."""

    def make() -> Case:
        torch.manual_seed(1)
        w = torch.randn(6, dtype=D, requires_grad=True)
        w2 = w.exp()
        x0 = torch.randn(6, dtype=D, requires_grad=True)
        return (lambda x: torch.sin(w2 * x)), x0, sq, [x0, w]

    step, x0, loss, leaves = make()
    ref = x0
    for _ in range(7):
        ref = step(ref)
    g_ref = grads(loss(ref), leaves)
    step, x0, loss, leaves = make()
    out = checkpointed_loop(step, x0, 7, schedule=Revolve(7, 2), store=Store("cpu"), params=[leaves[1]])
    assert_equal(grads(loss(out), leaves), g_ref)


class Forced(nn.Module):
    """A module step that also reads a tensor held outside it (a forcing term)."""

    def __init__(self, forcing: torch.Tensor) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=D)
        self.forcing = [forcing]  # not a parameter, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + self.forcing[0]


def test_module_step_reading_an_outside_tensor() -> None:
    def make() -> Case:
        torch.manual_seed(1)
        f = torch.randn(4, dtype=D, requires_grad=True)
        m = Forced(f)
        x0 = torch.randn(2, 4, dtype=D, requires_grad=True)
        return m, x0, sq, [x0, f, *m.parameters()]

    check(make, 6)


# -- state structures ---------------------------------------------------------------------------
def test_tuple_state_with_closure() -> None:
    def make() -> Case:
        torch.manual_seed(1)
        c = torch.rand(5, dtype=D, requires_grad=True)
        u0 = torch.randn(5, dtype=D, requires_grad=True)

        def step(s: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            u, up = s
            return 2 * u - up + c * (torch.roll(u, 1) + torch.roll(u, -1) - 2 * u) * 0.1, u

        return step, (u0, torch.zeros(5, dtype=D)), (lambda s: sq(s[0])), [u0, c]

    check(make, 8)


def test_dict_state_with_closure() -> None:
    def make() -> Case:
        torch.manual_seed(1)
        w = torch.randn(5, dtype=D, requires_grad=True)
        a0 = torch.randn(5, dtype=D, requires_grad=True)

        def step(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {"a": torch.sin(w * s["a"]) + 0.1 * s["b"], "b": s["a"] * w, "t": s["t"] + 1}

        state = {"a": a0, "b": torch.zeros(5, dtype=D), "t": torch.tensor(0)}
        return step, state, (lambda s: sq(s["a"]) + s["b"].sum()), [a0, w]

    check(make, 8)


# -- cost ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 6])
def test_probe_is_the_first_step(n: int) -> None:
    """NOTE [ Checkpointed loop ] Rule 3: the forward sweep starts from the probe's output: n step calls before backward
    (2 when n == 1)."""
    w = torch.randn(3, dtype=D, requires_grad=True)
    calls = []

    def step(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.sin(w * x)

    out = checkpointed_loop(step, torch.ones(3, dtype=D), n, schedule=Revolve(n, n), store=Store("cpu"))
    assert len(calls) == max(n, 2)
    out.sum().backward()
    assert w.grad is not None


def test_no_probe_without_grad() -> None:
    w = torch.randn(3, dtype=D, requires_grad=True)
    calls = []

    def step(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.sin(w * x)

    with torch.no_grad():
        out = checkpointed_loop(step, torch.ones(3, dtype=D), 5, store=Store("cpu"))
    assert len(calls) == 5 and not out.requires_grad


# -- grad-mode-dependent kernels (NOTE [ Checkpointed loop ] Rule 2) -----------------------------------
@pytest.mark.parametrize("kind", ["encoder_layer", "mha"])
def test_eval_fast_paths_match_the_plain_loop(kind: str) -> None:
    """In eval mode and under no_grad, nn.TransformerEncoderLayer and nn.MultiheadAttention take a
    fused fast path whose values differ from the path plain autograd runs: steps that are not
    recorded must still run under grad (this failed when they ran under no_grad)."""
    torch.manual_seed(0)
    if kind == "encoder_layer":
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()

        def step(x: torch.Tensor) -> torch.Tensor:
            return x + 0.1 * layer(x)
    else:
        layer = nn.MultiheadAttention(32, 4, batch_first=True).eval()

        def step(x: torch.Tensor) -> torch.Tensor:
            return x + 0.1 * layer(x, x, x, need_weights=False)[0]

    x0 = torch.randn(2, 8, 32, requires_grad=True)
    wrt = [x0, *layer.parameters()]
    x = x0
    for _ in range(6):
        x = step(x)
    ref = torch.autograd.grad(x.square().sum(), wrt)
    y = checkpointed_loop(step, x0, 6, schedule=Revolve(6, 2), store=Store("cpu", min_bytes=0))
    got = torch.autograd.grad(y.square().sum(), wrt)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
