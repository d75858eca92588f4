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

import contextlib
import inspect
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from ipuxl.errors import AutodiffError, InvalidArgumentError, UnknownKeyError
from ipuxl.ir import context
from ipuxl.ir.grad_info import GradGraphInfo
from ipuxl.ir.graph_builder import graph_input
from ipuxl.ir.tensor import Tensor

if TYPE_CHECKING:
    from ipuxl.addons_compat.graph import GraphWithNamedArgs
    from ipuxl.addons_compat.module import Module

__all__ = ["Aux", "VarGrads", "build_grad_graph", "building_grad"]


#: The modules whose ``build_grad`` is being built (innermost last): ``aux`` reads and
#: ``var_grad`` items are only allowed there, as upstream.
_BUILDING_GRAD: list["Module"] = []


@contextlib.contextmanager
def building_grad(module: "Module") -> Iterator[None]:
    """Mark ``module.build_grad`` as being built."""
    _BUILDING_GRAD.append(module)
    try:
        yield
    finally:
        _BUILDING_GRAD.pop()


def _in_build_grad_of(owner: object, attribute: str) -> bool:
    return bool(_BUILDING_GRAD) and getattr(_BUILDING_GRAD[-1], attribute, None) is owner


_ONLY_IN_BUILD_GRAD = ("You can only {} within the `build_graph` method which must be called via `create_grad_graph` "
                       "or `autodiff`.")


class Aux:
    """``Module.aux``: values ``build`` saves for ``build_grad``, by key.

    Set items in ``build``; read them only in ``build_grad``, where a saved tensor
    reads as an input of the gradient graph (other values as themselves).
    """

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}
        self._grad_inputs: dict[str, Tensor] = {}
        self.grad_to_fwd: dict[Tensor, Tensor] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        self._values[key] = value

    def __getitem__(self, key: str) -> Any:
        if not _in_build_grad_of(self, "aux"):
            raise AutodiffError(_ONLY_IN_BUILD_GRAD.format("get items") + f" (Module.aux['{key}'])",
                                where=context.user_source_line(),
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

    def values(self) -> list[Any]:
        """The saved values, in the order they were set."""
        return list(self._values.values())

    def __repr__(self) -> str:
        return repr(self._values)

    def copy(self) -> "Aux":
        """A copy with the same items, ready for building a gradient graph."""
        new = Aux()
        new._values = dict(self._values)
        return new


class VarGrads:
    """``Module.var_grad``: the gradient graph's outputs for the forward graph's named inputs."""

    def __init__(self, variables: dict[str, Tensor] | None = None) -> None:
        self.grads: dict[str, Tensor] = {}
        self._variables = variables

    def _check_in_build_grad(self, key: str) -> None:
        if self._variables is None or not _in_build_grad_of(self, "var_grad"):
            raise AutodiffError(_ONLY_IN_BUILD_GRAD.format("use` var_grad`") + f" (Module.var_grad['{key}'])",
                                where=context.user_source_line(), fix="set var_grad items in build_grad")

    def __setitem__(self, name: str, tensor: Tensor) -> None:
        self._check_in_build_grad(name)
        assert self._variables is not None
        if not isinstance(tensor, Tensor):
            raise InvalidArgumentError(f"Not a tensor: {tensor!r} (Module.var_grad['{name}'])",
                                       where=context.user_source_line(), fix="set the gradient tensor of the variable")
        if name not in self._variables:
            raise UnknownKeyError(f"Not a variable: {name}. Possible inputs: {list(self._variables)}",
                                  where=context.user_source_line(), fix="use the name of a named input (variable)")
        var = self._variables[name]
        if var.shape != tensor.shape or var.meta_shape != tensor.meta_shape:
            raise AutodiffError(
                "Shape or meta-shape of Tensor does not match variable. "
                f"Tensor shape: {tensor.shape} meta-shape {tensor.meta_shape}. "
                f"Variable shape {var.shape} meta-shape {var.meta_shape}.", where=context.user_source_line())
        self.grads[name] = tensor

    def __getitem__(self, name: str) -> Tensor:
        self._check_in_build_grad(name)
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
            raise AutodiffError(f"A Tensor specified in `{what}` is not a {kind} of `fwd_graph` or not a Tensor: {t!r} "
                                f"(graph '{graph}')", where=context.user_source_line())
    if len(set(tensors)) != len(tensors):
        raise AutodiffError(f"A Tensor has been specified more than once in `{what}`.",
                            where=context.user_source_line())
    return tensors


def build_grad_graph(module: "Module", fwd: "GraphWithNamedArgs", grads_provided: Iterable[Tensor] | None,
                     grads_required: Iterable[Tensor] | None) -> GradGraphInfo:
    """Build ``module.build_grad`` as the gradient graph of ``fwd`` (see the module docstring).

    Steps: 1. check ``grads_provided`` (forward outputs) and ``grads_required`` (forward
    inputs); 2. build ``build_grad`` with one input per provided gradient, aux reads
    adding inputs; 3. check its outputs (one per required non-variable input) and append
    the required variables' ``var_grad``s; 4. give the forward graph every tensor saved
    in aux as an output (as upstream, inputs included); 5. describe the connections.

    Raises:
        AutodiffError: (a ValueError) a check fails; the message says which.
    """
    graph = fwd.graph
    provided = _checked_subset(grads_provided, graph.outputs, "grads_provided", "output", graph.name)
    required = _checked_subset(grads_required, graph.inputs, "grads_required", "input", graph.name)
    names = {t: name for name, t in fwd.args.to_dict().items()}
    variables = {names[t]: t for t in required if t in names}
    others = [t for t in required if t not in names]
    _check_build_grad_signature(module)
    module.var_grad = VarGrads(fwd.args.to_dict())
    module.aux = fwd.aux.copy()
    with building_grad(module):
        grad_graph = graph.ir.create_graph(module.build_grad, *[t.spec for t in provided])
    _check_grad_outputs(module, grad_graph.outputs, others, variables)
    grad_graph.set_outputs([*grad_graph.outputs, *(module.var_grad.grads[name] for name in variables)])
    saved = list(module.aux.grad_to_fwd.values())
    # as upstream, every tensor saved in aux becomes an output of the forward graph (inputs too)
    graph.set_outputs([*graph.outputs, *(t for t in module.aux.values() if isinstance(t, Tensor))])
    return GradGraphInfo.of(grad_graph, graph, provided, saved, [*others, *variables.values()])


def _check_build_grad_signature(module: "Module") -> None:
    for name, param in inspect.signature(module.build_grad).parameters.items():
        if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            raise InvalidArgumentError(
                "The `build_grad` method signature must only have a fixed number of positional parameters as "
                f"inputs. Not a positional parameter: {name}", where=context.user_source_line(),
                fix="take one parameter per gradient of a forward output")


def _check_grad_outputs(module: "Module", outputs: tuple[Tensor, ...], others: list[Tensor],
                        variables: dict[str, Tensor]) -> None:
    where = f"{type(module).__name__}.build_grad"
    missing = sorted(set(variables) - set(module.var_grad.grads))
    if missing:
        raise AutodiffError("Not all variable gradients have been specified in self.var_grad. If you dont want to "
                            "output all gradients specify `grads_required` when calling autodiff. Variables missing "
                            f"gradients: {missing} ({where})", where=context.user_source_line(),
                            fix="set self.var_grad[name] for each, or leave them out of grads_required")
    if len(outputs) > len(others):
        raise AutodiffError(f"Too many outputs in the grad graph. `grads_required` has {len(others)} non-variable "
                            f"outputs ({where} returned {len(outputs)}). If you dont want to output all gradients "
                            "specify `grads_required` when calling autodiff.", where=context.user_source_line(),
                            fix="return one gradient per non-variable forward input, in order (or set grads_required)")
    if len(outputs) < len(others):
        raise AutodiffError("Not all forward graph inputs have been specified as outputs in the grad graph. If you "
                            "dont want to output all gradients specify `grads_required` when calling autodiff. "
                            f"Outputs missing: {[t.name for t in others[len(outputs):]]} ({where})",
                            where=context.user_source_line(),
                            fix="return one gradient per non-variable forward input, in order (or set grads_required)")
    for i, (out, fwd_in) in enumerate(zip(outputs, others)):
        if out.shape != fwd_in.shape or out.meta_shape != fwd_in.meta_shape:
            raise AutodiffError(
                f"Shape or meta-shape of output Tensor at position {i} does not match the `grad_required` at position "
                f"{i}. Output Tensor shape: {out.shape} meta-shape {out.meta_shape}. Grad required shape "
                f"{fwd_in.shape} meta-shape {fwd_in.meta_shape}. ({where})", where=context.user_source_line())
