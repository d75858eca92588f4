"""Run Graphcore's PopXL, popxl.addons and PopTorch programs unchanged.

``install()`` puts an import hook first on ``sys.meta_path`` that makes ``popxl``,
``popxl_addons``, ``poptorch``, ``popdist`` and ``popart`` (and their submodules, module
by module) resolve
to ipuxl's modules: the alias *is* ipuxl's module object, so ``popxl.ops is
ipuxl.ops`` and ``import popxl_addons`` gives ``ipuxl.addons_compat``. Where ipuxl's
module path differs from upstream's, ``ipuxl.compat.table`` says which module
stands for it (``ipuxl.compat.table``). An upstream module ipuxl does not provide raises
``CompatImportError`` (a ``ModuleNotFoundError``) naming it.

From the command line, ``python -m ipuxl.compat PROGRAM.py [args]`` runs a program
as ``__main__`` after ``install()`` (also under ``torchrun ... -m ipuxl.compat``).

Example:
    >>> import ipuxl.compat
    >>> ipuxl.compat.install()
    >>> import popxl, popxl.ops as ops
    >>> popxl.Ir is ipuxl.Ir and ops is ipuxl.ops
    True

``import popdist`` gives ``ipuxl.popdist`` (answers from torchrun's environment) and
``import popart`` the few PopART names programs use (``ipuxl.popart_compat``).

``import poptorch`` gives ``ipuxl.poptorch_compat``, PopTorch's namespace
(``poptorch.Options``, ``poptorch.enums``, ``poptorch.optim``, ``poptorch.logging``...),
apart from PopXL's (``popxl`` is ``ipuxl``).

Differences from upstream: a module's ``__name__`` is ipuxl's
(``popxl.__name__ == "ipuxl"``, ``poptorch.__name__ == "ipuxl.poptorch_compat"``).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import pkgutil
import sys
from types import ModuleType
from typing import NoReturn, Sequence

from ipuxl.compat import table
from ipuxl.errors import CompatImportError

__all__ = ["install", "uninstall", "is_installed", "resolve"]


def resolve(name: str) -> str | None:
    """The ipuxl module standing for upstream module ``name``.

    Returns:
        The ipuxl module's name, or None when ``name`` is not under one of the packages
        of ``ipuxl.compat.table.ROOTS``.

    Raises:
        CompatImportError: upstream has ``name`` but ipuxl does not provide it.
    """
    root = name.partition(".")[0]
    if root not in table.ROOTS:
        return None
    if name == root:
        return table.ROOTS[root]
    for known in table.TABLES:
        if name in known:
            return known[name] or _raise_missing(name, _MISSING_DETAIL.get(name))
    prefix, _, last = name.rpartition(".")
    if prefix == "popxl.ops" and last in table.OP_FILES:
        return _op_module(name, table.OP_FILES[last])
    if root in table.LISTED_ONLY:
        _raise_missing(name, upstream_has=False)
    return table.ROOTS[root] + name[len(root):]


def _in_tables(name: str) -> bool:
    return name in table.ROOTS or any(name in t for t in table.TABLES)


def _op_module(name: str, op: str) -> str:
    ops = importlib.import_module("ipuxl.ops")
    function = getattr(ops, op, None)
    if function is None:
        _raise_missing(name, f"ipuxl.ops has no '{op}'")
    return function.__module__


def _raise_missing(name: str, detail: str | None = None, upstream_has: bool = True) -> NoReturn:
    what = (f"'{name}' is part of {_package(name)} but ipuxl does not provide it" if upstream_has
            else f"No module named '{name}': ipuxl.compat maps only {_package(name)}'s modules it provides")
    error = CompatImportError(what + (f" ({detail})" if detail else ""), where=_importer_line(),
                              fix="use the ipuxl modules that exist (see ipuxl.compat.table), or remove the import")
    error.name = name  # as Python's own ModuleNotFoundError: the module that is missing
    raise error


def _package(name: str) -> str:
    return table.PACKAGE_NAMES[name.partition(".")[0]]


_INTERNAL_IR = "it is PopART's C++ IR, which only PopART itself can provide"
#: why an upstream module is missing, where there is more to say than "not provided"
_MISSING_DETAIL = {"popart._internal": _INTERNAL_IR, "popart._internal.ir": _INTERNAL_IR}


def _importer_line() -> str | None:
    """``file:line`` of the innermost frame outside ipuxl and the import machinery."""
    skipped = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(importlib.__file__))
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith("<frozen") and not os.path.abspath(filename).startswith(skipped):
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads upstream module path ``alias`` as the ipuxl module ``target``."""

    def __init__(self, alias: str, target: str):
        self.alias, self.target = alias, target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system has set the module's ``__spec__`` to the alias's: give ipuxl's back.
        module.__spec__ = self.own_spec
        _register_renamed_children(self.alias)


def _resolve_quiet(name: str) -> str | None:
    try:
        return resolve(name)
    except CompatImportError:
        return None


def _register_renamed_children(parent: str) -> None:
    """Put the aliases under ``parent`` that loading would rebind onto ipuxl's module in ``sys.modules``.

    Python sets a loaded submodule as an attribute of its parent, and the parent of an
    alias *is* an ipuxl module: loading ``popxl.ops.call`` (``from popxl.ops.call import
    CallSiteInfo``) would replace the op ``ipuxl.ops.call`` by the module, and loading
    ``popxl.ops.gelu`` would bind a module where ipuxl has the op. An alias already in
    ``sys.modules`` is never loaded, so its parent keeps its attributes. Registered: every
    child whose ipuxl module has another name, and every child whose name the parent
    already binds to something else (an op, a function).
    """
    parent_module = sys.modules[parent]
    real_parent = parent_module.__name__
    for child in _children(parent, parent_module):
        target, last = _resolve_quiet(child), child.rpartition(".")[2]
        if target is None or child in sys.modules:
            continue
        bound = vars(parent_module).get(last)
        if target == f"{real_parent}.{last}" and (bound is None or bound is sys.modules.get(target)):
            continue  # loading it binds what ``import <target>`` binds
        if importlib.util.find_spec(target) is not None:
            sys.modules[child] = module = importlib.import_module(target)
            if last not in vars(parent_module):  # ``popxl.context`` reads as upstream's
                setattr(parent_module, last, module)
                _ATTRIBUTES_SET.append((parent_module, last))


def _children(parent: str, parent_module: ModuleType) -> list[str]:
    """Upstream module paths directly under ``parent``: from the tables, PopXL's op files, ipuxl's submodules."""
    children = [n for known in table.TABLES for n in known if n.rpartition(".")[0] == parent]
    if parent == "popxl.ops":
        children += [f"popxl.ops.{f}" for f in table.OP_FILES]
    search = getattr(parent_module, "__path__", None)
    if search is not None:
        children += [f"{parent}.{info.name}" for info in pkgutil.iter_modules(search)]
    return list(dict.fromkeys(children))


#: (module, name) of the submodule attributes set for renamed children, removed by ``uninstall``
_ATTRIBUTES_SET: list[tuple[ModuleType, str]] = []


class CompatFinder(importlib.abc.MetaPathFinder):
    """Finds ``popxl``, ``popxl_addons``, ``poptorch``, ``popdist`` and ``popart`` modules as ipuxl's."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        ipuxl_name = resolve(fullname)
        if ipuxl_name is None:
            return None
        real = importlib.util.find_spec(ipuxl_name)
        if real is None:
            _raise_missing(fullname, f"no module '{ipuxl_name}'", upstream_has=_in_tables(fullname))
        is_package = real.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname, ipuxl_name), is_package=is_package)


_FINDER = CompatFinder()


def is_installed() -> bool:
    """Whether ``install()`` is in effect."""
    return _FINDER in sys.meta_path


def install() -> None:
    """Make ``popxl``, ``popxl_addons``, ``poptorch``, ``popdist`` and ``popart`` import ipuxl's modules.

    Idempotent. Raises:
        CompatImportError: one of those packages is already imported (the real one,
            or another alias): ipuxl cannot stand in for a module a program holds.
    """
    if is_installed():
        return
    foreign = sorted(n for n in table.ROOTS if n in sys.modules and sys.modules[n].__name__ != table.ROOTS[n])
    if foreign:
        raise CompatImportError(f"{foreign} already imported before ipuxl.compat.install()",
                                where=_importer_line(), fix="call install() before importing them")
    sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Undo ``install()``: remove the hook and every alias it made (``popxl``, ``popxl_addons``...)."""
    if is_installed():
        sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if n.partition(".")[0] in table.ROOTS]:
        del sys.modules[name]
    while _ATTRIBUTES_SET:
        module, attribute = _ATTRIBUTES_SET.pop()
        if attribute in vars(module):
            delattr(module, attribute)
