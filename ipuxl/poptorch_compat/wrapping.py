"""``poptorch._impl``'s model (un)wrapping helpers, which clients call around eager use of a wrapped module.

Upstream, ``trainingModel``/``inferenceModel`` mark the module's parameters and buffers
as PopTorch tensors; a client that runs the host module eagerly in between device
calls (optimum-graphcore's ``IPUSeq2SeqTrainer`` generating text) removes those marks
with ``unwrapModelIfNecessary`` and puts them back with ``rewrapModelIfNecessary``.

ipuxl leaves parameters and buffers ordinary torch tensors: reading the host module
already gives the device's current values (``runtime.weights``), and a host write
reaches the device before its next run. So ``unwrapModelIfNecessary`` only brings the
host module up to date (reading its tensors does that), and ``rewrapModelIfNecessary``
has nothing to restore.

``isDispatchTracing`` is upstream's flag for "PopTorch's dispatcher is tracing the model's
forward" (set while its ``IPUScope`` is entered): on ipuxl, True while a forward is captured
for the device, False otherwise (eagerly, and between calls).
"""
from __future__ import annotations

import itertools

import torch

from ipuxl.capture.mode import active_mode

__all__ = ["unwrapModelIfNecessary", "rewrapModelIfNecessary", "isDispatchTracing"]


def unwrapModelIfNecessary(model: torch.nn.Module) -> None:  # noqa: N802 - PopTorch's name
    """Make ``model``'s parameters and buffers usable eagerly: they hold the device's values after this."""
    for _ in itertools.chain(model.parameters(), model.buffers()):
        pass  # iterating reads the module, which pulls newer device values (runtime.weights)


def rewrapModelIfNecessary(model: torch.nn.Module) -> None:  # noqa: N802 - PopTorch's name
    """Undo ``unwrapModelIfNecessary``: nothing to restore on ipuxl (parameters stay plain tensors)."""
    del model  # ipuxl never marks parameters, so there is no mark to put back


def isDispatchTracing() -> bool:  # noqa: N802 - PopTorch's name
    """True while ipuxl captures a model's forward for the device (upstream: while PopTorch's
    dispatcher traces it), False otherwise."""
    return active_mode() is not None
