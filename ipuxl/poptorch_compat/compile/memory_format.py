"""The memory format a captured model's image inputs run in: NCHW or channels-last.

CPU convolutions are much faster channels-last for some networks and slower for
others. Measured on this project's 2-core machine (torchvision models, one thread,
batch 4, 64x64, SGD with momentum, the captured step in each format): MobileNetV2,
MobileNetV3 and EfficientNet-B0 1.3x faster channels-last, DenseNet-121 1.2x,
ShuffleNetV2 the same, ResNet-18 0.72x (slower). Depthwise convolutions and
concatenations gain; dense 3x3 convolutions lose. No structural rule predicts it
(DenseNet has no grouped convolution), eager steps in each format do: the generated
code's ops keep their input's memory format, so the captured step gains as eager does.

So before capturing a model whose inputs include a 4-D float tensor and whose modules
include a ``Conv2d``, the executor times a few eager forward/backward steps
of a copy of the module in both formats (``choose``), under a forked RNG and on a copy
so the user's module, RNG and buffers are untouched, and picks channels-last when it is
at least ``MARGIN`` (4%) faster. The model is then traced with channels-last example inputs
(so every view and reshape in the graph is the one channels-last data needs) and each
call's 4-D float inputs are converted before they are staged (``to_format``). Values
are those of eager PyTorch in channels-last format: the same kernels, which round
differently from the NCHW ones (both are eager float32).

``IPUXL_CHANNELS_LAST=1`` forces channels-last for every model with a 4-D float input,
``0`` turns the choice off (NCHW, the input's own format). Only on a CPU device (the
timing is of host steps) and with one replica in the process: several replicas' stream
data is regrouped (``batching``) and would lose the format. Measuring costs twelve eager
steps at compile time (a copy of the module in memory meanwhile).
"""
from __future__ import annotations

import copy
import os
import time
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["MARGIN", "choose", "to_format", "ENV"]

ENV = "IPUXL_CHANNELS_LAST"
MARGIN = 1.04
"""Channels-last is chosen when eager steps are this many times faster in it."""
_TIMED = 5  # steps timed per format (the fastest counts: load on the machine only slows steps down)


def _images(leaves: list[Any]) -> list[int]:
    return [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_floating_point()]


def _has_conv(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Conv2d) for m in model.modules())


def to_format(args: tuple, kwargs: dict[str, Any], channels_last: bool) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` with every 4-D float tensor in channels-last format (unchanged when
    ``channels_last`` is False)."""
    if not channels_last:
        return args, kwargs
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for i in _images(leaves):
        leaves[i] = leaves[i].contiguous(memory_format=torch.channels_last)
    return pytree.tree_unflatten(leaves, spec)


def choose(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], training: bool) -> bool:
    """Whether to run ``model`` channels-last, for one micro-batch's example call ``(args, kwargs)``
    (see the module docstring)."""
    setting = os.environ.get(ENV, "").strip()
    leaves, _ = pytree.tree_flatten((args, kwargs))
    if not _images(leaves) or setting == "0":
        return False
    if setting == "1":
        return True
    if not _has_conv(model):
        return False
    try:
        nchw, channels_last = _time_formats(model, args, kwargs, training)
    except Exception:  # noqa: BLE001 - a model eager cannot run in one format keeps NCHW; capture reports real errors
        return False
    return nchw >= MARGIN * channels_last


def _time_formats(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], training: bool) -> tuple[float, float]:
    """The fastest seconds of an eager step (forward, and backward of every float output when
    training) of a copy of ``model`` with NCHW and with channels-last inputs."""
    probe = copy.deepcopy(model)
    probe.train(training)
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(training):
        filled_args, filled_kwargs = pytree.tree_map(
            lambda v: torch.randn_like(v) if isinstance(v, torch.Tensor) and v.is_floating_point()
            else (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v), (args, kwargs))
        calls = {False: (filled_args, filled_kwargs), True: to_format(filled_args, filled_kwargs, True)}
        for fmt in (False, True):
            _step(probe, calls[fmt], training)  # warm-up: oneDNN's kernels for the format
        for _ in range(_TIMED):
            for fmt in (False, True):
                start = time.perf_counter()
                _step(probe, calls[fmt], training)
                times[fmt].append(time.perf_counter() - start)
    return min(times[False]), min(times[True])


def _step(model: torch.nn.Module, call: tuple[tuple, dict[str, Any]], training: bool) -> None:
    args, kwargs = call
    out = model(*args, **kwargs)
    if not training:
        return
    model.zero_grad(set_to_none=True)
    floats = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if floats:
        torch.autograd.backward([t.float().sum() for t in floats])
