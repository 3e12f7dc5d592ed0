"""NOTE [ Cheap streams ] Rule 6 without a GPU: the byte copier's error and ``Blob.write_raw``'s layout (CPU copies)."""
from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchckpt._errors import CheckpointError
from torchckpt._streams import _make_copier, copier
from torchckpt.codecs import Identity
from torchckpt.codecs.blob import Blob


class _Stream:
    cuda_stream = 12345


def test_the_copier_passes_the_stream_and_names_a_runtime_error() -> None:
    calls = []

    def memcpy(dst, src, n, kind, stream):
        calls.append((dst, src, n, kind, stream))
        return 0 if n else 1

    cp = _make_copier(memcpy, lambda rc: b"cudaErrorInvalidValue")
    cp(64, 128, 9, _Stream())
    assert calls == [(64, 128, 9, 4, 12345)]  # cudaMemcpyDefault, on the stream's handle
    with pytest.raises(CheckpointError,
                       match=r"^torchckpt: cudaMemcpyAsync of 0 bytes failed with cudaErrorInvalidValue \(1\)"):
        cp(64, 128, 0, _Stream())


def test_the_copier_is_none_or_callable_and_found_once() -> None:
    cp = copier()
    assert cp is copier()
    if torch.version.cuda is None:
        assert cp is None  # a CPU build of torch has no CUDA runtime to call
    assert cp is None or callable(cp)


def _memmove(dst: int, src: int, n: int, stream: object) -> None:
    ctypes.memmove(dst, src, n)


def test_write_raw_writes_what_write_does() -> None:
    c = Identity()
    xs = [torch.arange(300.0), torch.ones(7, dtype=torch.int64), torch.arange(12.0).view(3, 4).t()]  # last: strided
    packs = [c.compress(x) for x in xs]
    blob = Blob(packs)
    want = torch.zeros(blob.nbytes, dtype=torch.uint8)
    blob.write(want, packs)
    got = torch.full((blob.nbytes,), 5, dtype=torch.uint8)
    got.zero_()
    blob.write_raw(got, packs, _memmove, None)
    assert torch.equal(got, want)
    assert all(torch.equal(c.decompress(p), x) for p, x in zip(blob.read(got), xs))


def test_write_raw_refuses_a_flat_buffer_too_small() -> None:
    c = Identity()
    packs = [c.compress(torch.arange(300.0))]
    blob = Blob(packs)
    small = torch.zeros(blob.nbytes - 512, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="internal error"):
        blob.write_raw(small, packs, _memmove, None)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
                          st.booleans(), st.sampled_from(["identity", "quant4", "quant8"])), min_size=1, max_size=4),
       st.integers(0, 1024))
def test_write_raw_is_write_for_random_packs(specs: list, room: int) -> None:
    """Any codec's packs (TritonQuant's four buffers a tensor, empty tensors, strided ones) land where ``write`` puts
    them, byte for byte, whatever the flat buffer's spare room (NOTE [ Cheap streams ] Rule 6)."""
    from torchckpt.codecs import TritonQuant

    codecs = {"identity": Identity(), "quant4": TritonQuant(4, "abs", 1e-2), "quant8": TritonQuant(8, "rel", 1e-2)}
    packs = []
    for i, (n, dtype, strided, name) in enumerate(specs):
        g = torch.Generator().manual_seed(i)
        x = (torch.randn(2 * n, generator=g) * 100).to(dtype)
        x = x[::2] if strided else x[:n]
        c = codecs[name] if dtype.is_floating_point else codecs["identity"]
        packs.append(c.compress(x))
    blob = Blob(packs)
    want = torch.zeros(blob.nbytes + room, dtype=torch.uint8)
    blob.write(want, packs)
    got = torch.zeros(blob.nbytes + room, dtype=torch.uint8)
    blob.write_raw(got, packs, _memmove, None)
    assert torch.equal(got, want)
