"""popxl.addons' layers as Modules, one module each as upstream: ``Linear``, ``LayerNorm``,
``GroupNorm``, ``Embedding``, ``Conv2D``, and the tensor-parallel ones:
``LayerNormDistributed`` (a layer norm of a tensor sharded over its hidden axis) and
``LinearGQ`` (a linear layer with 4-bit group-quantised weights).

A ``replica_grouping`` with G > 1 groups shards a layer's variables: each holds one
value per group (``(G, *shape)`` on the host), so a tensor-parallel layer built with
``ir.replica_grouping(stride=tp, group_size=dp)`` gives replica ``r`` shard ``r % tp``.

Initialisation follows popxl.addons: weights from a normal distribution truncated at two
standard deviations (0.02), biases zero, norm scales one.
"""
from ipuxl.addons_compat.layers.conv import Conv2D
from ipuxl.addons_compat.layers.embedding import Embedding
from ipuxl.addons_compat.layers.group_norm import GroupNorm
from ipuxl.addons_compat.layers.layer_norm import LayerNorm
from ipuxl.addons_compat.layers.layer_norm_distributed import LayerNormDistributed
from ipuxl.addons_compat.layers.linear import Linear
from ipuxl.addons_compat.layers.linear_gq import LinearGQ

__all__ = ["Linear", "LayerNorm", "GroupNorm", "Embedding", "Conv2D", "LayerNormDistributed", "LinearGQ"]
