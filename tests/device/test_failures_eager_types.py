"""Run-time failures keep eager PyTorch's exception type and message.

A kernel that fails while the device program runs (an index out of range, a value a
host callback refuses) raises a ``DeviceError`` that is also the built-in type eager
PyTorch raises for the same call, with eager's message, the failing op and the user's
line, and the kernel's exception as ``__cause__``: for PopTorch models and PopXL
sessions alike. Eager torch is the oracle for the type and the message.
"""
from __future__ import annotations

import copy
import os
import pickle
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipuxl
import ipuxl.ops as ops
import ipuxl.poptorch_compat as poptorch
from ipuxl.device import failures
from ipuxl.errors import DeviceError, IpuxlError, TraceError, with_builtin

BAD = torch.tensor([1, 50])  # 50 is out of range of every table below (4 rows)


class Apply(nn.Module):
    """``fn(table, indices)`` with a trained 4x3 table."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 3))
        self.fn = fn

    def forward(self, i):
        return self.fn(self.table, i)  # <- the failing call


CASES = {
    "embedding": lambda w, i: F.embedding(i, w),
    "index": lambda w, i: w[i],
    "index_select": lambda w, i: torch.index_select(w, 0, i),
    "gather": lambda w, i: torch.gather(w, 0, i[:, None].expand(-1, 3)),
    "scatter": lambda w, i: torch.zeros(4, 3).scatter(0, i[:, None].expand(-1, 3), w[:2]),
    "take": lambda w, i: torch.take(w, i),
    "cross_entropy": lambda w, i: F.cross_entropy(w[:2], i),
    "index_put": lambda w, i: w.index_put((i,), torch.ones(2, 3)),
}


def _eager_error(fn: Callable[[], object]) -> BaseException:
    with pytest.raises(Exception) as eager:
        fn()
    return eager.value


def _assert_like_eager(error: BaseException, eager: BaseException, op: str | None) -> None:
    """``error`` is a DeviceError and eager's type, with eager's message, the op and this file's line."""
    assert isinstance(error, DeviceError) and isinstance(error, type(eager)), type(error).__mro__
    assert str(eager) in str(error)
    assert type(error.__cause__) is type(eager) and str(error.__cause__) == str(eager)
    if op is not None:
        assert error.failed_op == op
    assert error.source and os.path.basename(__file__) in error.source
    assert error.fix


@pytest.mark.parametrize("name", CASES)
def test_inference_model_raises_eagers_type_and_message(name):
    fn = CASES[name]
    module = Apply(fn)
    eager = _eager_error(lambda: module(BAD))
    model = poptorch.inferenceModel(module)
    model(torch.tensor([1, 2]))  # in range: runs
    with pytest.raises(type(eager)) as info:
        model(BAD)
    _assert_like_eager(info.value, eager, None)
    assert "failed in step 1 of 1 at op '" in str(info.value)


@pytest.mark.parametrize("name", ["embedding", "gather", "cross_entropy"])
def test_training_model_raises_eagers_type_and_keeps_the_applied_steps(name):
    fn = CASES[name]
    torch.manual_seed(0)
    module = Apply(lambda w, i: fn(w, i).float().square().mean())
    ref = copy.deepcopy(module)
    eager = _eager_error(lambda: ref(BAD))
    options = poptorch.Options().deviceIterations(2)
    model = poptorch.trainingModel(module, options, optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
    with pytest.raises(DeviceError) as info:
        model(torch.tensor([1, 2, 1, 50]))  # step 2 of 2 fails
    _assert_like_eager(info.value, eager, None)
    assert info.value.steps_applied == 1
    eager_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(torch.tensor([1, 2])).backward()
    eager_opt.step()
    torch.testing.assert_close(module.table.detach(), ref.table.detach())


def test_host_callback_errors_keep_their_type():
    def refuse(t: torch.Tensor) -> torch.Tensor:
        if (t > 100).any():
            raise TypeError(f"refuse: got a value above 100 ({t.max().item()})")
        return t * 2

    class WithCallback(nn.Module):
        def __init__(self):
            super().__init__()
            self.cpu = poptorch.CPU(refuse, "refuse")

        def forward(self, x):
            return self.cpu(x) + 1  # <- the callback

    model = poptorch.inferenceModel(WithCallback())
    torch.testing.assert_close(model(torch.ones(3)), torch.full((3,), 3.0))
    eager = _eager_error(lambda: refuse(torch.full((3,), 500.0)))
    with pytest.raises(TypeError) as info:
        model(torch.full((3,), 500.0))
    _assert_like_eager(info.value, eager, "host_callback")


def test_popxl_session_gather_raises_eagers_index_error():
    ir = ipuxl.Ir()
    with ir.main_graph:
        idx = ipuxl.h2d_stream((2,), ipuxl.int32, "idx")
        out = ipuxl.d2h_stream((2, 3), ipuxl.float32, "out")
        table = ipuxl.variable(np.ones((4, 3), np.float32), ipuxl.float32, name="table")
        ops.host_store(out, ops.gather(table, ops.host_load(idx)))  # <- the gather
    eager = _eager_error(lambda: torch.index_select(torch.ones(4, 3), 0, BAD))
    with ipuxl.Session(ir) as session:
        np.testing.assert_array_equal(session.run({idx: np.array([0, 3], np.int32)})[out], np.ones((2, 3)))
        with pytest.raises(IndexError) as info:
            session.run({idx: BAD.numpy().astype(np.int32)})
    _assert_like_eager(info.value, eager, "gather")
    assert (info.value.steps_applied, info.value.step) == (0, 1)


def _replicated_gather() -> tuple[ipuxl.Ir, ipuxl.HostToDeviceStream]:
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        idx = ipuxl.h2d_stream((2,), ipuxl.int32, "idx")
        out = ipuxl.d2h_stream((2, 3), ipuxl.float32, "out")
        table = ipuxl.variable(np.ones((4, 3), np.float32), ipuxl.float32, name="table")
        ops.host_store(out, ops.gather(table, ops.host_load(idx)))  # <- the replicated gather
    return ir, idx


def test_a_failing_replica_raises_eagers_type():
    ir, idx = _replicated_gather()
    eager = _eager_error(lambda: torch.index_select(torch.ones(4, 3), 0, BAD))
    with ipuxl.Session(ir) as session:
        with pytest.raises(IndexError) as info:
            session.run({idx: np.array([[0, 1], [1, 50]], np.int32)})  # replica 1 is out of range
    _assert_like_eager(info.value, eager, "gather")
    assert "replica 1 of 2" in str(info.value)


def test_a_step_that_passes_when_run_again_keeps_the_type(monkeypatch):
    monkeypatch.setattr(failures, "_rerun_failed_step", lambda session, failure: None)  # as if it did not repeat
    model = poptorch.inferenceModel(Apply(CASES["embedding"]))
    with pytest.raises(IndexError) as info:
        model(BAD)
    assert isinstance(info.value, DeviceError) and info.value.failed_op is None
    assert "index out of range in self" in str(info.value)


def test_a_runtime_error_stays_a_plain_device_error():
    eager = _eager_error(lambda: CASES["gather"](torch.ones(4, 3), BAD))
    assert type(eager) is RuntimeError
    model = poptorch.inferenceModel(Apply(CASES["gather"]))
    with pytest.raises(DeviceError) as info:
        model(BAD)
    assert type(info.value) is DeviceError


# -- the class maker ------------------------------------------------------------------------
def test_with_builtin_makes_one_named_class_per_pair():
    made = with_builtin(DeviceError, IndexError)
    assert made is with_builtin(DeviceError, IndexError)
    assert made.__name__ == "DeviceError_IndexError" and issubclass(made, (DeviceError, IndexError))
    assert with_builtin(DeviceError, RuntimeError) is DeviceError  # already one
    assert with_builtin(TraceError, IndexError).__name__ == "TraceError_IndexError"
    assert with_builtin(TraceError, IndexError) is not made


def test_with_builtin_errors_pickle_with_their_attributes():
    made = with_builtin(DeviceError, IndexError)
    error = made("index 50 out of range", where="model.py:3 in forward", fix="keep indices in range",
                 steps_applied=2, step=3, failed_op="gather", source="model.py:3 in forward")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is made and str(again) == str(error)
    assert (again.steps_applied, again.step, again.failed_op, again.source) == (2, 3, "gather", "model.py:3 in forward")
    assert (again.what, again.where, again.fix, again.message) == (error.what, error.where, error.fix, error.what)


def test_a_device_failure_pickles_as_its_type():
    model = poptorch.inferenceModel(Apply(CASES["embedding"]))
    with pytest.raises(IndexError) as info:
        model(BAD)
    again = pickle.loads(pickle.dumps(info.value))  # e.g. sent back by a replica's process
    assert isinstance(again, IndexError) and isinstance(again, DeviceError)
    assert str(again) == str(info.value) and again.failed_op == "embedding"


def test_a_builtin_with_its_own_str_keeps_the_message():
    error = with_builtin(DeviceError, KeyError)("no such key", fix="use another")
    assert str(error) == "no such key\n  fix: use another"  # not KeyError's repr of its argument
    assert isinstance(error, IpuxlError)
