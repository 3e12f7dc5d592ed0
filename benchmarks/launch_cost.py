"""Diagnosis (not a claim): the host's time per call of what a compressed save and restore launch (issue 26).

On an H100 the (d) runs of ``adjoint_codecs.py`` with ``TritonQuant(bits=4)`` leave the device idle 57-69% of the
run while the device-only run (a), with the same callbacks, does not: the host's time per store action is what
binds. This script times, on small tensors (the device far faster than the host, so a call's time is the host's),
each piece of ``TritonQuant``'s save (``compress_deferred``) and restore (``decompress``) one by one, against a
PyTorch op's launch, and each Triton kernel through Triton's JIT launch (``kernel[grid](...)``: argument binding,
specialisation key, cache lookup) and through its compiled kernel's launcher directly (the same kernel, none of that),
so what a cheaper launch would save is measured, not guessed; then the codec's save and restore whole with every
launch through the JIT and through the compiled kernels (NOTE [ Kernel launches ], ``_launch.ENABLED``), in turn.

    python benchmarks/launch_cost.py [--n 4096] [--reps 2000]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch


def per_call(fn: Callable[[], Any], reps: int) -> float:
    """Microseconds a call, ``reps`` calls in a row after 20 warm-up calls, between two synchronisations."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def direct(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], kw: dict[str, Any]) -> Callable[[], None]:
    """A call of ``kernel`` compiled for these arguments through its launcher alone (no binding, no key, no
    lookup): valid only for these arguments' types and alignments, which is what a cache of launchers would key."""
    ck = kernel[grid](*args, **kw)
    names = kernel.arg_names
    full = list(args) + [kw[n] for n in names[len(args):]]  # kw's launch options (num_warps, ...) are not arguments
    g = tuple(grid) + (1,) * (3 - len(grid))
    stream = torch.cuda.current_stream().cuda_stream
    run, fn, meta = ck.run, ck.function, ck.packed_metadata

    def call() -> None:
        run(g[0], g[1], g[2], stream, fn, meta, None, None, None, *full)

    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096, help="elements of the tensor saved and restored")
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--turns", type=int, default=7, help="turns of JIT and compiled launches for the whole codec")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("launch_cost: needs CUDA (it times launches); nothing to do here")
        return
    from torchckpt.codecs import TritonQuant, _launch
    from torchckpt.codecs import _quant_triton as k
    from torchckpt.codecs.quant import _bits, _small_rows, _tl_dtype, triton_cdiv

    dev = torch.device("cuda")
    x = torch.randn(args.n, device=dev)
    out = torch.empty_like(x)
    print(f"launch_cost: {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.n} fp32 elements, "
          f"{args.reps} calls each; microseconds a call (host-bound: the device is faster)")
    rows: list[tuple[str, float]] = []

    def row(label: str, fn: Callable[[], Any]) -> None:
        us = per_call(fn, args.reps)
        rows.append((label, us))
        print(f"  {label:<78} {us:8.2f} us", flush=True)

    row("torch.empty(2) on the device", lambda: torch.empty(2, device=dev))
    row("torch.zeros(2, int64) on the device", lambda: torch.zeros(2, dtype=torch.int64, device=dev))
    row("x.add_(0) (one PyTorch kernel launch)", lambda: x.add_(0))
    for bits in (4, 8):
        c = TritonQuant(bits=bits, mode="abs", bound=1e-3)
        B = c.block
        nb = -(-args.n // B)
        rws, warps, drows, dwarps = c._config(x.dtype)
        codes = torch.empty(nb * B * bits // 8, dtype=torch.uint8, device=dev)
        params = torch.empty(nb, 2, dtype=torch.float32, device=dev)
        sizes = torch.zeros(2, dtype=torch.int64, device=dev)
        count = sizes.view(torch.int32)[:1]
        qa = (x, codes, params, count, args.n, nb, c._b32, float(2**bits - 1), 0)
        qk = dict(MASKED=False, BIG=False, REL=False, BITS=bits, FP8=False, BLOCK=B, ROWS=rws,
                  OUT=_tl_dtype(x.dtype), num_warps=warps, enable_fp_fusion=False)
        grid = (args.n // (rws * B),)
        row(f"quant{bits}: quant_kernel, Triton's JIT launch", lambda: k.quant_kernel[grid](*qa, **qk))
        row(f"quant{bits}: quant_kernel, its launcher directly", direct(k.quant_kernel, grid, qa, qk))
        R = _small_rows(B)
        rr = torch.empty(nb * B, dtype=torch.int32, device=dev)
        ra = (_bits(x), params, rr, sizes, args.n, nb)
        rk = dict(NPAR=2, BLOCK=B, ROWS=R)
        rgrid = (triton_cdiv(nb, R),)
        row(f"quant{bits}: raw_rows_kernel, Triton's JIT launch", lambda: k.raw_rows_kernel[rgrid](*ra, **rk))
        row(f"quant{bits}: raw_rows_kernel, its launcher directly", direct(k.raw_rows_kernel, rgrid, ra, rk))
        d = c.compress_deferred(x)
        pk = c.settle(d, (0, 0))
        whole = {"compress_deferred (whole)": lambda: c.compress_deferred(x),
                 "decompress(out=) (whole)": lambda: c.decompress(pk, out=out),
                 "compress (exact: reads the count back)": lambda: c.compress(x)}
        for what, fn in whole.items():  # JIT and compiled launches in turns: a host's slow spell hits both
            got: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.turns):
                for fast in (False, True):
                    _launch.ENABLED = fast
                    got[fast].append(per_call(fn, args.reps // 4))
                    c.scratch = type(c.scratch)()  # compress_deferred lent rows that nothing gives back
            _launch.ENABLED = True
            a, b = statistics.median(got[False]), statistics.median(got[True])
            print(f"  quant{bits}: {what}: JIT launches {a:.1f} us, compiled {b:.1f} us (medians of {args.turns} "
                  f"turns; least {min(got[False]):.1f}, {min(got[True]):.1f}): {a / b:.2f}x less host time",
                  flush=True)
    print("launch_cost: done")


if __name__ == "__main__":
    main()
