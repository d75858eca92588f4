"""Fuse whole bias-corrected Adam and AdamW steps into multi-tensor fused Adam kernels.

Rewrites: one weight's Adam step as ``optim.rules.adam_`` emits it,

* the decoupled weight decay ``W' = scale_(W, f)`` (``optim.rules.adam_`` for AdamW; absent
  for Adam),
* the moment updates ``moving_average_(m, g, beta1)`` and ``moving_average_square_(v, g, beta2)``,
* the ``adam_updater`` that reads them (it increments the step counter), with or without
  a weight decay term ``wd * W`` (popxl.addons' ``AdamOptimizerStep``: the same AdamW),
* the weight update ``W'.add_(updater, alpha=-lr)`` or ``W'.addcmul_(updater, -lr)``
  (``-lr`` a Python number or a 0-dim tensor),

is matched for every weight of the graph; the matched steps that share their
hyperparameters (``beta1``, ``beta2``, ``eps``, the ``-lr``, decay factor and weight
decay values or nodes, dtype and device) become one ``kernels.var_updates.fused_adam_steps_`` call over
the lists of weights, gradients, moments and steps: torch's multi-tensor fused AdamW
kernel (the one ``torch.optim.AdamW(fused=True)`` runs), one pass over each tensor. The
call takes the place of the group's last weight update; the other steps move there. A
decay factor ``1 - lr * wd`` computed per weight from the same ``lr`` and ``wd`` (nodes or
numbers) counts as one value, and so does ``-lr`` computed per weight from one node (the
step code computes them once per weight).

Preconditions: a lowered fx graph; bias correction on (a step counter read only by the
updater); an updater's weight (for its decay term) the updated weight itself, and not
both decays; ``beta1``, ``beta2`` and ``eps`` Python numbers; both moments updated from
one gradient; each moment, moment update, updater, scaled weight and weight update read
by nothing else; weight, gradient, moments
and update term of one dtype, float32, float16 or bfloat16 (not float64: its programs keep
the unfused formula); no two steps share a weight, moment or step counter. A step moves
to its group's position only past nodes that do not read its tensors (or views of them)
and do not write its hyperparameters; a node that does ends the group before it, and a
step whose own nodes have such a node between them is left unfused. In lowered code the
alias records (``ir.aliases``) name the IR's nodes, so a node that records a write or a
view counts as writing, or viewing, any of its inputs.

Numerics: the fused kernel's. Its moment factors and bias corrections are the Python
numbers in double precision, not rounded to float32 as the unfused kernels round them
(the unfused formula differs from ``torch.optim.AdamW`` by ~1e-7 relative; the fused
kernel is torch's own); the decay factor is the graph's value (see ``fused_adam_steps_``).
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Hashable, NamedTuple, cast

import torch
import torch.fx as fx

from ipuxl.device.rewrites._nodes import alpha, input_node, is_scalar, val
from ipuxl.ir.aliases import record_writes, writes
from ipuxl.ir.meta import CALLED_GRAPH, MODIFIES, OP, VIEW_OF, WRITES
from ipuxl.kernels import var_updates
from ipuxl.passes.result import PassResult

__all__ = ["fuse_adam_steps"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Python functions that compute a new tensor from their inputs (the optimiser rules' arithmetic,
#: the lowering's copies)
_PURE_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset(
    {torch.mul, torch.sub, torch.add, torch.neg, torch.div, torch.clone})


class _AdamStep(NamedTuple):
    """The nodes of one weight's fusable Adam step, ended by the weight update ``update``."""

    update: fx.Node
    weight: fx.Node
    grad: fx.Node
    first: fx.Node  # moving_average_(m, grad, beta1)
    second: fx.Node  # moving_average_square_(v, grad, beta2)
    updater: fx.Node
    step: fx.Node
    scale: fx.Node | None  # scale_(weight, decay): AdamW's decoupled weight decay
    negative_lr: Any  # a number or a 0-dim tensor node
    decay: Any  # the decoupled decay's factor: None (none), a number or a 0-dim tensor node
    weight_decay: Any  # the updater's weight decay (popxl.addons' Adam): None, a number or a 0-dim tensor node
    key: tuple[Hashable, ...]  # steps with equal keys share one kernel call

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        """The step's own nodes, which the fused call replaces."""
        own = (self.first, self.second, self.updater, self.update)
        return own if self.scale is None else (self.scale, *own)

    @property
    def tensors(self) -> tuple[fx.Node, ...]:
        """The tensors the step reads or writes: weight, gradient, moments, step counter."""
        return self.weight, self.grad, self.first.args[0], self.second.args[0], self.step  # type: ignore[return-value]

    @property
    def hypers(self) -> tuple[fx.Node, ...]:
        """The hyperparameter nodes the step reads (learning rate, decay factor and what it is computed from)."""
        found = [h for h in (self.negative_lr, self.decay, self.weight_decay) if isinstance(h, fx.Node)]
        for _ in range(2):  # ``-lr`` and ``1 - lr * wd`` are computed from ``lr``: steps of one group share it
            found += [i for h in found for i in h.all_input_nodes]
        return tuple(dict.fromkeys(found))


def fuse_adam_steps(graph: fx.Graph) -> PassResult:
    """Replace the fusable Adam steps (see the module docstring) by multi-tensor ``fused_adam_steps_`` calls."""
    steps = _unshared([s for s in map(_adam_step, list(graph.nodes)) if s is not None])
    order = {n: i for i, n in enumerate(graph.nodes)}
    member = {n for s in steps for n in s.nodes}
    steps = [s for s in steps if not _interrupted(s, order, member)]
    member = {n for s in steps for n in s.nodes}
    if not steps:
        return PassResult(graph, False)
    for group in _groups(graph, steps, member):
        _fuse(graph, group, order)
    return PassResult(graph, True)


# -- matching one step ---------------------------------------------------------------------------
def _adam_step(node: fx.Node) -> _AdamStep | None:
    """The Adam step the weight update ``node`` ends, when it can be fused (module docstring)."""
    if node.op != "call_function" or node.users:
        return None
    if node.target is torch.Tensor.add_ and len(node.args) == 2 and set(node.kwargs) <= {"alpha"}:
        negative_lr = alpha(node)
    elif node.target is torch.Tensor.addcmul_ and len(node.args) == 3 and not node.kwargs:
        negative_lr = node.args[2]
    else:
        return None
    term, target = input_node(node, 1), input_node(node, 0)
    if (term is None or target is None or term.target is not var_updates.adam_updater or len(term.users) != 1
            or not is_scalar(negative_lr)):
        return None
    _, _, w, step, wd, beta1, beta2, eps = term.args
    step_node = input_node(term, 3)
    if (step_node is None or len(step_node.users) != 1
            or not all(isinstance(x, (int, float)) for x in (beta1, beta2, eps))
            or (w is not None and w is not target) or (wd is not None and (w is None or not is_scalar(wd)))):
        return None
    scale, weight, decay = _decay(target)
    if scale is not None and wd is not None:
        return None  # two weight decays: not a form the kernel has
    m_node = _moment_update(term, 0, var_updates.moving_average_, beta1)
    v_node = _moment_update(term, 1, var_updates.moving_average_square_, beta2)
    if weight is None or m_node is None or v_node is None or m_node.args[1] is not v_node.args[1]:
        return None
    grad = input_node(m_node, 1)
    tensors = [weight, grad, input_node(m_node, 0), input_node(v_node, 0)]
    if any(t is None or not isinstance(t.meta.get("val"), torch.Tensor) for t in tensors):
        return None
    metas = [val(t) for t in tensors if t is not None] + [val(term)]
    if len({m.dtype for m in metas}) != 1 or metas[0].dtype not in _DTYPES or len({m.device for m in metas}) != 1:
        return None
    key: tuple[Hashable, ...] = (float(cast(float, beta1)), float(cast(float, beta2)), float(cast(float, eps)),
                                 _hyper_key(negative_lr), _decay_key(decay),
                                 None if wd is None else _hyper_key(wd), metas[0].dtype, metas[0].device)
    return _AdamStep(node, weight, cast(fx.Node, tensors[1]), m_node, v_node, term, step_node, scale, negative_lr,
                     decay, wd, key)


def _decay(target: fx.Node) -> tuple[fx.Node | None, fx.Node | None, Any]:
    """``(scale node, weight, factor)`` of the update's target: AdamW's ``scale_(W, f)`` read
    only by the update, or the weight itself (no decay: ``(None, W, None)``)."""
    if target.target is not var_updates.scale_:
        return None, target, None
    weight, factor = input_node(target, 0), target.args[1]
    if weight is None or len(target.users) != 1 or not is_scalar(factor):
        return None, None, None
    return target, weight, factor


def _moment_update(term: fx.Node, i: int, kernel: Callable[..., Any], beta: Any) -> fx.Node | None:
    """The update ``kernel(moment, grad, beta)`` of the moment the updater ``term`` reads as
    argument ``i``: the update itself (its result read by the updater alone), or the moment
    written by that update (popxl.addons reads the tensor, not the op's result), the
    moment read by nothing else in either case."""
    arg = input_node(term, i)
    if arg is None:
        return None
    if arg.target is kernel:
        moment = input_node(arg, 0)
        ok = len(arg.users) == 1 and moment is not None and len(moment.users) == 1
        return arg if ok and arg.args[2] == beta else None
    others = [u for u in arg.users if u is not term]
    if len(arg.users) != 2 or len(others) != 1:
        return None
    update = others[0]
    if (update.target is not kernel or update.args[0] is not arg or update.args[2] != beta or update.users
            or not _before(update, term)):
        return None
    return update


def _before(first: fx.Node, second: fx.Node) -> bool:
    """Whether ``first`` comes before ``second`` in their graph."""
    node = first.next
    while node.op != "root":
        if node is second:
            return True
        node = node.next
    return False


def _hyper_key(value: Any) -> Hashable:
    """Equal for equal hyperparameters: the same node or number, or ``-x`` computed by
    separate nodes from one node ``x`` (each inlined optimiser graph negates the rate)."""
    if not isinstance(value, fx.Node):
        return ("number", float(value))
    if value.target is torch.neg and len(value.args) == 1 and not value.kwargs and isinstance(value.args[0], fx.Node):
        return ("neg", value.args[0])
    return ("node", value)


def _decay_key(factor: Any) -> Hashable:
    """Equal for equal decay factors: the same node or number, or ``1 - lr * wd`` computed
    by separate nodes from one learning-rate node and one number ``wd``."""
    if factor is None:
        return None
    if isinstance(factor, fx.Node) and factor.target is torch.sub and factor.args[0] == 1.0 and not factor.kwargs:
        product = input_node(factor, 1)
        if (product is not None and product.target is torch.mul and len(product.args) == 2 and not product.kwargs
                and all(isinstance(a, fx.Node) or is_scalar(a) for a in product.args)):
            return ("one_minus", *(a if isinstance(a, fx.Node) else float(cast(float, a)) for a in product.args))
    return _hyper_key(factor)


def _unshared(steps: list[_AdamStep]) -> list[_AdamStep]:
    """The steps whose weight, moments and step counter no other step touches."""
    count: dict[fx.Node, int] = {}
    for s in steps:
        for t in s.tensors[:1] + s.tensors[2:]:
            count[t] = count.get(t, 0) + 1
    return [s for s in steps if all(count[t] == 1 for t in s.tensors[:1] + s.tensors[2:])]


# -- where a step may move -----------------------------------------------------------------------
def _may_alias(user: fx.Node, source: fx.Node) -> bool:
    """Whether ``user``'s result may share storage with its input ``source`` (unknown: yes).

    In lowered code the alias records name the IR's nodes (``ir.lower``): they are flags
    here. An ipuxl op or call with none returns new storage (the lowering copies a view
    whose storage the program writes later); an item or slice (``getitem``) may be a view."""
    if MODIFIES in user.meta or VIEW_OF in user.meta:
        return True
    if OP in user.meta or CALLED_GRAPH in user.meta:
        return False
    if user.op == "call_function" and isinstance(user.target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in user.target._schema.returns)
    return not (user.op == "call_function" and user.target in _PURE_FUNCTIONS)


def _aliases(start: tuple[fx.Node, ...]) -> set[fx.Node]:
    """``start`` and every node that may share storage with one of them (through users)."""
    seen, todo = set(start), list(start)
    while todo:
        source = todo.pop()
        for user in source.users:
            if user not in seen and _may_alias(user, source):
                seen.add(user)
                todo.append(user)
    return seen


def _may_write(node: fx.Node, tensors: set[fx.Node]) -> bool:
    """Whether ``node`` may write one of ``tensors`` in place: one of its inputs when it
    records writes (ipuxl's ops and calls record every write, ``ir.aliases``; in lowered
    code the records name the IR's nodes, so which input is not known), never when it is
    an ipuxl op or call without such a record; an aten op when its schema is mutable; else
    any input (unknown)."""
    inputs = [i for i in node.all_input_nodes if i in tensors]
    if not inputs:
        return False
    if writes(node):
        return True
    if OP in node.meta or CALLED_GRAPH in node.meta or (
            node.op == "call_function" and (node.target in _PURE_FUNCTIONS or node.target is operator.getitem)):
        return False
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    return True


class _Watch:
    """What other nodes must not do while a step waits to run later: read its tensors or
    views of them, or write its hyperparameters."""

    def __init__(self, step: _AdamStep):
        self.tensors = _aliases(step.tensors)
        self.hypers = _aliases(step.hypers)

    def blocks(self, node: fx.Node) -> bool:
        return any(i in self.tensors for i in node.all_input_nodes) or _may_write(node, self.hypers)


def _interrupted(step: _AdamStep, order: dict[fx.Node, int], member: set[fx.Node]) -> bool:
    """Whether a node (not a step's own) between the step's first node and its weight update blocks it."""
    watch = _Watch(step)
    node = min(step.nodes, key=order.__getitem__).next
    while node is not step.update:
        if node not in member and watch.blocks(node):
            return True
        node = node.next
    return False


def _groups(graph: fx.Graph, steps: list[_AdamStep], member: set[fx.Node]) -> list[list[_AdamStep]]:
    """The steps in groups of one key, each to run where its last weight update was: walking
    the graph in order, a group closes before a node (not a step's own) that blocks one
    of its steps."""
    by_update = {s.update: s for s in steps}
    open_groups: dict[Hashable, list[tuple[_AdamStep, _Watch]]] = {}
    groups: list[list[_AdamStep]] = []
    for node in graph.nodes:
        if node in by_update:
            step = by_update[node]
            open_groups.setdefault(step.key, []).append((step, _Watch(step)))
        elif node not in member:
            for key in [k for k, g in open_groups.items() if any(w.blocks(node) for _, w in g)]:
                groups.append([s for s, _ in open_groups.pop(key)])
    groups.extend([s for s, _ in g] for g in open_groups.values())
    return groups


# -- the fused call ------------------------------------------------------------------------------
def _fuse(graph: fx.Graph, group: list[_AdamStep], order: dict[fx.Node, int]) -> None:
    """Put one ``fused_adam_steps_`` call where the group's last weight update was; erase the steps."""
    last = max((s.update for s in group), key=order.__getitem__)
    head = group[0]
    beta1, beta2, eps = head.updater.args[5:8]
    args = ([s.weight for s in group], [s.grad for s in group], [s.first.args[0] for s in group],
            [s.second.args[0] for s in group], [s.step for s in group], head.negative_lr, head.decay,
            head.weight_decay, beta1, beta2, eps)
    with graph.inserting_before(last):
        fused = graph.call_function(var_updates.fused_adam_steps_, args, {})
    fused.meta.update({k: v for k, v in last.meta.items() if k not in (WRITES, MODIFIES, "val")})
    record_writes(fused, (w for s in group for n in s.nodes for w in writes(n)))
    kept = {n for n in (head.negative_lr, head.decay, head.weight_decay) if isinstance(n, fx.Node)}
    for step in group:
        for node in sorted(step.nodes, key=order.__getitem__, reverse=True):
            graph.erase_node(node)
        for hyper in (step.decay, step.negative_lr, step.weight_decay):
            _erase_unused(graph, hyper, kept)


def _erase_unused(graph: fx.Graph, hyper: Any, kept: set[fx.Node]) -> None:
    """Erase a per-weight hyperparameter node the fused call no longer reads (``-lr``,
    ``1 - lr * wd``) and the product it was computed from."""
    if (not isinstance(hyper, fx.Node) or hyper in kept or hyper.users or hyper.op != "call_function"
            or hyper.target not in _PURE_FUNCTIONS):
        return
    inputs = hyper.all_input_nodes
    graph.erase_node(hyper)
    for node in inputs:
        if node not in kept and not node.users and node.op == "call_function" and node.target is torch.mul:
            graph.erase_node(node)
