"""popxl.addons' ``LayerNorm``: layer normalisation over the last axis."""
from __future__ import annotations

from functools import partial

import numpy as np

from ipuxl import ops
from ipuxl.addons_compat.module import Module
from ipuxl.ir.tensor import Tensor

__all__ = ["LayerNorm"]


class LayerNorm(Module):
    """Layer normalisation over the last axis with learnt ``weight`` (ones) and ``bias`` (zeros).

    Args:
        eps: added to the variance (``build``'s ``eps`` overrides it, as upstream's signature).
        cache: reuse graphs where possible.
    """

    def __init__(self, eps: float = 1e-5, cache: bool = False):
        super().__init__(cache=cache)
        self.eps = eps

    def build(self, x: Tensor, eps: float | None = None) -> Tensor:
        features = x.shape[-1]
        w = self.add_variable_input("weight", partial(np.ones, (features,)), x.dtype)
        b = self.add_variable_input("bias", partial(np.zeros, (features,)), x.dtype)
        return ops.layer_norm(x, w, b, epsilon=self.eps if eps is None else eps)
