"""What torchckpt's policies do with torch.compile, torch.func, torch.jit, DDP, FSDP2, BatchNorm and
transformers' KV cache: the claims of docs/guide.md's "Works with" table, each checked here on the CPU.

Gradients are compared bit for bit with the same program without a policy. The graph-break counts
are those of torch 2.11.0 (the version the table was measured on); on another torch only the
runs and gradients are checked.
"""
from __future__ import annotations

import json
import operator
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import torchckpt
from ckpt_models import cpu_store, grads, small_pool

TORCH_2_11 = torch.__version__.split("+")[0] == "2.11.0"


class Blk(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(d, 4 * d)
        self.b = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(F.gelu(self.a(x)))


def _blocks(policy: Callable[[], torchckpt.Policy] | None, n: int = 3, d: int = 32) -> nn.Sequential:
    """``n`` residual MLP blocks (seeded), each wrapped with ``policy()`` when given."""
    torch.manual_seed(0)
    m = nn.Sequential(*[Blk(d) for _ in range(n)])
    if policy is not None:
        for b in m:
            torchckpt.checkpoint(b, policy=policy())
    return m


def _policy(name: str, store: torchckpt.Store | None = None) -> Callable[[], torchckpt.Policy]:
    """A factory for the table's policy ``name``; the store ones share ``store`` (default: a fresh CPU store)."""
    s = store if store is not None else cpu_store(1 << 20)
    return {
        "Keep": torchckpt.Keep,
        "Recompute": torchckpt.Recompute,
        "Recompute(store)": lambda: torchckpt.Recompute(store=s),
        "Offload": lambda: torchckpt.Offload(s),
    }[name]


def _train_grads(m: nn.Module, fwd: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 x0: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
    x = (torch.randn(8, 32, generator=torch.Generator().manual_seed(1)) if x0 is None else x0).requires_grad_()
    (fwd or m)(x * 1.0).square().mean().backward()
    out = grads(m)
    out["input"] = x.grad
    return out


def _same(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> bool:
    return a.keys() == b.keys() and all(
        (a[k] is None and b[k] is None) or (a[k] is not None and b[k] is not None and torch.equal(a[k], b[k]))
        for k in a)


POLICIES = ["Keep", "Recompute", "Recompute(store)", "Offload"]  # as the table names them; stores are CPU-simulated


# -- torch.compile -----------------------------------------------------------------------------
def _dynamo_breaks(fn: Callable[..., Any], *args: Any) -> tuple[int, int, int]:
    """(graph breaks Dynamo hit, explain's graph_count, explain's graph_break_count) for one call.

    ``torch._dynamo.explain`` counts graph_count - 1 breaks: a break at a frame's first
    instruction leaves no graph and is not counted there, so Dynamo's own counter is the figure.
    """
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ex = torch._dynamo.explain(fn)(*args)
    return sum(counters["graph_break"].values()), ex.graph_count, ex.graph_break_count


# (Dynamo's graph breaks, explain's graph_count, explain's graph_break_count) for 3 wrapped blocks
# on torch 2.11.0: docs/guide.md quotes these.
GRAPH_BREAKS = {
    "none": (0, 1, 0),
    "Keep": (0, 1, 0),
    "Recompute": (0, 1, 0),
    "Recompute(store)": (4, 0, -1),
    "Offload": (4, 1, 0),
    "offload(store) around the compiled model": (0, 1, 0),
    "offload(store) inside the compiled function": (1, 1, 0),
}


# What Dynamo names as the cause of each break (substrings of its reasons).
BREAK_CAUSES = {
    "Offload": {"is_functorch_wrapped_tensor"},
    "Recompute(store)": {"is_functorch_wrapped_tensor"},
    "offload(store) inside the compiled function": {"saved_tensors_hooks.__init__"},
}


def _compile_case(name: str) -> tuple[Callable[..., Any], Callable[[], Any]]:
    """The function to compile for table row ``name`` and the context to call it in."""
    import contextlib

    store = cpu_store(1 << 20)
    if name == "offload(store) around the compiled model":
        return _blocks(None), lambda: torchckpt.offload(store)
    if name == "offload(store) inside the compiled function":
        m = _blocks(None)

        def f(x: torch.Tensor) -> torch.Tensor:
            with torchckpt.offload(store):
                return m(x)

        return f, contextlib.nullcontext
    return _blocks(_policy(name, store) if name != "none" else None), contextlib.nullcontext


@pytest.mark.parametrize("name", list(GRAPH_BREAKS))
def test_compile_graph_breaks(name: str) -> None:
    if not TORCH_2_11:
        pytest.skip(f"the counts are those of torch 2.11.0; this is torch {torch.__version__}")
    fn, ctx = _compile_case(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ctx():
            got = _dynamo_breaks(fn, torch.randn(8, 32, requires_grad=True) * 1.0)
    assert got == GRAPH_BREAKS[name]
    from torch._dynamo.utils import counters

    causes = BREAK_CAUSES.get(name, set())
    for reason in counters["graph_break"]:
        assert any(c in reason for c in causes), reason
    assert all(any(c in reason for reason in counters["graph_break"]) for c in causes)


def test_compile_recompute_blocks_become_checkpoint_regions() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    m = _blocks(torchckpt.Recompute)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(m, backend=capture)(torch.randn(8, 32, requires_grad=True) * 1.0)
    hops = [n for g in graphs for n in g.graph.nodes if n.target is torch.ops.higher_order.tag_activation_checkpoint]
    others = [n for g in graphs for n in g.graph.nodes if n.op == "call_function" and n not in hops
              and n.target is not operator.getitem]
    assert hops and not others  # every block's work is inside a checkpoint region


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", POLICIES)
def test_compile_runs_with_the_compiled_models_gradients(name: str, backend: str) -> None:
    # aot_eager gives eager's bits. inductor fuses: its gradients differ from eager's in the last
    # bits, and a policy under which Dynamo compiles the blocks gives the bits of the compiled
    # model without a policy; one under which it compiles nothing (explain's graph_count 0) runs
    # in eager and gives eager's bits.
    eager = _train_grads(_blocks(None))
    torch._dynamo.reset()
    plain = _blocks(None)
    compiled = _train_grads(plain, torch.compile(plain, backend=backend))
    torch._dynamo.reset()
    store = cpu_store(1 << 20)
    m = _blocks(_policy(name, store))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamo's graph-break warnings
        got = _train_grads(m, torch.compile(m, backend=backend))
    if backend == "aot_eager":
        assert _same(got, eager)
    elif TORCH_2_11:
        assert _same(got, compiled if GRAPH_BREAKS[name][1] > 0 else eager)
    else:
        assert _same(got, compiled) or _same(got, eager)
    # the store still receives the compiled blocks' saved tensors (Recompute(store): the block inputs)
    assert (store.stats().offloaded > 0) == ("store" in name or name == "Offload")


def test_offload_context_around_a_compiled_model() -> None:
    store = cpu_store(0)
    torch._dynamo.reset()
    m = _blocks(None)
    want = _train_grads(_blocks(None))
    f = torch.compile(m, backend="aot_eager")
    with torchckpt.offload(store):
        got = _train_grads(m, f)
    assert _same(got, want)
    assert store.stats().offloaded > 0  # the compiled graph's saved tensors went to the store


# -- torch.func ----------------------------------------------------------------------------------
_W1 = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
_W2 = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
_X = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))


def _block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w1.T) @ w2.T


def _scalar_fn(run: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(x: torch.Tensor) -> torch.Tensor:
        h = run(_block, x, _W1, _W2)
        return (h.sin() * h).sum()

    return f


TRANSFORMS: dict[str, Callable[[Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]] = {
    "grad": lambda f: torch.func.grad(f)(_X),
    "vjp": lambda f: torch.func.vjp(f, _X)[1](torch.tensor(1.0))[0],
    "jacrev": lambda f: torch.func.jacrev(f)(_X),
    "hessian": lambda f: torch.func.hessian(f)(_X[:1]),
    "vmap(grad)": lambda f: torch.func.vmap(torch.func.grad(f))(_X.unsqueeze(1)),
    "vmap": lambda f: torch.func.vmap(f)(_X.unsqueeze(1)),
    "jvp": lambda f: torch.func.jvp(f, (_X,), (torch.ones_like(_X),))[1],
    "jacfwd": lambda f: torch.func.jacfwd(f)(_X),
}
_REVERSE = ("grad", "vjp", "jacrev", "hessian", "vmap(grad)")  # PyTorch refuses saved-tensor hooks in these


def _func_expectation(policy: str, transform: str) -> str | type[BaseException]:
    """What the table says: "same" (plain's result), "keep" (same, run as Keep() with a warning), or an error."""
    if policy == "Keep":
        return "same"
    if transform in _REVERSE:
        return "keep"
    if policy.startswith("Recompute"):  # torch.utils.checkpoint's autograd.Function has no vmap/jvp rule
        return NotImplementedError if transform == "jvp" else RuntimeError
    return "same"


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("policy", POLICIES)
def test_func_transforms(policy: str, transform: str) -> None:
    want = TRANSFORMS[transform](_scalar_fn(lambda fn, *a: fn(*a)))
    pol = _policy(policy)()
    f = _scalar_fn(lambda fn, *a: torchckpt.api.run(pol, fn, *a))
    expect = _func_expectation(policy, transform)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        if not isinstance(expect, str):
            with pytest.raises(expect):
                TRANSFORMS[transform](f)
            return
        got = TRANSFORMS[transform](f)
    assert torch.equal(got, want)
    runs_as_keep = [x for x in w if "runs as Keep()" in str(x.message)]
    assert bool(runs_as_keep) == (expect == "keep")


@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp", "jacfwd"])
def test_func_torch_utils_checkpoint_raises_too(transform: str) -> None:
    # Recompute's errors under vmap/jvp/jacfwd are torch.utils.checkpoint's; under grad it raises
    # where torchckpt runs the block as Keep().
    f = _scalar_fn(lambda fn, *a: torch_checkpoint(fn, *a, use_reentrant=False))
    with pytest.raises((RuntimeError, NotImplementedError)):
        TRANSFORMS[transform](f)


def test_vmap_then_backward() -> None:
    # Per-sample style: vmap over the forward, ordinary backward outside. Offload sees the saved
    # tensors (plain tensors below the vmap level); Recompute raises as torch.utils.checkpoint does.
    w1, w2 = _W1.clone().requires_grad_(), _W2.clone().requires_grad_()

    def go(run: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        w1.grad = w2.grad = None
        torch.func.vmap(lambda xi: run(_block, xi, w1, w2))(_X).square().sum().backward()
        assert w1.grad is not None and w2.grad is not None
        return w1.grad.clone(), w2.grad.clone()

    want = go(lambda fn, *a: fn(*a))
    store = cpu_store(0)
    got = go(lambda fn, *a: torchckpt.api.run(torchckpt.Offload(store), fn, *a))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert store.stats().offloaded > 0
    with pytest.raises(RuntimeError, match="vmap"):
        go(lambda fn, *a: torchckpt.api.run(torchckpt.Recompute(), fn, *a))
    with pytest.raises(RuntimeError, match="vmap"):
        go(lambda fn, *a: torch_checkpoint(fn, *a, use_reentrant=False))


# -- torch.jit -----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["Keep", "Recompute", "Offload"])
def test_jit_script_of_a_wrapped_module_raises(policy: str) -> None:
    m = _blocks(None, n=1)[0]
    torchckpt.checkpoint(m, policy=_policy(policy)())
    with pytest.raises(Exception):  # noqa: B017  (the error is TorchScript's or Python's, not ours)
        torch.jit.script(m)


def test_jit_script_of_a_decorated_class_raises() -> None:
    @torchckpt.checkpoint(torchckpt.Recompute())
    class Decorated(Blk):
        pass

    with pytest.raises(Exception):  # noqa: B017
        torch.jit.script(Decorated())


def test_jit_trace_records_the_ops_not_the_policy() -> None:
    x = torch.randn(8, 32)
    want = _train_grads(_blocks(None, n=1), x0=x.clone())
    store = cpu_store(0)
    m = _blocks(lambda: torchckpt.Offload(store), n=1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        traced = torch.jit.trace(m, (x.clone().requires_grad_(),))
    if TORCH_2_11:
        assert any("torch.jit.trace` is deprecated" in str(x.message) for x in w)
    during_trace = store.stats().offloaded
    got = _train_grads(m, traced, x0=x.clone())
    assert _same(got, want)
    assert store.stats().offloaded == during_trace  # the traced module runs as Keep()
    r = _blocks(torchckpt.Recompute, n=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(torch.jit.TracingCheckError):  # the recomputation makes two traces differ
            torch.jit.trace(r, (x.clone().requires_grad_(),))


# -- DDP and FSDP2 (2 processes: gloo on the CPU; NCCL on 2 GPUs) ---------------------------------
def _dist_store(dev: str, gpu_bytes: int) -> torchckpt.Store:
    if dev == "cpu":
        return cpu_store(gpu_bytes)
    return torchckpt.Store(device=dev, gpu_bytes=gpu_bytes, min_bytes=0, host=small_pool())  # the blocks' small tensors too


def _dist_policies(dev: str = "cpu") -> dict[str, Callable[[], torchckpt.Policy]]:
    return {
        "Keep": torchckpt.Keep,
        "Recompute": torchckpt.Recompute,
        "Recompute(store)": lambda: torchckpt.Recompute(store=_dist_store(dev, 0)),
        "Offload": lambda: torchckpt.Offload(_dist_store(dev, 0)),
        "Offload(1 MiB cache)": lambda: torchckpt.Offload(_dist_store(dev, 1 << 20)),
    }


def _parallel(m: nn.Module, kind: str) -> nn.Module:
    """``m`` under DDP (``kind`` "ddp"), or with ``fully_shard`` on each block and on the root (FSDP2)."""
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(m)
    from torch.distributed.fsdp import fully_shard

    for b in m:
        if isinstance(b, Blk):
            fully_shard(b)
    fully_shard(m)
    return m


def _sgd(model: nn.Module, m: nn.Module, xs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One SGD step per batch of ``xs`` on ``model`` (``m`` under DDP or FSDP2); ``m``'s unsharded weights after."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in xs:
        model(x.clone().requires_grad_() * 1.0).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in m.state_dict().items()}


def _headed(d: int = 16) -> nn.Sequential:
    """``_blocks`` with a linear head after them: under FSDP2 the root holds parameters of its own."""
    blocks = _blocks(None, d=d)
    return nn.Sequential(*blocks, nn.Linear(d, d))


def _dist_planner(rank: int, xs: list[torch.Tensor], dev: str) -> dict[str, Any]:
    """The planner on the DDP and FSDP2 models of 2 ranks, each planning on its own batch (NOTE [ One plan for all
    ranks ]): per case, the plan's JSON on this rank, its modes, whether the weights after SGD steps under it equal those of
    the same run without torchckpt, and what the plan's blocks save beside what the model's save before it is wrapped);
    and the refusal of a tensor-parallel parameter."""
    res: dict[str, Any] = {}
    d = xs[0].shape[-1]
    for kind, make, how in (("ddp", lambda: _blocks(None, d=d).to(dev), "plan"),
                            ("fsdp", lambda: _blocks(None, d=d).to(dev), "plan"), ("fsdp", lambda: _headed(d).to(dev), "auto")):
        try:
            m = make()
            model = _parallel(m, kind)
            top = torchckpt.planner.plans(model, xs[0], budgets=[1 << 40])[1 << 40]
            none = top.measured_peak_bytes if top.measured_peak_bytes is not None else top.none_peak_bytes  # CUDA: measured
            budget = (top.floor_bytes + none) // 2  # a plan that recomputes (the test checks)
            if how == "plan":
                p = torchckpt.plan(model, xs[0], budget=budget)
                p.apply(model)
                state = _sgd(model, m, xs)
            else:
                a = torchckpt.auto(model, budget=budget)
                state = _sgd(model, m, xs)
                assert a.plan is not None
                p = a.plan
            plain = make()
            # the batch as planned: auto plans _sgd's (an activation) on a view of a fresh leaf, as profiling._leaves does
            batch = xs[0] if how == "plan" else xs[0].clone().requires_grad_().view_as(xs[0])
            alone = torchckpt.planner.profile(plain, (batch,), {}, blocks=[(n, b) for n, b in plain.named_children()
                                                                           if isinstance(b, Blk)])
            ref = _sgd(_parallel(plain, kind), plain, xs)
            res[f"{kind}/{how}"] = dict(
                json=p.to_json(), modes=[b.mode for b in p.blocks], same=all(torch.equal(state[k], ref[k]) for k in ref),
                saved=[[(t.nbytes, t.why_zero) for t in b.tensors] for b in p.blocks],
                saved_alone=[[(t.nbytes, t.why_zero) for t in b] for b in alone.saved])
        except Exception as e:
            res[f"{kind}/{how}"] = f"raised {type(e).__name__}: {e}"
    try:
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        tp = _blocks(None, d=16).to(dev)
        mesh = init_device_mesh(torch.device(dev).type, (2,))
        tp[0].a.weight = nn.Parameter(distribute_tensor(tp[0].a.weight.detach(), mesh, [Shard(0)]))
        torchckpt.plan(tp, xs[0], budget=1 << 30)
        res["tp"] = "planned"
    except torchckpt.CheckpointError as e:
        res["tp"] = str(e)
    return res


def _dist_worker(rank: int, world: int, init: str, out: str, backend: str = "gloo") -> None:
    import torch.distributed as dist

    import datetime

    dev = "cpu"
    if backend == "nccl":
        dev = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    # a rank that fails a case leaves the other waiting in a collective: give up after a minute
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + 10 * rank + i)).to(dev) for i in range(2)]

    def train(policy: Callable[[], torchckpt.Policy] | None, kind: str) -> tuple[dict[str, torch.Tensor], int, int]:
        m = _blocks(None, d=16).to(dev)
        pols = []
        if policy is not None:
            for b in m:
                pols.append(policy())
                torchckpt.checkpoint(b, policy=pols[-1])
        calls = [0]
        m[0].a.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        state = _sgd(_parallel(m, kind), m, xs)
        offloaded = sum(p.store.stats().offloaded for p in pols if getattr(p, "store", None) is not None)
        return state, calls[0], offloaded

    res: dict[str, Any] = {}
    for kind in ("ddp", "fsdp"):
        try:
            ref, ref_calls, _ = train(None, kind)
        except Exception as e:  # FSDP2 without CPU support, say: the test reports it
            res[kind] = f"plain {kind} raised {type(e).__name__}: {e}"
            continue
        for name, policy in _dist_policies(dev).items():
            try:
                state, n_calls, offloaded = train(policy, kind)
                res[f"{kind}/{name}"] = (all(torch.equal(state[k], ref[k]) for k in ref), n_calls, ref_calls, offloaded)
            except Exception as e:
                res[f"{kind}/{name}"] = f"raised {type(e).__name__}: {e}"
    if "fsdp" not in res and "ddp" not in res:
        if dev != "cpu":  # the planner on the device: tensors of 16 MiB, so that budgets between the floor and keeping
            # everything lie well above NOTE [ Applying a plan ] Rule 4's slack (10% under 20 MiB: with 256 x 256
            # batches the floor's plan measured 12.27 MiB against a limit of 11.61 at the midpoint, on 2 H100s)
            xs = [torch.randn(2048, 2048, generator=torch.Generator().manual_seed(100 + 10 * rank + i)).to(dev)
                  for i in range(2)]
        res.update(_dist_planner(rank, xs, dev))
    torch.save(res, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    # Seen once under load: "terminate called without an active exception" (SIGABRT) as a worker
    # tore down after its work was done and saved; leave without running C++ static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn_dist(backend: str) -> list[dict[str, Any]]:
    """What each of the 2 ranks of ``_dist_worker`` found on ``backend``, by rank."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "results.pt")
        mp.spawn(_dist_worker, args=(2, "file://" + os.path.join(d, "init"), out, backend), nprocs=2, join=True)
        return [torch.load(f"{out}.{r}") for r in range(2)]


@pytest.fixture(scope="module")
def dist_ranks() -> list[dict[str, Any]]:
    """What each of the 2 gloo ranks (CPU) of ``_dist_worker`` found, by rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    return _spawn_dist("gloo")


@pytest.fixture(scope="module")
def nccl_ranks() -> list[dict[str, Any]]:
    """The same on 2 GPUs over NCCL."""
    import torch.distributed as dist

    if torch.cuda.device_count() < 2 or not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("needs 2 CUDA devices and NCCL")
    return _spawn_dist("nccl")


@pytest.fixture(scope="module")
def dist_results(dist_ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return dist_ranks[0]


_BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.cuda)]  # gloo: CPU; NCCL: 2 GPUs


def _ranks(request: pytest.FixtureRequest, backend: str) -> list[dict[str, Any]]:
    return request.getfixturevalue("dist_ranks" if backend == "gloo" else "nccl_ranks")  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("policy", list(_dist_policies()))
def test_distributed_matches_plain(request: pytest.FixtureRequest, backend: str, kind: str, policy: str) -> None:
    # Two SGD steps on 2 ranks: parameters bit-identical to the same DDP / fully_shard run with no policy.
    dist_results = _ranks(request, backend)[0]
    assert kind not in dist_results, dist_results[kind]
    r = dist_results[f"{kind}/{policy}"]
    assert not isinstance(r, str), r
    same, calls, ref_calls, offloaded = r
    assert same
    assert calls == (2 * ref_calls if policy.startswith("Recompute") else ref_calls)  # recomputed in backward
    assert (offloaded > 0) == (policy == "Recompute(store)" or policy.startswith("Offload"))


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("case", ["ddp/plan", "fsdp/plan", "fsdp/auto"])
def test_planning_under_ddp_and_fsdp2(request: pytest.FixtureRequest, backend: str, case: str) -> None:
    """plan() / auto() on the DDP or FSDP2 model itself, each rank on a batch of its own: one plan on both ranks
    (NOTE [ One plan for all ranks ]), which recomputes, and two SGD steps under it train the weights of the same run
    without torchckpt, bit for bit. The blocks' saved tensors are those of the model before it is wrapped: FSDP2's
    unsharded parameters (and views of them) count as parameters (NOTE [ Sharded parameters ] Rule 1). On NCCL the
    planner also measures and verifies on the device, both ranks together (NOTE [ One plan for all ranks ] Rule 4)."""
    got = [r[case] for r in _ranks(request, backend)]
    assert not any(isinstance(g, str) for g in got), got
    plans = [json.loads(g["json"]) for g in got]
    assert [p.pop("device") for p in plans] == ([f"cuda:{r}" for r in range(2)] if backend == "nccl" else ["cpu"] * 2)
    assert plans[0] == plans[1]  # each rank's plan names its own device, and is otherwise the same
    assert "recompute" in got[0]["modes"]
    assert got[0]["same"] and got[1]["same"]
    assert got[0]["saved"] == got[0]["saved_alone"]
    assert any(why == "parameter" for b in got[0]["saved"] for _, why in b)


def test_planning_refuses_tensor_parallel_parameters(dist_results: dict[str, Any]) -> None:
    # NOTE [ Sharded parameters ] Rule 4: a DTensor parameter no fully_shard placed
    assert dist_results["tp"].startswith("torchckpt: plan(model, ...) plans models sharded with fully_shard alone")
    assert "0.a.weight" in dist_results["tp"]


# -- BatchNorm under Recompute -------------------------------------------------------------------
def _conv_bn(momentum: float | None = 0.1) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=momentum), nn.ReLU(),
                         nn.Conv2d(8, 4, 3, padding=1))


def _bn_step(m: nn.Sequential, fwd: Callable[[torch.Tensor], torch.Tensor] | None = None,
             steps: int = 1) -> tuple[dict, torch.Tensor, torch.Tensor, int]:
    """``steps`` forward/backward passes on fixed batches: (gradients of the last, running mean, var, count)."""
    for i in range(steps):
        m.zero_grad(set_to_none=True)
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(5 + i)).requires_grad_()
        (fwd or m)(x * 1.0).square().mean().backward()
    bn = m[1]
    assert isinstance(bn, nn.BatchNorm2d) and bn.running_mean is not None and bn.running_var is not None
    return grads(m), bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked)  # type: ignore[arg-type]


def _bn_same(a: tuple, b: tuple) -> tuple[bool, bool, bool]:
    """(gradients equal, running statistics equal, num_batches_tracked equal)."""
    return _same(a[0], b[0]), torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]), a[3] == b[3]


def test_batchnorm_recompute_updates_running_stats_once() -> None:
    """NOTE [ Buffers written in a forward ]: the recomputation leaves the statistics as plain autograd does;
    torch.utils.checkpoint updates them twice."""
    want = _bn_step(_conv_bn())
    m = _conv_bn()
    torchckpt.checkpoint(m, policy=torchckpt.Recompute())
    assert _bn_same(_bn_step(m), want) == (True, True, True)
    t = _conv_bn()
    twice = _bn_step(t, lambda x: torch_checkpoint(t, x, use_reentrant=False))
    assert _bn_same(twice, want) == (True, False, False) and twice[3] == 2


def test_batchnorm_offload_updates_once() -> None:
    m = _conv_bn()
    torchckpt.checkpoint(m, policy=torchckpt.Offload(cpu_store(0)))
    assert _bn_same(_bn_step(m), _bn_step(_conv_bn())) == (True, True, True)


def test_batchnorm_outside_the_recomputed_blocks() -> None:
    m = _conv_bn()
    for i in (0, 3):  # the convolutions recompute, BatchNorm runs once
        torchckpt.checkpoint(m[i], policy=torchckpt.Recompute())
    assert _bn_same(_bn_step(m), _bn_step(_conv_bn())) == (True, True, True)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_inside_a_recomputed_block_over_steps(momentum: float | None) -> None:
    """Three steps, with momentum and with a cumulative average (which reads num_batches_tracked), and with Keep()
    on the BatchNorm inside the recomputed block: statistics and gradients as plain autograd's, bit for bit."""
    m = _conv_bn(momentum=momentum)
    torchckpt.checkpoint(m[1], policy=torchckpt.Keep())
    torchckpt.checkpoint(m, policy=torchckpt.Recompute())
    got, want = _bn_step(m, steps=3), _bn_step(_conv_bn(momentum=momentum), steps=3)
    assert _bn_same(got, want) == (True, True, True) and got[3] == 3


# -- transformers' KV cache under Recompute ------------------------------------------------------
def _tiny_llama(attn: str = "sdpa") -> tuple[nn.Module, nn.ModuleList]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation=attn)
    m = transformers.LlamaForCausalLM(cfg)
    m.train()
    return m, m.model.layers


_IDS = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(6))


def _hf_grads(m: nn.Module, use_cache: bool) -> dict[str, torch.Tensor | None]:
    m(_IDS, labels=_IDS, use_cache=use_cache).loss.backward()
    return grads(m)


def test_transformers_recompute_with_use_cache_false() -> None:
    want = _hf_grads(_tiny_llama()[0], use_cache=False)
    m, layers = _tiny_llama()
    for layer in layers:
        torchckpt.checkpoint(layer, policy=torchckpt.Recompute())
    assert _same(_hf_grads(m, use_cache=False), want)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_transformers_recompute_with_use_cache_true_raises_in_the_forward(attn: str) -> None:
    # The recomputation would append each layer's keys and values to the DynamicCache a second time: with SDPA the
    # cache would hold every token twice (gradients right), with eager attention backward would fail with a size
    # mismatch. Recompute sees the forward change the cache it was handed and refuses it there
    # (NOTE [ Mutating forwards ] Rule 2); the cache holds the first layer's tokens once.
    m, layers = _tiny_llama(attn)
    for layer in layers:
        torchckpt.checkpoint(layer, policy=torchckpt.Recompute())
    with pytest.raises(torchckpt.CheckpointError, match=r"LlamaDecoderLayer.*DynamicCache.*pass use_cache=False"):
        m(_IDS, labels=_IDS, use_cache=True)


def test_transformers_recompute_without_grad_keeps_the_cache() -> None:
    # Generation records no graph: the policies call the layer as it is, and the cache fills once.
    plain = _tiny_llama()[0]
    m, layers = _tiny_llama()
    for layer in layers:
        torchckpt.checkpoint(layer, policy=torchckpt.Recompute())
    with torch.no_grad():
        want, got = plain(_IDS, use_cache=True), m(_IDS, use_cache=True)
    assert got.past_key_values.get_seq_length() == 10
    assert torch.equal(got.logits, want.logits)


def test_transformers_offload_with_use_cache_true() -> None:
    want = _hf_grads(_tiny_llama()[0], use_cache=True)
    m, layers = _tiny_llama()
    store = cpu_store(0)
    for layer in layers:
        torchckpt.checkpoint(layer, policy=torchckpt.Offload(store))
    out = m(_IDS, labels=_IDS, use_cache=True)
    out.loss.backward()
    assert _same(grads(m), want)
    assert out.past_key_values.get_seq_length() == 10  # no rerun, no second append
    assert store.stats().offloaded > 0
