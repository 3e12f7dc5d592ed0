"""The codecs' Triton kernels launched through the kernel Triton compiled for them, without the JIT's launch path.

Triton's ``kernel[grid](...)`` binds the arguments, computes their specialisation key and looks it up on every call:
14-24 us of host time a launch on an H100 machine, against 5.5-6.9 us through the compiled kernel's launcher
(benchmarks/launch_cost.py). A compressed save launches two kernels and a restore two, so on a host-bound adjoint
loop (issue 26) that path is a large part of the store's time per action.

# NOTE [ Kernel launches ]
# 1. ``Launch(kernel)(grid, *args, **kw)`` launches ``kernel`` as ``kernel[grid](*args, **kw)`` would: the first
#    call for arguments of a kind goes through Triton's JIT (which compiles, or finds, the kernel for them) and
#    keeps the compiled kernel it returns under the arguments' kind; later calls of that kind call its launcher
#    with the same arguments in the kernel's parameter order, on the current device's current stream, as the JIT
#    does.
# 2. The kind is at least as fine as Triton's specialisation, so one kind never maps to two compiled kernels:
#    the current device; per positional argument, a tensor's dtype and whether its address is a multiple of 16, a
#    bool's value, an int's being 1, its being a multiple of 16 and its range (i32, u64, i64), a float as fp32;
#    every keyword argument's value (constexprs and launch options such as ``num_warps``). An argument of another
#    type, a keyword that is not hashable, or a parameter the call does not name, and every call while Triton's
#    launch hooks are set (a profiler's), go through the JIT each time: the same launch, at its price; so does a
#    kernel of triton's interpreter (``TRITON_INTERPRET=1``), which runs on the CPU.
# 3. The kernels of ``_quant_triton.py`` read no global that can change, so the JIT's check that the globals they
#    read have not changed since compiling is not repeated. Results are the JIT's launch's, bit for bit (the CUDA
#    tests run both).
# 4. ``ENABLED = False`` (module-wide) sends every launch through the JIT: the same results at the JIT's price, for
#    measuring one against the other in one process (benchmarks/launch_cost.py).
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["ENABLED", "Launch"]

ENABLED = True  # NOTE [ Kernel launches ] Rule 4
_triton: Any = None  # (knobs.runtime, driver.active), imported at the first launch


def _kind(a: Any) -> Any:
    """An argument's kind (NOTE [ Kernel launches ] Rule 2); ``None``: not one this cache keys."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        r = 0 if -(2**31) <= a <= 2**31 - 1 else (1 if 2**63 <= a <= 2**64 - 1 else 2)
        return (a == 1, a % 16 == 0, r)
    if isinstance(a, float):
        return "f"
    return None


def _hooked(hook: Any) -> bool:
    """Whether a launch hook of Triton's is set: a hook, or a chain of hooks (Triton 3.5+) holding one."""
    return hook is not None and bool(getattr(hook, "calls", True))


class Launch:
    """Launches of one Triton kernel through the compiled kernels the JIT chose (NOTE [ Kernel launches ])."""

    def __init__(self, kernel: Any) -> None:
        from triton.runtime.jit import JITFunction

        self.kernel = kernel
        # triton's interpreter (TRITON_INTERPRET=1) makes other callables, run on the CPU: launched as they are
        self.jit = isinstance(kernel, JITFunction)
        self.names: tuple[str, ...] = tuple(kernel.arg_names) if self.jit else ()
        self._compiled: dict[Any, tuple[Any, Any, Any, tuple[str, ...]]] = {}
        self.jit_calls = 0  # launches that went through the JIT (the tests count them)

    def __call__(self, grid: tuple[int, ...], *args: Any, **kw: Any) -> None:
        global _triton
        if not (self.jit and ENABLED):
            self.jit_calls += 1
            self.kernel[grid](*args, **kw)
            return
        if _triton is None:
            from triton import knobs
            from triton.runtime.driver import driver

            _triton = (knobs.runtime, driver.active)
        runtime, active = _triton
        dev = active.get_current_device()
        key: Any = None
        hit = None
        if not (_hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook)):
            kinds = tuple(_kind(a) for a in args)
            if None not in kinds:
                key = (dev, kinds, tuple(kw.items()))  # the call sites name their keywords in one order
                try:
                    hit = self._compiled.get(key)
                except TypeError:  # a keyword's value is not hashable
                    key = None
        if hit is None:
            self.jit_calls += 1
            ck = self.kernel[grid](*args, **kw)
            rest = self.names[len(args):]
            if key is not None and ck is not None and all(n in kw for n in rest):
                self._compiled[key] = (ck.run, ck.function, ck.packed_metadata, rest)
            return
        run, fn, meta, rest = hit
        g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        run(g[0], g[1], g[2], active.get_current_stream(dev), fn, meta, None, None, None,
            *args, *[kw[n] for n in rest])
