"""Host streams: the named channels between the host and the device program."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence, TypeVar

from ipuxl import dtypes
from ipuxl.dtypes import check_supported, dtype_name, from_any
from ipuxl.ir.context import gcg
from ipuxl.ir.tensor import TensorSpec

if TYPE_CHECKING:
    from ipuxl.ir.ir import Ir

__all__ = ["Stream", "HostToDeviceStream", "DeviceToHostStream", "h2d_stream", "d2h_stream"]


class Stream:
    """A named host stream of one IR, carrying tensors of one shape and dtype."""

    def __init__(self, ir: "Ir", spec: TensorSpec, name: str):
        self.ir, self.spec, self.name = ir, spec, name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @property
    def dtype(self) -> "dtypes.dtype":
        """The PopXL dtype (``spec.dtype`` is the torch dtype)."""
        return dtypes.public(self.spec.dtype)

    @property
    def tensor_id(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, shape={self.shape}, dtype={dtype_name(self.dtype)})"


class HostToDeviceStream(Stream):
    """Carries host data into the device program (read by ``ops.host_load``)."""


class DeviceToHostStream(Stream):
    """Carries device tensors to the host (written by ``ops.host_store``)."""


S = TypeVar("S", bound=Stream)


def _new_stream(cls: type[S], shape: Sequence[int], dtype: Any, name: str | None) -> S:
    """A stream of class ``cls`` in the current graph's IR, named uniquely after ``name``."""
    ir = gcg().ir
    stream_name = ir.unique_stream_name(name or cls.__name__.lower())
    subject = f"{'h2d' if cls is HostToDeviceStream else 'd2h'}_stream '{stream_name}'"
    torch_dtype = check_supported(from_any(dtype, subject, host_data=False), subject, host_data=False)
    spec = TensorSpec(tuple(shape), torch_dtype)
    stream = cls(ir, spec, stream_name)
    ir.streams.append(stream)
    return stream


def h2d_stream(shape: Sequence[int], dtype: Any, name: str | None = None) -> HostToDeviceStream:
    """Create a host-to-device stream of ``shape`` and ``dtype`` in the current IR.

    Raises:
        InvalidArgumentError: ``dtype`` is not one ipuxl supports (complex...).
    """
    return _new_stream(HostToDeviceStream, shape, dtype, name)


def d2h_stream(shape: Sequence[int], dtype: Any, name: str | None = None) -> DeviceToHostStream:
    """Create a device-to-host stream of ``shape`` and ``dtype`` in the current IR.

    Raises:
        InvalidArgumentError: ``dtype`` is not one ipuxl supports (complex...).
    """
    return _new_stream(DeviceToHostStream, shape, dtype, name)
