"""Soak: usage patterns other than a clean forward + backward never leak a graph (issue 22 Deliver 1).

Every policy, the context manager and every store setting run each pattern (forward only, evaluation
with grad enabled and overlapping graphs, an exception in forward, an exception in the middle of
backward, ``retain_graph`` twice, backward through one of two outputs, generation with a KV cache,
and a clean step as the control) many times after a warm-up. Afterwards the live tensors, the
process's resident memory (CPU) or the device's allocated memory (CUDA) must be what they were after
the warm-up, and every store must be empty (no entry, no host block, no file on disk).

The leak this guards against (NOTE [ Saved tensor identity ] Rule 5): a pack hook that returns the
saved tensor itself, when that tensor is an op's output, holds the op's ``grad_fn``, which holds
the packed value: a cycle through C++ the collector never frees.
"""
from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchckpt
from torchckpt.codecs import TritonQuant
from torchckpt.memory.disk import PIECE

WIDTH, BATCH = 512, 640  # 1.25 MiB per fp32 activation: above the default Store's min_bytes (1 MiB)
WARMUP, ROUNDS = 2, 6


class Boom(torch.autograd.Function):
    """Identity whose backward raises: an exception in the middle of backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise _Raised("backward")


class _Raised(RuntimeError):
    pass


class Block(nn.Module):
    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.act = act
        self.raise_in_forward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.lin(x))  # tanh, gelu, softmax: ops that save their outputs
        if self.raise_in_forward:
            raise _Raised("forward")
        return h


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(torch.tanh), Block(F.gelu), Block(lambda t: t.softmax(-1)),
                                     Block(torch.sigmoid)])
        self.head = nn.Linear(WIDTH, 2)
        self.boom = False

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        for i, b in enumerate(self.blocks):
            x = b(x)
            if i == 0 and self.boom:
                x = Boom.apply(x)  # backward runs blocks 3..1 (recomputing, unpacking), then raises here
        if cache is not None:  # a key/value cache, as decoding keeps one
            cache.append(x)
            x = x + torch.stack(cache).mean(0)
        out = self.head(x).tanh()
        return out[:, 0], out[:, 1]


# -- settings: what routes the saved tensors -----------------------------------------------------------
def _store(device: torch.device, **kw: Any) -> torchckpt.Store:
    if device.type == "cpu":
        kw.setdefault("host", torchckpt.memory.HostPool(capacity_bytes=512 << 20, chunk_bytes=1 << 20, pin=False))
    return torchckpt.Store(device=str(device), **kw)


def _per_block(policy: Callable[[], torchckpt.Policy]) -> Callable[[Net, torch.device, Any], Any]:
    def apply(model: Net, device: torch.device, tmp: Any) -> None:
        for b in model.blocks:
            torchckpt.checkpoint(b, policy=policy())
    return apply


def _whole(make_store: Callable[[torch.device, Any], torchckpt.Store]) -> Callable[[Net, torch.device, Any], Any]:
    def apply(model: Net, device: torch.device, tmp: Any) -> torchckpt.Store:
        store = make_store(device, tmp)
        torchckpt.checkpoint(model, policy=torchckpt.Offload(store))
        return store
    return apply


def _context(make_store: Callable[[torch.device, Any], torchckpt.Store]) -> Callable[[Net, torch.device, Any], Any]:
    def apply(model: Net, device: torch.device, tmp: Any) -> torchckpt.Store:
        store = make_store(device, tmp)
        inner = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            with torchckpt.offload(store):
                return inner(*args, **kwargs)
        object.__setattr__(model, "forward", forward)
        return store
    return apply


def _chain(model: Net, device: torch.device, tmp: Any) -> None:
    torchckpt.checkpoint_chain(list(model.blocks), snapshots=2)


_MM = {torch.ops.aten.addmm.default, torch.ops.aten.mm.default}
SETTINGS: dict[str, Callable[[Net, torch.device, Any], Any]] = {
    "none": lambda model, device, tmp: None,
    "keep": _per_block(torchckpt.Keep),
    "recompute": _per_block(torchckpt.Recompute),
    "recompute_save": _per_block(lambda: torchckpt.Recompute(save=_MM)),
    "recompute_parts": _per_block(lambda: torchckpt.Recompute(parts=(1,))),
    "offload_default": _whole(lambda d, tmp: _store(d)),  # min_bytes 1 MiB: small tensors kept by reference
    "offload_all": _whole(lambda d, tmp: _store(d, min_bytes=0, gpu_bytes=2 << 20)),  # evicts to host
    "offload_codec": _whole(lambda d, tmp: _store(d, min_bytes=0, gpu_bytes=0,
                                                  codec=TritonQuant(bits=8, mode="rel", bound=1e-2))),
    "offload_disk": _whole(lambda d, tmp: _store(
        d, min_bytes=0, gpu_bytes=0, disk=str(tmp),
        host=torchckpt.memory.HostPool(capacity_bytes=4 << 20, chunk_bytes=1 << 20, pin=d.type == "cuda"))),
    "context_default": _context(lambda d, tmp: _store(d)),
    "context_all": _context(lambda d, tmp: _store(d, min_bytes=0, gpu_bytes=2 << 20)),
    "chain": _chain,
}


# Settings that refuse a second backward through one forward with a torchckpt: error (what they hand back to
# backward is handed back once: torch's selective checkpointing refuses it too); the soak checks the
# refusal leaks nothing either.
REFUSE_SECOND_BACKWARD = {"recompute_save", "chain"}


# -- patterns: how the model is used -----------------------------------------------------------------
class Pattern:
    """One use of the model per call; state that must outlive a call (an overlapping graph) is held here."""

    def __init__(self, model: Net, x: torch.Tensor, refuses_second_backward: bool = False) -> None:
        self.model, self.x = model, x
        self.refuses_second_backward = refuses_second_backward
        self.prev: Any = None

    def train(self) -> None:  # the control: a clean step
        a, b = self.model(self.x)
        (a.sum() + b.sum()).backward()

    def forward_only(self) -> None:  # a forward whose loss is dropped
        a, b = self.model(self.x)
        (a.sum() + b.sum()).item()

    def eval_grad(self) -> None:  # evaluation without no_grad; the previous output lives into the next forward
        self.model.eval()
        try:
            out = self.model(self.x)
            if self.prev is not None:
                (self.prev[0] - out[0]).abs().max().item()
            self.prev = out
        finally:
            self.model.train()

    def raise_forward(self) -> None:
        blk = self.model.blocks[-1]
        blk.raise_in_forward = True
        try:
            self.model(self.x)
        except _Raised:
            pass
        else:
            raise AssertionError("the block did not raise")
        finally:
            blk.raise_in_forward = False

    def raise_backward(self) -> None:
        self.model.boom = True
        try:
            a, b = self.model(self.x)
            loss = a.sum() + b.sum()
            try:
                loss.backward()
            except _Raised:
                pass
            else:
                raise AssertionError("backward did not raise")
        finally:
            self.model.boom = False

    def retain_twice(self) -> None:
        a, b = self.model(self.x)
        loss = a.sum() + b.sum()
        loss.backward(retain_graph=True)
        if self.refuses_second_backward:  # a documented refusal (as torch's selective checkpointing refuses)
            with pytest.raises(torchckpt.CheckpointError, match="second backward"):
                loss.backward(retain_graph=True)
        else:
            loss.backward(retain_graph=True)

    def one_of_two(self) -> None:  # backward through one output; the other's part of the graph stays until dropped
        a, b = self.model(self.x)
        a.sum().backward()

    def generate(self) -> None:  # decoding with a KV cache, grad enabled, nothing backpropagated
        cache: list[torch.Tensor] = []
        x = self.x[:8]
        for _ in range(4):
            a, _b = self.model(x, cache)
            x = x + a[:, None]

    def finish(self) -> None:
        self.prev = None
        self.model.zero_grad(set_to_none=True)


PATTERNS = [p for p in vars(Pattern) if not p.startswith("_") and p != "finish"]


def _live_tensors(skip_nbytes: int = -1) -> tuple[int, int]:
    """How many tensors Python holds, and the bytes of their distinct storages.

    ``skip_nbytes``: leave out storages of that size (the disk tier's per-thread bounce buffers, made
    once by each I/O thread the first time it runs: bounded by its threads, not a leak).
    """
    gc.collect()
    n, seen, nbytes = 0, set(), 0
    tensor = torch.Tensor
    for o in gc.get_objects():
        if type(o) is tensor or type(o) is nn.Parameter:
            n += 1
            try:
                st = o.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if st.nbytes() == skip_nbytes:
                n -= 1
                continue
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                nbytes += st.nbytes()
    return n, nbytes


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _device_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _left_in_store(store: Any) -> list[str]:
    """What a store still holds after the rounds: nothing, when every graph was freed."""
    if not isinstance(store, torchckpt.Store):
        return []
    left = []
    if store._live or store._entries:
        left.append(f"the store still holds {len(store._entries)} entries")
    if store.cache.used:
        left.append(f"the store's GPU cache still holds {store.cache.used} bytes")
    host = store.host.stats()
    lent = host.in_use_bytes + host.pageable_in_use_bytes
    if lent:
        left.append(f"the host pool still lends {lent} bytes")
    if store.disk is not None:
        store._poll_disk(raise_errors=True)
        if store._disk_keys or store._staged:
            left.append(f"disk files or staging buffers left: {store._disk_keys}")
    return left


def soak(setting: str, pattern: str, device: torch.device, tmp: Any) -> list[str]:
    """Run ``pattern`` under ``setting`` after a warm-up; what grew or was left behind (empty: nothing)."""
    model = Net().to(device)
    store = SETTINGS[setting](model, device, tmp)
    x = torch.randn(BATCH, WIDTH, device=device)
    run = Pattern(model, x, refuses_second_backward=setting in REFUSE_SECOND_BACKWARD)
    use = getattr(run, pattern)
    for _ in range(WARMUP):
        use()
    run.finish()
    skip = PIECE if isinstance(store, torchckpt.Store) and store.disk is not None else -1
    n0, b0 = _live_tensors(skip)
    rss0, dev0 = _rss(), _device_bytes(device)
    for _ in range(ROUNDS):
        use()
    run.finish()
    n1, b1 = _live_tensors(skip)
    rss1, dev1 = _rss(), _device_bytes(device)
    grew = []
    if n1 > n0 or b1 > b0:
        grew.append(f"{n1 - n0} more live tensors, {(b1 - b0) >> 20} MiB more after {ROUNDS} rounds")
    if dev0 is not None and dev1 is not None and dev1 > dev0:
        grew.append(f"device memory grew by {(dev1 - dev0) >> 20} MiB over {ROUNDS} rounds")
    if rss0 is not None and rss1 is not None and device.type == "cpu" and rss1 - rss0 >= 24 << 20:
        # one round's graph is ~6 MiB; a leak grows ROUNDS times that
        grew.append(f"resident memory grew by {(rss1 - rss0) >> 20} MiB over {ROUNDS} rounds")
    grew += _left_in_store(store)
    if isinstance(store, torchckpt.Store):
        store.close()
    return grew


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_soak_cpu(setting: str, pattern: str, tmp_path: Any) -> None:
    assert soak(setting, pattern, torch.device("cpu"), tmp_path) == []


@pytest.mark.cuda
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_soak_cuda(setting: str, pattern: str, tmp_path: Any) -> None:
    assert soak(setting, pattern, torch.device("cuda"), tmp_path) == []


def test_soak_catches_a_leak(tmp_path: Any) -> None:
    """The soak's meters see a graph held by a pack hook that returns the saved tensor (the old Kept)."""
    model = Net()
    inner = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return inner(*args, **kwargs)
    object.__setattr__(model, "forward", forward)
    run = Pattern(model, torch.randn(BATCH, WIDTH))
    run.forward_only()
    n0, b0 = _live_tensors()
    for _ in range(3):
        run.forward_only()
    n1, b1 = _live_tensors()
    assert n1 > n0 and b1 - b0 >= 3 * BATCH * WIDTH * 4
