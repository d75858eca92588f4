"""Why a device program failed: the op, the user's line, the state it left, a fix.

Only on the failure path (a run is one call of the compiled main program): the
program is run again through ``torch.fx.Interpreter`` on copies of the variables and
of the run's stream data (``_Rerun``), stepping into called compiled graphs and loop
bodies, and the node that raises names the op and the user's source line recorded
when it was built. The copies' version counters, read when the failed step takes its
first slice, tell which variables that step had already written.

A step is a host transfer (see ``device.session``): the failed step is the most
slices any stream's cursor had given out when the program raised.

The error is a ``DeviceError`` and also the built-in type the kernel raised (an
``IndexError`` for an embedding index out of range: ``errors.with_builtin``), with
the kernel's message kept whole, as eager PyTorch would raise it.
"""
from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Sequence, cast

import torch

from ipuxl.device.replicas import replica_alone
from ipuxl.dtypes import dtype_name, to_numpy_dtype
from ipuxl.errors import ApplicationRuntimeError, DeviceError, builtin_type, with_builtin
from ipuxl.ir.calls import is_repeat, repeat_count, run_repeat
from ipuxl.ir.meta import CALLED_GRAPH, OP, OP_ID, SOURCE, STREAM
from ipuxl.ir.streams import HostToDeviceStream
from ipuxl.kernels.host_io import consumed
from ipuxl.kernels.program_stop import ProgramStop

if TYPE_CHECKING:
    from ipuxl.device.session import Session
    from ipuxl.ir.graph import Graph

__all__ = ["StepFailure", "step_error", "transfer_in_progress"]


def transfer_in_progress(cursors: Sequence[Iterator[torch.Tensor]] | None, total: int) -> int:
    """The step (0-based) a run was in: the most slices any cursor gave out, less one."""
    if not cursors:
        return 0
    return max(0, max(consumed(c, total) for c in cursors) - 1)


def step_error(session: "Session", failure: "StepFailure") -> DeviceError:
    """The DeviceError for a failed step, also of the torch error's built-in type: the op
    and user line (by re-running the step), the steps kept, and a fix that fits the error."""
    n, k = session.num_host_transfers, failure.step + 1
    replica = session.local_replicas[failure.index]
    replicas = session.replication_factor
    replica_part = f", replica {replica} of {replicas}" if replicas > 1 else ""
    cause = str(failure.exc).strip() or type(failure.exc).__name__
    stopped = isinstance(failure.exc, ProgramStop)  # the program stopped itself (Poplar's application error)
    error = cast("type[DeviceError]", with_builtin(ApplicationRuntimeError if stopped else DeviceError,
                                                   builtin_type(failure.exc)))
    found = _rerun_failed_step(session, failure)
    applied = min(session.steps_completed)
    state = _kept_state(session, failure, applied, found.updated if found is not None else None)
    if found is None:  # the step did not fail again (non-deterministic), or was not re-run
        late = ("; CUDA reports kernel errors late, so the step may be wrong too: run with "
                "CUDA_LAUNCH_BLOCKING=1 or on 'cpu' to find the op") if _is_async_cuda_error(failure.exc) else ""
        return error(
            f"the device program failed in step {k} of {n}{replica_part}: {cause}\n{state}",
            where=f"main program of {session.ir!r} (see session.code)",
            fix=f"check the data fed to the program (e.g. label or gather indices in range){late}",
            steps_applied=applied, step=k)
    graph = (f"graph '{found.path[-1].meta[CALLED_GRAPH].name}' (called from the main program)"
             if found.path else "the main program")
    location = f"node '{found.node.name}' of {graph}; session.code shows the main program"
    at = f" at op '{found.op}'" + (f" (from {found.source})" if found.source else "")
    return error(
        f"the device program failed in step {k} of {n}{replica_part}{at}: {cause}\n{state}",
        where=f"{found.source} ({location})" if found.source else location,
        fix=_fix_for(session, found, failure), steps_applied=applied, step=k, failed_op=found.op,
        source=found.source)

def _kept_state(session: "Session", failure: "StepFailure", applied: int, updated: list[str] | None) -> str:
    """What the failed run left on the device, in words."""
    k = failure.step + 1
    if applied == 0:
        state = "  no step of this run completed: the variables hold their values from before it"
    else:
        steps = "step 1 was" if applied == 1 else f"steps 1-{applied} were"
        state = (f"  {steps} applied and kept: the variables now hold their values after step {applied} "
                 "(weights and optimiser state included: reading them shows these values, and the next run "
                 "continues from them)")
    ahead = [(r, p) for r, p in zip(session.local_replicas, session.steps_completed) if p > applied]
    if ahead:
        state += "; " + ", ".join(f"replica {r} had completed {p} steps" for r, p in ahead)
    if updated:
        names = ", ".join(f"'{v}'" for v in updated)
        state += (f"\n  step {k} had already updated {names} in place before the failing op: "
                  f"{'that variable holds' if len(updated) == 1 else 'those variables hold'} that update too")
    return state

def _rerun_failed_step(session: "Session", failure: "StepFailure") -> "_OpFailed | None":
    """Run the program again, node by node, on copies of the variables and of the run's
    stream data: the op that raises (None when it now passes, or fails outside any op)."""
    if _is_async_cuda_error(failure.exc):  # the CUDA context is broken: any op would fail now
        return None
    module = session.programs[failure.index]
    variables = {attr: record.tensor.name for attr, record in session.ir.variable_records.items()}
    shared = _RerunState(session, {a: getattr(module, a).clone() for a in variables if hasattr(module, a)},
                         variables, failure.step)
    cursors = [_Cursor(shared, b.clone()) for b in failure.buffers]
    replicas = session.replication_factor
    alone: ContextManager[None] = (replica_alone(replicas, session.local_replicas[failure.index]) if replicas > 1
                                   else contextlib.nullcontext())
    takes_io = any(n.op == "placeholder" for n in module.graph.nodes)
    try:
        with alone, torch.no_grad():
            shared.rerun(module, ()).run(*([cursors] if takes_io else []))
    except _OpFailed as found:
        found.updated = shared.updated()
        return found
    except Exception:  # noqa: BLE001 - outside any op: report what the step raised
        return None
    return None


def _repeat_count(session: "Session", node: torch.fx.Node) -> int | None:
    """The count of the IR ``repeat`` that lowered ``node``, found by its op id."""
    op_id = node.meta.get(OP_ID)
    for graph in session.ir.graphs:
        for ir_node in graph.fx.nodes:
            if is_repeat(ir_node) and ir_node.meta.get(OP_ID) == op_id:
                return repeat_count(ir_node)
    return None

def _fix_for(session: "Session", found: "_OpFailed", failure: "StepFailure") -> str:
    """How to fix it, from the torch error and the streams the failing op reads."""
    message, k = str(found.exc), failure.step + 1
    streams = _streams_feeding(session, found, failure)
    if found.op in _CHECK_OPS:  # the program's own check (torch._check, assert, torch._assert_async)
        data = (f"the data of stream {', '.join(repr(s.name) for s, _ in streams)} in step {k}" if streams
                else f"the data of step {k}")
        return f"the model's check does not hold for {data}: fix that data, or the check if the data is valid"
    if isinstance(found.exc, FloatingPointError):  # the IPU's floating-point exceptions (device.fp_checks)
        fed = f"the data of stream {', '.join(repr(s.name) for s, _ in streams)} in step {k}, " if streams else ""
        return (f"find what brings the values op '{found.op}' reads out of range ({fed}a learning rate, a loss "
                "scale, float16 overflow) and fix it; or, to let NaN and infinity through as eager PyTorch does, "
                "turn the checks off (Options.Precision.enableFloatingPointExceptions(False), "
                "SessionOptions.enableFloatingPointChecks = False)")
    if isinstance(found.exc, IndexError) or re.search(r"out of (range|bounds)|index \S+ is out", message, re.I):
        ints = [(s, t) for s, t in streams if not (t.is_floating_point() or t.is_complex())]
        if not ints:
            return ("check the indices op '{}' reads (labels or gather indices): keep indices in range of the "
                    "dimension they index".format(found.op))
        fed = ", ".join(f"'{s.name}'" + (f" (step {k} has values {t.min().item()} to {t.max().item()})"
                                         if t.numel() else "") for s, t in ints)
        return (f"check the labels / gather indices fed to stream {fed}: keep indices in range of the "
                "dimension they index")
    if re.search(r"expected scalar type|must have the same dtype|Double|Long", message):
        dtypes = sorted({t.dtype for t in found.tensors()}, key=dtype_name)
        got = f"op '{found.op}' got inputs of dtypes {', '.join(dtype_name(d) for d in dtypes)}"
        if not streams:
            return f"{got}: ops.cast them to one dtype where the program builds them"
        stream = streams[0][0]
        others = [d for d in dtypes if d != stream.dtype]
        if len(others) != 1:
            return (f"the data of stream '{stream.name}' has dtype {dtype_name(stream.dtype)} and {got}: "
                    "convert the data to the dtype the op needs, or ops.cast it in the program")
        need = others[0]
        return (f"the data of stream '{stream.name}' has dtype {dtype_name(stream.dtype)}, {got}: convert it "
                f"to {dtype_name(need)} (create the stream with that dtype and feed "
                f"array.astype(np.{to_numpy_dtype(need)}), or ops.cast the loaded tensor)")
    fed = f"the data of stream {', '.join(repr(s.name) for s, _ in streams)} in step {k} and " if streams else ""
    shapes = ", ".join(f"{tuple(t.shape)} {dtype_name(t.dtype)}" for t in found.tensors())
    return f"check {fed}the inputs of op '{found.op}' ({shapes or 'no tensors'})"


_CHECK_OPS = frozenset({"_assert_async", "_assert_scalar"})


def _streams_feeding(session: "Session", found: "_OpFailed", failure: "StepFailure") -> list[tuple[HostToDeviceStream, torch.Tensor]]:
    """The loaded streams the failing op depends on (in its graph and, through the call
    sites that reached it, in its callers), with the slice each load gave it."""
    seen: set[torch.fx.Node] = set()
    stack = [found.node, *found.path]
    streams: dict[HostToDeviceStream, torch.Tensor] = {}
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.meta.get(OP) == "host_load" and node in found.loaded:
            streams.setdefault(node.meta[STREAM], found.loaded[node])
        stack.extend(node.all_input_nodes)
    return sorted(streams.items(), key=lambda item: item[0].name)


def _is_async_cuda_error(exc: BaseException) -> bool:
    """A CUDA kernel error (device-side assert...): raised at a later op, and sticky."""
    message = str(exc)
    return "CUDA error" in message or "device-side assert" in message


class StepFailure(Exception):
    """A step of the device program raised: carried out of the replica threads to ``run``.

    ``step``: the failed step (0-based); ``index``: the local replica; ``buffers``: its
    run buffers, one per stream in the session's cursor order (for the re-run).
    """

    def __init__(self, exc: BaseException, step: int, index: int, buffers: tuple[torch.Tensor, ...]):
        super().__init__(str(exc))
        self.exc, self.step, self.index, self.buffers = exc, step, index, buffers


class _OpFailed(Exception):
    """The op that raised while a failed step was run again (``_Rerun``)."""

    def __init__(self, node: torch.fx.Node, exc: Exception, inputs: tuple, path: tuple[torch.fx.Node, ...]):
        super().__init__(str(exc))
        self.node, self.exc, self.inputs, self.path = node, exc, inputs, path
        self.updated: list[str] = []
        self.loaded: dict[torch.fx.Node, torch.Tensor] = {}  # the last slice each load node gave

    @property
    def op(self) -> str:
        """The PopXL op name, or the aten op's name for captured ops."""
        if self.node.meta.get(OP):
            return str(self.node.meta[OP])
        target = self.node.target
        packet = getattr(target, "_overloadpacket", None)
        return getattr(packet, "__name__", None) or getattr(target, "__name__", None) or self.node.name

    @property
    def source(self) -> str | None:
        """The user's line of the op, else of the call that reached it."""
        for node in (self.node, *reversed(self.path)):
            if node.meta.get(SOURCE):
                return str(node.meta[SOURCE])
        return None

    def tensors(self) -> list[torch.Tensor]:
        flat, _ = torch.utils._pytree.tree_flatten(self.inputs)
        return [t for t in flat if isinstance(t, torch.Tensor)]


class _RerunState:
    """One re-run of a failed run: copies of the variables, an interpreter per program,
    the slices loads gave, and the variables' versions when the failed step began."""

    def __init__(self, session: Session, clones: dict[str, torch.Tensor], names: dict[str, str], step: int):
        self.session, self.clones, self.names, self.step = session, clones, names, step
        self._versions = {attr: t._version for attr, t in clones.items()}
        self._reruns: dict[tuple, _Rerun] = {}
        self.loaded: dict[torch.fx.Node, torch.Tensor] = {}
        self._step_began = False
        self._iteration_start: dict[str, int] | None = None

    def iteration_begins(self) -> None:
        """An iteration of a loop doing host IO begins (a step of a device loop may begin here)."""
        if not self._step_began:
            self._iteration_start = self._current_versions()

    def took(self, count: int) -> None:
        """A cursor gave its ``count``-th slice. The failed step began with the first such
        slice, or with the loop iteration that took it."""
        if self._step_began:
            return
        if count == self.step + 1:
            self._step_began = True
            self._versions = self._iteration_start or self._current_versions()
        else:
            self._iteration_start = None

    def _current_versions(self) -> dict[str, int]:
        return {attr: t._version for attr, t in self.clones.items()}

    def rerun(self, module: torch.fx.GraphModule, path: tuple[torch.fx.Node, ...]) -> "_Rerun":
        key = (id(module), path)
        if key not in self._reruns:
            self._reruns[key] = _Rerun(self, module, path)
        return self._reruns[key]

    def updated(self) -> list[str]:
        """Variables written in place so far (their copies' version counters moved)."""
        return [self.names[a] for a, t in self.clones.items() if t._version != self._versions[a]]


class _Cursor:
    """A stream cursor of the re-run: slices of a copy of the run buffer, counted."""

    def __init__(self, state: _RerunState, buffer: torch.Tensor):
        self.state, self.slices, self.taken = state, buffer.unbind(0), 0

    def __iter__(self) -> "_Cursor":
        return self

    def __next__(self) -> torch.Tensor:
        if self.taken == len(self.slices):
            raise StopIteration
        self.taken += 1
        self.state.took(self.taken)
        return self.slices[self.taken - 1]


class _Rerun(torch.fx.Interpreter):
    """Runs a compiled program node by node on the variables' copies; raises ``_OpFailed``
    at the op that fails. Calls of compiled graphs are run the same way, inside."""

    def __init__(self, state: _RerunState, module: torch.fx.GraphModule, path: tuple[torch.fx.Node, ...]):
        super().__init__(module)
        self.extra_traceback = False
        self.state, self.path = state, path

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if not self.path and target in self.state.clones:
            return self.state.clones[target]
        return super().get_attr(target, args, kwargs)

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        try:
            result = self._call(n, args, kwargs)
        except _OpFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the op raised is the diagnosis
            failed = _OpFailed(n, exc, (args, kwargs), self.path)
            failed.loaded = self.state.loaded
            raise failed from exc
        if n.meta.get(OP) == "host_load":
            self.state.loaded[n] = result
        return result

    def _call(self, n: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
        """Run call node ``n``: a called compiled graph node by node (a repeat once per
        iteration), anything else as it is."""
        session = self.state.session
        graph = cast("Graph | None", n.meta.get(CALLED_GRAPH))
        compiled = session.compiled_graph(graph) if graph is not None else None
        target = cast(Callable[..., Any], n.target)
        if graph is None or compiled is None or kwargs:
            return target(*args, **kwargs)
        module = compiled.module

        def body(*inputs: Any) -> Any:
            if compiled.takes_io and target is not compiled.call:  # a loop iteration
                self.state.iteration_begins()
            return self.state.rerun(module, self.path + (n,)).run(*inputs)

        if target is compiled.call:
            return body(*args)
        count = _repeat_count(session, n) if n.meta.get(OP) == "repeat" else None
        if count is not None:
            if compiled.takes_io:
                return run_repeat(body, count, len(graph.outputs), args[1:], args[0])
            return run_repeat(body, count, len(graph.outputs), args)
        return target(*args, **kwargs)
