"""Loads nvCOMP's ``libnvcomp.so.6`` through ctypes and declares the native Bitcomp API.

No C++ build is involved: the functions of ``nvcomp/native/bitcomp.h`` are plain C, so
ctypes calls them directly (host twins included, which run without a GPU). The library is
looked up, in order, at ``$TORCHCKPT_NVCOMP_LIB`` (a path), in the folder of the
``nvidia-libnvcomp-cu13`` wheel (found with ``importlib.util.find_spec`` or under any
``sys.path`` entry, without importing the wheel's Python code), then by soname on the
system's search path. It must report major version 6 (``nvcompGetProperties``): the lossy
entry points are those of 6.0.

Nothing here runs at import; ``library()`` loads once and caches the outcome.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading

from torchckpt._errors import CheckpointError

SONAME = "libnvcomp.so.6"
INSTALL_HINT = "pip install nvidia-libnvcomp-cu13==6.0.0.12"

# bitcompResult_t
_RESULTS = {
    0: "BITCOMP_SUCCESS",
    -1: "BITCOMP_INVALID_PARAMETER",
    -2: "BITCOMP_INVALID_COMPRESSED_DATA",
    -3: "BITCOMP_INVALID_ALIGNMENT",
    -4: "BITCOMP_INVALID_INPUT_LENGTH",
    -5: "BITCOMP_CUDA_KERNEL_LAUNCH_ERROR",
    -6: "BITCOMP_CUDA_API_ERROR",
    -7: "BITCOMP_UNKNOWN_ERROR",
}

# bitcompDataType_t
U8, S8, U16, S16, U32, S32, U64, S64, FP16, FP32, FP64 = range(11)
# bitcompMode_t
LOSSLESS, LOSSY_FP_TO_SIGNED, LOSSY_FP_TO_UNSIGNED = 0, 1, 2
# bitcompAlgorithm_t
DEFAULT_ALGO, SPARSE_ALGO = 0, 1

_V = ctypes.c_void_p
_R = ctypes.c_int
_SIZE = ctypes.c_size_t


class _Properties(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("cudart_version", ctypes.c_uint32)]


_SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "bitcompCreatePlan": (_R, [ctypes.POINTER(_V), _SIZE, ctypes.c_int, ctypes.c_int, ctypes.c_int]),
    "bitcompDestroyPlan": (_R, [_V]),
    "bitcompSetStream": (_R, [_V, _V]),
    # ``half delta``: __half is a 2-byte trivially copyable struct, passed like a uint16_t
    "bitcompCompressLossy_fp16": (_R, [_V, _V, _V, ctypes.c_uint16]),
    "bitcompCompressLossy_fp32": (_R, [_V, _V, _V, ctypes.c_float]),
    "bitcompCompressLossy_fp64": (_R, [_V, _V, _V, ctypes.c_double]),
    "bitcompCompressLossless": (_R, [_V, _V, _V]),
    "bitcompUncompress": (_R, [_V, _V, _V]),
    "bitcompHostCompressLossy_fp16": (_R, [_V, _V, _V, ctypes.c_uint16]),
    "bitcompHostCompressLossy_fp32": (_R, [_V, _V, _V, ctypes.c_float]),
    "bitcompHostCompressLossy_fp64": (_R, [_V, _V, _V, ctypes.c_double]),
    "bitcompHostCompressLossless": (_R, [_V, _V, _V]),
    "bitcompHostUncompress": (_R, [_V, _V, _V]),
    "bitcompMaxBuflen": (_SIZE, [_SIZE]),
    "bitcompGetCompressedSize": (_R, [_V, ctypes.POINTER(_SIZE)]),
    "bitcompGetCompressedSizeAsync": (_R, [_V, _V, _V]),
    "bitcompGetCompressedInfo": (_R, [_V, ctypes.POINTER(_SIZE), ctypes.POINTER(_SIZE), ctypes.POINTER(ctypes.c_int),
                                      ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]),
    "nvcompGetProperties": (ctypes.c_int, [ctypes.POINTER(_Properties)]),
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_loaded = False
_path: str | None = None


def _candidates() -> list[str]:
    out = []
    env = os.environ.get("TORCHCKPT_NVCOMP_LIB")
    if env:
        out.append(env)
    try:
        spec = importlib.util.find_spec("nvidia.libnvcomp")
    except (ImportError, ValueError):
        spec = None
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    # a regular package ``nvidia`` (with an __init__.py) elsewhere on sys.path hides the wheel's
    # folder from find_spec: look in every sys.path entry too
    dirs += [os.path.join(p, "nvidia", "libnvcomp") for p in sys.path if p]
    for d in dirs:
        for sub in ("lib64", "lib", "bin"):
            p = os.path.join(d, sub, SONAME)
            if os.path.isfile(p) and p not in out:
                out.append(p)
    out.append(SONAME)
    return out


def _load() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    errors = []
    for cand in _candidates():
        try:
            lib = ctypes.CDLL(cand, mode=ctypes.RTLD_LOCAL)
        except OSError as e:
            errors.append(f"{cand}: {e}")
            continue
        try:
            for name, (res, args) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype = res
                fn.argtypes = args
        except AttributeError as e:
            errors.append(f"{cand}: lacks {e}")
            continue
        props = _Properties()
        if lib.nvcompGetProperties(ctypes.byref(props)) != 0 or props.version // 1000 != 6:
            errors.append(f"{cand}: reports nvCOMP version {props.version} (need 6.x, i.e. 6000 to 6999)")
            continue
        return lib, None, cand
    return None, (f"Bitcomp needs nvCOMP 6 ({SONAME}), which was not found or not usable: {INSTALL_HINT} "
                  f"(or point TORCHCKPT_NVCOMP_LIB at {SONAME}). Tried: " + "; ".join(errors)), None


def unavailable_reason() -> str | None:
    """``None`` when ``libnvcomp.so.6`` loads, else what is missing and how to install it."""
    global _lib, _reason, _loaded, _path
    with _lock:
        if not _loaded:
            _lib, _reason, _path = _load()
            _loaded = True
        return _reason


def library() -> ctypes.CDLL:
    """The loaded library; raises ``CheckpointError`` naming the fix when it is missing."""
    reason = unavailable_reason()
    if reason is not None or _lib is None:
        raise CheckpointError(f"torchckpt: {reason}")
    return _lib


def library_path() -> str | None:
    """Where the library was loaded from (``None`` when it did not load)."""
    unavailable_reason()
    return _path


def version() -> int | None:
    """nvCOMP's version number (6000 for 6.0.0), ``None`` when the library is missing."""
    if unavailable_reason() is not None:
        return None
    props = _Properties()
    library().nvcompGetProperties(ctypes.byref(props))
    return int(props.version)


def check(rc: int, what: str) -> None:
    """Raise ``CheckpointError`` when a Bitcomp call returned an error code."""
    if rc != 0:
        name = _RESULTS.get(rc, f"code {rc}")
        raise CheckpointError(
            f"torchckpt: nvCOMP {what} failed with {name}. Expected BITCOMP_SUCCESS; if the input came from "
            "Bitcomp.compress, this is a bug (please report it); if it was edited or truncated, compress it again."
        )
