"""popxl.addons' optimiser Modules: upstream's ``adam`` (``AdamOptimizerStep``) and ipuxl's
``*Update`` modules applying the ``ipuxl.optim`` rules (``rule_updates``)."""
from ipuxl.addons_compat.optimizers.adam import AdamOptimizerStep
from ipuxl.addons_compat.optimizers.rule_updates import (
    AdamUpdate, AdamWUpdate, LAMBUpdate, RMSpropUpdate, SGDUpdate, apply_optimizer,
)

__all__ = ["AdamOptimizerStep", "SGDUpdate", "AdamUpdate", "AdamWUpdate", "LAMBUpdate", "RMSpropUpdate",
           "apply_optimizer"]
