"""``python -m torchckpt``: every command described, ``help`` and ``--help`` at every level exit 0."""
from __future__ import annotations

import subprocess
import sys

import pytest

from torchckpt.__main__ import main


def test_help_describes_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["-h"], ["help"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        for name in ("demo", "env", "help"):
            assert f"  python -m torchckpt {name}" in out
        assert "a few training steps of a small transformer" in out and "what torchckpt can use on this machine" in out
    from torchckpt.__main__ import COMMANDS

    assert set(COMMANDS) == {"demo", "env", "help"} and all(text for _, text in COMMANDS.values())


def test_help_of_a_command_is_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["help", "demo"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m torchckpt demo")
    assert main(["demo", "--help"]) == 0  # argparse's exit, as an exit status
    assert "--steps" in capsys.readouterr().out
    assert main(["help", "env"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m torchckpt env")
    assert main(["help", "bogus"]) == 2
    assert capsys.readouterr().err.startswith("torchckpt: help takes one command of demo, env, help, got 'bogus'")
    assert main(["bogus"]) == 2
    assert "`python -m torchckpt help` describes them" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["help"], ["env", "--help"], ["help", "env"]])
def test_command_line_exits_0(argv: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "torchckpt", *argv], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m torchckpt")
