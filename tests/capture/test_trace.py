"""Capture (issue #15, part 6) against eager PyTorch: tensors from outside the module
become constants, eval-mode submodules inside a training model, float16 models,
data-dependent ops (refused, or computed with static shapes), torch's own error
types for bad op arguments, and generated code whose argument names cannot clash."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import TraceError
from tests.poptorch_compat._checks import as_poptorch, sgd_steps_like_eager
from tests.poptorch_compat._checks import raises_in

raises = raises_in(__file__)
TOL = dict(rtol=1e-5, atol=1e-6)


def scalar_like(out: torch.Tensor, eager: torch.Tensor) -> torch.Tensor:
    """``out`` in ``eager``'s shape when both hold one value (scalar outputs' shape is
    tested in test_io_shapes_dtypes)."""
    return out.reshape(eager.shape) if out.numel() == eager.numel() == 1 else out


def train_side_by_side(model: nn.Module, *inputs: torch.Tensor, steps: int = 3, lr: float = 0.1, **tol) -> nn.Module:
    """``steps`` SGD steps through trainingModel and eagerly; outputs, losses and final
    weights must match. Returns the eager copy."""
    training, ref = sgd_steps_like_eager(model, inputs, steps, lr, tol or TOL)
    training.copyWeightsToHost()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m, n=name: f"{n}: {m}", **(tol or TOL))
    training.destroy()
    return ref


# -- 1. tensors from outside the module are constants ---------------------------------
OUTSIDE = torch.linspace(0.5, 1.5, 5)


class WithLoss(nn.Module):
    """A linear layer scaled by an outside tensor, then ``loss(out, target)``."""

    def __init__(self, loss, scale_kind: str = "none"):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.loss = loss
        self.scale_kind = scale_kind
        self.scale = torch.linspace(2.0, 1.0, 5)  # a plain attribute: not a parameter, not a buffer

    def forward(self, x, target):
        out = self.fc(x)
        if self.scale_kind == "closure":
            out = out * OUTSIDE
        elif self.scale_kind == "attribute":
            out = out * self.scale
        elif self.scale_kind == "created":
            out = out * torch.tensor([1.0, 2.0, 3.0, 2.0, 1.0]) + torch.tensor(0.5)
        return out, self.loss(out, target)


def _lambda_loss():
    shift = torch.linspace(-1.0, 1.0, 5)  # held only by the lambda's closure
    return lambda out, target: F.mse_loss(out - shift, target)


LABELS = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(1))
FLOAT_TARGET = torch.rand(8, 5, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("loss, target, scale_kind", [
    (lambda: nn.CrossEntropyLoss(weight=torch.rand(5) + 0.1), LABELS, "none"),
    (lambda: nn.NLLLoss(weight=torch.rand(5) + 0.1), LABELS, "none"),
    (lambda: nn.BCEWithLogitsLoss(pos_weight=torch.rand(5) + 1.0), FLOAT_TARGET, "none"),
    (_lambda_loss, FLOAT_TARGET, "none"),
    (nn.MSELoss, FLOAT_TARGET, "closure"),
    (nn.MSELoss, FLOAT_TARGET, "attribute"),
    (nn.MSELoss, FLOAT_TARGET, "created"),
], ids=["ce-weight", "nll-weight", "bce-pos-weight", "lambda", "closure", "attribute", "created-in-forward"])
def test_outside_tensors_are_constants_in_training(loss, target, scale_kind):
    torch.manual_seed(0)
    model = WithLoss(loss(), scale_kind)
    x = torch.randn(8, 4)
    if isinstance(model.loss, nn.NLLLoss):
        model.fc = nn.Sequential(nn.Linear(4, 5), nn.LogSoftmax(dim=1))
    train_side_by_side(model, x, target)


def test_later_changes_to_an_outside_tensor_are_not_seen():
    torch.manual_seed(0)
    model = WithLoss(nn.MSELoss(), "attribute")
    x = torch.randn(8, 4)
    expected = model(x, FLOAT_TARGET)[0].detach()
    inference = ipuxl.inferenceModel(model)
    torch.testing.assert_close(inference(x, FLOAT_TARGET)[0], expected, **TOL)
    model.scale.mul_(10.0)  # eager sees this; the compiled program holds the value at compile time
    assert not torch.allclose(model(x, FLOAT_TARGET)[0], expected)
    torch.testing.assert_close(inference(x, FLOAT_TARGET)[0], expected, **TOL)


def test_an_outside_tensor_that_requires_grad_gets_no_gradient():
    torch.manual_seed(0)
    free = torch.rand(5, requires_grad=True)  # not a parameter of the model
    before = free.detach().clone()

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 5)

        def forward(self, x, target):
            out = self.fc(x) * free
            return out, F.mse_loss(out, target)

    model = Scaled()
    ref = copy.deepcopy(model)
    training = ipuxl.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    out, _ = training(torch.randn(8, 4), FLOAT_TARGET)
    training.copyWeightsToHost()
    torch.testing.assert_close(free.detach(), before)
    assert free.grad is None
    assert not torch.allclose(model.fc.weight, ref.fc.weight)  # the model itself trained


def test_in_place_write_to_an_outside_tensor_is_refused():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 5)
            self.count = torch.zeros(5)  # plain attribute

        def forward(self, x):
            self.count.add_(1.0)
            return self.fc(x) + self.count

    model = Counter()
    with raises(TraceError, "add_", "not a parameter, buffer or input", "register_buffer"):
        ipuxl.inferenceModel(model)(torch.randn(2, 4))
    torch.testing.assert_close(model.count, torch.zeros(5))  # tracing left the user's tensor alone


# -- 2. eval-mode submodules inside a training model -----------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.9)
        self.out = nn.Linear(8, 3)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.out(self.drop(self.bn(self.fc(x))))
        return out, self.loss(out, y)


def test_eval_submodules_stay_in_eval_mode_in_a_training_model():
    torch.manual_seed(0)
    model = Net()
    model.bn.running_mean.normal_()
    model.bn.running_var.uniform_(0.5, 2.0)
    model.bn.eval()
    model.drop.eval()
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    ref = train_side_by_side(model, x, y)  # dropout off, BatchNorm on running statistics
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
    assert (model.training, model.bn.training, model.drop.training) == (True, False, False)


def test_eval_batchnorm_in_a_training_model_keeps_its_running_statistics():
    torch.manual_seed(0)
    model = Net()
    model.drop.p = 0.0
    model.bn.eval()
    stats = model.bn.running_mean.clone(), model.bn.running_var.clone()
    ref = train_side_by_side(model, torch.randn(16, 6), torch.randint(0, 3, (16,)))
    torch.testing.assert_close(model.bn.running_mean, stats[0])
    torch.testing.assert_close(model.bn.running_var, stats[1])
    torch.testing.assert_close(ref.bn.running_var, stats[1])


# -- 3. float16 models ---------------------------------------------------------------
class HalfNet(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 4)
        self.variant = variant

    def forward(self, x, y):
        if self.variant == "cast-input":
            x = x.half()
        out = self.out(torch.relu(self.bn(self.fc(x))))
        if self.variant == "mse":
            return out, F.mse_loss(out, y)
        if self.variant == "float-loss":
            return out, F.cross_entropy(out.float(), y)
        return out, F.cross_entropy(out, y)


HALF_X = torch.randn(16, 6, generator=torch.Generator().manual_seed(3))
HALF_LABELS = torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("variant, x, y, loss_dtype", [
    ("ce", HALF_X.half(), HALF_LABELS, torch.float16),
    ("float-loss", HALF_X.half(), HALF_LABELS, torch.float32),
    ("cast-input", HALF_X, HALF_LABELS, torch.float16),
    ("mse", HALF_X.half(), torch.randn(16, 4).half(), torch.float16),
])
def test_float16_model_trains_as_eager_float16(variant, x, y, loss_dtype):
    torch.manual_seed(0)
    model = HalfNet(variant).half()
    half_tol = dict(rtol=1e-2, atol=1e-2)  # float16 keeps ~3 significant digits
    ref = train_side_by_side(model, x, y, lr=0.05, **half_tol)  # assert_close checks dtypes too
    assert model.fc.weight.dtype == torch.float16
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean, **half_tol)
    ref.eval()
    out, loss = ipuxl.inferenceModel(model.eval())(x, y)
    assert out.dtype == torch.float16 and loss.dtype == loss_dtype
    torch.testing.assert_close(out, ref(x, y)[0].detach(), **half_tol)


# -- 4. data-dependent ops -------------------------------------------------------------
class Apply(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("fn, op, fix", [
    (lambda x: x[x > 0], "aten.index", "torch.where(mask, x, 0)"),
    (lambda x: torch.nonzero(x > 0), "aten.nonzero", "nonzero_static"),
    (lambda x: torch.masked_select(x, x > 0), "aten.masked_select", "torch.where(mask, x, 0)"),
    (lambda x: torch.bincount((x.abs() * 3).long().flatten()), "aten.bincount", "one_hot"),
    (lambda x: torch.unique(x.round()), "aten._unique2", "on the host"),
    (lambda x: x[x > 0].sum(), "aten.index", "torch.where"),  # static result, data-dependent inside
], ids=["mask-index", "nonzero", "masked_select", "bincount", "unique", "mask-then-sum"])
def test_ops_with_value_dependent_shapes_are_refused(fn, op, fix):
    with raises(TraceError, f"uses {op}", "depends on tensor values", "Apply") as info:
        ipuxl.inferenceModel(Apply(fn))(torch.randn(4, 5))
    assert fix in info.value.fix


@pytest.mark.parametrize("fn", [
    lambda x: torch.where(x > 0, x, 0.0),
    lambda x: torch.nonzero_static(x > 0, size=20),
    lambda x: (x * (x > 0)).sum(1),
    lambda x: F.one_hot((x.abs() * 2).long().clamp(max=4).flatten(), num_classes=5).sum(0),
], ids=["where", "nonzero_static", "mask-multiply", "one-hot-count"])
def test_static_shape_forms_of_those_ops_run_as_eager(fn):
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(ipuxl.inferenceModel(Apply(fn))(x), as_poptorch(fn(x)))


INDEX = torch.tensor([0, 1, 0, 2])


@pytest.mark.parametrize("reduce_fn", [
    lambda h: torch.ones(3, 5).scatter_reduce(0, INDEX[:, None].expand(4, 5), h, reduce="prod"),
    lambda h: torch.ones(3, 5).scatter_reduce(0, INDEX[:, None].expand(4, 5), h, reduce="prod", include_self=False),
    lambda h: torch.full((6, 3), 2.0).scatter_reduce(1, torch.tensor([[0, 2], [1, 1], [0, 0], [2, 2]]), h[:, :2],
                                                     reduce="prod"),
    lambda h: torch.scatter_reduce(torch.ones(3, 5), 0, INDEX[:, None].expand(4, 5), h * (h > 0), "prod"),
    lambda h: torch.full((3, 5), 2.0).index_reduce(0, INDEX, h, "prod"),
    lambda h: torch.full((3, 5), 2.0).index_reduce(0, INDEX, h, "prod", include_self=False),
    lambda h: torch.full((4, 3), 2.0).index_reduce(1, torch.tensor([0, 2, 2, 0, 1]), h, "prod"),
], ids=["scatter", "scatter-exclude-self", "scatter-dim1-narrow-index", "scatter-with-zeros", "index",
        "index-exclude-self", "index-dim1"])
@pytest.mark.filterwarnings("ignore:index_reduce")
def test_product_scatters_train_as_eager(reduce_fn):
    class Reduce(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 5)

        def forward(self, x):
            out = reduce_fn(self.fc(x))
            return out, (out ** 2).sum()

    torch.manual_seed(0)
    model = Reduce()
    x = torch.randn(4, 5)
    torch.testing.assert_close(ipuxl.inferenceModel(copy.deepcopy(model))(x)[0], model(x)[0].detach(), **TOL)
    train_side_by_side(model, x, steps=2, lr=0.01)


# -- 5. torch's own error types for bad op arguments ---------------------------------------
class Bad(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.fc(x))


@pytest.mark.parametrize("fn", [
    lambda h: h @ torch.ones(5, 2),
    lambda h: F.linear(h, torch.ones(3, 3)),
    lambda h: h.sum(dim=5),
    lambda h: h[7],
    lambda h: h.view(-1, -1),
    lambda h: h.reshape(5, 5),
], ids=["matmul", "linear", "sum-dim", "index", "view", "reshape"])
def test_bad_op_arguments_raise_eagers_type_and_message(fn):
    with pytest.raises(Exception) as eager:
        fn(torch.randn(3, 4))
    eager_type, eager_message = type(eager.value), str(eager.value).strip().splitlines()[0]
    with raises(TraceError, "module Bad", eager_message) as info:
        ipuxl.inferenceModel(Bad(fn))(torch.randn(3, 4))
    assert isinstance(info.value, eager_type)
    assert isinstance(info.value.__cause__, Exception)
    again = pickle.loads(pickle.dumps(info.value))  # e.g. sent back by a replica's process
    assert isinstance(again, eager_type) and isinstance(again, TraceError) and str(again) == str(info.value)


@pytest.mark.parametrize("fn", [lambda h: torch.cat(h, h), lambda h: h + "a"], ids=["cat-args", "add-str"])
def test_errors_python_raises_on_the_users_line_are_eagers_own(fn):
    """Python's argument parsing fails on the forward's own line (no torch kernel ran): the
    caller gets eager's exception itself, type and message unchanged (PopTorch lets a
    forward's exceptions through); its ``where`` names the line."""
    with pytest.raises(Exception) as eager:
        fn(torch.randn(3, 4))
    with pytest.raises(type(eager.value)) as info:
        ipuxl.inferenceModel(Bad(fn))(torch.randn(3, 4))
    assert type(info.value) is type(eager.value) and str(info.value) == str(eager.value)
    assert "test_trace.py" in info.value.where and not getattr(info.value, "__notes__", None)


def test_bad_op_arguments_in_a_training_model_keep_the_type():
    with pytest.raises(IndexError, match="Dimension out of range") as info:
        model = Bad(lambda h: (h, h.sum(dim=3)))
        ipuxl.trainingModel(model)(torch.randn(3, 4))
    assert isinstance(info.value, TraceError)


def test_wrong_forward_arguments_are_a_type_error():
    with raises(TraceError, "cannot call Bad.forward") as info:
        ipuxl.inferenceModel(Bad(torch.relu))(torch.randn(3, 4), torch.randn(3, 4))
    assert isinstance(info.value, TypeError)


# -- 6. argument names in generated code -------------------------------------------------
@pytest.mark.parametrize("names", [("self", "other"), ("torch", "x"), ("x", "x"), ("lambda_", "getattr")])
def test_generated_code_arguments_are_unique_whatever_the_names(names):
    """A graph compiled on its own (called twice) whose input names clash with ``self``,
    with a global of the generated code, or with each other."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(np.arange(3, dtype=np.float32), name="w")
        graph = ir.create_graph(lambda a, b: a * 2.0 + b, w, w)
        a, b = (t.node for t in graph.inputs)
        a.target, b.target = names  # the names fx would write as the arguments
        (y,) = ops.call(graph, w, w)
        (z,) = ops.call(graph, y, w)
        stream = ipuxl.d2h_stream((3,), ipuxl.float32, "z")
        ops.host_store(stream, z)
    ir.num_host_transfers = 1
    with ipuxl.Session(ir, "cpu") as session:
        out = session.run({})[stream]
    w0 = np.arange(3, dtype=np.float32)
    np.testing.assert_allclose(out, (w0 * 2 + w0) * 2 + w0)


@pytest.mark.parametrize("p, swap, reduction", [(2.0, True, "none"), (3.0, False, "mean"), (1.0, True, "sum")])
def test_triplet_margin_loss_as_eager(p, swap, reduction):
    torch.manual_seed(42)
    model = nn.TripletMarginLoss(margin=0.7, p=p, swap=swap, reduction=reduction)
    anchor, positive, negative = torch.randn(10, 5), torch.randn(10, 5), torch.randn(10, 5)
    inference = ipuxl.inferenceModel(model)
    for args in [(anchor, positive, negative), (anchor, anchor, negative)]:  # the same tensor twice too
        expected = model(*args)
        torch.testing.assert_close(scalar_like(inference(*args), expected), expected, **TOL)


@pytest.mark.parametrize("loss", [
    lambda: nn.TripletMarginLoss(swap=True, p=1),
    lambda: nn.TripletMarginWithDistanceLoss(swap=True),
    lambda: nn.TripletMarginWithDistanceLoss(distance_function=nn.PairwiseDistance(p=1.5), margin=0.5),
], ids=["triplet", "with-distance", "with-pairwise-distance"])
def test_triplet_losses_train_as_eager_with_a_shared_embedding(loss):
    class Siamese(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4))
            self.loss = loss()

        def forward(self, anchor, positive, negative):
            a = self.embed(anchor)
            return a, self.loss(a, self.embed(positive), self.embed(negative))

    torch.manual_seed(0)
    anchor, negative = torch.randn(10, 5), torch.randn(10, 5)
    train_side_by_side(Siamese(), anchor, anchor + 0.1, negative)
    train_side_by_side(Siamese(), anchor, anchor, negative)  # one tensor given as two inputs


@pytest.mark.parametrize("loss, second", [
    (lambda: nn.CosineEmbeddingLoss(margin=0.2), lambda: torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, 1.0])),
    (lambda: nn.MarginRankingLoss(margin=0.3), lambda: torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, 1.0])),
], ids=["cosine-embedding", "margin-ranking"])
def test_pair_losses_train_as_eager(loss, second):
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.loss = loss()

        def forward(self, a, b, target):
            x, y = self.fc(a), self.fc(b)
            if isinstance(self.loss, nn.MarginRankingLoss):
                x, y = x.sum(1), y.sum(1)
            return x, self.loss(x, y, target)

    torch.manual_seed(0)
    a = torch.randn(6, 4)
    train_side_by_side(Pair(), a, torch.randn(6, 4), second())
    train_side_by_side(Pair(), a, a, second())
