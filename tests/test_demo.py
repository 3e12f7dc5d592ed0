"""``python -m torchckpt demo``: bad arguments give ``torchckpt:`` errors; modes are timed interleaved."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from torchckpt import __main__ as cli
from torchckpt import demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(("args", "expected"), [
    (["--steps", "0"], "torchckpt: argument --steps: expected a positive integer (timed steps per mode), got '0'; "
                       "pass e.g. --steps 5"),
    (["--steps", "-2"], "torchckpt: argument --steps: expected a positive integer"),
    (["--steps", "two"], "torchckpt: argument --steps: expected a positive integer"),
    (["--shape", "foo"], "torchckpt: argument --shape: expected D,H,S,B,L: five positive integers separated by "
                         "commas (model width, heads, sequence, batch, blocks), got 'foo'; pass e.g. --shape 128,4,64,4,4"),
    (["--shape", "128,4,64,4"], "torchckpt: argument --shape: expected D,H,S,B,L"),
    (["--shape", "128,4,0,4,4"], "torchckpt: argument --shape: expected D,H,S,B,L"),
    (["--shape", "130,4,64,4,4"], "torchckpt: argument --shape: the width D must be a multiple of the heads H, "
                                  "got D=130, H=4"),
    (["--device", "gpu"], "torchckpt: argument --device: expected cpu, cuda or cuda:N, got 'gpu'"),
    (["--stpes", "2"], "torchckpt: unrecognized arguments: --stpes 2"),
])
def test_bad_arguments(args: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        demo.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m torchckpt demo")
    assert err.splitlines()[-1].startswith(expected), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_cuda_device_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        demo.main(["--device", "cuda"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "torchckpt: argument --device: 'cuda' needs CUDA, and torch.cuda.is_available() is False; pass --device cpu")


def test_command_line_exit_status() -> None:
    res = subprocess.run([sys.executable, "-m", "torchckpt", "demo", "--steps", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert res.stderr.splitlines()[-1].startswith("torchckpt: argument --steps: expected a positive integer")
    assert res.stdout == ""


def test_cli_without_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("torchckpt: expected a command, demo or env")
    assert cli.main(["demos"]) == 2
    assert capsys.readouterr().err.startswith("torchckpt: unknown command 'demos'")
    assert cli.main(["--help"]) == 0
    assert "python -m torchckpt demo" in capsys.readouterr().out


def test_demo_runs_and_restores_threads(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    assert demo.main(["--steps", "1", "--shape", "16,2,8,2,2", "--device", "cpu"]) == 0
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out
    names = demo._mode_names(2)
    rows = [line[:34].rstrip() for line in out.splitlines() if line[:34].rstrip() in names]
    assert rows == names  # one table row per mode
    assert "1 CPU thread" in out and "cpu ms" in out
    assert "Final losses are identical across the lossless modes" in out


def _fake(name: str, order: list[str], work: float = 0.0, wait: float = 0.0) -> demo._Run:
    def step() -> float:
        order.append(name)
        time.sleep(wait)  # another process holding the CPU: not this thread's CPU time
        end = time.thread_time() + work
        while time.thread_time() < end:
            pass
        return 0.0

    return demo._Run(name, step, None)


def test_modes_are_interleaved_round_robin() -> None:
    order: list[str] = []
    runs = [_fake(n, order) for n in "abc"]
    demo.measure(runs, 3, torch.device("cpu"))
    rounds = [order[i:i + 3] for i in range(0, len(order), 3)]
    assert len(rounds) == demo.WARMUP + 3
    assert rounds[:4] == [list("abc"), list("bca"), list("cab"), list("abc")]  # each round starts one later
    assert all(len(r.times) == 3 for r in runs)  # warm-up rounds are not timed


def test_cpu_steps_count_this_threads_time_only() -> None:
    # A mode that waits (as when other processes hold the CPU) is not charged for the wait.
    order: list[str] = []
    runs = [_fake("ref", order, work=0.004), _fake("waits", order, work=0.002, wait=0.03)]
    demo.measure(runs, 3, torch.device("cpu"))
    rel = demo.ratios(runs[1], runs[0])
    assert len(rel) == 3 and max(rel) < 1.0, rel
