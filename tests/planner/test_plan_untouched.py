"""``plan`` and ``plans`` leave the model as they found it (NOTE [ Planning leaves no trace ], issue 22 item 2).

README's use, ``plan(model, batch, budget=...)``, ``plan.apply(model)``, then an ordinary training loop, trains the
weights the same loop trains without torchckpt, bit for bit: the planner's profiling and verification steps leave no
gradient in ``.grad``, no step in the batch-norm statistics and no draw in the RNG.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.planner import PlanError, plans

D = 32


class Blk(nn.Module):
    """Dropout (draws from the RNG) and, in every other block, batch norm (writes its statistics: a recomputation puts
    them back, NOTE [ Buffers written in a forward ]; every block may be recomputed, replaying the RNG)."""

    def __init__(self, bn: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(D, 2 * D), nn.Linear(2 * D, D), nn.Dropout(0.3)
        self.bn = nn.BatchNorm1d(2 * D) if bn else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.nn.functional.gelu(self.bn(self.fc1(x)))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), *[Blk(bn=k % 2 == 1) for k in range(6)], nn.Linear(D, 3))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _train(model: nn.Module, x: torch.Tensor, steps: int = 4) -> None:
    """The loop of any training script: forward, backward, step, zero_grad."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        _loss(model(x)).backward()
        opt.step()
        opt.zero_grad()


def _same_state(a: nn.Module, b: nn.Module) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), n
    for (n, x), y in zip(a.named_buffers(), b.buffers()):
        assert torch.equal(x, y), n


def _rng() -> list[torch.Tensor]:
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [])]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_plan_apply_then_training_equals_training_without_torchckpt(device: str) -> None:
    """README's use: plan, apply, then a training loop (SGD with momentum, batch norm, dropout): the weights, buffers
    and RNG states it ends with are those of the same loop without torchckpt, bit for bit. On CUDA the plan is also
    verified on the device (steps under candidate plans: NOTE [ Applying a plan ] Rule 4)."""
    base, x = _model().to(device), torch.randn(64, D, device=device)
    floor = plans(copy.deepcopy(base), x, budgets=[1 << 40], loss_fn=_loss)[1 << 40].floor_bytes
    plain, planned = copy.deepcopy(base), copy.deepcopy(base)

    torch.manual_seed(1)
    _train(plain, x)
    rng = _rng()

    torch.manual_seed(1)
    p = torchckpt.plan(planned, x, budget=floor if device == "cpu" else 1 << 30, loss_fn=_loss)
    if device == "cpu":  # at the floor: the blocks recomputed, batch norm's too, replaying dropout
        assert any(p.blocks[k].mode == "recompute" for k in (1, 3, 5))
    applied = p.apply(planned)
    try:
        _train(planned, x)
    finally:
        applied.remove()
    _same_state(plain, planned)
    assert all(torch.equal(a, b) for a, b in zip(_rng(), rng, strict=True))


def test_plan_puts_back_existing_gradients_training_flags_and_the_batch_gradient() -> None:
    model, x = _model(), torch.randn(64, D, requires_grad=True)
    _loss(model(x)).backward()  # gradients the user holds, to accumulate into later
    x.grad = None
    grads = {n: p.grad for n, p in model.named_parameters()}
    values = {n: g.clone() for n, g in grads.items()}
    model[0].weight.grad = None  # one parameter without a gradient
    model[2].eval()  # one block in eval mode
    bufs = {n: b.clone() for n, b in model.named_buffers()}
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    p = torchckpt.plan(model, x, budget=1 << 40, loss_fn=_loss)
    assert torch.equal(torch.get_rng_state(), rng)
    assert x.grad is None and model[0].weight.grad is None
    for n, q in model.named_parameters():
        if n != "0.weight":
            assert q.grad is grads[n] and torch.equal(q.grad, values[n]), n
    for n, b in model.named_buffers():
        assert torch.equal(b, bufs[n]), n
    assert model.training and not model[2].training and not model[2].bn.training and model[4].bn.training and model[1].training
    assert all(b.mode == "keep" for b in p.blocks)


def test_plans_and_a_failing_plan_leave_no_trace() -> None:
    model, x = _model(), torch.randn(64, D)
    before = copy.deepcopy(model)
    torch.manual_seed(9)
    rng = torch.get_rng_state()
    out = plans(model, x, budgets=[1, 1 << 40], loss_fn=_loss)
    assert list(out) == [1 << 40]
    with pytest.raises(PlanError):
        torchckpt.plan(model, x, budget=1, loss_fn=_loss)
    _same_state(before, model)
    assert torch.equal(torch.get_rng_state(), rng)


def test_untouched_warns_of_parameters_the_forward_writes() -> None:
    from torchckpt.planner.restore import untouched

    class Clamp(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.weight.clamp_(-0.1, 0.1)
            return super().forward(x)

    m = Clamp(4, 4)
    with pytest.warns(RuntimeWarning, match=r"^torchckpt: .*0?weight.* in place"):
        with untouched(m):
            m(torch.randn(2, 4)).sum().backward()
    assert m.weight.grad is None


def test_the_planners_steps_start_without_gradients_and_leave_the_users() -> None:
    """NOTE [ Profiling step ] Rule 4: each of the planner's steps starts with ``.grad`` set to None, as a loop's
    ``zero_grad()`` leaves it, so the gradients a step allocates are in its peak; the user's gradients come back."""
    model, x = _model(), torch.randn(64, D)
    _loss(model(x)).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    seen: list[bool] = []
    h = model[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.grad is None))
    try:
        plans(model, x, budgets=[1 << 40], loss_fn=_loss)
    finally:
        h.remove()
    assert len(seen) >= 3 and all(seen)
    assert all(p.grad is grads[n] for n, p in model.named_parameters())
