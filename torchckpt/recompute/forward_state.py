"""What running a block again needs of the state its forward ran in: RNG states, autocast, device context.

The one home of that capture and replay for the two recomputations of this package that run a block themselves,
``Recompute(parts=...)`` (parts.py, NOTE [ Recompute in parts ] Rules 2-3) and ``checkpoint_chain``'s advances
(chain.py, NOTE [ Chain of blocks ] Rules 2-3), as ``torch.utils.checkpoint`` captures them for its own.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import DefaultDeviceType, get_device_states, set_device_states

__all__ = ["ForwardState"]


def _device_type(tensors: Sequence[torch.Tensor]) -> str:
    kinds = [t.device.type for t in tensors if t.device.type != "cpu"]
    if not kinds:
        return DefaultDeviceType.get_device_type()
    return "cuda" if "cuda" in kinds else kinds[0]


def _autocast_state(device_type: str) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    def of(dt: str) -> dict[str, Any]:
        return dict(enabled=torch.is_autocast_enabled(dt), dtype=torch.get_autocast_dtype(dt),
                    cache_enabled=torch.is_autocast_cache_enabled())
    return (of(device_type) if torch.amp.is_autocast_available(device_type) else None), of("cpu")


def _device_context() -> Any:
    """The innermost ``with torch.device(...)`` around the forward, or a null context."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode
    return contextlib.nullcontext()


class ForwardState:
    """The state a block's forward ran in, captured at its call from its tensor arguments.

    Args:
        tensors: the block's tensor arguments (their devices say whose RNG states to capture).
        preserve: capture the CPU RNG state and, if its device is initialised, the device's (``preserve_rng_state``).
    """

    __slots__ = ("autocast", "cpu_state", "device_ctx", "device_states", "device_type", "devices", "had_device",
                 "preserve")

    def __init__(self, tensors: Sequence[torch.Tensor], preserve: bool) -> None:
        self.preserve = preserve
        self.device_type = _device_type(tensors)
        self.autocast = _autocast_state(self.device_type)
        self.device_ctx = _device_context()
        self.cpu_state: torch.Tensor | None = None
        self.devices: list[int] = []
        self.device_states: list[torch.Tensor] = []
        self.had_device = False
        if preserve:
            self.cpu_state = torch.get_rng_state()
            if getattr(getattr(torch, self.device_type, None), "_initialized", False):
                self.had_device = True
                self.devices, self.device_states = get_device_states(*tensors)

    @contextlib.contextmanager
    def replayed(self, rng: bool = True) -> Iterator[None]:
        """Run the body under the captured RNG states (restoring the current ones after; not with ``rng=False``),
        autocast and device context."""
        with torch.random.fork_rng(devices=self.devices if self.had_device else [], enabled=self.preserve and rng,
                                   device_type=self.device_type):
            if self.preserve and rng:
                assert self.cpu_state is not None
                torch.set_rng_state(self.cpu_state)
                if self.had_device:
                    set_device_states(self.devices, self.device_states, device_type=self.device_type)
            dev, cpu = self.autocast
            dev_ctx: Any = torch.amp.autocast(device_type=self.device_type, **dev) if dev is not None \
                else contextlib.nullcontext()
            with dev_ctx, torch.amp.autocast("cpu", **cpu), self.device_ctx:
                yield
