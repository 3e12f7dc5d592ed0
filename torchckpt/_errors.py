"""Errors raised by torchckpt.

Every user-facing message starts with ``torchckpt:`` and says what was expected,
what was found, and what to pass instead (STYLE.md, practice 6).
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
