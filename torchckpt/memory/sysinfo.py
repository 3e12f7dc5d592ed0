"""What the machine offers the memory layer: page size, physical and available memory, huge pages.

Read from ``os.sysconf`` and ``/proc``; every function answers something sensible (0 or ``None``)
where the information cannot be read (not Linux).
"""
from __future__ import annotations

import os

import torch

__all__ = ["available_memory_bytes", "device_index", "huge_page_bytes", "page_bytes", "physical_memory_bytes"]


def page_bytes() -> int:
    """The host page size in bytes (chunk sizes must be multiples of it)."""
    return int(os.sysconf("SC_PAGE_SIZE"))


def physical_memory_bytes() -> int:
    """Total physical RAM of this machine in bytes (0 when unknown)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def available_memory_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo in bytes (physical RAM when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_memory_bytes()


def huge_page_bytes(base: int, nbytes: int, smaps: str = "/proc/self/smaps") -> int | None:
    """Bytes of the mapping ``[base, base + nbytes)`` that the kernel backs with transparent huge pages.

    ``MADV_HUGEPAGE`` is only advice: the kernel may back the pool with 4 KiB pages, and then
    registering it costs several times more (NOTE [ Lazy host pool ] Rule 8). Sums ``AnonHugePages`` of the mappings in
    ``/proc/self/smaps`` that lie in the range; ``None`` where that file cannot be read (not Linux).

    Example::

        >>> huge_page_bytes(0, 4096) in (0, None)
        True
    """
    end = base + nbytes
    total = 0
    inside = False
    try:
        with open(smaps) as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo >= base and hi <= end
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return total


def device_index(device: int | torch.device | None) -> int:
    """The CUDA device index ``device`` names (the current device for ``None`` or a bare "cuda")."""
    if device is None:
        return int(torch.cuda.current_device()) if torch.cuda.is_available() else 0
    if isinstance(device, int):
        return device
    if device.index is None:
        return int(torch.cuda.current_device()) if torch.cuda.is_available() else 0
    return int(device.index)
