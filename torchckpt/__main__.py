"""Command line: ``python -m torchckpt demo [--steps N] [--device cpu|cuda] [--shape D,H,S,B,L]``, and
``python -m torchckpt env`` (what torchckpt can use on this machine)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m torchckpt demo [--steps N] [--device cpu|cuda] [--shape D,H,S,B,L]\n"
              "       python -m torchckpt env")
        return 0 if argv else 2
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
