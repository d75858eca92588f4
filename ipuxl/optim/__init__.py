"""Optimisers as graph-building code whose updates are in-place ``var_updates`` ops.

* ``rules``: the update rules (SGD, Adam/AdamW, LAMB, RMSprop) matching torch.optim:
  the one implementation both front ends build their updates from.
* ``SGDUpdate``, ``AdamUpdate``, ``AdamWUpdate``, ``LAMBUpdate``, ``RMSpropUpdate``,
  ``apply_optimizer``: popxl.addons-style Modules applying a rule to one weight with
  its state (defined in ``ipuxl.addons_compat.optimizers``).
* ``SGD``, ``Adam``, ``AdamW``, ``RMSprop``, ``LAMB``: PopTorch-style optimisers,
  ``torch.optim``-compatible (eager ``step()`` included) plus PopTorch's extras
  (``loss_scaling``, accumulator dtypes...); ``trainingModel`` compiles them into
  the same rules (defined in ``ipuxl.poptorch_compat.optim``).

This package is a facade: the front ends' names load on first use (PEP 562), so
``ipuxl.optim.rules`` (used by both front ends) never loads either of them.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ipuxl.optim import rules

if TYPE_CHECKING:
    from ipuxl.addons_compat.optimizers import (AdamUpdate, AdamWUpdate, LAMBUpdate, RMSpropUpdate, SGDUpdate,
                                                apply_optimizer)
    from ipuxl.poptorch_compat.optim import LAMB, SGD, Adam, AdamW, RMSprop

_ADDONS = ("AdamUpdate", "AdamWUpdate", "LAMBUpdate", "RMSpropUpdate", "SGDUpdate", "apply_optimizer")
_POPTORCH = ("SGD", "Adam", "AdamW", "RMSprop", "LAMB")


def __getattr__(name: str) -> Any:
    if name in _ADDONS:
        module = "ipuxl.addons_compat.optimizers"
    elif name in _POPTORCH:
        module = "ipuxl.poptorch_compat.optim"
    else:
        raise AttributeError(f"module 'ipuxl.optim' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ADDONS) | set(_POPTORCH))


__all__ = ["rules", *_ADDONS, *_POPTORCH]
