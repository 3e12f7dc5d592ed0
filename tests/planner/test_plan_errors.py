"""Bad arguments to the planner's entry points are errors at the call, naming it (issue 22 item 4, STYLE.md 6).

``plan``, ``plans``, ``auto`` and ``Plan.apply`` check what they are given before profiling anything; a batch the
model rejects in the profiling step is a ``torchckpt:`` error naming the call, chained to the model's own exception
(NOTE [ Profiling step ] Rule 8). ``checkpoint_chain``'s and ``offload``'s checks are in tests/test_errors.py.
"""
from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.planner import Link, plans

D = 16


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList([Blk() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.h:
            x = b(x)
        return x


class Causal(nn.Module):
    """Takes keyword arguments, as transformers' models do, and reads its labels."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return (self.net(input_ids) - labels).square().mean()


class Dicts(nn.Module):
    """Takes one dict, as some training loops hand their batch, and reads keys from it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (self.net(batch["x"]) - batch["y"]).square().mean()


def _x() -> torch.Tensor:
    return torch.randn(8, D)


def _plan(*args: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("budget", 1 << 30)
    return torchckpt.plan(*args, **kwargs)


def _plans(*args: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("budgets", [1 << 30])
    return plans(*args, **kwargs)


ENTRY = [pytest.param(_plan, "plan", id="plan"), pytest.param(_plans, "plans", id="plans")]


@pytest.mark.parametrize("call,name", ENTRY)
@pytest.mark.parametrize("model,found", [
    (torch.tanh, r"the function tanh"),
    (lambda x: x, r"the function <lambda>"),
    (Net, r"the class Net; pass an instance, e\.g\. Net\(\.\.\.\)"),
    ("gpt2", r"str 'gpt2'"),
])
def test_the_model_must_be_a_module(call: Any, name: str, model: object, found: str) -> None:
    with pytest.raises(TypeError, match=rf"^torchckpt: {name}\(model, \.\.\.\) expects an nn\.Module, got {found}"):
        call(model, _x())


def test_auto_and_apply_check_the_model() -> None:
    with pytest.raises(TypeError, match=r"^torchckpt: auto\(model, \.\.\.\) expects an nn\.Module, got the function tanh"):
        torchckpt.auto(torch.tanh, budget=1 << 30)  # type: ignore[arg-type]
    p = _plan(Net(), _x())
    with pytest.raises(TypeError, match=r"^torchckpt: Plan\.apply\(model, \.\.\.\) expects an nn\.Module, got the "
                       r"function tanh; pass the model this plan was made for"):
        p.apply(torch.tanh)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^torchckpt: Plan\.apply\(store=\.\.\.\) expects a torchckpt\.Store or None, "
                       r"got str 'cpu'; pass None"):
        p.apply(Net(), store="cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^torchckpt: Plan\.apply\(codec=\.\.\.\) expects a torchckpt\.codecs\.Codec"):
        p.apply(Net(), codec="q4")  # type: ignore[arg-type]


@pytest.mark.parametrize("call,name", ENTRY)
def test_a_missing_batch_is_named_at_the_call(call: Any, name: str) -> None:
    with pytest.raises(TypeError, match=rf"^torchckpt: {name}\(model, \*batch, \.\.\.\) calls Net\.forward\(x\) with "
                       r"no batch, which does not fit it \(missing a required argument: 'x'\); pass an example batch"):
        call(Net())
    with pytest.raises(TypeError, match=r"calls Net\.forward\(x\) with the batch \(a Tensor of shape \(8, 16\); "
                       r"a Tensor of shape \(8, 16\)\), which does not fit it \(too many positional arguments\)"):
        call(Net(), _x(), _x())


@pytest.mark.parametrize("call,name", ENTRY)
def test_a_dict_batch_of_keyword_arguments_says_pass_star_star_batch(call: Any, name: str) -> None:
    batch = {"input_ids": _x(), "labels": _x()}
    with pytest.raises(TypeError, match=rf"^torchckpt: {name}\(model, batch, \.\.\.\) got one dict whose keys \(input_ids, "
                       rf"labels\) are arguments of Causal\.forward\(input_ids, labels=None\); pass them as keyword "
                       rf"arguments, as the model is called: {name}\(model, \*\*batch, \.\.\.\)"):
        call(Causal(), batch)
    call(Causal(), **batch)  # as the error says


def test_a_model_that_takes_a_dict_still_gets_it() -> None:
    p = _plan(Dicts(), {"x": _x(), "y": _x()})
    assert len(p.blocks) == 3


@pytest.mark.parametrize("call,name", ENTRY)
@pytest.mark.parametrize("model,args,kwargs,error,message,fix", [
    (Net, (torch.randn(8, D + 1),), {}, RuntimeError, r"mat1 and mat2 shapes cannot be multiplied",
     r"pass an example batch the model takes"),
    (Dicts, ({"x": torch.randn(8, D)},), {}, KeyError, r"'y'", r"the batch is one dict: if its keys are the model's "
     r"arguments"),
    (Causal, (), {"input_ids": torch.randn(8, D)}, TypeError, r"unsupported operand", r"pass an example batch"),
])
def test_a_batch_the_model_rejects_is_named_and_chained(call: Any, name: str, model: type, args: tuple, kwargs: dict,
                                                        error: type, message: str, fix: str) -> None:
    with pytest.raises(torchckpt.CheckpointError, match=rf"^torchckpt: {name}\(model, \.\.\.\) profiles a training step "
                       rf"of {model.__name__} on the batch \(.*\), and the model's forward raised {error.__name__}: "
                       rf"{message}.*; {fix}") as got:
        call(model(), *args, **kwargs)
    cause = got.value.__cause__
    assert isinstance(cause, error)  # the model's own exception, with its traceback
    frames = [f.name for f in traceback.extract_tb(cause.__traceback__)]
    assert "forward" in frames


def test_a_loss_fn_that_raises_is_named_and_chained() -> None:
    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.loss  # type: ignore[attr-defined]

    with pytest.raises(torchckpt.CheckpointError, match=r"^torchckpt: plan\(model, \.\.\.\) profiles .* the loss of the "
                       r"model's output raised AttributeError: .*; pass loss_fn=\.\.\.") as got:
        _plan(Net(), _x(), loss_fn=loss_fn)
    assert isinstance(got.value.__cause__, AttributeError)
    with pytest.raises(torchckpt.CheckpointError, match=r"^torchckpt: plan\(model, \.\.\.\) profiles .* the backward of "
                       r"the loss raised RuntimeError: grad can be implicitly created only for scalar outputs; "
                       r"planning runs plain training steps") as got:
        _plan(Net(), _x(), loss_fn=lambda out: out.sum(0))
    assert isinstance(got.value.__cause__, RuntimeError)


def test_the_model_state_is_put_back_after_a_rejected_batch() -> None:
    m = Net()
    with pytest.raises(torchckpt.CheckpointError):
        _plan(m, torch.randn(8, D + 1))
    assert all(p.grad is None for p in m.parameters()) and all("forward" not in b.__dict__ for b in m.h)
    _plan(m, _x())  # the same model plans once given a batch it takes


@pytest.mark.parametrize("kw,exc,match", [
    ({"codec": "q4"}, TypeError, r"\(codec=\.\.\.\) expects a torchckpt\.codecs\.Codec or None, got str 'q4'; pass e\.g\."),
    ({"blocks": nn.Linear(2, 2)}, TypeError, r"\(blocks=\.\.\.\) expects a list of the model's blocks .*got the module "
     r"Linear; pass e\.g\. blocks=list\(model\.layers\)"),
    ({"blocks": []}, ValueError, r"\(blocks=\.\.\.\) got no blocks"),
    ({"blocks": [nn.Linear(2, 2)]}, ValueError, r"\(blocks=\.\.\.\) must be submodules of the model, in forward order; "
     r"item 0, the module Linear, is not one"),
    ({"loss_fn": "mean"}, TypeError, r"\(loss_fn=\.\.\.\) expects a function of the model's output returning a scalar "
     r"loss, or None, got str 'mean'; pass e\.g\. loss_fn=lambda out: out\.loss"),
    ({"link": 25e9}, TypeError, r"\(link=\.\.\.\) expects a torchckpt\.planner\.Link or None \(measured\), got float"),
    ({"verify": "no"}, TypeError, r"\(verify=\.\.\.\) expects True or False, got 'no'"),
    ({"progress": 1}, TypeError, r"\(progress=\.\.\.\) expects True or False, got 1"),
])
@pytest.mark.parametrize("call,name", ENTRY)
def test_keyword_arguments_are_checked_at_the_call(call: Any, name: str, kw: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=rf"^torchckpt: {name}" + match):
        call(Net(), _x(), **kw)


def test_blocks_given_twice_and_a_link_are_checked() -> None:
    m = Net()
    with pytest.raises(ValueError, match=r"^torchckpt: plan\(blocks=\.\.\.\) got a module twice"):
        _plan(m, _x(), blocks=[m.h[0], m.h[0]])
    assert len(_plan(m, _x(), blocks=list(m.h), link=Link(d2h=1e10, h2d=1e10)).blocks) == 3


@pytest.mark.parametrize("kw,exc,match", [
    ({"codec": "q4"}, TypeError, r"auto\(codec=\.\.\.\) expects a torchckpt\.codecs\.Codec"),
    ({"blocks": [nn.Linear(2, 2)]}, ValueError, r"auto\(blocks=\.\.\.\) must be submodules of the model"),
    ({"loss_fn": 3}, TypeError, r"auto\(loss_fn=\.\.\.\) expects a function"),
    ({"verify": "yes"}, TypeError, r"auto\(verify=\.\.\.\) expects True or False"),
])
def test_auto_checks_at_its_call_not_at_the_first_step(kw: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match="^torchckpt: " + match):
        torchckpt.auto(Net(), budget=1 << 30, **kw)


@pytest.mark.parametrize("budgets", ["1GiB", 1 << 30, []])
def test_plans_budgets_must_be_a_list(budgets: object) -> None:
    with pytest.raises(TypeError, match=r"^torchckpt: plans\(budgets=\.\.\.\) expects a non-empty list of byte counts, "
                       r"got .*; pass e\.g\. budgets=\['2GiB', '4GiB'\]"):
        plans(Net(), _x(), budgets=budgets)  # type: ignore[arg-type]
