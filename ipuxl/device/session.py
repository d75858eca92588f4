"""``Session``: compile an IR once, own its variables, run the main program.

Compilation lowers every graph once to fx-generated Python (``ir.lower``): a graph
called from many sites is one function, a graph with a single call site is inlined
into its caller, and a matmul gradient feeding an in-place update becomes one fused
``addmm_`` (``device.fuse``). The per-step path is a loop of direct calls
of the main program's generated ``forward`` over pre-sliced stream buffers:
``num_host_transfers`` steps per ``run``, no Python between ops.

Weights live twice, as on an IPU: host buffers (numpy) and device storage (torch
tensors the compiled code updates in place). ``with session:`` attaches, copies
host -> device on entry and device -> host on exit, as PopXL's Session does.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np
import torch

from ipuxl.dtypes import DOWNCAST, dtype_name, to_numpy_dtype
from ipuxl.errors import (
    DetachedError, DeviceError, InvalidArgumentError, IpuxlError, ReplicationError, ShapeMismatchError,
    StreamInputError,
)
from ipuxl.ir.graph import Graph, _identifier
from ipuxl.ir.ir import Ir, VariableRecord
from ipuxl.device.replicas import Communicator, ensure_process_group, run_replicas
from ipuxl.device.dce import eliminate_dead_code
from ipuxl.device.resources import check_fits
from ipuxl.device.fuse import (
    call_random_ops_directly, fuse_adam_steps, fuse_adam_updates, fuse_matmul_updates, select_kernels,
)
from ipuxl.ir.lower import CallTarget, compiled_callee, lower_to_fx
from ipuxl.ir.streams import DeviceToHostStream, HostToDeviceStream
from ipuxl.ir.tensor import Constant, Tensor, Variable
from ipuxl.passes.replicate import plan_replicas

__all__ = ["Session", "DeviceType", "device_for"]

DeviceType = Literal["ipu_model", "cpu", "ipu_hw"]


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
            (CUDA when present, else CPU).

    Example:
        >>> with ipuxl.Session(ir, "cpu") as session:
        ...     outputs = session.run({x_stream: np.ones((2,), np.float32)})
    """

    def __init__(self, ir: Ir, device_desc: DeviceType = "cpu"):
        self.ir = ir
        self.device_type = device_desc
        self.device = device_for(device_desc)
        self._plan = plan_replicas(ir)
        if device_desc == "ipu_model":  # the IPU resource model: fail before compiling when it cannot fit
            check_fits(ir)
        if self._plan.distributed:
            ensure_process_group(self.device)
        replicated = ir.replication_factor > 1
        self._comm = Communicator(ir.replication_factor, self._plan.local, self._plan.distributed) if replicated else None
        self._attached = False
        self._enter_stack: list[bool] = []
        self._host_in_sync = True
        records = ir._variables
        self._records = {r.tensor: r for r in records.values()}
        self._host = {r.tensor: self._initial_host(r) for r in records.values()}
        self._replica_vars = [{attr: self._to_device(self._plan.initial_value(r, replica), r.tensor.dtype)
                               for attr, r in records.items()} for replica in self._plan.local]
        self._device_vars = self._replica_vars[0]
        self._compiled: dict[Graph, Callable[..., tuple]] = {}
        self._call_sites = _count_call_sites(ir)
        self._program = self._compile(ir.main_graph, self._device_vars)
        self._forward = self._program.forward
        self._forwards = [self._forward] + [self._replica_program(v).forward for v in self._replica_vars[1:]]
        self._arguments = self._stream_arguments()
        self._h2d = [s for role, s in self._arguments if role == "h2d"]
        self._written_inputs = {w.meta["ipuxl_stream"] for n in ir.main_graph.fx.nodes
                                for w in n.meta.get("ipuxl_writes", ()) if w.meta.get("ipuxl_role") == "h2d"}
        self._d2h = [s for role, s in self._arguments if role == "d2h"]

    # -- compilation ---------------------------------------------------------------
    def _compile(self, graph: Graph, attrs: dict[str, torch.Tensor] | None = None) -> torch.fx.GraphModule:
        """Lower ``graph`` (inlining graphs with one call site), drop dead code, fuse updates."""
        root, code = lower_to_fx(graph, self._compile_callee, attrs, inline=lambda g: self._call_sites[g] == 1)
        for rewrite in (eliminate_dead_code, fuse_matmul_updates, fuse_adam_steps, fuse_adam_updates,
                        call_random_ops_directly, select_kernels):
            rewrite(code)
        # the Python code is generated once, after the rewrites
        module = torch.fx.GraphModule(root, code, class_name=_identifier(f"ipuxl_{graph.name}"))
        return module.to(self.device)

    def _replica_program(self, variables: dict[str, torch.Tensor]) -> torch.fx.GraphModule:
        """The main program again, reading and updating another replica's variables."""
        module = torch.fx.GraphModule(self._program, self._program.graph, class_name=type(self._program).__name__)
        for attr, tensor in variables.items():
            if hasattr(module, attr):
                setattr(module, attr, tensor)
        return module

    def _compile_callee(self, graph: Graph) -> Callable[..., tuple]:
        if graph not in self._compiled:
            self._compiled[graph] = compiled_callee(graph, self._compile(graph).forward)
        return self._compiled[graph]

    def _stream_arguments(self) -> list[tuple[str, HostToDeviceStream | DeviceToHostStream]]:
        """The main program's arguments in order: ("h2d", stream) inputs and ("d2h", stream) slots."""
        return [(n.meta["ipuxl_role"], n.meta["ipuxl_stream"]) for n in self.ir.main_graph.fx.nodes
                if n.op == "placeholder" and n.meta.get("ipuxl_role") in ("h2d", "d2h")]

    def report(self, spec: Any = None) -> Any:
        """The program's ``ipuxl.report.ProgramReport``: op counts, code size, call sites,
        memory per IPU (``spec``: an ``IpuSpec``, default the configured one) and FLOPs."""
        from ipuxl.report import program_report

        return program_report(self.ir, spec)

    @property
    def code(self) -> str:
        """The generated Python code of the main program."""
        return self._program.code

    # -- attach / detach ---------------------------------------------------------------
    @property
    def is_attached(self) -> bool:
        return self._attached

    def __enter__(self) -> "Session":
        self._enter_stack.append(self._attached)
        if not self._attached:
            self._attached = True
            self.weights_from_host()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        was_attached = self._enter_stack.pop()
        if not was_attached:
            if exc_type is None:
                self.weights_to_host()
            self._attached = False

    def _require_attached(self, what: str) -> None:
        if not self._attached:
            raise DetachedError(
                f"Session.{what} needs the session attached to its device",
                fix="put the call inside the session context: `with session: session.run(...)`")

    # -- running ------------------------------------------------------------------------
    def expected_inputs(self) -> list[HostToDeviceStream]:
        return list(self._h2d)

    @property
    def replication_factor(self) -> int:
        return self.ir.replication_factor

    def create_host_outputs(self) -> dict[DeviceToHostStream, np.ndarray]:
        return {s: np.empty(self._full_shape(s.shape), to_numpy_dtype(s.dtype)) for s in self._d2h}

    def run(self, inputs: Mapping[HostToDeviceStream, Any] | None = None,
            downcast_inputs: bool = True) -> dict[DeviceToHostStream, np.ndarray]:
        """Run the main program ``ir.num_host_transfers`` times; return stored outputs.

        Args:
            inputs: one array (numpy or torch) per loaded stream, shaped
                ``(num_host_transfers, replication_factor, *stream.shape)``, each of the
                two leading dims dropped when it is 1. Under torchrun a process may
                give all replicas' data (it takes its own) or only its replicas'.
            downcast_inputs: accept 64-bit data for 32-bit streams.

        Returns:
            ``{d2h_stream: array}`` shaped like the inputs, all replicas included.
        """
        self._require_attached("run")
        self._check_keys(inputs or {})
        data = inputs or {}
        if self._comm is None:
            results = self._run_one(data, downcast_inputs)
        else:
            results = self._run_replicas(data, downcast_inputs)
        self._host_in_sync = False
        return {s: self._to_host(o, s) for s, o in zip(self._d2h, results)}

    def _run_one(self, data: Mapping[HostToDeviceStream, Any], downcast: bool) -> list[torch.Tensor]:
        n = self.ir.num_host_transfers
        loaded = {s: self._stream_input(s, data.get(s), downcast).reshape(n, *s.shape).unbind(0) for s in self._h2d}
        outputs = [torch.empty((n, *s.shape), dtype=s.dtype, device=self.device) for s in self._d2h]
        slots = {s: o.unbind(0) for s, o in zip(self._d2h, outputs)}
        self._steps(self._forward, [loaded[s] if role == "h2d" else slots[s] for role, s in self._arguments], 0)
        return outputs

    def _run_replicas(self, data: Mapping[HostToDeviceStream, Any], downcast: bool) -> list[torch.Tensor]:
        n, local = self.ir.num_host_transfers, self._plan.local
        loaded = {s: self._stream_input(s, data.get(s), downcast) for s in self._h2d}  # (n, local, *shape)
        outputs = [torch.empty((n, len(local), *s.shape), dtype=s.dtype, device=self.device) for s in self._d2h]
        slots = dict(zip(self._d2h, outputs))

        def work(i: int) -> Callable[[], None]:
            columns = [(loaded[s] if role == "h2d" else slots[s])[:, i].unbind(0) for role, s in self._arguments]
            return lambda: self._steps(self._forwards[i], columns, local[i])

        run_replicas(self._comm, [work(i) for i in range(len(local))])
        return [self._comm.gather_processes(o, 1) for o in outputs]

    def _steps(self, forward: Callable[..., Any], columns: list[Sequence[torch.Tensor]], replica: int) -> None:
        """Run ``forward`` once per device iteration over the per-step argument columns."""
        n = self.ir.num_host_transfers
        steps = list(zip(*columns)) if columns else [()] * n
        step = 0
        try:
            for step, args in enumerate(steps):
                forward(*args)
        except IpuxlError:
            raise
        except (RuntimeError, IndexError, ValueError) as exc:
            replica_part = f", replica {replica} of {self.ir.replication_factor}" if self._comm is not None else ""
            raise DeviceError(
                f"the device program failed in step {step + 1} of {n}{replica_part}: {str(exc).splitlines()[0]}",
                where=f"main program of {self.ir!r} (see session.code)",
                fix="check the data fed to the program (e.g. label or gather indices in range)") from exc

    def run_with_outputs(self, inputs: Mapping[HostToDeviceStream, Any] | None = None,
                         outputs: Mapping[DeviceToHostStream, np.ndarray] | None = None,
                         downcast_inputs: bool = True) -> None:
        """Like ``run``, writing results into the given arrays."""
        results = self.run(inputs, downcast_inputs)
        for stream, array in (outputs or {}).items():
            array[...] = results[stream]

    def _full_shape(self, shape: tuple[int, ...], replicas: int | None = None) -> tuple[int, ...]:
        """Host data shape: ``(num_host_transfers, replicas, *shape)`` without dims of size 1."""
        n = self.ir.num_host_transfers
        r = self.ir.replication_factor if replicas is None else replicas
        return tuple(d for d in (n, r) if d > 1) + tuple(shape)

    def _check_keys(self, inputs: Mapping[Any, Any]) -> None:
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
            tensor = torch.from_numpy(array)
        tensor = self._replica_slice(stream, tensor)
        if tensor.dtype != stream.dtype:
            if not (downcast and DOWNCAST.get(tensor.dtype) == stream.dtype):
                raise StreamInputError(
                    f"Session.run: input stream '{stream.name}' expects dtype {dtype_name(stream.dtype)}, "
                    f"got {dtype_name(tensor.dtype)}",
                    fix=f"convert the data, e.g. array.astype(np.{to_numpy_dtype(stream.dtype)})")
        return tensor.to(self.device, stream.dtype, copy=private)

    def _replica_slice(self, stream: HostToDeviceStream, tensor: torch.Tensor) -> torch.Tensor:
        """Check the host data's shape; with replicas, keep this process's replicas."""
        n, replicas, local = self.ir.num_host_transfers, self.ir.replication_factor, self._plan.local
        got = tuple(tensor.shape)
        if self._comm is None:
            if got != self._full_shape(stream.shape):
                self._raise_shape(stream, got)
            return tensor
        if got == self._full_shape(stream.shape):
            full = tensor.reshape(n, replicas, *stream.shape)
            return full[:, local[0]:local[-1] + 1] if self._plan.distributed else full
        if self._plan.distributed and got == self._full_shape(stream.shape, len(local)):
            return tensor.reshape(n, len(local), *stream.shape)
        self._raise_shape(stream, got)
        raise AssertionError("unreachable")

    def _raise_shape(self, stream: HostToDeviceStream, got: tuple[int, ...]) -> None:
        n, replicas = self.ir.num_host_transfers, self.ir.replication_factor
        expected = self._full_shape(stream.shape)
        axis = 1 if n > 1 else 0
        if (replicas > 1 and len(got) == len(expected)
                and got[:axis] + got[axis + 1:] == expected[:axis] + expected[axis + 1:]):
            local = f" (or {len(self._plan.local)} for this process's replicas)" if self._plan.distributed else ""
            raise ReplicationError(
                f"Session.run: input stream '{stream.name}' has replica dimension {got[axis]} (axis {axis}), "
                f"the program has {replicas} replicas{local}: expected shape {expected}, got {got}",
                where=f"Session of {self.ir!r}",
                fix="give one slice per replica: (num_host_transfers, replication_factor, *stream.shape), "
                    "each leading dim dropped when it is 1")
        raise StreamInputError(
            f"Session.run: input stream '{stream.name}' expects shape {expected} "
            f"(stream shape {stream.shape}, num_host_transfers={n}, replication_factor={replicas}), got {got}",
            fix="give (num_host_transfers, replication_factor, *stream.shape) data, each leading dim dropped "
                "when it is 1")

    def _to_host(self, tensor: torch.Tensor, stream: DeviceToHostStream) -> np.ndarray:
        array = tensor.detach().to("cpu", torch.float32 if tensor.dtype == torch.bfloat16 else tensor.dtype).numpy()
        return array.reshape(self._full_shape(stream.shape))

    # -- weights ------------------------------------------------------------------------
    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.array(array, copy=True)).to(self.device, dtype)

    def _attr(self, tensor: Variable) -> str:
        return tensor.node.target  # type: ignore[return-value]

    def _host_replicas(self, record: VariableRecord) -> list[int] | None:
        """The replica behind each row of a variable's host buffer (None: the buffer is one value).

        PopXL's rule: "one_per_group" keeps one value per group of the variable's
        replica grouping (the group's first replica), "all_replicas" one per replica.
        """
        replicas = self.ir.replication_factor
        if record.retrieval_mode == "all_replicas" and replicas > 1:
            return list(range(replicas))
        grouping = record.replica_grouping(replicas)
        return [members[0] for members in grouping.groups] if grouping.num_groups > 1 else None

    def _initial_host(self, record: VariableRecord) -> np.ndarray:
        rows = self._host_replicas(record)
        if rows is None:
            return np.array(record.data, copy=True)
        return np.stack([self._plan.initial_value(record, r) for r in rows])

    def _host_row(self, record: VariableRecord, replica: int) -> int | None:
        """Which row of the host buffer replica ``replica`` is loaded from."""
        replicas = self.ir.replication_factor
        if record.retrieval_mode == "all_replicas" and replicas > 1:
            return replica
        grouping = record.replica_grouping(replicas)
        return grouping.assignment[replica] if grouping.num_groups > 1 else None

    def weights_to_host(self) -> None:
        """Copy every variable from the device to its host buffer.

        Each host row is read from a replica of this process: the group's first
        replica here, or for a group with no replica in this process (torchrun) the
        row keeps its last host value. Reading weights never needs the other
        processes, so a rank may read them alone without waiting for the others.
        """
        self._require_attached("weights_to_host")
        local = self._plan.local
        for tensor, host in self._host.items():
            record, attr = self._records[tensor], self._attr(tensor)
            rows = self._host_replicas(record)
            if rows is None:
                value = self._device_vars[attr].detach().to("cpu")
                host[...] = value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy()
                continue
            for row, replica in enumerate(rows):
                source = self._local_member(record, replica)
                if source is not None:
                    value = self._replica_vars[local.index(source)][attr].detach().to("cpu")
                    host[row] = value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy()
        self._host_in_sync = True

    def _local_member(self, record: VariableRecord, replica: int) -> int | None:
        """``replica`` if it runs here, else (one_per_group) a member of its group that does."""
        local = set(self._plan.local)
        if replica in local:
            return replica
        if record.retrieval_mode == "all_replicas":
            return None
        members = record.replica_grouping(self.ir.replication_factor).members(replica)
        return next((m for m in members if m in local), None)

    def weights_from_host(self) -> None:
        """Copy every variable's host buffer to the device (each replica its row)."""
        self._require_attached("weights_from_host")
        for tensor, host in self._host.items():
            self._load_replicas(tensor, host)

    def _load_replicas(self, tensor: Variable, host: np.ndarray) -> None:
        record, attr = self._records[tensor], self._attr(tensor)
        for replica, variables in zip(self._plan.local, self._replica_vars):
            row = self._host_row(record, replica)
            variables[attr].copy_(torch.from_numpy(host if row is None else host[row]))

    def get_tensor_data(self, tensor: Variable | Constant) -> np.ndarray:
        """The host value of a variable (synced from the device first when attached) or constant.

        As in PopXL, a variable's array is the session's host buffer itself, which
        later syncs overwrite: copy it to keep a snapshot.
        """
        return self.get_tensors_data([tensor])[tensor]

    def get_tensors_data(self, tensors: Any) -> dict[Tensor, np.ndarray]:
        tensors = list(tensors)
        for t in tensors:
            self._check_own(t, (Variable, Constant), "get_tensors_data")
        if self._attached and not self._host_in_sync and any(isinstance(t, Variable) for t in tensors):
            self.weights_to_host()
        return {t: self._host[t] if isinstance(t, Variable) else _constant_value(t) for t in tensors}

    def write_variable_data(self, tensor: Variable, data: Any) -> None:
        """Set a variable's value (host buffer, and the device too when attached)."""
        self.write_variables_data({tensor: data})

    def write_variables_data(self, tensors: Mapping[Variable, Any]) -> None:
        """Set several variables; all entries are checked before any is written."""
        arrays = {tensor: self._checked_variable_data(tensor, data) for tensor, data in tensors.items()}
        if self._attached and not self._host_in_sync:
            self.weights_to_host()
        for tensor, array in arrays.items():
            self._host[tensor][...] = array
            if self._attached:
                self._load_replicas(tensor, self._host[tensor])

    def _checked_variable_data(self, tensor: Variable, data: Any) -> np.ndarray:
        self._check_own(tensor, (Variable,), "write_variables_data")
        array = np.asarray(data)
        expected = to_numpy_dtype(tensor.dtype)
        if array.dtype != expected and not (array.ndim == 0 and np.isscalar(data)):
            raise InvalidArgumentError(
                f"write_variables_data: data for variable '{tensor.name}' has dtype {array.dtype}, "
                f"the variable is {dtype_name(tensor.dtype)}", fix=f"convert with .astype(np.{expected})")
        expected_shape = self._host[tensor].shape
        if array.shape != expected_shape:
            rows = "" if expected_shape == tensor.shape else \
                f" ({expected_shape[0]} rows: one per {'replica' if self._records[tensor].retrieval_mode == 'all_replicas' else 'replica group'})"
            raise ShapeMismatchError(
                f"write_variables_data: data for variable '{tensor.name}' has shape {array.shape}, "
                f"the variable's host data has shape {expected_shape}{rows}", fix="reshape the data to the variable's host shape")
        return array

    def _check_own(self, tensor: Any, kinds: tuple[type, ...], what: str) -> None:
        if not isinstance(tensor, kinds):
            raise InvalidArgumentError(
                f"{what}: {tensor!r} is not a {' or '.join(k.__name__ for k in kinds)}",
                fix="pass tensors created with ipuxl.variable (or ipuxl.constant)")
        if tensor.graph.ir is not self.ir:
            raise InvalidArgumentError(
                f"{what}: tensor '{tensor.name}' belongs to another Ir than this session's",
                fix="copy values between IRs with session_a.get_tensors_data + session_b.write_variables_data")


def _count_call_sites(ir: Ir) -> Counter[Graph]:
    """How many call/repeat nodes of the whole IR call each graph."""
    return Counter(node.target.graph for graph in ir.graphs for node in graph.fx.nodes
                   if isinstance(node.target, CallTarget))


def _constant_value(tensor: Constant) -> np.ndarray:
    value = tensor.graph.constants[tensor.node.target]
    return value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy()
