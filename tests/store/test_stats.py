"""``Stats.summary()`` (sizes in their unit; why nothing moved) and ``repr(Store)`` (its settings)."""
from __future__ import annotations

import tempfile

import torch

import torchckpt
from torchckpt.codecs import TritonQuant
from torchckpt.memory import HostPool
from torchckpt.store.stats import Stats


def _step(store: torchckpt.Store) -> str:
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)])
    with torchckpt.offload(store):
        loss = model(torch.randn(8, 16, requires_grad=True)).sum()
    loss.backward()
    return store.stats().summary()


def test_summary_says_why_a_default_store_moved_nothing() -> None:
    st = torchckpt.Store("cpu")  # min_bytes=1 MiB: every tensor of this model is smaller
    line = _step(st)
    kept = st.stats().kept
    assert st.stats().offloaded == 0 and kept > 0
    assert line.startswith("offloaded 0 B in 0 tensors, loaded 0 B;")
    assert f"moved none of the {kept} saved tensors" in line and "Store(min_bytes=0) moves small tensors too" in line
    moved = _step(torchckpt.Store("cpu", min_bytes=0))
    assert "moved none" not in moved and "offloaded 0 B" not in moved
    assert "kept " in moved  # the parameters saved by reference


def test_summary_sizes_take_their_unit() -> None:
    line = Stats(offloaded=78, offloaded_bytes=78 * 6144, loaded_bytes=78 * 6144 - 1).summary()
    assert line.startswith("offloaded 468.000 KiB in 78 tensors, loaded 467.999 KiB;"), line  # never 0.00 GiB, never equal
    assert Stats(offloaded=1, offloaded_bytes=3 << 30, loaded_bytes=3 << 30).summary().startswith(
        "offloaded 3.00 GiB in 1 tensors, loaded 3.00 GiB;")


def test_store_repr_shows_its_settings() -> None:
    assert repr(torchckpt.Store("cpu")) == "Store(device='cpu', gpu_bytes='64MiB', min_bytes='1MiB', codec=None, disk=None)"
    d = tempfile.mkdtemp()
    st = torchckpt.Store("cpu", gpu_bytes="1.5GiB", min_bytes=100, prefetch=False, codec=TritonQuant(bits=4),
                         host=HostPool(capacity_bytes=8 << 20, pin=False), disk=d)
    try:
        assert repr(st) == (f"Store(device='cpu', gpu_bytes='1536MiB', min_bytes=100, prefetch=False, "
                            f"host=HostPool(capacity_bytes='8MiB', ...), codec={TritonQuant(bits=4)!r}, disk={d!r})")
    finally:
        st.close()
    plain = torchckpt.Store("cpu", gpu_bytes=1000, min_bytes=0)
    assert repr(eval(repr(plain), {"Store": torchckpt.Store})) == repr(plain)  # noqa: S307 - pasted back as code


def test_summary_counts_the_tensors_under_min_bytes() -> None:
    """The store counts what it kept for being under ``min_bytes`` and the summary names the setting."""
    import torch
    import torchckpt
    from ckpt_models import small_pool
    store = torchckpt.Store(device="cpu", host=small_pool(), min_bytes="64KiB")
    x = torch.randn(64, 64, requires_grad=True)  # 16 KiB tensors
    with store.hooks():
        y = x.tanh().exp().sum()
    y.backward()
    st = store.stats()
    assert (st.small, st.small_bytes, st.min_bytes) == (2, 2 * 64 * 64 * 4, 64 << 10)
    assert "2 of them (32.00 KiB) under the store's min_bytes of 64.00 KiB" in st.summary()
