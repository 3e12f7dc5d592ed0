"""Command line: ``python -m torchckpt demo [--steps N] [--device cpu|cuda] [--shape D,H,S,B,L]``,
``python -m torchckpt env`` (what torchckpt can use on this machine) and ``python -m torchckpt help [COMMAND]``."""
from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable

# command -> (its arguments, what it does)
COMMANDS = {
    "demo": ("[--steps N] [--device cpu|cuda] [--shape D,H,S,B,L]",
             "a few training steps of a small transformer under no checkpointing, torch.utils.checkpoint and "
             "torchckpt's policies (Recompute, Offload, a mix, Offload through a 4-bit codec), with each mode's step "
             "time, peak memory and the store's transfers; a GPT-style stack on a GPU, a tiny model on the CPU"),
    "env": ("", "what torchckpt can use on this machine (CUDA, the native extension, the host pools, the node "
                "registration lock, huge pages, memory limits, the codecs' kernels), with advice where it cannot"),
    "help": ("[COMMAND]", "this list, or a command's description and options (as `python -m torchckpt COMMAND --help`)"),
}
USAGE = "usage: python -m torchckpt COMMAND [options]\n\ncommands:\n" + "\n".join(
    f"  python -m torchckpt {name}{' ' + args if args else ''}\n"
    + textwrap.fill(text, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    for name, (args, text) in COMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    """Run a command; exit status 0, or 2 for a bad command line (with a ``torchckpt:`` message)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        print("torchckpt: expected a command, demo or env (or help); pass e.g. `python -m torchckpt demo`",
              file=sys.stderr)
        return 2
    if argv[0] == "help":
        if len(argv) == 1:
            print(USAGE)
            return 0
        if len(argv) > 2 or argv[1] not in COMMANDS:
            print(f"torchckpt: help takes one command of {', '.join(COMMANDS)}, got {' '.join(argv[1:])!r}; pass e.g. "
                  "`python -m torchckpt help demo`", file=sys.stderr)
            return 2
        return main([argv[1], "--help"]) if argv[1] != "help" else main(["help"])
    if argv[0] not in COMMANDS:
        print(f"torchckpt: unknown command {argv[0]!r}; the commands are: {', '.join(COMMANDS)} "
              "(`python -m torchckpt help` describes them)", file=sys.stderr)
        return 2
    if argv[0] == "demo":
        from torchckpt.demo import main as command
    else:
        from torchckpt.env import main as command
    return _exit_status(command, argv[1:])


def _exit_status(command: Callable[[list[str]], int], args: list[str]) -> int:
    """``command(args)``'s exit status, also when argparse exits (``--help``: 0, a bad argument: 2)."""
    try:
        return command(args)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
