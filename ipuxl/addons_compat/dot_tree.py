"""``DotTree``: a tree of named values addressed with dotted keys (popxl.addons' container).

Reproduces upstream's behaviour: ``insert("fc1.weight", v)`` builds nested trees (a
second ``insert("fc1.bias", v)`` raises, as upstream's: ``fc1`` exists; pass
``overwrite=True`` to merge, or build with ``from_dict``),
``to_dict`` flattens them back to dotted keys, numeric keys are allowed, ``unpack``
sorts by key, and ``NamedVariableFactories.init`` relies on sorted key order.
Differs from upstream in one guardrail: ``to_mapping`` between trees that share no
key raises instead of returning an empty dict (an empty mapping is always a bug).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Generic, Iterable, TypeVar

from ipuxl.errors import InvalidArgumentError, InvalidValueError, NameConflictError

__all__ = ["DotTree", "to_mapping", "sanitise", "clear_leaves"]

L = TypeVar("L")
V = TypeVar("V")
CLS = TypeVar("CLS", bound="DotTree")


def sanitise(name: str) -> str:
    """Replace characters that cannot appear in a Python identifier."""
    return re.sub(r"\W|^(?=\d)", "_", name)


def to_mapping(keys: "DotTree[Any]", values: "DotTree[V]") -> dict[Any, V]:
    """For the dotted keys both trees have, map ``keys``' leaf to ``values``' leaf.

    Raises:
        InvalidArgumentError: the trees have no key in common.
    """
    key_dict, value_dict = keys.to_dict(), values.to_dict()
    common = [k for k in key_dict if k in value_dict]
    if key_dict and value_dict and not common:
        raise InvalidArgumentError(
            f"to_mapping: the trees have no key in common (first has {sorted(key_dict)[:5]}, "
            f"second has {sorted(value_dict)[:5]})",
            fix="map trees built from the same module, or rename keys with DotTree.from_dict")
    return {key_dict[k]: value_dict[k] for k in common}


class DotTree(Generic[L]):
    """A tree of values; children and leaves are reachable as attributes or items.

    Example:
        >>> tree = DotTree.from_dict({"fc1.weight": 1, "fc1.bias": 2})
        >>> tree.fc1.bias, tree.to_dict()
        (2, {'fc1.weight': 1, 'fc1.bias': 2})
    """

    def __init__(self, **kwargs: Any):
        self._map: dict[str, Any] = {}
        for key, value in kwargs.items():
            self.insert(key, value)

    # -- access -------------------------------------------------------------------
    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        try:
            return self.get(key)
        except KeyError:
            raise AttributeError(f"no key '{key}'; available keys: {list(self._map)}") from None

    def __getitem__(self, key: str | int) -> Any:
        return self.get(key)

    def __contains__(self, key: str) -> bool:
        try:
            self.get(key)
        except KeyError:
            return False
        return True

    def get(self, key: str | int) -> Any:
        """The value or subtree at ``key`` (a dotted path, an int, or a negative int from the end)."""
        if isinstance(key, int) or key.isnumeric():
            index = int(key)
            if index < 0:
                numeric = [int(k) for k in self._map if k.isnumeric()]
                index = (max(numeric) + 1 + index) if numeric else index
            key = str(index)
        head, _, rest = key.partition(".")
        if head not in self._map:
            raise KeyError(f"key '{key}' does not exist; available keys: {list(self._map)}")
        value = self._map[head]
        return value.get(rest) if rest else value

    # -- building -------------------------------------------------------------------
    def insert(self, key: str | int, value: Any, overwrite: bool = False) -> None:
        """Set ``key``; dots make nested trees. As upstream, the first part of a dotted key
        must be new too: ``insert("a.c", v)`` when ``a`` exists raises unless ``overwrite``,
        which merges into the existing subtree (replacing a leaf on the way).

        Raises:
            InvalidValueError: (a ValueError) a negative int key, or a part of the key that is
                neither a Python identifier nor a number.
            NameConflictError: (a ValueError) the key's first part exists and not ``overwrite``.
        """
        if isinstance(key, int):
            if key < 0:
                raise InvalidValueError(f"{type(self).__name__}.insert: numeric key cannot be negative: {key}",
                                        fix="use a key >= 0 (a negative key only reads from the end, in get)")
            key = str(key)
        head, _, rest = key.partition(".")
        self._validate_key(head, overwrite)
        if not rest:
            self._map[head] = value
            return
        existing = self._map.get(head)
        nested = existing.copy() if isinstance(existing, type(self)) else type(self)()
        nested.insert(rest, value, overwrite)  # on failure nothing of ours has changed
        if isinstance(existing, DotTree):
            existing._map.update(nested._map)  # keep the subtree object: others may hold it
        else:
            self._map[head] = nested

    def update(self, values: "DotTree[L]", overwrite: bool = False) -> None:
        """Insert every entry of ``values``."""
        for key, value in values.copy()._map.items():
            self.insert(key, value, overwrite)

    def pop(self, key: str) -> Any:
        return self._map.pop(key)

    def copy(self: CLS) -> CLS:
        """A copy of the tree structure (leaves are shared)."""
        tree = type(self)()
        for key, value in self._map.items():
            tree._map[key] = value.copy() if isinstance(value, DotTree) else value
        return tree

    def _validate_key(self, key: str, overwrite: bool) -> None:
        if not overwrite and key in self._map:
            raise NameConflictError(f"'{key}' already exists in this {type(self).__name__}",
                                    fix="use another name, or pass overwrite=True to replace or merge into it")
        if not key.isnumeric() and not key.isidentifier():
            raise InvalidValueError(f"'{key}' is not a valid Python identifier or number",
                                    fix=f"use e.g. '{sanitise(key)}'")

    # -- views ----------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._map)

    def keys_flat(self) -> list[str]:
        return list(self.to_dict())

    def values(self) -> list[Any]:
        return list(self._map.values())

    def values_flat(self) -> list[L]:
        return list(self.to_dict().values())

    def len(self) -> int:
        return len(self._map)

    def len_flat(self) -> int:
        return len(self.to_dict())

    def to_dict(self) -> dict[str, L]:
        """Flatten to ``{dotted key: leaf}`` in insertion order."""
        flat: dict[str, L] = {}
        for key, value in self._map.items():
            if isinstance(value, DotTree):
                flat.update({f"{key}.{name}": v for name, v in value.to_dict().items()})
            else:
                flat[key] = value
        return flat

    @classmethod
    def from_dict(cls: type[CLS], d: dict[Any, Any]) -> CLS:
        """Build a tree from ``{dotted key: leaf}``: keys sharing a first part share a subtree.

        Raises:
            NameConflictError: a key is given twice, or names a leaf and a subtree.
        """
        tree = cls()
        for key, value in d.items():
            *path, last = str(key).split(".")
            node: DotTree[Any] = tree
            for part in path:
                child = node._map.get(part)
                if not isinstance(child, DotTree):
                    child = cls()
                    node.insert(part, child)
                node = child
            node.insert(last, value)
        return tree

    def filter_keys(self: CLS, keys: Iterable[str | int]) -> CLS:
        """A tree of only ``keys`` (each a dotted path to a leaf or a subtree); leaves are shared."""
        kept: dict[str, Any] = {}
        for key in map(str, keys):
            value = self.get(key)
            if isinstance(value, DotTree):
                kept.update({f"{key}.{name}": leaf for name, leaf in value.to_dict().items()})
            else:
                kept[key] = value
        return self.from_dict(kept)

    def _clear(self) -> None:
        """Remove every leaf, keeping the subtree objects (upstream's ``_clear``)."""
        clear_leaves(self)

    def to_mapping(self, values: "DotTree[V]") -> dict[L, V]:
        """``{self leaf: values leaf}`` for common keys (see :func:`to_mapping`)."""
        return to_mapping(self, values)

    def unpack(self) -> tuple[list[str], list[L]]:
        """Keys and leaves, sorted by key."""
        items = sorted(self.to_dict().items(), key=lambda kv: kv[0])
        return [k for k, _ in items], [v for _, v in items]

    @classmethod
    def pack(cls: type[CLS], keys: Iterable[Any], values: Iterable[Any]) -> CLS:
        """The inverse of ``unpack``: a tree from parallel lists of keys and leaves."""
        return cls.from_dict(dict(zip(keys, values)))

    def map(self: CLS, fn: Callable[[L], Any]) -> CLS:
        """A tree with ``fn`` applied to every leaf."""
        return self.from_dict({k: fn(v) for k, v in self.to_dict().items()})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_dict()})"


def clear_leaves(tree: DotTree[Any]) -> None:
    """Remove every leaf of ``tree``, keeping its subtree objects (others may hold them:
    a module's submodules share their trees with it)."""
    for key, value in list(tree._map.items()):
        if isinstance(value, DotTree):
            clear_leaves(value)
        else:
            tree._map.pop(key)
