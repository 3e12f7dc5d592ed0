"""NOTE [ Graphed recompute ] off CUDA and its arguments: ``Recompute(graphed=True)`` is ``Recompute(reentrant=True)``
with the same checks, runs eagerly on the CPU (the same bits as plain autograd) and counts those backwards; its
signature takes only immutable arguments. The CUDA side: tests/recompute/test_graphed_cuda.py."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchckpt
from ckpt_models import assert_same_grads, grads
from torchckpt import Recompute
from torchckpt.recompute import graphed


def test_graphed_implies_reentrant_and_its_checks() -> None:
    p = Recompute(graphed=True)
    assert p.reentrant and p.graphed
    with pytest.raises(ValueError, match="reentrant=True"):
        Recompute(graphed=True, save=frozenset({torch.ops.aten.mm.default}))
    with pytest.raises(TypeError, match=r"torchckpt: Recompute\(graphed=...\) expects True or False"):
        Recompute(graphed=1)  # type: ignore[arg-type]


def test_cpu_blocks_run_eagerly_with_plain_bits() -> None:
    graphed.clear()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.GELU()) for _ in range(3)])
    ref = copy.deepcopy(model)
    for b in model:
        torchckpt.checkpoint(b, policy=Recompute(graphed=True))
    x = torch.randn(16, 8, requires_grad=True)
    for step in range(3):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
        assert_same_grads(grads(model), grads(ref))
        for (n, a), (_, b) in zip(model.named_buffers(), ref.named_buffers()):
            assert torch.equal(a, b), f"step {step}: buffer {n}"
    st = graphed.stats()
    assert st.get("captures", 0) == 0 and st["eager"] == 9, st  # CPU tensors: no signature (Rule 6)
    assert graphed.pool_bytes() == 0


@pytest.mark.parametrize(("value", "plain"), [
    (None, True), (3, True), (0.5, True), ("causal", True), (torch.float16, True), ((1, (2, "a")), True),
    ([1, 2], False), ({"a": 1}, False), (object(), False), ((1, [2]), False),
])
def test_signature_takes_immutable_values_only(value: object, plain: bool) -> None:
    assert graphed._plain(value) is plain


def test_reads_sees_a_tensor_held_outside_through_a_view() -> None:
    """NOTE [ Graphed recompute ] Rule 3's watch on the CPU: a tensor held outside the call and read through a view
    (transformers' rotary tables) is reported while alive; a temporary made outside the watch and dropped, an allowed
    tensor and memory an op made are not. Before views were told apart, the view's output counted the table's
    memory as made and the table went unreported (a wrong gradient on the H100)."""
    table = torch.arange(4.0)
    allowed = torch.ones(4)
    x = torch.randn(3, 4)
    reads = graphed._Reads(graphed._storages([allowed, x]))
    temp = torch.zeros(4)
    with reads:
        y = (x * table.unsqueeze(0)).sum() + (x * allowed).sum() + (x * temp).sum()
        z = y.exp().view(1)
        z.add_(1)
    del temp
    assert reads.outside() == [(4,)]  # the table alone
    del table
    assert reads.outside() == []


def test_draws_reads_the_dropout_probability() -> None:
    """NOTE [ Graphed recompute ] Rule 8's tag: an op tagged ``nondeterministic_seeded`` draws unless its dropout
    probability is 0 or it is not training."""
    aten = torch.ops.aten
    x = torch.ones(4)
    assert graphed._draws(aten.native_dropout.default, (x, 0.1, True), {})
    assert not graphed._draws(aten.native_dropout.default, (x, 0.0, True), {})
    assert not graphed._draws(aten.native_dropout.default, (x, 0.1, False), {})
    assert graphed._draws(aten.bernoulli_.float, (x, 0.5), {})
    assert graphed._draws(aten.randn.default, ([2],), {})
    assert not graphed._draws(aten.add.Tensor, (x, x), {})
    q = torch.randn(1, 1, 4, 8)
    assert not graphed._draws(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q), {"dropout_p": 0.0})
    assert graphed._draws(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, 0.2), {})


@pytest.mark.parametrize(("fn", "what"), [
    (lambda x: x.sum().item(), "_local_scalar_dense"),
    (lambda x: torch.nonzero(x > 0), "nonzero"),
    (lambda x: x[x > 0], "index"),
])
def test_reads_sees_what_synchronises(fn: object, what: str) -> None:
    """NOTE [ Graphed recompute ] Rule 3: a value read on the host or an output whose shape depends on the data is a
    synchronisation (a capture would fail and leave the process's RNG unusable, Rule 7)."""
    x = torch.randn(8)
    reads = graphed._Reads(set())
    with reads:
        fn(x)  # type: ignore[operator]
    assert reads.sync is not None and what in reads.sync, reads.sync
    quiet = graphed._Reads(set())
    with quiet:
        (x * 2).sum()
    assert quiet.sync is None


def test_a_buffer_stands_for_its_input_as_a_leaf_or_a_view() -> None:
    """NOTE [ Graphed recompute ] Rule 3 with NOTE [ Reentrant recompute ] Rule 8: the recomputation the graph
    captures takes each buffer as the eager recomputation takes the input it stands for (a leaf where the input is
    one, else a view), so autocast caches the same casts in both."""
    from torchckpt.recompute.reentrant import _inputs

    leaf = torch.randn(3, requires_grad=True)
    for t in (leaf, leaf * 2, torch.randn(3)):
        with torch.enable_grad():
            direct = _inputs([t], False)[0]
            via = _inputs([graphed._like(torch.empty(3), t)], False)[0]
        assert (direct.is_leaf, direct.requires_grad, direct._is_view()) == (via.is_leaf, via.requires_grad,
                                                                               via._is_view())
