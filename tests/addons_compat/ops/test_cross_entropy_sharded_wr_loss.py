"""popxl.addons' cross_entropy_sharded_wr_loss: logits split over the class axis between the
IPUs of one replica; eager torch's cross entropy of the whole logits is the oracle."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.addons_compat.ops.cross_entropy_sharded_wr_loss import cross_entropy_sharded_wr_loss
from ipuxl.errors import InvalidValueError, ShapeMismatchError


class _Loss(addons.Module):
    def build(self, logits, labels, ipus):
        return cross_entropy_sharded_wr_loss(logits, labels, ipus=ipus)


@pytest.mark.parametrize("n_ipus,vocab", [(4, 53), (2, 8)])
def test_loss_and_each_shards_gradient_match_torch(n_ipus, vocab):
    rng = np.random.default_rng(1)
    samples = 7
    labels = rng.integers(0, vocab, samples)
    parts = [rng.standard_normal((samples, vocab // n_ipus + int(i < vocab % n_ipus))).astype(np.float32)
             for i in range(n_ipus)]
    dloss = rng.random(samples).astype(np.float32)
    whole = torch.tensor(np.concatenate(parts, axis=-1), requires_grad=True)
    expected = F.cross_entropy(whole, torch.tensor(labels), reduction="none")
    expected.backward(torch.tensor(dloss))

    ir = ipuxl.Ir()
    with ir.main_graph:
        with ipuxl.ipu(0):
            logits = [ipuxl.variable(parts[0]) + 0]
            indices = [ipuxl.variable(labels.astype(np.uint32)) + 0]
            grad_in = ipuxl.variable(dloss) + 0
        for i in range(1, n_ipus):
            with ipuxl.ipu(i):
                logits.append(ipuxl.variable(parts[i]) + 0)
                indices.append(indices[0].copy_to_ipu(destination=i, source=0))
        _, graph = _Loss().create_graph(logits, indices, ipus=list(range(n_ipus)))
        dgraph = addons.autodiff(graph, grads_provided=[graph.graph.outputs[0]],
                                 grads_required=graph.graph.inputs[:n_ipus])
        call = graph.call_with_info(logits, indices)
        loss = call.outputs[0]
        grads = dgraph.call(grad_in, args=dgraph.grad_graph_info.inputs_dict(call))
        streams = [addons.host_store(loss)]
        for i, g in enumerate(grads):
            with ipuxl.ipu(i):
                streams.append(addons.host_store(g))
    with ipuxl.Session(ir, "ipu_hw") as session:
        out = session.run()
    assert_close(torch.from_numpy(out[streams[0]]), expected.detach())
    got_grad = np.concatenate([out[s] for s in streams[1:]], axis=1)
    assert_close(torch.from_numpy(got_grad), whole.grad)


def test_bad_arguments_are_refused_as_upstream():
    ir = ipuxl.Ir()
    with ir.main_graph:
        with ipuxl.ipu(0):
            a = ipuxl.variable(np.zeros((3, 4), np.float32)) + 0
            idx = ipuxl.variable(np.zeros(3, np.uint32)) + 0
        with ipuxl.ipu(1):
            b = ipuxl.variable(np.zeros((3, 4), np.float32)) + 0
        with pytest.raises(InvalidValueError, match="same number of logits and indices"):
            cross_entropy_sharded_wr_loss([a, b], [idx])
        with pytest.raises(InvalidValueError, match="logits and indices IPUs do not match"):
            cross_entropy_sharded_wr_loss([a, b], [idx, idx])
        with pytest.raises(InvalidValueError, match="does not equal number of specified IPUs"):
            cross_entropy_sharded_wr_loss([a, b], [idx, idx], ipus=[0])
        with ipuxl.ipu(1):
            flat = ops.reshape(b, (12,))
        with pytest.raises(ShapeMismatchError, match="needs logits"):
            cross_entropy_sharded_wr_loss([a, flat], [idx, idx], ipus=[0, 1])
