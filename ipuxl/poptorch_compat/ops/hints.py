"""PopTorch's ops that only steer Poplar: they check their arguments as PopTorch does and change nothing.

``nop``, ``recomputationCheckpoint``, ``serializedMatMul`` (the product is
``torch.matmul``'s), ``set_available_memory``, ``set_overlap_for_input`` /
``set_overlap_for_output``, and the scopes ``MultiConv``, ``NameScope`` and ``Attribute``.

Where PopTorch diagnoses a misuse in the traced graph, so does ipuxl:

* while a model is captured, ``set_overlap_for_input/output`` return a copy of each tensor
  (an ``aten.clone`` node whose ``OVERLAP`` meta is ``(side, mode)``), so that
  ``compile.overlap.check_overlap`` can check, after the capture, that the mark is the only
  use of a model input, or a model output returned once, as upstream does;
* ``MultiConv`` refuses to nest, and a captured scope without a convolution raises
  (upstream's "Unexpected end_multi_conv").
"""
from __future__ import annotations

from typing import Any, Sequence

import threading

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils import _pytree as pytree

from ipuxl.poptorch_compat.enums import MatMulSerializationMode, MultiConvPlanType, OverlapMode
from ipuxl.poptorch_compat.ops.arguments import bad_arg, check_tensor

__all__ = [
    "OVERLAP", "nop", "recomputationCheckpoint", "serializedMatMul", "set_available_memory", "set_overlap_for_input",
    "set_overlap_for_output", "MultiConv", "NameScope", "Attribute",
]


def nop(tensor: torch.Tensor) -> torch.Tensor:
    """An identity that the graph keeps (PopTorch's debugging no-op): a copy of ``tensor``."""
    check_tensor(tensor, "nop must take a torch.tensor argument.")
    return tensor.clone()


def recomputationCheckpoint(*tensors: Any) -> Any:
    """Mark tensors to keep between forward and backward; returns them (one tensor, or a tuple,
    or a list/tuple of the type passed).

    No effect on a simulated device: ipuxl keeps every activation the backward reads.
    """
    if len(tensors) == 1 and isinstance(tensors[0], (tuple, list)):
        return type(tensors[0])(recomputationCheckpoint(*tensors[0]))
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise bad_arg(f"All inputs must be tensors (got {type(t).__name__})", "pass only tensors")
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def serializedMatMul(lhs: torch.Tensor, rhs: torch.Tensor, mode: MatMulSerializationMode, factor: int = 0,
                     keep_precision: bool = False) -> torch.Tensor:
    """``torch.matmul(lhs, rhs)``, which PopTorch splits into ``factor`` serial matmuls along ``mode``.

    The arguments are checked as PopTorch (and PopART) check them: ``factor`` must
    divide the serialised dimension. The serialisation itself has no effect on a
    simulated device (the product is the same).
    """
    if not isinstance(keep_precision, bool):
        raise bad_arg(f"serializedMatMul: keep_precision must be a bool, got {keep_precision!r}", "pass True or False")
    if isinstance(factor, bool) or not isinstance(factor, int):
        raise bad_arg(f"serializedMatMul: factor must be an int, got {factor!r}", "pass factor as an int")
    if not isinstance(mode, MatMulSerializationMode):
        raise bad_arg(f"serializedMatMul: mode must be a poptorch.MatMulSerializationMode, got {mode!r}",
                      "pass e.g. poptorch.MatMulSerializationMode.OutputChannels")
    out = torch.matmul(lhs, rhs)
    if mode is not MatMulSerializationMode.Disabled:
        _check_factor(lhs, rhs, mode, factor)
    return out


def _check_factor(lhs: torch.Tensor, rhs: torch.Tensor, mode: MatMulSerializationMode, factor: int) -> None:
    dims = {MatMulSerializationMode.InputChannels: ("input channels (lhs dim -2)", lhs.shape[-2] if lhs.dim() > 1
                                                    else 1),
            MatMulSerializationMode.ReducingDim: ("reducing dimension (lhs dim -1)", lhs.shape[-1]),
            MatMulSerializationMode.OutputChannels: ("output channels (rhs dim -1)", rhs.shape[-1])}
    name, length = dims[mode]
    if factor < 1 or length % factor:
        raise bad_arg(f"serializedMatMul: factor {factor} must be >= 1 and divide the {name} of length {length}",
                      f"pass a factor of {length}, or MatMulSerializationMode.Disabled")


def set_available_memory(tensor: torch.Tensor, available_memory_proportion: float) -> torch.Tensor:
    """Set the temporary memory proportion (0 to 1) Poplar plans the op making ``tensor`` with;
    returns ``tensor``. No effect on a simulated device (it only steers Poplar's planner)."""
    check_tensor(tensor, "You may only set available memory for torch.tensor values.")
    value = available_memory_proportion
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise bad_arg(f"set_available_memory: available_memory_proportion must be a number in [0, 1], got {value!r}",
                      "pass a proportion such as 0.6 (PopTorch's default)")
    return tensor


#: fx node meta of a captured ``set_overlap_for_input/output`` mark: ``("input" | "output", OverlapMode)``
OVERLAP = "poptorch_overlap"


def _set_overlap(tensors: Any, mode: OverlapMode, side: str) -> Any:
    if not isinstance(mode, OverlapMode):
        raise bad_arg(f"set_overlap_for_{side}: mode must be a poptorch.OverlapMode, got {mode!r}",
                      "pass e.g. poptorch.OverlapMode.OverlapAccumulationLoop")
    leaves, spec = pytree.tree_flatten(tensors)
    for leaf in leaves:
        check_tensor(leaf, f"You may only set overlap for torch.tensor {side}s.")
    proxy_mode = get_proxy_mode()
    if proxy_mode is not None:  # captured: a marked copy, checked after the capture (``compile.overlap``)
        leaves = [_marked_copy(leaf, proxy_mode.tracer, (side, mode)) for leaf in leaves]
    return pytree.tree_unflatten(leaves, spec)


def _marked_copy(tensor: torch.Tensor, tracer: Any, mark: tuple[str, OverlapMode]) -> torch.Tensor:
    graph = tracer.graph
    before = len(graph.nodes)
    copied = tensor.clone()
    clones = [node for node in list(graph.nodes)[before:]
              if node.op == "call_function" and node.target is torch.ops.aten.clone.default]
    if clones:  # the copy's node (the capture may record casts around it)
        clones[-1].meta[OVERLAP] = mark
    return copied


def set_overlap_for_input(input_tensors: Any, mode: OverlapMode) -> Any:
    """Let host input transfers of ``input_tensors`` (a tensor, or tuples/lists/dicts of them)
    overlap compute; returns them. No effect on a simulated device (no IO tiles)."""
    return _set_overlap(input_tensors, mode, "input")


def set_overlap_for_output(output_tensors: Any, mode: OverlapMode) -> Any:
    """Let host output transfers of ``output_tensors`` overlap compute; returns them. No effect
    on a simulated device (no IO tiles)."""
    return _set_overlap(output_tensors, mode, "output")


# -- scopes (no effect on a simulated device) -----------------------------------------------------------------
class MultiConv:
    """Combine the convolutions run inside ``with MultiConv():`` into one multi-convolution.

    The setters check and record their values as PopTorch does and return ``self``;
    the combination has no effect on a simulated device (each convolution runs as in
    eager PyTorch, with the same result).
    """

    def __init__(self) -> None:
        self._available_memory_proportions: Sequence[float] | None = None
        self._partials_types: Sequence[int] | None = None
        self._plan_type: MultiConvPlanType | None = None
        self._per_conv_reserved_tiles: int | None = None
        self._cycle_back_off: float | None = None
        self._enable_conv_ditherings: Sequence[bool] | None = None
        self._graph: fx.Graph | None = None  # the captured graph the scope opened in, and its length then
        self._start = 0

    @staticmethod
    def _per_conv(name: str, value: Any, kind: type) -> Any:
        if value is None:
            return None
        if isinstance(value, kind):
            return (value,)
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, kind) for v in value):
            return value
        raise bad_arg(f"Invalid {name}! Expected a {kind.__name__} or a non-empty list/tuple of them, got {value!r}",
                      f"pass one {kind.__name__} for all convolutions, or one per convolution")

    def availableMemoryProportions(self, value: float | list[float]) -> MultiConv:
        """The available memory proportion of each convolution (one float for all)."""
        self._available_memory_proportions = self._per_conv("available memory proportion", value, float)
        return self

    def partialsTypes(self, value: torch.dtype | list[torch.dtype]) -> MultiConv:
        """The partials type (``torch.float`` or ``torch.half``) of each convolution."""
        def encode(dtype: Any) -> int:
            if dtype in (torch.float, torch.float32):
                return 0
            if dtype in (torch.half, torch.float16):
                return 1
            raise bad_arg(f"Invalid partials types. Expecting torch.float or torch.half, got {dtype!r}",
                          "pass torch.float or torch.half")
        self._partials_types = [encode(v) for v in value] if isinstance(value, (list, tuple)) else (encode(value),)
        return self

    def enableConvDithering(self, value: bool | list[bool]) -> MultiConv:
        """Enable dithering per convolution (one bool for all)."""
        if value is not None and not (isinstance(value, bool) or (isinstance(value, (list, tuple))
                                                                   and all(isinstance(v, bool) for v in value))):
            raise bad_arg(f"value must be bool or list of bools, got {value!r}", "pass True/False or a list of them")
        self._enable_conv_ditherings = (value,) if isinstance(value, bool) else value
        return self

    def planType(self, value: MultiConvPlanType | None) -> MultiConv:
        """The multi-convolution plan (``poptorch.MultiConvPlanType``)."""
        if value is not None and not isinstance(value, MultiConvPlanType):
            raise bad_arg(f"Invalid plan type! Expected a poptorch.MultiConvPlanType, got {value!r}",
                          "pass poptorch.MultiConvPlanType.Parallel or .Serial")
        self._plan_type = value
        return self

    def perConvReservedTiles(self, value: int) -> MultiConv:
        """Tiles to reserve for each convolution."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_arg(f"perConvReservedTiles: value must be an int, got {value!r}", "pass a number of tiles")
        self._per_conv_reserved_tiles = value
        return self

    def cycleBackOff(self, value: float) -> MultiConv:
        """The cycle back-off proportion (a float between 0 and 1)."""
        if not isinstance(value, float):
            raise bad_arg(f"cycleBackOff: value must be a float, got {value!r}", "pass a float such as 0.1")
        self._cycle_back_off = value
        return self

    _active = threading.local()  # ``depth``: the MultiConv scopes open in this thread

    def __enter__(self) -> None:
        depth = getattr(MultiConv._active, "depth", 0)
        if depth:
            raise bad_arg("Nested poptorch.MultiConv is not supported",
                          "close the outer poptorch.MultiConv scope before opening another one")
        MultiConv._active.depth = depth + 1
        proxy_mode = get_proxy_mode()
        self._graph = proxy_mode.tracer.graph if proxy_mode is not None else None
        self._start = len(self._graph.nodes) if self._graph is not None else 0

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        MultiConv._active.depth = 0
        graph, self._graph = self._graph, None
        if exc_type is not None or graph is None:
            return
        added = list(graph.nodes)[self._start:]
        if not any(_may_convolve(node) for node in added):
            raise bad_arg("Unexpected end_multi_conv: no convolution ran inside this poptorch.MultiConv scope",
                          "put the convolutions to combine inside `with poptorch.MultiConv():`, or remove the scope")


def _may_convolve(node: fx.Node) -> bool:
    """A captured node that is (or may hold: a call of another graph) a convolution."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return node.op not in ("placeholder", "get_attr", "output")
    return "conv" in node.target.name()


class NameScope:
    """Prefix the names of the ops made inside ``with NameScope(name):``. No effect on a simulated
    device (ipuxl's op names come from the traced graph)."""

    def __init__(self, name: str):
        if not isinstance(name, str):
            raise bad_arg(f"Parameter to NameScope must be a string, got {type(name).__name__}", "pass a str")
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class Attribute:
    """Set PopART attributes (``__outline``, ``__recompute``...) on the ops made inside
    ``with Attribute(**{attr: {key: value}}):``. Scopes nest: an inner one adds or overrides
    keys and the outer values come back on exit (``Attribute.current()``). No effect on a
    simulated device: the attributes steer PopART's outlining and scheduling."""

    _current: dict[str, dict[str, Any]] = {}

    def __init__(self, **kwargs: dict[str, Any]):
        for attr, values in kwargs.items():
            if not isinstance(values, dict):
                raise bad_arg(f"Attribute {attr!r} must be given a dict of values, got {type(values).__name__}",
                              f"pass {attr}={{key: value}}")
        self._kwargs = kwargs
        self._saved: dict[str, dict[str, Any]] = {}

    @classmethod
    def current(cls) -> dict[str, dict[str, Any]]:
        """The attributes in force, by attribute then key."""
        return {attr: dict(values) for attr, values in cls._current.items()}

    def __enter__(self) -> None:
        self._saved = Attribute.current()
        for attr, values in self._kwargs.items():
            Attribute._current.setdefault(attr, {}).update(values)

    def __exit__(self, *exc: Any) -> None:
        Attribute._current = self._saved
