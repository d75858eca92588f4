"""PopTorch-style ``DataLoader``: batches sized for one run of a compiled model.

This follows the public PopTorch API (``poptorch.DataLoader`` in ``python/__init__.py``
and ``DataLoaderMode`` in ``python/enums.py``):

* same signature and defaults; it is a ``torch.utils.data.DataLoader`` whose
  batches hold the *combined* batch size ``batch_size x deviceIterations x
  replicationFactor x Training.gradientAccumulation`` samples (upstream multiplies
  by gradient accumulation whatever the model; ``combinedBatchSize`` says it);
* ``batch_size=None`` turns batching off (``combinedBatchSize`` is then None;
  ``drop_last`` is then ignored, where torch would refuse the pair);
* ``persistent_workers=None`` means ``num_workers > 0``;
* with ``drop_last=False`` and a dataset length that the combined batch size does
  not divide, the last batch is smaller and a warning says so (upstream logs it);
* building a DataLoader freezes its ``options`` (upstream calls ``_freeze()``);
* ``DataLoaderMode.Async`` reads batches ahead of the caller;
  ``DataLoaderMode.AsyncRebatched`` makes the underlying loader produce batches of
  ``rebatched_worker_size`` samples (default: the combined batch size) and
  re-assembles them into combined batches; the leftover samples are kept as a
  final smaller batch only with ``drop_last=False``. Batches may be of a custom
  type with a registered ``ICustomArgParser`` (``custom_args``), also when rebatched.
* ``poptorch.AsynchronousDataAccessor`` (``accessor``) reads any iterable ahead
  the same way.

Differences from upstream, on purpose:

* Async prefetching runs in a background *thread* with a bounded queue rather
  than upstream's separate process and shared-memory ring buffer: the host and the
  simulated device share one process here. Of ``async_options`` only
  ``buffer_size`` (the queue bound, default 3) has an effect; upstream's
  process-transport knobs (``miss_sleep_time_in_ms``, ``sharing_strategy``,
  ``load_indefinitely``, ``early_preload``) are accepted and have no effect. An
  exception raised while loading is re-raised in the caller's thread.
* Distributed execution: under torchrun (``WORLD_SIZE`` > 1) or after
  ``opts.Distributed.configureProcessId(process_id, num_processes)``, and with
  ``auto_distributed_partitioning=True`` (the default), each process reads only
  its shard of a map-style dataset, as upstream's ``_SubDataset`` does: the
  dataset is cut into ``num_processes`` consecutive blocks (a whole number of
  combined batches each with ``drop_last=True``), process ``i`` reading block
  ``i``. With ``shuffle=True`` all processes draw the same permutation of the
  whole dataset each epoch (seeded from ``options.randomSeed``, which upstream
  also requires) and each reads its block of it. As upstream, ``replicationFactor``
  counts the replicas of one process, so a process's combined batch is ``batch_size
  x deviceIterations x replicationFactor x gradientAccumulation``: the data of the
  replicas it runs. An ``IterableDataset`` is not sharded (each process reads all of
  it; use ``opts.Distributed.processId`` in the dataset).
* A custom ``batch_sampler`` (passed on to torch's loader, with ``collate_fn``) makes
  micro-batches, as PopTorch: each run of the model takes ``deviceIterations x
  replicationFactor x gradientAccumulation`` consecutive ones, concatenated along the
  sample axis (they may differ in size), and ``drop_last`` (default True) drops a final
  shorter run. ``combinedBatchSize`` is None; ``batch_size`` other than 1,
  ``shuffle=True`` or a ``sampler`` raise torch's ValueError, as
  ``torch.utils.data.DataLoader``.
"""
from __future__ import annotations

import enum
import numbers
import queue
import threading
import warnings
import weakref
from typing import Any, Iterator, Sized, TypeGuard, cast

import torch
import torch.utils.data

from ipuxl.errors import InvalidArgumentError, OptionsError
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat.options import Options
from ipuxl.poptorch_compat.rebatching import combine, rebatch

__all__ = ["DataLoader", "DataLoaderMode", "Prefetcher", "ASYNC_BUFFER_SIZE"]


class DataLoaderMode(enum.IntEnum):
    """How :class:`DataLoader` reads its dataset (PopTorch's values).

    - ``Sync``: batches are read when the caller asks for them.
    - ``Async``: a background thread reads batches ahead of the caller.
    - ``AsyncRebatched``: like ``Async``; the underlying loader produces batches of
      ``rebatched_worker_size`` samples which are re-assembled into combined batches.
    """

    Sync = 0
    Async = 1
    AsyncRebatched = 2


# Upstream's AsynchronousDataAccessor options: only ``buffer_size`` matters to a
# thread; the others configure upstream's worker process and shared memory.
ASYNC_BUFFER_SIZE = 3
_ASYNC_OPTIONS = frozenset({"buffer_size", "miss_sleep_time_in_ms", "load_indefinitely",
                            "early_preload", "sharing_strategy"})
_POLL_S = 0.05          # how often a blocked producer / consumer checks for shutdown
_JOIN_TIMEOUT_S = 5.0   # how long close() waits for a producer stuck in the dataset


def _type_name(value: object) -> str:
    return type(value).__name__


def _is_int(value: object) -> TypeGuard[numbers.Integral]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class DataLoader(torch.utils.data.DataLoader):
    """A ``torch.utils.data.DataLoader`` whose batches feed one run of a model
    compiled with ``options``: ``combinedBatchSize`` = ``batch_size`` x
    ``deviceIterations`` x ``replicationFactor`` x ``Training.gradientAccumulation``.

    Args:
        options: the :class:`~ipuxl.Options` the model is compiled with (frozen here).
        dataset: the dataset to read (map-style or iterable).
        batch_size: the micro-batch size, i.e. what one replica processes in one
            step; None disables batching.
        shuffle: shuffle the samples each epoch (pass ``generator=`` for a
            reproducible order, or seed torch, e.g. with ``options.randomSeed``).
        num_workers: worker processes for torch's loader (0: load in this process).
        drop_last: drop the last batch if it is smaller than the combined batch.
        persistent_workers: keep worker processes between epochs; None means
            ``num_workers > 0``.
        auto_distributed_partitioning: with several processes (torchrun, or
            ``options.Distributed.configureProcessId``), read only this process's
            shard of the dataset (default True).
        mode: a :class:`DataLoaderMode`.
        async_options: for the Async modes, ``{"buffer_size": n}`` bounds how many
            batches are read ahead (default 3).
        rebatched_worker_size: for ``AsyncRebatched``, the size of the batches the
            underlying loader produces (<= the combined batch size).
        **kwargs: passed on to ``torch.utils.data.DataLoader``.

    Raises:
        InvalidArgumentError: an argument has the wrong type.
        OptionsError: an argument has a wrong value.
    """

    def __init__(self,
                 options: Options,
                 dataset: torch.utils.data.Dataset,
                 batch_size: int | None = 1,
                 shuffle: bool = False,
                 num_workers: int = 0,
                 drop_last: bool = True,
                 persistent_workers: bool | None = None,
                 auto_distributed_partitioning: bool = True,
                 mode: DataLoaderMode = DataLoaderMode.Sync,
                 async_options: dict[str, Any] | None = None,
                 rebatched_worker_size: int | None = None,
                 **kwargs: Any) -> None:
        # Set first so that terminate() / __del__ work even if validation fails.
        self._active: weakref.ReferenceType[Prefetcher] | None = None
        _check_arguments(options, batch_size, num_workers, mode, shuffle=shuffle, drop_last=drop_last,
                         persistent_workers=persistent_workers,
                         auto_distributed_partitioning=auto_distributed_partitioning)
        if persistent_workers is None:
            persistent_workers = num_workers > 0

        self._options = options
        self._mode = mode
        self._combined_batch_size: int | None = None
        self._combine: int | None = None  # with a batch_sampler: how many of its batches one run takes
        if kwargs.get("batch_sampler") is not None:
            _refuse_batching_arguments(batch_size, shuffle, kwargs)
            batch_size = None  # the batch sampler makes the (micro-)batches
            self._combine = options.device_iterations * options.replicas_per_process() * \
                options.gradient_accumulation
        # The replicas this process feeds: all of them, or its share under torchrun.
        replicas = options.replicas_per_process()
        if batch_size is not None:
            self._combined_batch_size = int(batch_size) * options.device_iterations * \
                replicas * options.gradient_accumulation
        self._shard: _ProcessShardSampler | None = None
        processes = options.Distributed.numProcesses
        if processes > 1 and auto_distributed_partitioning and \
                not isinstance(dataset, torch.utils.data.IterableDataset):
            self._shard = _process_shard(options, dataset, self._combined_batch_size, bool(shuffle), drop_last,
                                         kwargs)
            kwargs["sampler"] = self._shard
            shuffle = False  # the shard sampler shuffles (the same permutation in every process)
        elif processes > 1 and auto_distributed_partitioning:
            warnings.warn(f"DataLoader: process {options.Distributed.processId} of {processes} reads the whole "
                          "IterableDataset (ipuxl only shards map-style datasets); use "
                          "options.Distributed.processId / numProcesses in the dataset to give each process "
                          "its own samples", UserWarning, stacklevel=2)

        self._buffer_size = _check_async_options(async_options, mode)
        self._rebatched_size: int | None = None
        self._requested_drop_last = drop_last
        loader_batch_size = self._combined_batch_size
        if mode is DataLoaderMode.AsyncRebatched:
            if self._combined_batch_size is None:
                raise OptionsError(
                    "DataLoaderMode.AsyncRebatched needs a batch size to rebatch to, got batch_size=None",
                    where=user_source_line(), fix="pass batch_size=1 (or more), or use DataLoaderMode.Async")
            self._rebatched_size = self._combined_batch_size
            if rebatched_worker_size is not None:
                loader_batch_size = _check_worker_size(rebatched_worker_size, self._combined_batch_size)
            # The rebatching step handles the leftovers, not torch's loader.
            drop_last = False
        elif rebatched_worker_size is not None:
            warnings.warn(f"DataLoader: rebatched_worker_size={rebatched_worker_size!r} is ignored with "
                          f"DataLoaderMode.{mode.name} (it only applies to DataLoaderMode.AsyncRebatched)",
                          UserWarning, stacklevel=2)

        if loader_batch_size is None:
            # No batching (or a batch_sampler's, combined here): torch's loader drops nothing (it refuses the pair).
            drop_last = False
        elif self._combined_batch_size is not None and not isinstance(dataset, torch.utils.data.IterableDataset):
            _warn_if_partial_last_batch(self._shard if self._shard is not None else dataset,
                                        self._combined_batch_size, self._requested_drop_last)

        if kwargs.get("batch_sampler") is not None:
            loader_batch_size = 1  # torch's default, which it requires with a batch_sampler
        super().__init__(dataset, batch_size=loader_batch_size, shuffle=shuffle, num_workers=num_workers,
                         drop_last=drop_last, persistent_workers=persistent_workers, **kwargs)
        # As upstream: the batches are sized from these options, so they must not change.
        # (Frozen only once everything was accepted, so a refused call leaves them as they were.)
        options.freeze()

    # -- upstream's attributes -----------------------------------------------------
    @property
    def combinedBatchSize(self) -> int | None:  # noqa: N802 - PopTorch's public name
        """Samples consumed from the dataset by one run of the model (None without batching)."""
        return self._combined_batch_size

    @property
    def shard(self) -> "_ProcessShardSampler | None":
        """This process's shard of the dataset (None unless distributed); ``shard.indices()``."""
        return self._shard

    @property
    def options(self) -> Options:
        """The (frozen) options this DataLoader was built with."""
        return self._options

    @property
    def mode(self) -> DataLoaderMode:
        return self._mode

    # -- iteration -----------------------------------------------------------------
    def __len__(self) -> int:
        if self._combine is not None:
            runs, leftover = divmod(super().__len__(), self._combine)  # TypeError: the batch_sampler has no len
            return runs + int(bool(leftover) and not self._requested_drop_last)
        if self._rebatched_size is None:
            return super().__len__()
        num_samples = len(self._shard) if self._shard is not None else len(cast(Sized, self.dataset))
        batches, leftover = divmod(num_samples, self._rebatched_size)
        return batches + int(bool(leftover) and not self._requested_drop_last)

    # torch annotates __iter__ with its private iterator class; the Async modes return a
    # prefetching iterator of the same batches instead
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self._mode is DataLoaderMode.Sync and self._combine is None:
            return super().__iter__()
        # One epoch at a time: with persistent workers torch reuses one iterator,
        # which two prefetching threads must not share.
        self.terminate()
        source: Iterator[Any] = super().__iter__()
        if self._combine is not None:
            source = combine(source, self._combine, self._requested_drop_last)
            if self._mode is DataLoaderMode.Sync:
                return source
        if self._rebatched_size is not None:
            source = rebatch(source, self._rebatched_size, self._requested_drop_last)
        iterator = Prefetcher(source, self._buffer_size)
        self._active = weakref.ref(iterator)
        return iterator

    def terminate(self) -> None:
        """Stop the background thread of an Async epoch in progress (no effect otherwise)."""
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._active = None

    def __del__(self) -> None:
        if "_active" in self.__dict__:
            self.terminate()


def _refuse_batching_arguments(batch_size: int | None, shuffle: bool, kwargs: dict[str, Any]) -> None:
    """With the user's ``batch_sampler``, the arguments torch refuses beside it (see the module docstring).

    Raises:
        ValueError: torch's, for ``batch_size`` other than 1, ``shuffle=True`` or a ``sampler``.
    """
    if batch_size != 1 or shuffle or kwargs.get("sampler") is not None:
        raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and "
                         "drop_last")


# -- argument checks ----------------------------------------------------------------
def _check_arguments(options: object, batch_size: object, num_workers: object, mode: object,
                     **flags: object) -> None:
    where = user_source_line()
    if not isinstance(options, Options):
        raise InvalidArgumentError(
            f"DataLoader: options must be an ipuxl.Options, got {_type_name(options)}",
            where=where, fix="pass the options the model is compiled with: DataLoader(opts, dataset, ...)")
    if batch_size is not None:
        if not _is_int(batch_size):
            raise InvalidArgumentError(
                f"DataLoader: batch_size must be an int or None, got {batch_size!r} ({_type_name(batch_size)})",
                where=where, fix="pass the micro-batch size as a whole number, for example batch_size=4")
        if batch_size < 1:
            raise OptionsError(
                f"DataLoader: batch_size must be >= 1, got {batch_size}",
                where=where, fix="pass a micro-batch size of at least 1 (or None to disable batching)")
    if not _is_int(num_workers):
        raise InvalidArgumentError(
            f"DataLoader: num_workers must be an int, got {num_workers!r} ({_type_name(num_workers)})",
            where=where, fix="pass num_workers=0 to load in this process, or a number of worker processes")
    if num_workers < 0:
        raise OptionsError(f"DataLoader: num_workers must be >= 0, got {num_workers}",
                           where=where, fix="pass num_workers=0 to load in this process")
    if not isinstance(mode, DataLoaderMode):
        members = ", ".join(f"DataLoaderMode.{m.name}" for m in DataLoaderMode)
        raise InvalidArgumentError(f"DataLoader: mode must be a DataLoaderMode, got {mode!r}",
                                   where=where, fix=f"pass one of {members}")
    for name, value in flags.items():
        if name in ("shuffle", "persistent_workers") and value is None:
            continue  # torch's default for shuffle; "num_workers > 0" for persistent_workers
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"DataLoader: {name} must be True or False, got {value!r}",
                                       where=where, fix=f"pass {name}=True or {name}=False")


def _check_async_options(async_options: object, mode: DataLoaderMode) -> int:
    """The prefetch queue bound from ``async_options`` (validated)."""
    where = user_source_line()
    if async_options is None:
        return ASYNC_BUFFER_SIZE
    if not isinstance(async_options, dict):
        raise InvalidArgumentError(
            f"DataLoader: async_options must be a dict or None, got {_type_name(async_options)}",
            where=where, fix='pass for example async_options={"buffer_size": 4}')
    if mode is DataLoaderMode.Sync:
        warnings.warn("DataLoader: async_options are ignored with DataLoaderMode.Sync",
                      UserWarning, stacklevel=3)
    if "rebatched_size" in async_options:
        raise OptionsError(
            "DataLoader: rebatched_size cannot be given in async_options (as upstream)",
            where=where, fix="use mode=DataLoaderMode.AsyncRebatched and rebatched_worker_size= instead")
    unknown = sorted(set(async_options) - _ASYNC_OPTIONS)
    if unknown:
        raise OptionsError(f"DataLoader: unknown async_options {unknown}",
                           where=where, fix=f"use some of {sorted(_ASYNC_OPTIONS)}")
    buffer_size = async_options.get("buffer_size", ASYNC_BUFFER_SIZE)
    if not _is_int(buffer_size) or buffer_size < 1:
        raise OptionsError(f"DataLoader: async_options['buffer_size'] must be an int >= 1, got {buffer_size!r}",
                           where=where, fix='pass for example async_options={"buffer_size": 3}')
    return int(buffer_size)


def _check_worker_size(rebatched_worker_size: object, combined_batch_size: int) -> int:
    where = user_source_line()
    if not _is_int(rebatched_worker_size):
        raise InvalidArgumentError(
            f"DataLoader: rebatched_worker_size must be an int or None, got {rebatched_worker_size!r}",
            where=where, fix="pass a whole number of samples per worker batch")
    size = int(rebatched_worker_size)
    if not 1 <= size <= combined_batch_size:
        raise OptionsError(
            f"DataLoader: rebatched_worker_size ({rebatched_worker_size}) must be between 1 and the "
            f"combined batch size ({combined_batch_size})",
            where=where, fix=f"pass rebatched_worker_size <= {combined_batch_size}, or leave it None")
    return size


def _warn_if_partial_last_batch(dataset: object, combined_batch_size: int, drop_last: bool) -> None:
    try:
        num_samples = len(cast(Sized, dataset))
    except TypeError:  # a map-style dataset without __len__ (torch allows it with a sampler)
        return
    leftover = num_samples % combined_batch_size
    if leftover and not drop_last:
        warnings.warn(
            f"DataLoader: the dataset's {num_samples} samples are not a multiple of the combined batch size "
            f"({combined_batch_size}) and drop_last=False, so the last batch holds {leftover} samples; "
            "pass drop_last=True to avoid handling this special case", UserWarning, stacklevel=3)


# -- distributed: one shard of the dataset per process ------------------------------------
class _ProcessShardSampler(torch.utils.data.Sampler):
    """The indices of this process's block of the dataset (upstream's ``_SubDataset``
    layout: ``[p0, p0, ..., p1, p1, ..., p2, ...]``).

    With ``seed`` set, every epoch draws a permutation of the whole dataset from
    ``seed + epoch`` (the same in every process) and this process reads its block
    of it, so together the processes still read each sample once per epoch.
    """

    def __init__(self, num_samples: int, per_process: int, process_id: int, seed: int | None) -> None:
        self._num_samples = num_samples
        self._offset = process_id * per_process
        self._length = max(0, min(per_process, num_samples - self._offset))
        self._seed = seed
        self._epoch = 0

    def __len__(self) -> int:
        return self._length

    def indices(self, epoch: int | None = None) -> list[int]:
        """The dataset indices this process reads in ``epoch`` (default: the next one)."""
        epoch = self._epoch if epoch is None else epoch
        if self._seed is None:
            return list(range(self._offset, self._offset + self._length))
        generator = torch.Generator().manual_seed((self._seed + epoch) % 2**64)
        order = torch.randperm(self._num_samples, generator=generator)
        return order[self._offset:self._offset + self._length].tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.indices()
        self._epoch += 1
        return iter(order)


def _process_shard(options: Options, dataset: Any, combined_batch_size: int | None, shuffle: bool,
                   drop_last: bool, kwargs: dict[str, Any]) -> _ProcessShardSampler:
    where = user_source_line()
    processes, process_id = options.Distributed.numProcesses, options.Distributed.processId
    context = f"process {process_id} of {processes}"
    if combined_batch_size is None:
        raise OptionsError(f"DataLoader: batch_size=None cannot be split over {processes} processes ({context})",
                           where=where, fix="pass a micro-batch size, e.g. batch_size=1")
    for name in ("sampler", "batch_sampler"):
        if kwargs.get(name) is not None:
            raise OptionsError(
                f"DataLoader: a custom {name} cannot be combined with sharding the dataset over {processes} "
                f"processes ({context})", where=where,
                fix="pass auto_distributed_partitioning=False and shard the samples in your sampler")
    if shuffle and options.random_seed is None:
        raise OptionsError(
            f"DataLoader: shuffle=True over {processes} processes needs options.randomSeed(...) so that every "
            f"process draws the same permutation of the dataset ({context})", where=where,
            fix="call options.randomSeed(seed) with the same seed in every process (as upstream requires)")
    try:
        num_samples = len(dataset)
    except TypeError:
        raise InvalidArgumentError(
            f"DataLoader: the dataset has no len(), so it cannot be split over {processes} processes",
            where=where, fix="give the dataset a __len__, or pass auto_distributed_partitioning=False") from None
    if drop_last:
        per_process = combined_batch_size * (num_samples // (combined_batch_size * processes))
    else:
        per_process = -(-num_samples // processes)
    return _ProcessShardSampler(num_samples, per_process, process_id, options.random_seed if shuffle else None)


# -- Async: background prefetching ----------------------------------------------------
class _End:
    """Queue marker: the source is exhausted."""


class _Failure:
    """Queue marker: the source raised ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _put(out: queue.Queue, item: object, stop: threading.Event) -> bool:
    """Put ``item`` unless ``stop`` is set first; True when it was put."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterator[Any], out: queue.Queue, stop: threading.Event) -> None:
    """Thread body: move batches from ``source`` to ``out`` until exhausted or stopped.

    It holds no reference to the consumer, so an abandoned iterator can be
    garbage-collected (which stops this thread).
    """
    try:
        for item in source:
            if not _put(out, item, stop):
                return
    except BaseException as error:  # noqa: BLE001 - re-raised in the consumer's thread
        _put(out, _Failure(error), stop)
        return
    _put(out, _End(), stop)


class Prefetcher:
    """An iterator over ``source`` read ahead by a daemon thread into a bounded queue
    (one Async epoch); an error raised by ``source`` is re-raised by ``__next__``."""

    def __init__(self, source: Iterator[Any], buffer_size: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=buffer_size)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=_produce, args=(source, self._queue, self._stop),
                                        name="ipuxl-dataloader-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    # Stopped by close() from elsewhere: nothing more will come.
                    self._finished = True
                    raise StopIteration from None
        if isinstance(item, _End):
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            error = item.error
            error.add_note("(raised while the ipuxl DataLoader was reading ahead in its Async background thread)")
            raise error
        return item

    def close(self) -> None:
        """Stop the background thread and drop the batches read ahead."""
        self._finished = True
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=_JOIN_TIMEOUT_S)
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def __del__(self) -> None:
        if "_thread" in self.__dict__:
            self.close()
