"""Device memory for the GPU cache: a CUDA VMM arena mapped in the background, or one cudaMalloc.

A device cache of tens of GiB taken with one ``cudaMalloc`` is usable only when all of it is
backed; the VMM arena (csrc/vmm_cache.cpp, after the lazy device cache of Maurya et al.,
HiPC'22) reserves the whole address range at once and maps physical memory chunk by chunk in a
background thread, so its first slot is usable after one small mapping.

# NOTE [ Device arena ]
# 1. ``DeviceArena`` reserves ``nbytes`` of virtual addresses on one GPU and backs them in
#    address order: the first ``first_bytes`` synchronously in the constructor, the rest in
#    chunks of ``chunk_bytes`` (rounded UP to the driver's allocation granularity, 2 MiB on
#    current GPUs; a chunk size that is not a multiple is rounded, never refused) from a
#    background thread. NOTE [ VMM device arena ] in csrc/vmm_cache.cpp has the native rules.
# 2. ``view(offset, nbytes)`` and ``slot(i, slot_bytes)`` wait until *their* range is mapped,
#    then return a flat CUDA ``uint8`` tensor over it; a write waits only for its own range.
#    ``is_mapped`` asks without waiting (chunks map in address order, so the mapped part is
#    the prefix ``[0, mapped_bytes)``).
# 3. The memory is outside PyTorch's caching allocator: it does not interact with it at all.
#    ``torch.cuda.memory_allocated()`` / ``memory_reserved()`` do not count it and
#    ``torch.cuda.empty_cache()`` does not return it; account for it with ``mapped_bytes``
#    (``torch.cuda.mem_get_info()`` does see it, as it sees every process's memory). The
#    arena checks the device's free memory when it is created; PyTorch's cached blocks are
#    not free to it (``torch.cuda.empty_cache()`` first where that matters).
# 4. Views keep the memory alive: ``close()`` stops the mapping thread and drops the arena's
#    hold; the memory goes back to the driver once the last view is gone too. Release
#    synchronizes the device first (as ``cudaFree`` does), so closing while a kernel still
#    uses the arena is safe; callers on a hot path should still order their streams.
# 5. Slots are ``slot_stride(slot_bytes)`` apart (256-byte aligned), so ``Layout.views`` (store/snapshot_slots.py) of the
#    snapshot store can reinterpret a slot as any dtype.
# 6. Fallback: where VMM is unavailable (no extension, no CUDA, a driver or device without
#    virtual memory management, or ``device="cpu"``) ``make_device_slots`` takes one
#    ``torch.empty`` through PyTorch's caching allocator (one ``cudaMalloc`` for a large
#    cache) with the same interface; ``unavailable_reason`` says why VMM was not used.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, overload

import torch

from torchckpt._errors import CheckpointError
from torchckpt._native import device_arena_class, ops, vmm_error

_log = logging.getLogger("torchckpt")

DEFAULT_CHUNK_BYTES = 256 << 20
SLOT_ALIGN = 256


def slot_stride(slot_bytes: int) -> int:
    """Distance in bytes between consecutive slots of ``slot_bytes`` (NOTE [ Device arena ] Rule 5: 256-byte aligned).

    Example::

        >>> slot_stride(1000)
        1024
    """
    _check_int("slot_bytes", slot_bytes, minimum=1)
    return (slot_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"torchckpt: {name} must be an int, got {type(value).__name__} ({value!r}).")
    if value < minimum:
        raise ValueError(f"torchckpt: {name} must be >= {minimum}, got {value}.")
    return value


def _device(device: str | torch.device | int) -> torch.device:
    if isinstance(device, bool):
        raise TypeError(f"torchckpt: device must be a str, torch.device or int, got {device!r}.")
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return dev


def _native_class() -> Any:
    """The compiled ``torchckpt::DeviceArena`` class (tests replace this function with a stub)."""
    return device_arena_class()


def _native_status(index: int) -> str:
    """The native capability check: "" when device ``index`` supports VMM (tests stub this)."""
    return ops.vmm_status(index)


def _native_loaded() -> str | None:
    """Why the native arena cannot be used at all (``None`` when it is compiled in)."""
    return vmm_error()


def unavailable_reason(device: str | torch.device | int = "cuda") -> str | None:
    """Why a VMM ``DeviceArena`` cannot be made on ``device``, or ``None`` when it can.

    Args:
        device: the CUDA device (``"cuda"`` is the current one).

    Returns:
        ``None``, or a ``torchckpt:`` message saying what is missing and what to do.

    Example::

        >>> unavailable_reason("cpu")
        "torchckpt: the VMM device arena lives on a CUDA device, got 'cpu'. ..."
    """
    dev = _device(device)
    if dev.type != "cuda":
        return (
            f"torchckpt: the VMM device arena lives on a CUDA device, got {str(dev)!r}. Fix: pass device='cuda', "
            "or use make_device_slots(..., use_vmm=False) for host memory."
        )
    why = _native_loaded()
    if why is not None:
        return why
    if not torch.cuda.is_available():
        return (
            "torchckpt: no CUDA device (torch.cuda.is_available() is False), so the VMM device arena is "
            "unavailable. Fix: run on a GPU machine, or use make_device_slots(..., use_vmm=False)."
        )
    status = _native_status(int(dev.index or 0))
    return status or None


def is_available(device: str | torch.device | int = "cuda") -> bool:
    """Whether a VMM ``DeviceArena`` can be made on ``device`` (see ``unavailable_reason``).

    Example::

        >>> is_available("cpu")
        False
    """
    return unavailable_reason(device) is None


def _native_error(e: RuntimeError) -> CheckpointError:
    msg = str(e).strip()
    return CheckpointError(msg if msg.startswith("torchckpt:") else f"torchckpt: DeviceArena: {msg}")


class DeviceArena:
    """A device buffer on CUDA virtual memory, backed chunk by chunk in the background.

    Args:
        nbytes: size in bytes (> 0).
        device: the CUDA device.
        chunk_bytes: bytes mapped per background step, rounded up to the allocation
            granularity (NOTE [ Device arena ] Rule 1).
        background: map in a background thread; ``False`` maps everything before returning.
        first_bytes: bytes at offset 0 mapped before the constructor returns (the first slot).

    Example::

        >>> if is_available("cuda"):
        ...     with DeviceArena(64 << 20, "cuda", chunk_bytes=16 << 20, first_bytes=1 << 20) as a:
        ...         print(int(a.view(0, 16).fill_(3).sum()))
        ... else:
        ...     print(48)
        48
    """

    def __init__(self, nbytes: int, device: str | torch.device | int = "cuda",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, background: bool = True, first_bytes: int = 0,
                 *, _delay_us: int = 0) -> None:
        _check_int("nbytes", nbytes, minimum=1)
        _check_int("chunk_bytes", chunk_bytes, minimum=1)
        _check_int("first_bytes", first_bytes, minimum=0)
        _check_int("_delay_us", _delay_us, minimum=0)
        if first_bytes > nbytes:
            raise ValueError(
                f"torchckpt: DeviceArena expected first_bytes <= nbytes ({nbytes}), got {first_bytes}; "
                "pass the size of the first slot."
            )
        if not isinstance(background, bool):
            raise TypeError(f"torchckpt: background must be a bool, got {background!r}.")
        dev = _device(device)
        why = unavailable_reason(dev)
        if why is not None:
            raise CheckpointError(why)
        try:
            self._impl: Any = _native_class()(nbytes, int(dev.index or 0), chunk_bytes, first_bytes, background,
                                              _delay_us)
        except RuntimeError as e:
            raise _native_error(e) from None
        err = str(self._impl.init_error())  # the native side reports, Python raises (NOTE [ VMM device arena ] Rule 10)
        if err:
            raise _native_error(RuntimeError(err))
        self.device = dev
        self.nbytes = nbytes
        self.chunk_bytes = int(self._impl.chunk_bytes())
        self.granularity = int(self._impl.granularity())
        self.reserved_bytes = int(self._impl.reserved_bytes())
        self.num_chunks = int(self._impl.num_chunks())
        self._closed = False

    kind = "vmm"

    # -- state -----------------------------------------------------------------------------
    @property
    def mapped_bytes(self) -> int:
        """Bytes of device memory backing the arena now (NOTE [ Device arena ] Rule 3: count these, not memory_allocated)."""
        return 0 if self._closed else int(self._impl.mapped_bytes())

    @property
    def mapped_chunks(self) -> int:
        return 0 if self._closed else int(self._impl.mapped_chunks())

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def live_views(self) -> int:
        """Tensors over the arena still alive (they hold its memory after ``close``, NOTE [ Device arena ] Rule 4)."""
        return 0 if self._closed else int(self._impl.live_views())

    @property
    def all_mapped_s(self) -> float | None:
        """Seconds from the start of construction until every chunk was mapped (``None`` until then)."""
        t = -1.0 if self._closed else float(self._impl.all_mapped_s())
        return t if t >= 0 else None

    def ready(self) -> bool:
        """Whether every chunk is mapped (never blocks)."""
        return not self._closed and bool(self._impl.ready())

    def error(self) -> str | None:
        """The background mapping failure, if one happened (NOTE [ VMM device arena ] Rule 5)."""
        e = "" if self._closed else str(self._impl.error())
        return e or None

    def is_mapped(self, offset: int, nbytes: int) -> bool:
        """Whether bytes ``[offset, offset + nbytes)`` are mapped now (never blocks; NOTE [ Device arena ] Rule 2)."""
        self._check_range(offset, nbytes)
        return offset + nbytes <= self.mapped_bytes

    # -- access ----------------------------------------------------------------------------
    def wait(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Block until bytes ``[offset, offset + nbytes)`` are mapped (default: to the end)."""
        if nbytes is None:
            nbytes = self.nbytes - offset
        self._check_range(offset, nbytes)
        self._live("wait")
        err = str(self._impl.wait(offset, nbytes))
        if err:
            raise _native_error(RuntimeError(err))

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A flat ``uint8`` tensor over bytes ``[offset, offset + nbytes)``, once they are mapped."""
        self._check_range(offset, nbytes)
        self._live("view")
        self.wait(offset, nbytes)
        try:
            return self._impl.view(offset, nbytes, False)
        except RuntimeError as e:  # pragma: no cover - guarded by wait() and the range check above
            raise _native_error(e) from None

    def slot(self, i: int, slot_bytes: int) -> torch.Tensor:
        """Slot ``i`` of ``slot_bytes`` at offset ``i * slot_stride(slot_bytes)`` (NOTE [ Device arena ] Rule 5), once mapped."""
        return self.view(*_slot_range(i, slot_bytes, self.nbytes))

    def close(self) -> None:
        """Stop mapping and drop the arena's hold on its memory (NOTE [ Device arena ] Rule 4). Idempotent."""
        if not self._closed:
            self._impl.close()
            self._closed = True

    def __enter__(self) -> DeviceArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"mapped={self.mapped_bytes}/{self.reserved_bytes}"
        return (f"DeviceArena(nbytes={self.nbytes}, device={str(self.device)!r}, chunk_bytes={self.chunk_bytes}, "
                f"{state})")

    def _live(self, what: str) -> None:
        if self._closed:
            raise CheckpointError(f"torchckpt: DeviceArena.{what}() after close(); make a new arena.")

    def _check_range(self, offset: int, nbytes: int) -> None:
        _check_int("offset", offset, minimum=0)
        _check_int("nbytes", nbytes, minimum=0)
        if offset + nbytes > self.nbytes:
            raise ValueError(
                f"torchckpt: expected a byte range inside [0, {self.nbytes}), got offset {offset} and nbytes "
                f"{nbytes}; keep offset + nbytes <= the buffer's size."
            )


def _slot_range(i: int, slot_bytes: int, total: int) -> tuple[int, int]:
    stride = slot_stride(slot_bytes)
    _check_int("slot index", i, minimum=0)
    if i * stride + slot_bytes > total:
        raise IndexError(
            f"torchckpt: slot {i} of {slot_bytes} bytes (stride {stride}) does not fit in {total} bytes; "
            f"expected i < {max((total - slot_bytes) // stride + 1, 0)}."
        )
    return i * stride, slot_bytes


class CachingAllocatorBuffer:
    """The fallback of ``make_device_slots``: one ``torch.empty`` with ``DeviceArena``'s interface.

    The memory comes from PyTorch's caching allocator (one ``cudaMalloc`` for a large buffer), so
    ``torch.cuda.memory_allocated()`` counts it; it is fully usable when created.

    Args:
        nbytes: size in bytes (> 0).
        device: any torch device (``"cpu"`` too).

    Example::

        >>> b = CachingAllocatorBuffer(4096, "cpu")
        >>> b.slot(1, 1000).numel(), b.mapped_bytes
        (1000, 4096)
    """

    kind = "cudaMalloc"

    def __init__(self, nbytes: int, device: str | torch.device | int = "cuda") -> None:
        _check_int("nbytes", nbytes, minimum=1)
        self.device = _device(device)
        self.nbytes = nbytes
        self._buf: torch.Tensor | None = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.device.type != "cuda":
            self.kind = "torch.empty"

    @property
    def mapped_bytes(self) -> int:
        return 0 if self._buf is None else self.nbytes

    @property
    def closed(self) -> bool:
        return self._buf is None

    def ready(self) -> bool:
        return self._buf is not None

    def is_mapped(self, offset: int, nbytes: int) -> bool:
        return self._buf is not None and offset + nbytes <= self.nbytes

    def wait(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Nothing to wait for: the buffer is whole from the start."""

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        _check_int("offset", offset, minimum=0)
        _check_int("nbytes", nbytes, minimum=0)
        if self._buf is None:
            raise CheckpointError("torchckpt: CachingAllocatorBuffer.view() after close(); make a new buffer.")
        if offset + nbytes > self.nbytes:
            raise ValueError(
                f"torchckpt: expected a byte range inside [0, {self.nbytes}), got offset {offset} and nbytes "
                f"{nbytes}; keep offset + nbytes <= the buffer's size."
            )
        return self._buf[offset : offset + nbytes]

    def slot(self, i: int, slot_bytes: int) -> torch.Tensor:
        return self.view(*_slot_range(i, slot_bytes, self.nbytes))

    def close(self) -> None:
        """Drop the buffer (the caching allocator keeps it cached; views keep it alive)."""
        self._buf = None

    def __enter__(self) -> CachingAllocatorBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DeviceMemory(Protocol):
    """What ``make_device_slots`` returns: a ``DeviceArena`` or a ``CachingAllocatorBuffer``."""

    kind: str
    nbytes: int
    device: torch.device

    @property
    def mapped_bytes(self) -> int: ...
    def ready(self) -> bool: ...
    def is_mapped(self, offset: int, nbytes: int) -> bool: ...
    def wait(self, offset: int = 0, nbytes: int | None = None) -> None: ...
    def view(self, offset: int, nbytes: int) -> torch.Tensor: ...
    def slot(self, i: int, slot_bytes: int) -> torch.Tensor: ...
    def close(self) -> None: ...


def make_device_slots(nbytes: int, device: str | torch.device | int = "cuda", *,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES, first_bytes: int = 0,
                      use_vmm: bool | None = None) -> DeviceMemory:
    """Device memory for a cache: a VMM ``DeviceArena`` where possible, else one ``torch.empty``.

    Args:
        nbytes: size in bytes (> 0).
        device: where the cache lives (``"cpu"`` gives the fallback).
        chunk_bytes: the arena's background mapping step (ignored by the fallback).
        first_bytes: bytes mapped before returning (the first slot; ignored by the fallback).
        use_vmm: ``None`` picks VMM when ``is_available(device)``, ``True`` requires it (raises
            ``CheckpointError`` with ``unavailable_reason`` otherwise), ``False`` never uses it.

    Returns:
        A ``DeviceArena`` (``kind == "vmm"``) or a ``CachingAllocatorBuffer`` (NOTE [ Device arena ] Rule 6).

    Example::

        >>> m = make_device_slots(1 << 20, "cpu")
        >>> m.kind, m.slot(0, 4096).shape
        ('torch.empty', torch.Size([4096]))
    """
    _check_int("nbytes", nbytes, minimum=1)
    if use_vmm is not None and not isinstance(use_vmm, bool):
        raise TypeError(f"torchckpt: use_vmm must be None, True or False, got {use_vmm!r}.")
    dev = _device(device)
    if use_vmm is not False:
        why = unavailable_reason(dev)
        if why is None:
            return DeviceArena(nbytes, dev, chunk_bytes=chunk_bytes, first_bytes=first_bytes)
        if use_vmm:
            raise CheckpointError(why)
        if dev.type == "cuda":
            _log.debug("torchckpt: device cache falls back to torch.empty: %s", why)
    return CachingAllocatorBuffer(nbytes, dev)


class ArenaSlots(Sequence[torch.Tensor]):
    """``slots`` flat ``uint8`` slots of a ``DeviceMemory``; indexing waits for that slot only.

    Each slot's tensor is made on first access (after its range is mapped) and kept, so the
    snapshot store can index it as it indexes a list.

    Args:
        memory: the arena or fallback buffer holding the slots.
        slots: how many slots.
        slot_bytes: bytes per slot (slots are ``slot_stride(slot_bytes)`` apart).

    Example::

        >>> s = ArenaSlots(CachingAllocatorBuffer(2048, "cpu"), 2, 1000)
        >>> len(s), s[1].numel(), s.is_ready(1)
        (2, 1000, True)
    """

    def __init__(self, memory: DeviceMemory, slots: int, slot_bytes: int) -> None:
        _check_int("slots", slots, minimum=1)
        stride = slot_stride(slot_bytes)
        if (slots - 1) * stride + slot_bytes > memory.nbytes:
            raise ValueError(
                f"torchckpt: {slots} slots of {slot_bytes} bytes need {(slots - 1) * stride + slot_bytes} bytes, "
                f"the memory has {memory.nbytes}."
            )
        self.memory = memory
        self.slot_bytes = slot_bytes
        self.stride = stride
        self._views: list[torch.Tensor | None] = [None] * slots

    def __len__(self) -> int:
        return len(self._views)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"torchckpt: slot index {i} out of range for {len(self)} slots.")
        v = self._views[i]
        if v is None:
            v = self._views[i] = self.memory.slot(i, self.slot_bytes)
        return v

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))

    def is_ready(self, i: int) -> bool:
        """Whether slot ``i`` is usable without waiting."""
        return self._views[i] is not None or self.memory.is_mapped(i * self.stride, self.slot_bytes)

    def release(self) -> None:
        """Drop the cached slot tensors (so that a closed arena's memory can go back, NOTE [ Device arena ] Rule 4)."""
        self._views = [None] * len(self._views)


def arena_slots(device: str | torch.device | int, slots: int, slot_bytes: int, *,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                use_vmm: bool | None = None) -> tuple[DeviceArena | None, ArenaSlots]:
    """``slots`` device slots of ``slot_bytes`` for ``SnapshotStore``: VMM arena when possible.

    The first slot is mapped before this returns; the others map in the background in address
    order and ``slots[i]`` waits only for slot ``i``.

    Args:
        device: the cache's device (``"cpu"`` gives plain ``torch.empty`` slots).
        slots: number of slots (>= 1).
        slot_bytes: bytes per slot (a snapshot's flat size).
        chunk_bytes: background mapping step of the arena.
        use_vmm: as in ``make_device_slots``.

    Returns:
        ``(arena, slots)``: ``arena`` is the ``DeviceArena`` (close it when done; its
        ``mapped_bytes`` is the device memory to account for) or ``None`` for the fallback;
        ``slots`` indexes like a list of flat ``uint8`` tensors.

    Example::

        >>> arena, slots = arena_slots("cpu", 3, 1000)
        >>> arena is None, len(slots), slots[2].dtype
        (True, 3, torch.uint8)
    """
    _check_int("slots", slots, minimum=1)
    stride = slot_stride(slot_bytes)
    nbytes = (slots - 1) * stride + slot_bytes
    mem = make_device_slots(nbytes, device, chunk_bytes=chunk_bytes, first_bytes=slot_bytes, use_vmm=use_vmm)
    return (mem if isinstance(mem, DeviceArena) else None), ArenaSlots(mem, slots, slot_bytes)
