"""Where a load's tensors go: the :data:`Device` a caller names, checked once per load.

torch is imported by the check, not with this module: ``weightstream inspect`` reads headers
without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from weightstream.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["Device", "device_of", "device_or_cpu"]

Device: TypeAlias = "str | torch.device"
"""Where tensors go: ``"cpu"``, ``"cuda:0"``, a :class:`torch.device`."""


def device_of(device: Device) -> torch.device:
    """``device`` as a torch device this machine has and that can hold a load's tensors, or a
    :class:`ConfigError` (checked before any read: a device torch would refuse at the first
    tensor is refused here, and ``meta``, which would return tensors without their data)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"invalid device {device!r}: {exc}", setting="device") from None
    if dev.type == "meta":
        raise ConfigError(
            "device 'meta' holds no data: a load would return tensors without their bytes (use "
            "open_checkpoint() for names, dtypes and shapes)",
            setting="device",
        )
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {device!r} asked for, but this machine or torch build has no CUDA device",
                setting="device",
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"device {device!r}: this machine has {count} CUDA device(s)", setting="device")
        return dev
    try:  # mps, xpu, privateuseone, ...: torch knows the name; is the device here?
        torch.empty(0, device=dev)
    except Exception as exc:
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            f"device {device!r} is not available here: {line[:200]}", setting="device"
        ) from None
    return dev


def device_or_cpu(device: Device) -> torch.device:
    """``device`` checked, or the CPU where it is not valid (for the exchange that reports the
    failure to the other ranks: the load itself raises the device's error)."""
    try:
        return device_of(device)
    except ConfigError:
        import torch

        return torch.device("cpu")
