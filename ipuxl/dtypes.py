"""PopXL's dtype objects: ``ipuxl.float32``, ``x.dtype``, ``dtype.as_dtype(...)``.

Each ``ipuxl.dtypes.dtype`` instance stands for one torch dtype and compares and
hashes equal to it (``ipuxl.float32 == torch.float32``), so user code and ipuxl's
internals may mix the two. Graphs keep torch dtypes (``TensorSpec.dtype``,
``node.meta["val"]``); the public surface (``Tensor.dtype``, ``Stream.dtype``, the
module-level names) shows these objects, and every function taking a dtype
accepts a PopXL dtype, a torch dtype, a numpy dtype or a name (``from_any``).

As PopXL: ``half``/``float``/``double`` alias ``float16``/``float32``/``float64``;
``uint64`` and the complex types exist as dtypes but no tensor can have them
(``check_supported``). PopXL's float8 types are torch's "fnuz" float8 types, which are the
same formats bit for bit (Graphcore's proposal: ``float8_143`` 1 sign, 4 exponent, 3 mantissa
bits, bias 8; ``float8_152`` 1/5/2, bias 16; subnormals, no infinities, one NaN, 0x80, and no
negative zero): ``float8_143`` is ``torch.float8_e4m3fnuz`` and ``float8_152`` is
``torch.float8_e5m2fnuz``. As in PopXL their host data are numpy arrays of the structured
dtypes ``np_dtype_float8_143``/``np_dtype_float8_152`` (one ``u1`` field: the bits), and
``ipuxl.fp8_utils`` converts them from and to floats (``as_torch()`` gives the fnuz type; PopXL's
raises). ``uint16`` tensors hold packed data (popxl.addons' group-quantised weights): torch
has no arithmetic on them, so the ops that read them convert first. ipuxl adds ``bfloat16``
(torch's) and ``dtype.itemsize``.
"""
from __future__ import annotations

import builtins
from typing import Any, NoReturn

import numpy as np
import torch

from ipuxl.errors import DtypeError, InvalidArgumentError, UnsupportedError
from ipuxl.source import user_source_line

__all__ = [
    "dtype", "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "half", "float16",
    "bfloat16", "float", "float32", "double", "float64", "complex64", "complex128",
    "to_numpy_dtype", "from_any", "public", "dtype_name", "SUPPORTED", "check_supported", "DTypeLike",
    "DOWNCAST", "float8_options", "float8_143", "float8_152", "np_dtype_float8_143", "np_dtype_float8_152",
    "FLOAT8", "is_float8"]

_BY_NAME: dict[str, "dtype"] = {}
_BY_TORCH: dict[torch.dtype, "dtype"] = {}
_BY_NUMPY: dict[np.dtype, "dtype"] = {}
_BY_PYTHON: dict[type, "dtype"] = {}


class dtype:  # noqa: N801 - PopXL's public name
    """The type of a tensor's elements (PopXL's ``popxl.dtype``).

    Instances are the module's names (``ipuxl.float32``...); the class cannot be
    instantiated. Each equals, and hashes like, the torch dtype it stands for.

    Example:
        >>> ipuxl.float32.as_numpy()
        dtype('float32')
        >>> ipuxl.dtype.as_dtype("float16") is ipuxl.half
        True
    """

    __slots__ = ("_name", "_torch", "_numpy", "_is_complex", "_is_int", "_is_floating_point", "_is_signed")
    _name: str
    _torch: torch.dtype
    _numpy: np.dtype | None
    _is_complex: builtins.bool
    _is_int: builtins.bool
    _is_floating_point: builtins.bool
    _is_signed: builtins.bool

    def __init__(self) -> None:
        raise TypeError("cannot create ipuxl.dtypes.dtype instances: use one of the module's dtypes "
                        "(ipuxl.float32...) or ipuxl.dtype.as_dtype(value)")

    @classmethod
    def _define(cls, name: str, torch_dtype: torch.dtype, numpy_dtype: Any, python_type: type | None = None) -> "dtype":
        self = object.__new__(cls)
        self._name, self._torch = name, torch_dtype
        self._numpy = np.dtype(numpy_dtype) if numpy_dtype is not None else None
        self._is_complex = torch_dtype.is_complex
        self._is_floating_point = torch_dtype.is_floating_point
        self._is_int = not (self._is_complex or self._is_floating_point or torch_dtype == torch.bool)
        self._is_signed = torch_dtype.is_signed
        _BY_NAME[name] = _BY_TORCH[torch_dtype] = self
        if self._numpy is not None:
            _BY_NUMPY[self._numpy] = self
        if python_type is not None:
            _BY_PYTHON[python_type] = self
        return self

    # -- PopXL's attributes ---------------------------------------------------------
    @property
    def name(self) -> str:
        """PopXL's name: ``"float32"``."""
        return self._name

    @property
    def is_complex(self) -> builtins.bool:
        return self._is_complex

    @property
    def is_int(self) -> builtins.bool:
        """True for signed and unsigned integers (not ``bool``)."""
        return self._is_int

    @property
    def is_floating_point(self) -> builtins.bool:
        return self._is_floating_point

    @property
    def is_signed(self) -> builtins.bool:
        return self._is_signed

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self._torch.itemsize

    # -- conversions ------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str) -> "dtype":
        """The dtype called ``name`` (``"float32"``; aliases such as ``"half"`` too).

        Raises:
            ValueError: no dtype has that name.
        """
        found = _BY_NAME.get(name) if isinstance(name, str) else None
        if found is None:
            raise _value_error(f"there is no ipuxl dtype named {name!r}")
        return found

    @classmethod
    def as_dtype(cls, type_value: Any) -> "dtype":
        """Convert ``type_value`` to a PopXL dtype.

        Args:
            type_value: a dtype, ``torch.dtype``, numpy dtype (or anything ``np.dtype``
                accepts), a name, ``builtins.bool``/``float``/``int``, or an array or
                tensor (its dtype).

        Raises:
            ValueError: nothing corresponds to ``type_value``.
        """
        found = _lookup(type_value)
        if found is None and hasattr(type_value, "dtype") and not isinstance(type_value, type):
            found = _lookup(type_value.dtype)
        if found is None:
            raise _value_error(f"there is no ipuxl dtype for {type_value!r} (of type {type(type_value).__name__})")
        return found

    def as_numpy(self) -> np.dtype:
        """The numpy dtype of this dtype.

        Raises:
            TypeError: numpy has none (``bfloat16``).
        """
        if self._numpy is None:
            raise _type_error(f"ipuxl.{self._name} has no numpy dtype",
                              fix="hold bfloat16 host data as float32 (ipuxl.float32.as_numpy())")
        return self._numpy

    def as_torch(self) -> torch.dtype:
        """The ``torch.dtype`` this dtype stands for."""
        return self._torch

    # -- identity -----------------------------------------------------------------------
    def __eq__(self, other: object) -> builtins.bool:
        if isinstance(other, dtype):
            return other is self
        if isinstance(other, torch.dtype):
            return other == self._torch
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._torch)

    def __repr__(self) -> str:
        return f"{__name__}.{self._name}"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return dtype.from_name, (self._name,)  # pickle and deepcopy keep the module's instance


_Dtype = dtype  # the class, where a parameter named ``dtype`` hides it

DTypeLike = Any
"""What a dtype argument accepts: a PopXL ``dtype``, a ``torch.dtype``, a numpy dtype or a name
(``from_any`` converts it). ``Any``, as numpy's dtype-like types are."""


def _lookup(value: Any) -> "dtype | None":
    if isinstance(value, dtype):
        return value
    for table in (_BY_NAME, _BY_TORCH, _BY_PYTHON):
        try:
            found = table.get(value)
        except TypeError:  # unhashable
            continue
        if found is not None:
            return found
    try:
        return _BY_NUMPY.get(np.dtype(value))
    except (TypeError, ValueError):
        return None


#: PopXL's host representation of float8 data (numpy has no float8): a structured dtype whose
#: one ``u1`` field holds the bits.
np_dtype_float8_143 = np.dtype([("float8_143", "u1")])
np_dtype_float8_152 = np.dtype([("float8_152", "u1")])

# fmt: off
bool = dtype._define("bool", torch.bool, np.bool_, builtins.bool)  # noqa: A001 - PopXL's public name
int8 = dtype._define("int8", torch.int8, np.int8)
int16 = dtype._define("int16", torch.int16, np.int16)
int32 = dtype._define("int32", torch.int32, np.int32)
int64 = dtype._define("int64", torch.int64, np.int64)
uint8 = dtype._define("uint8", torch.uint8, np.uint8)
uint16 = dtype._define("uint16", torch.uint16, np.uint16)
uint32 = dtype._define("uint32", torch.uint32, np.uint32)
uint64 = dtype._define("uint64", torch.uint64, np.uint64)
float8_143 = dtype._define("float8_143", torch.float8_e4m3fnuz, np_dtype_float8_143)
float8_152 = dtype._define("float8_152", torch.float8_e5m2fnuz, np_dtype_float8_152)
float16 = dtype._define("float16", torch.float16, np.float16)
bfloat16 = dtype._define("bfloat16", torch.bfloat16, None)
float32 = dtype._define("float32", torch.float32, np.float32, builtins.float)
float64 = dtype._define("float64", torch.float64, np.float64)
complex64 = dtype._define("complex64", torch.complex64, np.complex64)
complex128 = dtype._define("complex128", torch.complex128, np.complex128)
# fmt: on
half = float16
float = float32  # noqa: A001 - PopXL's alias
double = float64
_BY_NAME.update(half=half, float=float32, double=float64)
del dtype._define  # the instances above are all there are

#: PopXL's lookup tables: torch dtype -> dtype and numpy dtype -> dtype, for the types both
#: sides have (PopXL's: no bfloat16, which numpy lacks, and none of torch's unsigned wide ints).
_PT_TO_POPXL: dict[torch.dtype, dtype] = {t: d for t, d in _BY_TORCH.items()
                                         if d._numpy is not None and d._numpy.fields is None
                                         and t not in (torch.uint16, torch.uint32, torch.uint64)}
_NP_TO_POPXL: dict[np.dtype, dtype] = dict(_BY_NUMPY)

# Every dtype a tensor, variable, constant or stream can have (the IPU's types).
SUPPORTED = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float16, torch.bfloat16, torch.float32,
             torch.float64, torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.int64, torch.uint32,
             torch.bool)
# PopXL's ``downcast=True``: 64-bit host data becomes 32-bit on the device.
DOWNCAST = {torch.float64: torch.float32, torch.int64: torch.int32}
#: The float8 dtypes (torch's), PopXL's ``float8_143`` and ``float8_152``.
FLOAT8 = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def is_float8(dtype: object) -> builtins.bool:
    """Whether ``dtype`` (a PopXL or torch dtype) is ``float8_143`` or ``float8_152``."""
    return isinstance(dtype, (torch.dtype, _Dtype)) and dtype in FLOAT8


def public(torch_dtype: torch.dtype) -> "dtype":
    """The PopXL dtype users see for ``torch_dtype`` (a torch dtype without one is returned as is)."""
    return _BY_TORCH.get(torch_dtype, torch_dtype)  # type: ignore[arg-type]


def to_numpy_dtype(dtype: "torch.dtype | dtype") -> np.dtype:
    """The numpy dtype that holds host data of ``dtype`` (bfloat16 uses float32)."""
    if dtype == torch.bfloat16:
        return np.dtype(np.float32)
    return _BY_TORCH[_torch_of(dtype)].as_numpy()


def _torch_of(value: "torch.dtype | dtype") -> torch.dtype:
    return value.as_torch() if isinstance(value, dtype) else value


def from_any(dtype: object, subject: str | None = None, *, host_data: builtins.bool = True) -> torch.dtype:
    """Turn a PopXL dtype, torch dtype, numpy dtype or name into a torch dtype.

    Args:
        dtype: an ``ipuxl.dtypes.dtype`` or ``torch.dtype`` (returned as its torch
            dtype), a numpy dtype (or anything ``np.dtype`` accepts) of a supported
            type, or a PopXL or torch dtype name (``"float32"``, ``"half"``).
        subject: what the dtype is for (``"variable 'w'"``), named in the error.
        host_data: the dtype is that of host data (the fix says how to convert it),
            not one asked for (a stream's: the fix says which to ask for).

    Raises:
        InvalidArgumentError: (a TypeError) ``dtype`` names no dtype, or a numpy
            dtype without an ipuxl equivalent (complex, strings, objects, uint64...).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, _Dtype):
        return dtype.as_torch()
    if isinstance(dtype, str):
        named = _BY_NAME.get(dtype)
        found = named.as_torch() if named is not None else getattr(torch, dtype, None)
        if isinstance(found, torch.dtype):
            return found
        _raise(f"unknown dtype name {dtype!r}", subject, "use a supported dtype, e.g. ipuxl.float32")
    try:
        np_dtype = np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        _raise(f"cannot interpret {dtype!r} as a dtype", subject, "use a supported dtype, e.g. ipuxl.float32")
    found_np = _BY_NUMPY.get(np_dtype)
    if found_np is None or found_np.as_torch() not in SUPPORTED:
        _raise(f"dtype {np_dtype} is not supported", subject, _fix_for(np_dtype, host_data))
    return found_np.as_torch()


def check_supported(dtype: "torch.dtype | dtype", subject: str | None = None, *,
                    host_data: builtins.bool = True) -> torch.dtype:
    """The torch dtype of ``dtype`` when ipuxl can hold it on the device and stream it.

    Raises:
        InvalidArgumentError: (a TypeError) a dtype outside ``SUPPORTED`` (complex,
            uint64...).
    """
    if dtype not in SUPPORTED:
        _raise(f"dtype {dtype_name(dtype)} is not supported", subject, _fix_for(_torch_of(dtype), host_data))
    return _torch_of(dtype)


def _fix_for(dtype: np.dtype | torch.dtype, host_data: builtins.bool) -> str:
    complex_ = dtype.is_complex if isinstance(dtype, torch.dtype) else dtype.kind == "c"
    if complex_ and host_data:
        return ("IPUs have no complex type: convert the data with data.astype(np.float32) (keeps the real "
                "part), or hold the real and imaginary parts as two float32 tensors (data.real, data.imag)")
    if complex_:
        return ("IPUs have no complex type: use ipuxl.float32, with one stream for the real part and one "
                "for the imaginary part if both are needed")
    if host_data:
        return "convert the data to a supported dtype first, e.g. data.astype(np.float32) or data.astype(np.int32)"
    return "use a supported dtype, e.g. ipuxl.float32 or ipuxl.int32"


def _raise(problem: str, subject: str | None, fix: str) -> NoReturn:
    line = user_source_line()
    where = ", ".join(p for p in (line, subject) if p) or None
    head = f"{subject}: " if subject else ""
    raise InvalidArgumentError(f"{head}{problem}; ipuxl supports {', '.join(map(dtype_name, SUPPORTED))}",
                               where=where, fix=fix) from None


def _value_error(problem: str) -> Exception:
    return DtypeError(problem, where=user_source_line(),
                      fix=f"use one of {', '.join(sorted(_BY_NAME))}, or the matching numpy or torch dtype")


def _type_error(problem: str, fix: str) -> Exception:
    return InvalidArgumentError(problem, where=user_source_line(), fix=fix)


def float8_options(subject: str, dtype: object, log2_scale: int | None,
                   nan_on_overflow: builtins.bool | None) -> tuple[int, builtins.bool]:
    """PopXL's float8 options of host data converted to ``dtype``: ``(log2_scale, nan_on_overflow)``
    with PopXL's defaults (0, True) for a float8 dtype.

    Raises:
        UnsupportedError: (a RuntimeError, as PopXL's) an option is set for another dtype.
    """
    if is_float8(dtype):
        return (0 if log2_scale is None else int(log2_scale),
                True if nan_on_overflow is None else builtins.bool(nan_on_overflow))
    for option, value in (("log2_scale", log2_scale), ("nan_on_overflow", nan_on_overflow)):
        if value is not None:
            raise UnsupportedError(f"{subject}: non-default value {option}={value!r} is not supported for dtypes that "
                                   "are not popxl.float8_143 or popxl.float8_152",
                                   where=user_source_line(), fix=f"leave {option} as None, or use a float8 dtype")
    return 0, True


def dtype_name(dtype: "torch.dtype | dtype") -> str:
    """PopXL's short name of a dtype (``float32``, not ``torch.float32``)."""
    if isinstance(dtype, _Dtype):
        return dtype.name
    return str(dtype).replace("torch.", "")
