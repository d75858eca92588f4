"""Choose faster kernels with the same results.

Rewrites: calls of ``aten.max_pool2d_with_indices`` and ``aten.convolution_backward`` become
calls of ``ipuxl.kernels.pool.max_pool2d_with_indices`` and
``ipuxl.kernels.conv.convolution_backward``, which pick per call (from the tensors' device,
dtype, layout and sizes) between aten's kernel and a faster computation of the same
results: the channels-last max-pool kernel on a channels-last copy, or a convolution's
gradients as GEMMs or as a depthwise convolution.

Preconditions: none beyond a lowered fx graph. The new targets are pure, as the aten ops
they replace (``dead_code`` counts them so).

Numerics: max pooling is bit for bit aten's (values, indices, NaNs and ties included).
Convolution gradients computed another way take the same products summed in another order
(float32 rounding, ~1e-7 relative); every other convolution is aten's, bit for bit. See
the kernels' docstrings.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from ipuxl.device.rewrites._nodes import retarget
from ipuxl.kernels.conv import convolution_backward
from ipuxl.kernels.pool import max_pool2d_with_indices
from ipuxl.passes.result import PassResult

__all__ = ["select_kernels"]

_KERNELS: dict[Any, Callable[..., Any]] = {torch.ops.aten.max_pool2d_with_indices.default: max_pool2d_with_indices,
                                           torch.ops.aten.convolution_backward.default: convolution_backward}


def select_kernels(graph: fx.Graph) -> PassResult:
    """Replace ops by implementations with the same results that run faster."""
    return PassResult(graph, retarget(graph, _KERNELS))
