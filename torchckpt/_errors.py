"""Errors raised by torchckpt, and the one formatter of byte sizes in its messages.

Every user-facing message starts with ``torchckpt:`` and says what was expected,
what was found, and what to pass instead (STYLE.md, practice 6). Sizes in messages, summaries
and tables go through ``format_bytes`` (``format_bytes_apart`` for several in one message).
"""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A torchckpt operation could not be carried out as asked."""


def internal_error(what: str) -> CheckpointError:
    """An invariant of torchckpt itself broke: ask the user to report it."""
    return CheckpointError(
        f"torchckpt: internal error: {what}. This is a bug in torchckpt, not in your code; "
        "please report it with the smallest script that shows it."
    )


_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float, digits: int = 2) -> str:
    """``n`` bytes for a message: whole bytes below 1 KiB, else the largest binary unit with ``digits`` decimals.

    Every user-facing size goes through this function or ``format_bytes_apart`` (one formatter, one style).

    Example::

        >>> format_bytes(512), format_bytes(1509949), format_bytes(3 << 30), format_bytes(1048575)
        ('512 B', '1.44 MiB', '3.00 GiB', '1.00 MiB')
    """
    a = abs(n)
    if round(a) < 1024:
        return f"{round(n)} B"
    for k, unit in enumerate(_BINARY_UNITS):
        v = a / 1024 ** (k + 1)
        if round(v, digits) < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{'-' if n < 0 else ''}{v:.{digits}f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def format_bytes_apart(*values: float) -> list[str]:
    """``format_bytes`` of each value, with more decimals, then whole bytes, where two different values would
    print alike: sizes compared in one message never read the same unless they are.

    Example::

        >>> format_bytes_apart(1509949, 1509949 + 1000, 1 << 30)
        ['1.440 MiB', '1.441 MiB', '1.00 GiB']
        >>> format_bytes_apart(1509949, 1509950)
        ['1509949 B', '1509950 B']
    """
    out = [format_bytes(v) for v in values]
    for digits in (3, 4, None):
        clash = {i for i, (v, s) in enumerate(zip(values, out))
                 if any(s == t and v != w for w, t in zip(values, out))}
        if not clash:
            break
        for i in clash:
            out[i] = format_bytes(values[i], digits) if digits is not None else f"{round(values[i])} B"
    return out
