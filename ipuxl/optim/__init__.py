"""Optimisers as graph-building code whose updates are in-place ``var_updates`` ops.

* ``rules``: the update rules (SGD, Adam/AdamW, LAMB, RMSprop) matching torch.optim.
* ``SGDUpdate``, ``AdamUpdate``, ``AdamWUpdate``, ``LAMBUpdate``, ``RMSpropUpdate``:
  popxl.addons-style Modules applying a rule to one weight with its state.
* ``apply_optimizer``: one optimiser over every variable of a NamedTensors.
* ``SGD``, ``Adam``, ``AdamW``, ``RMSprop``, ``LAMB``: PopTorch-style optimisers,
  ``torch.optim``-compatible (eager ``step()`` included) plus PopTorch's extras
  (``loss_scaling``, accumulator dtypes...); ``trainingModel`` compiles them into
  the same rules (``translate``).
"""
from ipuxl.optim import rules
from ipuxl.addons_compat.optimizers import AdamUpdate, AdamWUpdate, LAMBUpdate, RMSpropUpdate, SGDUpdate, apply_optimizer
from ipuxl.poptorch_compat.optim import LAMB, SGD, Adam, AdamW, RMSprop

__all__ = ["rules", "AdamUpdate", "AdamWUpdate", "LAMBUpdate", "RMSpropUpdate", "SGDUpdate", "apply_optimizer",
           "SGD", "Adam", "AdamW", "RMSprop", "LAMB"]
