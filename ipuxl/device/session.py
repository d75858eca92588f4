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
from typing import Any, Callable, Literal, Mapping

import numpy as np
import torch

from ipuxl.dtypes import DOWNCAST, dtype_name, to_numpy_dtype
from ipuxl.errors import DetachedError, DeviceError, InvalidArgumentError, ShapeMismatchError, StreamInputError
from ipuxl.ir.graph import Graph
from ipuxl.ir.ir import Ir
from ipuxl.device.dce import eliminate_dead_code
from ipuxl.device.fuse import call_random_ops_directly, fuse_adam_steps, fuse_adam_updates, fuse_matmul_updates
from ipuxl.ir.lower import CallTarget, compiled_callee, lower_graph
from ipuxl.ir.streams import DeviceToHostStream, HostToDeviceStream
from ipuxl.ir.tensor import Constant, Tensor, Variable

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
        if ir.replication_factor != 1:
            raise InvalidArgumentError(
                f"Session: replication_factor {ir.replication_factor} is not supported yet",
                fix="use Ir(replication=1); data-parallel replicas are planned")
        self.ir = ir
        self.device_type = device_desc
        self.device = device_for(device_desc)
        self._attached = False
        self._enter_stack: list[bool] = []
        self._host_in_sync = True
        records = ir._variables
        self._host = {r.tensor: np.array(r.data, copy=True) for r in records.values()}
        self._device_vars = {attr: self._to_device(r.data, r.tensor.dtype) for attr, r in records.items()}
        self._compiled: dict[Graph, Callable[..., tuple]] = {}
        self._call_sites = _count_call_sites(ir)
        self._program = self._compile(ir.main_graph, self._device_vars)
        self._forward = self._program.forward
        self._arguments = self._stream_arguments()
        self._h2d = [s for role, s in self._arguments if role == "h2d"]
        self._written_inputs = {w.meta["ipuxl_stream"] for n in ir.main_graph.fx.nodes
                                for w in n.meta.get("ipuxl_writes", ()) if w.meta.get("ipuxl_role") == "h2d"}
        self._d2h = [s for role, s in self._arguments if role == "d2h"]

    # -- compilation ---------------------------------------------------------------
    def _compile(self, graph: Graph, attrs: dict[str, torch.Tensor] | None = None) -> torch.fx.GraphModule:
        """Lower ``graph`` (inlining graphs with one call site), drop dead code, fuse updates."""
        module = lower_graph(graph, self._compile_callee, attrs, inline=lambda g: self._call_sites[g] == 1)
        changed = [eliminate_dead_code(module.graph), fuse_matmul_updates(module.graph),
                   fuse_adam_steps(module.graph), fuse_adam_updates(module.graph),
                   call_random_ops_directly(module.graph)]
        if any(changed):
            module.recompile()
        return module.to(self.device)

    def _compile_callee(self, graph: Graph) -> Callable[..., tuple]:
        if graph not in self._compiled:
            self._compiled[graph] = compiled_callee(graph, self._compile(graph).forward)
        return self._compiled[graph]

    def _stream_arguments(self) -> list[tuple[str, HostToDeviceStream | DeviceToHostStream]]:
        """The main program's arguments in order: ("h2d", stream) inputs and ("d2h", stream) slots."""
        return [(n.meta["ipuxl_role"], n.meta["ipuxl_stream"]) for n in self.ir.main_graph.fx.nodes
                if n.op == "placeholder" and n.meta.get("ipuxl_role") in ("h2d", "d2h")]

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

    def create_host_outputs(self) -> dict[DeviceToHostStream, np.ndarray]:
        return {s: np.empty(self._full_shape(s.shape), to_numpy_dtype(s.dtype)) for s in self._d2h}

    def run(self, inputs: Mapping[HostToDeviceStream, Any] | None = None,
            downcast_inputs: bool = True) -> dict[DeviceToHostStream, np.ndarray]:
        """Run the main program ``ir.num_host_transfers`` times; return stored outputs.

        Args:
            inputs: one array (numpy or torch) per loaded stream, shaped
                ``(num_host_transfers, *stream.shape)``, the leading dim dropped when 1.
            downcast_inputs: accept 64-bit data for 32-bit streams.

        Returns:
            ``{d2h_stream: array}`` shaped like the inputs.
        """
        self._require_attached("run")
        n = self.ir.num_host_transfers
        self._check_keys(inputs or {})
        loaded = {s: self._stream_input(s, (inputs or {}).get(s), downcast_inputs).reshape(n, *s.shape).unbind(0)
                  for s in self._h2d}
        outputs = [torch.empty((n, *s.shape), dtype=s.dtype, device=self.device) for s in self._d2h]
        slots = {s: o.unbind(0) for s, o in zip(self._d2h, outputs)}
        columns = [loaded[s] if role == "h2d" else slots[s] for role, s in self._arguments]
        steps = list(zip(*columns)) if columns else [()] * n
        forward = self._forward
        step = 0
        try:
            for step, args in enumerate(steps):
                forward(*args)
        except (RuntimeError, IndexError, ValueError) as exc:
            raise DeviceError(
                f"the device program failed in step {step + 1} of {n}: {str(exc).splitlines()[0]}",
                where=f"main program of {self.ir!r} (see session.code)",
                fix="check the data fed to the program (e.g. label or gather indices in range)") from exc
        self._host_in_sync = False
        return {s: self._to_host(o, s) for s, o in zip(self._d2h, outputs)}

    def run_with_outputs(self, inputs: Mapping[HostToDeviceStream, Any] | None = None,
                         outputs: Mapping[DeviceToHostStream, np.ndarray] | None = None,
                         downcast_inputs: bool = True) -> None:
        """Like ``run``, writing results into the given arrays."""
        results = self.run(inputs, downcast_inputs)
        for stream, array in (outputs or {}).items():
            array[...] = results[stream]

    def _full_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        n = self.ir.num_host_transfers
        return (n, *shape) if n > 1 else tuple(shape)

    def _check_keys(self, inputs: Mapping[Any, Any]) -> None:
        unexpected = [getattr(k, "name", repr(k)) for k in inputs if k not in self._h2d]
        if unexpected:
            raise StreamInputError(
                f"Session.run got inputs for streams the program does not load: {unexpected}",
                fix=f"pass exactly the streams loaded with ops.host_load: {[s.name for s in self._h2d]}")

    def _stream_input(self, stream: HostToDeviceStream, data: Any, downcast: bool) -> torch.Tensor:
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
        expected = self._full_shape(stream.shape)
        if tuple(tensor.shape) != expected:
            n = self.ir.num_host_transfers
            raise StreamInputError(
                f"Session.run: input stream '{stream.name}' expects shape {expected} "
                f"(stream shape {stream.shape}, num_host_transfers={n}), got {tuple(tensor.shape)}",
                fix="give (num_host_transfers, *stream.shape) data, without the leading dim when it is 1")
        if tensor.dtype != stream.dtype:
            if not (downcast and DOWNCAST.get(tensor.dtype) == stream.dtype):
                raise StreamInputError(
                    f"Session.run: input stream '{stream.name}' expects dtype {dtype_name(stream.dtype)}, "
                    f"got {dtype_name(tensor.dtype)}",
                    fix=f"convert the data, e.g. array.astype(np.{to_numpy_dtype(stream.dtype)})")
        return tensor.to(self.device, stream.dtype, copy=private)

    def _to_host(self, tensor: torch.Tensor, stream: DeviceToHostStream) -> np.ndarray:
        array = tensor.detach().to("cpu", torch.float32 if tensor.dtype == torch.bfloat16 else tensor.dtype).numpy()
        return array.reshape(self._full_shape(stream.shape))

    # -- weights ------------------------------------------------------------------------
    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.array(array, copy=True)).to(self.device, dtype)

    def _attr(self, tensor: Variable) -> str:
        return tensor.node.target  # type: ignore[return-value]

    def weights_to_host(self) -> None:
        """Copy every variable from the device to its host buffer."""
        self._require_attached("weights_to_host")
        for tensor, host in self._host.items():
            value = self._device_vars[self._attr(tensor)].detach().to("cpu")
            host[...] = value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy()
        self._host_in_sync = True

    def weights_from_host(self) -> None:
        """Copy every variable's host buffer to the device."""
        self._require_attached("weights_from_host")
        for tensor, host in self._host.items():
            self._device_vars[self._attr(tensor)].copy_(torch.from_numpy(host))

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
                self._device_vars[self._attr(tensor)].copy_(torch.from_numpy(self._host[tensor]))

    def _checked_variable_data(self, tensor: Variable, data: Any) -> np.ndarray:
        self._check_own(tensor, (Variable,), "write_variables_data")
        array = np.asarray(data)
        expected = to_numpy_dtype(tensor.dtype)
        if array.dtype != expected and not (array.ndim == 0 and np.isscalar(data)):
            raise InvalidArgumentError(
                f"write_variables_data: data for variable '{tensor.name}' has dtype {array.dtype}, "
                f"the variable is {dtype_name(tensor.dtype)}", fix=f"convert with .astype(np.{expected})")
        if array.shape != tensor.shape:
            raise ShapeMismatchError(
                f"write_variables_data: data for variable '{tensor.name}' has shape {array.shape}, "
                f"the variable has shape {tensor.shape}", fix="reshape the data to the variable's shape")
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
