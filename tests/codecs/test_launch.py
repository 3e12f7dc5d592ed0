"""NOTE [ Kernel launches ] Rule 2 on the CPU: the kinds that key the compiled kernels are at least as fine as
Triton's specialisation (the launches themselves: tests/codecs/test_launch_cuda.py)."""
from __future__ import annotations

import torch

from torchckpt.codecs._launch import _hooked, _kind


def test_a_tensors_kind_is_its_dtype_and_16_byte_alignment() -> None:
    x = torch.zeros(64)
    assert x.data_ptr() % 16 == 0
    assert _kind(x) == (torch.float32, True)
    assert _kind(x[1:]) == (torch.float32, False)  # 4 bytes on
    assert _kind(x[4:]) == (torch.float32, True)  # 16 bytes on
    assert _kind(x.to(torch.float16)) != _kind(x)


def test_ints_are_told_apart_where_triton_specialises() -> None:
    assert _kind(1) != _kind(17)  # 1 is a constant to Triton
    assert _kind(32) != _kind(33)  # multiples of 16
    assert _kind(17) == _kind(33) == _kind(2**31 - 1)  # i32, neither
    assert _kind(2**31) != _kind(2**31 - 1)  # i64
    assert _kind(2**63) != _kind(2**63 - 1)  # u64
    assert _kind(-(2**31) + 1) == _kind(17) != _kind(-(2**31) - 1)
    assert _kind(0) == _kind(16)


def test_bools_floats_and_other_types() -> None:
    assert _kind(True) != _kind(1) and _kind(True) != _kind(False)  # a bool is an int to Python, not to Triton
    assert _kind(0.5) == _kind(3.0) == "f"
    assert _kind(None) is None and _kind("x") is None and _kind((1,)) is None


def test_a_hook_chain_counts_as_set_only_when_it_holds_a_hook() -> None:
    class Chain:  # Triton 3.5+'s knobs.runtime.launch_enter_hook: a HookChain, never None
        def __init__(self) -> None:
            self.calls: list[object] = []

    chain = Chain()
    assert not _hooked(None) and not _hooked(chain)
    chain.calls.append(print)
    assert _hooked(chain) and _hooked(print)
