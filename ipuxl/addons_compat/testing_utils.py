"""popxl.addons' ``testing_utils``: run one Module on host data in a fresh IR and session.

``ops_of_type`` (a count of PopART op types) has no ipuxl counterpart: ipuxl graphs
are torch.fx graphs (read ``graph.fx.nodes``).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import numpy as np

from ipuxl.addons_compat.module import Module
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.addons_compat.ops.streams import host_store
from ipuxl.device import Session
from ipuxl.dtypes import dtype as Dtype
from ipuxl.ir.graph_builder import variable
from ipuxl.ir.ir import Ir
from ipuxl.ir.tensor import Tensor, Variable

__all__ = ["TensorInput", "run_module"]

WeightsArg = Callable[[NamedTensors], Mapping[Variable, np.ndarray]] | Mapping[Variable, np.ndarray] | None


class TensorInput:
    """Host data that ``run_module`` turns into a variable input of the module's graph.

    Args:
        data: the values.
        dtype: the tensor's dtype; default: inferred from ``data``.
    """

    def __init__(self, data: np.ndarray, dtype: Any = None) -> None:
        self.data = data
        self.dtype = dtype


def _tensor_arg(arg: Any) -> Any:
    if not isinstance(arg, TensorInput):
        return arg
    dtype = arg.dtype if arg.dtype is not None else Dtype.as_dtype(arg.data)
    return variable(arg.data, dtype=dtype)


def run_module(module: Module, *args: Any, weights: WeightsArg = None, **kwargs: Any) -> list[np.ndarray]:
    """Build ``module``'s graph from ``args``/``kwargs`` in a new IR, call it, return its outputs.

    ``TensorInput`` arguments become variables; ``weights`` (a mapping, or a function
    of the module's variables returning one) is written before the run.

    Returns:
        The graph's outputs as numpy arrays, in order.
    """
    ir = Ir()
    with ir.main_graph:
        new_args = [_tensor_arg(a) for a in args]
        new_kwargs = {k: _tensor_arg(v) for k, v in kwargs.items()}
        factories, graph = module.create_graph(*new_args, **new_kwargs)
        variables = factories.init()
        bound = inspect.signature(module.build).bind(*new_args, **new_kwargs)  # the graph's inputs' order
        tensors = [a for a in bound.arguments.values() if isinstance(a, Tensor)]
        outputs = graph.bind(variables).call(*tensors)
        streams = [host_store(t) for t in outputs]
    with Session(ir, "ipu_hw") as session:
        if weights is not None:
            session.write_variables_data(weights(variables) if callable(weights) else weights)
        results = session.run()
    return [results[s] for s in streams]
