"""The few PopART names Graphcore's PopXL and PopTorch programs use (``import popart``).

Programs written for PopXL import ``popart`` for its version string (which they log)
and PopART's ``SessionOptions`` fields they set through ``ir._pb_ir``; those are here.
PopART's graph-building API is not: ipuxl builds graphs with PopXL's. ``popart._internal``
(PopART's C++ IR, which some programs and tests inspect directly) cannot exist on a
reimplementation, and importing it raises ``CompatImportError`` (a ModuleNotFoundError).
"""
from __future__ import annotations

from ipuxl.errors import PopartException as popart_exception  # noqa: N813 - PopART's name
from ipuxl.ir.popart_options import SessionOptions

__all__ = ["versionString", "versionNumber", "SessionOptions", "__version__", "popart_exception"]

#: The PopART release whose PopXL API ipuxl reproduces (Poplar SDK 3.3).
__version__ = "3.3.0"


def versionString() -> str:  # noqa: N802 - PopART's name
    """PopART's version string, ``"<major>.<minor>.<patch> (ipuxl)"``."""
    return f"{__version__} (ipuxl)"


def versionNumber() -> tuple[int, int, int]:  # noqa: N802
    """PopART's version as ``(major, minor, patch)``."""
    major, minor, patch = (int(part) for part in __version__.split("."))
    return major, minor, patch
