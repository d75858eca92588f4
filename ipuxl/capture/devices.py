"""The IPU's device names inside a captured forward.

Under PopTorch's dispatcher a model's forward runs on the IPU's torch device (``"ipu"``,
which PopTorch 3 registers as ``"xla"``): code written for it creates tensors with
``device="ipu"`` / ``device="xla"`` (``torch.zeros(n, device=...)``, ``x.to("ipu")``),
often choosing the name with ``poptorch._impl.isDispatchTracing()``. ipuxl captures a
forward on host tensors, so while it does those names mean the capture's own device:
``on_capture_device`` rewrites them in an op's arguments before the op runs.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["IPU_DEVICE_TYPES", "on_capture_device"]

IPU_DEVICE_TYPES = frozenset({"ipu", "xla"})

_HOST = torch.device("cpu")
# methods whose positional arguments may name a device (``x.to("ipu")``, ``x.to("ipu", torch.half)``)
_POSITIONAL = frozenset({torch.Tensor.to, torch.Tensor.new_tensor})


def _is_ipu(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type in IPU_DEVICE_TYPES
    if isinstance(value, str):
        return value.split(":")[0] in IPU_DEVICE_TYPES
    return False


def on_capture_device(func: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``func`` with an IPU device name replaced by the capture's device."""
    if "device" in kwargs and _is_ipu(kwargs["device"]):
        kwargs = {**kwargs, "device": _HOST}
    if func in _POSITIONAL and any(_is_ipu(a) for a in args[1:]):
        args = tuple(_HOST if i and _is_ipu(a) else a for i, a in enumerate(args))
    return args, kwargs
