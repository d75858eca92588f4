"""The memory format a captured model's image inputs run in: NCHW or channels-last.

CPU convolutions are much faster channels-last for some networks and slower for others.
The choice is a rule on the model's structure (``choose``), never a timing: the same
program and data compile to the same program and give the same numbers on every run,
whatever the machine's load.

The rule: a model whose inputs include a 4-D float32 tensor runs channels-last when less
than ``DENSE_SHARE`` (90%) of the weights of its ``Conv2d`` layers past the stem are in
dense spatial kernels (ungrouped, larger than 1x1; ``dense_share``). The stem (an ungrouped
convolution reading at most ``STEM_CHANNELS`` = 4 channels: the image's) is left out; a
model with no other convolution (ViT's and Swin's patch embedding) stays NCHW. Pointwise,
depthwise and grouped convolutions and the concatenations around them gain channels-last;
stacks of dense 3x3 convolutions lose. Weights, not multiply-adds, so the rule needs no
input shapes and no run of the model.

Evidence: torchvision's models at ``benchmarks/bench_models.py``'s shapes (SGD training,
micro-batch 4 of 3x64x64, 2 device iterations), ``trainingModel`` compiled each way
(``IPUXL_CHANNELS_LAST=0``/``1``), fastest of 6 timings of 3 calls, one thread, measured on
this project's 2-core machine under load (so about 5% either way is noise). Speed-up of
channels-last (NCHW ms / channels-last ms) and the model's dense share:

===================  =====  ========     ===================  =====  ========
model                share  speed-up     model                share  speed-up
===================  =====  ========     ===================  =====  ========
resnet18             0.985  0.66         regnet_y_400mf       0.0    2.16
resnet50             0.483  1.25         convnext_tiny        0.827  1.38
mobilenet_v2         0.0    2.36         vit (patch conv)     none   0.96
mobilenet_v3_large   0.0    1.00         swin_t (patch conv)  none   0.79
efficientnet_b0      0.0    1.53         googlenet            0.595  1.12
shufflenet_v2_x1_0   0.0    1.04         mnasnet1_0           0.0    1.70
densenet121          0.312  1.56         squeezenet1_0        0.764  1.06
===================  =====  ========     ===================  =====  ========

The rule picks the faster format for all 14 (MobileNetV3 is a tie; eager steps were
1.37x faster channels-last for it). The gap in the shares is between ConvNeXt (0.83: its
2x2 downsampling convolutions are dense) and ResNet-18 (0.985). ``inferenceModel`` (same
shapes, 8 timings of 3 calls) splits the same way for the 9 models measured: channels-last
speed-up resnet18 0.71, swin_t 0.71, vit 0.86 (NCHW kept); convnext_tiny 1.04, squeezenet1_0
1.07, resnet50 1.09, densenet121 1.20, googlenet 1.32, efficientnet_b0 1.91 (channels-last).
(Eager inference differs: ResNet-50 0.77 and ConvNeXt 0.95 channels-last; the captured
program is what is run.) Only float32 images were measured: other dtypes keep their format.

The model is traced with channels-last example inputs (so every view and reshape in the
graph is the one channels-last data needs) and each call's 4-D float inputs are converted
before they are staged (``to_format``). Values are those of eager PyTorch in channels-last
format: the same kernels, which round differently from the NCHW ones (both are eager
float32).

``IPUXL_CHANNELS_LAST=1`` forces channels-last for every model with a 4-D float input,
``0`` keeps NCHW (the input's own format); PopTorch has no such option. The rule applies
only on a CPU device (it was measured on the host's kernels) and with one replica in the
process: several replicas' stream data is regrouped (``batching``) and would lose the format.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["DENSE_SHARE", "STEM_CHANNELS", "choose", "dense_share", "to_format", "ENV"]

ENV = "IPUXL_CHANNELS_LAST"
DENSE_SHARE = 0.9
"""Channels-last is chosen when less than this share of the convolution weights past the stem
is in dense spatial kernels (``dense_share``)."""
STEM_CHANNELS = 4
"""An ungrouped convolution reading at most this many channels (an image's) is the stem, left out."""


def _images(leaves: list[Any]) -> list[int]:
    return [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_floating_point()]


def to_format(args: tuple, kwargs: dict[str, Any], channels_last: bool) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` with every 4-D float tensor in channels-last format (unchanged when
    ``channels_last`` is False)."""
    if not channels_last:
        return args, kwargs
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for i in _images(leaves):
        leaves[i] = leaves[i].contiguous(memory_format=torch.channels_last)
    return pytree.tree_unflatten(leaves, spec)


def dense_share(model: torch.nn.Module) -> float | None:
    """The share of the weights of ``model``'s ``Conv2d`` layers past the stem (an ungrouped
    layer reading at most ``STEM_CHANNELS`` channels) that are in dense spatial kernels:
    ungrouped, larger than 1x1. None when there are no such layers."""
    total = dense = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d) and (m.groups > 1 or m.in_channels > STEM_CHANNELS):
            kh, kw = m.kernel_size
            weights = m.out_channels * (m.in_channels // m.groups) * kh * kw
            total += weights
            if m.groups == 1 and kh * kw > 1:
                dense += weights
    return None if total == 0 else dense / total


def choose(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], training: bool) -> bool:
    """Whether to run ``model`` channels-last, for one micro-batch's example call ``(args, kwargs)``
    (see the module docstring): a function of the model's structure and the inputs' dtypes only
    (training and inference models measured alike, so ``training`` does not enter)."""
    setting = os.environ.get(ENV, "").strip()
    leaves, _ = pytree.tree_flatten((args, kwargs))
    images = [leaves[i] for i in _images(leaves)]
    if not images or setting == "0":
        return False
    if setting == "1":
        return True
    if any(t.dtype != torch.float32 for t in images):
        return False  # measured for float32 only
    share = dense_share(model)
    return share is not None and share < DENSE_SHARE
