"""Repeated block modules traced once and called from the model's trace (``outline=True``).

A deep model is often N copies of one block (transformer layers, residual blocks).
Tracing each copy inline makes capture time and graph size grow with N; instead:

1. ``outline_candidates`` finds the outermost submodules that have a structurally
   identical sibling (same class, plain attributes, parameter/buffer specs and
   children; see ``_structure``). torch's own layers without submodules (``Conv2d``,
   ``BatchNorm2d``, ``ReLU``...) are not candidates: each is one functional call,
   a graph call of its own cannot save anything, and tracing each kind alone cost
   ResNet-50's first call 33 extra traces.
2. While the model is traced, ``outlined_blocks`` routes each candidate's forward
   through its kind's ``OutlinedBlock``: a call of the block's own trace (an
   ``ipuxl::call_graph`` node). The first run of a kind not traced yet raises
   ``NeedBlock``; the tracer traces that block alone and starts again.
   ``discover_blocks`` finds most kinds up front by running the model once on fake
   tensors, so the model's trace rarely restarts.
3. ``outline_block`` keeps a block's trace only when calling it pays
   (``MIN_BLOCK_OPS``, ``ipuxl.ir.calls.MIN_SAVINGS``) and changes nothing the model
   computes (no loss inside, no in-place write to its inputs); otherwise that kind
   runs inline.
"""
from __future__ import annotations

import contextlib
import enum
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ipuxl.capture.arguments import flatten_call
from ipuxl.capture.dropout import SEED_DTYPE, SEED_SHAPE
from ipuxl.capture.module_state import call_with_state
from ipuxl.capture.grad_mode import REQUIRES
from ipuxl.capture.mode import CaptureMode, active_mode, capturing
from ipuxl.capture.nodes import output_nodes, spec_of
from ipuxl.ir.call_op import CallEntry, is_call_graph_node, node_strides
from ipuxl.ir.calls import MIN_SAVINGS  # what an outlined block must save over all its copies

if TYPE_CHECKING:
    from ipuxl.capture.trace import TracedModule

__all__ = ["MIN_BLOCK_OPS", "OutlinedBlock", "NeedBlock", "Candidates", "Blocks", "outline_candidates",
           "outlined_blocks", "discover_blocks", "outline_block", "used_blocks"]

MIN_BLOCK_OPS = 4  # smaller blocks stay inline: a call costs more than it saves and stops fusion

# the attributes ``nn.Module.__init__`` sets: not part of what makes two blocks alike
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
# ipuxl's own attributes on a user's module (the weight-sync registry): not part of its structure
_IPUXL_ATTRIBUTES = "_ipuxl"


@dataclass
class OutlinedBlock:
    """A kind of block module traced once; ``entry`` records its calls in the model's trace.

    The block's graph (``graph_from_trace(ir, traced)``) takes the call's tensor
    inputs, the block's parameters and buffers, then (when it draws random numbers)
    a seed: the model's seed shifted by the dropouts that ran before the call
    (``ops.random.offset_seed``), so masks equal the inlined module's.
    """

    traced: TracedModule
    entry: CallEntry
    # per graph input (call tensors, parameters, buffers): whether any call passed a value
    # that needs a gradient (None: no differentiated call seen); see ``ir.meta.NO_GRAD``
    needs_grad: list[bool] | None = None

    def call(self, module: torch.nn.Module, tensors: list[torch.Tensor]) -> Any:
        """Record one run of the block ``module`` on ``tensors`` in the active capture."""
        traced, mode = self.traced, active_mode()
        assert mode is not None, "outlined blocks run inside a capture"
        extra = [mode.skip_dropouts(traced.n_dropouts)] if traced.uses_seed else []
        state = [_member(module, n) for n in traced.params + traced.buffers]
        if mode.grads is not None and mode.grads.differentiated:
            flags = [bool(mode.grads.flags(t) & REQUIRES) for t in (*tensors, *state)]
            self.needs_grad = flags if self.needs_grad is None else [a or b for a, b in zip(self.needs_grad, flags)]
        outs = self.entry(*tensors, *state, *extra)
        for name, new in zip(traced.mutated, outs[traced.n_outputs:]):
            _member(module, name).copy_(new)  # functionalize turns this into the model's buffer update
        return pytree.tree_unflatten(list(outs[:traced.n_outputs]), traced.out_spec)


class NeedBlock(Exception):
    """Raised inside a trace at the first run of a kind of block not traced yet."""

    def __init__(self, key: Any, module: torch.nn.Module, args: tuple, kwargs: dict):
        super().__init__(type(module).__name__)
        self.key, self.module, self.args, self.kwargs = key, module, args, kwargs
        self.runs = 0  # how many runs of this kind ``discover_blocks`` met (0: not known)
        self.outputs: tuple[list, Any] | None = None  # the first run's output leaves and spec (discovery)


# {candidate module: (structure key, number of instances)}; {block key: its trace, or None: inline}
Candidates = dict[torch.nn.Module, tuple[Any, int]]
Blocks = dict[Any, "OutlinedBlock | None"]


def _member(module: torch.nn.Module, dotted: str) -> torch.Tensor:
    owner: Any = module
    for part in dotted.split("."):
        owner = getattr(owner, part)
    assert isinstance(owner, torch.Tensor), dotted
    return owner


def _structure(module: torch.nn.Module, memo: dict[torch.nn.Module, Any]) -> Any:
    """What makes two module instances compute the same function of their inputs and
    state: class, training flag, plain attributes, parameter and buffer specs, children (recursively).
    None when that cannot be told (hooks, a per-instance forward, unhashable state)."""
    if module in memo:
        return memo[module]
    memo[module] = None
    if (module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module)
            or getattr(module, "_forward_hooks_with_kwargs", None)):
        return None
    attrs = [(key, _attr_key(value)) for key, value in vars(module).items()
             if key not in _MODULE_INTERNALS and not key.startswith(_IPUXL_ATTRIBUTES)]
    state = tuple((kind, name, None if t is None else (tuple(t.shape), t.dtype))
                  for kind, members in (("p", module._parameters), ("b", module._buffers))
                  for name, t in members.items())
    children = []
    for name, child in module._modules.items():
        key = None if child is None else _structure(child, memo)
        if key is None and child is not None:
            return None
        children.append((name, key))
    memo[module] = (type(module), module.training, tuple(sorted(attrs, key=repr)), state, tuple(children))
    return memo[module]


def _attr_key(value: Any) -> Any:
    """Plain values compare by value (containers item by item); any other object by identity."""
    if isinstance(value, (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, type)):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_attr_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((_attr_key(k), _attr_key(v)) for k, v in value.items()))
    return ("id", id(value))  # tensors, functions, other objects: the same one only


def outline_candidates(root: torch.nn.Module) -> Candidates:
    """Outermost submodules with at least one structurally identical sibling instance:
    ``{module: (structure key, number of instances of that structure)}``."""
    memo: dict[torch.nn.Module, Any] = {}
    named = [(name, m) for name, m in root.named_modules() if m is not root]
    keys = {m: _structure(m, memo) for _, m in named}
    counts: dict[Any, int] = {}
    for key in keys.values():
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    repeated = {name: m for name, m in named
                if keys[m] is not None and counts[keys[m]] > 1 and not _torch_layer(m)}
    return {m: (keys[m], counts[keys[m]]) for name, m in repeated.items()
            if not any(name.startswith(other + ".") for other in repeated)}


def _torch_layer(module: torch.nn.Module) -> bool:
    """One of torch's own layers without submodules (one functional call: never worth a graph)."""
    return not module._modules and type(module).__module__.startswith("torch.nn.")


@contextlib.contextmanager
def outlined_blocks(candidates: Candidates, blocks: Blocks, found: dict[Any, NeedBlock] | None = None,
                    ) -> Iterator[None]:
    """Route each candidate's forward through its traced block while tracing the model.
    With ``found``, a run of a kind not traced yet runs inline and is recorded there (first run
    of each kind) instead of raising ``NeedBlock``."""
    for module, (structure, _) in candidates.items():
        vars(module)["forward"] = _block_forward(module, structure, blocks, found)
    try:
        yield
    finally:
        for module in candidates:
            vars(module).pop("forward", None)


def _block_forward(module: torch.nn.Module, structure: Any, blocks: Blocks,
                   found: dict[Any, NeedBlock] | None) -> Callable:
    original = type(module).forward.__get__(module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        call = flatten_call(module, original, args, kwargs)
        statics = tuple(v for _, v in call.static_leaves())
        if not all(map(_comparable, statics)):
            return original(*args, **kwargs)  # an object equal only to itself (a cache made per call): inline
        key = (structure, str(call.spec), statics,
               tuple((tuple(t.shape), t.dtype, _layout(t)) for t in call.tensors()))
        if key not in blocks:
            if found is None:
                raise NeedBlock(key, module, args, kwargs)
            return _discovery_run(found, key, module, original, args, kwargs)
        block = blocks[key]
        if block is None:
            return original(*args, **kwargs)
        return block.call(module, call.tensors())

    return forward


_VALUES = (type(None), bool, int, float, complex, str, bytes, type, enum.Enum, torch.dtype, torch.device,
           torch.layout, torch.memory_format)


def _comparable(value: Any) -> bool:
    """Whether a block's static argument compares by value (or is a singleton), so that two runs
    of a kind of block can be told to be the same. An object equal only to itself (Hugging
    Face's per-call ``Cache``, a lambda made in forward) would make every run a new kind: the
    trace would start again at each run, for ever."""
    return isinstance(value, _VALUES) or type(value).__eq__ is not object.__eq__


def _discovery_run(found: dict[Any, NeedBlock], key: Any, module: torch.nn.Module, original: Callable,
                   args: tuple, kwargs: dict) -> Any:
    """A run of a kind of block in ``discover_blocks``' dry run: recorded, and run inline the
    first time. Later runs of the kind (same structure, same input specs: the same output
    specs) give fresh fake tensors of the first run's outputs instead of running again."""
    need = found.get(key)
    if need is None:
        need = found[key] = NeedBlock(key, module, args, kwargs)
    need.runs += 1
    if need.outputs is not None:
        flat, spec = need.outputs
        return pytree.tree_unflatten([v.detach() if isinstance(v, torch.Tensor) else v for v in flat], spec)
    out = original(*args, **kwargs)
    if need.runs == 1:
        flat, spec = pytree.tree_flatten(out)
        if all(isinstance(v, (torch.Tensor, int, float, bool, str, type(None))) for v in flat):
            need.outputs = (flat, spec)
    return out


def _layout(t: torch.Tensor) -> tuple[int, ...]:
    """The strides that matter for a block's trace (a dimension of size 1 takes any)."""
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))


def discover_blocks(module: torch.nn.Module, args: tuple, kwargs: dict | None,
                    candidates: Candidates, blocks: Blocks, trace_block: Callable[[NeedBlock], OutlinedBlock | None],
                    ) -> None:
    """Find the kinds of blocks the model runs, and trace each alone (``trace_block``), by
    running the model once on fake tensors (no tracing, so cheap; each kind's first run runs
    inline, the others give fake tensors like its outputs) and
    recording each kind's first run and how often it runs (a kind run once stays inline,
    untraced); the model's trace then meets known blocks only. Fake CPU
    tensors, not meta ones: their ops give the strides the trace will see (meta convolutions
    return NCHW for channels-last inputs, and a block's key includes its inputs' strides).
    Anything fake tensors cannot run leaves the rest to the tracer's retries."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(value: Any) -> Any:
        return fake_mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

    found: dict[Any, NeedBlock] = {}
    complete = False
    try:
        state = {name: fake(t.detach()) for name, t in [*module.named_parameters(), *module.named_buffers()]}
        fake_args, fake_kwargs = pytree.tree_map(fake, (tuple(args), dict(kwargs or {})))
        with torch.no_grad(), fake_mode:
            mode = CaptureMode(torch.zeros(SEED_SHAPE, dtype=SEED_DTYPE))
            with capturing(mode), outlined_blocks(candidates, blocks, found):
                call_with_state(module, state, fake_args, fake_kwargs)
        complete = True
    except Exception:  # noqa: BLE001 - an op without a fake kernel, data-dependent code...: the trace retries
        pass
    for key, need in found.items():  # the kinds met (before any failure)
        # a kind the whole run met once (alike modules run on other shapes: DenseNet's layers) stays inline
        blocks[key] = trace_block(need) if need.runs > 1 or not complete else None


def outline_block(traced: TracedModule, copies: int) -> OutlinedBlock | None:
    """The block ``traced`` (run ``copies`` times in the model) as an ``OutlinedBlock``; None
    (run it inline) when outlining it would not pay or would change what the model computes."""
    ops = sum(1 for n in traced.gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
    if traced.has_losses or traced.mutates_inputs or ops < MIN_BLOCK_OPS or ops * (copies - 1) < MIN_SAVINGS:
        return None
    returned = output_nodes(traced.gm.graph)
    inputs = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    entry = CallEntry(traced.name, [spec_of(n) for n in returned], in_strides=node_strides(inputs),
                      out_strides=node_strides(returned))
    return OutlinedBlock(traced, entry)


def used_blocks(gm: fx.GraphModule, blocks: Blocks) -> list[OutlinedBlock]:
    """The outlined blocks ``gm`` calls."""
    keys = {n.args[0] for n in gm.graph.nodes if is_call_graph_node(n)}
    return [b for b in blocks.values() if b is not None and b.entry.key in keys]
