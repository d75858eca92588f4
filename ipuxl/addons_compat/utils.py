"""popxl.addons' ``utils``: ``timer``, ``WeightsDict``, ``OrderedDict``, ``null_context``,
``suffix_graph_name``.

``timer`` logs how long its block took (``logging.info``, minutes) and, when Weights &
Biases is imported and a run is active, records it in the run's summary, as upstream.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import re
import sys
import time
from typing import Any, Iterator, MutableMapping, TypeVar

import numpy as np

from ipuxl.dtypes import from_any
from ipuxl.errors import DtypeError, ShapeMismatchError
from ipuxl.ir.tensor import Variable

__all__ = ["null_context", "suffix_graph_name", "timer", "OrderedDict", "WeightsDict"]

K = TypeVar("K")
V = TypeVar("V")


@contextlib.contextmanager
def null_context() -> Iterator[None]:
    """A context that does nothing (upstream's backport of ``contextlib.nullcontext``)."""
    yield


def suffix_graph_name(name: str, suffix: str) -> str:
    """``name`` without its ``_subgraph(k)`` part, then ``_<suffix>``: ``"fwd_subgraph(3)"`` -> ``"fwd_grad"``."""
    return f"{re.sub(r'_subgraph[(][0-9]+[)]', '', name)}_{suffix}"


@contextlib.contextmanager
def timer(title: str | None = None, log_to_wandb: bool = True) -> Iterator[None]:
    """Log the duration of the block (minutes); with ``log_to_wandb`` and an active W&B run,
    also put it in the run summary as ``<title>_mins``.

    Example:
        >>> with timer("Compile"):
        ...     session = TaskSession(...)
    """
    start = time.perf_counter()
    logging.info(f"Starting {title or ''}")
    yield
    minutes = (time.perf_counter() - start) / 60
    logging.info(f"{f'{title} duration' if title else 'Duration'}: {minutes:.2f} mins")
    wandb = sys.modules.get("wandb")  # upstream logs only when the program has imported wandb
    if log_to_wandb and title and wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.run.summary[title.lower().replace(" ", "_") + "_mins"] = minutes


class OrderedDict(collections.OrderedDict, MutableMapping[K, V]):
    """An ``OrderedDict`` with ``idx(i)`` (the i-th value) and a one-item-per-line repr."""

    def idx(self, idx: int) -> V:
        return list(self.values())[idx]

    def __repr__(self) -> str:
        return "{" + ("\n" if len(self) else "") + "".join(f"{k}: {v},\n" for k, v in self.items()) + "}"


class WeightsDict(MutableMapping[Variable, np.ndarray]):
    """A dict from variables to host arrays that checks each array's dtype and host shape.

    Raises:
        DtypeError: (a ValueError, as upstream) an array's dtype is not its variable's.
        ShapeMismatchError: (a ValueError) an array's shape is not the variable's
            ``shape_on_host`` (with replica groups: ``(groups, *shape)``).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        self.dict: dict[Variable, np.ndarray] = {}
        if args or kwargs:
            self.update(*args, **kwargs)

    def __getitem__(self, key: Variable) -> np.ndarray:
        return self.dict[key]

    def __setitem__(self, key: Variable, value: np.ndarray) -> None:
        if from_any(value.dtype) != key.dtype:
            raise DtypeError(f"{key}: tensor and weight dtypes do not equal {key.dtype} != {from_any(value.dtype)}",
                             fix="cast the array to the variable's dtype (popxl.utils.to_numpy(data, dtype))")
        if tuple(key.shape_on_host) != tuple(value.shape):
            raise ShapeMismatchError(f"{key}: tensor and weight shapes do not equal {key.shape_on_host} != "
                                     f"{value.shape}", fix="give one array of the variable's host shape")
        self.dict[key] = value

    def __delitem__(self, key: Variable) -> None:
        del self.dict[key]

    def __len__(self) -> int:
        return len(self.dict)

    def __iter__(self) -> Iterator[Variable]:
        return iter(self.dict)
