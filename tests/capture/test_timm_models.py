"""timm's image models, which nobody wrote for ipuxl, train through ``trainingModel`` as eagerly:
tiny configs (nothing downloaded), float64, dropout and stochastic depth off, SGD; every step's
loss and every weight compared with eager PyTorch.

A sweep of one model per timm family (98 families, timm 1.0) found the defects these models
pin: CoaT shares its positional-encoding modules with its blocks, and the capture left its
fake tensors in the shared module (``capture.module_state``); EfficientFormerV2's repeated
blocks each read their own gradient graph's outputs, and outlining cut a repeat between a
call and its items (``passes.outline``). (It also found float64 training 2e-8 off eager
through float32 optimiser numbers, which the full-size ConvMixer's 32 BatchNorm blocks amplified
to 5e-7 in the loss: ``test_optim_device.py`` pins that.)
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.capture._eager import train_like_eager

timm = pytest.importorskip("timm", reason="timm is not installed")

MODELS = {
    # shared submodules: cpe/crpe held by the model and by every serial block
    "coat": ("coat_tiny", dict(img_size=32, embed_dims=(16, 16, 16, 16), serial_depths=(1, 1, 1, 1),
                               parallel_depth=0, num_heads=8, mlp_ratios=(2, 2, 2, 2))),
    # its blocks (s0 depths) repeat across grad-graph calls: outlined without cutting a call from its items
    "efficientformerv2": ("efficientformerv2_s0", dict(img_size=64, depths=(2, 2, 6, 4),
                                                       embed_dims=(8, 16, 16, 32), num_vit=2)),
    "convmixer": ("ConvMixer", dict(dim=16, depth=6, kernel_size=5, patch_size=7)),  # the class: no tiny preset
    "nfnet": ("test_nfnet", {}),
    "mambaout": ("test_mambaout", {}),
}


class _WithLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        out = self.model(x)
        return out, F.cross_entropy(out, y)


@pytest.mark.parametrize("family", list(MODELS))
def test_timm_model_trains_as_eagerly(family, monkeypatch):
    monkeypatch.setenv("IPUXL_CHANNELS_LAST", "0")  # eager's NCHW rounding
    name, config = MODELS[family]
    torch.manual_seed(0)
    if name[0].isupper():
        model = getattr(timm.models, name)(num_classes=10, **config)
    else:
        model = timm.create_model(name, pretrained=False, num_classes=10, **config)
    for module in model.modules():  # dropout and stochastic depth off: ipuxl's draws are its own
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        if isinstance(getattr(module, "drop_prob", None), float):
            module.drop_prob = 0.0
    size = config.get("img_size", 64)
    x = torch.randn(2, 3, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    train_like_eager(_WithLoss(model.double().train()), (x, torch.tensor([1, 7])), steps=2, lr=0.01)
    assert os.environ["IPUXL_CHANNELS_LAST"] == "0"
