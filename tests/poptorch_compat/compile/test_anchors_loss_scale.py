"""``Options.anchorTensor(name, "finalLossScale")``: the loss scaling a training step used."""
from __future__ import annotations

import pytest
import torch

import ipuxl.poptorch_compat as poptorch


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        out = self.lin(x)
        return out, poptorch.identity_loss(out.sum(), reduction="sum")


@pytest.mark.parametrize("scaling, variable", [(1.0, False), (4.0, True)])
def test_the_final_loss_scale_is_the_optimisers_loss_scaling(scaling, variable):
    net = _Net()
    opts = poptorch.Options().deviceIterations(3)
    opts.Training.setAutomaticLossScaling(True)
    opts.anchorTensor("last", "finalLossScale", poptorch.OutputMode.Final)
    opts.anchorTensor("each", "finalLossScale", poptorch.OutputMode.All)
    opt = poptorch.optim.SGD(net.parameters(), lr=0.0, **({"loss_scaling": scaling} if variable else {}))
    model = poptorch.trainingModel(net, opts, optimizer=opt)
    model(torch.ones(3, 3))
    torch.testing.assert_close(model.getAnchoredTensor("last"), torch.tensor(scaling))
    torch.testing.assert_close(model.getAnchoredTensor("each"), torch.full((3,), scaling))
    # automatic loss scaling has no effect on ipuxl: the update factor is 1
    torch.testing.assert_close(opt.state_dict()["ipu_state"]["lossScaleUpdateFactor"], torch.tensor(1.0))
    if variable:
        opt.loss_scaling = 8.0
        model.setOptimizer(opt)
        model(torch.ones(3, 3))
        torch.testing.assert_close(model.getAnchoredTensor("last"), torch.tensor(8.0))


def test_an_inference_model_has_no_loss_scale_to_anchor():
    opts = poptorch.Options()
    opts.anchorTensor("scale", "finalLossScale")
    with pytest.raises(AssertionError, match="finalLossScale"):
        poptorch.inferenceModel(torch.nn.Linear(2, 2), opts)(torch.ones(1, 2))
