"""Checks on tensor values in a captured program run on every call, as torch.compile runs them.

Code written for ``torch.compile`` / ``torch.export`` states what it knows about data with
``torch._check(cond)`` (Hugging Face's ``torch_compilable_check``), ``torch._check_tensor_all``
and ``torch._assert_async``, and older code with ``assert``. A capture's tensors hold no
values, so each such check becomes part of the program (see also ``torch.export``'s
runtime asserts):

- ``torch._assert_async(cond, msg)`` is traced as an op; the device keeps it (it has no
  result, so dead-code elimination would drop it otherwise: ``device.rewrites.dead_code``).
- ``torch._check(cond)`` on a value read from a tensor (``.item()``) is recorded by torch's
  shape environment as a deferred runtime assert, and tracing goes on assuming it holds (a
  later ``if`` on the same fact is decided). ``materialize_checks`` turns each into tensor ops
  on the tensor that was read (``x.max().item() < 100`` becomes ``x.max().double() < 100``)
  and an ``_assert_async`` with a message naming the check's line.
- ``assert`` on a value read from a tensor (``assert lengths.max().item() <= n``, ``assert
  (x > 0).all()``) would stop the capture ("could not guard on data-dependent expression").
  As Dynamo does, an assert statement becomes a deferred check instead (``assert_statements``):
  when converting a data-dependent value to ``bool`` fails while capturing, and the Python
  frame doing it is evaluating an ``assert``'s condition (its bytecode jumps to
  ``LOAD_ASSERTION_ERROR``), the condition is recorded as above, with the assert's message.
  Any other branch on data (``if``, ``while``, ``and`` outside an assert) is still refused.

A check that fails at run time stops the step before it completes: a ``DeviceError`` (a
RuntimeError, as torch.compile's failed asserts are; eager raises AssertionError for
``assert``) naming the check, the step and the user's line, with the variables as they were
before the step. A condition ipuxl cannot state as tensor ops (a fractional power, a value
not read with ``.item()``) is a ``TraceError``.
"""
from __future__ import annotations

import contextlib
import dis
import functools
import linecache
import sys
import types
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.sym_node import SymNode
from torch.fx.experimental.symbolic_shapes import ConvertIntKey, GuardOnDataDependentSymNode

from ipuxl.capture.patches import CapturePatch
from ipuxl.errors import TraceError
from ipuxl.source import SKIP_PREFIXES, is_user_file

__all__ = ["assert_statements", "materialize_checks"]

aten = torch.ops.aten
_ASSERT_PREFIX = "assert failed"  # how the message of a check made from an ``assert`` starts

_GUARD_BOOL: Callable[[SymNode, str, int], bool] = SymNode.guard_bool  # torch's own

_JUMP_IF_TRUE = frozenset({"POP_JUMP_IF_TRUE", "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_TRUE"})
_JUMP_IF_FALSE = frozenset({"POP_JUMP_IF_FALSE", "POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_FALSE"})
_CALLS = frozenset({"PRECALL", "CALL", "CALL_FUNCTION"})


def assert_statements() -> contextlib.AbstractContextManager[None]:
    """While inside, an ``assert`` on a data-dependent value in this thread becomes a deferred
    runtime check instead of a failed guard (see the module docstring)."""
    return _PATCH()


def _guard_bool(self: SymNode, file: str, line: int) -> bool:
    try:
        return _GUARD_BOOL(self, file, line)
    except GuardOnDataDependentSymNode:
        if not _PATCH.active() or self.shape_env is None:
            raise
        site = _assert_site(sys._getframe(1))
        if site is None:
            raise
        message, negated = site
        expr = sympy.Not(self.expr) if negated else self.expr
        return bool(self.shape_env.guard_or_defer_runtime_assert(expr, message)) != negated


_PATCH = CapturePatch.replacing(SymNode, "guard_bool", _guard_bool)


def _assert_site(frame: types.FrameType | None) -> tuple[str, bool] | None:
    """When the innermost frame outside torch and ipuxl is converting an ``assert`` statement's
    condition to bool: the check's message, and whether the value converted is negated
    (``assert not x``). Else None."""
    while frame is not None and frame.f_code.co_filename.startswith(SKIP_PREFIXES):
        frame = frame.f_back
    if frame is None:
        return None
    code = frame.f_code
    instructions, at = _instructions(code)
    i = at.get(frame.f_lasti)
    if i is None:
        return None
    negated = False
    while instructions[i].opname in ("TO_BOOL", "UNARY_NOT"):  # the conversion precedes the jump
        negated ^= instructions[i].opname == "UNARY_NOT"
        i += 1
    jump = instructions[i]
    if jump.opname not in _JUMP_IF_TRUE | _JUMP_IF_FALSE:
        return None
    target = at.get(jump.argval) if isinstance(jump.argval, int) else None
    if _opname(instructions, i + 1) == "LOAD_ASSERTION_ERROR":  # falling through fails the assert
        fail, holds_when = i + 1, jump.opname in _JUMP_IF_TRUE
    elif target is not None and _opname(instructions, target) == "LOAD_ASSERTION_ERROR":  # ``assert a and b``
        fail, holds_when = target, jump.opname in _JUMP_IF_FALSE
    else:
        return None
    negated ^= not holds_when  # ``assert not x`` compiles to a jump if false over the failure
    text = linecache.getline(code.co_filename, frame.f_lineno).strip()
    given = instructions[fail + 1]
    said = (f": {given.argval}" if given.opname == "LOAD_CONST" and isinstance(given.argval, str)
            and _opname(instructions, fail + 2) in _CALLS else "")
    return f"{_ASSERT_PREFIX}{said} (`{text}` at {code.co_filename}:{frame.f_lineno})", negated


def _opname(instructions: list[dis.Instruction], i: int) -> str | None:
    return instructions[i].opname if i < len(instructions) else None


@functools.lru_cache(maxsize=512)
def _instructions(code: types.CodeType) -> tuple[list[dis.Instruction], dict[int, int]]:
    instructions = list(dis.get_instructions(code))
    return instructions, {ins.offset: i for i, ins in enumerate(instructions)}


def materialize_checks(gm: fx.GraphModule, module_name: str) -> None:
    """Add an ``aten._assert_async.msg`` node for each runtime assert torch's shape environment
    deferred while ``gm`` was traced (``torch._check`` and ``assert`` on values read from
    tensors): the condition as tensor ops on the tensors those values were read from, placed
    after the last read. Call ``gm.recompile()`` afterwards."""
    sources: dict[sympy.Symbol, tuple[fx.Node, tuple]] = {}
    shape_env = None
    for node in gm.graph.nodes:
        for symbol, path in (node.meta.get("unbacked_bindings") or {}).items():
            sources[symbol] = (node, tuple(path))
            shape_env = shape_env or _shape_env_of(node.meta.get("val"))
    if shape_env is None:
        return
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for records in list(shape_env.deferred_runtime_asserts.values()):
        for record in records:
            _Check(gm.graph, sources, order, record, module_name).emit()


def _shape_env_of(value: Any) -> Any:
    node = getattr(value, "node", None)
    if node is not None:
        return getattr(node, "shape_env", None)
    mode = getattr(value, "fake_mode", None)
    return getattr(mode, "shape_env", None)


class _Check:
    """One deferred runtime assert, built as tensor ops into ``graph``."""

    def __init__(self, graph: fx.Graph, sources: dict[sympy.Symbol, tuple[fx.Node, tuple]],
                 order: dict[fx.Node, int], record: Any, module_name: str) -> None:
        self.graph, self.sources, self.record, self.module_name = graph, sources, record, module_name
        frames = [f for f in record.stack.summary() if is_user_file(f.filename)]
        self.frame = frames[-1] if frames else None
        forward = [f for f in frames if f.name == "forward"]
        self.anchor = (forward or frames)[-1] if frames else None
        anchor = self.anchor
        self.stack_trace = f'File "{anchor.filename}", line {anchor.lineno}, in {anchor.name}' if anchor else None
        self.symbols: dict[sympy.Symbol, fx.Node] = {}
        self.message = self._message()
        symbols = list(record.expr.free_symbols)
        missing = [s for s in symbols if s not in sources]
        if missing:
            self._refuse(f"it depends on {', '.join(map(str, missing))}, which no tensor read defines")
        reads = [sources[s][0].args[0] for s in symbols if sources[s][0].args]
        self.fake_mode = next((r.meta["val"].fake_mode for r in reads if isinstance(r, fx.Node)
                               and hasattr(r.meta.get("val"), "fake_mode")), None)
        last = max((sources[s][0] for s in symbols), key=order.__getitem__, default=None)
        self.at = None if last is None else last.next

    def _message(self) -> str:
        msg = str(self.record.msg)
        if msg.startswith(_ASSERT_PREFIX):
            return msg
        if self.frame is None:
            return f"a runtime check failed: {self.record.expr} is False"
        frame, anchor = self.frame, self.anchor
        said = f"a runtime check failed: `{(frame.line or '').strip()}` at {frame.filename}:{frame.lineno}"
        if anchor is not None and anchor is not frame:  # a helper's check (transformers' torch_compilable_check)
            said += f", called from `{(anchor.line or '').strip()}` at {anchor.filename}:{anchor.lineno}"
        return said

    def _refuse(self, why: str) -> None:
        where = f"{self.frame.filename}:{self.frame.lineno} in {self.frame.name}" if self.frame else None
        raise TraceError(f"cannot check `{self.record.expr}` at run time in module {self.module_name}: {why}",
                         where=where, fix="state the check on tensors: torch._assert_async(tensor_condition, message)")

    def emit(self) -> None:
        if self.at is None:
            return  # no data in it: torch decided it while tracing
        with self.graph.inserting_before(self.at):
            cond = self.value(self.record.expr)
            if not isinstance(cond, fx.Node):
                return
            self.node(aten._assert_async.msg, cond, self.message)

    def node(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        assert self.fake_mode is not None, "a symbol is read first"
        with self.fake_mode:
            node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args], **kwargs)
        if self.stack_trace:
            node.meta["stack_trace"] = self.stack_trace
        return node

    def symbol(self, symbol: sympy.Symbol) -> fx.Node:
        if symbol not in self.symbols:
            self.symbols[symbol] = self._read(symbol)
        return self.symbols[symbol]

    def _read(self, symbol: sympy.Symbol) -> fx.Node:
        read, path = self.sources[symbol]
        source = read.args[0] if read.target is aten._local_scalar_dense.default else None
        if not isinstance(source, fx.Node) or path not in ((), (ConvertIntKey(),)):
            self._refuse(f"{symbol} is not a value read from a tensor (.item())")
        assert isinstance(source, fx.Node)
        dtype = torch.float64 if source.meta["val"].is_floating_point() else torch.int64  # Python float and int
        return self.node(aten._to_copy.default, source, dtype=dtype)

    def value(self, expr: Any) -> Any:
        if isinstance(expr, sympy.Symbol):
            return self.symbol(expr)
        if expr is sympy.true or expr is sympy.false:
            return bool(expr)
        if expr.is_Integer:
            return int(expr)
        if expr.is_Number:
            return float(expr)
        parts = [self.value(a) for a in expr.args]
        name = type(expr).__name__
        if name in _RELATIONS:
            return self.compare(name, *parts)
        if name in _FOLDS:
            return functools.reduce(lambda a, b: self.binary(_FOLDS[name], a, b), parts)
        if name in _UNARY:
            return self.node(_UNARY[name], self.tensor(parts[0]))
        if name == "Pow" and isinstance(parts[1], int) and parts[1] >= 1:
            return self.node(aten.pow.Tensor_Scalar, parts[0], parts[1])
        if name in _ROUNDINGS:  # math.floor, math.ceil, math.trunc
            return self.node(aten._to_copy.default, self.node(_ROUNDINGS[name], self.tensor(parts[0])),
                             dtype=torch.int64)
        if name in ("ToFloat", "FloatTrueDiv", "IntTrueDiv"):
            floats = [self.node(aten._to_copy.default, p, dtype=torch.float64) if isinstance(p, fx.Node) else float(p)
                      for p in parts]
            return floats[0] if name == "ToFloat" else self.binary(aten.div.Tensor, *floats)
        self._refuse(f"torch's {name} has no tensor form here")

    def tensor(self, value: Any) -> fx.Node:
        if isinstance(value, fx.Node):
            return value
        dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float64
        return self.node(aten.scalar_tensor.default, value, dtype=dtype)

    def binary(self, target: Any, a: Any, b: Any) -> fx.Node:
        if not isinstance(a, fx.Node) and target in _COMMUTES:
            a, b = b, a
        return self.node(target, self.tensor(a), self.tensor(b))

    def compare(self, name: str, a: Any, b: Any) -> fx.Node:
        if not isinstance(a, fx.Node):
            a, b, name = b, a, _MIRROR[name]
        return self.node(_RELATIONS[name], a, self.tensor(b))


_RELATIONS = {"StrictLessThan": aten.lt.Tensor, "LessThan": aten.le.Tensor, "StrictGreaterThan": aten.gt.Tensor,
              "GreaterThan": aten.ge.Tensor, "Equality": aten.eq.Tensor, "Unequality": aten.ne.Tensor}
_MIRROR = {"StrictLessThan": "StrictGreaterThan", "LessThan": "GreaterThan", "StrictGreaterThan": "StrictLessThan",
           "GreaterThan": "LessThan", "Equality": "Equality", "Unequality": "Unequality"}
_FOLDS = {"Add": aten.add.Tensor, "Mul": aten.mul.Tensor, "And": aten.logical_and.default,
          "Or": aten.logical_or.default, "Max": aten.maximum.default, "Min": aten.minimum.default,
          "FloorDiv": aten.floor_divide.default, "PythonMod": aten.remainder.Tensor, "Mod": aten.remainder.Tensor}
_UNARY = {"Not": aten.logical_not.default, "Abs": aten.abs.default}
_ROUNDINGS = {"FloorToInt": aten.floor.default, "CeilToInt": aten.ceil.default, "TruncToInt": aten.trunc.default}
_COMMUTES = frozenset({aten.add.Tensor, aten.mul.Tensor, aten.logical_and.default, aten.logical_or.default,
                       aten.maximum.default, aten.minimum.default})
