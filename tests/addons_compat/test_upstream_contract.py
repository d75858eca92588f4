"""popxl.addons' documented behaviour where ipuxl once differed (upstream's test-suite run):
``RemoteHandle`` results of batch serialisation, ``Conv2D``'s signature, ``DotTree.insert``
errors, positional ``InputStreams``, ``GraphCache`` keys, ``VariableFactory`` errors and
``GradGraphInfo._expected_inputs``. Values are checked against torch / numpy.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from numpy.testing import assert_allclose

import ipuxl as popxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.addons_compat.dot_tree import DotTree
from ipuxl.addons_compat.graph_cache import GraphCache
from ipuxl.addons_compat.testing_utils import TensorInput, run_module
from ipuxl.addons_compat.transforms.batch_serialisation import (
    RemoteHandle, batch_serial_buffer, batch_serialise, batch_serialise_fwd_and_grad,
)
from ipuxl.addons_compat.variable_factory import VariableFactory
from ipuxl.errors import InvalidArgumentError

RNG = np.random.default_rng(5)


class Scale(addons.Module):
    def build(self, x: popxl.Tensor) -> popxl.Tensor:
        return x * self.add_variable_input("scale", partial(np.full, x.shape, 3.0), x.dtype)


# -- 1. batch serialisation returns RemoteHandles -------------------------------------------------
def test_batch_serialise_stored_buffers_are_remote_handles_and_hold_the_outputs():
    steps = 4
    ir = popxl.Ir(replication=1)
    with ir.main_graph:
        x_stream = popxl.h2d_stream((2, 3), popxl.float32, "x")
        y_stream = popxl.d2h_stream((2, 3), popxl.float32, "y")
        facts, graph = Scale().create_graph(x_stream.spec)
        out = graph.graph.outputs[0]
        buffer = batch_serial_buffer(out, steps=steps)
        store_buffers = {out: (buffer, 0)}
        result = batch_serialise(graph, steps, {graph.graph.inputs[0]: x_stream}, {}, store_buffers)
        handle = result.stored_buffers[out]
        assert isinstance(handle, RemoteHandle)
        assert (handle.buffer, handle.row_offset, handle.shard_group) == (buffer, 0, None)
        assert store_buffers[out] == (buffer, 0) and type(store_buffers[out]) is tuple  # caller's dict untouched
        with popxl.in_sequence(True):
            result.graph.bind(facts.init()).call(0)
            for i in range(steps):  # read each step's output back through the handle's buffer
                ops.host_store(y_stream, ops.remote_load(handle.buffer, i))
    ir.num_host_transfers = steps
    x = RNG.normal(size=(steps, 2, 3)).astype(np.float32)
    with popxl.Session(ir, "cpu") as session:
        got = session.run({x_stream: x})[y_stream]
    assert_allclose(got, (torch.from_numpy(x) * 3.0).numpy())


def _scale_and_its_grad(shape: tuple[int, int]):
    """Scale's forward graph, its gradient graph, and streams for both graphs' first inputs."""
    x_stream = popxl.h2d_stream(shape, popxl.float32, "x")
    dy_stream = popxl.h2d_stream(shape, popxl.float32, "dy")
    _, fwd = Scale().create_graph(x_stream.spec)
    _, bwd = addons.autodiff_with_accumulation(fwd, fwd.args.tensors, grads_required=[])
    return fwd, bwd, {fwd.graph.inputs[0]: x_stream, bwd.graph.inputs[0]: dy_stream}


def test_batch_serialise_fwd_and_grad_results_hold_remote_handles():
    steps = 2
    ir = popxl.Ir(replication=1)
    with ir.main_graph:
        fwd, bwd, streams = _scale_and_its_grad((2, 3))
        fwd_bs, _ = batch_serialise_fwd_and_grad(fwd, bwd, fwd.args, steps, streams, {}, {})
        assert fwd_bs.stored_buffers and all(isinstance(h, RemoteHandle) for h in fwd_bs.stored_buffers.values())
        fwd_only = {fwd.graph.inputs[0]: streams[fwd.graph.inputs[0]]}
        with pytest.raises(ValueError, match="has no load handle"):  # upstream: a ValueError
            batch_serialise_fwd_and_grad(fwd, bwd, fwd.args, steps, fwd_only, {}, {})


def test_batch_serialise_fwd_and_grad_takes_a_replica_grouping_as_a_sharded_store_buffer():
    steps = 2
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        fwd, bwd, streams = _scale_and_its_grad((2, 4))
        activation = next(c.fwd_tensor for c in bwd.grad_graph_info.expected_inputs
                          if c.fwd_tensor not in fwd.args.tensors and c.connection_type.value == "Fwd")
        group = ir.replica_grouping(group_size=2)
        fwd_bs, _ = batch_serialise_fwd_and_grad(fwd, bwd, fwd.args, steps, streams, {}, {activation: group})
    handle = fwd_bs.stored_buffers[activation]
    assert isinstance(handle, RemoteHandle) and handle.shard_group is group
    assert handle.buffer.meta_shape == tuple(activation.shape) and handle.buffer.entries >= steps


# -- 2. Conv2D: upstream's signature and torch_mapping ----------------------------------------------
def _torch_conv(x: np.ndarray, layer: torch.nn.Conv2d, pads: tuple[int, int, int, int], stride, dilation):
    top, left, bottom, right = pads
    padded = F.pad(torch.from_numpy(x), (left, right, top, bottom))
    return F.conv2d(padded, layer.weight, layer.bias, stride, 0, dilation, layer.groups).detach().numpy()


@pytest.mark.parametrize("paddings, pads", [
    ("same_upper", (0, 0, 1, 1)), ("same_lower", (1, 1, 0, 0)), ("valid", (0, 0, 0, 0)), ((1, 2, 0, 1), (1, 2, 0, 1)),
])
def test_conv2d_upstream_keywords_and_torch_mapping(paddings, pads):
    x = RNG.random((2, 3, 8, 8)).astype(np.float32)
    torch.manual_seed(0)
    layer = torch.nn.Conv2d(3, 4, kernel_size=2)
    conv = addons.Conv2D(4, 2, strides=(1, 1), paddings=paddings, dilations=(1, 1), groups=1, bias=True)
    (got,) = run_module(conv, TensorInput(x), weights=partial(addons.Conv2D.torch_mapping, nn_layer=layer))
    assert_allclose(got, _torch_conv(x, layer, pads, 1, 1), rtol=1e-5, atol=1e-5)


def test_conv2d_strides_dilations_groups_and_bias_shape():
    x = RNG.random((1, 4, 9, 9)).astype(np.float32)
    torch.manual_seed(1)
    layer = torch.nn.Conv2d(4, 6, kernel_size=(3, 2), stride=(1, 2), dilation=(2, 1), groups=2)
    conv = addons.Conv2D(6, (3, 2), strides=(1, 2), paddings=(1, 0, 1, 0), dilations=(2, 1), groups=2)
    (got,) = run_module(conv, TensorInput(x), weights=partial(addons.Conv2D.torch_mapping, nn_layer=layer))
    assert_allclose(got, _torch_conv(x, layer, (1, 0, 1, 0), (1, 2), (2, 1)), rtol=1e-5, atol=1e-5)
    ir = popxl.Ir()
    with ir.main_graph:
        facts, _ = addons.Conv2D(6, 3).create_graph(popxl.TensorSpec((1, 4, 5, 5), popxl.float32))
    assert facts.bias.shape == (1, 6, 1, 1) and facts.weight.shape == (6, 4, 3, 3)
    with pytest.raises(ValueError, match="not a pad type"):
        addons.Conv2D(6, 3, paddings="same")


# -- 3. DotTree.insert errors ---------------------------------------------------------------------------
def test_dot_tree_insert_errors_are_value_errors():
    tree = DotTree()
    with pytest.raises(ValueError, match="cannot be negative"):
        tree.insert(-1, "a")
    with pytest.raises(ValueError, match="not a valid Python identifier"):
        tree.insert(".a", "a")
    tree.insert("foo.bar.hee", "a")
    with pytest.raises(ValueError, match="'foo' already exists"):
        tree.insert("foo.bar.goo", "c")
    assert tree.to_dict() == {"foo.bar.hee": "a"}
    tree.insert("foo.bar.goo", "c", overwrite=True)
    assert tree.to_dict() == {"foo.bar.hee": "a", "foo.bar.goo": "c"}
    built = DotTree.from_dict({"fc.w": 1, "fc.b": 2, "out": 3})  # from_dict still shares subtrees
    assert built.fc.to_dict() == {"w": 1, "b": 2}


# -- 4. InputStreams / OutputStreams by position -----------------------------------------------------------
def test_streams_index_by_position_and_iterate_streams():
    ir = popxl.Ir()
    with ir.main_graph:
        inputs = addons.InputStreams(x=((1, 4), popxl.float32), y=((4,), popxl.int32))
        outputs = addons.OutputStreams(z=((2,), popxl.float32))
    assert inputs[0] is inputs.x and inputs[1] is inputs["y"] and inputs[-1] is inputs.y
    assert inputs[0:2] == [inputs.x, inputs.y]
    assert list(inputs) == [inputs.x, inputs.y] and list(outputs) == [outputs.z]
    assert list(inputs.keys()) == ["x", "y"]
    with pytest.raises(IndexError):
        inputs[2]
    with pytest.raises(KeyError, match="No key 'w'"):
        inputs["w"]


# -- 5. GraphCache keys ---------------------------------------------------------------------------------------
class Add(addons.Module):
    def __init__(self, config: int):
        super().__init__()
        self.config = config

    def build(self, x, y):
        return x + y

    def __hash__(self) -> int:
        return hash(self.config)


def test_graph_cache_keys_on_module_hash_ipu_and_tile_set():
    ir = popxl.Ir()
    cache = GraphCache()
    with ir.main_graph:
        x, y = popxl.variable(np.float32(1)), popxl.variable(np.float32(2))
        with popxl.ipu(0):
            first = cache.create_graph(Add(0), x, y)
            assert cache.create_graph(Add(0), x, y) is first  # another instance, equal hash
            assert cache.create_graph(Add(1), x, y) is not first
            with popxl.io_tiles():
                assert cache.create_graph(Add(0), x, y) is not first
        with popxl.ipu(1):
            assert cache.create_graph(Add(0), x, y) is not first
    assert len(cache) == 4


# -- 6. VariableFactory data sources ----------------------------------------------------------------------------
def test_variable_factory_bad_data_source_is_a_value_error():
    with pytest.raises(ValueError, match="`data_iter` throws error") as caught:
        VariableFactory(data_iter=lambda: sum(1))
    assert isinstance(caught.value, InvalidArgumentError)  # ipuxl's type before: still caught as that
    assert isinstance(caught.value.__cause__, TypeError) and "raised TypeError" in str(caught.value)
    with pytest.raises(ValueError, match="must be an iterable or callable"):
        VariableFactory(data_iter=3)  # type: ignore[arg-type]


# -- 7. GradGraphInfo._expected_inputs ------------------------------------------------------------------------------
def test_grad_graph_info_keeps_expected_connections_as_lists():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones((2, 2), np.float32))
        graph = ir.create_graph(lambda t: t * t, x)
    info = popxl.transforms.autodiff(graph)
    assert isinstance(info._expected_inputs, list) and isinstance(info._expected_outputs, list)
    assert tuple(info._expected_inputs) == info.expected_inputs and len(info._expected_inputs) == 2
    assert tuple(info._expected_outputs) == info.expected_outputs
    assert [c.connection_type.value for c in info._expected_inputs] == ["FwdGrad", "Fwd"]
