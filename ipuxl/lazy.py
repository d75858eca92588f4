"""Namespaces whose names load on first use (PEP 562), for the facades ``ipuxl`` and
``ipuxl.poptorch_compat``: importing them stays cheap and loads nothing above them.

    __getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY)

with ``_LAZY`` mapping each name to ``(module, attribute)`` (attribute None: the module).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["lazy_names"]


def lazy_names(owner: str, namespace: dict[str, Any], table: dict[str, tuple[str, str | None]],
               what: str | None = None) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``owner`` serving ``table``;
    a loaded name is stored in ``namespace`` (the module's globals), so it loads once."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module '{owner}'{f' ({what})' if what else ''} has no attribute '{name}'")
        module_name, attribute = table[name]
        module = importlib.import_module(module_name)
        value = module if attribute is None else getattr(module, attribute)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
