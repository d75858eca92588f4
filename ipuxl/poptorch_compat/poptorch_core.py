"""``poptorch.poptorch_core``: the Python-visible surface of PopTorch's C++ extension.

Upstream, ``poptorch_core`` is the compiled module behind PopTorch; programs and
PopTorch's own tests reach into it for a few names, which ipuxl provides here:

* ``Error``, ``RecoverableError``, ``UnrecoverableError``: the exception classes every
  PopTorch error is (``poptorch.Error`` *is* ``poptorch_core.Error``). On ipuxl they
  are ``ipuxl.errors.PoptorchError`` and its two subclasses, so ``except
  poptorch_core.Error`` catches what ipuxl raises where PopTorch raises one: capture
  errors (``TraceError``), device errors (``DeviceError``), executor errors
  (``ExecutorError``), and the errors of the options parser below.
* ``TestErrorType`` and ``_throwTestError(type)``: upstream's hook to raise each
  category of backend error (PopTorch, PopART, Poplibs, Poplar recoverable /
  unrecoverable / unknown / link errors) through its error translation. ipuxl raises
  the same class, ``type``, ``message``, ``location`` (the nested contexts
  ``throwTestError::topLevel`` and ``throwTestError::bottomLevel``) and
  ``recovery_action``. No real error of those backends can occur on ipuxl.
* ``_validateOptions(options.toDict())``: the backend's check of an options dict
  (``ipuxl.poptorch_compat.session_options``), logging each option it sets.
* ``isCompilingWithDispatcher()``: True while a model is being captured for the
  device (ipuxl always captures through PyTorch's dispatcher).
* ``setLogLevel(level)``: the backend's log level by upstream's integer.
* ``propagateInputShapes(graph)``: shape propagation on a TorchScript graph, which
  PopTorch's tests' helpers call (torch's own pass).
* ``ipuHardwareVersion(numIpus=1)``: as ``poptorch.ipuHardwareVersion`` (raises:
  there is no IPU hardware).
* ``_getPopartIR(model)``: a compiled model's IR dump (``compile.popart_ir``: the ops
  ipuxl runs under PopART's op types; there is no PopART IR).

Everything else in upstream's extension (the PopART compiler, executables, the
dispatcher's internals) has no counterpart: an attribute ipuxl does not provide raises
an AttributeError that names it.
"""
from __future__ import annotations

import enum
from typing import Any

import torch

from ipuxl.capture.mode import active_mode
from ipuxl.errors import InvalidValueError, PoptorchError, RecoverableError, UnrecoverableError
from ipuxl.poptorch_compat.hardware import ipuHardwareVersion as _ipu_hardware_version
from ipuxl.poptorch_compat.poptorch_logging import setLogLevel as _set_log_level
from ipuxl.poptorch_compat.session_options import parse_session_options
from ipuxl.poptorch_compat.poptorch_logging import cpp_logger

__all__ = ["Error", "RecoverableError", "UnrecoverableError", "TestErrorType", "isCompilingWithDispatcher",
           "createPoptorchError",
           "setLogLevel", "propagateInputShapes", "ipuHardwareVersion"]

#: ``poptorch_core.Error`` is ``poptorch.Error``: every PopTorch error
Error = PoptorchError


class TestErrorType(enum.IntEnum):
    """The categories of backend error ``_throwTestError`` raises (upstream's members)."""

    __test__ = False  # not a test class, whatever pytest's collector thinks of the name

    Poptorch = 0
    Popart = 1
    PopartInternal = 2
    Poplibs = 3
    PoplarUnrecoverable = 4
    PoplarUnknown = 5
    PoplarRecoverableFullReset = 6
    PoplarLinkError = 7


# category -> (error class, upstream's ``type``, upstream's message)
_TEST_ERRORS: dict[TestErrorType, tuple[type[PoptorchError], str, str]] = {
    TestErrorType.Poptorch: (PoptorchError, "poptorch_cpp_error", "This is a PopTorch error"),
    TestErrorType.Popart: (PoptorchError, "popart_exception", "This is a Popart error"),
    TestErrorType.PopartInternal: (PoptorchError, "popart_internal_exception", "This is a Popart error"),
    TestErrorType.Poplibs: (PoptorchError, "poplibs_exception", "This is a Poplibs error"),
    TestErrorType.PoplarUnrecoverable: (UnrecoverableError, "poplar_unrecoverable_runtime_error",
                                        "This is not recoverable"),
    TestErrorType.PoplarUnknown: (PoptorchError, "poplar_unknown_runtime_error", "Don't know what happened"),
    TestErrorType.PoplarRecoverableFullReset: (RecoverableError, "poplar_recoverable_runtime_error",
                                               "Reboot needed"),
    TestErrorType.PoplarLinkError: (PoptorchError, "poplar_link_error",
                                    "Link error. Output: Library -lfoo not found\ncheck path"),
}
_TEST_CONTEXTS = ("throwTestError::topLevel", "throwTestError::bottomLevel")


def _throwTestError(error_type: TestErrorType) -> None:  # noqa: N802 - PopTorch's (private) name
    """Raise the error of ``error_type``'s category, as upstream's error translation does
    for a backend error raised inside two nested contexts (see the module docstring).

    Raises:
        PoptorchError: always (``RecoverableError`` / ``UnrecoverableError`` for those
            categories); ``InvalidValueError`` if ``error_type`` is not a ``TestErrorType``.
    """
    try:
        category = TestErrorType(error_type)
    except ValueError:
        raise InvalidValueError(f"_throwTestError: unknown TestErrorType {error_type!r}",
                                fix="pass a member of poptorch_core.TestErrorType") from None
    cls, type_name, message = _TEST_ERRORS[category]
    location = "\n".join(f"  [{depth}] {context}" for depth, context in enumerate(_TEST_CONTEXTS))
    error: PoptorchError
    if cls is RecoverableError:
        error = RecoverableError(message, recovery_action="FULL_RESET", where=location)
    else:
        error = cls(message, where=location)
    error.type = type_name
    raise error


def _validateOptions(options: dict[str, Any]) -> None:  # noqa: N802 - PopTorch's (private) name
    """Check an ``Options.toDict()`` as upstream's backend does, logging each option set
    (``poptorch:cpp`` logger, debug level).

    Raises:
        PoptorchError: an option nobody knows, or a value of a type the parser cannot take.
    """
    for line in parse_session_options(dict(options)):
        cpp_logger.debug(line)


def createPoptorchError(msg: str) -> PoptorchError:  # noqa: N802 - PopTorch's name
    """A ``poptorch.Error`` of type ``poptorch_py_error`` with message ``msg`` (upstream's
    helper for errors raised from Python)."""
    error = PoptorchError(f"'poptorch_py_error': {msg}")
    error.message = msg
    return error


def isCompilingWithDispatcher() -> bool:  # noqa: N802 - PopTorch's name
    """True while ipuxl captures a model for the device (its capture always goes
    through PyTorch's dispatcher), False otherwise."""
    return active_mode() is not None


def setLogLevel(level: int = 2) -> None:  # noqa: N802 - PopTorch's name
    """The backend's log level by upstream's integer (0 TRACE ... 4 ERR, 6 OFF)."""
    _set_log_level(level)


def ipuHardwareVersion(numIpus: int = 1) -> int:  # noqa: N802,N803 - PopTorch's names
    """As ``poptorch.ipuHardwareVersion``: raises, there is no IPU hardware."""
    del numIpus
    return _ipu_hardware_version()


def propagateInputShapes(graph: torch._C.Graph) -> None:  # noqa: N802 - PopTorch's name
    """Propagate the input types set on a TorchScript ``graph`` (``Value.inferTypeFrom``)
    through its nodes, with torch's shape-propagation pass."""
    torch._C._jit_pass_propagate_shapes_on_graph(graph)


def _getPopartIR(executable: Any) -> str:  # noqa: N802 - PopTorch's (private) name
    """The IR dump of a compiled ``PoplarExecutor`` (``PoplarExecutor._debugGetPopartIR``:
    the ops ipuxl runs under PopART's op types; see ``compile.popart_ir``)."""
    return str(executable._debugGetPopartIR())


def __getattr__(name: str) -> Any:
    raise AttributeError(f"module 'poptorch.poptorch_core' has no attribute '{name}': it is part of PopTorch's "
                         "C++ backend (PopART compiler, executables, dispatcher), which ipuxl does not provide")
