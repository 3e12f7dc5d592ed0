"""Command line: ``python -m torchckpt demo [--steps N] [--device cpu|cuda] [--shape D,H,S,B,L]``, and
``python -m torchckpt env`` (what torchckpt can use on this machine)."""
from __future__ import annotations

import sys

USAGE = ("usage: python -m torchckpt demo [--steps N] [--device cpu|cuda] [--shape D,H,S,B,L]\n"
         "       python -m torchckpt env")


def main(argv: list[str] | None = None) -> int:
    """Run a command; exit status 0, or 2 for a bad command line (with a ``torchckpt:`` message)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        print("torchckpt: expected a command, demo or env; pass e.g. `python -m torchckpt demo`", file=sys.stderr)
        return 2
    if argv[0] == "demo":
        from torchckpt.demo import main as demo

        return demo(argv[1:])
    if argv[0] == "env":
        from torchckpt.env import main as env

        return env(argv[1:])
    print(f"torchckpt: unknown command {argv[0]!r}; the commands are: demo, env", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
