"""popxl.addons' ``layer_norm_distributed``: layer norm of a tensor sharded over its hidden axis."""
from __future__ import annotations

from ipuxl.errors import ShapeMismatchError
from ipuxl.ir import context
from ipuxl.ir.build import emit
from ipuxl.ir.graph import describe
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import tp_collectives
from ipuxl.ops.collectives import check_group

__all__ = ["layer_norm_distributed"]


def layer_norm_distributed(t: Tensor, w: Tensor, b: Tensor, epsilon: float = 1e-5,
                           group: ReplicaGrouping | None = None) -> Tensor:
    """Layer normalisation of ``t`` (N, H / group_size) whose hidden axis is sharded over the
    members of ``group``: normalised with the mean and variance of the whole hidden axis,
    then scaled by ``w`` and shifted by ``b`` (this shard's, (H / group_size,)).

    Differentiable: the statistics' gradients are all-reduced over the group, as upstream's
    grad op computes the distributed statistics' gradients.

    Raises:
        ShapeMismatchError: ``t`` is not 2-D, or ``w``/``b`` are not 1-D of ``t``'s last size.
    """
    g = check_group("layer_norm_distributed", t, None, group)
    if t.rank != 2 or w.shape != (t.shape[-1],) or b.shape != (t.shape[-1],):
        raise ShapeMismatchError(
            f"layer_norm_distributed: needs t (N, H) and w, b (H,); got {describe(t)}, {describe(w)}, {describe(b)}",
            where=context.user_source_line(), fix="flatten t to 2-D and give this shard's scale and shift")
    return emit("layer_norm_distributed", tp_collectives.layer_norm_distributed,
                (t, w, b, float(epsilon), g.stride, g.group_size), meta_fn=lambda x, *_: x.new_empty(x.shape))
