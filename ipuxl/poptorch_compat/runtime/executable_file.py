"""ipuxl's executable files: what ``compileAndExport``/``save`` write and ``load``/``loadExecutable`` read.

PopTorch saves a Poplar executable plus pickled metadata. ipuxl's program is rebuilt
from the module in well under a second, so its file holds what is needed to
rebuild the same program and continue: a ``torch.save`` archive of

* ``inputs``: the compiled call's arguments with every tensor replaced by its
  shape and dtype (:class:`InputSpec`; ``example_inputs`` makes zero tensors of them);
* ``options``: the model's ``Options``; ``training``: which wrapper;
* ``model`` and ``optimizer`` (``export_model=True``): the module with its current
  weights and the optimiser with its current state, pickled together so the
  optimiser's parameters are the module's;
* ``rng_state`` (``save_rng_state=True``): the device's random seed state.

The file is a pickle: load only files you trust (as with ``torch.load``). PopTorch
files (``.popef`` executables) cannot be read.
"""
from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from ipuxl.errors import ExecutorError
from ipuxl.ir.context import user_source_line

__all__ = ["FORMAT", "InputSpec", "input_specs", "example_inputs", "write_executable", "read_executable",
           "output_path"]

FORMAT = "ipuxl-poptorch-executable"
FORMAT_VERSION = 1
_LOG = logging.getLogger("poptorch::python")


class InputSpec(NamedTuple):
    """A model input tensor's shape and dtype, as saved in an executable file."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def input_specs(call: Any) -> Any:
    """``call`` (any pytree, e.g. ``(args, kwargs)``) with each tensor replaced by its :class:`InputSpec`."""
    return pytree.tree_map(lambda v: InputSpec(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v, call)


def example_inputs(specs: Any) -> Any:
    """The inverse of ``input_specs``: zero tensors of the saved shapes and dtypes."""
    return pytree.tree_map(lambda v: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, InputSpec) else v, specs,
                           is_leaf=lambda v: isinstance(v, InputSpec))


def output_path(filename: str | os.PathLike[str]) -> str:
    """Where ``save(filename)`` writes: ``filename``, or ``filename/model.poptorch`` for a
    directory (as upstream, with a warning); missing parent folders are created."""
    path = os.fspath(filename)
    if os.path.isdir(path):
        target = os.path.join(path, "model.poptorch")
        _LOG.warning("save(): %s is a directory, saving model to %s", path, target)
        return target
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    return path


def write_executable(filename: str | os.PathLike[str], contents: dict[str, Any]) -> str:
    """Write ``contents`` (see the module docstring) as an ipuxl executable file; returns the path."""
    path = output_path(filename)
    torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, **contents}, path)
    return path


def read_executable(filename: str | os.PathLike[str]) -> dict[str, Any]:
    """The contents of an ipuxl executable file.

    Raises:
        ExecutorError: the file is missing or is not an ipuxl executable file.
    """
    path = os.fspath(filename)
    if not os.path.isfile(path):
        raise ExecutorError(f"no executable file at {path!r}", where=user_source_line(),
                            fix="pass the path given to compileAndExport()/save()")
    try:
        data = torch.load(path, weights_only=False)
    except Exception as exc:  # any unpickling failure: the file is not ours
        raise ExecutorError(f"Invalid file {path}: not an ipuxl executable file ({type(exc).__name__}: {exc})",
                            where=user_source_line(),
                            fix="create it with compileAndExport() or save() in ipuxl (PopTorch's Poplar "
                                "executables cannot be loaded)") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ExecutorError(f"Invalid file {path}: not an ipuxl executable file", where=user_source_line(),
                            fix="create it with compileAndExport() or save() in ipuxl (PopTorch's Poplar "
                                "executables cannot be loaded)")
    if data.get("format_version", 0) > FORMAT_VERSION:
        raise ExecutorError(f"Invalid file {path}: format version {data['format_version']} is newer than this "
                            f"ipuxl reads ({FORMAT_VERSION})", where=user_source_line(),
                            fix="load it with the ipuxl version that wrote it")
    return data
