"""Native code, loaded in one place: the extensions ``torchckpt._C`` and ``torchckpt._zfp`` and nvCOMP.

# NOTE [ Native code ]
# 1. Every native feature has a pure-Python path or says why it is missing; importing
#    torchckpt never fails because native code is absent. ``torchckpt._C`` (csrc/*.cpp: the
#    host pool, the VMM device arena, ``touch_pages``) is imported here, once, at import.
#    ``torchckpt._zfp`` (csrc/zfp/, built only with ``TORCHCKPT_BUILD_ZFP=1``) is imported on
#    first use (``zfp_error``). nvCOMP's shared library is loaded through ctypes on first use
#    (``torchckpt._native.nvcomp``).
# 2. Nothing outside this package imports the extensions or names ``torch.ops.torchckpt`` /
#    ``torch.classes.torchckpt``: ``ops.py`` wraps every op with types, and the ``*_class``
#    functions here return the compiled classes.
# 3. The ``*_error`` functions say why a feature is missing (``None`` when it is there), in
#    words a user can act on.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from torchckpt._errors import CheckpointError

__all__ = ["capabilities", "device_arena_class", "host_pool_available", "host_pool_can_register",
           "native_available", "native_error", "native_host_pool", "native_host_pool_class", "touch_pages", "vmm_error", "zfp_error"]

_log = logging.getLogger("torchckpt")
_error: str | None = None

try:
    import torchckpt._C  # noqa: F401  (registers torch.ops.torchckpt.* and torch.classes.torchckpt.*)
except ImportError as e:  # not built, or built against another torch
    _error = str(e)
    _log.debug("torchckpt: native extension not loaded: %s", e)

_zfp_error: str | None = None
_zfp_loaded = False


def native_available() -> bool:
    """Whether ``torchckpt._C`` is loaded."""
    return _error is None


def native_error() -> str | None:
    """Why ``torchckpt._C`` is not loaded (``None`` when it is)."""
    return _error


def zfp_error() -> str | None:
    """Import ``torchckpt._zfp`` once; ``None`` when its ops are registered, else why not
    (NOTE [ Native code ] Rule 1)."""
    global _zfp_error, _zfp_loaded
    if not _zfp_loaded:
        _zfp_loaded = True
        try:
            import torchckpt._zfp  # noqa: F401  (registers torch.ops.torchckpt.zfp_*)
        except ImportError as e:
            _zfp_error = str(e)
        else:
            from torchckpt._native import ops

            ops.register_zfp_fakes()
    return _zfp_error


def host_pool_available() -> bool:
    """Whether the native lazily pinned host pool (csrc/host_pool.cpp) is loaded."""
    if not native_available():
        return False
    try:
        torch.ops.torchckpt.host_page_bytes.default  # noqa: B018  (raises when the op is missing)
        return True
    except (AttributeError, RuntimeError):
        return False


def host_pool_can_register() -> bool:
    """Whether the native host pool was built with the CUDA runtime (it can pin memory)."""
    from torchckpt._native import ops

    return host_pool_available() and ops.host_pool_built_with_cuda()


def native_host_pool_class() -> Any:
    """The native host pool class (``torch.classes.torchckpt.HostPool``); raises when not built."""
    if not host_pool_available():
        raise CheckpointError(
            "torchckpt: the native host pool is not available "
            f"({native_error() or 'this build of torchckpt._C has no host_pool.cpp'}); build the extension with "
            "`pip install --no-build-isolation -e .` where torch is installed, or use HostPool."
        )
    return torch.classes.torchckpt.HostPool


def native_host_pool(**config: int | bool | str) -> Any:
    """A native host pool from one config value: its settings by name (csrc/host_pool.cpp, ``make_host_pool``).

    Integers and booleans go as integers, strings as strings; the native side rejects a missing
    or unknown setting by name.
    """
    cls = native_host_pool_class()
    ints = {k: int(v) for k, v in config.items() if not isinstance(v, str)}
    strs = {k: v for k, v in config.items() if isinstance(v, str)}
    return cls(ints, strs)


def vmm_error() -> str | None:
    """Why the VMM device arena (csrc/vmm_cache.cpp) is not compiled in (``None`` when it is)."""
    if not native_available():
        return (
            f"torchckpt: the native extension torchckpt._C is not loaded ({native_error()}), so the VMM device "
            "arena is unavailable. Fix: build it with `pip install --no-build-isolation -e .` in an "
            "environment with torch and a CUDA toolkit, or use make_device_slots(..., use_vmm=False)."
        )
    try:
        torch.classes.torchckpt.DeviceArena  # noqa: B018  (raises when absent)
        torch.ops.torchckpt.vmm_status  # noqa: B018
    except (RuntimeError, AttributeError):
        return (
            "torchckpt: the native extension is loaded but has no DeviceArena (built before "
            "csrc/vmm_cache.cpp existed). Fix: rebuild with `pip install --no-build-isolation -e .`."
        )
    return None


def device_arena_class() -> Any:
    """The compiled ``torchckpt::DeviceArena`` class."""
    return torch.classes.torchckpt.DeviceArena


def touch_pages(buf: torch.Tensor, page_bytes: int = 4096) -> int:
    """Write one byte per page of the CPU tensor ``buf`` (keeping its data); returns the page count.

    Uses the native op when built, else a strided in-place update in PyTorch.
    """
    if native_available():
        from torchckpt._native import ops

        return ops.touch_pages(buf, page_bytes)
    flat = buf.view(torch.uint8).view(-1)
    if flat.numel() == 0:
        return 0
    flat[::page_bytes].add_(0)
    return (flat.numel() + page_bytes - 1) // page_bytes


def capabilities() -> dict[str, str | None]:
    """Each native feature and why it is missing (``None``: available)."""
    from torchckpt._native import nvcomp

    return {
        "torchckpt._C": native_error(),
        "host pool": None if host_pool_available() else (native_error() or "built without csrc/host_pool.cpp"),
        "VMM device arena": vmm_error(),
        "torchckpt._zfp": zfp_error(),
        "nvCOMP": nvcomp.unavailable_reason(),
    }
