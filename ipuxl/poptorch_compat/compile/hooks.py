"""PopTorch's compile hooks: ``registerPreCompileHook`` and ``registerPostCompileHook``.

A hook is a callable taking no arguments (as upstream). Every compile of every
``PoplarExecutor`` (the first call, ``compile``, ``compileAndExport``,
``loadExecutable`` and ipuxl's recompiles after a change of input shape or optimiser
structure) runs the pre-compile hooks before capturing the module and the
post-compile hooks after building the program, also when the build failed
(upstream runs them in a ``finally`` too).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch.utils.hooks

from ipuxl.errors import ExecutorError
from ipuxl.ir.context import user_source_line

__all__ = ["registerPreCompileHook", "registerPostCompileHook", "run_pre_compile_hooks", "run_post_compile_hooks"]

_PRE: "OrderedDict[int, Callable[[], object]]" = OrderedDict()
_POST: "OrderedDict[int, Callable[[], object]]" = OrderedDict()


def _register(hooks: "OrderedDict[int, Callable[[], object]]", hook: Callable[[], object],
              kind: str) -> torch.utils.hooks.RemovableHandle:
    if not callable(hook):
        raise ExecutorError(f"{kind} hook must be callable, got {type(hook).__name__}", where=user_source_line(),
                            fix="pass a function taking no arguments")
    handle = torch.utils.hooks.RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def registerPreCompileHook(hook: Callable[[], object]) -> torch.utils.hooks.RemovableHandle:  # noqa: N802
    """Call ``hook()`` before each model compilation starts (PopTorch's function).

    Returns:
        a handle whose ``remove()`` unregisters the hook.

    Raises:
        ExecutorError: ``hook`` is not callable (a ``RuntimeError``, as upstream).
    """
    return _register(_PRE, hook, "Pre-compile")


def registerPostCompileHook(hook: Callable[[], object]) -> torch.utils.hooks.RemovableHandle:  # noqa: N802
    """Call ``hook()`` after each model compilation ends (PopTorch's function).

    Returns:
        a handle whose ``remove()`` unregisters the hook.

    Raises:
        ExecutorError: ``hook`` is not callable (a ``RuntimeError``, as upstream).
    """
    return _register(_POST, hook, "Post-compile")


def run_pre_compile_hooks() -> None:
    """Run the registered pre-compile hooks, in registration order."""
    for hook in list(_PRE.values()):
        hook()


def run_post_compile_hooks() -> None:
    """Run the registered post-compile hooks, in registration order."""
    for hook in list(_POST.values()):
        hook()
