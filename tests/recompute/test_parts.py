"""Recompute(parts=...): a block's saved tensors recomputed one part at a time (NOTE [ Recompute in parts ])."""
from __future__ import annotations

import pickle
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import torchckpt
from ckpt_models import Block, cpu_store
from torchckpt import Recompute
from torchckpt._errors import CheckpointError
from torchckpt.recompute import parts
from torchckpt.recompute.parts import part_bytes

aten = torch.ops.aten
MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default})
ATTENTION = frozenset(getattr(aten, n).default for n in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention") if hasattr(aten, n))


def saved_count(f: Any, *args: Any, **kwargs: Any) -> int:
    """How many tensors ``f`` saves for backward (the N that cuts must stay below)."""
    n = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal n
        n += 1
        return t

    with torch.random.fork_rng(devices=[]), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        f(*args, **kwargs)
    return n


def spread(n: int, k: int) -> tuple[int, ...]:
    """``k`` cuts spread over ``n`` saved tensors."""
    return tuple(sorted({max(1, n * j // (k + 1)) for j in range(1, k + 1)}))


def run_grads(f: Any, params: list[torch.Tensor], x: torch.Tensor, seed: int = 7, **kwargs: Any) -> list[torch.Tensor]:
    """The output and the gradients of the input and of ``params``, from a fixed seed (dropout)."""
    torch.manual_seed(seed)
    out = f(x * 1.0, **kwargs)  # a non-leaf input: a store sees it
    return [out.detach(), *torch.autograd.grad(out.square().sum(), [x, *params])]


def assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for j, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"tensor {j}: max abs diff {(u - v).abs().max().item()}"


def block(p: float = 0.1) -> tuple[nn.Module, torch.Tensor, int]:
    """The GPT-like block of ckpt_models (LayerNorm, Linear, causal SDPA, GELU, residuals, dropout ``p``), an input,
    and the number of tensors it saves."""
    torch.manual_seed(3)
    m = Block(d=32, heads=4, p=p)
    x = torch.randn(2, 8, 32, requires_grad=True)
    return m, x, saved_count(m, x * 1.0)


def under(policy: Recompute, m: nn.Module) -> Any:
    return lambda y, **kw: torchckpt.api.run(policy, m, y, module=m, **kw)


# -- gradients ------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_gradients_bit_identical_to_plain_autograd(k: int, p: float) -> None:
    m, x, n = block(p)
    params = list(m.parameters())
    ref = run_grads(m, params, x)
    got = run_grads(under(Recompute(parts=spread(n, k)), m), params, x)
    assert_equal(ref, got)


def test_dropout_masks_need_the_rng_restored() -> None:
    """The test above can fail: without the RNG state restored, the recomputations draw other dropout masks."""
    m, x, n = block(0.5)
    params = list(m.parameters())
    ref = run_grads(m, params, x)
    got = run_grads(under(Recompute(parts=spread(n, 2), preserve_rng_state=False), m), params, x)
    assert not all(torch.equal(u, v) for u, v in zip(ref[1:], got[1:]))


@pytest.mark.parametrize("store", [None, "resident", "evicted"])
@pytest.mark.parametrize("save", ["overloads", "positions", "all"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_with_kept_outputs(save: str, store: str | None, k: int) -> None:
    m, x, n = block(0.1)
    params = list(m.parameters())
    ops = {"overloads": MATMULS | ATTENTION, "positions": frozenset({1, 4, 9, 17, 30}),
           "all": frozenset(range(400))}[save]
    st = None if store is None else cpu_store(0 if store == "evicted" else 1 << 30)
    ref = run_grads(m, params, x)
    with parts.measure() as meter:
        got = run_grads(under(Recompute(save=ops, store=st, parts=spread(n, k)), m), params, x)
    assert_equal(ref, got)
    stats = meter.blocks[0]
    assert stats.recomputations == k + 1
    assert stats.kept == 0  # every kept output released by the end of backward (NOTE [ Recompute in parts ] Rule 7)
    if store == "evicted":
        assert st is not None and st.stats().offloaded > 0


def test_kept_outputs_are_handed_to_every_recomputation_that_runs_their_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Recompute in parts ] Rule 7: a kept matmul output comes back in each recomputation that reaches it; none
    runs a kept op."""
    m, x, n = block(0.0)
    runs: list[list[int]] = []
    enter = parts._Handing.__enter__
    take = parts._Handing.take

    def entering(self: Any) -> Any:
        runs.append([])
        return enter(self)

    def taking(self: Any, k: int) -> Any:
        runs[-1].append(k)
        return take(self, k)

    monkeypatch.setattr(parts._Handing, "__enter__", entering)
    monkeypatch.setattr(parts._Handing, "take", taking)
    params = list(m.parameters())
    ref = run_grads(m, params, x)
    got = run_grads(under(Recompute(save=MATMULS, parts=spread(n, 2)), m), params, x)
    assert_equal(ref, got)
    assert len(runs) == 3 and len(runs[0]) > len(runs[1]) > 0  # the last part's run is the longest
    assert runs[1] == runs[0][:len(runs[1])] and runs[2] == runs[0][:len(runs[2])]


def test_boundary_inputs_through_a_store() -> None:
    m, x, n = block(0.1)
    params = list(m.parameters())
    st = cpu_store(0)
    ref = run_grads(m, params, x)
    got = run_grads(under(Recompute(store=st, parts=spread(n, 2)), m), params, x)
    assert_equal(ref, got)
    assert st.stats().offloaded == 1  # the block's input, once; the block's own tensors are recomputed


def test_keyword_arguments_and_non_tensor_outputs() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    bias = torch.randn(16, requires_grad=True)

    def f(x: torch.Tensor, *, scale: float, extra: dict[str, torch.Tensor], tag: str = "") -> tuple[Any, ...]:
        h = F.gelu(lin(x) * scale + extra["bias"])
        h = F.dropout(h, 0.3, training=True)
        return (h.tanh() * extra["w"]).sin(), tag + "!", 3

    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(16)  # an input that needs no grad
    params = [*lin.parameters(), bias]

    def kw() -> dict[str, Any]:
        return dict(scale=0.5, extra={"bias": bias * 1.0, "w": w}, tag="t")

    def loss_grads(g: Any) -> list[torch.Tensor]:
        torch.manual_seed(5)
        out, tag, three = g(x * 1.0, **kw())
        assert (tag, three) == ("t!", 3)
        return [out.detach(), *torch.autograd.grad(out.square().sum(), [x, *params])]

    n = saved_count(f, x * 1.0, **kw())
    ref = loss_grads(f)
    for k in (1, 2):
        got = loss_grads(lambda y, **kws: torchckpt.checkpoint(f, y, policy=Recompute(parts=spread(n, k)), **kws))
        assert_equal(ref, got)


def test_inputs_that_need_no_grad_and_a_partial_backward() -> None:
    m, x, n = block(0.1)
    params = list(m.parameters())
    xs = x.detach()
    torch.manual_seed(7)
    ref = torch.autograd.grad(m(xs).square().sum(), params[:3])
    torch.manual_seed(7)
    with parts.measure() as meter:
        y = torchckpt.api.run(Recompute(parts=spread(n, 2)), m, xs, module=m)
    got = torch.autograd.grad(y.square().sum(), params[:3])  # reaches only the block's first parameters
    assert_equal(list(ref), list(got))
    del y
    assert meter.live_bytes == 0  # what was recomputed for the tensors backward did not reach died with them


def test_autocast_state_is_restored() -> None:
    m, x, n = block(0.0)
    params = list(m.parameters())

    def autocast_grads(f: Any) -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = f(x * 1.0)
        return [out.detach(), *torch.autograd.grad(out.float().square().sum(), [x, *params])]  # outside autocast

    ref = autocast_grads(m)
    assert_equal(ref, autocast_grads(under(Recompute(parts=spread(n, 2)), m)))
    assert not torch.equal(ref[-1], run_grads(m, params, x)[-1])  # autocast changes them: restoring it matters


# -- memory and recomputations (NOTE [ Recompute in parts ] Rules 3, 5, 10) ------------------------------------
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_largest_part_alive_not_the_sum(k: int) -> None:
    m, x, n = block(0.0)
    cuts = {0: (), 1: (12,), 2: (7, 14), 3: (5, 12, 19)}[k]  # between the saves of its ops (n == 24)
    assert n == 24
    with parts.measure() as meter:
        y = torchckpt.api.run(Recompute(parts=cuts), m, x * 1.0, module=m)
    whole = sum(part_bytes(meter.blocks[0].sizes, ()))  # what Recompute() holds at once (each storage once)
    y.square().sum().backward()
    stats = meter.blocks[0]
    assert stats.recomputations == k + 1  # one forward re-run per part
    assert stats.peak_bytes == max(stats.part_bytes)
    assert stats.live_bytes == 0  # each recomputed tensor was released at its unpack
    if k:
        assert stats.peak_bytes < whole
    else:
        assert stats.peak_bytes == whole


def test_a_cut_inside_a_node_holds_more_than_its_largest_part() -> None:
    """NOTE [ Recompute in parts ] Rule 11: attention saves q, k, v, its log-sum-exp and its output (positions 7-11):
    cut among them, its backward recomputes the earlier part while holding the later part's tensors of that node."""
    m, x, n = block(0.0)
    with parts.measure() as meter:
        y = torchckpt.api.run(Recompute(parts=(8, 20, 22)), m, x * 1.0, module=m)
    y.square().sum().backward()
    stats = meter.blocks[0]
    assert stats.nodes == [0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3, 4, 4, 4, 4, 4, 5, 5, 6, 7, 7]
    assert stats.peak_bytes > max(stats.part_bytes)
    starts = [i for i in range(1, n) if stats.nodes[i] != stats.nodes[i - 1]]
    assert {5, 12, 19, 7, 14} <= set(starts)  # the cuts of test_largest_part_alive_not_the_sum


def test_part_bytes() -> None:
    assert part_bytes([4, 0, 8, 8, 2], (2, 4)) == [4, 16, 2]
    assert part_bytes([1, 2, 3], ()) == [6]
    assert part_bytes([], ()) == [0]


@pytest.mark.parametrize("retain", [False, True])
def test_released_as_unpacked(retain: bool) -> None:
    """NOTE [ Recompute in parts ] Rule 5: a recomputed tensor is gone once backward has used it, the graph retained or
    not (its holder then lives on); the part's others stay until theirs."""
    x = torch.randn(256, requires_grad=True)
    levels: list[int] = []
    used: list[StorageWeakRef] = []
    leaks: list[int] = []

    class Use(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            ctx.save_for_backward(t)
            return t.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            (a,) = ctx.saved_tensors
            leaks.append(sum(not r.expired() for r in used))  # storages used before this one (both of their saves)
            used.append(StorageWeakRef(a.untyped_storage()))
            levels.append(meter.live_bytes)
            return g

    def f(t: torch.Tensor) -> torch.Tensor:
        for _ in range(6):
            t = Use.apply(t.exp())  # exp saves its result, Use saves it too: 2 saves, 1 storage per step
        return t

    with parts.measure() as meter:
        y = torchckpt.checkpoint(f, x, policy=Recompute(parts=(6,)))
    y.sum().backward(retain_graph=retain)
    assert meter.recomputations == 2 and meter.peak_bytes == 3 * 1024
    assert levels == [3072, 2048, 1024, 3072, 2048, 1024]  # after each Use's unpack: part 1, then part 0
    assert leaks == [0] * 6


def test_recomputation_drops_what_its_part_does_not_keep() -> None:
    """NOTE [ Recompute in parts ] Rule 3: a recomputation's own graph holds no saved tensor, so the earlier parts'
    tensors die as the block's frame lets go of them (the forward holds none either)."""
    x = torch.randn(256, requires_grad=True)
    made: list[StorageWeakRef] = []
    alive: list[int] = []

    class Look(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            alive.append(sum(not r.expired() for r in made))
            made.append(StorageWeakRef(t.untyped_storage()))
            return t * 1.0

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            made.clear()  # each recomputation is looked at on its own
            return g

    def f(t: torch.Tensor) -> torch.Tensor:
        for _ in range(6):
            t = Look.apply(t.exp())  # exp saves its result (position j); Look saves nothing
        return t

    y = torchckpt.checkpoint(f, x, policy=Recompute(parts=(3,)))
    assert alive == [0] * 6
    y.sum().backward()
    # part 1 (positions 3-5) runs to exp 5's save: the exp results 3 and 4 are alive, 0-2 died; part 0 runs to exp 2's
    assert alive == [0] * 6 + [0, 0, 0, 0, 1] + [0, 1]


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,err", [([0, 3], ValueError), ((3, 1), ValueError), ((2, 2), ValueError),
                                     ((1.5,), TypeError), ("12", TypeError), ((True,), TypeError), (3, TypeError)])
def test_bad_cuts(bad: Any, err: type) -> None:
    with pytest.raises(err, match=r"^torchckpt: Recompute\(parts=\.\.\.\) expects .*pass"):
        Recompute(parts=bad)


def test_cuts_are_normalised() -> None:
    assert Recompute(parts=[2, 5]).parts == (2, 5)
    assert Recompute(parts={5, 2}).parts == (2, 5)
    assert Recompute(parts=()).parts == ()
    r = pickle.loads(pickle.dumps(Recompute(parts=(2, 5))))
    assert r.parts == (2, 5) and "parts=(2, 5)" in repr(r)


def test_cut_beyond_the_saved_tensors() -> None:
    m, x, n = block(0.0)
    with pytest.raises(ValueError, match=rf"^torchckpt: Recompute\(parts=\(3, {n}\)\) .* saves {n} tensors"):
        torchckpt.api.run(Recompute(parts=(3, n)), m, x, module=m)
    torchckpt.api.run(Recompute(parts=(3, n - 1)), m, x, module=m)  # the last part holds one tensor
    with torch.no_grad():  # nothing saved: nothing to check
        torchckpt.api.run(Recompute(parts=(3, n)), m, x, module=m)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    torchckpt.api.run(Recompute(parts=(5,)), frozen, torch.randn(2, 4), module=frozen)  # saves nothing


def test_backward_twice() -> None:
    m, x, n = block(0.1)
    params = list(m.parameters())
    ref = run_grads(m, params, x)
    torch.manual_seed(7)
    y = torchckpt.api.run(Recompute(parts=spread(n, 2)), m, x * 1.0, module=m)
    loss = y.square().sum()
    first = torch.autograd.grad(loss, [x, *params], retain_graph=True)
    again = torch.autograd.grad(loss, [x, *params])  # NOTE [ Recompute in parts ] Rule 8: recomputed again, same dropout masks
    assert_equal(ref[1:], list(first))
    assert_equal(ref[1:], list(again))
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_backward_twice_with_kept_outputs_raises() -> None:
    m, x, n = block(0.0)
    y = torchckpt.api.run(Recompute(save=MATMULS, parts=spread(n, 2)), m, x * 1.0, module=m)
    y.sum().backward(retain_graph=True)
    with pytest.raises(CheckpointError, match=r"^torchckpt: a second backward through a block under Recompute\(save"):
        y.sum().backward()


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(t)
        return t * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (a,) = ctx.saved_tensors
        (b,) = ctx.saved_tensors
        return g * 2 + 0 * (a + b)


def test_a_saved_tensor_unpacked_twice_raises() -> None:
    x = torch.randn(8, requires_grad=True)
    y = torchckpt.checkpoint(lambda t: _Twice.apply(t.exp()).sin(), x, policy=Recompute(parts=(1,)))
    with pytest.raises(CheckpointError, match=r"^torchckpt: saved tensor 1 .* unpacked twice in one backward"):
        y.sum().backward()


def test_non_deterministic_blocks_raise() -> None:
    flip = {"on": False}

    def f(t: torch.Tensor) -> torch.Tensor:
        t = t.exp()
        t = t.sin() if not flip["on"] else t[:4].sin()
        return t.cos().tanh()

    x = torch.randn(8, requires_grad=True)
    y = torchckpt.checkpoint(f, x, policy=Recompute(parts=(1,)))
    flip["on"] = True
    with pytest.raises(CheckpointError, match=r"^torchckpt: recomputing .* saved tensor 1 with .*\(4,\).*\(8,\).*debug=True"):
        y.sum().backward()
    flip["on"] = False
    y = torchckpt.checkpoint(f, x, policy=Recompute(parts=(1,), debug=True))
    flip["on"] = True
    with pytest.raises(CheckpointError, match=r"(?s)Ops of the forward from 1 on: \['aten.sin.default'.*"
                                              r"Ops of the recomputation from 1 on: \['aten.slice.Tensor'"):
        y.sum().backward()

    def fewer(t: torch.Tensor) -> torch.Tensor:
        return t.exp().sin().cos() if not flip["on"] else t.exp() * 1.0

    flip["on"] = False
    y = torchckpt.checkpoint(fewer, x, policy=Recompute(parts=(1,), determinism_check="none"))
    flip["on"] = True
    with pytest.raises(CheckpointError, match=r"saved 1 tensors before the block's forward returned, where the forward "
                                              r"saved 3"):
        y.sum().backward()


def test_grad_inside_the_block_raises() -> None:
    def f(t: torch.Tensor) -> torch.Tensor:
        u = t.exp().sin()
        (g,) = torch.autograd.grad(u.sum(), t, create_graph=True)
        return g * u

    x = torch.randn(8, requires_grad=True)
    with pytest.raises(CheckpointError, match=r"^torchckpt: backward through the saved tensors .* Recompute\(\)"):
        torchckpt.checkpoint(f, x, policy=Recompute(parts=(1,)))


# -- nesting, unpacks outside backward, torch.compile ----------------------------------------------------------
def test_nested_checkpoints() -> None:
    m, x, n = block(0.1)
    inner = Block(d=32, heads=4, p=0.1)
    params = [*m.parameters(), *inner.parameters()]

    def plain(y: torch.Tensor) -> torch.Tensor:
        return inner(m(y))

    def torch_inside(y: torch.Tensor) -> torch.Tensor:  # torch's checkpoint inside a block in parts
        return inner(torch_checkpoint(m, y, use_reentrant=False))

    def ours_inside(y: torch.Tensor) -> torch.Tensor:  # a block in parts inside another
        return inner(torchckpt.api.run(Recompute(parts=spread(n, 1)), m, y, module=m))

    ref = run_grads(plain, params, x)
    n2 = saved_count(torch_inside, x * 1.0)
    assert_equal(ref, run_grads(lambda y: torchckpt.checkpoint(torch_inside, y, policy=Recompute(parts=spread(n2, 2))),
                                params, x))
    n3 = saved_count(ours_inside, x * 1.0)
    assert_equal(ref, run_grads(lambda y: torchckpt.checkpoint(ours_inside, y, policy=Recompute(parts=spread(n3, 2))),
                                params, x))
    assert_equal(ref, run_grads(lambda y: torchckpt.checkpoint(ours_inside, y, policy=Recompute()), params, x))


def test_unpack_outside_backward() -> None:
    x = torch.randn(8, requires_grad=True)
    with parts.measure() as meter:
        y = torchckpt.checkpoint(lambda t: t.sin().exp(), x, policy=Recompute(parts=(1,)))
    assert torch.equal(y.grad_fn._saved_result, x.detach().sin().exp())  # type: ignore[union-attr]
    assert meter.live_bytes == 0
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().cos() * x.detach().sin().exp())


def test_under_torch_compile_the_block_is_recomputed_whole() -> None:
    m, x, n = block(0.0)
    params = list(m.parameters())
    ref = run_grads(m, params, x)
    torch._dynamo.reset()
    wrapped = torchckpt.checkpoint(Block(d=32, heads=4, p=0.0), policy=Recompute(parts=spread(n, 2)))
    wrapped.load_state_dict(m.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run_grads(torch.compile(wrapped, backend="aot_eager"), list(wrapped.parameters()), x)
    assert_equal(ref, got)
