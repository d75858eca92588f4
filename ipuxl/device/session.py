"""``Session``: compile an IR once, own its variables, run the main program.

Compilation lowers every graph once to fx-generated Python (``device.compiler``; a graph
called from one site is inlined), then the device's rewrites (``device.rewrites``) fuse ops.

Host transfers are PopXL's: ``run`` runs the main program once, and every execution
of a ``host_load``/``host_store`` (in the main graph, a called graph or an
``ops.repeat`` body) takes or gives the next of its stream's ``num_host_transfers``
slices. The run stages each stream's data once and hands the compiled program one
cursor per stream (``kernels.host_io``); a load in a loop body is a ``next`` on it.
How often each stream is transferred per run is static (call and repeat counts
are; of a conditional's two branches only the one taken transfers, so there the
count is at most that of the busier branch), so a program that may transfer a stream
more times than ``num_host_transfers`` is refused before it runs (PopXL would wrap around).

Weights live twice, as on an IPU: host buffers (numpy) and device storage (``device.variables``);
``with session:`` attaches, copies host -> device on entry and back on exit, as PopXL's does.

A *step* is one host transfer: step k is the work between the k-th and the
(k+1)-th slice of the streams (in a device loop, iteration k of the ``ops.repeat``
whose body loads the batch). A run that fails in step k of n (``DeviceError``;
k: the most slices any stream had taken when it failed) keeps what it did: steps
1..k-1 stay applied, host and device agree on them (the next read of a variable
syncs, and the exit of the ``with`` block copies them back, as after a successful
run), and the next run continues from them. In-place updates that step k made before
its failing op stay too; the error names them, with the failing op and the user's
line that built it (``device.failures``: found off the hot path, by running the
program again node by node on copies of the variables).

A Session compiles its IR once: a variable, replica count or ``num_host_transfers``
changed afterwards is refused with an error, never run half-way.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np
import torch

from ipuxl.device import host_data
from ipuxl.device.built import Built
from ipuxl.device.device_info import DeviceInfo, attach, session_device
from ipuxl.device.cuda_graphs import GraphedRuns, enabled as cuda_graphs_enabled, host_reads
from ipuxl.device.compiler import CompiledGraph, Compiler, replica_program
from ipuxl.device.failures import StepFailure, step_error, transfer_in_progress
from ipuxl.device.host_memory import keep_freed_memory, release_freed_memory
from ipuxl.device.profile import Profile, labelled_programs, profile_runs
from ipuxl.device.replica_plan import plan_replicas
from ipuxl.device.replicas import Communicator, ensure_process_group, run_replicas
from ipuxl.device.report import ProgramReport, program_report
from ipuxl.device.resources import IpuSpec, check_fits
from ipuxl.device.variables import DeviceVariables, attr_of, constant_value
from ipuxl import fp8_utils
from ipuxl.dtypes import DOWNCAST, dtype_name, to_numpy_dtype
from ipuxl.errors import (
    DetachedError, DeviceError, InvalidArgumentError, IpuxlError, ReplicaFailureError,
    StreamInputError,
)
from ipuxl.ir.aliases import storage_owner, written_nodes
from ipuxl.ir.calls import call_nodes, does_host_io, reachable_graphs, transfer_counts
from ipuxl.log import logger
from ipuxl.ir.graph import Graph
from ipuxl.ir.ir import Ir
from ipuxl.ir.meta import BY_REF_ARGS, ROLE, STREAM, Role
from ipuxl.ir.streams import DeviceToHostStream, HostToDeviceStream, Stream
from ipuxl.ir.tensor import Constant, Tensor, Variable
from ipuxl.kernels.host_io import stream_cursors
from ipuxl.progress import graph_sizes, pipeline, stage

__all__ = ["Session", "DeviceType", "device_for", "CompiledGraph"]

DeviceType = Literal["ipu_model", "cpu", "ipu_hw"]


def _device_memory(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``method`` with ``torch.inference_mode`` off: the device's storage holds ordinary
    tensors that its programs update in place, also when the caller is in inference mode
    (a Lightning validation loop) and in the replicas' threads (which never are)."""
    @functools.wraps(method)
    def outside_inference_mode(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode(False):
            return method(*args, **kwargs)

    return outside_inference_mode


def device_for(device_type: str) -> torch.device:
    """The torch device a device type runs on: ``ipu_hw`` is the fastest local one."""
    if device_type in ("ipu_model", "cpu"):
        return torch.device("cpu")
    if device_type == "ipu_hw":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    raise InvalidArgumentError(f"unknown device type {device_type!r}",
                               fix="use 'ipu_model', 'cpu' or 'ipu_hw'")


class Session:
    """Runs an ``Ir`` on a simulated device.

    Args:
        ir: the program. It should not be changed after the session is created.
        device_desc: ``"ipu_model"``, ``"cpu"`` (both run on the CPU) or ``"ipu_hw"``
            (CUDA when present, else CPU), or a ``popart.DeviceInfo`` from
            ``popart.DeviceManager`` (``device.device_info``; an attached one attaches the session).
        storage: ipuxl only: tensors to use as the device storage of some variables
            (the first local replica's), without a copy. Each must be contiguous, on the
            session's device, with the variable's shape and dtype; the program then reads
            and updates it in place, so its owner sees the device's values at once.
            ``trainingModel`` uses it to make the host module's parameters the device's.

    Example:
        >>> with ipuxl.Session(ir, "cpu") as session:
        ...     outputs = session.run({x_stream: np.ones((2,), np.float32)})
    """

    @_device_memory
    def __init__(self, ir: Ir, device_desc: DeviceType | DeviceInfo = "cpu", *,
                 storage: Mapping[Variable, torch.Tensor] | None = None):
        self.ir = ir
        # PopART's device (``device.device_info``); ``device`` is ipuxl's: the torch device it runs on
        self._device, self.device_type = session_device(device_desc, ir.num_ipus, ir.instance_replication_factor)
        self.device = self._torch_device = device_for(self.device_type)
        if self._torch_device.type == "cpu":
            keep_freed_memory()  # the device's memory is kept between steps (device.host_memory)
        self._built = Built.of(ir)
        self._plan = plan_replicas(ir)
        if self.device_type == "ipu_model":  # the IPU resource model: fail before compiling when it cannot fit
            check_fits(ir)
        if self._plan.distributed:
            ensure_process_group(self._torch_device)
        replicated = ir.replication_factor > 1
        self._comm = Communicator(ir.replication_factor, self._plan.local, self._plan.distributed) if replicated else None
        self._enter_stack: list[bool | DeviceInfo] = []
        self._host_in_sync = True
        self._variables = DeviceVariables(ir, self._plan, self._torch_device, self._built.created_at, storage)
        self._records = self._variables.records
        self._memory = self._variables.memory  # remote buffers (device.streaming_memory)
        self._replica_vars = self._variables.replicas
        self._device_vars = self._replica_vars[0]
        self._transfers = transfer_counts(ir.main_graph)  # per stream: loads or stores per run (at most)
        self._fewest_transfers = transfer_counts(ir.main_graph, fewest=True)  # a conditional's branch may not run
        self._streams: list[Stream] = [s for s in ir.streams if s in self._transfers]  # the cursors' order
        self._io_index = {s: i for i, s in enumerate(self._streams)}
        self._takes_io = does_host_io(ir.main_graph)
        self._compiler = Compiler(ir, self._torch_device, self._io_index)
        self._compiled = self._compiler.compiled
        # inside trainingModel's pipeline a stage of it; alone, a compile of its own (bar, INFO log)
        with pipeline("the session's IR", ["compile"], sizes=lambda: graph_sizes(ir.graphs)), stage("compile"):
            self._program = self._compiler.compile(ir.main_graph, self._device_vars)
            self._compiler.pad_matrices(self._program, self._replica_vars, bound={attr_of(t) for t in storage or {}})
            self._modules = [self._program] + [replica_program(self._program, v) for v in self._replica_vars[1:]]
        self._forwards = [m.forward for m in self._modules]
        self._graphed = (GraphedRuns(self._program.forward, lambda f, b: self._execute(f, b, 0),
                                     refused=host_reads([self._program, *(c.module for c in self._compiled.values())]))
                         if cuda_graphs_enabled(self._torch_device, len(self._plan.local)) else None)
        self._h2d = [s for s in self._streams if isinstance(s, HostToDeviceStream)]
        self._d2h = [s for s in self._streams if isinstance(s, DeviceToHostStream)]
        self._written_inputs = _written_streams(ir)
        self._progress = [0] * len(self._plan.local)  # steps each local replica completed in the last run
        self._warned_short_transfers = False
        self._failed_run: IpuxlError | None = None  # the error of this session's last failed run, for __exit__
        self._runs = 0
        if self.is_attached:  # a device the user attached: entering the context will not set it up
            self.weights_from_host()

    # -- reports, profile, code ---------------------------------------------------------
    @property
    def num_ipus(self) -> int:
        """IPUs the program uses per replica (``popxl.ipu(n)`` placement: 1 + the largest id)."""
        return self.ir.num_ipus

    def report(self, spec: IpuSpec | None = None) -> ProgramReport:
        """The program's report: op counts, code size, call sites, memory per IPU (``spec``:
        default the configured one) and FLOPs (``ipuxl.device.report``)."""
        return program_report(self.ir, spec)

    def profile(self, inputs: Mapping[HostToDeviceStream, Any] | None = None, *, runs: int = 3, warmup: int = 1,
                top: int = 20, trace_path: str | os.PathLike[str] | None = None, downcast_inputs: bool = True,
                run_fn: Callable[[], object] | None = None) -> Profile:
        """ipuxl only: run the program ``warmup`` times, then ``runs`` times under
        ``torch.profiler``, every op labelled by its graph, op and source line
        (``ipuxl.device.profile``). Profiled runs are real runs: they update the
        variables as ``run`` does.

        Args:
            inputs: the data of each run, as for ``run``.
            runs: runs to profile; warmup: runs before them, not profiled.
            top: rows ``print(profile)`` shows.
            trace_path: where to write the Chrome/Perfetto trace JSON (None: not written).
            downcast_inputs: as for ``run``.
            run_fn: what one run is (default ``self.run(inputs, downcast_inputs)``);
                ``PoplarExecutor.profile`` passes a call of the model.

        Returns:
            The ``Profile``: ``print`` it for the most expensive ops and their share.

        Raises:
            DetachedError: the session is not attached, as for ``run``.
            InvalidValueError: ``runs`` or ``top`` < 1, or ``warmup`` < 0.
            UnsupportedError: more than one local replica (they run in threads the profiler does not see).

        Example:
            >>> with session:
            ...     print(session.profile({x_stream: data}, runs=3, trace_path="trace.json"))
        """
        self._require_attached("profile")
        labelled = labelled_programs(self.ir, self._modules, self.compiled_graph)
        saved, self._forwards = self._forwards, labelled
        try:
            return profile_runs(run_fn or (lambda: self.run(inputs, downcast_inputs)), runs=runs, warmup=warmup,
                                top=top, trace_path=trace_path)
        finally:
            self._forwards = saved

    @property
    def cuda_graphs(self) -> GraphedRuns | None:
        """ipuxl only: how runs replay as CUDA graphs (``device.cuda_graphs``); None off CUDA."""
        return self._graphed

    @property
    def code(self) -> str:
        """The generated Python code of the main program."""
        return self._program.code

    # -- what was compiled (read-only) ------------------------------------------------------------
    @property
    def num_host_transfers(self) -> int:
        """Slices of each stream per ``run`` (steps): the IR's ``num_host_transfers`` when
        the session compiled it."""
        return self._built.steps

    @property
    def transfers_per_run(self) -> dict[Stream, int]:
        """ipuxl only: how many times the program loads or stores each stream in one run
        (counting calls and ``ops.repeat`` iterations; of a conditional's branches, the busier);
        none may exceed ``num_host_transfers``."""
        return dict(self._transfers)

    @property
    def local_replicas(self) -> list[int]:
        """The replicas this process runs, by global index (all of them unless under torchrun)."""
        return list(self._plan.local)

    @property
    def programs(self) -> tuple[torch.fx.GraphModule, ...]:
        """The compiled main program of each local replica: one code, each its replica's variables."""
        return tuple(self._modules)

    def compiled_graph(self, graph: Graph) -> CompiledGraph | None:
        """The compiled code of a called ``graph``; None when every call of it was inlined."""
        return self._compiled.get(graph)

    @property
    def applied_rewrites(self) -> dict[Graph, tuple[str, ...]]:
        """ipuxl only: for each graph compiled to code of its own (the main graph and the
        called graphs not inlined everywhere), the device rewrites (``ipuxl.device.rewrites``)
        that changed it, in the order they ran."""
        return dict(self._compiler.applied)

    @property
    def steps_completed(self) -> tuple[int, ...]:
        """The steps (host transfers, see the module docstring) of the last ``run`` each local
        replica completed (in ``local_replicas`` order)."""
        return tuple(self._progress)

    # -- attach / detach ---------------------------------------------------------------
    @property
    def is_attached(self) -> bool:
        return self._device.isAttached

    @_device_memory
    def __enter__(self) -> "Session":
        was_attached = self.is_attached
        if was_attached:
            self._enter_stack.append(True)
        else:  # an offline device is swapped for a hardware one until the context ends
            device, self._device = self._device, attach(self._device, self._device.numIpus)
            self._enter_stack.append(device if device is not self._device else False)
            self.weights_from_host()
        return self

    @_device_memory
    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        was_attached = self._enter_stack.pop()
        if was_attached is not True:
            try:
                # Another exception leaves the host values as they were; a failed run of this
                # session does not: its applied steps are kept (see the module docstring).
                if exc_type is None or (exc and exc[0] is self._failed_run):
                    self.weights_to_host()
            finally:
                self._device.detach()
                if isinstance(was_attached, DeviceInfo):
                    self._device = was_attached
                self._failed_run = None
                self.free_buffers()

    def free_buffers(self) -> None:
        """ipuxl only: free the memory plan's buffers (``device.memory_plan``; made again on use)."""
        self._compiler.workspace.clear()
        if self._graphed is not None:  # its graph reads the freed arenas
            self._graphed.invalidate()

    def _require_attached(self, what: str) -> None:
        if not self.is_attached:
            raise DetachedError(
                f"Must be attached to device before calling a runtime function (Session.{what}). Put the call "
                "inside a `Session` context, for example `with session: session.run()`.",
                fix="put the call inside the session context: `with session: session.run(...)`")

    # -- running ------------------------------------------------------------------------
    def expected_inputs(self) -> list[HostToDeviceStream]:
        return list(self._h2d)

    @property
    def replication_factor(self) -> int:
        return self._built.replicas

    def create_host_outputs(self) -> dict[DeviceToHostStream, np.ndarray]:
        return {s: np.empty(self._full_shape(s.shape), to_numpy_dtype(s.dtype)) for s in self._d2h}

    @_device_memory
    def run(self, inputs: Mapping[HostToDeviceStream, Any] | None = None,
            downcast_inputs: bool = True) -> dict[DeviceToHostStream, np.ndarray]:
        """Run the main program once; each executed host load/store takes/gives its stream's next slice.

        Args:
            inputs: one array (numpy or torch) per loaded stream, shaped
                ``(num_host_transfers, replication_factor, *stream.shape)``, each of the
                two leading dims dropped when it is 1. Under torchrun a process may
                give all replicas' data (it takes its own) or only its replicas'.
            downcast_inputs: accept 64-bit data for 32-bit streams.

        Returns:
            ``{d2h_stream: array}`` shaped like the inputs, all replicas included.

        Raises:
            StreamInputError: the program loads or stores a stream another number of
                times than ``num_host_transfers``, or the data does not fit the streams.
            DeviceError: a step failed. Its ``steps_applied`` steps stay applied (the
                variables hold their values after them; ``step``, ``failed_op`` and
                ``source`` say where it failed). See the module docstring.
        """
        results = self.run_on_device(inputs, downcast_inputs)
        return dict(zip(results, host_data.to_host(list(results.values()), [self._full_shape(s.shape) for s in results])))

    @_device_memory
    def run_on_device(self, inputs: Mapping[HostToDeviceStream, Any] | None = None,
                      downcast_inputs: bool = True) -> dict[DeviceToHostStream, torch.Tensor]:
        """ipuxl only: ``run`` with the stored outputs left on the device (``num_host_transfers x
        replicas x shape`` elements each, valid until the next run): the caller takes what it needs."""
        self._require_attached("run")
        self._built.check_unchanged(self.ir, self._records)
        self._memory.check_unchanged(self.ir, self._built.created_at)
        self._check_transfer_counts()
        self._check_keys(inputs or {})
        data = inputs or {}
        self._progress = [0] * len(self._plan.local)
        comm = self._comm
        try:
            if comm is None:
                results = self._run_one(data, downcast_inputs)
            else:
                results = self._run_replicas(comm, data, downcast_inputs)
        except StepFailure as failure:
            with self._memory.copy_running(failure.index):  # the re-run that finds the op reads a copy
                error = step_error(self, failure)
            self._failed_run = error  # its applied steps are kept: __exit__ copies them to the host
            raise error from failure.exc
        except ReplicaFailureError as stopped:  # stopped by another process's replica
            if stopped.steps_applied is None:
                stopped.steps_applied = min(self._progress)
            self._failed_run = stopped
            raise
        self._runs += 1
        if self._runs == 1:  # what compiling and the first run's one-time work freed is not kept (device.host_memory)
            release_freed_memory()
        return dict(zip(self._d2h, results))

    def _run_one(self, data: Mapping[HostToDeviceStream, Any], downcast: bool) -> list[torch.Tensor]:
        n = self._built.steps
        loaded = {s: self._stream_input(s, data.get(s), downcast).reshape(n, *s.shape) for s in self._h2d}
        outputs: dict[Stream, torch.Tensor] = {
            s: self._output_buffer(s, (n, *s.shape)) for s in self._d2h}
        buffers = [loaded[s] if isinstance(s, HostToDeviceStream) else outputs[s] for s in self._streams]
        if self._graphed is None:
            self._execute(self._forwards[0], buffers, 0)
        else:  # a CUDA graph per run (device.cuda_graphs): its outputs are in the graph's static buffers
            self._host_in_sync = False  # as _execute says, which a replay does not run
            kinds = [isinstance(s, HostToDeviceStream) for s in self._streams]
            ran = dict(zip(self._streams, self._graphed.run(self._forwards[0], buffers, kinds)))
            self._progress[0] = self._built.steps
            outputs = {s: ran[s] for s in self._d2h}
        return [outputs[s] for s in self._d2h]

    def _run_replicas(self, comm: Communicator, data: Mapping[HostToDeviceStream, Any],
                      downcast: bool) -> list[torch.Tensor]:
        n, local = self._built.steps, self._plan.local
        loaded = {s: self._stream_input(s, data.get(s), downcast) for s in self._h2d}  # (n, local, *shape)
        outputs: dict[Stream, torch.Tensor] = {
            s: self._output_buffer(s, (n, len(local), *s.shape)) for s in self._d2h}

        def work(i: int) -> Callable[[], None]:
            buffers = [(loaded[s] if isinstance(s, HostToDeviceStream) else outputs[s])[:, i] for s in self._streams]
            return lambda: self._execute(self._forwards[i], buffers, i)

        run_replicas(comm, [work(i) for i in range(len(local))])
        if self._plan.distributed:  # values held only in other processes (shards, groups), for host reads
            self._variables.gather_elsewhere(lambda t: comm.gather_processes(t, 0))
        return [comm.gather_processes(outputs[s], 1) for s in self._d2h]

    def _execute(self, forward: Callable[..., Any], buffers: Sequence[torch.Tensor], index: int) -> None:
        """Run the main program once over the streams' run buffers (``index``: the local
        replica). Records the steps it completed; a failure leaves as ``StepFailure``
        (with the buffers, for ``failures.step_error``)."""
        cursors = stream_cursors(buffers) if self._takes_io else None
        # From here on the device may hold newer variables than the host, however the
        # run ends (a failed step's applied steps are kept): the next read syncs.
        self._host_in_sync = False
        try:
            with self._memory.running(index):
                if cursors is None:
                    forward()
                else:
                    forward(cursors)
        except Exception as exc:  # a kernel's error, of any type: reported with its type kept
            step = self._progress[index] = transfer_in_progress(cursors, self._built.steps)
            if isinstance(exc, IpuxlError):
                raise
            raise StepFailure(exc, step, index, tuple(buffers)) from exc
        except BaseException:
            self._progress[index] = transfer_in_progress(cursors, self._built.steps)
            raise
        self._progress[index] = self._built.steps

    def _check_transfer_counts(self) -> None:
        """Refuse a program that loads or stores a stream more than ``num_host_transfers``
        times per run; warn (once) when no stream takes all of them.

        A stream transferred k < n times reads (or fills) the first k of its n slices each
        run, as PopART's step IO does (Graphcore's applications load the learning rate once
        while the batch streams take one slice per accumulation step). Slices a stream does
        not fill stay zero. When no stream takes the n transfers, it is logged."""
        n = self._built.steps
        counts = {s: self._transfers[s] for s in self._h2d + self._d2h}
        for stream, count in counts.items():
            if count <= n:
                continue
            verb, op = ("loaded", "host_load") if isinstance(stream, HostToDeviceStream) else ("stored", "host_store")
            raise StreamInputError(
                f"Session.run: stream '{stream.name}' is {verb} {count} time(s) per run (its {op} ops, "
                f"counting calls and ops.repeat iterations), but ir.num_host_transfers is {n}: each execution "
                f"of {op} takes the next of the stream's num_host_transfers slices",
                where=f"Session of {self.ir!r}, created at {self._built.created_at}",
                fix=f"set ir.num_host_transfers = {count} before creating the Session, or change the program "
                    f"to {op} '{stream.name}' {n} times per run (e.g. ops.repeat(step_graph, {n}) with the "
                    f"{op} in the body)")
        if counts and n not in counts.values() and not self._warned_short_transfers:
            self._warned_short_transfers = True
            short = ", ".join(f"'{s.name}' {c}" for s, c in counts.items())
            logger.warning(f"Session.run: ir.num_host_transfers is {n} but no stream is transferred {n} times per "
                           f"run ({short}): each run uses only the first slices of every stream (PopART's step "
                           f"IO); set ir.num_host_transfers to the transfers per run, or ops.repeat the step "
                           f"(created at {self._built.created_at})")

    def _output_buffer(self, stream: DeviceToHostStream, shape: tuple[int, ...]) -> torch.Tensor:
        """The run's buffer of a stored stream: zeros where the program stores it fewer times
        than ``num_host_transfers`` (those slices stay as they are), or may (a store in a
        conditional's branch), else uninitialised."""
        make = torch.zeros if self._fewest_transfers[stream] < self._built.steps else torch.empty
        return make(shape, dtype=stream.spec.dtype, device=self._torch_device)

    def run_with_outputs(self, inputs: Mapping[HostToDeviceStream, Any] | None = None,
                         outputs: Mapping[DeviceToHostStream, np.ndarray] | None = None,
                         downcast_inputs: bool = True) -> None:
        """Like ``run``, writing results into the given arrays."""
        results = self.run(inputs, downcast_inputs)
        for stream, array in (outputs or {}).items():
            array[...] = results[stream]

    def _full_shape(self, shape: tuple[int, ...], replicas: int | None = None) -> tuple[int, ...]:
        """Host data shape: ``(num_host_transfers, replicas, *shape)`` without dims of size 1."""
        return host_data.full_shape(shape, self._built.steps, self._built.replicas if replicas is None else replicas)

    def _full_input_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """PopXL's (private, but Graphcore's programs call it): the host data shape of a
        stream of ``shape`` for this process, ``(num_host_transfers, instance replicas,
        *shape)`` without dims of size 1."""
        return self._full_shape(tuple(shape), len(self._plan.local))

    def _check_keys(self, inputs: Mapping[Any, Any]) -> None:
        """Refuse data for streams the program does not load."""
        unexpected = [getattr(k, "name", repr(k)) for k in inputs if k not in self._h2d]
        if unexpected:
            raise StreamInputError(
                f"Session.run got inputs for streams the program does not load: {unexpected}",
                fix=f"pass exactly the streams loaded with ops.host_load: {[s.name for s in self._h2d]}")

    def _stream_input(self, stream: HostToDeviceStream, data: Any, downcast: bool) -> torch.Tensor:
        """The data of one stream on the device; with replicas shaped ``(n, local replicas, *shape)``."""
        if data is None:
            raise StreamInputError(
                f"Session.run: no data for input stream '{stream.name}'",
                fix=f"pass {{stream: array}} for every loaded stream: {[s.name for s in self._h2d]}")
        # The program may update a loaded tensor in place; that must never write the
        # caller's data, so such streams (only those) get a private copy.
        private = stream in self._written_inputs
        if isinstance(data, torch.Tensor):
            tensor = data.detach()
        else:
            array = np.asarray(data)
            if private or not (array.flags.c_contiguous and array.flags.writeable):
                array = np.array(array, order="C")
                private = False
            tensor = fp8_utils.to_tensor(array)
        tensor = self._replica_slice(stream, tensor)
        if tensor.dtype != stream.spec.dtype:
            if not (downcast and DOWNCAST.get(tensor.dtype) == stream.spec.dtype):
                raise StreamInputError(
                    f"Session.run: input stream '{stream.name}' expects dtype {dtype_name(stream.dtype)}, "
                    f"got {dtype_name(tensor.dtype)}",
                    fix=f"convert the data, e.g. array.astype(np.{to_numpy_dtype(stream.dtype)})")
        return tensor.to(self._torch_device, stream.spec.dtype, copy=private)

    def _replica_slice(self, stream: HostToDeviceStream, tensor: torch.Tensor) -> torch.Tensor:
        """Check the host data's shape; with replicas, keep this process's replicas."""
        return host_data.replica_slice(stream, tensor, steps=self._built.steps, replicas=self._built.replicas,
                                       local=self._plan.local, distributed=self._plan.distributed,
                                       replicated=self._comm is not None, where=f"Session of {self.ir!r}")

    # -- weights (device.variables) --------------------------------------------------------
    def bind_storage(self, tensor: Variable, given: torch.Tensor) -> None:
        """ipuxl only: from now on ``given`` is the device storage of ``tensor`` (first local
        replica), as with ``Session(storage=...)``; the variable takes ``given``'s values."""
        attr, storage = self._variables.bind(tensor, given)
        if self._graphed is not None:  # its graph reads the old storage
            self._graphed.invalidate()
        setattr(self._program, attr, storage)

    @_device_memory
    def weights_to_host(self) -> None:
        """Copy every variable from the device to its host buffer.

        Each host row is read from a replica of this process: the group's first
        replica here, or for a group with no replica in this process (torchrun) its
        value as gathered from the other processes after the last run (the host value
        when the host wrote it since). Reading weights never waits for the other
        processes, so a rank may read them alone.
        """
        self._require_attached("weights_to_host")
        self._variables.to_host()
        self._host_in_sync = True

    @_device_memory
    def weights_from_host(self) -> None:
        """Copy every variable's host buffer to the device (each replica its row)."""
        self._require_attached("weights_from_host")
        self._variables.from_host()

    def get_tensor_data(self, tensor: Variable | Constant) -> np.ndarray:
        """The host value of a variable (synced from the device first when attached) or constant.

        As in PopXL, a variable's array is the session's host buffer itself, which
        later syncs overwrite: copy it to keep a snapshot.
        """
        return self.get_tensors_data([tensor])[tensor]

    def get_tensors_data(self, tensors: Any) -> dict[Tensor, np.ndarray]:
        tensors = list(tensors)
        for t in tensors:
            self._variables.check_own(t, (Variable, Constant), "get_tensors_data")
        if self.is_attached and not self._host_in_sync and any(isinstance(t, Variable) for t in tensors):
            self.weights_to_host()
        return {t: self._variables.host_of(t) if isinstance(t, Variable) else constant_value(t) for t in tensors}

    def write_variable_data(self, tensor: Variable, data: Any) -> None:
        """Set a variable's value (host buffer, and the device too when attached)."""
        self.write_variables_data({tensor: data})

    @_device_memory
    def write_variables_data(self, tensors: Mapping[Variable, Any]) -> None:
        """Set several variables; all entries are checked before any is written."""
        arrays = {tensor: self._variables.checked_data(tensor, data) for tensor, data in tensors.items()}
        if self.is_attached and not self._host_in_sync:
            self.weights_to_host()
        self._variables.write(arrays, attached=self.is_attached)


def _written_streams(ir: Ir) -> set[Stream]:
    """Loaded streams whose loaded tensor the program may write in place (their run
    buffers are private copies): written by an op, or passed by reference to a call."""
    found: set[Stream] = set()
    for graph in reachable_graphs(ir):
        roots = set(written_nodes(graph))
        for node in call_nodes(graph):
            roots.update(storage_owner(node.args[i]) for i in node.meta.get(BY_REF_ARGS, ()))
        found.update(r.meta[STREAM] for r in roots if r.meta.get(ROLE) == Role.H2D and STREAM in r.meta)
    return found
