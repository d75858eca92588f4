"""Objects that hold tensors in their attributes, returned from ``forward``.

A forward may return, besides tensors and containers of them, an object whose
attributes hold its tensors: Hugging Face's ``DynamicCache`` (the keys and values of
each attention layer) comes back from a causal LM with ``use_cache`` on, as part of
its ``ModelOutput``. torch.compile rebuilds such objects after the compiled code
runs, and torch.export flattens them once they are registered with pytree; a capture
does the same for any plain object, without registering anything globally:

* ``flatten_objects`` replaces each such object (one with a ``__dict__`` that holds a
  tensor, directly or inside lists, tuples, dicts or other such objects) by an
  ``_Attributes`` node: its tensor-holding attributes become children of the pytree,
  the rest is kept, so the object's tensors are outputs of the step;
* unflattening the output spec rebuilds an object of the same class (``copy.copy`` of
  the traced one, without its tensors) and sets the step's tensors on it.

An object that is also a ``dict`` (Hugging Face's ``ModelOutput``, an ``OrderedDict``
whose items mirror its attributes, in releases that do not register it with pytree)
has its tensor-holding items flattened too, and set back in place (same key order),
so ``out.loss`` and ``out["loss"]`` are both the step's tensor.

An object that keeps its tensors anywhere else (``__slots__``, a C++ handle) is not
flattened, and capture refuses it as before.
"""
from __future__ import annotations

import collections
import copy
from typing import Any, Iterable

import torch
from torch.utils import _pytree as pytree

__all__ = ["flatten_objects"]


class _Attributes:
    """An object's tensor-holding attributes (``children``) and, for a dict, items
    (``items``), and the object without them."""

    def __init__(self, template: Any, children: dict[str, Any], items: dict[Any, Any] | None = None,
                 mirrored: tuple[str, ...] = ()):
        self.template, self.children, self.items = template, children, items or {}
        self.mirrored = mirrored  # attributes that are the item of the same name (one output each)


def _flatten(node: _Attributes) -> tuple[list[Any], Any]:
    names, keys = list(node.children), list(node.items)
    return ([node.children[n] for n in names] + [node.items[k] for k in keys],
            (node.template, names, keys, node.mirrored))


def _unflatten(values: Iterable[Any], context: Any) -> Any:
    template, names, keys, mirrored = context
    values = list(values)
    obj = copy.copy(template)
    vars(obj).update(zip(names, values))
    for key, value in zip(keys, values[len(names):]):
        _set_item(obj, key, value)
    vars(obj).update({name: obj[name] for name in mirrored})
    return obj


def _set_item(obj: Any, key: Any, value: Any) -> None:
    """``obj[key] = value`` through the dict class itself (a subclass's ``__setitem__`` may
    refuse or mirror it), keeping an ``OrderedDict``'s bookkeeping and the key's place."""
    base = collections.OrderedDict if isinstance(obj, collections.OrderedDict) else dict
    base.__setitem__(obj, key, value)


pytree.register_pytree_node(_Attributes, _flatten, _unflatten,
                            serialized_type_name="ipuxl.capture.outputs._Attributes")


def _holds_tensor(value: Any, seen: set[int]) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if id(value) in seen:
        return False
    seen.add(id(value))
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v, seen) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v, seen) for v in value.values())
    state = getattr(value, "__dict__", None)
    return isinstance(state, dict) and any(_holds_tensor(v, seen) for v in state.values())


def _is_plain_object(value: Any) -> bool:
    """Not a tensor, not a pytree container, with attributes in a ``__dict__``."""
    if isinstance(value, (torch.Tensor, type)) or not isinstance(getattr(value, "__dict__", None), dict):
        return False
    return pytree._get_node_type(value) not in pytree.SUPPORTED_NODES


def flatten_objects(tree: Any) -> Any:
    """``tree`` with every plain object that holds tensors replaced by an ``_Attributes``
    node, recursively (see the module docstring); anything else is left as it is."""
    def convert(value: Any) -> Any:
        if not _is_plain_object(value) or not _holds_tensor(value, set()):
            return value
        state = vars(value)
        held = {name: v for name, v in state.items() if _holds_tensor(v, set())}
        items = ({k: v for k, v in value.items() if _holds_tensor(v, set())} if isinstance(value, dict) else {})
        mirrored = tuple(name for name in held if name in items and items[name] is held[name])
        template = copy.copy(value)
        for name in held:
            delattr(template, name)
        for key in items:
            _set_item(template, key, None)
        return _Attributes(template, {name: flatten_objects(v) for name, v in held.items() if name not in mirrored},
                           {key: flatten_objects(v) for key, v in items.items()}, mirrored)

    return pytree.tree_map(convert, tree)
