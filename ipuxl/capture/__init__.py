"""Front ends into the IR. PopXL style: ``graph_builder`` and ``builder`` (one op = one fx node)."""
from ipuxl.capture.graph_builder import Module, constant, graph_input, variable

__all__ = ["Module", "constant", "graph_input", "variable"]
