"""popxl.addons' hand-written gradients: ``Module.build_grad`` with ``aux`` and ``var_grad``,
used by ``addons.autodiff``, and the ``grad_inlining_error`` guardrail. Eager torch is the oracle."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.errors import AutodiffError

rng = np.random.default_rng(0)


class LinearBuildGrad(addons.Module):
    """``x @ w + b`` whose gradient is written by hand from the saved ``x`` and ``w``."""

    def __init__(self, features: int, grad_inlining_error: str = "error"):
        super().__init__(grad_inlining_error=grad_inlining_error)
        self.features = features

    def build(self, x):
        w = self.add_variable_input("w", partial(rng.standard_normal, (x.shape[-1], self.features)), ipuxl.float32)
        b = self.add_variable_input("b", partial(np.zeros, (self.features,)), ipuxl.float32)
        self.aux["x"], self.aux["w"], self.aux["scale"] = x, w, 1.0
        return x @ w + b

    def build_grad(self, dy):
        self.var_grad["w"] = self.aux["x"].transpose() @ dy
        self.var_grad["b"] = ops.sum(dy, 0)
        return (dy @ self.aux["w"].transpose()) * self.aux["scale"]


class StraightThroughFloor(addons.Module):
    """``floor(x)`` with the straight-through gradient (autodiff alone would give zeros)."""

    def build(self, x):
        return ops.floor(x)

    def build_grad(self, dy):
        return dy


def _forward_and_grads(module, x_np, dy_np):
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.constant(x_np, name="x")
        facts, fwd = module.create_graph(x)
        bwd = addons.autodiff(fwd)
        variables = facts.init()
        info = fwd.bind(variables).call_with_info(x)
        grad_info = bwd.call_with_info(ipuxl.constant(dy_np, name="dy"), args=bwd.grad_graph_info.inputs_dict(info))
        grads = bwd.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(info, grad_info)
        wanted = {"y": info.outputs[0], "x": grads[x], **{k: grads[t] for k, t in variables.named_tensors.items()}}
        streams = {k: addons.host_store(t) for k, t in wanted.items()}
    with ipuxl.Session(ir, "cpu") as session:
        out = session.run()
        weights = {k: torch.from_numpy(session.get_tensor_data(t)) for k, t in variables.named_tensors.items()}
    return {k: torch.from_numpy(out[s]) for k, s in streams.items()}, weights, bwd


def test_build_grad_is_the_gradient_autodiff_uses_and_matches_torch():
    x_np, dy_np = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)
    got, weights, bwd = _forward_and_grads(LinearBuildGrad(2), x_np, dy_np)
    x = torch.from_numpy(x_np).requires_grad_()
    w, b = weights["w"].requires_grad_(), weights["b"].requires_grad_()
    y = x @ w + b
    y.backward(torch.from_numpy(dy_np))
    assert_close(got["y"], y.detach())
    assert_close(got["x"], x.grad)
    assert_close(got["w"], w.grad)
    assert_close(got["b"], b.grad)
    # the saved tensors are grad-graph inputs connected to forward tensors ("stitching")
    saved = [c.fwd_tensor.name for c in bwd.grad_graph_info.expected_inputs if c.connection_type.value == "Fwd"]
    assert len(saved) == 2 and len(bwd.graph.inputs) == 3


def test_a_straight_through_gradient_replaces_autodiffs():
    x_np, dy_np = rng.standard_normal((5,)).astype(np.float32) * 3, rng.standard_normal((5,)).astype(np.float32)
    got, _, _ = _forward_and_grads(StraightThroughFloor(), x_np, dy_np)
    assert_close(got["y"], torch.floor(torch.from_numpy(x_np)))
    assert_close(got["x"], torch.from_numpy(dy_np))


class Outer(addons.Module):
    def __init__(self, mode):
        super().__init__()
        self.inner = LinearBuildGrad(2, grad_inlining_error=mode)

    def build(self, x):
        return self.inner(x)


def test_inlining_a_module_with_build_grad_is_refused_warned_or_allowed():
    def build(mode):
        ir = ipuxl.Ir()
        with ir.main_graph:
            return Outer(mode).create_graph(ipuxl.constant(np.zeros((2, 3), np.float32)))

    with pytest.raises(AutodiffError, match="To disable this guardrail set `grad_inlining_error` to `none`"):
        build("error")
    with pytest.warns(UserWarning, match="`build_grad` will not be called when using autodiff"):
        build("warning")
    _, graph = build("none")
    assert sorted(graph.args.to_dict()) == ["inner.b", "inner.w"]


def test_misuses_of_build_grad_aux_and_var_grad_are_refused():
    with pytest.raises(AutodiffError, match="should be one of 'error', 'warning', 'none'"):
        LinearBuildGrad(2, grad_inlining_error="loud")
    with pytest.raises(AutodiffError, match="You cannot use graph caching if you have implemented `build_grad`"):
        StraightThroughFloor(cache=True)
    module = LinearBuildGrad(2)
    module.aux["x"] = 1.0
    with pytest.raises(AutodiffError, match=r"only get items within the `build_graph` method.*aux\['x'\]"):
        module.aux["x"]

    class ForgetsB(LinearBuildGrad):
        def build_grad(self, dy):
            self.var_grad["w"] = self.aux["x"].transpose() @ dy
            return dy @ self.aux["w"].transpose()

    ir = ipuxl.Ir()
    with ir.main_graph:
        _, fwd = ForgetsB(2).create_graph(ipuxl.constant(np.zeros((2, 3), np.float32)))
        with pytest.raises(AutodiffError, match=r"Not all variable gradients have been specified in self.var_grad.*\['b'\]"):
            addons.autodiff(fwd)
        _, plain = addons.Linear(2).create_graph(ipuxl.constant(np.zeros((2, 3), np.float32)))
        with pytest.raises(AutodiffError, match="does not implement build_grad"):
            addons.Linear(2).create_grad_graph(plain)


class CallsLinear(addons.Module):
    """Outlines LinearBuildGrad with ``call_module``: its gradient graph is built then and recorded."""

    def build(self, x):
        (y,) = self.call_module(LinearBuildGrad(x.shape[-1]))(x * 1.0)
        return y


def _graph(module, shape=(4, 3)):
    x = ipuxl.constant(rng.standard_normal(shape).astype(np.float32), name="x")
    return x, *module.create_graph(x)


def test_graph_autodiff_methods_choose_build_grad_or_the_transform():
    with ipuxl.Ir().main_graph:
        _, _, fwd = _graph(StraightThroughFloor())
        grad = fwd.autodiff(method="build_grad")
        assert grad.graph.outputs and grad.grad_graph_info.graph is grad.graph
        with pytest.raises(AutodiffError, match="Autodiff has already been applied"):
            fwd.autodiff()
        _, _, fwd = _graph(StraightThroughFloor())
        with pytest.raises(AutodiffError, match="should be one of 'auto', 'build_grad', 'autodiff'"):
            fwd.autodiff(method="guess")
        manual = addons.GraphWithNamedArgs(fwd.graph, args=fwd.args)  # no from_module: build_grad unknown
        with pytest.raises(AutodiffError, match="`from_module` is specified"):
            manual.autodiff(method="build_grad")


def test_autodiff_through_a_called_build_grad_graph_needs_its_grad_info():
    with ipuxl.Ir().main_graph:
        _, _, fwd = _graph(CallsLinear())
        recorded = dict(fwd.called_graphs_grad_info)
        (called,) = recorded
        assert not called.can_be_recursively_autodiffed and called.name.startswith("LinearBuildGrad")
        fwd.called_graphs_grad_info = {}
        with pytest.raises(AutodiffError, match="marked as unsafe to autodiff"):
            fwd.autodiff()
        fwd.called_graphs_grad_info = recorded
        grad = fwd.autodiff()
        assert len(grad.graph.outputs) == len(grad.grad_graph_info.expected_outputs) == 3  # x, w, b


def test_call_module_without_autodiff_records_nothing():
    class NoGrad(addons.Module):
        def build(self, x):
            (y,) = self.call_module(LinearBuildGrad(x.shape[-1]), autodiff="none")(x)
            return y

    with ipuxl.Ir().main_graph:
        _, _, fwd = _graph(NoGrad())
    assert fwd.called_graphs_grad_info == {}


def test_build_grad_errors_use_upstreams_sentences():
    class TwoOutputs(LinearBuildGrad):
        def build_grad(self, dy):
            self.var_grad["w"] = self.aux["x"].transpose() @ dy
            self.var_grad["b"] = ops.sum(dy, 0)
            with pytest.raises(TypeError, match="Not a tensor"):
                self.var_grad["b"] = 0
            with pytest.raises(KeyError, match="Not a variable: z"):
                self.var_grad["z"] = dy
            with pytest.raises(ValueError, match="Shape or meta-shape of Tensor does not match variable"):
                self.var_grad["b"] = dy
            return dy, dy

    class VarArgs(LinearBuildGrad):
        def build_grad(self, *grads):
            return grads

    with ipuxl.Ir().main_graph:
        _, _, fwd = _graph(TwoOutputs(3))
        with pytest.raises(AutodiffError, match="Too many outputs in the grad graph"):
            fwd.autodiff()
        x, _, fwd = _graph(VarArgs(3))
        with pytest.raises(TypeError, match="only have a fixed number of positional parameters"):
            fwd.autodiff()
        with pytest.raises(ValueError, match="A Tensor specified in `grads_provided` is not a output of `fwd_graph`"):
            fwd.autodiff(grads_provided=[x])
        with pytest.raises(ValueError, match="A Tensor specified in `grads_required` is not a input of `fwd_graph`"):
            fwd.autodiff(grads_required=[x])


def test_the_forward_graph_outputs_every_saved_aux_tensor():
    with ipuxl.Ir().main_graph:
        _, _, fwd = _graph(LinearBuildGrad(3))
        grad = fwd.autodiff()
    # y, then the saved x and w (the float "scale" is not a tensor); the gradient graph reads dy, w, x
    assert len(fwd.graph.outputs) == 3 and fwd.graph.outputs[1] is fwd.graph.inputs[0]
    assert len(grad.graph.inputs) == 3
