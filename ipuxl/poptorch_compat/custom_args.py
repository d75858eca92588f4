"""Custom argument types: PopTorch's ``ICustomArgParser`` and ``registerCustomArgParser``.

A model input (or output, or DataLoader batch) of a user type — a PyG ``Data``
batch, a dataclass of tensors — is opened by the parser registered for its type
(or for a base class of it, as upstream looks it up): ``yieldTensors(struct)``
gives its tensors in a fixed order and ``reconstruct(original, tensor_iterator)``
builds a new instance from new tensors. ipuxl registers such a type as a
``torch.utils._pytree`` node, so batching, capture and the compile key see its
tensors like those of a tuple. Two instances of one type whose tensors have the
same shapes and dtypes share one compiled program (as upstream, which compares
only their tensors); the non-tensor attributes of the first call's instance are
the ones ``reconstruct`` is given while tracing.
"""
from __future__ import annotations

import abc
from typing import Any, Iterator

import torch
from torch.utils import _pytree as pytree

from ipuxl.errors import InvalidArgumentError
from ipuxl.ir.context import user_source_line

__all__ = ["ICustomArgParser", "registerCustomArgParser", "register_subclasses"]


class ICustomArgParser(abc.ABC):
    """How to take a custom argument type apart into tensors and put it back together."""

    @abc.abstractmethod
    def yieldTensors(self, struct: Any) -> Iterator[torch.Tensor]:  # noqa: N802 - PopTorch's name
        """Yield every tensor of ``struct``, always in the same order."""

    @abc.abstractmethod
    def reconstruct(self, original_structure: Any, tensor_iterator: Iterator[torch.Tensor]) -> Any:
        """A new instance like ``original_structure`` whose tensors are taken, in
        ``yieldTensors`` order, from ``tensor_iterator``."""


#: registered type -> its parser (a later registration replaces an earlier one, as upstream)
_PARSERS: dict[type, ICustomArgParser] = {}
#: exact types registered as pytree nodes (each once; the parser is looked up at use)
_NODES: set[type] = set()


class _Template:
    """A pytree context: the instance a structure was flattened from. Equal for any two
    instances of one type (the tensors are compared as the node's children)."""

    def __init__(self, original: Any) -> None:
        self.original = original

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Template) and type(other.original) is type(self.original)

    def __hash__(self) -> int:
        return hash(type(self.original))

    def __repr__(self) -> str:
        return f"<{type(self.original).__name__}>"


def registerCustomArgParser(arg_type: type, parser: ICustomArgParser) -> None:  # noqa: N802 - PopTorch's name
    """Use ``parser`` for arguments of ``arg_type`` and its subclasses.

    Raises:
        InvalidArgumentError: ``arg_type`` is not a class, or ``parser`` not an ``ICustomArgParser``.
    """
    where = user_source_line()
    if not isinstance(arg_type, type):
        raise InvalidArgumentError(f"registerCustomArgParser: arg_type must be a class, got {arg_type!r}",
                                   where=where, fix="pass the class of your argument, e.g. MyBatch")
    if not isinstance(parser, ICustomArgParser):
        got = f"the class {parser.__name__}" if isinstance(parser, type) else type(parser).__name__
        raise InvalidArgumentError(
            f"registerCustomArgParser: parser must be an ICustomArgParser instance, got {got}",
            where=where, fix="subclass poptorch.ICustomArgParser (yieldTensors, reconstruct) and pass an "
                             "instance, e.g. registerCustomArgParser(MyBatch, MyParser())")
    if arg_type in (tuple, list, dict, torch.Tensor):
        raise InvalidArgumentError(f"registerCustomArgParser: {arg_type.__name__} is handled by PopTorch itself",
                                   where=where, fix="register a parser for your own class only")
    _PARSERS[arg_type] = parser
    _register_node(arg_type)


def parser_for(value: Any) -> ICustomArgParser | None:
    """The parser registered for ``value``'s type, or else for a base class of it."""
    parser = _PARSERS.get(type(value))
    if parser is not None:
        return parser
    return next((p for t, p in _PARSERS.items() if isinstance(value, t)), None)


def register_subclasses(tree: Any) -> None:
    """Register as pytree nodes the subclasses of registered types found in ``tree``
    (tuples, lists and dicts are searched), so that ``pytree.tree_flatten`` opens them."""
    if not _PARSERS:
        return
    if isinstance(tree, (tuple, list)):
        for item in tree:
            register_subclasses(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            register_subclasses(item)
    elif not isinstance(tree, torch.Tensor) and type(tree) not in _NODES and parser_for(tree) is not None:
        _register_node(type(tree))


def _register_node(cls: type) -> None:
    if cls in _NODES:
        return

    def flatten(value: Any) -> tuple[list[Any], _Template]:
        return list(_parser(value).yieldTensors(value)), _Template(value)

    def unflatten(values: Any, context: _Template) -> Any:
        return _parser(context.original).reconstruct(context.original, iter(list(values)))

    pytree.register_pytree_node(cls, flatten, unflatten)
    _NODES.add(cls)


def _parser(value: Any) -> ICustomArgParser:
    parser = parser_for(value)
    assert parser is not None, f"{type(value).__name__} was registered with a parser"
    return parser
