"""NOTE [ Buffers written in a forward ]: every form of recomputation leaves a block's buffers as plain autograd does
and computes what the forward computed, bit for bit (CPU; the CUDA variant runs the same on the device)."""
from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.recompute.buffers import BufferGuard, guarded

aten = torch.ops.aten


class ConvBN(nn.Module):
    """A residual conv block with batch norm (its running statistics written by a kernel that moves no version)."""

    def __init__(self, c: int = 4, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 1)
        self.bn = nn.BatchNorm2d(c, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c2(torch.relu(self.bn(self.c1(x))))


class ReadsAfterWriting(nn.Module):
    """Writes a buffer in place (its version moves), then computes with it: a recomputation that started from the
    written value would compute something else."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(c, c)
        self.register_buffer("seen", torch.zeros(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.seen.mul_(0.5).add_(x.detach().mean(dim=tuple(range(x.dim() - 1))))
        return self.lin(x) * (1 + self.seen)


class Net(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.b = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.b:
            x = blk(x)
        return x.square().mean()


def _conv_net(momentum: float | None = 0.1) -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    return Net([ConvBN(momentum=momentum) for _ in range(4)]), torch.randn(2, 4, 8, 8)


def _reads_net() -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    return Net([ReadsAfterWriting() for _ in range(4)]), torch.randn(3, 5, 4)


POLICIES: dict[str, Callable[[], torchckpt.Recompute]] = {
    "recompute": lambda: torchckpt.Recompute(),
    "save_op": lambda: torchckpt.Recompute(save={aten.convolution.default, aten.mm.default, aten.addmm.default}),
    "save_positions": lambda: torchckpt.Recompute(save={0, 2, 5}),
    "parts": lambda: torchckpt.Recompute(parts=[1]),
    "store": lambda: torchckpt.Recompute(store=torchckpt.Store(torch.device("cpu"), gpu_bytes=0, min_bytes=0)),
}


def _steps(m: Net, x: torch.Tensor, steps: int = 3) -> list[list[torch.Tensor]]:
    out = []
    for i in range(steps):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(i)
        m(x * (1 + i)).backward()
        out.append([p.grad.clone() for p in m.parameters()])
    return out


def _same(a: Net, b: Net, ga: list[list[torch.Tensor]], gb: list[list[torch.Tensor]]) -> None:
    for (n, x), y in zip(a.named_buffers(), b.buffers(), strict=True):
        assert torch.equal(x, y), n
    for s, (u, v) in enumerate(zip(ga, gb, strict=True)):
        assert all(torch.equal(p, q) for p, q in zip(u, v, strict=True)), f"step {s}"


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("net", ["conv_bn", "conv_bn_cumulative", "reads_after_writing"])
def test_recompute_leaves_buffers_and_gradients_as_plain_autograd(policy: str, net: str) -> None:
    make = {"conv_bn": _conv_net, "conv_bn_cumulative": lambda: _conv_net(None), "reads_after_writing": _reads_net}[net]
    plain, x = make()
    model = copy.deepcopy(plain)
    for blk in model.b:
        torchckpt.checkpoint(blk, policy=POLICIES[policy]())
    _same(plain, model, _steps(plain, x), _steps(model, x))


@pytest.mark.parametrize("snapshots", [1, 2])
def test_checkpoint_chain_runs_again_from_the_buffers_the_forward_found(snapshots: int) -> None:
    """The chain runs blocks again to rebuild inputs (NOTE [ Chain of blocks ] Rule 3): those runs too start from the
    buffers as the block's forward found them and leave them as the step has them."""
    for make in (_conv_net, _reads_net):
        plain, x = make()
        model = copy.deepcopy(plain)
        chain = torchckpt.checkpoint_chain(list(model.b), snapshots=snapshots)
        try:
            got = _steps(model, x)
            assert chain.stats.advances > 0
        finally:
            chain.remove()
        _same(plain, model, _steps(plain, x), got)


def test_torch_checkpoint_writes_batch_norm_statistics_twice() -> None:
    """What the guard is for: torch.utils.checkpoint's recomputation moves the statistics a second time."""
    plain, x = _conv_net()
    model = copy.deepcopy(plain)
    plain(x).backward()
    h = x
    for blk in model.b:
        h = torch.utils.checkpoint.checkpoint(blk, h, use_reentrant=False)
    h.square().mean().backward()
    assert not torch.equal(model.b[0].bn.running_mean, plain.b[0].bn.running_mean)
    assert int(model.b[0].bn.num_batches_tracked) == 2


def test_guard_only_where_there_are_buffers() -> None:
    """NOTE [ Buffers written in a forward ] Rules 1, 4: no module or no buffer, nothing wrapped; torch's own batch norm
    in training is restored after recomputations only (nothing cloned at the call), in evaluation cloned as any
    buffer; a subclass with its own forward counts as written whatever its versions say."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x
    assert guarded(fn, None) is fn and guarded(fn, nn.Linear(2, 2)) is fn
    bn = nn.BatchNorm1d(3)
    g = guarded(fn, bn)
    assert isinstance(g, BufferGuard) and guarded(g, bn) is g
    assert g.buffers == [] and not g.unseen
    assert all(d is bn._buffers for d, _ in g.norms) and {id(d[n]) for d, n in g.norms} == {id(b) for b in bn.buffers()}
    g2 = guarded(fn, bn.eval())
    assert isinstance(g2, BufferGuard) and g2.norms == [] and len(g2.buffers) == 3 and not g2.unseen
    mine = OwnForwardBN(3)
    g3 = guarded(fn, mine)
    assert isinstance(g3, BufferGuard) and g3.norms == [] and g3.unseen == {id(mine.running_mean), id(mine.running_var),
                                                                            id(mine.num_batches_tracked)}


def test_a_recomputation_writes_fresh_statistics_not_the_norms() -> None:
    """NOTE [ Buffers written in a forward ] Rule 2: while a recomputation runs, a stock norm's ``_buffers`` hold fresh
    tensors (the count a CPU zero), and the norm's own tensors are back after it, untouched: same objects, values and
    versions as after the forward."""
    seen: list[dict[str, torch.Tensor]] = []

    class Spy(nn.BatchNorm1d):
        pass

    bn = nn.BatchNorm1d(3, momentum=None)  # the cumulative average: the forward reads the count with float()
    own = dict(bn._buffers)

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(dict(bn._buffers))
        return bn(x)
    g = guarded(fn, bn)
    x = torch.randn(8, 3)
    g(x)  # the forward
    after = {k: (v.clone(), v._version) for k, v in own.items()}
    g(x)  # a recomputation
    assert all(bn._buffers[k] is own[k] for k in own)
    assert all(torch.equal(own[k], after[k][0]) and own[k]._version == after[k][1] for k in own)
    assert all(seen[1][k] is not own[k] for k in own) and seen[1]["num_batches_tracked"].device.type == "cpu"
    assert int(bn.num_batches_tracked) == 1


def test_statistics_two_norms_share_are_copied_not_swapped() -> None:
    """NOTE [ Buffers written in a forward ] Rule 2: a statistic two norms share (or that is no buffer of its name)
    cannot be swapped in one norm alone: it is cloned at the call and put back after each recomputation, and the
    gradients and statistics are plain autograd's."""
    torch.manual_seed(0)

    def shared() -> Net:
        blocks = []
        for _ in range(3):
            a, b = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
            b.running_mean = a.running_mean  # one tensor, two norms
            blocks.append(nn.Sequential(nn.Linear(3, 3), a, nn.Linear(3, 3), b))
        return Net(blocks)
    plain = shared()
    model = copy.deepcopy(plain)
    g = guarded(lambda x: x, model.b[0])
    assert isinstance(g, BufferGuard) and id(model.b[0][1].running_mean) in g.unseen
    assert all(d[n] is not model.b[0][1].running_mean for d, n in g.norms)
    for blk in model.b:
        torchckpt.checkpoint(blk, policy=torchckpt.Recompute())
    x = torch.randn(8, 3)
    _same(plain, model, _steps(plain, x), _steps(model, x))


class OwnForwardBN(nn.BatchNorm1d):
    """A batch norm subclass with a forward of its own that reads its running mean after updating it (training)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        assert self.running_mean is not None
        return y + 0.25 * self.running_mean


def test_a_norm_with_its_own_forward_recomputes_from_the_statistics_it_found() -> None:
    torch.manual_seed(0)
    plain = Net([nn.Sequential(nn.Linear(3, 3), OwnForwardBN(3)) for _ in range(3)])
    x = torch.randn(8, 3)
    model = copy.deepcopy(plain)
    for blk in model.b:
        torchckpt.checkpoint(blk, policy=torchckpt.Recompute())
    _same(plain, model, _steps(plain, x), _steps(model, x))


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["recompute", "save_positions", "parts"])
def test_recompute_leaves_batch_norm_as_plain_autograd_on_cuda(policy: str) -> None:
    """The same on the device, cuDNN's batch norm (deterministic convolutions, so that plain autograd repeats)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    prev = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        plain, x = _conv_net()
        plain, x = plain.cuda(), x.cuda()
        model = copy.deepcopy(plain)
        for blk in model.b:
            torchckpt.checkpoint(blk, policy=POLICIES[policy]())
        _same(plain, model, _steps(plain, x), _steps(model, x))
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = prev
