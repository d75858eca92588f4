"""PopTorch's programming model on ipuxl: ``trainingModel``, ``inferenceModel``,
``identity_loss``, ``DropoutReplay``, one module per concern:

* ``executor``: ``PoplarExecutor``, the wrappers' calls, compiles and device attachment;
* ``compile``: ``compile_model``, capture -> IR -> autodiff -> step program -> outline;
* ``program``: the device program's main graph around the captured forward;
* ``batching``: the combined batch split into streams, outputs per output mode;
* ``weights``, ``weight_sync``: where the weights live, and when they move;
* ``options``, ``dataloader``: ``Options``, ``DataLoader``;
* ``optim``, ``translate``: PopTorch's optimisers, and torch.optim translated to ``ipuxl.optim`` rules.

The wrappers are built from the same pieces as the PopXL front end: torch.fx
capture into the IR (``ipuxl.capture``), ``transforms.autodiff``, the
``ipuxl.optim`` update rules and the device ``Session``.
"""
from ipuxl.capture.dropout import DropoutReplay
from ipuxl.capture.mode import identity_loss
from ipuxl.poptorch_compat.executor import PoplarExecutor, inferenceModel, trainingModel

__all__ = ["DropoutReplay", "PoplarExecutor", "identity_loss", "inferenceModel", "trainingModel"]
