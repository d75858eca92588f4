"""One CUDA graph per run: a session's device loop replayed without returning to the host.

On CUDA, ``Session.run`` stages each stream's data on the device once, and the compiled
program's device loop then only launches kernels: nothing in it waits for the GPU. But
each launch still costs the host its Python and dispatcher time, so a small model's step
is bound by the host. ``GraphedRuns`` records the whole run (every step of the device
loop, the optimiser's updates included) as one ``torch.cuda.CUDAGraph`` and replays it on
later runs: one launch per run, the host idle until the outputs are read back.

The states, per session:

1. The first run runs as compiled (it is also the one that compiles).
2. The second run runs as compiled on the capture stream (its lazily made handles and
   buffers belong to that stream).
3. The third run is captured over static copies of the run buffers, then replayed; every
   later run copies its input slices into those static buffers, replays, and reads the
   outputs from them.

What a graph cannot replay is refused, and that session runs as compiled from then on
(``reason`` says why; logged at INFO). Before any capture, the compiled code is scanned
(``host_reads``): kernels that read device values on the host by design (seeded random
draws from torch's samplers, prints, host callbacks, Streaming Memory, sampling and decoding kernels, a
conditional branch's host transfers) refuse it there, so a capture attempt never runs
their Python side effects (a print of a value the capture has not computed). What the scan
cannot see is refused at capture:

* host work inside the run: any op on or making a CPU tensor (a CPU scalar's value would be
  baked into the graph, and a CPU update would run once, at capture, not at each replay),
  and any op that reads a device value on the host (``.item()``, ``.tolist()``): refused
  before it runs, and CUDA refuses such copies while capturing too;
* random ops drawing from a ``torch.Generator`` other than the default one (the default
  CUDA generator advances at each replay; another would repeat its numbers).

A captured graph reads the variables, the memory plan's arenas and the static buffers
at fixed addresses, so whatever may move them drops it (``invalidate``: the session's
``free_buffers``, ``bind_storage`` and detach); the next run captures again after one
warm-up run. Only one local replica on a CUDA device is graphed; replicas and CPU
devices always run as compiled.

``IPUXL_CUDA_GRAPHS=0`` in the environment when the session is made turns it off. Checked
on an H200 (``tests/device/test_cuda_graphs.py``'s ``cuda`` tests, ``.ci/device_check.sh``):
replayed training gives the compiled runs' weights and losses bit for bit, and
``bench_transformers.py --device cuda`` passes its weight check on all four models.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ipuxl.kernels import debug
from ipuxl.kernels.host_io import gate_cursors
from ipuxl.log import logger

__all__ = ["GraphedRuns", "enabled", "cuda_capture", "host_reads"]


def enabled(device: torch.device, replicas: int) -> bool:
    """Whether a session on ``device`` with ``replicas`` local replicas replays CUDA graphs."""
    return device.type == "cuda" and replicas == 1 and os.environ.get("IPUXL_CUDA_GRAPHS", "1") != "0"


class _NotReplayable(Exception):
    """Raised inside a capture by ``_DeviceOnly``: the run does host work a replay would skip."""


_HOST_READS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default})


class _DeviceOnly(TorchDispatchMode):
    """Stops a capture at the first op a graph cannot replay (see the module docstring)."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type = device_type

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise _NotReplayable(f"{func} reads a device value on the host")
        if kwargs.get("generator") is not None:
            raise _NotReplayable(f"{func} draws from its own torch.Generator")
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != self.device_type:
            raise _NotReplayable(f"{func} makes a tensor on {device}")
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != self.device_type:
                raise _NotReplayable(f"{func} reads a {leaf.device.type} tensor of shape {tuple(leaf.shape)}")
        out = func(*args, **kwargs)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != self.device_type:
                raise _NotReplayable(f"{func} made a {leaf.device.type} tensor")
        return out


#: kernel modules whose functions read device values on the host by design (module docstring)
_HOST_READING_MODULES = frozenset(f"ipuxl.kernels.{m}" for m in (
    "random", "poplar_print", "host_callbacks", "remote", "cluster", "ctc_decoder", "fp_exceptions"))
#: and single functions of other modules (``debug.init``, beside ``debug.print_tensor``, is pure)
_HOST_READING_FUNCTIONS = frozenset({gate_cursors, debug.print_tensor})
#: ipuxl custom ops that do (their implementations live in those modules)
_HOST_READING_OPS = frozenset({
    "print_tensor", "ipu_print_tensor", "host_callback", "fps", "ctc_beam_search_decoder", "random_fill",
    "random_integers", "random_permutation", "random_sample"})


def host_reads(modules: Iterable[torch.fx.GraphModule]) -> str | None:
    """The first op of the compiled ``modules`` that reads device values on the host by
    design, named for ``GraphedRuns.reason``; None when there is none."""
    for module in modules:
        for node in module.graph.nodes:
            target = node.target
            if node.op != "call_function":
                continue
            op_name = str(getattr(target, "_opname", None) or getattr(getattr(target, "_schema", None), "name", ""))
            op_name = op_name.split("::")[-1]
            if getattr(target, "namespace", None) == "ipuxl" and op_name in _HOST_READING_OPS:
                return f"the program calls ipuxl::{op_name} (node '{node.name}'), which reads on the host"
            if getattr(target, "__module__", None) in _HOST_READING_MODULES or target in _HOST_READING_FUNCTIONS:
                return (f"the program calls {target.__module__}.{target.__name__} (node '{node.name}'), which reads "
                        "on the host")
    return None


def cuda_capture(work: Callable[[], None], stream: Any) -> Any:
    """Record ``work`` (which must not be run: CUDA records its launches) as a
    ``torch.cuda.CUDAGraph`` on ``stream``; refuses what a replay would get wrong."""
    graph = torch.cuda.CUDAGraph()
    # thread_local: other threads' CUDA calls (a data loader pinning memory) are not refused meanwhile
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"), _DeviceOnly("cuda"):
        work()
    return graph


class GraphedRuns:
    """A session's runs of its main program, replayed as one CUDA graph each (module docstring).

    Args:
        forward: the compiled main program's ``forward``; runs with another forward (a
            profile's labelled program) run as compiled.
        execute: runs a forward over the run buffers (``Session._execute``: progress and
            failure handling).
        capture: ``(work, stream) -> graph`` recording one run, the graph's ``replay()``
            running it again (default ``cuda_capture``; tests pass a recorder of their own).
        refused: why the program can never be replayed (``host_reads``); None: try.
    """

    WARMUP_RUNS = 2

    def __init__(self, forward: Callable[..., Any],
                 execute: Callable[[Callable[..., Any], Sequence[torch.Tensor]], None],
                 capture: Callable[[Callable[[], None], Any], Any] = cuda_capture, refused: str | None = None):
        self.forward = forward
        self._execute = execute
        self._capture_with = capture
        self.reason: str | None = refused  # why this session does not graph (None: it does, or will)
        self.graph: Any = None
        self.captures = 0  # graphs made (again after each invalidate)
        self.replays = 0
        self._static: list[torch.Tensor] = []
        self._runs = 0  # runs since the last invalidate
        self._stream: Any = None

    def invalidate(self) -> None:
        """Drop the graph: what it reads may move. The next runs warm up and capture again."""
        self.graph, self._static, self._runs = None, [], 0

    def run(self, forward: Callable[..., Any], buffers: Sequence[torch.Tensor], inputs: Sequence[bool]
            ) -> Sequence[torch.Tensor]:
        """Run ``forward`` over ``buffers`` (``inputs[i]``: buffer i holds input data; the
        others receive outputs) and return the buffers that hold the run's outputs: the
        static ones once a graph replays, else ``buffers``."""
        if self.reason is not None or forward != self.forward:  # bound methods: equal, not identical
            self._execute(forward, buffers)
            return buffers
        self._runs += 1
        if self.graph is None and self._runs == self.WARMUP_RUNS:
            self._on_capture_stream(lambda: self._execute(forward, buffers))
        elif self.graph is None and (self._runs < self.WARMUP_RUNS or not self._capture(buffers)):
            self._execute(forward, buffers)
        else:
            for static, given, is_input in zip(self._static, buffers, inputs):
                if is_input:
                    static.copy_(given)
            self.graph.replay()
            self.replays += 1
            return self._static
        return buffers

    def _on_capture_stream(self, work: Callable[[], None]) -> None:
        if self._capture_with is not cuda_capture:
            work()
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        # the cached blocks of the runs so far would stay reserved beside the capture stream's
        # own (the caching allocator keeps blocks per stream): hand them back first
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            work()
        torch.cuda.current_stream().wait_stream(self._stream)

    def _capture(self, buffers: Sequence[torch.Tensor]) -> bool:
        """Capture one run over static copies of ``buffers``; False (and graphing off for
        good, with the reason logged) when the run cannot be replayed."""
        static = [b.clone() for b in buffers]
        try:
            graph = self._capture_with(lambda: self._execute(self.forward, static), self._stream)
        except Exception as exc:  # noqa: BLE001 - any failure to capture: run as compiled from now on
            cause = _first_cause(exc)
            self.reason = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
            logger.info("CUDA graphs off for this session (its runs run as compiled): %s", self.reason)
            if self._capture_with is cuda_capture:
                torch.cuda.synchronize()
            return False
        self.graph, self._static = graph, static
        self.captures += 1
        return True


def _first_cause(exc: BaseException) -> BaseException:
    """The error that started a chain: a failed capture's own error is CUDA's "operation failed
    due to a previous error during capture", raised as the capture ends, over the op's."""
    seen = {id(exc)}
    while True:
        inner = exc.__cause__ or exc.__context__
        if inner is None or id(inner) in seen:
            return exc
        seen.add(id(inner))
        exc = inner
