"""Shared by the Hugging Face capture tests: a model built from a tiny config, dropout off."""
from __future__ import annotations

from typing import Any

import pytest
import torch


def hf_model(transformers: Any, config_name: str, model_name: str, arguments: dict) -> torch.nn.Module:
    """``model_name`` of ``config_name(**arguments)`` with every float dropout rate (any config
    attribute named ``*drop*``) at 0, seeded, in train mode; skips when this transformers lacks it."""
    config_class = getattr(transformers, config_name, None)
    model_class = getattr(transformers, model_name, None)
    if config_class is None or model_class is None:
        pytest.skip(f"this transformers has no {model_name}")
    config = config_class(**arguments)
    for key, value in list(vars(config).items()):
        if "drop" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return model_class(config).train()
