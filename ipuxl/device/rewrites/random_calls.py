"""Call the seeded random ops' Python implementations directly.

Rewrites: every call of a ``torch.ops.ipuxl.*`` random custom op (as an overload packet or
its ``.default``) becomes a call of its Python implementation
(``ipuxl.kernels.random.DIRECT_CALLS``), skipping the custom-op dispatch, which costs more
than the draw itself for small tensors.

Preconditions: none beyond a lowered fx graph (the custom ops stay in the IR, where
tracing and autodiff need them; only the compiled code calls the implementations).

Numerics: unchanged (the custom ops run the same implementations).
"""
from __future__ import annotations

import torch.fx as fx

from ipuxl.device.rewrites._nodes import retarget
from ipuxl.kernels.random import DIRECT_CALLS
from ipuxl.passes.result import PassResult

__all__ = ["call_random_ops_directly"]


def call_random_ops_directly(graph: fx.Graph) -> PassResult:
    """Call the seeded random ops' Python implementations without the custom-op dispatch."""
    return PassResult(graph, retarget(graph, DIRECT_CALLS))
