"""PopTorch's programming model on ipuxl: ``trainingModel``, ``inferenceModel``,
``identity_loss`` (``Options`` and ``DataLoader`` live in ``ipuxl.poptorch_compat.options`` and
``ipuxl.poptorch_compat.dataloader``).

The wrappers are built from the same pieces as the PopXL front end: torch.fx
capture into the IR (``ipuxl.capture.trace``), ``transforms.autodiff``, the
``ipuxl.optim`` update rules and the device ``Session``.
"""
from ipuxl.capture.trace import DropoutReplay, identity_loss
from ipuxl.poptorch_compat.executor import PoplarExecutor, inferenceModel, trainingModel

__all__ = ["DropoutReplay", "PoplarExecutor", "identity_loss", "inferenceModel", "trainingModel"]
