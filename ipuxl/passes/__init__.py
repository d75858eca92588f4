"""Graph passes: each takes IR graphs and returns transformed ones (one pass per file)."""
from ipuxl.passes.autodiff import differentiate
from ipuxl.passes.inplace_order import side_effect_constraints, verify_inplace_order
from ipuxl.passes.op_to_identity import replace_ops_by_identity
from ipuxl.passes.outline import deduplicate, outline_graph, outline_ir
from ipuxl.passes.schedule import apply_schedule, memory_schedule

__all__ = [
    "differentiate", "side_effect_constraints", "verify_inplace_order", "deduplicate", "outline_graph", "outline_ir",
    "apply_schedule", "memory_schedule", "replace_ops_by_identity",
]
