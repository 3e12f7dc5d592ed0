"""checkpoint()/offload()/run(): gradients bit-identical to plain autograd under every policy and API form."""
from __future__ import annotations

import copy
import functools
import inspect
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchckpt
from ckpt_models import MLP, Block, assert_same_grads, assert_same_state, clone, cpu_store, grads, make, step
from torchckpt import Keep, Offload, Recompute

POLICIES: dict[str, Callable[[], torchckpt.Policy]] = {
    "keep": Keep,
    "offload_b0": lambda: Offload(cpu_store(0)),
    "offload_small": lambda: Offload(cpu_store(2048)),
    "offload_large": lambda: Offload(cpu_store(64 << 20)),
    "recompute": Recompute,
    "recompute_store": lambda: Recompute(store=cpu_store(1024)),
}
FORMS = ["class", "instance", "call"]


def wrap(form: str, model: nn.Module, policy: torchckpt.Policy | None) -> tuple[Callable, nn.Module]:
    """Apply ``policy`` to a copy of ``model`` with one API form; return (callable, parameter owner)."""
    m = clone(model)
    if form in ("class", "class_bare"):
        cls = type(f"Ck{type(model).__name__}", (type(model),), {})
        cls = torchckpt.checkpoint(cls) if form == "class_bare" else torchckpt.checkpoint(policy)(cls)
        m.__class__ = cls
        return m, m
    if form == "instance":
        keys = list(m.state_dict())
        out = torchckpt.checkpoint(m, policy=policy)
        assert out is m and list(m.state_dict()) == keys
        return m, m
    if form == "call":
        return (lambda x: torchckpt.checkpoint(m, x, policy=policy)), m
    raise KeyError(form)


def store_of(policy: torchckpt.Policy) -> torchckpt.Store | None:
    return getattr(policy, "store", None)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("pname", list(POLICIES))
@pytest.mark.parametrize("kind", ["mlp", "cnn", "block"])
def test_gradients_identical(kind: str, pname: str, form: str) -> None:
    model, x = make(kind)
    model.train()
    policy = POLICIES[pname]()
    plain = clone(model)
    out_p, gx_p, g_p = step(plain, plain, x)

    fn, owner = wrap(form, model, policy)
    out, gx, g = step(fn, owner, x)
    assert torch.equal(out, out_p)
    assert torch.equal(gx, gx_p)
    assert_same_grads(g, g_p)

    assert_same_state(owner, plain)  # Recompute too: NOTE [ Buffers written in a forward ]

    store = store_of(policy)
    if store is not None:
        s = store.stats()
        assert s.offloaded > 0 and s.host.in_use_bytes == 0
        if store.cache.capacity == 0:
            assert s.misses == s.unpacks and s.cache_hits == 0


@pytest.mark.parametrize("kind", ["mlp", "cnn", "block"])
def test_bare_class_decorator_is_recompute(kind: str) -> None:
    model, x = make(kind)
    plain = clone(model)
    ref = step(plain, plain, x)
    fn, owner = wrap("class_bare", model, None)
    assert isinstance(type(owner).forward._torchckpt_policy, Recompute)
    out, gx, g = step(fn, owner, x)
    assert torch.equal(out, ref[0]) and torch.equal(gx, ref[1])
    assert_same_grads(g, ref[2])


def test_class_decorator_applies_to_every_instance_and_keeps_state_dict() -> None:
    store = cpu_store(0)

    @torchckpt.checkpoint(Offload(store))
    class Net(MLP):
        pass

    a, b = Net(), Net()
    assert list(a.state_dict()) == list(MLP().state_dict())
    x = torch.randn(4, 16)
    for m in (a, b):
        plain = MLP()
        plain.load_state_dict(m.state_dict())
        ref = step(plain, plain, x)
        got = step(m, m, x)
        assert torch.equal(got[1], ref[1])
        assert_same_grads(got[2], ref[2])
    assert store.stats().offloaded > 0


def test_rewrapping_an_instance_replaces_the_policy() -> None:
    # Replaced with a warning (policies on one module do not nest); the same policy again is a no-op.
    model, x = make("mlp")
    plain = clone(model)
    ref = step(plain, plain, x)
    s1, s2 = cpu_store(0), cpu_store(0)
    p2 = Offload(s2)
    m = torchckpt.checkpoint(clone(model), policy=Offload(s1))
    with pytest.warns(UserWarning, match="^torchckpt: this MLP instance was already wrapped"):
        assert torchckpt.checkpoint(m, policy=p2) is m
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchckpt.checkpoint(m, p2)
    got = step(m, m, x)
    assert_same_grads(got[2], ref[2])
    assert s1.stats().packed == 0 and s2.stats().offloaded > 0


def test_redecorating_a_class_replaces_the_policy() -> None:
    s1, s2 = cpu_store(0), cpu_store(0)
    p2 = Offload(s2)

    @torchckpt.checkpoint(Offload(s1))
    class Net(MLP):
        pass

    with pytest.warns(UserWarning, match="^torchckpt: class .*Net was already decorated"):
        assert torchckpt.checkpoint(p2)(Net) is Net
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchckpt.checkpoint(Net, policy=p2)
    m = Net()
    plain = MLP()
    plain.load_state_dict(m.state_dict())
    x = torch.randn(4, 16)
    ref, got = step(plain, plain, x), step(m, m, x)
    assert torch.equal(got[1], ref[1])
    assert_same_grads(got[2], ref[2])
    assert s1.stats().packed == 0 and s2.stats().offloaded > 0


def test_instance_policy_takes_the_place_of_the_class_policy() -> None:
    s1, s2 = cpu_store(0), cpu_store(0)

    @torchckpt.checkpoint(Offload(s1))
    class Net(MLP):
        pass

    m = torchckpt.checkpoint(Net(), policy=Offload(s2))
    plain = MLP()
    plain.load_state_dict(m.state_dict())
    x = torch.randn(4, 16)
    ref, got = step(plain, plain, x), step(m, m, x)
    assert_same_grads(got[2], ref[2])
    assert s1.stats().packed == 0 and s2.stats().offloaded > 0


# -- dropout, autocast -------------------------------------------------------------------
@pytest.mark.parametrize("pname", list(POLICIES))
def test_dropout_mask_reproduced(pname: str) -> None:
    model, x = make("block")
    model.drop.p = 0.5
    plain = clone(model)
    ref = step(plain, plain, x, seed=11)
    fn, owner = wrap("instance", model, POLICIES[pname]())
    got = step(fn, owner, x, seed=11)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert_same_grads(got[2], ref[2])
    # A different seed gives a different mask: the test above is not vacuous.
    other = step(plain, plain, x, seed=12)
    assert not torch.equal(other[0], ref[0])


def test_sdpa_dropout_reproduced_by_recompute() -> None:
    def attn(q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q * 0.5, q.sin(), dropout_p=0.3)

    x = torch.randn(2, 2, 8, 16)
    plain = nn.Linear(16, 16)
    ref = step(lambda t: attn(plain(t)), plain, x, seed=3)
    mod = clone(plain)
    got = step(lambda t: torchckpt.checkpoint(lambda u: attn(mod(u)), t, policy=Recompute()), mod, x, seed=3)
    assert torch.equal(got[1], ref[1])
    assert_same_grads(got[2], ref[2])


@pytest.mark.parametrize("pname", list(POLICIES))
@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_cpu_autocast_bf16(kind: str, pname: str) -> None:
    model, x = make(kind)
    plain = clone(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = step(plain, plain, x)
    if kind == "mlp":
        assert ref[0].dtype == torch.bfloat16  # autocast is really on
    fn, owner = wrap("instance", model, POLICIES[pname]())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = step(fn, owner, x)
    assert got[0].dtype == ref[0].dtype
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert_same_grads(got[2], ref[2])


# -- nesting -----------------------------------------------------------------------------
class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(32, 32)
        self.inner = Block()
        self.post = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(torch.tanh(self.inner(F.gelu(self.pre(x)))))


@pytest.mark.parametrize(
    "outer,inner",
    [("offload", "recompute"), ("recompute", "offload"), ("recompute", "recompute"), ("offload", "offload")],
)
def test_nesting(outer: str, inner: str) -> None:
    torch.manual_seed(5)
    model = Outer()
    x = torch.randn(2, 8, 32)
    plain = clone(model)
    ref = step(plain, plain, x)
    stores = []

    def pol(name: str) -> torchckpt.Policy:
        if name == "offload":
            stores.append(cpu_store(1024))
            return Offload(stores[-1])
        return Recompute()

    m = clone(model)
    torchckpt.checkpoint(m.inner, policy=pol(inner))
    torchckpt.checkpoint(m, policy=pol(outer))
    for _ in range(3):  # later steps follow a prefetch plan
        got = step(m, m, x)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        assert_same_grads(got[2], ref[2])
    for s in stores:
        st = s.stats()
        assert st.offloaded > 0 and st.host.in_use_bytes == 0


def test_recompute_around_offload_does_not_store_the_recomputation() -> None:
    # During backward, Recompute re-runs the inner Offload block; the tensors that re-run saves
    # belong to a graph that is thrown away, yet they go through the store (packed, cached,
    # written to host, evicting entries the backward still needs).
    torch.manual_seed(5)
    m = Outer()
    x = torch.randn(2, 8, 32)
    s = cpu_store(2048)
    torchckpt.checkpoint(m.inner, policy=Offload(s))
    torchckpt.checkpoint(m, policy=Recompute())
    out = m(x * 1.0)
    fwd = s.stats()
    assert fwd.offloaded > 0
    out.square().mean().backward()
    bwd = s.stats()
    moved = (bwd.packed - bwd.kept) - (fwd.packed - fwd.kept)
    assert moved == 0, f"{moved} tensors saved by the recomputation became store entries"


# -- frozen parameters, inputs without grad ------------------------------------------------
@pytest.mark.parametrize("pname", list(POLICIES))
def test_frozen_params_and_input_without_grad(pname: str) -> None:
    model, x = make("mlp")
    model.layers[0].requires_grad_(False)
    model.layers[1].bias.requires_grad_(False)
    plain = clone(model)

    def run(fn: Callable, owner: nn.Module) -> dict:
        owner.zero_grad(set_to_none=True)
        fn(x).square().mean().backward()  # x does not require grad
        return grads(owner)

    ref = run(plain, plain)
    fn, owner = wrap("instance", model, POLICIES[pname]())
    got = run(fn, owner)
    assert got["layers.0.weight"] is None and got["layers.1.bias"] is None
    assert_same_grads(got, ref)


def test_block_whose_inputs_need_no_grad_recompute() -> None:
    # Nothing inside needs grad: the call still works and returns the plain value.
    lin = nn.Linear(8, 8).requires_grad_(False)
    x = torch.randn(3, 8)
    for policy in (Recompute(), Offload(cpu_store(0)), Keep()):
        out = torchckpt.checkpoint(lin, x, policy=policy)
        assert torch.equal(out, lin(x)) and not out.requires_grad


# -- call form: keyword arguments, tuple and non-tensor outputs -----------------------------
def fn_kw(x: torch.Tensor, w: torch.Tensor, *, scale: float = 1.0, bias: torch.Tensor | None = None, flag: bool = False):
    y = torch.tanh(x @ w) * scale
    if bias is not None:
        y = y + bias.sin()
    z = y.exp() if flag else y.cos()
    return y, {"aux": z, "n": 3, "name": "block"}, 7


@pytest.mark.parametrize("pname", list(POLICIES))
def test_call_form_kwargs_and_structured_outputs(pname: str) -> None:
    g = torch.Generator().manual_seed(0)
    x0, w0, b0 = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g), torch.randn(8, generator=g)

    def run(call: Callable) -> tuple:
        x, w, b = (t.clone().requires_grad_(True) for t in (x0, w0, b0))
        y, d, n = call(x * 1.0, w, scale=0.5, bias=b, flag=True)
        (y.sum() + d["aux"].pow(2).sum()).backward()
        return y.detach(), d["aux"].detach(), d["n"], d["name"], n, x.grad, w.grad, b.grad

    ref = run(fn_kw)
    policy = POLICIES[pname]()
    got = run(lambda *a, **k: torchckpt.checkpoint(fn_kw, *a, policy=policy, **k))
    assert got[2:5] == (3, "block", 7)
    for a, b in zip(got[:2] + got[5:], ref[:2] + ref[5:]):
        assert torch.equal(a, b)


def test_keyword_arguments_reach_module_forward() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, *, scale: float = 1.0, extra: torch.Tensor | None = None) -> torch.Tensor:
            y = self.lin(x).relu() * scale
            return y if extra is None else y * extra.sigmoid()

    torch.manual_seed(0)
    plain = Scaled()
    x, e = torch.randn(4, 8), torch.randn(8)
    for pname, make_policy in POLICIES.items():
        m = torchckpt.checkpoint(clone(plain), policy=make_policy())
        for mod in (plain, m):
            mod.zero_grad()
            mod(x, scale=3.0, extra=e).sum().backward()
        assert_same_grads(grads(m), grads(plain)), pname


# -- offload() context manager -------------------------------------------------------------
@pytest.mark.parametrize("budget", [0, 1024, 64 << 20])
def test_offload_context_manager(budget: int) -> None:
    model, x = make("block")
    plain = clone(model)
    ref = step(plain, plain, x)
    m = clone(model)
    store = cpu_store(budget)

    def fwd(t: torch.Tensor) -> torch.Tensor:
        with torchckpt.offload(store, keep=list(m.buffers())):
            return m(t)

    got = step(fwd, m, x)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert_same_grads(got[2], ref[2])
    s = store.stats()
    assert s.offloaded > 0 and s.kept > 0  # LayerNorm weights kept by reference
    assert s.host.in_use_bytes == 0


def test_offload_context_default_store() -> None:
    store = torchckpt.default_store()
    assert torchckpt.default_store(store.device) is store
    assert store.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    before = store.stats().packed
    x = torch.randn(32, 32, device=store.device, requires_grad=True)
    with torchckpt.offload():
        loss = (x.sin() * 2).sum()
    loss.backward()
    assert torch.equal(x.grad, x.detach().cos() * 2)
    assert store.stats().packed > before


# -- several steps: the prefetch plan ------------------------------------------------------
def deep_mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(4)
    return MLP(d_in=64, d=64, d_out=64, depth=8), torch.randn(8, 64)


@pytest.mark.parametrize("form", ["offload_context", "wrapper"])
def test_steps_follow_the_prefetch_plan(form: str) -> None:
    # Budget: 4 activations; every saved activation is 1 (8x64 fp32). Weights are parameters
    # and must stay by reference (NOTE [ Store ] Rule 1) -- including the transposed view of
    # each weight that addmm saves; "wrapper" relies on the store doing that by itself.
    model, x = deep_mlp()
    act = x.numel() * 4
    store = cpu_store(4 * act)
    plain = clone(model)
    m = clone(model)
    if form == "wrapper":
        fn = torchckpt.checkpoint(m, policy=Offload(store))
    else:
        def fn(t: torch.Tensor) -> torch.Tensor:
            with torchckpt.offload(store, keep=list(m.parameters())):
                return m(t)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_m = torch.optim.SGD(m.parameters(), lr=0.1)
    prev = store.stats()
    for i in range(5):
        ref = step(plain, plain, x, seed=i)
        got = step(fn, m, x, seed=i)
        assert torch.equal(got[1], ref[1])
        assert_same_grads(got[2], ref[2])
        opt_p.step()
        opt_m.step()
        s = store.stats()
        misses, pf = s.misses - prev.misses, s.prefetch_hits - prev.prefetch_hits
        assert s.host.in_use_bytes == 0
        if i == 0:
            assert misses > 0 and pf == 0 and store.plan is None
        else:
            assert misses == 0, f"step {i + 1}: {misses} misses"
            assert pf > 0, f"step {i + 1}: no prefetch hits"
        prev = s
    s = store.stats()
    assert s.plans == 1 and s.plan_divergences == 0 and s.prefetch_hits > 0


# -- retain_graph, no_grad -----------------------------------------------------------------
@pytest.mark.parametrize("pname", list(POLICIES))
def test_retain_graph_double_backward(pname: str) -> None:
    model, x = make("block")

    def run(fn: Callable, owner: nn.Module) -> tuple:
        owner.zero_grad(set_to_none=True)
        xl = x.clone().requires_grad_(True)
        torch.manual_seed(9)
        loss = fn(xl * 1.0).square().mean()
        loss.backward(retain_graph=True)
        first = grads(owner)
        loss.backward()
        return xl.grad, first, grads(owner)

    plain = clone(model)
    ref = run(plain, plain)
    policy = POLICIES[pname]()
    fn, owner = wrap("instance", model, policy)
    for _ in range(2):
        got = run(fn, owner)
        assert torch.equal(got[0], ref[0])
        assert_same_grads(got[1], ref[1])
        assert_same_grads(got[2], ref[2])
    store = store_of(policy)
    if store is not None:
        assert store.stats().host.in_use_bytes == 0


@pytest.mark.parametrize("pname", list(POLICIES))
def test_no_grad_forward(pname: str) -> None:
    model, x = make("block")
    model.eval()
    policy = POLICIES[pname]()
    fn, _ = wrap("instance", model, policy)
    with torch.no_grad():
        ref = model(x)
        out = fn(x)
    assert torch.equal(out, ref) and not out.requires_grad
    store = store_of(policy)
    if store is not None:
        assert store.stats().packed == 0


def test_wrapped_module_deepcopy_runs_its_own_parameters() -> None:
    # A copy of a wrapped module (EMA, model averaging) must use the copy's parameters.
    # Library bug: _wrap_instance stores a closure over the original module in
    # module.__dict__["forward"]; deepcopy shares that closure, so the copy runs the original.
    model, x = make("mlp")
    m = torchckpt.checkpoint(clone(model), policy=Recompute())
    c = copy.deepcopy(m)
    with torch.no_grad():
        for p in c.parameters():
            p.mul_(2)
    assert not torch.equal(c(x), m(x))


# -- call semantics of torch.utils.checkpoint.checkpoint (NOTE [ checkpoint forms ] Rule 4) -------
@pytest.mark.parametrize("pname", [*POLICIES, "default"])
def test_call_form_with_no_call_arguments_calls_the_function(pname: str) -> None:
    # transformers: checkpoint_fn(partial(layer.__call__, **kwargs), *args) with args empty when
    # the model passes everything by keyword; checkpoint_fn = partial(checkpoint, **options).
    # Library bug: checkpoint(fn, policy=P) returned fn wrapped instead of calling it.
    model, x = make("block")
    plain = clone(model)
    ref = step(plain, plain, x)
    m = clone(model)
    ckpt_fn = torchckpt.checkpoint if pname == "default" else functools.partial(torchckpt.checkpoint, policy=POLICIES[pname]())
    got = step(lambda t: ckpt_fn(functools.partial(m.__call__, x=t)), m, x)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert_same_grads(got[2], ref[2])
    got = step(lambda t: ckpt_fn(m, x=t), m, x)  # a module with keyword arguments only is called too
    assert torch.equal(got[1], ref[1])
    assert_same_grads(got[2], ref[2])


@pytest.mark.parametrize("pname", list(POLICIES))
def test_call_form_of_a_closure_with_no_arguments(pname: str) -> None:
    w0 = torch.randn(8, 8)

    def run(call: Callable) -> torch.Tensor:
        w = w0.clone().requires_grad_(True)
        call(lambda: (w @ w).tanh().exp().sum()).backward()
        return w.grad

    ref = run(lambda fn: fn())
    policy = POLICIES[pname]()
    got = run(lambda fn: torchckpt.checkpoint(fn, policy=policy))
    assert torch.equal(got, ref)


@pytest.mark.parametrize("pname", list(POLICIES))
def test_function_decorator_forms(pname: str) -> None:
    policy = POLICIES[pname]()

    def body(x: torch.Tensor, w: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return torch.tanh(x @ w).exp() * scale

    forms = {
        "decorator": torchckpt.checkpoint(policy)(body),
        "keyword": torchckpt.checkpoint(policy=policy)(body),
        "default": torchckpt.checkpoint()(body),
    }
    x0, w0 = torch.randn(4, 8), torch.randn(8, 8)

    def run(fn: Callable) -> tuple:
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        fn(x * 1.0, w, scale=0.5).square().sum().backward()
        return x.grad, w.grad

    ref = run(body)
    for name, fn in forms.items():
        assert fn.__name__ == "body", name
        got = run(fn)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), name


def test_torch_checkpoint_keywords_do_not_reach_the_block() -> None:
    # torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False) never passes use_reentrant to fn.
    x0 = torch.randn(4, 8)

    def run(call: Callable) -> torch.Tensor:
        x = x0.clone().requires_grad_(True)
        call(x).sum().backward()
        return x.grad

    ref = run(f_sin_exp)
    for policy in (Recompute(), Offload(cpu_store(0)), Keep(), None):
        got = run(lambda x: torchckpt.checkpoint(f_sin_exp, x, use_reentrant=False, policy=policy))
        assert torch.equal(got, ref)


def f_sin_exp(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp()


def test_wrapping_keeps_a_forward_the_instance_already_has() -> None:
    # Libraries (accelerate's hooks) set module.forward on the instance; wrapping runs that one.
    model, x = make("mlp")

    def doubled(self: nn.Module, t: torch.Tensor) -> torch.Tensor:
        return type(self).forward(self, t) * 2

    plain = clone(model)
    plain.forward = functools.partial(doubled, plain)
    ref = step(plain, plain, x)
    m = clone(model)
    m.forward = functools.partial(doubled, m)
    s = cpu_store(0)
    torchckpt.checkpoint(m, policy=Offload(s))
    got = step(m, m, x)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert_same_grads(got[2], ref[2])
    assert s.stats().offloaded > 0


def test_signature_of_a_wrapped_forward() -> None:
    # inspect.signature(model.forward) (used by transformers and others) sees the real parameters.
    m = torchckpt.checkpoint(Block(), policy=Recompute())
    assert inspect.signature(m.forward) == inspect.signature(Block().forward)
    assert list(inspect.signature(m.forward).parameters) == ["x"]
