"""The default host pool cap is this process's share of the node (NOTE [ Host pool ] Rule 6, NOTE [ Lazy host pool ]
Rule 10): ``LOCAL_WORLD_SIZE`` divides it, a given cap is never divided, a malformed value is a ``torchckpt:`` error,
and ranks of ``torch.distributed`` without the variable are warned once."""
from __future__ import annotations

import os
import warnings

import pytest
import torch.distributed as dist

import torchckpt.memory.factory as factory
import torchckpt.memory.lazy_pool as lp
import torchckpt.memory.sysinfo as sysinfo
from torchckpt._native import host_pool_available
from torchckpt.memory.host_pool import HostPool
from torchckpt.memory.lazy_pool import LazyHostPool

MiB = 1 << 20
native = pytest.mark.skipif(not host_pool_available(), reason="torchckpt._C with csrc/host_pool.cpp is not built")


@pytest.fixture(autouse=True)
def _alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher around the test: the variable unset, the one warning not given yet."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(sysinfo, "_warned_alone", False)


def host_cap() -> int:
    return HostPool(pin=False).capacity_bytes


def lazy(capacity: int | None = None) -> LazyHostPool:
    lock = os.path.join("/tmp", f"torchckpt-test-{os.getpid()}.lock")
    return LazyHostPool(capacity_bytes=capacity, chunk_bytes=4 * MiB, first_chunk_bytes=MiB, pin=False, ahead_bytes=0,
                        strategy="concurrent", register_mode="none", lock_path=lock)


@pytest.fixture
def small_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node of 256 MiB with 192 MiB available, so the lazy pool's default is small and the same at every call."""
    monkeypatch.setattr(lp, "physical_memory_bytes", lambda: 256 * MiB)
    monkeypatch.setattr(lp, "available_memory_bytes", lambda: 192 * MiB)


def lazy_cap() -> int:
    p = lazy()
    try:
        return p.capacity_bytes
    finally:
        p.close()


def test_local_ranks_reads_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sysinfo.local_ranks() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert sysinfo.local_ranks() == 8
    assert sysinfo.node_share(64 * MiB) == 8 * MiB


def test_host_pool_default_cap_is_the_node_share(monkeypatch: pytest.MonkeyPatch) -> None:
    alone = host_cap()
    assert alone == sysinfo.physical_memory_bytes() // 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_cap() == alone // 4
    assert factory.make_host_pool(pin=False).capacity_bytes == alone // 4  # a store's default pool (no pinning here)


@native
def test_lazy_pool_default_cap_is_the_node_share(monkeypatch: pytest.MonkeyPatch, small_node: None) -> None:
    alone = lazy_cap()
    assert alone == min(128 * MiB, int(192 * MiB * 0.8))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    page = sysinfo.page_bytes()
    assert lazy_cap() == -(-(alone // 4) // page) * page


@native
def test_a_given_cap_is_never_divided(monkeypatch: pytest.MonkeyPatch, small_node: None) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert HostPool(capacity_bytes=64 * MiB, pin=False).capacity_bytes == 64 * MiB
    assert factory.make_host_pool(pin=False, capacity_bytes=64 * MiB, chunk_bytes=MiB).capacity_bytes == 64 * MiB
    p = lazy(capacity=64 * MiB)
    assert p.capacity_bytes == 64 * MiB
    p.close()
    assert host_cap() == sysinfo.physical_memory_bytes() // 2 // 4  # while the defaults are divided
    assert lazy_cap() == 32 * MiB  # 128 MiB (half of the node) over 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")  # not read at all for a given cap
    assert HostPool(capacity_bytes=64 * MiB, pin=False).capacity_bytes == 64 * MiB
    lazy(capacity=64 * MiB).close()


@pytest.mark.parametrize("value", ["0", "x", "-2", "1.5"])
def test_malformed_local_world_size_says_what_to_set(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(ValueError, match=r"^torchckpt: LOCAL_WORLD_SIZE must be a positive integer.*found "
                                         + repr(value).replace(".", r"\.") + r".*set it to"):
        HostPool(pin=False)
    with pytest.raises(ValueError, match=r"^torchckpt: LOCAL_WORLD_SIZE"):
        sysinfo.node_share(MiB)


def test_ranks_without_local_world_size_are_warned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert sysinfo.local_ranks() == 1
        assert sysinfo.local_ranks() == 1
    msgs = [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and msgs[0].startswith("torchckpt: torch.distributed runs 8 ranks but LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # set: no warning, the share is an eighth
    monkeypatch.setattr(sysinfo, "_warned_alone", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sysinfo.local_ranks() == 8


def test_one_process_without_a_group_is_not_warned() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sysinfo.local_ranks() == 1
        host_cap()
