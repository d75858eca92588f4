"""popxl.addons' ``Module``: a graph-building layer with state declared as named inputs.

``build`` runs inside the graph being created. State is declared with
``add_variable_input`` (a graph input plus a ``VariableFactory``); submodules
assigned as attributes share their trees with the parent under the attribute name,
so calling ``self.fc1(x)`` inside ``build`` inlines fc1's ops and its inputs appear
as ``fc1.weight``. ``create_graph`` returns ``(factories, GraphWithNamedArgs)`` and
resets the module, which keeps no state between graphs (as upstream). A module may
write its own gradient in ``build_grad`` (see ``grad_graph``): ``autodiff`` then uses it.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Iterator, Literal


from ipuxl.dtypes import DTypeLike
from ipuxl.addons_compat.dot_tree import clear_leaves
from ipuxl.addons_compat.grad_graph import Aux, VarGrads, build_grad_graph
from ipuxl.addons_compat.graph import CalledGraphsGradInfo, GraphWithNamedArgs
from ipuxl.addons_compat.graph_cache import GraphCache
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.addons_compat.variable_factory import (
    NamedVariableFactories, VariableFactory, add_replica_sharded_variable_input, add_variable_input,
)
from ipuxl.errors import AutodiffError, InvalidArgumentError, NameConflictError
from ipuxl.ir import context, graph_builder
from ipuxl.ir.tensor import Tensor

__all__ = ["Module"]


class Module(graph_builder.Module):
    """Base class of popxl.addons-style layers and models.

    Args:
        cache: reuse one graph for ``create_graph`` calls with equal argument specs.
        grad_inlining_error: what calling a module that implements ``build_grad``
            directly inside another module's ``build`` (inlining it, so its
            ``build_grad`` is never used) does: "error" (default), "warning" or "none".

    Raises:
        AutodiffError: (a ValueError) an unknown ``grad_inlining_error``, or ``cache``
            with ``build_grad`` (as upstream).

    Example:
        >>> class Scale(Module):
        ...     def build(self, x):
        ...         w = self.add_variable_input("w", lambda: np.ones(x.shape, np.float32))
        ...         return x * w
    """

    _sub_modules: list["Module"]

    def __init__(self, cache: bool = False, grad_inlining_error: Literal["error", "warning", "none"] = "error"):
        self._variable_factories = NamedVariableFactories()
        self._named_inputs = NamedTensors()
        self._graph_cache = GraphCache() if cache else None
        self._args_cache: dict[Any, tuple[NamedVariableFactories, NamedTensors]] = {}
        self.aux = Aux()
        self.var_grad = VarGrads()
        self.grad_inlining_error = grad_inlining_error
        self.called_graphs_grad_info = CalledGraphsGradInfo()
        if cache and self.implements_grad_graph:
            raise AutodiffError(f"You cannot use graph caching if you have implemented `build_grad`. "
                                f"({type(self).__name__})", where=context.user_source_line(),
                                fix="create the module with cache=False")
        if grad_inlining_error not in ("error", "warning", "none"):
            raise AutodiffError(f"grad_inlining_error should be one of 'error', 'warning', 'none'. "
                                f"Not: {grad_inlining_error!r}", where=context.user_source_line())

    # -- hand-written gradients ---------------------------------------------------------
    @property
    def implements_grad_graph(self) -> bool:
        """Whether this module's class overrides ``build_grad``."""
        return type(self).build_grad is not Module.build_grad

    def build_grad(self, *grads: Tensor) -> Any:
        """Override to write the gradient graph: one input per forward output's gradient,
        one output per non-variable forward input's gradient (in order); variables'
        gradients go in ``self.var_grad[name]``, saved forward tensors come from ``self.aux``."""
        raise NotImplementedError(f"{type(self).__name__} must implement `build_grad` to create a gradient graph")

    def create_grad_graph(self, fwd_graph: GraphWithNamedArgs, grads_provided: Iterable[Tensor] | None = None,
                          grads_required: Iterable[Tensor] | None = None) -> GraphWithNamedArgs:
        """The gradient graph ``build_grad`` writes for ``fwd_graph`` (which gains the aux
        tensors as outputs, so call it once per forward graph).

        Raises:
            AutodiffError: the module does not implement ``build_grad``, or the graph it
                builds does not fit ``fwd_graph`` (see ``grad_graph.build_grad_graph``).
        """
        if not self.implements_grad_graph:
            raise AutodiffError("The default implementation of `build_graph` needs to be overridden to use "
                                f"`create_grad_graph` ({type(self).__name__} does not implement build_grad)",
                                where=context.user_source_line(), fix="override build_grad, or use autodiff")
        info = build_grad_graph(self, fwd_graph, grads_provided, grads_required)
        self._reset()
        return GraphWithNamedArgs.from_grad_graph(info)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.implements_grad_graph and self.grad_inlining_error != "none":
            message = (f"You are calling this module ({type(self).__name__}) directly but `build_grad` has been "
                       "implemented. If you call this module directly `build_grad` will not be called when using "
                       "autodiff. You need to create a graph of this module first and call that graph e.g. use "
                       "`self.call_module`. To disable this guardrail set `grad_inlining_error` to `none`")
            if self.grad_inlining_error == "error":
                raise AutodiffError(message, where=context.user_source_line())
            warnings.warn(message, stacklevel=2)
        return super().__call__(*args, **kwargs)

    @property
    def variable_factories(self) -> NamedVariableFactories:
        """The factories of the named inputs added since the last graph (submodules' as subtrees)."""
        return self._variable_factories

    @property
    def named_inputs(self) -> NamedTensors:
        """The named inputs added since the last graph, by name (submodules' as subtrees)."""
        return self._named_inputs

    # -- submodules ------------------------------------------------------------------
    def __setattr__(self, key: str, value: Any) -> None:
        if isinstance(value, Module) and "_named_inputs" in self.__dict__:
            # The submodule's trees become subtrees of ours (shared objects), so
            # inputs it adds while building appear here as "key.name".
            self._variable_factories.insert(key, value.variable_factories, overwrite=True)
            self._named_inputs.insert(key, value.named_inputs, overwrite=True)
            self.called_graphs_grad_info.add_submap(value.called_graphs_grad_info)
        super().__setattr__(key, value)

    @classmethod
    def from_list(cls, sub_modules: list["Module"]) -> "Module":
        """A module whose submodules are named ``0, 1, ...``."""
        self = cls()
        for i, module in enumerate(sub_modules):
            setattr(self, str(i), module)
        self._sub_modules = list(sub_modules)
        return self

    def get(self, key: str | int) -> Any:
        return getattr(self, str(key))

    def __getitem__(self, key: str | int) -> Any:
        return self.get(key)

    def __iter__(self) -> Iterator["Module"]:
        if "_sub_modules" not in self.__dict__:
            raise TypeError(f"{type(self).__name__} is not iterable: only modules made with Module.from_list are")
        return iter(self._sub_modules)

    # -- named inputs ---------------------------------------------------------------------
    def add_variable_input(self, name: str, data_iter: Callable[[], Any] | Iterable[Any],
                           dtype: DTypeLike = None, by_ref: bool = False,
                           replica_grouping: Any = None, overwrite: bool = False) -> Tensor:
        """Add a named graph input with a factory for its variables; returns the input tensor.

        Raises:
            NameConflictError: ``name`` is already a named input of this module.
        """
        self._check_free(name, overwrite)
        tensor, factory = add_variable_input(name, data_iter, dtype, by_ref, replica_grouping)
        self._variable_factories.insert(name, factory, overwrite=overwrite)
        self._named_inputs.insert(name, tensor, overwrite=overwrite)
        return tensor

    def add_replica_sharded_variable_input(self, name: str, data_iter: Callable[[], Any] | Iterable[Any],
                                           dtype: DTypeLike = None, by_ref: bool = False,
                                           replica_grouping: Any = None, shard_over: int | None = None,
                                           overwrite: bool = False) -> Tensor:
        """Add a replica-sharded named input (the 1-D shard, the data's shape as meta
        shape); its factory's variables are whole on the host (see ``init_remote``).

        Raises:
            NameConflictError: ``name`` is already a named input of this module.
        """
        self._check_free(name, overwrite)
        tensor, factory = add_replica_sharded_variable_input(name, data_iter, dtype, by_ref, replica_grouping,
                                                             shard_over)
        self._variable_factories.insert(name, factory, overwrite=overwrite)
        self._named_inputs.insert(name, tensor, overwrite=overwrite)
        return tensor

    def add_variable_factory(self, factory: VariableFactory, name: str | None = None) -> Tensor:
        """Add a named graph input made by an existing factory.

        Raises:
            InvalidArgumentError: neither ``name`` nor the factory gives a name.
        """
        key = name or factory.name
        if not key:
            raise InvalidArgumentError("add_variable_factory: the factory has no name and none was given",
                                       fix="pass name=... or give the VariableFactory a name")
        self._check_free(key, False)
        tensor = factory.create_input()
        self._variable_factories.insert(key, factory)
        self._named_inputs.insert(key, tensor)
        return tensor

    def add_variable_inputs(self, name: str | int, variable_f: NamedVariableFactories,
                            overwrite: bool = False) -> NamedTensors:
        """Add a graph input for each factory of ``variable_f`` under ``name``; returns them.

        Used to outline: bind one shared graph to several sets of inputs.
        """
        name = str(name)
        self._check_free(name, overwrite)
        tensors = NamedTensors.from_dict({key: f.create_input() for key, f in variable_f.to_dict().items()})
        self._variable_factories.insert(name, variable_f.copy(), overwrite=overwrite)
        self._named_inputs.insert(name, tensors, overwrite=overwrite)
        return tensors

    def _check_free(self, name: str, overwrite: bool) -> None:
        if not overwrite and name in self._named_inputs:
            raise NameConflictError(
                f"{type(self).__name__} already has a variable input named '{name}'",
                where=context.user_source_line(), fix="give each variable input of a module its own name")

    # -- graphs ------------------------------------------------------------------------
    def create_graph(self, *args: Any, **kwargs: Any) -> tuple[NamedVariableFactories, GraphWithNamedArgs]:
        """Build ``self.build(*args, **kwargs)`` as a graph; return its factories and the graph.

        Tensor/TensorSpec arguments become graph inputs (in signature order) before
        the named inputs ``build`` adds.
        """
        ir = context.gcg().ir
        if self._graph_cache is not None:
            graph = self._graph_cache.create_graph(self, *args, **kwargs)
            if graph not in self._args_cache:
                self._args_cache[graph] = (self._variable_factories.copy(), self._named_inputs.copy())
            factories, named = self._args_cache[graph]
        else:
            self.aux = Aux()
            graph = ir.create_graph(self, *args, **kwargs)
            if self.implements_grad_graph:  # autodiff of a caller needs its grad info (upstream: PopART's flag)
                graph.can_be_recursively_autodiffed = False
            factories, named = self._variable_factories, self._named_inputs
        result = factories.copy(), GraphWithNamedArgs(graph, named.copy(), from_module=self, aux=self.aux.copy(),
                                                      called_graphs_grad_info=self.called_graphs_grad_info.consolidate())
        self._reset()
        return result

    def _reset(self) -> None:
        """Forget the inputs and aux of the last graph (submodule subtrees are kept, emptied)."""
        clear_leaves(self._variable_factories)
        clear_leaves(self._named_inputs)
        self.called_graphs_grad_info.clear()
        self.aux = Aux()
        self.var_grad = VarGrads()

    def call_module(self, module: "Module", name: str | None = None,
                    autodiff: Literal["auto", "build_grad", "autodiff", "none"] = "auto"
                    ) -> Callable[..., tuple[Tensor, ...]]:
        """Outline ``module``: build its graph, add its inputs under ``name`` and return a caller.

        ``autodiff``: "auto" builds the gradient graph of a module that implements
        ``build_grad`` (recorded in ``called_graphs_grad_info``, so autodiff of this
        module's graph uses it); "build_grad"/"autodiff" always build it with that method;
        "none" never. The gradient graph is built before the call, as it adds outputs to
        the forward graph; the call returns the forward graph's original outputs.
        """
        def call(*args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
            factories, graph = module.create_graph(*args, **kwargs)
            inputs = self.add_variable_inputs(name or type(module).__name__, factories)
            self.called_graphs_grad_info.add_submap(graph.called_graphs_grad_info)
            outputs_before = len(graph.graph.outputs)
            if not (autodiff == "none" or (autodiff == "auto" and not module.implements_grad_graph)):
                self.called_graphs_grad_info.add(graph.graph, graph.autodiff(method=autodiff).grad_graph_info)
            tensor_args = [a for a in args if isinstance(a, Tensor)]
            return graph.bind(inputs).call(*tensor_args)[:outputs_before]

        return call
