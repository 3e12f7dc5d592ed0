"""GPUDirect Storage through cuFile: a disk tier's file read straight into device memory.

# NOTE [ cuFile reads ]
# 1. ``DiskTier(device_reads=...)`` (NOTE [ Disk tier ] Rule 8) reads a file into a CUDA buffer with ``cuFileRead``
#    (``cuda.bindings.cufile``: cuda-bindings is torch's own dependency on CUDA 13 wheels, and its descriptors need
#    NumPy), with no host block and no copy to the device after it. With the ``nvidia-fs`` driver loaded the bytes
#    go from the drive to the GPU by DMA (GPUDirect Storage); without it cuFile runs in compatibility mode, reading
#    through its own host bounce buffers, which moves the same bytes as the tier's own read and fill.
# 2. ``probe(directory, direct)`` says whether cuFile can read files of ``directory`` here and how: ``"gds"`` (the
#    driver is loaded: ``/proc/driver/nvidia-fs`` exists), ``"compat"`` (cuFile reads without it), or the reason it
#    cannot (no CUDA, no ``cuda.bindings.cufile``, no NumPy, ``cuFileDriverOpen`` failed, or cuFile would not register
#    a file there). The driver is opened once and left open for the process; the registration is tried once per
#    directory and mode, on a file the probe writes and removes. Opening the driver is not enough: on the H100 machine
#    (virtio disk, no nvidia-fs) ``cuFileDriverOpen`` succeeded and every ``cuFileHandleRegister`` failed with
#    HANDLE_NOT_REGISTERED, with and without O_DIRECT, so a probe of the driver alone sent every read to an error.
# 3. ``read(path, out, nbytes, direct)`` on an I/O thread: opens the file (``O_DIRECT`` when the tier writes with
#    it), registers the handle, reads ``nbytes`` into ``out``'s memory, deregisters and closes. ``cuFileRead`` is
#    synchronous (the bytes are in device memory when it returns) and releases the GIL. A short read, or a file
#    shorter than ``nbytes``, raises ``OSError`` (the tier turns it into its ``torchckpt:`` error naming the file):
#    never a restore of bytes that did not arrive. The buffer is not registered with ``cuFileBufRegister`` (slots
#    move and grow; cuFile then reads through its own registered buffers).
"""
from __future__ import annotations

import errno
import os
import tempfile
import threading
from typing import Any

import torch

__all__ = ["probe", "read"]

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_lock = threading.Lock()
_state: dict[Any, Any] = {}  # "probe", "cufile", and (directory, direct) -> its probe


def probe(directory: str | None = None, direct: bool = False) -> tuple[bool, str]:
    """NOTE [ cuFile reads ] Rule 2: ``(True, "gds" | "compat")`` where cuFile can read files of ``directory`` (opened
    with O_DIRECT if ``direct``) here, else ``(False, why)``; ``None``: the driver alone."""
    with _lock:
        if "probe" not in _state:
            _state["probe"] = _probe()
        got: tuple[bool, str] = _state["probe"]
        if not got[0] or directory is None:
            return got
        key = (directory, bool(direct))  # as given: a store asks at every prefetch, so no path walk here
        if key not in _state:
            why = _registers(os.path.realpath(directory), bool(direct))
            _state[key] = got if why is None else (False, why)
        found: tuple[bool, str] = _state[key]
        return found


def _probe() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        import numpy  # noqa: F401  (cuda.bindings.cufile's descriptors are NumPy records)
        from cuda.bindings import cufile
    except ImportError as e:
        return False, f"cuda.bindings.cufile cannot be imported ({e})"
    try:
        cufile.driver_open()
    except Exception as e:  # noqa: BLE001 - any failure to open the driver means no cuFile here
        return False, f"cuFileDriverOpen failed ({e})"
    _state["cufile"] = cufile
    return True, "gds" if os.path.exists("/proc/driver/nvidia-fs") else "compat"


def _registers(directory: str, direct: bool) -> str | None:
    """``None`` where cuFile registers a file of ``directory`` opened as the tier opens its files, else why not."""
    try:
        fd, path = tempfile.mkstemp(prefix="torchckpt-cufile-", dir=directory)
    except OSError as e:
        return f"no file could be written in {directory} to try cuFile on ({e})"
    try:
        try:
            os.write(fd, bytes(4096))
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            fh = _register(fd)
            _state["cufile"].handle_deregister(fh)
        except Exception as e:  # noqa: BLE001 - cuFileError and the like: no cuFile reads for this directory
            return f"cuFileHandleRegister failed on a file of {directory} ({e})"
        finally:
            os.close(fd)  # only the descriptor this function opened, once
        return None
    except OSError as e:
        return f"no file could be written and opened in {directory} to try cuFile on ({e})"
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def _register(fd: int) -> Any:
    """``fd``'s cuFile handle (deregister it with ``cufile.handle_deregister``)."""
    cufile = _state["cufile"]
    descr = cufile.Descr()
    descr.type = cufile.FileHandleType.OPAQUE_FD
    descr.handle.fd = fd
    descr.fs_ops = 0  # no file-system callbacks: cuFile's own for the descriptor's file
    return cufile.handle_register(descr.ptr)


def read(path: str, out: torch.Tensor, nbytes: int, direct: bool) -> None:
    """NOTE [ cuFile reads ] Rule 3: the first ``nbytes`` bytes of the file at ``path`` into CUDA ``out``."""
    cufile = _state["cufile"]
    fd = os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if os.fstat(fd).st_size < nbytes:
            raise OSError(errno.EIO, f"the file holds {os.fstat(fd).st_size} of {nbytes} bytes")
        fh = _register(fd)
        try:
            with torch.cuda.device(out.device):
                got = cufile.read(fh, out.data_ptr(), nbytes, 0, 0)
        finally:
            cufile.handle_deregister(fh)
        if got is not None and got != nbytes:  # bindings that return the count (13.x): a short read is an error
            raise OSError(errno.EIO, f"cuFileRead read {got} of {nbytes} bytes")
    finally:
        os.close(fd)
