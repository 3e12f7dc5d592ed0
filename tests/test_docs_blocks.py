"""Every ```python block of README.md and docs/*.md runs as written (on the CPU without a GPU).

A block may use names the reader brings: a ``model``, a ``batch``, ``x``, a ``block``, a schedule and its
callbacks. ``BLOCKS`` gives each block, found by a phrase it contains, a small preamble that defines those
names; the preamble runs in a namespace of its own and only the names the entry lists are handed to the block,
so the block's own imports are needed. Lines are numbered as in the file, so a failure points at the doc.
Without a GPU, ``"cuda"`` in a block reads ``"cpu"`` (the stores then simulate both tiers with CPU tensors);
a block that needs a GPU is marked ``cuda=True`` and runs under the ``cuda`` marker (the guide's captured saves); none
needs several processes either (the FSDP2 loop runs as a group of one process). The LazyHostPool block needs the native extension (it skips, with the
package's reason, in the pure-Python install, as its docstring example does). Every python block must have an
entry and every entry must find exactly one block, so a new block is not skipped silently. Shell (bash) blocks
and the plain blocks of docs/architecture.md (diagrams) are not run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import pathlib
import re
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^( *)```(\w*)[ \t]*\n(.*?)^\1```", re.S | re.M)


@dataclasses.dataclass(frozen=True)
class Entry:
    """How to run one block: ``names`` taken from ``preamble``; ``check(namespace, stdout)`` after it."""

    preamble: str = ""
    names: tuple[str, ...] = ()
    check: Callable[[dict[str, Any], str], None] | None = None
    cuda: bool = False  # needs a GPU (run under the cuda marker)
    needs: Callable[[], str | None] | None = None  # why it cannot run in this install (None: it can)


_NET = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

dev = "cuda" if torch.cuda.is_available() else "cpu"
model, x = Net().to(dev), torch.randn(8, 16, device=dev, requires_grad=True)
batch = x
layer, fn = torch.nn.Linear(16, 16, device=dev), torch.sin
"""

_GRAPHS = """
import torch
from torchckpt.codecs import TritonQuant
from torchckpt.schedules import Revolve, Tier

q = TritonQuant(bits=4, mode="abs", bound=1e-2)
u, u_prev = torch.randn(1 << 16, device="cuda"), torch.randn(1 << 16, device="cuda")
schedule = Revolve(20, 4, tier=Tier.HOST)

def forward(n0, n1):  # the state updated in place: its buffers stay where they are
    for _ in range(n0, n1):
        u_prev.copy_(u)
        u.mul_(0.99).add_(0.01)

def save(n):
    return u, u_prev

def backward(n):
    pass
"""


def _graphs(ns: dict[str, Any], out: str) -> None:
    assert ns["stats"].graph_saves > 0 and 0 < ns["stats"].graph_captures <= 6, out
    assert "saves replayed" in out


_ADJOINT = """
import torch
from torchckpt.schedules import Revolve, Tier

dev = "cuda" if torch.cuda.is_available() else "cpu"
block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()).to(dev)
state, seen = [torch.randn(4096, device=dev)], []
schedule = Revolve(8, 3, tier=Tier.HOST)

def forward(n0, n1):
    state[0] = state[0] * 1.01 ** (n1 - n0)

def save(n):
    return state[0]

def restore(n, tensors):
    state[0] = tensors[0].clone()

def backward(n):
    seen.append(n)
"""


def _use(ns: dict[str, Any], out: str) -> None:
    assert ns["store"].stats().packed > 0
    assert "Store(min_bytes=0) moves small tensors" in out  # the summary says why nothing moved
    ns["chain"].remove()


def _plan(ns: dict[str, Any], out: str) -> None:
    assert out.startswith("torchckpt plan on ") and "layers.5" in out
    ns["applied"].remove()


def _chain(ns: dict[str, Any], out: str) -> None:
    assert out.split() == ["12"]


def _lazy(ns: dict[str, Any], out: str) -> None:
    assert ns["s"].capacity_bytes == 8 << 30
    ns["pool"].close()


def _codec(ns: dict[str, Any], out: str) -> None:
    assert ns["seen"] == list(range(8))[::-1] and ns["snaps"].stats().raw_bytes > 0


def _planner(ns: dict[str, Any], out: str) -> None:
    assert any(b.mode != "keep" for b in ns["p"].blocks) and pathlib.Path("plan.json").exists()


def _native_host_pool() -> str | None:
    from torchckpt._native import host_pool_available, native_error

    return None if host_pool_available() else f"needs the native host pool of torchckpt._C ({native_error()})"


def _trainer(ns: dict[str, Any], out: str) -> None:
    assert ns["callback"].plan is not None and "torchckpt plan" in out


def _hf_trainer() -> str | None:
    import importlib.util

    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    return f"needs {' and '.join(missing)} (not torchckpt dependencies)" if missing else None


def _lightning(ns: dict[str, Any], out: str) -> None:
    assert ns["callback"].plan is not None and "keep" in out


def _pl() -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("pytorch_lightning") is not None else \
        "needs pytorch_lightning (not a torchckpt dependency)"


_ONE_RANK = """
import os, socket

with socket.socket() as s:  # what torchrun sets, for a group of one process
    s.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
"""


def _dist() -> str | None:
    import torch.distributed as dist

    return None if dist.is_available() and dist.is_gloo_available() else "needs torch.distributed with gloo"


def _fsdp(ns: dict[str, Any], out: str) -> None:
    import os

    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    assert len(ns["plan"].blocks) == 8 and "keep" in out


def _graphed(ns: dict[str, Any], out: str) -> None:
    st = ns["graphed"].stats()
    if torch.cuda.is_available():
        assert st.get("captures", 0) >= 1 and st.get("replays", 0) >= 2, st
    else:
        assert st.get("eager", 0) >= 3 and "captures" not in st, st
    assert "eager" in out


# (file, a phrase of the block) -> how to run it
BLOCKS: dict[tuple[str, str], Entry] = {
    ("README.md", "torchckpt.offload(store)"): Entry(_NET, ("model", "x", "layer", "fn"), _use),
    ("README.md", "torchckpt.plan(model, batch"): Entry(_NET, ("model", "batch"), _plan),
    ("guide.md", "checkpoint_chain(list(blocks)"): Entry(check=_chain),
    ("guide.md", "LazyHostPool(capacity_bytes"): Entry(check=_lazy, needs=_native_host_pool),
    ("guide.md", "Revolve(1000, 16"): Entry(),
    ("guide.md", "checkpointed_scan(step"): Entry(),
    ("guide.md", "disk=tempfile.mkdtemp()"): Entry(),
    ("guide.md", "TritonQuant(bits=4"): Entry(_ADJOINT, ("block", "schedule", "forward", "save", "restore",
                                                         "backward", "seen"), _codec),
    ("guide.md", "graph_captures"): Entry(_GRAPHS, ("q", "schedule", "forward", "save", "backward", "u", "u_prev"),
                                          _graphs, cuda=True),
    ("guide.md", "Recompute(graphed=True)"): Entry(check=_graphed),
    ("guide.md", "torch.save(m, buf)"): Entry(),
    ("guide.md", "PlanCallback(budget=\"1GiB\")"): Entry(check=_trainer, needs=_hf_trainer),
    ("guide.md", "PlanCallback(budget=\"1GiB\", module="): Entry(check=_lightning, needs=_pl),
    ("guide.md", "fully_shard(model)"): Entry(_ONE_RANK, check=_fsdp, needs=_dist),
    ("planner.md", "torchckpt.plan(model, x"): Entry(check=_planner),
}


def _blocks() -> list[tuple[str, int, str]]:
    """(file name, line of the block's first line of code, code) of every python block."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for m in _FENCE.finditer(text):
            if m.group(2) != "python":
                continue
            found.append((path.name, text.count("\n", 0, m.start(3)) + 1, textwrap.dedent(m.group(3))))
    return found


FOUND = _blocks()


def _entry(name: str, code: str) -> tuple[str, Entry] | None:
    keys = [k for k in BLOCKS if k[0] == name and k[1] in code]  # one at most: the first test checks it
    return (keys[0][1], BLOCKS[keys[0]]) if keys else None


def test_every_block_has_one_entry_and_every_entry_one_block() -> None:
    assert len(FOUND) >= 10
    missing = [f"{name}:{line}" for name, line, code in FOUND if _entry(name, code) is None]
    assert not missing, f"python blocks with no entry in BLOCKS: {missing}"
    for name, line, code in FOUND:
        keys = [k for k in BLOCKS if k[0] == name and k[1] in code]
        assert len(keys) == 1, f"{name}:{line} matches the phrases of {keys}; make them distinct"
    for (name, phrase) in BLOCKS:
        hits = [line for n, line, code in FOUND if n == name and phrase in code]
        assert len(hits) == 1, f"BLOCKS entry ({name!r}, {phrase!r}) finds {len(hits)} blocks"


def _params() -> list[Any]:
    out = []
    for name, line, code in FOUND:
        got = _entry(name, code)
        marks = [pytest.mark.cuda] if got is not None and got[1].cuda else []
        out.append(pytest.param(name, line, code, marks=marks, id=f"{name}:{got[0] if got else line}"))
    return out


@pytest.mark.parametrize(("name", "line", "code"), _params())
def test_block_runs(name: str, line: int, code: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got = _entry(name, code)
    assert got is not None, f"{name}:{line} has no entry in BLOCKS"
    entry = got[1]
    why = entry.needs() if entry.needs is not None else None
    if why is not None:
        pytest.skip(why)
    if not torch.cuda.is_available():
        code = code.replace('"cuda"', '"cpu"')
    monkeypatch.chdir(tmp_path)  # blocks that write files (plan.json) write them here
    pre: dict[str, Any] = {}
    exec(compile(entry.preamble, f"preamble of {name}:{line}", "exec"), pre)  # noqa: S102 - the test's own code
    ns: dict[str, Any] = {"__name__": "__docs__"}
    ns.update({k: pre[k] for k in entry.names})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile("\n" * (line - 1) + code, name, "exec"), ns)  # noqa: S102 - the doc's own example
    if entry.check is not None:
        entry.check(ns, out.getvalue())
