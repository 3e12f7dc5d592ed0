"""torchckpt/_native: native code loaded in one place, typed wrappers, the host pool's config value."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import torchckpt
import torchckpt._native as native
from torchckpt._native import ops

ROOT = pathlib.Path(torchckpt.__file__).parent
needs_pool = pytest.mark.skipif(not native.host_pool_available(), reason="torchckpt._C with csrc/host_pool.cpp is not built")

POOL = dict(nbytes=4 << 20, chunk_bytes=1 << 20, first_chunk_bytes=1 << 20, strategy="concurrent", register_mode="none",
            node_lock=False, lock_path="", device=0, huge_pages=True, touch_threads=1, populate=True, touch_limit=-1,
            fake_register_us=0)


def test_only_native_names_the_compiled_ops() -> None:
    """NOTE [ Native code ] Rule 2: no module outside torchckpt/_native uses torch.ops/torch.classes.torchckpt."""
    for path in ROOT.rglob("*.py"):
        if "_native" in path.parts:
            continue
        text = path.read_text()
        assert "torch.ops.torchckpt" not in text and "torch.classes.torchckpt" not in text, path


def test_capabilities_name_every_feature() -> None:
    caps = native.capabilities()
    assert set(caps) == {"torchckpt._C", "host pool", "VMM device arena", "torchckpt._zfp", "nvCOMP"}
    assert all(v is None or isinstance(v, str) and v for v in caps.values())
    assert (caps["torchckpt._C"] is None) == native.native_available()


def test_touch_pages_keeps_data_with_or_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = torch.arange(3 * 4096, dtype=torch.int32).view(torch.uint8)
    want = buf.clone()
    assert native.touch_pages(buf, 4096) == (buf.numel() + 4095) // 4096
    monkeypatch.setattr(native, "_error", "hidden")  # the pure-Python path
    assert native.touch_pages(buf, 4096) == (buf.numel() + 4095) // 4096
    assert torch.equal(buf, want)


@needs_pool
def test_native_pool_takes_one_config_value() -> None:
    p = native.native_host_pool(**POOL)
    try:
        assert p.size() == 4 << 20 and list(p.chunk_sizes()) == [1 << 20] * 4
    finally:
        p.close()


@needs_pool
def test_native_pool_config_refuses_unknown_and_missing_settings() -> None:
    with pytest.raises(RuntimeError, match="unknown integer setting 'chunk_size'"):
        native.native_host_pool(**{**POOL, "chunk_size": 1})
    with pytest.raises(RuntimeError, match="unknown string setting 'mode'"):
        native.native_host_pool(**{**POOL, "mode": "cuda"})
    cfg = dict(POOL)
    del cfg["touch_limit"]
    with pytest.raises(RuntimeError, match="needs the integer setting 'touch_limit'"):
        native.native_host_pool(**cfg)
    cfg = dict(POOL)
    del cfg["strategy"]
    with pytest.raises(RuntimeError, match="needs the string setting 'strategy'"):
        native.native_host_pool(**cfg)


@pytest.mark.skipif(native.zfp_error() is not None, reason="torchckpt._zfp is not built")
def test_zfp_ops_trace_under_fake_tensors() -> None:
    """The zfp ops have fake kernels: they run on fake tensors (what torch.compile traces) and change nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(64, dtype=torch.float32)
        out = torch.empty(1024, dtype=torch.uint8)
        ops.zfp_compress(x, [64], 8.0, out)
        assert out.shape == (1024,)


def test_wrappers_are_typed() -> None:
    tree = ast.parse((ROOT / "_native" / "ops.py").read_text())
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert funcs and all(f.returns is not None and all(a.annotation is not None for a in f.args.args) for f in funcs)
