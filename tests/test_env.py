"""``python -m torchckpt env``: what torchckpt can use on this machine, with advice where it cannot."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from torchckpt.__main__ import main as cli
from torchckpt.env import _sys_choice, balloon_reporting, report

NAMES = [
    "torchckpt", "CUDA", "native extension torchckpt._C", "lazily pinned host pool", "stores' default host pool",
    "node registration lock", "transparent huge pages", "locked-memory limit", "freed memory returned to the VM host",
    "available host memory",
    "VMM device arena", "TritonQuant GPU kernels", "Bitcomp (nvCOMP)", "ZFP (cuZFP)",
]


def value(name: str) -> str:
    return next(line.value for line in report() if line.name == name)


def test_report_names_every_capability_in_order() -> None:
    lines = report()
    assert [line.name for line in lines] == NAMES
    assert all(line.value for line in lines)


def test_cli_prints_every_line_and_rejects_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["env"]) == 0
    out = capsys.readouterr().out
    for name in NAMES:
        assert name in out
    assert cli(["env", "--bogus"]) == 2
    assert cli(["nope"]) == 2
    assert "demo, env" in capsys.readouterr().err


def test_environment_overrides_show(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setenv("TORCHCKPT_HOST_POOL", "python")
    assert value("stores' default host pool") == "HostPool (TORCHCKPT_HOST_POOL=python)"
    monkeypatch.setenv("TORCHCKPT_HOST_POOL", "bogus")
    line = next(line for line in report() if line.name == "stores' default host pool")
    assert line.value == "invalid setting" and line.advice.startswith("torchckpt: TORCHCKPT_HOST_POOL must be")
    monkeypatch.setenv("TORCHCKPT_NODE_LOCK", "0")
    assert value("node registration lock").startswith("off")
    monkeypatch.delenv("TORCHCKPT_NODE_LOCK")
    assert value("node registration lock").startswith("on")
    missing = os.path.join(str(tmp_path), "no-such-dir", "x.lock")
    monkeypatch.setenv("TORCHCKPT_REGISTER_LOCK", missing)
    line = next(line for line in report() if line.name == "node registration lock")
    assert line.value.endswith("(not writable)") and "TORCHCKPT_REGISTER_LOCK" in line.advice


def test_sys_choice_reads_the_bracketed_setting(tmp_path: object) -> None:
    p = os.path.join(str(tmp_path), "enabled")
    with open(p, "w") as f:
        f.write("always [madvise] never\n")
    assert _sys_choice(p) == "madvise"
    assert _sys_choice(os.path.join(str(tmp_path), "missing")) == "unknown"


def test_module_runs_as_a_command() -> None:
    r = subprocess.run([sys.executable, "-m", "torchckpt", "env"], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("torchckpt")


def test_balloon_reporting_reads_the_virtio_feature_bits(tmp_path: object) -> None:
    root = str(tmp_path)

    def dev(name: str, device: str, features: str) -> None:
        os.makedirs(os.path.join(root, name))
        with open(os.path.join(root, name, "device"), "w") as f:
            f.write(device + "\n")
        with open(os.path.join(root, name, "features"), "w") as f:
            f.write(features + "\n")

    assert balloon_reporting(os.path.join(root, "missing")) is None
    dev("virtio0", "0x0002", "0010001001100100")  # a block device
    assert balloon_reporting(root) is None
    dev("virtio1", "0x0005", "0110010100000000")  # balloon, bit 5 (free page reporting) set
    assert balloon_reporting(root) is True
    with open(os.path.join(root, "virtio1", "features"), "w") as f:
        f.write("0110000100000000\n")
    assert balloon_reporting(root) is False


def test_help_exits_0_and_says_what_env_reports(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--help", "-h"):
        assert cli(["env", flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: python -m torchckpt env\n") and "one line per capability" in out
    assert cli(["env", "--bogus"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("torchckpt: env takes no arguments, got '--bogus'")
    r = subprocess.run([sys.executable, "-m", "torchckpt", "env", "--help"], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0 and "one line per capability" in r.stdout, r.stderr


def test_a_pool_built_with_cuda_does_not_claim_to_pin_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchckpt.env as env

    monkeypatch.setattr(env, "host_pool_can_register", lambda: True)
    monkeypatch.setattr(env.torch.cuda, "is_available", lambda: False)
    lines = {line.name: line for line in env.report()}
    assert lines["CUDA"].value == "not available"
    assert lines["lazily pinned host pool"].value == "built with CUDA, but cannot pin without a GPU (not used here)"
    assert "(can pin)" not in lines["lazily pinned host pool"].value


def test_sizes_take_their_unit() -> None:
    assert re.fullmatch(r"\d+\.\d\d [KMGT]iB", value("available host memory"))
    assert re.fullmatch(r"unlimited|\d+ B|\d+\.\d\d [KMGT]iB", value("locked-memory limit"))
