"""popxl.addons' transforms, one module each as upstream: ``autodiff``
(``autodiff``, ``autodiff_with_accumulation``), ``recomputation``
(``recompute_graph``) and ``repeat_graph``."""
from ipuxl.addons_compat.transforms.autodiff import autodiff, autodiff_with_accumulation
from ipuxl.addons_compat.transforms.recomputation import recompute_graph

__all__ = ["autodiff", "autodiff_with_accumulation", "recompute_graph"]
