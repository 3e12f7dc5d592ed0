"""Bad input: every user error is a TypeError/ValueError/CheckpointError starting with 'torchckpt:'."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchckpt
from ckpt_models import MLP, assert_same_grads, clone, cpu_store, step
from torchckpt import Keep, Offload, Recompute


def f(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@pytest.mark.parametrize("bad", ["offload", 3, Offload, object()])
def test_unknown_policy_call_form(bad: object) -> None:
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(TypeError, match="^torchckpt:"):
        torchckpt.checkpoint(f, x, policy=bad)


@pytest.mark.parametrize("bad", ["offload", 3])
def test_unknown_policy_instance_and_class(bad: object) -> None:
    with pytest.raises(TypeError, match="^torchckpt:"):
        torchckpt.checkpoint(nn.Linear(2, 2), policy=bad)
    with pytest.raises(TypeError, match="^torchckpt:"):
        torchckpt.checkpoint(type("M", (nn.Module,), {}), policy=bad)


@pytest.mark.parametrize("bad", ["offload", 3, None])
def test_unknown_policy_run(bad: object) -> None:
    with pytest.raises(TypeError, match="^torchckpt:"):
        torchckpt.run(bad, f, torch.randn(4, requires_grad=True))


@pytest.mark.parametrize("target", ["offload", 3])
def test_checkpoint_of_non_callable(target: object) -> None:
    with pytest.raises(TypeError, match="^torchckpt:"):
        torchckpt.checkpoint(target)


def test_decorating_a_non_module_class() -> None:
    with pytest.raises(TypeError, match="^torchckpt:"):
        torchckpt.checkpoint(Recompute())(type("NotAModule", (), {}))


def test_policy_decorator_takes_no_call_arguments() -> None:
    with pytest.raises(TypeError, match="^torchckpt:"):
        torchckpt.checkpoint(Recompute(), torch.randn(2))


@pytest.mark.parametrize("bad", ["x", 0, torch.device("cpu")])
def test_offload_store_type(bad: object) -> None:
    with pytest.raises(TypeError, match="^torchckpt:"):
        Offload(store=bad)
    with pytest.raises(TypeError, match="^torchckpt:"):
        Recompute(store=bad)
    with pytest.raises(TypeError, match="^torchckpt:"):
        torchckpt.offload(bad)


@pytest.mark.parametrize("kw", [{"gpu_bytes": -1}, {"min_bytes": -1}])
def test_negative_budget(kw: dict) -> None:
    with pytest.raises(ValueError, match="^torchckpt:"):
        torchckpt.Store(device="cpu", host=torchckpt.HostPool(chunk_bytes=1 << 20, pin=False), **kw)


def test_gpu_cache_negative_budget() -> None:
    with pytest.raises(ValueError, match="^torchckpt:"):
        torchckpt.GpuCache(-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_store_without_cuda(device: object) -> None:
    with pytest.raises(ValueError, match="^torchckpt:"):
        torchckpt.Store(device=device)


def test_unsupported_store_device() -> None:
    with pytest.raises(ValueError, match="^torchckpt:"):
        torchckpt.Store(device="meta")


def test_determinism_check_value() -> None:
    with pytest.raises(ValueError, match="^torchckpt:"):
        Recompute(determinism_check="bogus")
    Recompute(determinism_check="none")  # valid


def test_policies_are_frozen_values() -> None:
    r = Recompute()
    with pytest.raises(Exception):
        r.preserve_rng_state = False  # type: ignore[misc]
    assert isinstance(Keep(), torchckpt.Keep)


@pytest.mark.parametrize("budget", [0, 1, 255])
def test_budget_smaller_than_one_tensor_is_exact(budget: int) -> None:
    # Documented fallback: an entry larger than the budget goes to host and is loaded on demand.
    model, x = MLP(d_in=64, d=64, d_out=64, depth=3), torch.randn(8, 64)
    plain = clone(model)
    s = cpu_store(budget)
    m = torchckpt.checkpoint(clone(model), policy=Offload(s))
    for i in range(3):
        ref = step(plain, plain, x, seed=i)
        got = step(m, m, x, seed=i)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        assert_same_grads(got[2], ref[2])
    st = s.stats()
    assert st.misses == st.unpacks > 0 and st.host.in_use_bytes == 0


def test_recompute_determinism_error_is_raised() -> None:
    # A block whose recomputation saves differently-shaped tensors: torch's check catches it.
    calls = {"n": 0}

    def changing(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return (x[: 4 if calls["n"] == 1 else 3] * 2).sin().sum()

    x = torch.randn(4, requires_grad=True)
    with pytest.raises(Exception):
        torchckpt.checkpoint(changing, x * 1.0, policy=Recompute()).backward()
