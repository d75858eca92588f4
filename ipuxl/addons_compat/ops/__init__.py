"""popxl.addons' ops: cross entropy (``cross_entropy``) and host transfers (``streams``).

As upstream, the custom ops live in modules of their own that this package does not
import (upstream compiles each on import): ``replicated_all_reduce_TP``,
``replicated_strided_collectives``, ``cross_entropy_sharded_loss``,
``layer_norm_distributed``, ``rotary_pos_embed``, ``grad_reduce_square_add`` and
``group_quantize_decompress``.
"""
from ipuxl.addons_compat.ops.cross_entropy import cross_entropy, cross_entropy_with_grad
from ipuxl.addons_compat.ops.streams import host_load, host_store

__all__ = ["cross_entropy", "cross_entropy_with_grad", "host_load", "host_store"]
