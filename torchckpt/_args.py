"""Checks of user arguments shared across the package: byte sizes (``1 << 30``, ``"1GiB"``), flags, host pools.

Each raises at the call that received the value, naming it and what to pass (STYLE.md, practice 6).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: object, arg: str) -> int:
    """``value`` as a number of bytes: an int >= 0, or a string such as ``"1GiB"`` or ``"512MB"``.

    Args:
        value: what the user passed.
        arg: how to name it in errors, e.g. ``"Store(gpu_bytes=...)"``.

    Returns:
        The byte count.

    Example::

        >>> parse_bytes("1.5GiB", "gpu_bytes"), parse_bytes(4096, "gpu_bytes")
        (1610612736, 4096)
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"torchckpt: {arg} expects a byte count (an int, or a string such as '1GiB' or '512MB'), "
            f"got {type(value).__name__} {value!r}."
        )
    if isinstance(value, str):
        m = _SIZE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"torchckpt: {arg} could not read {value!r} as a size; pass an int or a number with one of the "
                "units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '1GiB')."
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < 0:
        raise ValueError(f"torchckpt: {arg} must be >= 0 bytes, got {value}.")
    return value


def found(value: object) -> str:
    """``value`` named for an error message's "got ...": a class, a function, a tensor by its shape, else its type
    and a short repr.

    Example::

        >>> found(int), found(len), found("x" * 100)[:12]
        ('the class int', 'the function len', "str 'xxxxxxx")
    """
    import inspect
    import reprlib

    import torch

    if isinstance(value, type):
        return f"the class {value.__qualname__}"
    if inspect.isroutine(value):
        name = getattr(value, "__name__" if inspect.isbuiltin(value) else "__qualname__", None)
        return f"the function {name or repr(value)}"
    if isinstance(value, torch.Tensor):
        return f"a {type(value).__name__} of shape {tuple(value.shape)}"
    if isinstance(value, torch.nn.Module):
        return f"the module {type(value).__name__}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {reprlib.repr(list(value))}"
    return f"{type(value).__name__} {reprlib.repr(value)}"


def check_module(where: str, value: object, fix: str) -> None:
    """``value`` must be an ``nn.Module`` instance; ``fix`` says what to pass instead (a class is told to make one).

    Example::

        >>> check_module("plan(model, ...)", len, "pass the model")
        Traceback (most recent call last):
          ...
        TypeError: torchckpt: plan(model, ...) expects an nn.Module, got the function len; pass the model.
    """
    from torch import nn

    if isinstance(value, nn.Module):
        return
    if isinstance(value, type) and issubclass(value, nn.Module):
        fix = f"pass an instance, e.g. {value.__name__}(...)"
    raise TypeError(f"torchckpt: {where} expects an nn.Module, got {found(value)}; {fix}.")


def check_flag(owner: str, name: str, value: object) -> None:
    """``value`` must be ``True`` or ``False`` (a string such as ``"no"`` is not taken as truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"torchckpt: {owner}({name}=...) expects True or False, got {value!r}.")


def check_host(owner: str, host: object) -> None:
    """``host`` must be a host pool (``HostPool``, ``LazyHostPool``) or ``None``."""
    from torchckpt.memory.host_pool import HostPoolBase  # the store imports this module

    if host is not None and not isinstance(host, HostPoolBase):
        raise TypeError(
            f"torchckpt: {owner}(host=...) expects a torchckpt.memory.HostPool or None, got {type(host).__name__} {host!r}; "
            "pass host=None for the default pool (pinned when CUDA is available) or e.g. "
            "host=torchckpt.memory.HostPool(capacity_bytes=8 << 30)."
        )


def part_bytes(sizes: Sequence[int], cuts: Sequence[int]) -> list[int]:
    """Bytes of each part of a block recomputed in parts (``Recompute(parts=...)``, NOTE [ Recompute in parts ]
    Rule 1): ``sizes`` (bytes per saved tensor, in the order the forward saves them) summed between the cuts.
    Pure Python: the one home of this arithmetic for the store's mechanism and the planner's model.

    Args:
        sizes: bytes each saved tensor's recomputation materialises (0 for one kept by reference).
        cuts: the parts' starts after the first, increasing, each below ``len(sizes)``.

    Returns:
        ``len(cuts) + 1`` byte counts; their largest is what the block holds at once in backward.

    Example::

        >>> part_bytes([4, 0, 8, 8, 2], (2, 4))
        [4, 16, 2]
    """
    edges = [0, *cuts, len(sizes)]
    return [sum(sizes[a:b]) for a, b in zip(edges, edges[1:])]
