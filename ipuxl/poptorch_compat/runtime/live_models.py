"""The wrapped models alive in this process, and what a wrapper adds around the user's module.

* ``LIVE``: every ``CompiledModel`` not destroyed; ``refuse_second_training_wrapper``
  refuses a second training wrapper of the same module, as PopTorch does;
* ``WithLoss``: the module called by ``trainingModel(model, loss=...)``;
* ``initial_seed``: a new model's device seed (``Options.randomSeed`` or a random one).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np
import torch

from ipuxl.capture.dropout import seed_words
from ipuxl.errors import AlreadyWrappedError
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat.options import Options

__all__ = ["LIVE", "WithLoss", "initial_seed", "refuse_second_training_wrapper"]

#: the wrapped models not destroyed (``CompiledModel``s)
LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()


def refuse_second_training_wrapper(model: torch.nn.Module) -> None:
    """Refuse to wrap ``model`` for training while a live training model wraps it.

    Raises:
        AlreadyWrappedError: a training model that was not destroyed wraps ``model``.
    """
    for other in list(LIVE):
        if other.training and other.model is model:  # LIVE holds no destroyed model
            raise AlreadyWrappedError(
                "Model has already been wrapped in 'poptorch.trainingModel'. Call model.destroy() on the model to "
                f"unwrap before wrapping again. (the module: {type(model).__name__})",
                where=user_source_line(),
                fix="call destroy() on the existing training model (it copies the weights back) before wrapping "
                    "the module again, or keep using the existing one")


class WithLoss(torch.nn.Module):
    """``model`` followed by ``loss(output, target)``; the target is the call's last argument."""

    def __init__(self, model: torch.nn.Module, loss: Callable[[Any, Any], torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss_fn = loss

    def forward(self, *args: Any) -> tuple[Any, torch.Tensor]:
        output = self.model(*args[:-1])
        return output, self.loss_fn(output, args[-1])


def initial_seed(options: Options) -> np.ndarray:
    """The device seed words a new model starts from."""
    seed = options.random_seed
    if seed is None:
        return torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64).numpy()
    return seed_words(seed)
