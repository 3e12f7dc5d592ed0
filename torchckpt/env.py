"""What torchckpt can use on this machine: ``python -m torchckpt env``.

Each line names a capability, what was found, and, where it is missing, what to do about it.
Nothing here allocates GPU or host memory beyond creating the CUDA context when a GPU exists.

Example::

    >>> lines = report()
    >>> lines[0].name
    'torchckpt'
    >>> all(isinstance(line.value, str) for line in lines)
    True
"""
from __future__ import annotations

import dataclasses
import os
import platform
import resource
import sys

import torch

import torchckpt
from torchckpt._errors import format_bytes
from torchckpt._native import host_pool_available, host_pool_can_register, native_available, native_error

HELP = """usage: python -m torchckpt env

What torchckpt can use on this machine, one line per capability: CUDA and its devices, the native extension
torchckpt._C, the lazily pinned host pool and the pool the stores make by default, the node registration lock,
transparent huge pages, the locked-memory limit, whether freed memory goes back to a VM host, the available host
memory, the VMM device arena and the codecs' GPU kernels (TritonQuant, Bitcomp, ZFP). Where one is missing, the
line below it says what to do. Takes no options."""


@dataclasses.dataclass(frozen=True)
class Line:
    """One capability: its ``name``, what was found (``value``), and ``advice`` when it is missing."""

    name: str
    value: str
    advice: str = ""


def _sys_choice(path: str) -> str:
    """The bracketed choice of a /sys setting such as ``always [madvise] never``."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return "unknown"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return text


def balloon_reporting(root: str = "/sys/bus/virtio/devices") -> bool | None:
    """Whether a virtio balloon reports free pages to the host (``None``: no balloon seen).

    Where it does, memory a process frees goes back to the host after a few seconds, and the
    next first touch of it faults the host in again (NOTE [ Lazy host pool ] Rule 8).
    """
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(root, name, "device")) as f:
                if int(f.read().strip(), 16) != 5:  # VIRTIO_ID_BALLOON
                    continue
            with open(os.path.join(root, name, "features")) as f:
                bits = f.read().strip()
        except (OSError, ValueError):
            continue
        return len(bits) > 5 and bits[5] == "1"  # VIRTIO_BALLOON_F_REPORTING
    return None


def _memlock() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else format_bytes(soft)


def report() -> list[Line]:
    """Probe this machine; one :class:`Line` per capability, in a fixed order."""
    from torchckpt._native import nvcomp
    from torchckpt.codecs import TritonQuant
    from torchckpt.codecs.zfp import ZFP
    from torchckpt.memory import device_arena
    from torchckpt.memory.factory import default_pool_kind, node_lock_default
    from torchckpt.memory.sysinfo import available_memory_bytes
    from torchckpt.memory.node_lock import default_lock_path

    cuda = torch.cuda.is_available()
    out = [
        Line("torchckpt", f"{torchckpt.__version__} (Python {platform.python_version()}, torch {torch.__version__})"),
        Line("CUDA", f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
             if cuda else "not available",
             "" if cuda else "the stores run on the CPU (a simulated two-tier store); the GPU paths need a CUDA device"),
    ]
    if native_available():
        out.append(Line("native extension torchckpt._C", "loaded"))
    else:
        out.append(Line("native extension torchckpt._C", f"not loaded ({native_error()})",
                        "pip install --no-build-isolation -e . with torch installed first (pure-Python paths still work)"))
    if host_pool_can_register():
        pool = "built with CUDA (can pin)" if cuda else "built with CUDA, but cannot pin without a GPU (not used here)"
    elif host_pool_available():
        pool = "built without CUDA (cannot pin)"
    else:
        pool = "not built"
    out.append(Line("lazily pinned host pool", pool,
                    "" if host_pool_can_register() or not cuda else "rebuild torchckpt._C where a CUDA toolkit is found"))
    try:
        kind = {"lazy": "LazyHostPool", "python": "HostPool"}[default_pool_kind(cuda)]
        env = os.environ.get("TORCHCKPT_HOST_POOL")
        out.append(Line("stores' default host pool", kind + (f" (TORCHCKPT_HOST_POOL={env})" if env else "")))
    except ValueError as e:
        out.append(Line("stores' default host pool", "invalid setting", str(e)))
    lock = default_lock_path()
    lock_dir = os.path.dirname(lock) or "."
    writable = os.access(lock if os.path.exists(lock) else lock_dir, os.W_OK)
    out.append(Line("node registration lock",
                    f"{'on' if node_lock_default() else 'off (TORCHCKPT_NODE_LOCK=0)'}, {lock}"
                    + ("" if writable else " (not writable)"),
                    "" if writable else "set TORCHCKPT_REGISTER_LOCK to a writable file"))
    thp = _sys_choice("/sys/kernel/mm/transparent_hugepage/enabled")
    out.append(Line("transparent huge pages", f"{thp}, defrag {_sys_choice('/sys/kernel/mm/transparent_hugepage/defrag')}",
                    "" if thp in ("always", "madvise") else
                    "without huge pages the host pool registers several times slower"))
    out.append(Line("locked-memory limit", _memlock()))
    rep = balloon_reporting()
    out.append(Line("freed memory returned to the VM host", {None: "no virtio balloon seen", False: "no",
                                                             True: "yes (virtio-balloon free page reporting)"}[rep],
                    "a pool made a few seconds after memory was freed touches several times slower; keep pools "
                    "alive rather than re-creating them" if rep else ""))
    out.append(Line("available host memory", format_bytes(available_memory_bytes())))
    arena = device_arena.unavailable_reason() if cuda else "no CUDA device"
    out.append(Line("VMM device arena", "available" if arena is None else f"not available ({arena})"))
    triton = TritonQuant().unavailable_reason()
    out.append(Line("TritonQuant GPU kernels", "available" if triton is None else "not available", triton or ""))
    nv = nvcomp.unavailable_reason()
    out.append(Line("Bitcomp (nvCOMP)", f"available ({nvcomp.library_path()})" if nv is None else "not available",
                    nv or ""))
    zfp = ZFP(rate=8).unavailable_reason()
    out.append(Line("ZFP (cuZFP)", "available" if zfp is None else "not available", zfp or ""))
    return out


def main(argv: list[str] | None = None) -> int:
    """Print :func:`report` (``--help``: what it reports); exit status 0, or 2 for an argument (it takes none)."""
    if argv in (["-h"], ["--help"]):
        print(HELP)
        return 0
    if argv:
        print("usage: python -m torchckpt env", file=sys.stderr)
        print(f"torchckpt: env takes no arguments, got {' '.join(argv)!r}; pass `python -m torchckpt env` "
              "(`--help` says what it reports)", file=sys.stderr)
        return 2
    lines = report()
    width = max(len(line.name) for line in lines)
    for line in lines:
        print(f"{line.name:<{width}}  {line.value}")
        if line.advice:
            print(f"{'':<{width}}  -> {line.advice}")
    return 0
