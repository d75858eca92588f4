"""Graph passes: each takes IR graphs and returns transformed ones (one pass per file).

Transforms of a graph give a ``PassResult`` (the graph, and whether it changed):
``outline``, ``merge_identical_graphs``, ``reorder_for_memory``. The functions they
wrap stay, for callers that want what was made (``outline_graph``...) or that check
(``verify_inplace_order``) rather than transform.
"""
from ipuxl.passes.autodiff import differentiate
from ipuxl.passes.inplace_order import side_effect_constraints, verify_inplace_order
from ipuxl.passes.op_to_identity import replace_ops_by_identity
from ipuxl.passes.outline import deduplicate, merge_identical_graphs, outline, outline_graph, outline_ir
from ipuxl.passes.result import PassResult
from ipuxl.passes.schedule import apply_schedule, memory_schedule, reorder_for_memory

__all__ = [
    "PassResult", "differentiate", "side_effect_constraints", "verify_inplace_order", "outline",
    "merge_identical_graphs", "deduplicate", "outline_graph", "outline_ir", "reorder_for_memory", "apply_schedule",
    "memory_schedule", "replace_ops_by_identity",
]
