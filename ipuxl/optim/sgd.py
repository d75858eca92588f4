"""Plain SGD as in-place graph ops: ``w -= lr * g`` for each variable."""
from __future__ import annotations

from typing import Mapping

from ipuxl.ir.tensor import Tensor
from ipuxl.ops.elementwise import scaled_add_


def sgd_update_(params: Mapping[str, Tensor], grads: Mapping[str, Tensor], lr: float | Tensor) -> None:
    """Build ``scaled_add_(w, g, b=-lr)`` for every parameter, in ``params`` order.

    Args:
        params: variables (or by-reference graph inputs) keyed by name.
        grads: their gradients, same keys.
        lr: learning rate, a Python number (baked in) or a scalar tensor.
    """
    missing = [k for k in params if k not in grads]
    if missing:
        from ipuxl.errors import InvalidArgumentError

        raise InvalidArgumentError(f"sgd_update_: no gradient for {missing}",
                                   fix="pass a gradient for every parameter (autodiff grads_required)")
    for name, weight in params.items():
        if isinstance(lr, Tensor):
            scaled_add_(weight, grads[name] * lr, b=-1.0)
        else:
            scaled_add_(weight, grads[name], b=-lr)
