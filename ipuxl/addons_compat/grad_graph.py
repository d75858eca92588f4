"""Hand-written gradient graphs of popxl.addons Modules: ``Module.build_grad``.

A module that overrides ``build_grad`` saves the forward tensors its gradient needs
in ``self.aux[key]`` while ``build`` runs. ``create_grad_graph`` then builds
``build_grad(*grads of the forward outputs)`` as a graph in which reading
``self.aux[key]`` adds a graph input connected to that forward tensor (the forward
graph gains it as an output: "stitching"), and ``self.var_grad[name] = t`` names the
gradient of the named input (variable) ``name``. The result is a ``GradGraphInfo``
like autodiff's, so ``inputs_dict`` and ``fwd_parent_ins_to_grad_parent_outs`` work.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from ipuxl.errors import AutodiffError
from ipuxl.ir import context
from ipuxl.ir.grad_info import GradGraphInfo
from ipuxl.ir.graph_builder import graph_input
from ipuxl.ir.tensor import Tensor

if TYPE_CHECKING:
    from ipuxl.addons_compat.graph import GraphWithNamedArgs
    from ipuxl.addons_compat.module import Module

__all__ = ["Aux", "VarGrads", "build_grad_graph"]


class Aux:
    """``Module.aux``: values ``build`` saves for ``build_grad``, by key.

    Set items in ``build``; read them only in ``build_grad``, where a saved tensor
    reads as an input of the gradient graph (other values as themselves).
    """

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}
        self._grad_inputs: dict[str, Tensor] | None = None  # None: not building a gradient graph
        self.grad_to_fwd: dict[Tensor, Tensor] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        self._values[key] = value

    def __getitem__(self, key: str) -> Any:
        if self._grad_inputs is None:
            raise AutodiffError(f"Module.aux['{key}'] read outside build_grad", where=context.user_source_line(),
                                fix="read aux items in build_grad (run by autodiff or Module.create_grad_graph); "
                                    "in build, use the tensor itself")
        value = self._values[key]
        if not isinstance(value, Tensor):
            return value
        if key not in self._grad_inputs:
            self._grad_inputs[key] = graph_input(value.shape, value.dtype, key, False, value.meta_shape)
            self.grad_to_fwd[self._grad_inputs[key]] = value
        return self._grad_inputs[key]

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def __repr__(self) -> str:
        return repr(self._values)

    def copy(self) -> "Aux":
        """A copy with the same items, ready for building a gradient graph."""
        new = Aux()
        new._values = dict(self._values)
        return new

    def open_for_grad(self) -> None:
        self._grad_inputs, self.grad_to_fwd = {}, {}


class VarGrads:
    """``Module.var_grad``: the gradient graph's outputs for the forward graph's named inputs."""

    def __init__(self, variables: dict[str, Tensor] | None = None) -> None:
        self.grads: dict[str, Tensor] = {}
        self._variables = variables

    def __setitem__(self, name: str, tensor: Tensor) -> None:
        if self._variables is None:
            raise AutodiffError(f"Module.var_grad['{name}'] set outside build_grad", where=context.user_source_line(),
                                fix="set var_grad items in build_grad")
        if not isinstance(tensor, Tensor):
            raise AutodiffError(f"Module.var_grad['{name}']: not a tensor: {tensor!r}", where=context.user_source_line())
        if name not in self._variables:
            raise AutodiffError(f"Module.var_grad: '{name}' is not a named input of the forward graph",
                                where=context.user_source_line(), fix=f"use one of {sorted(self._variables)}")
        expected = self._variables[name]
        if tensor.shape != expected.shape:
            raise AutodiffError(f"Module.var_grad['{name}']: gradient of shape {tensor.shape}, the variable has "
                                f"shape {expected.shape}", where=context.user_source_line())
        self.grads[name] = tensor

    def __getitem__(self, name: str) -> Tensor:
        return self.grads[name]

    def __contains__(self, name: str) -> bool:
        return name in self.grads


def _checked_subset(given: Iterable[Tensor] | None, allowed: tuple[Tensor, ...], what: str, kind: str,
                    graph: str) -> list[Tensor]:
    if given is None:
        return list(allowed)
    tensors = list(given)
    for t in tensors:
        if not isinstance(t, Tensor) or t not in allowed:
            raise AutodiffError(f"a tensor in `{what}` is not an {kind} of graph '{graph}': {t!r}",
                                where=context.user_source_line())
    if len(set(tensors)) != len(tensors):
        raise AutodiffError(f"a tensor is given twice in `{what}`", where=context.user_source_line())
    return tensors


def build_grad_graph(module: "Module", fwd: "GraphWithNamedArgs", grads_provided: Iterable[Tensor] | None,
                     grads_required: Iterable[Tensor] | None) -> GradGraphInfo:
    """Build ``module.build_grad`` as the gradient graph of ``fwd`` (see the module docstring).

    Steps: 1. check ``grads_provided`` (forward outputs) and ``grads_required`` (forward
    inputs); 2. build ``build_grad`` with one input per provided gradient, aux reads
    adding inputs; 3. check its outputs (one per required non-variable input) and append
    the required variables' ``var_grad``s; 4. give the forward graph the aux tensors
    it does not already expose as outputs; 5. describe the connections.

    Raises:
        AutodiffError: (a ValueError) a check fails; the message says which.
    """
    graph = fwd.graph
    provided = _checked_subset(grads_provided, graph.outputs, "grads_provided", "output", graph.name)
    required = _checked_subset(grads_required, graph.inputs, "grads_required", "input", graph.name)
    names = {t: name for name, t in fwd.args.to_dict().items()}
    variables = {names[t]: t for t in required if t in names}
    others = [t for t in required if t not in names]
    module.var_grad = VarGrads(fwd.args.to_dict())
    module.aux = fwd.aux.copy()
    module.aux.open_for_grad()
    grad_graph = graph.ir.create_graph(module.build_grad, *[t.spec for t in provided])
    _check_grad_outputs(module, grad_graph.outputs, others, variables)
    grad_graph.set_outputs([*grad_graph.outputs, *(module.var_grad[name] for name in variables)])
    saved = list(module.aux.grad_to_fwd.values())
    graph.set_outputs([*graph.outputs, *(t for t in saved if t not in graph.outputs and t not in graph.inputs)])
    return GradGraphInfo.of(grad_graph, graph, provided, saved, [*others, *variables.values()])


def _check_grad_outputs(module: "Module", outputs: tuple[Tensor, ...], others: list[Tensor],
                        variables: dict[str, Tensor]) -> None:
    where = f"{type(module).__name__}.build_grad"
    missing = sorted(set(variables) - set(module.var_grad.grads))
    if missing:
        raise AutodiffError(f"{where}: no var_grad for the variables {missing}", where=context.user_source_line(),
                            fix="set self.var_grad[name] for each, or leave them out of grads_required")
    if len(outputs) != len(others):
        raise AutodiffError(f"{where} returned {len(outputs)} gradients, the forward graph has {len(others)} "
                            "required inputs that are not variables", where=context.user_source_line(),
                            fix="return one gradient per non-variable forward input, in order (or set grads_required)")
    for i, (out, fwd_in) in enumerate(zip(outputs, others)):
        if out.shape != fwd_in.shape:
            raise AutodiffError(f"{where}: gradient {i} has shape {out.shape}, forward input '{fwd_in.name}' has "
                                f"shape {fwd_in.shape}", where=context.user_source_line())
