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
        torchckpt.api.run(bad, f, torch.randn(4, requires_grad=True))


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
        torchckpt.Store(device="cpu", host=torchckpt.memory.HostPool(chunk_bytes=1 << 20, pin=False), **kw)


def test_cache_negative_capacity() -> None:
    with pytest.raises(ValueError, match="^torchckpt:"):
        torchckpt.schedules.cache.Cache(-1)


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


# -- API bad input named at the call that received it (issue 11) ----------------------------
@pytest.mark.parametrize(
    "bad,fix",
    [("recompute", r"Recompute\(\)"), ("Offload", r"Offload\(store\)"), ("keep", r"Keep\(\)"), (Offload, r"Offload\(\)")],
)
def test_policy_given_as_string_or_class_in_the_policy_position(bad: object, fix: str) -> None:
    # Library bug: checkpoint(m, "recompute") called m("recompute") and failed inside Linear.
    for target in (nn.Linear(2, 2), f):
        with pytest.raises(TypeError, match=rf"^torchckpt: .*policy=torchckpt\.{fix}"):
            torchckpt.checkpoint(target, bad)
    with pytest.raises(TypeError, match=rf"^torchckpt: checkpoint\(\.\.\., policy=\.\.\.\) .*policy=torchckpt\.{fix}"):
        torchckpt.checkpoint(nn.Linear(2, 2), policy=bad)
    with pytest.raises(TypeError, match=rf"^torchckpt: .*policy=torchckpt\.{fix}"):
        torchckpt.checkpoint(bad)


def test_policy_given_twice_or_as_a_call_argument() -> None:
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(TypeError, match="^torchckpt: .*policy twice"):
        torchckpt.checkpoint(nn.Linear(2, 2), Offload(cpu_store(0)), policy=Recompute())
    with pytest.raises(TypeError, match="^torchckpt: .*policy twice"):
        torchckpt.checkpoint(Recompute(), policy=Keep())
    with pytest.raises(TypeError, match="^torchckpt: .*never a call argument"):
        torchckpt.checkpoint(f, x, Recompute())


def test_bare_decorator_on_a_function_is_an_error() -> None:
    # checkpoint(fn) calls fn() (torch.utils.checkpoint semantics), so a bare @checkpoint above a
    # function that needs arguments says how to decorate it instead of calling it.
    with pytest.raises(TypeError, match=r"^torchckpt: checkpoint\(.*g\) with no call arguments.*@torchckpt\.checkpoint\(\)"):
        @torchckpt.checkpoint
        def g(x: torch.Tensor) -> torch.Tensor:
            return x.sin()
    with pytest.raises(TypeError, match="^torchckpt: .*pass its arguments"):
        torchckpt.checkpoint(f, policy=Offload(cpu_store(0)))


def test_decorator_of_a_non_callable() -> None:
    with pytest.raises(TypeError, match="^torchckpt: checkpoint\\(policy\\) decorates"):
        torchckpt.checkpoint(Keep())(3)


@pytest.mark.parametrize("bad", [5, torch.randn(3), [torch.randn(3), 1.0], nn.Linear(2, 2)])
def test_offload_keep_must_be_an_iterable_of_tensors(bad: object) -> None:
    with pytest.raises(TypeError, match=r"^torchckpt: offload\(keep=\.\.\.\) expects an iterable of tensors"):
        torchckpt.offload(cpu_store(0), keep=bad)


def test_offload_keep_accepts_a_generator() -> None:
    lin = nn.Linear(4, 4)
    with torchckpt.offload(cpu_store(0), keep=lin.parameters()):
        lin(torch.randn(2, 4)).sum().backward()
    assert lin.weight.grad is not None


def test_keep_takes_no_store() -> None:
    # Library bug: Keep(store) raised Python's "takes 1 positional argument but 2 were given".
    s = cpu_store(0)
    for make in (lambda: Keep(s), lambda: Keep(store=s)):
        with pytest.raises(TypeError, match=r"^torchckpt: Keep\(\) takes no arguments.*Offload\(store\)"):
            make()
    assert repr(Keep()) == "Keep()"


@pytest.mark.parametrize("field", ["preserve_rng_state", "debug"])
def test_recompute_flags_are_booleans(field: str) -> None:
    with pytest.raises(TypeError, match=rf"^torchckpt: Recompute\({field}=\.\.\.\) expects True or False"):
        Recompute(**{field: "no"})


def test_run_bad_input() -> None:
    x = torch.randn(4, requires_grad=True)
    with torch.no_grad():  # checked before the no-grad shortcut
        with pytest.raises(TypeError, match=r"^torchckpt: run\(policy, \.\.\.\)"):
            torchckpt.api.run("recompute", f, x)
    with pytest.raises(TypeError, match="^torchckpt: run.* takes the policy first"):
        torchckpt.api.run(f, Recompute(), x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^torchckpt: run.* expects a callable fn"):
        torchckpt.api.run(Recompute(), 3, x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^torchckpt: run\(\.\.\., module=\.\.\.\)"):
        torchckpt.api.run(Offload(cpu_store(0)), f, x, module="lin")  # type: ignore[arg-type]


def test_torch_checkpoint_options_in_the_call_form() -> None:
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match="^torchckpt: .*use_reentrant=True.*non-reentrant"):
        torchckpt.checkpoint(f, x, use_reentrant=True)
    with pytest.raises(TypeError, match=r"^torchckpt: .*preserve_rng_state=\.\.\.\).*Recompute\(preserve_rng_state=False\)"):
        torchckpt.checkpoint(f, x, preserve_rng_state=False, policy=Recompute())


# -- checkpointed_loop, run_schedule and SnapshotStore (each raises at the call: adjoint/args.py) --------
def _loop(**kw: object) -> object:
    from torchckpt.schedules import Revolve

    kw.setdefault("schedule", Revolve(3, 2))
    return torchckpt.checkpointed_loop(torch.sin, torch.ones(2, requires_grad=True), 3, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("store,match", [
    ("cpu", r"found the device 'cpu'; pass store=torchckpt\.Store\('cpu'\)"),
    (torch.device("cpu"), r"found the device 'cpu'"),
    (torchckpt.SnapshotStore, r"found the class SnapshotStore; pass an instance"),
    (torchckpt.Store, r"found the class Store; pass an instance"),
    (3, r"found int 3"),
])
def test_checkpointed_loop_store_argument(store: object, match: str) -> None:
    with pytest.raises(TypeError, match=r"^torchckpt: checkpointed_loop\(store=\.\.\.\) expects a torchckpt\.Store.*"
                       + match):
        _loop(store=store)


@pytest.mark.parametrize("params,match", [
    (torch.ones(2, requires_grad=True), r"found a tensor; pass a list, e\.g\. params=\[w\]"),
    (nn.Linear(2, 2), r"found an nn\.Module; pass params=list\(module\.parameters\(\)\)"),
    ([torch.ones(2), "w"], r"found str 'w' at index 1"),
    (3, r"found int 3"),
])
def test_checkpointed_loop_params_argument(params: object, match: str) -> None:
    with pytest.raises(TypeError, match=r"^torchckpt: checkpointed_loop\(params=\.\.\.\) expects .*" + match):
        _loop(params=params, store=cpu_store(1 << 20))


@pytest.mark.parametrize("schedule", [None, 3, ["Save(0)"], b"auto"])
def test_checkpointed_loop_schedule_argument(schedule: object) -> None:
    with pytest.raises(TypeError, match=r"^torchckpt: .*schedule"):
        _loop(schedule=schedule, store=cpu_store(1 << 20))


def test_checkpointed_loop_schedule_none_says_what_to_pass() -> None:
    with pytest.raises(TypeError, match=r"^torchckpt: checkpointed_loop\(schedule=None\).*schedule=torchckpt\.adjoint\.AutoSchedule\(\)"):
        _loop(schedule=None, store=cpu_store(1 << 20))


@pytest.mark.parametrize("slots,exc", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError),
                                       ("4", TypeError)])
def test_checkpointed_loop_slots_argument(slots: object, exc: type) -> None:
    with pytest.raises(exc, match=r"^torchckpt: checkpointed_loop\(slots=\.\.\.\).*slots=4"):
        _loop(slots=slots, store=cpu_store(1 << 20))


def test_checkpointed_loop_prefetch_and_step_arguments() -> None:
    with pytest.raises(TypeError, match=r"^torchckpt: checkpointed_loop\(prefetch=\.\.\.\) expects True or False"):
        _loop(prefetch="no", store=cpu_store(1 << 20))
    with pytest.raises(TypeError, match=r"^torchckpt: checkpointed_loop\(step=\.\.\.\) expects a callable"):
        torchckpt.checkpointed_loop("sin", torch.ones(2), 3)  # type: ignore[arg-type]


def _schedule_run(**kw: object) -> object:
    from torchckpt.schedules import Revolve, Tier

    x = [torch.ones(2)]
    args: dict = dict(forward=lambda n0, n1: None, save=lambda n: x[0], restore=lambda n, t: None,
                      backward=lambda n: None, store=None)
    args.update(kw)
    sched = args.pop("schedule", Revolve(3, 2, tier=Tier.HOST))
    return torchckpt.run_schedule(sched, **args)


@pytest.mark.parametrize("store,match", [
    ("cpu", r"found the device 'cpu'"),
    (torchckpt.SnapshotStore, r"found the class SnapshotStore; pass an instance"),
    (torchckpt.Store, r"found the class Store; pass an instance"),
])
def test_run_schedule_store_argument(store: object, match: str) -> None:
    with pytest.raises(TypeError, match=r"^torchckpt: run_schedule\(store=\.\.\.\) expects .*" + match):
        _schedule_run(store=store)


@pytest.mark.parametrize("kw,exc,match", [
    ({"schedule": None}, TypeError, r"run_schedule\(schedule=\.\.\.\).*found None"),
    ({"schedule": 7}, TypeError, r"run_schedule\(schedule=\.\.\.\)"),
    ({"schedule": ["Advance(0, 1)"]}, TypeError, r"unknown schedule action 'Advance\(0, 1\)' at position 0"),
    ({"slots": 0}, ValueError, r"run_schedule\(slots=\.\.\.\) must be >= 1"),
    ({"slots": "2"}, TypeError, r"run_schedule\(slots=\.\.\.\) must be an int"),
    ({"prefetch": "no"}, TypeError, r"run_schedule\(prefetch=\.\.\.\) expects True or False"),
    ({"progress": 1}, TypeError, r"run_schedule\(progress=\.\.\.\) expects True or False"),
    ({"forward": None}, TypeError, r"run_schedule\(forward=\.\.\.\) expects a callable"),
    ({"end_forward": "done"}, TypeError, r"run_schedule\(end_forward=\.\.\.\) expects a callable"),
    ({"save": lambda n: 3.0}, TypeError, r"run_schedule's save\(0\) must return a tensor"),
])
def test_run_schedule_bad_arguments(kw: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match="^torchckpt: " + match):
        _schedule_run(**kw)


@pytest.mark.parametrize("kw,exc,match", [
    ({"gpu_bytes": 1 << 20}, TypeError, r"SnapshotStore needs the device .*SnapshotStore\('cuda', gpu_bytes=\.\.\.\)"),
    ({"device": "gpu"}, ValueError, r"SnapshotStore\(device='gpu'\) is not a device"),
    ({"device": 0.5}, TypeError, r"SnapshotStore\(device=\.\.\.\) expects"),
    ({"device": "cpu", "gpu_bytes": True}, ValueError, r"SnapshotStore\(gpu_bytes=\.\.\.\) must be a positive int"),
    ({"device": "cpu", "gpu_bytes": "1GB"}, ValueError, r"SnapshotStore\(gpu_bytes=\.\.\.\) must be a positive int"),
    ({"device": "cpu", "slot_bytes": 0}, ValueError, r"SnapshotStore\(slot_bytes=\.\.\.\) must be a positive int"),
    ({"device": "cpu", "slot_margin": "0.1"}, ValueError, r"SnapshotStore\(slot_margin=\.\.\.\) must be a number"),
    ({"device": "cpu", "host": "pinned"}, TypeError, r"SnapshotStore\(host=\.\.\.\) expects a torchckpt\.memory\.HostPool"),
    ({"device": "cpu", "timing": "no"}, TypeError, r"SnapshotStore\(timing=\.\.\.\) expects True or False"),
])
def test_snapshot_store_bad_construction(kw: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match="^torchckpt: " + match):
        torchckpt.SnapshotStore(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_snapshot_store_cuda_without_cuda() -> None:
    with pytest.raises(ValueError, match=r"^torchckpt: SnapshotStore\(device='cuda'\) needs CUDA.*device='cpu'"):
        torchckpt.SnapshotStore("cuda", gpu_bytes=1 << 20)


# -- checkpoint_chain and offload: what was found, and what to pass (issue 22 item 4) -------------------------------
@pytest.mark.parametrize("policy,found", [("recompute", r"str 'recompute'"), (Recompute, r"the class Recompute")])
def test_checkpoint_chain_policy_given_as_string_or_class(policy: object, found: str) -> None:
    blocks = [nn.Linear(2, 2), nn.Linear(2, 2)]
    with pytest.raises(TypeError, match=rf"^torchckpt: checkpoint_chain\(policy=\.\.\.\) takes Recompute\(\) .*got "
                       rf"{found}; .*pass e\.g\. policy=torchckpt\.Recompute\(\)"):
        torchckpt.checkpoint_chain(blocks, 1, policy=policy)  # type: ignore[arg-type]
    assert all("forward" not in b.__dict__ for b in blocks)


def test_checkpoint_chain_names_what_it_found() -> None:
    with pytest.raises(TypeError, match=r"^torchckpt: checkpoint_chain\(blocks, \.\.\.\) expects .*got the function tanh "
                       r"at index 1; pass modules"):
        torchckpt.checkpoint_chain([nn.Linear(2, 2), torch.tanh], 1)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"^torchckpt: checkpoint_chain\(blocks, \.\.\.\) expects .*got the module Linear; "
                       r"pass e\.g\. list\(model\.layers\)"):
        torchckpt.checkpoint_chain(nn.Linear(2, 2), 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^torchckpt: checkpoint_chain\(snapshots=\.\.\.\) takes an int >= 1 .*got str "
                       r"'2'; pass e\.g\. snapshots=4"):
        torchckpt.checkpoint_chain([nn.Linear(2, 2), nn.Linear(2, 2)], "2")  # type: ignore[arg-type]


@pytest.mark.parametrize("store,found,fix", [
    (torchckpt.Store, r"the class Store", r"pass an instance, e\.g\. store=torchckpt\.Store\(gpu_bytes=\.\.\.\)"),
    ("cuda", r"str 'cuda'", r"pass store=torchckpt\.Store\(gpu_bytes=\.\.\.\), or None for the default store"),
])
def test_offload_store_names_what_it_found(store: object, found: str, fix: str) -> None:
    with pytest.raises(TypeError, match=rf"^torchckpt: offload\(store=\.\.\.\) expects a torchckpt\.Store or None, got "
                       rf"{found}; {fix}\.$"):
        torchckpt.offload(store)  # type: ignore[arg-type]


def test_format_bytes_picks_the_unit() -> None:
    from torchckpt._errors import format_bytes

    assert [format_bytes(n) for n in (0, 512, 1023, 1024, 6144, 1509949, (1 << 20) - 1, 3 << 30, 5 << 40, -(3 << 20))] == [
        "0 B", "512 B", "1023 B", "1.00 KiB", "6.00 KiB", "1.44 MiB", "1.00 MiB", "3.00 GiB", "5.00 TiB", "-3.00 MiB"]


def test_format_bytes_apart_never_prints_two_values_alike() -> None:
    from torchckpt._errors import format_bytes_apart

    assert format_bytes_apart(1509949, 1509949) == ["1.44 MiB", "1.44 MiB"]  # equal values read equal
    assert format_bytes_apart(1509949, 1509949 + 1000, 1 << 30) == ["1.440 MiB", "1.441 MiB", "1.00 GiB"]
    assert format_bytes_apart(1509949, 1509950) == ["1509949 B", "1509950 B"]  # rounding cannot tell them apart
    for a, b in [(1, 2), (1 << 20, (1 << 20) - 1), (5 << 30, (5 << 30) + 7), (1000, 1000.4)]:
        x, y = format_bytes_apart(a, b)
        assert (x == y) == (round(a) == round(b)), (a, b, x, y)
