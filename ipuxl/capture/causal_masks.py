"""nn.Transformer's causal-mask check on masks whose values a capture does not know.

``nn.Transformer``, ``nn.TransformerEncoder`` and ``nn.TransformerDecoder`` compare an
attention mask given to them with a causal mask (``_detect_is_causal_mask``) to choose
a faster path: with ``is_causal=True`` attention may apply its own causal mask instead of
the one given. torch documents the answer as a hint: False for a causal mask only costs
speed, the given mask being applied as it is. A mask computed from constants is compared
as eagerly (``capture.known_values`` knows its values); for a mask whose values the
capture cannot know (an input of the model) the check answers False, so the program
applies the mask it is given: the same results as eager for any mask.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch.nn.modules.transformer as transformer

from ipuxl.capture.failures import DATA_DEPENDENT
from ipuxl.capture.patches import CapturePatch

__all__ = ["causal_mask_hints"]

_ORIGINAL: Callable[..., bool] = transformer._detect_is_causal_mask


def _detect_is_causal_mask(mask: Any, is_causal: bool | None = None, size: int | None = None) -> bool:
    if not _PATCH.active():
        return _ORIGINAL(mask, is_causal, size)
    try:
        return _ORIGINAL(mask, is_causal, size)
    except Exception as exc:  # the comparison read values the capture does not know
        if not any(k in f"{type(exc).__name__} {exc}" for k in DATA_DEPENDENT):
            raise
        return False


_PATCH = CapturePatch.replacing(transformer, "_detect_is_causal_mask", _detect_is_causal_mask)


def causal_mask_hints() -> contextlib.AbstractContextManager[None]:
    """While inside, a transformer's causal-mask check in this thread answers False for a mask
    of unknown values (see the module docstring)."""
    return _PATCH()
