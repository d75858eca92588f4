"""``torch.nn.attention.flex_attention`` in a captured module: its dense math, which trains.

Called eagerly, ``flex_attention`` hands its higher-order op to ``torch.compile`` (Dynamo),
which a capture cannot run under its modes. While a module is captured
(``flex_attention_as_math``), the op is instead computed by torch's own dense
implementation (``math_attention``, what eager runs on the CPU): the scores, ``score_mod``
and ``mask_mod`` applied through ``vmap`` over (batch, head, query, key) indices, a softmax
that leaves fully masked rows at zero, the product with the values. Its ops are traced like
any others, so the program trains through them, with gradients for tensors the modifiers
capture (a learnt bias). Eager torch has no backward for flex attention on the CPU; a
program's device is the IPU's stand-in, so a capture does not refuse one there.

The block structure of a ``BlockMask`` is a speed-up for fused kernels: the dense math reads
only its ``mask_mod``, as torch's dense implementation does. The LSE and max-score outputs
(``return_aux``) are torch's too.

The patch is of ``torch.nn.attention.flex_attention``'s module globals (when a program has
imported it) while a capture runs in any thread; a call from another thread meanwhile runs
torch's op without ``torch.compile``.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable

import torch

from ipuxl.capture.patches import CapturePatch

__all__ = ["flex_attention_as_math"]


def _math_hop(original: Callable[..., Any]) -> Callable[..., Any]:
    def flex_attention_hop(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable,
                           block_mask: tuple, scale: float, kernel_options: dict[str, Any],
                           *buffers: Any) -> Any:
        if not _PATCH.active():
            return original(query, key, value, score_mod, block_mask, scale, kernel_options, *buffers)
        from torch._higher_order_ops.flex_attention import math_attention
        return math_attention(query, key, value, score_mod, block_mask, scale, kernel_options, *buffers)

    return flex_attention_hop


def _device_check(original: Callable[..., None]) -> Callable[..., None]:
    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if _PATCH.active() and query.device.type == "cpu":
            return  # the dense math has a gradient: a captured program may train through it
        original(query, key, value)

    return validate_device


def _patch() -> None:
    module = _flex_module()
    if module is None:  # not imported (no program calls flex attention) or not this torch's form
        return
    _SAVED.update(module=module, hop=module.flex_attention_hop, check=module._validate_device,
                  debug=module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG)
    module.flex_attention_hop = _math_hop(_SAVED["hop"])
    module._validate_device = _device_check(_SAVED["check"])
    module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True  # call the op itself, not through Dynamo


def _unpatch() -> None:
    module = _SAVED.pop("module", None)
    if module is not None:
        module.flex_attention_hop = _SAVED["hop"]
        module._validate_device = _SAVED["check"]
        module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = _SAVED["debug"]


_SAVED: dict[str, Any] = {}
_PATCH = CapturePatch(_patch, _unpatch)


def flex_attention_as_math() -> contextlib.AbstractContextManager[None]:
    """While inside, this thread's calls of ``flex_attention`` run its dense math (see above)."""
    return _PATCH()


def _flex_module() -> Any:
    """``torch.nn.attention.flex_attention`` if a program has imported it (a model that calls it
    has) and it has what is patched; else None."""
    module = sys.modules.get("torch.nn.attention.flex_attention")
    names = ("flex_attention_hop", "_validate_device", "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG")
    return module if module is not None and all(hasattr(module, n) for n in names) else None
