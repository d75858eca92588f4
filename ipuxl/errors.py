"""One exception family for everything ipuxl reports to users.

Every error says *what* is wrong (expected vs got), *where* (graph, tensor, stream,
op and the user's source line when known) and *how to fix it*. Each class also
subclasses the built-in exception that eager PyTorch or Python would raise for the
same mistake, so existing ``except ValueError`` handlers keep working.
"""
from __future__ import annotations

__all__ = [
    "IpuxlError",
    "CaptureError",
    "GraphContextError",
    "ShapeMismatchError",
    "InvalidArgumentError",
    "NameConflictError",
    "TraceError",
    "OpArgumentError",
    "OpContextError",
    "PassError",
    "AutodiffError",
    "OutlineError",
    "InplaceOrderError",
    "DeviceError",
    "StreamInputError",
    "DetachedError",
    "BatchSizeError",
    "DataError",
    "DataFileError",
    "OptionsError",
    "FrozenOptionsError",
    "AlreadyWrappedError",
    "ReplicationError",
    "ReplicaFailureError",
    "OutOfMemoryError",
    "PatternNotAppliedError",
    "CompatImportError",
    "CheckpointError",
    "DtypeError",
    "UndefinedValue",
    "CallInputError",
    "InvalidValueError",
    "UnknownKeyError",
    "PopdistError",
    "WrongGraphError",
    "CallIndexError",
    "UnsupportedError",
    "PoptorchError",
    "Error",
    "RecoverableError",
    "UnrecoverableError",
    "NoIpuHardwareError",
    "ConfigFileError",
    "InferenceOptionsError",
    "ExecutorError",
    "OfflineDeviceError",
    "AnchorError",
    "PlacementError",
    "builtin_type",
    "with_builtin",
    "PopartException",
    "ApplicationRuntimeError",
]


class IpuxlError(Exception):
    """Base class of every error raised by ipuxl."""

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None):
        self.what, self.where, self.fix = what, where, fix
        parts = [what]
        if where:
            parts.append(f"  where: {where}")
        if fix:
            parts.append(f"  fix: {fix}")
        super().__init__("\n".join(parts))


# -- PopTorch's error classes (poptorch.Error and its two subclasses) --------------
class PoptorchError(IpuxlError):
    """PopTorch's ``poptorch.Error``: an error in compiling or running a PopTorch model
    (upstream's C++ backend errors). ``except poptorch.Error`` catches ipuxl's capture
    (``TraceError``) and device (``DeviceError``) errors, as it catches PopTorch's.

    Attributes (upstream's, all strings):
        type: the part of the stack and category that raised it.
        message: the error message without its context.
        location: where it was raised (the user's source line when known, else "").
    """

    type: str = "poptorch_py_error"

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None):
        super().__init__(what, where=where, fix=fix)
        self.message, self.location = what, where or ""


#: PopTorch's name for :class:`PoptorchError` (``poptorch.Error``)
Error = PoptorchError


class RecoverableError(PoptorchError):
    """PopTorch's ``poptorch.RecoverableError``: a transient device failure; its
    ``recovery_action`` is ``"IPU_RESET"``, ``"PARTITION_RESET"`` or ``"FULL_RESET"``.
    The simulated device never raises it (no hardware to reset)."""

    type = "poplar_recoverable_runtime_error"
    RECOVERY_ACTIONS = ("IPU_RESET", "PARTITION_RESET", "FULL_RESET")

    def __init__(self, what: str, *, recovery_action: str, where: str | None = None, fix: str | None = None):
        if recovery_action not in self.RECOVERY_ACTIONS:
            raise InvalidValueError(f"RecoverableError: recovery_action must be one of {self.RECOVERY_ACTIONS}, "
                                    f"got {recovery_action!r}", fix="pass one of those strings")
        super().__init__(what, where=where, fix=fix)
        self.recovery_action = recovery_action


class UnrecoverableError(PoptorchError):
    """PopTorch's ``poptorch.UnrecoverableError``: a device failure that persists (take
    the machine out of service). The simulated device never raises it."""

    type = "poplar_unrecoverable_runtime_error"


class NoIpuHardwareError(IpuxlError, AssertionError):
    """``poptorch.ipuHardwareVersion()`` without IPU hardware (PopTorch fails an assert,
    an AssertionError): ipuxl's device is always simulated."""


# -- capture: building graphs ---------------------------------------------------
class PopartException(IpuxlError):
    """PopART's ``popart.popart_exception``: the errors PopART's C++ layer raises under PopXL
    (shape inference of an op, a call's inputs against the called graph's, autodiff of a
    graph that modifies its inputs). The ipuxl errors raised for the same mistakes are
    also instances of it, so ``except popart.popart_exception`` handlers keep working."""


class CaptureError(IpuxlError):
    """A graph could not be built as written."""


class GraphContextError(CaptureError, RuntimeError):
    """An op was built outside any graph, or with a tensor of another graph."""


class WrongGraphError(GraphContextError, ValueError):
    """A tensor is used in a graph it does not belong to, or a variable is created outside
    the main graph (PopXL raises a ValueError; as a ``GraphContextError`` this is also a
    RuntimeError)."""


class ShapeMismatchError(CaptureError, PopartException, ValueError):
    """An op's inputs have incompatible shapes or dtypes (found at build time)."""


class InvalidArgumentError(CaptureError, TypeError):
    """An argument has a type that the API cannot accept."""


class PlacementError(CaptureError, ValueError):
    """An op reads a tensor that lives on another IPU without an ``ipu_copy`` (PopART
    refuses such a program), or an IPU id is not valid."""


class InvalidValueError(CaptureError, ValueError):
    """An argument has an accepted type but a value the API cannot take."""


class UnknownKeyError(CaptureError, KeyError):
    """A name looked up in a fixed table (a level, a mode) is not in it (a KeyError, as a
    dict lookup raises upstream)."""

    __str__ = Exception.__str__  # the message as written, not KeyError's repr of it


class NameConflictError(CaptureError, ValueError):
    """A name is used twice where names must be unique (variable inputs, tree keys)."""


class CallInputError(CaptureError, ValueError):
    """A subgraph call's inputs do not match the called graph's: too many, missing,
    given twice, or not inputs of that graph (PopXL raises a ValueError)."""


class TraceError(CaptureError, PoptorchError, RuntimeError):
    """An ``nn.Module`` could not be traced into a graph (data-dependent control flow,
    ``.item()``, an op without a tracing rule, a model without a loss...); a
    ``poptorch.Error``, as PopTorch's compile-time errors are."""


class OpArgumentError(TraceError, ValueError, AssertionError):
    """A PopTorch op (``poptorch.for_loop``, ``dynamic_slice``, ``MultiConv``...) was given an
    argument it cannot take. PopTorch raises a ValueError, an AssertionError or a
    ``poptorch.Error`` for these; this is all three (and a ``TraceError``)."""


class OpContextError(TraceError):
    """A PopTorch op was used where it cannot run: ``poptorch.cond`` differentiated in
    training, a ``poptorch.CPU`` op whose inputs carry gradients, a PopART (C++) custom op."""


class CallIndexError(CaptureError, IndexError):
    """An input or output index outside a call site's (``CallSiteInfo`` index maps)."""


class UnsupportedError(IpuxlError, NotImplementedError):
    """A feature or option that PopXL, or ipuxl, does not have here (float8 options, a
    collective over a grouping without one stride); a NotImplementedError, so also the
    RuntimeError PopXL raises in some of these cases."""


class DtypeError(IpuxlError, ValueError):
    """Nothing names the dtype asked for (``dtype.as_dtype``, ``dtype.from_name``: PopXL
    raises a ValueError)."""


class UndefinedValue(IpuxlError):
    """A tensor's value was read where it has none (PopXL's ``popxl.errors.UndefinedValue``):
    ``Tensor`` handles of a graph being built hold no data."""


# -- passes -----------------------------------------------------------------------
class PassError(IpuxlError):
    """A graph transformation could not be applied."""


class AutodiffError(PassError, ValueError):
    """``transforms.autodiff`` was asked for something it cannot produce."""


class OutlineError(PassError, ValueError):
    """Graphs asked to share one outlined graph are not identical (the message says where)."""


class InplaceOrderError(PassError, RuntimeError):
    """A read of a tensor and an in-place write of its storage have no data path between
    them, so their order is only program order (PopXL's scheduler may run them either way)."""


# -- device -----------------------------------------------------------------------
class DeviceError(PoptorchError, RuntimeError):
    """The simulated device could not run the program (a ``poptorch.Error``, as PopTorch's
    Poplar runtime errors are).

    A failure inside the device program (``Session.run``) also carries where it
    happened; the other raisers leave these ``None``:

    Attributes:
        steps_applied: main-program runs (steps) of the failed ``run`` that completed
            and were kept (with replicas: the fewest over this process's replicas).
        step: the 1-based step that failed.
        failed_op: the op that raised (its PopXL or aten name), when found.
        source: the user's ``file:line in function`` that built that op, when known.
    """

    type = "poplar_runtime_error"

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None,
                 steps_applied: int | None = None, step: int | None = None, failed_op: str | None = None,
                 source: str | None = None):
        super().__init__(what, where=where, fix=fix)
        self.steps_applied, self.step, self.failed_op, self.source = steps_applied, step, failed_op, source


class ApplicationRuntimeError(DeviceError):
    """The device program stopped itself on a value it computed (Poplar's
    ``application_runtime_error``, ``popart.poplar_application_runtime_error``): a
    floating-point exception (``enableFloatingPointChecks``), a float8 scale out of range
    (``throwIfLog2ScaleTensorNotInRange``)."""

    type = "poplar_application_runtime_error"


class StreamInputError(DeviceError, ValueError):
    """Host data given to ``Session.run`` does not match its streams."""


class DetachedError(DeviceError, ValueError):
    """The session was used while not attached to its device."""


class OfflineDeviceError(DetachedError, AssertionError):
    """A model compiled for an offline device (``ConnectionType.Never``) was run or
    attached (PopTorch fails an assertion there)."""


class ExecutorError(PoptorchError, RuntimeError):
    """A ``PoplarExecutor`` method or PopTorch function was used where it cannot work: the
    model is not compiled, a file is not an ipuxl executable, a hook is not callable
    (PopTorch raises ``poptorch.Error`` or a ``RuntimeError`` there)."""


class AnchorError(ExecutorError, AssertionError):
    """An anchored tensor (``Options.anchorTensor``) names no tensor of the program, or
    ``getAnchoredTensor`` asks for a name not anchored or not yet returned (PopTorch
    asserts there: an AssertionError)."""


class BatchSizeError(StreamInputError):
    """A PopTorch-style batch does not split into micro-batches x device iterations
    x gradient accumulation x replicas."""


class ReplicaFailureError(DeviceError):
    """A replica (a thread in this process or another torch.distributed process)
    failed or stopped answering, so the collective every replica waits in cannot finish."""


class PatternNotAppliedError(DeviceError, PopartException):
    """The program holds an op PopART can only lower after a pattern rewrote it (a
    tensor-parallel all-reduce whose inputs are identical must first become an identity):
    PopART raises ``popart.popart_exception`` there."""


class OutOfMemoryError(DeviceError, MemoryError):
    """The program does not fit in the memory of one IPU (``"ipu_model"`` device): the
    message has the breakdown (variables, code, peak activations, stream buffers)."""

    type = "poplar_graph_memory_allocation_error"


# -- replication ------------------------------------------------------------------
class ReplicationError(IpuxlError, ValueError):
    """A replica count does not fit the replication factor: replicated host data, a
    replica grouping, a torchrun world size or a batch that does not split over replicas."""


# -- options ------------------------------------------------------------------------
class OptionsError(IpuxlError, ValueError, AssertionError):
    """A PopTorch-style ``Options`` value is invalid (PopTorch raises a ValueError for some
    setters and fails an assert, an AssertionError, for others: this is both)."""


class InferenceOptionsError(OptionsError, PoptorchError):
    """Options an inference model cannot run with (``Training.gradientAccumulation`` other
    than 1): PopTorch raises ``poptorch.Error`` there; this is also an ``OptionsError``."""


class ConfigFileError(OptionsError):
    """``Options.loadFromFile``: a line of the options file is not valid Python
    (PopTorch's ``poptorch.ConfigFileError``)."""


class FrozenOptionsError(OptionsError, AttributeError):
    """``Options`` were changed after a model had been compiled with them."""


# -- PopTorch wrappers --------------------------------------------------------------
class AlreadyWrappedError(IpuxlError, RuntimeError):
    """``trainingModel`` of a module that a live training model already wraps (PopTorch
    raises a RuntimeError too): ``destroy()`` the existing wrapper first."""


# -- running Graphcore programs unchanged (ipuxl.compat) ---------------------------
class PopdistError(IpuxlError, RuntimeError):
    """A popdist call that needs a multi-instance launch (torchrun) was made without one."""


class CheckpointError(IpuxlError, ValueError):
    """A checkpoint's variable names do not match the model's (popxl.addons' ``TaskSession``
    with ``report_missing="error"``; upstream raises a ValueError)."""


class CompatImportError(IpuxlError, ModuleNotFoundError):
    """A PopXL, popxl.addons or PopTorch module that ipuxl does not provide was imported
    through ``ipuxl.compat`` (``err.name`` is the upstream module's path)."""


# -- data -------------------------------------------------------------------------
class DataError(IpuxlError, FileNotFoundError):
    """A dataset could not be found where it was looked for."""


class DataFileError(IpuxlError, ValueError):
    """A dataset file was found but cannot be read: corrupt, truncated, or images and
    labels that do not match."""


# -- an ipuxl error that is also the built-in type eager PyTorch raised -------------------
_WITH_BUILTIN: dict[tuple[type[IpuxlError], type[BaseException]], type[IpuxlError]] = {}


def with_builtin(cls: type[IpuxlError], builtin: type[BaseException]) -> type[IpuxlError]:
    """``cls``, or a subclass of it that is also the built-in exception ``builtin``, named
    ``<cls>_<builtin>`` (e.g. ``DeviceError_IndexError``): made once per pair, and pickled
    by that pair, so it unpickles in another process too. ``cls`` itself when it already
    is a ``builtin``, or when ``builtin`` cannot be a second base (``OSError``...).

    Example: ``with_builtin(DeviceError, IndexError)("index 7 out of range")`` is caught
    by ``except IndexError`` and by ``except DeviceError``.
    """
    key = (cls, builtin)
    if key not in _WITH_BUILTIN:
        _WITH_BUILTIN[key] = cls if issubclass(cls, builtin) else _subclass(cls, builtin)
    return _WITH_BUILTIN[key]


def builtin_type(exc: BaseException) -> type[Exception]:
    """The most specific built-in exception class ``exc`` is an instance of (``RuntimeError``
    for torch's ``OutOfMemoryError``...; ``Exception`` when none is more specific)."""
    for base in type(exc).__mro__:
        if base.__module__ == "builtins" and issubclass(base, Exception):
            return base
    return Exception


def _subclass(cls: type[IpuxlError], builtin: type[BaseException]) -> type[IpuxlError]:
    def reduce(error: BaseException) -> tuple:  # the made class has no importable name: rebuild it
        return _rebuild_with_builtin, (cls, builtin, error.args), error.__dict__

    # BaseException.__str__: a built-in's own (KeyError's repr of its key) would hide the message
    namespace = {"__module__": cls.__module__, "__qualname__": f"{cls.__qualname__}_{builtin.__name__}",
                 "__str__": BaseException.__str__, "__reduce__": reduce}
    try:
        return type(f"{cls.__name__}_{builtin.__name__}", (cls, builtin), namespace)
    except TypeError:  # a built-in with its own instance layout: ``cls`` alone
        return cls


def _rebuild_with_builtin(cls: type[IpuxlError], builtin: type[BaseException], args: tuple) -> BaseException:
    """An unpickled ``with_builtin(cls, builtin)`` error (its attributes follow as state)."""
    made = with_builtin(cls, builtin)
    error = made.__new__(made)
    error.args = args
    return error
