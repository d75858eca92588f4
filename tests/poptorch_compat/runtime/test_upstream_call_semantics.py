"""Calling a compiled model as upstream PopTorch 3.x: under PopTorch's contract (the program
imported ``poptorch``) the inputs are fixed once compiled (the same flattened tensors in other
containers run the program; another call raises PopTorch's ``validateInputs`` error), a call
after ``destroy()`` compiles again, ``load`` of an offline export runs, ``inferenceModel`` of a
training model, ``getTensorNames`` before compiling. ipuxl's own API still compiles again for
another call."""
from __future__ import annotations

import copy
import importlib
import re
from types import ModuleType
from typing import Iterator

import pytest
import torch
from torch import nn

import ipuxl
import ipuxl.compat as compat
from ipuxl.errors import PoptorchError


@pytest.fixture
def poptorch() -> Iterator[ModuleType]:
    """``import poptorch`` through ``ipuxl.compat``, as Graphcore's programs run."""
    compat.install()
    try:
        yield importlib.import_module("poptorch")
    finally:
        compat.uninstall()


class TupleNet(nn.Module):
    """Upstream's ``helpers.ModelWithWeights``: forward takes a tuple, returns (out, loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, xs):
        assert isinstance(xs, tuple)
        y = self.lin(xs[0])
        return y, (y ** 2).sum()


class Adder(nn.Module):
    def forward(self, t):
        x, y = t
        return x + y


class DictDivider(nn.Module):
    def forward(self, d):
        return d["x"] / d["y"]


class Defaults(nn.Module):
    def forward(self, a, b, *c, z=None, u=3, **w):
        r = b * u
        for x in c:
            r = r + x
        if z is not None:
            r = r + z
        for value in w.values():
            r = r * value
        return r


def test_same_tensors_in_another_container_run_the_compiled_program(poptorch):
    torch.manual_seed(0)
    net = TupleNet()
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    model = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01))
    x = torch.randn(4)
    for call in ((x,), x, [x]):  # upstream flattens the inputs: forward is not run again
        out, loss = model(call) if not isinstance(call, list) else model(tuple(call))
        ref_opt.zero_grad()
        ref_out, ref_loss = ref((x,))
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(out, ref_out.detach())
        torch.testing.assert_close(loss, ref_loss.detach())
    assert model.compile_count == 1


def test_new_shape_or_dtype_raises_upstreams_error_and_the_program_stays(poptorch):
    model = poptorch.inferenceModel(Adder())
    one, two = torch.tensor([1.0]), torch.tensor([2.0])
    torch.testing.assert_close(model((one, two)), torch.tensor([3.0]))
    with pytest.raises(poptorch.Error, match=re.escape("Shape mismatch for t[0]: expected torch.Size([1]) but got "
                                                       "torch.Size([2])")):
        model((torch.ones(2), torch.ones(2)))
    with pytest.raises(poptorch.Error, match="Data type mismatch for t\\[1\\]: expected torch.float32 but got "
                                             "torch.int64"):
        model((one, torch.tensor([2])))
    with pytest.raises(poptorch.Error, match="Type mismatch for t: expected <class 'tuple'> but got <class 'list'>"):
        model([one, torch.ones(3)])
    with pytest.raises(poptorch.Error, match="Length mismatch for t: expected 2 elements but got 3"):
        model((one, two, two))
    torch.testing.assert_close(model((two, two)), torch.tensor([4.0]))
    assert model.compile_count == 1


def test_dict_keys_in_any_order_and_missing_or_extra_keys(poptorch):
    model = poptorch.inferenceModel(DictDivider())
    torch.testing.assert_close(model({"x": torch.tensor([1.0]), "y": torch.tensor([2.0])}), torch.tensor([0.5]))
    torch.testing.assert_close(model({"y": torch.tensor([4.0]), "x": torch.tensor([1.0])}), torch.tensor([0.25]))
    with pytest.raises(poptorch.Error, match="Keys mismatch for d: Missing arguments: x."):
        model({"y": torch.tensor([2.0])})
    with pytest.raises(poptorch.Error, match="Unexpected arguments: z."):
        model({"x": torch.tensor([1.0]), "y": torch.tensor([2.0]), "z": torch.tensor([3.0])})
    assert model.compile_count == 1


def test_arguments_bound_to_forward_as_upstreams_args_parser(poptorch):
    model = poptorch.inferenceModel(Defaults())
    b, c, d, z, m = (torch.full((2,), float(v)) for v in (1, 2, 3, 4, 5))
    expected = Defaults()(2, b, c, d, z=z, m=m)
    torch.testing.assert_close(model(2, b, c, d, z=z, m=m), expected)
    torch.testing.assert_close(model(2, b, c, d, z=z, m=m, u=3), expected)  # u's default, explicitly
    with pytest.raises(poptorch.Error, match="Type mismatch for z: expected .*Tensor.* but got .*NoneType"):
        model(2, b, c, d, m=m)
    with pytest.raises(poptorch.Error, match="Missing arguments: m."):
        model(2, b, c, d, z=z)
    with pytest.raises(poptorch.Error, match="Value mismatch for u: expected 3 but got 5"):
        model(2, b, c, d, z=z, m=m, u=5)
    with pytest.raises(poptorch.Error, match="Number of positional arguments mismatch: expected 4 arguments but "
                                             "got 3"):
        model(2, b, c, z=z, m=m)
    assert model.compile_count == 1


def test_a_call_after_destroy_compiles_for_its_inputs(poptorch):
    model = poptorch.inferenceModel(Adder())
    model((torch.tensor([1.0]), torch.tensor([2.0])))
    model.destroy()
    assert not model.isCompiled()
    out = model((torch.tensor([1, 1]), torch.tensor([2, 2])))  # another shape and dtype
    assert out.dtype == torch.int32 or out.dtype == torch.int64
    torch.testing.assert_close(out.long(), torch.tensor([3, 3]))
    assert model.compile_count == 2 and model.isCompiled()


def test_compile_once_compiled_is_ignored_whatever_the_inputs(poptorch, caplog):
    model = poptorch.inferenceModel(Adder())
    model.compile((torch.tensor([1.0]), torch.tensor([2.0])))
    with caplog.at_level("WARNING", logger="poptorch::python"):
        model.compile((torch.ones(3), torch.ones(3)))
    assert "Call to compile() ignored" in caplog.text and model.compile_count == 1


def test_ipuxl_api_binds_defaults_and_compiles_again_for_another_call():
    model = ipuxl.inferenceModel(Defaults())
    b, c, z = torch.ones(2), torch.full((2,), 2.0), torch.full((2,), 4.0)
    torch.testing.assert_close(model(2, b, c, z=z), Defaults()(2, b, c, z=z))
    torch.testing.assert_close(model(2, b, c, z=z, u=3), Defaults()(2, b, c, z=z))  # the same call
    assert model.compile_count == 1
    torch.testing.assert_close(model(2, b, c, z=z, u=5), Defaults()(2, b, c, z=z, u=5))  # eager semantics
    torch.testing.assert_close(model(2, torch.ones(3), torch.ones(3)), Defaults()(2, torch.ones(3), torch.ones(3)))
    assert model.compile_count == 3


def test_inference_model_of_a_training_model_shares_its_module(poptorch):
    torch.manual_seed(1)
    net = TupleNet()
    training = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    validation = poptorch.inferenceModel(training)
    assert validation.model is net
    x = torch.randn(4)
    training((x,))
    out, _ = validation((x,))
    torch.testing.assert_close(out, net.lin(x).detach())


def test_load_of_an_offline_export_runs(poptorch, tmp_path):
    torch.manual_seed(2)
    net = TupleNet()
    opts = poptorch.Options()
    opts.useOfflineIpuTarget(poptorch.ipuHardwareVersion())
    x = torch.randn(4)
    model = poptorch.trainingModel(net, opts)
    model.compileAndExport(str(tmp_path / "m.poptorch"), (x,))
    model.destroy()
    loaded = poptorch.load(str(tmp_path / "m.poptorch"))
    out, loss = loaded((x,))
    torch.testing.assert_close(loss, (out ** 2).sum(), rtol=1e-5, atol=1e-5)
    assert loaded.isAttachedToDevice()


def test_get_tensor_names_before_compiling_is_an_assertion(poptorch):
    model = poptorch.inferenceModel(nn.Linear(2, 2))
    with pytest.raises(AssertionError, match="Model must be compiled before calling getTensorNames") as info:
        model.getTensorNames()
    assert isinstance(info.value, PoptorchError)


def test_a_missing_parameter_is_upstreams_error(poptorch):
    model = poptorch.inferenceModel(Defaults())
    with pytest.raises(poptorch.Error, match="Mandatory parameter b missing") as info:
        model(2)
    assert isinstance(info.value, TypeError)  # as eager PyTorch's error


def test_torch_save_of_a_model_reloads_a_wrapper_of_the_trained_module(tmp_path):
    torch.manual_seed(3)
    net = TupleNet()
    training = ipuxl.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(4)
    training((x,))
    torch.save(training, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert isinstance(loaded, type(training)) and loaded.training and not loaded.isCompiled()
    torch.testing.assert_close(loaded.model.lin.weight, net.lin.weight)
    out, loss = loaded((x,))
    ref_out, ref_loss = training((x,))
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(loss, ref_loss)


class OptionalInputs(nn.Module):
    def forward(self, t1, t2, t3=torch.ones(1), t4=torch.zeros(1)):
        return t1 * t3 + t2 * t4


@pytest.mark.parametrize("through_poptorch", [True, False])
def test_tensor_defaults_are_inputs_so_passing_them_runs_the_same_program(through_poptorch, request):
    wrap = request.getfixturevalue("poptorch").inferenceModel if through_poptorch else ipuxl.inferenceModel
    model = wrap(OptionalInputs())
    t1, t2, t4 = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([4.0])
    torch.testing.assert_close(model(t1, t2), torch.tensor([1.0]))
    torch.testing.assert_close(model(t1, t2, t4=t4), torch.tensor([9.0]))
    torch.testing.assert_close(model(t4=t4, t1=t1, t2=t2), torch.tensor([9.0]))
    assert model.compile_count == 1


def test_a_buffer_deleted_by_forward_is_upstreams_error():
    class Remove(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("y", torch.tensor([2.0]))

        def forward(self, x):
            if "y" in self._buffers:
                del self._buffers["y"]
            return x + 1

    with pytest.raises(PoptorchError, match="Buffer y is removed from the model when calling the forward method"):
        ipuxl.inferenceModel(Remove())(torch.tensor([5.0]))


def test_forward_signature_is_read_once_per_function_and_follows_an_instance_forward():
    from ipuxl.poptorch_compat.runtime.call_inputs import forward_signature

    a, b = TupleNet(), TupleNet()
    assert forward_signature(a) is forward_signature(b)  # one function, one signature

    class Scaled(nn.Module):
        def forward(self, x):
            return x * 2

    model = Scaled()
    model.forward = lambda y, scale=3.0: y * scale  # an instance's own forward: read each time
    assert list(forward_signature(model).parameters) == ["y", "scale"]
    out = ipuxl.inferenceModel(model)(y=torch.ones(2))
    torch.testing.assert_close(out, torch.full((2,), 3.0))


def test_outputs_stay_plain_tensors_that_torch_load_reads_back(poptorch, tmp_path):
    """Unlike upstream, no replacement ``backward`` is set on the outputs: it would be saved with
    them, and ``torch.load`` (``weights_only=True``, torch's default) would refuse the file;
    ``backward()`` on an output is torch's error (it does not require grad)."""
    out, loss = poptorch.trainingModel(TupleNet())((torch.ones(2, 4),))
    torch.save((out, loss), tmp_path / "outputs.pt")
    loaded = torch.load(tmp_path / "outputs.pt")
    torch.testing.assert_close(loaded, (out, loss))
    with pytest.raises(RuntimeError, match="does not require grad"):
        loss.backward()


def test_zero_sized_tensors_are_refused_under_poptorch_and_run_under_ipuxls_api(poptorch):
    class Upsample(nn.Module):
        def forward(self, x):
            return nn.functional.interpolate(x, size=(10, 10))

    empty = torch.randn(0, 2, 5, 5)
    with pytest.raises(poptorch.Error, match=r"Zero-sized tensors are unsupported \(Got shape \[0, 2, 5, 5\]\)\."):
        poptorch.inferenceModel(Upsample())(empty)

    class EmptyWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3, 0))

        def forward(self, x):
            return x + self.w.sum()

    with pytest.raises(poptorch.Error, match=r"Got shape \[3, 0\]") as info:
        poptorch.inferenceModel(EmptyWeight())(torch.ones(2))
    assert "parameter 'w'" in info.value.fix
    compat.uninstall()  # ipuxl's own API (the program did not import poptorch): eager semantics
    torch.testing.assert_close(ipuxl.inferenceModel(Upsample())(empty), Upsample()(empty))


def test_a_buffer_reassigned_in_forward_is_upstreams_error(poptorch):
    class Reassigns(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("y", torch.tensor([2.0]))

        def forward(self, x):
            self.y = x + 1
            return x

    model = Reassigns()
    with pytest.raises(poptorch.Error, match=r"Buffer y is reassigned within the model when calling the forward "
                                             r"method\. This is not supported\. Consider using self\.y\.copy_\(src\)"):
        poptorch.inferenceModel(model)(torch.tensor([5.0]))
    assert model.y.tolist() == [2.0]  # the module keeps its buffer
