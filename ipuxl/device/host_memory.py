"""Host memory of the simulated device: keep freed memory for the next step.

An IPU program's memory is reserved once, when the program is loaded; every step
reuses it. On the CPU, a step's tensors come from the C library's allocator, and
glibc's defaults give much of that memory back to the kernel as soon as it is freed
(blocks above the dynamic ``mmap`` threshold, and the free top of the heap above the
trim threshold). The next step then faults every page in again: measured on
ResNet-18 (batch 4, 64x64, 2 steps per call), about 26,000 page faults per call and
a third of the step's time, while an eager loop in the same process, whose
allocation pattern happens to stay under the dynamic thresholds, faulted about 200
times.

``keep_freed_memory`` sets both thresholds once per process (``mallopt``), so freed
blocks up to ``MMAP_THRESHOLD`` bytes stay in the heap and are reused by the next
step: the process keeps its peak step memory resident, as a device keeps its
program's memory. Every later allocation of the process, eager code included, uses
the same settings. Set the environment variable ``IPUXL_KEEP_FREED_MEMORY=0`` to
leave the C library's defaults alone. A no-op where the C library is not glibc.

The same settings would also keep, for good, what a compile and a first run allocated
and freed (tracing, code generation, one-time set-ups): ``release_freed_memory``, called
after a session's first run, hands the heap's free memory back (``malloc_trim``), so a
process's resident memory over its later steps is theirs. (A ``gc.collect()`` first made
no difference on ViT's steps and costs about 250 ms in a process with transformers loaded.)
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["keep_freed_memory", "release_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

#: Blocks below this size come from the heap and are reused (glibc's maximum is 32 MiB).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of the heap is given back only above this size.
TRIM_THRESHOLD = 1 << 30

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_state: dict[str, bool] = {}
_libc: list[ctypes.CDLL] = []  # glibc, once the thresholds are set


def keep_freed_memory() -> bool:
    """Set the allocator's thresholds once per process; True when they are set (now or before)."""
    if "set" not in _state:
        _state["set"] = _set_thresholds()
    return _state["set"]


def _set_thresholds() -> bool:
    if os.environ.get("IPUXL_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting it also fixes glibc's dynamic thresholds
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return False
    _libc.append(libc)
    return True


def release_freed_memory() -> None:
    """Give the heap's free memory back to the kernel: what a compile and a first run
    freed, which ``keep_freed_memory``'s thresholds would keep resident. A no-op unless
    they are set (glibc, CPU sessions)."""
    if not _libc:
        return
    trim = _libc[0].malloc_trim
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
