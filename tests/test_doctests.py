"""The ``Example::`` blocks in the package's docstrings run as written (CPU only)."""
import doctest
import importlib

import pytest
import torch

MODULES = [
    "torchckpt.adjoint",
    "torchckpt.api",
    "torchckpt.codecs.base",
    "torchckpt.codecs.bitcomp",
    "torchckpt.codecs.quant",
    "torchckpt.env",
    "torchckpt.store.blob",
    "torchckpt.store.device_arena",
    "torchckpt.store.gpu_cache",
    "torchckpt.store.host_pool",
    "torchckpt.store.lazy_pool",
    "torchckpt.store.node_lock",
    "torchckpt.store.plan",
    "torchckpt.store.snapshots",
    "torchckpt.store.store",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0, f"{name} has no examples"
    assert res.failed == 0
