"""``Store(disk=...)``: offloaded tensors past the host pool's cap go to files (NOTE [ Spill to disk ]), on the CPU.

Gradients are checked against plain autograd bit for bit; files are checked gone after each step, after
``close()`` and after an exception; a full disk (simulated) must give a ``torchckpt:`` error and lose nothing.
"""
from __future__ import annotations

import errno
import gc
import os
import pickle
import time
from typing import Any

import pytest
import torch
from torch import nn

import torchckpt
from ckpt_models import Block, assert_same_grads, clone, step
from torchckpt import CheckpointError
from torchckpt.codecs import Identity
from torchckpt.memory import DiskTier, HostPool
from torchckpt.memory import disk as disk_mod
from torchckpt.store import saved_disk

MiB = 1 << 20


def files_under(root: Any) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def pool(cap: int = MiB) -> HostPool:
    return HostPool(capacity_bytes=cap, chunk_bytes=MiB, pin=False)


def disk_store(tmp_path: Any, gpu_bytes: int = 0, cap: int = MiB, **kw: Any) -> torchckpt.Store:
    return torchckpt.Store("cpu", gpu_bytes=gpu_bytes, min_bytes=0, host=pool(cap), disk=tmp_path, **kw)


def host_in_use(p: HostPool) -> int:
    p.free(p.alloc(1))  # reclaims parked blocks
    return p.stats().in_use_bytes


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def models(store: torchckpt.Store, depth: int = 4) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """A plain stack of transformer blocks, the same with every block under ``Offload(store)``, an input."""
    torch.manual_seed(5)
    plain = Stack([Block(d=64, p=0.0) for _ in range(depth)])
    wrapped = clone(plain)
    wrapped.blocks = nn.ModuleList(torchckpt.checkpoint(b, policy=torchckpt.Offload(store)) for b in wrapped.blocks)
    return plain, wrapped, torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(9))


# -- NOTE [ Spill to disk ] Rule 1: which tensors spill --------------------------------------------
def test_spills_exactly_past_the_cap(tmp_path: Any) -> None:
    s = disk_store(tmp_path)
    ts = [torch.randn(64 * 1024, generator=torch.Generator().manual_seed(i)) for i in range(6)]  # 256 KiB each
    hs = [s.pack(t) for t in ts]
    st = s.stats()
    assert st.offloaded == 6 and st.spilled == 2 and st.spilled_bytes == 2 * ts[0].numel() * 4
    assert st.host is not None and st.host.in_use_bytes == MiB and st.host.pageable_in_use_bytes == 0
    assert st.disk is not None and st.disk.writes == 2 and st.disk.bytes_written == st.spilled_bytes
    assert len(files_under(tmp_path)) == 2
    for h, t in zip(hs, ts):
        u = s.unpack(h)
        assert torch.equal(u, t) and u.stride() == t.stride()
    assert s.stats().disk.reads == 2  # type: ignore[union-attr]
    del hs, h
    assert files_under(tmp_path) == [] and host_in_use(s.host) == 0  # type: ignore[arg-type]
    s.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.filterwarnings("ignore:.*the host pool reached its cap:RuntimeWarning")
def test_pool_refusing_under_its_cap_spills(tmp_path: Any) -> None:
    """Chunks of 1 MiB under a 1.5 MiB cap: the pool cannot take a second chunk; the tensor spills
    (NOTE [ Spill to disk ] Rule 1)."""
    s = disk_store(tmp_path, cap=MiB + MiB // 2)
    ts = [torch.randn(64 * 1024, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    for _ in range(2):
        hs = [s.pack(t) for t in ts]
        assert all(torch.equal(s.unpack(h), t) for h, t in zip(hs, ts))
        del hs
    st = s.stats()
    assert st.spilled == 8 and st.host is not None and st.host.pageable_in_use_bytes == 0
    assert st.host.pageable_fallbacks <= 2  # once per step at most: the pool counts as full from then on
    assert files_under(tmp_path) == []
    s.close()


# -- training: Offload of every block ----------------------------------------------------------------
@pytest.mark.parametrize("gpu_bytes", [0, 256 << 10])
@pytest.mark.parametrize("codec", [None, Identity()], ids=["raw", "codec"])
def test_training_gradients_bit_exact_and_files_gone(tmp_path: Any, gpu_bytes: int, codec: Any) -> None:
    store = disk_store(tmp_path, gpu_bytes=gpu_bytes, codec=codec)
    plain, wrapped, x = models(store)
    ahead = []
    real = store.disk.prefetch  # type: ignore[union-attr]
    store.disk.prefetch = lambda *a, **k: ahead.append(a[0]) or real(*a, **k)  # type: ignore[union-attr,method-assign]
    for i in range(3):
        ref = step(plain, plain, x, seed=i)
        got = step(wrapped, wrapped, x, seed=i)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        assert_same_grads(got[2], ref[2])
        assert files_under(tmp_path) == []  # every file freed by the end of backward (NOTE [ Spill to disk ] Rule 5)
        assert host_in_use(store.host) == 0 and store._staged_bytes == 0  # type: ignore[arg-type]
    st = store.stats()
    assert st.spilled > 0 and st.disk is not None and 0 < st.disk.bytes_written <= st.spilled_bytes
    assert st.disk.reads > 0  # a write still queued when its entry dies is cancelled: no file, no read
    assert st.plans >= 1 and ahead  # NOTE [ Spill to disk ] Rule 4: on the plan, reads started ahead of the loads
    if codec is not None:
        assert st.compressed == st.offloaded
    store.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("budget", [1, 1 << 30])
def test_small_staging_budget_waits_for_writes(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    """NOTE [ Spill to disk ] Rule 2: with room for one staging buffer only, spills wait for the writes before them;
    results unchanged."""
    monkeypatch.setattr(saved_disk, "STAGING_BYTES", budget)
    slow = disk_mod._write_file

    def slow_write(*a: Any) -> None:
        time.sleep(0.005)
        slow(*a)

    monkeypatch.setattr(disk_mod, "_write_file", slow_write)
    store = disk_store(tmp_path, gpu_bytes=64 << 10)
    most = [0]
    real = store._staging

    def staging(n: int, wait_writes: bool) -> torch.Tensor:
        buf = real(n, wait_writes)
        live = sum(1 for _, f in store._staged.values() if f is not None and not f.done())
        most[0] = max(most[0], live)
        return buf

    store._staging = staging  # type: ignore[method-assign]
    plain, wrapped, x = models(store)
    for i in range(2):
        ref = step(plain, plain, x, seed=i)
        got = step(wrapped, wrapped, x, seed=i)
        assert_same_grads(got[2], ref[2])
    assert store.stats().spilled > 0
    if budget == 1:
        assert most[0] == 0  # every earlier write has ended when a new buffer is taken
    else:
        assert most[0] > 1  # the control: slow writes pile up when the budget allows
    assert files_under(tmp_path) == []
    store.close()


# -- NOTE [ Spill to disk ] Rule 5: files freed -------------------------------------------------------
class Boom(Exception):
    pass


class Fail(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise Boom()


def test_exception_mid_backward_leaves_no_file(tmp_path: Any) -> None:
    store = disk_store(tmp_path)
    _, wrapped, x = models(store)
    y = x.clone().requires_grad_() * 1.0
    for k, b in enumerate(wrapped.blocks):
        y = b(y)
        if k == 2:
            y = Fail.apply(y)  # backward fails once block 3 has unpacked
    store.disk.wait()  # type: ignore[union-attr]
    assert len(files_under(tmp_path)) >= 2
    with pytest.raises(Boom):
        y.square().sum().backward()
    del y  # the graph, and with it every handle, goes
    gc.collect()
    assert files_under(tmp_path) == [] and host_in_use(store.host) == 0  # type: ignore[arg-type]
    store.close()
    assert os.listdir(tmp_path) == []


def test_close_deletes_files_of_a_live_graph(tmp_path: Any) -> None:
    store = disk_store(tmp_path)
    _, wrapped, x = models(store)
    y = wrapped(x.clone().requires_grad_())
    store.disk.wait()  # type: ignore[union-attr]
    assert len(files_under(tmp_path)) >= 2
    store.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(CheckpointError, match=r"^torchckpt: a saved tensor this Store spilled .*Store.close\(\)"):
        y.square().sum().backward()  # the last blocks' tensors spilled: they are unpacked first
    del y
    gc.collect()
    assert os.listdir(tmp_path) == []
    with pytest.raises(CheckpointError, match=r"^torchckpt: a saved tensor must spill to disk .*Store.close\(\)"):
        wrapped(x.clone().requires_grad_())


def test_shared_tier_close_deletes_only_this_stores_files(tmp_path: Any) -> None:
    tier = DiskTier(tmp_path, direct=False)
    a = torchckpt.Store("cpu", gpu_bytes=0, min_bytes=0, host=pool(0), disk=tier)
    b = torchckpt.Store("cpu", gpu_bytes=0, min_bytes=0, host=pool(0), disk=tier)
    ta, tb = torch.randn(1000), torch.randn(1000)
    ha, hb = a.pack(ta), b.pack(tb)
    tier.wait()
    assert len(tier.files()) == 2
    a.close()
    assert not tier.closed and len(tier.files()) == 1 and torch.equal(b.unpack(hb), tb)
    del ha, hb
    assert tier.files() == []
    tier.close()
    assert os.listdir(tmp_path) == []


# -- NOTE [ Spill to disk ] Rule 6: errors ------------------------------------------------------------
def enospc(*a: Any, **k: Any) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_raises_and_loses_nothing(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    s = disk_store(tmp_path)
    ts = [torch.randn(64 * 1024, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    monkeypatch.setattr(os, "pwrite", enospc)
    hs = [s.pack(t) for t in ts]  # the last one spills; its write fails on an I/O thread
    s.disk.wait()  # type: ignore[union-attr]
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"^torchckpt: the disk at .* is full \(ENOSPC\)") as info:
        s.unpack(hs[0])
    assert "no data was lost" in str(info.value) and "Store(disk=...)" in str(info.value)
    for h, t in zip(hs, ts):  # reported once; every tensor comes back exactly (the failed ones from staging)
        assert torch.equal(s.unpack(h), t)
    del hs, h
    assert files_under(tmp_path) == [] and s._staged_bytes == 0
    s.close()
    assert os.listdir(tmp_path) == []


def test_full_disk_in_training_raises(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    store = disk_store(tmp_path)
    _, wrapped, x = models(store)
    monkeypatch.setattr(os, "pwrite", enospc)
    out = []
    with pytest.raises(CheckpointError, match=r"^torchckpt: the disk at .* is full \(ENOSPC\)"):
        out.append(wrapped(x.clone().requires_grad_()))  # a later pack may find an earlier write failed
        store.disk.wait()  # type: ignore[union-attr]
        out[0].square().sum().backward()  # else the first unpack does
    monkeypatch.undo()
    out.clear()
    gc.collect()
    assert files_under(tmp_path) == [] and host_in_use(store.host) == 0  # type: ignore[arg-type]
    store.close()


def test_bad_disk_arguments(tmp_path: Any) -> None:
    with pytest.raises(TypeError, match=r"^torchckpt: Store\(disk=...\) expects a directory path"):
        torchckpt.Store("cpu", disk=3)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="^torchckpt: the disk tier's directory .* does not exist"):
        torchckpt.Store("cpu", disk=tmp_path / "missing")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        with pytest.raises(CheckpointError, match="^torchckpt: the disk tier cannot write in"):
            torchckpt.Store("cpu", disk=ro)
    finally:
        ro.chmod(0o700)


@pytest.mark.filterwarnings("ignore:.*the host pool reached its cap:RuntimeWarning")
def test_store_without_disk_is_unchanged() -> None:
    s = torchckpt.Store("cpu", gpu_bytes=0, min_bytes=0, host=pool(0))
    t = torch.randn(1000)
    assert torch.equal(s.unpack(s.pack(t)), t)
    st = s.stats()
    assert s.disk is None and st.disk is None and st.spilled == 0 and st.host is not None
    assert st.host.pageable_fallbacks == 1  # past the cap: pageable, as before
    s.close()  # nothing to do


def test_pickles_with_its_directory(tmp_path: Any) -> None:
    for disk in (str(tmp_path), DiskTier(tmp_path, direct=False)):
        s = torchckpt.Store("cpu", host=pool(), disk=disk)
        t = pickle.loads(pickle.dumps(s))
        assert t is not s and t.disk is not None and s.disk is not None
        assert os.path.dirname(t.disk.root) == os.path.dirname(s.disk.root) == str(tmp_path)
        t.close()
        s.close()
        if isinstance(disk, DiskTier):
            assert not disk.closed  # the caller's tier stays open
            disk.close()
    assert os.listdir(tmp_path) == []
