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
    "PassError",
    "AutodiffError",
    "OutlineError",
    "InplaceOrderError",
    "DeviceError",
    "StreamInputError",
    "DetachedError",
    "BatchSizeError",
    "DataError",
    "OptionsError",
    "FrozenOptionsError",
    "AlreadyWrappedError",
    "ReplicationError",
    "ReplicaFailureError",
    "OutOfMemoryError",
    "CompatImportError",
    "CheckpointError",
    "DtypeError",
    "UndefinedValue",
    "CallInputError",
    "InvalidValueError",
    "WrongGraphError",
    "CallIndexError",
    "UnsupportedError",
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


# -- capture: building graphs ---------------------------------------------------
class CaptureError(IpuxlError):
    """A graph could not be built as written."""


class GraphContextError(CaptureError, RuntimeError):
    """An op was built outside any graph, or with a tensor of another graph."""


class WrongGraphError(GraphContextError, ValueError):
    """A tensor is used in a graph it does not belong to, or a variable is created outside
    the main graph (PopXL raises a ValueError; as a ``GraphContextError`` this is also a
    RuntimeError)."""


class ShapeMismatchError(CaptureError, ValueError):
    """An op's inputs have incompatible shapes or dtypes (found at build time)."""


class InvalidArgumentError(CaptureError, TypeError):
    """An argument has a type that the API cannot accept."""


class InvalidValueError(CaptureError, ValueError):
    """An argument has an accepted type but a value the API cannot take."""


class NameConflictError(CaptureError, ValueError):
    """A name is used twice where names must be unique (variable inputs, tree keys)."""


class CallInputError(CaptureError, ValueError):
    """A subgraph call's inputs do not match the called graph's: too many, missing,
    given twice, or not inputs of that graph (PopXL raises a ValueError)."""


class TraceError(CaptureError, RuntimeError):
    """An ``nn.Module`` could not be traced into a graph (data-dependent control flow,
    ``.item()``, an op without a tracing rule, a model without a loss...)."""


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
class DeviceError(IpuxlError, RuntimeError):
    """The simulated device could not run the program.

    A failure inside the device program (``Session.run``) also carries where it
    happened; the other raisers leave these ``None``:

    Attributes:
        steps_applied: main-program runs (steps) of the failed ``run`` that completed
            and were kept (with replicas: the fewest over this process's replicas).
        step: the 1-based step that failed.
        failed_op: the op that raised (its PopXL or aten name), when found.
        source: the user's ``file:line in function`` that built that op, when known.
    """

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None,
                 steps_applied: int | None = None, step: int | None = None, failed_op: str | None = None,
                 source: str | None = None):
        super().__init__(what, where=where, fix=fix)
        self.steps_applied, self.step, self.failed_op, self.source = steps_applied, step, failed_op, source


class StreamInputError(DeviceError, ValueError):
    """Host data given to ``Session.run`` does not match its streams."""


class DetachedError(DeviceError):
    """The session was used while not attached to its device."""


class BatchSizeError(StreamInputError):
    """A PopTorch-style batch does not split into micro-batches x device iterations
    x gradient accumulation x replicas."""


class ReplicaFailureError(DeviceError):
    """A replica (a thread in this process or another torch.distributed process)
    failed or stopped answering, so the collective every replica waits in cannot finish."""


class OutOfMemoryError(DeviceError, MemoryError):
    """The program does not fit in the memory of one IPU (``"ipu_model"`` device): the
    message has the breakdown (variables, code, peak activations, stream buffers)."""


# -- replication ------------------------------------------------------------------
class ReplicationError(IpuxlError, ValueError):
    """A replica count does not fit the replication factor: replicated host data, a
    replica grouping, a torchrun world size or a batch that does not split over replicas."""


# -- options ------------------------------------------------------------------------
class OptionsError(IpuxlError, ValueError):
    """A PopTorch-style ``Options`` value is invalid."""


class FrozenOptionsError(OptionsError, AttributeError):
    """``Options`` were changed after a model had been compiled with them."""


# -- PopTorch wrappers --------------------------------------------------------------
class AlreadyWrappedError(IpuxlError, RuntimeError):
    """``trainingModel`` of a module that a live training model already wraps (PopTorch
    raises a RuntimeError too): ``destroy()`` the existing wrapper first."""


# -- running Graphcore programs unchanged (ipuxl.compat) ---------------------------
class CheckpointError(IpuxlError, ValueError):
    """A checkpoint's variable names do not match the model's (popxl.addons' ``TaskSession``
    with ``report_missing="error"``; upstream raises a ValueError)."""


class CompatImportError(IpuxlError, ModuleNotFoundError):
    """A PopXL, popxl.addons or PopTorch module that ipuxl does not provide was imported
    through ``ipuxl.compat`` (``err.name`` is the upstream module's path)."""


# -- data -------------------------------------------------------------------------
class DataError(IpuxlError, FileNotFoundError):
    """A dataset could not be found where it was looked for."""
