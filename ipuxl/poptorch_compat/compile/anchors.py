"""Anchored tensors: PopTorch's ``Options.anchorTensor`` and ``PoplarExecutor.getAnchoredTensor``.

A long name is PopART's name of a tensor: a parameter's path as the user module's
``named_parameters()`` gives it (PopTorch 3's names, e.g. ``fc2.bias``), with one of
PopART's prefixes:

* ``<param>``: the weight as the step's forward reads it (before the update);
* ``Gradient___<param>``: the gradient of one micro-batch on one replica, as the
  backward pass gives it (loss scaling included, before accumulation and the replica
  reduction): one value per micro-batch;
* ``Accum___<param>``: the gradient the optimiser step receives: accumulated over the
  micro-batches and reduced over the replicas (mean, or sum with ``ReductionType.Sum``),
  loss scaling divided out, before gradient clipping;
* ``UpdatedVar___<param>``: the weight after the optimiser step.

A training model can also anchor PopART's ``finalLossScale``: the loss scaling the
step used (ipuxl's loss scaling is the optimiser's ``loss_scaling``, which automatic
loss scaling does not change on ipuxl: ``Training.setAutomaticLossScaling`` has no
effect, so its update factor is 1).

The gradient names exist for the parameters a training model trains. PopTorch 2's
JIT-traced spelling with ``model.`` before the path (``Gradient___model.fc2.bias``) is
accepted too. Each anchor is a device-to-host stream stored every device iteration
(``Gradient___``: every micro-batch); after a call the host reduces each anchor's
values per its output mode as outputs are (``batching.reduce_outputs``: All/EveryN
and replicas concatenate along the first dimension, Final/Sum with one replica keep
the tensor's shape).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ipuxl.device.host_data import host_tensors
from ipuxl.errors import AnchorError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.streams import DeviceToHostStream, d2h_stream
from ipuxl.ir.tensor import Tensor
from ipuxl.ops import host_store
from ipuxl.poptorch_compat.compile.batching import local_replica_range, reduce_outputs
from ipuxl.poptorch_compat.options import Options, OutputMode

if TYPE_CHECKING:
    from ipuxl.ir.tensor import Variable

__all__ = ["AnchorRequest", "AnchorPlan", "AnchorStreams", "plan_anchors", "gather_anchors",
           "anchorable_names", "parameter_paths", "PREFIXES"]

#: PopART's prefixes of the anchorable tensors, and what each gives (see the module docstring)
PREFIXES = {"": "weight", "Gradient___": "gradient", "Accum___": "accumulated", "UpdatedVar___": "updated"}
#: PopART's names of a training step's scalars that can be anchored -> their kind
SCALARS = {"finalLossScale": "loss_scale"}
_GRADIENT_KINDS = ("gradient", "accumulated", "updated")
_MODULE = "model."  # PopTorch 2's JIT wrapper, and ipuxl's loss wrapper: the user module is its "model"


@dataclass(frozen=True)
class AnchorRequest:
    """One ``Options.anchorTensor`` call, its output mode resolved."""

    short_name: str
    long_name: str
    mode: OutputMode
    period: int


@dataclass
class AnchorPlan:
    """What a program anchors: the requests, and each parameter's PopART path
    (``fc2.bias``) -> its name in the program."""

    requests: list[AnchorRequest]
    paths: dict[str, str]

    def build_streams(self, params: dict[str, Variable], trained: list[str], *, training: bool,
                      micro_batches: int) -> AnchorStreams:
        """A device-to-host stream per anchor (call in the main graph's context).

        Raises:
            AnchorError: a long name that is no anchorable tensor of this program.
        """
        streams = AnchorStreams()
        paths = {path: name for path, name in self.paths.items() if name in params}
        valid = anchorable_names(paths, trained, training)
        for request in self.requests:
            if training and request.long_name in SCALARS:
                scalar = d2h_stream((), torch.float32, f"anchor.{request.short_name}")
                streams.anchors.append(_Anchor(request, SCALARS[request.long_name], "", (scalar,)))
                continue
            long_name = _canonical(request.long_name, paths)
            if long_name not in valid:
                raise _unknown(request, valid, training)
            prefix = next(p for p in sorted(PREFIXES, key=len, reverse=True) if long_name.startswith(p))
            kind, param = PREFIXES[prefix], paths[long_name[len(prefix):]]
            var = params[param]
            count = micro_batches if kind == "gradient" else 1
            suffix = [f"_mb{g}" if count > 1 else "" for g in range(count)]
            made = tuple(d2h_stream(var.shape, var.dtype, f"anchor.{request.short_name}{s}") for s in suffix)
            streams.anchors.append(_Anchor(request, kind, param, made))
        return streams


@dataclass(frozen=True)
class _Anchor:
    request: AnchorRequest
    kind: str
    param: str  # the program's parameter name
    streams: tuple[DeviceToHostStream, ...]  # one per micro-batch (gradient), else one


@dataclass
class AnchorStreams:
    """A program's anchor streams and the stores that fill them, called by the step graph
    in program order (``program._build_step``)."""

    anchors: list[_Anchor] = field(default_factory=list)

    def _of(self, kind: str) -> list[_Anchor]:
        return [a for a in self.anchors if a.kind == kind]

    def store_weights(self, params: dict[str, Variable], inputs: dict[Variable, Tensor]) -> None:
        """At the start of the step: the weights the forward reads."""
        for a in self._of("weight"):
            host_store(a.streams[0], inputs[params[a.param]])

    def store_gradients(self, g: int, grads: dict[str, Tensor]) -> None:
        """After micro-batch ``g``'s backward: its gradients."""
        for a in self._of("gradient"):
            host_store(a.streams[g], grads[a.param])

    def store_accumulated(self, grads: dict[str, Tensor], scale: float | Tensor) -> None:
        """After accumulation and the replica reduction: the gradients the optimiser receives
        (the sums times ``scale``: 1 / (micro-batches averaged * loss scaling), a tensor
        when the loss scaling is a variable that ``setOptimizer`` may change)."""
        for a in self._of("accumulated"):
            plain = isinstance(scale, float) and scale == 1.0
            host_store(a.streams[0], grads[a.param] if plain else grads[a.param] * scale)

    def store_updated(self, params: dict[str, Variable], inputs: dict[Variable, Tensor]) -> None:
        """After the optimiser step: the updated weights."""
        for a in self._of("updated"):
            host_store(a.streams[0], inputs[params[a.param]])

    def store_loss_scale(self, loss_scale: Tensor) -> None:
        """After the optimiser step: the loss scaling the step used (float32 scalar)."""
        for a in self._of("loss_scale"):
            host_store(a.streams[0], loss_scale)


def plan_anchors(options: Options, training: bool, param_names: list[str], *, wrapped: bool) -> AnchorPlan | None:
    """The anchors of ``options`` (None without any): an anchor without its own output
    mode takes the model's (``Options.outputMode``, Default resolved as for outputs).

    Args:
        param_names: the program module's ``named_parameters()`` names.
        wrapped: the program module is ipuxl's loss wrapper, whose user module is ``model``.
    """
    if not options.anchored_tensors:
        return None
    requests = []
    for short, (long_name, use_default, mode, period) in options.anchored_tensors.items():
        if use_default:
            mode, period = options.resolved_output_mode(training), options.output_return_period
        requests.append(AnchorRequest(short, long_name, mode, period if mode is OutputMode.EveryN else 1))
    return AnchorPlan(requests, parameter_paths(param_names, wrapped=wrapped))


def parameter_paths(param_names: list[str], *, wrapped: bool) -> dict[str, str]:
    """Each parameter's PopART path (``fc2.bias``) -> its name in the program
    (``wrapped``: see ``plan_anchors``)."""
    return {(n[len(_MODULE):] if wrapped and n.startswith(_MODULE) else n): n for n in param_names}


def _canonical(long_name: str, paths: dict[str, str]) -> str:
    """``long_name`` in PopTorch 3's spelling: PopTorch 2's ``model.`` before the path dropped."""
    prefix = next(p for p in sorted(PREFIXES, key=len, reverse=True) if long_name.startswith(p))
    path = long_name[len(prefix):]
    if path not in paths and path.startswith(_MODULE) and path[len(_MODULE):] in paths:
        return prefix + path[len(_MODULE):]
    return long_name


def anchorable_names(plan_paths: dict[str, str], trained: list[str], training: bool) -> list[str]:
    """Every long name a program with these parameters can anchor, in a fixed order."""
    trained_set = set(trained)
    names = []
    for path, param in plan_paths.items():
        names.append(path)
        if training and param in trained_set:
            names += [f"{prefix}{path}" for prefix, kind in PREFIXES.items() if kind in _GRADIENT_KINDS]
    if training:
        names += list(SCALARS)
    return names


def _unknown(request: AnchorRequest, valid: list[str], training: bool) -> AnchorError:
    shown = ", ".join(valid[:24]) + (f", ... ({len(valid)} in all)" if len(valid) > 24 else "")
    hint = "" if training else " (an inference model has no gradients or updates: anchor a weight by its name)"
    close = difflib.get_close_matches(request.long_name, valid, n=1)
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    return AnchorError(
        f"Options.anchorTensor({request.short_name!r}, {request.long_name!r}): no tensor of the program has that "
        f"name{hint}{guess}. Anchorable: {shown or 'none (the model has no parameters)'}", where=user_source_line(),
        fix="use one of those names: 'Gradient___<param>', 'Accum___<param>', 'UpdatedVar___<param>' or "
            "'<param>', with <param> as model.named_parameters() spells it (e.g. 'Gradient___fc2.bias')")


def gather_anchors(streams: AnchorStreams, options: Options, results: dict[Any, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each anchor's values of the call, reduced per its output mode (see the module
    docstring); under torchrun, those of this process's replicas, as outputs are."""
    n, replicas = options.device_iterations, options.total_replicas()
    first, last = local_replica_range(options)
    found: dict[str, torch.Tensor] = {}
    for a in streams.anchors:
        shape = a.streams[0].shape
        per = torch.stack([results[s].reshape(n, replicas, *shape)[:, first:last]
                           for s in a.streams], 1)  # (n, micro-batches, local replicas, *shape)
        seq = per.reshape(n * len(a.streams), last - first, *shape)
        found[a.request.short_name] = reduce_outputs([seq], a.request.mode, a.request.period)[0]
    return dict(zip(found, host_tensors([t.clone() if t.device.type == "cpu" else t for t in found.values()])))
