"""PopTorch's ``AsynchronousDataAccessor``: read any iterable of batches ahead of the caller.

Upstream runs a worker *process* that fills a ring buffer of shared memory; ipuxl's
host and simulated device share one process, so a background thread reads ahead
into a bounded queue (``dataloader.Prefetcher``, also behind
``DataLoaderMode.Async``). The batches, their order and the epochs are the same as
iterating the dataset directly. Of the arguments, ``buffer_size`` (the queue bound),
``early_preload`` (start reading on construction) and ``rebatched_size`` have an
effect; ``miss_sleep_time_in_ms``, ``load_indefinitely`` and ``sharing_strategy``
configure upstream's worker process and are checked and recorded, with no effect on
a simulated device. Unlike upstream, a ``DataLoader(drop_last=False)`` without
``rebatched_size`` is accepted (a thread has no fixed-size buffers to fill).
"""
from __future__ import annotations

import numbers
from typing import Any, Iterator, TypeGuard

from ipuxl.errors import InvalidArgumentError, OptionsError, PoptorchError
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat.dataloader import DataLoader, DataLoaderMode, Prefetcher
from ipuxl.poptorch_compat.rebatching import rebatch
from ipuxl.poptorch_compat.enums import SharingStrategy

__all__ = ["AsynchronousDataAccessor"]


class AsynchronousDataAccessor:
    """Iterate ``dataset`` (any iterable: a ``DataLoader``, a ``Dataset``...) with the
    next batches read ahead by a background thread.

    Args:
        dataset: what to read; one pass over it is one epoch (one ``iter()``).
        buffer_size: how many batches are read ahead (>= 1).
        miss_sleep_time_in_ms: upstream's worker polling interval (no effect here).
        load_indefinitely: upstream's worker starts the next epoch at once (no effect here).
        early_preload: start reading on construction, before the first ``iter()``.
        sharing_strategy: how upstream passes the dataset to its worker process (no effect here).
        rebatched_size: if set (> 1), return batches of this many samples, made by
            concatenating / splitting the dataset's batches along their first dimension;
            the leftover samples are dropped unless ``dataset.rebatched_drop_last`` is False.

    Raises:
        PoptorchError: ``dataset`` is a ``DataLoader`` that already reads asynchronously.
        InvalidArgumentError, OptionsError: an argument of the wrong type or value.
    """

    def __init__(self, dataset: Any, buffer_size: int = 3, miss_sleep_time_in_ms: float = 0.1,
                 load_indefinitely: bool = True, early_preload: bool = False,
                 sharing_strategy: SharingStrategy = SharingStrategy.FileSystem,
                 rebatched_size: int | None = None) -> None:
        self._active: Prefetcher | None = None  # set first: terminate() works if a check fails
        self._terminated = False
        _check(dataset, buffer_size, miss_sleep_time_in_ms, sharing_strategy, rebatched_size,
               load_indefinitely=load_indefinitely, early_preload=early_preload)
        self._dataset = dataset
        self._buffer_size = int(buffer_size)
        self.rebatched_size = rebatched_size
        self.miss_sleep_time_in_ms = miss_sleep_time_in_ms
        self.load_indefinitely = load_indefinitely
        self.sharing_strategy = sharing_strategy
        self._preloaded = False
        if early_preload:
            self._start()
            self._preloaded = True

    def _start(self) -> None:
        self._stop_active()
        source: Iterator[Any] = iter(self._dataset)
        if self.rebatched_size is not None:
            source = rebatch(source, self.rebatched_size, getattr(self._dataset, "rebatched_drop_last", True))
        self._active = Prefetcher(source, self._buffer_size)

    def _stop_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def terminate(self) -> None:
        """Stop the background thread; the accessor cannot be iterated afterwards."""
        self._stop_active()
        self._terminated = True

    def __del__(self) -> None:
        if "_active" in self.__dict__:
            self._stop_active()

    def __len__(self) -> int:
        """Batches per epoch: ``len(dataset)``, or with ``rebatched_size`` the whole
        rebatched batches its samples make."""
        length = len(self._dataset)
        if not self.rebatched_size:
            return length
        samples = length * (getattr(self._dataset, "batch_size", 1) or 1)
        return samples // self.rebatched_size

    def __iter__(self) -> "AsynchronousDataAccessor":
        """Start an epoch (a new pass over the dataset) and return this accessor."""
        if self._terminated:
            raise PoptorchError("AsynchronousDataAccessor: iterated after terminate()", where=user_source_line(),
                                fix="create a new AsynchronousDataAccessor to read the dataset again")
        if not self._preloaded:  # the early-preloaded epoch is this first one
            self._start()
        self._preloaded = False
        return self

    def __next__(self) -> Any:
        if self._active is None:
            raise StopIteration
        return next(self._active)


def _check(dataset: Any, buffer_size: object, miss_sleep_time_in_ms: object, sharing_strategy: object,
           rebatched_size: object, **flags: object) -> None:
    where = user_source_line()
    if isinstance(dataset, DataLoader) and dataset.mode is not DataLoaderMode.Sync:
        raise PoptorchError(
            "The DataLoader already uses an AsynchronousDataAccessor internally. Either use the existing one or set "
            f"mode='poptorch.DataLoaderMode.Sync' in the DataLoader (it has mode=DataLoaderMode.{dataset.mode.name}).",
            where=where,
            fix="iterate the DataLoader itself, or build it with mode=poptorch.DataLoaderMode.Sync")
    if not hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__"):
        raise InvalidArgumentError(
            f"AsynchronousDataAccessor: dataset must be iterable, got {type(dataset).__name__}",
            where=where, fix="pass a DataLoader, a Dataset or another iterable of batches")
    if not _is_int(buffer_size) or int(buffer_size) < 1:
        raise OptionsError(f"AsynchronousDataAccessor: buffer_size must be an int >= 1, got {buffer_size!r}",
                           where=where, fix="pass for example buffer_size=3")
    if not isinstance(miss_sleep_time_in_ms, numbers.Real) or miss_sleep_time_in_ms < 0:
        raise OptionsError(f"AsynchronousDataAccessor: miss_sleep_time_in_ms must be a number >= 0, "
                           f"got {miss_sleep_time_in_ms!r}", where=where, fix="pass for example 0.1")
    if not isinstance(sharing_strategy, SharingStrategy):
        raise InvalidArgumentError(
            f"AsynchronousDataAccessor: sharing_strategy must be a poptorch.SharingStrategy, got {sharing_strategy!r}",
            where=where, fix=f"pass one of {', '.join('SharingStrategy.' + s.name for s in SharingStrategy)}")
    if rebatched_size is not None and (not _is_int(rebatched_size) or int(rebatched_size) <= 1):
        raise OptionsError(
            f"AsynchronousDataAccessor: rebatched_size must be None or an int greater than 1, got {rebatched_size!r}",
            where=where, fix="pass the number of samples per returned batch, or None")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"AsynchronousDataAccessor: {name} must be True or False, got {value!r}",
                                       where=where, fix=f"pass {name}=True or {name}=False")


def _is_int(value: object) -> TypeGuard[numbers.Integral]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
