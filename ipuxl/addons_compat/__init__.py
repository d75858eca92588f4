"""popxl.addons compatibility: ``import ipuxl.addons_compat as addons``.

Reproduces popxl.addons' Module, DotTree/NamedTensors, variable factories,
GraphWithNamedArgs, BoundGraph, GraphCache, autodiff transforms, cross entropy ops
and common layers on ipuxl's core API.
"""
from ipuxl.addons_compat import layers, ops
from ipuxl.addons_compat.dot_tree import DotTree, to_mapping
from ipuxl.addons_compat.graph import BoundGraph, GraphWithNamedArgs
from ipuxl.addons_compat.graph_cache import GraphCache
from ipuxl.addons_compat.layers import Conv2D, Embedding, LayerNorm, Linear
from ipuxl.addons_compat.module import Module
from ipuxl.addons_compat.named_tensors import NamedTensors, TensorMap
from ipuxl.addons_compat.transforms import autodiff, autodiff_with_accumulation
from ipuxl.addons_compat.variable_factory import NamedVariableFactories, VariableFactory, add_variable_input

__all__ = [
    "layers", "ops", "DotTree", "to_mapping", "BoundGraph", "GraphWithNamedArgs", "GraphCache", "Conv2D",
    "Embedding", "LayerNorm", "Linear", "Module", "NamedTensors", "TensorMap", "autodiff",
    "autodiff_with_accumulation", "NamedVariableFactories", "VariableFactory", "add_variable_input",
]
