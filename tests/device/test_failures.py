"""Failed runs: the state a failed step leaves, the error that reports it, and an IR
changed after its Session was created.

Programs are in PopXL's device-loop form: ``ops.repeat`` of a step graph that loads
its own data, so a step is a host transfer (one iteration). The rule: when step k of n fails, steps 1..k-1 stay applied and host and device agree
on them (reads sync, the next run continues from them); in-place updates step k made
before its failing op stay too and the error names them. The error names the failing op
and the user's line that built it. numpy is the oracle for every number.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import ipuxl
from ipuxl.device import failures
import ipuxl.ops as ops
from ipuxl.errors import DeviceError, InvalidArgumentError, ReplicationError

F32 = ipuxl.float32
STEPS = 3
TABLE = np.arange(8, dtype=np.float32).reshape(4, 2)


def _scalar(value: float) -> np.ndarray:
    return np.array(value, np.float32)


def _line_of(marker: str) -> int:
    """The line of this file that ends with ``marker`` (a comment on the line under test)."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(marker))


def _assert_source(source: str | None, marker: str, function: str) -> None:
    """``source`` is ``<this file>:<line of marker> in <function>``."""
    match = re.fullmatch(r"(.+):(\d+) in (\S+)", source or "")
    assert match, source
    assert os.path.samefile(match[1], __file__)
    assert (int(match[2]), match[3]) == (_line_of(marker), function)


# -- the program: a variable updated before a gather, one after it -----------------------------
def _gather_program(replication: int = 1):
    """``ops.repeat`` of ``gather_step``, STEPS iterations per run."""
    ir = ipuxl.Ir(replication=replication)
    ir.num_host_transfers = STEPS
    with ir.main_graph:
        idx_stream = ipuxl.h2d_stream((2,), ipuxl.int32, "idx")
        total_stream = ipuxl.d2h_stream((), F32, "total")
        acc_stream = ipuxl.d2h_stream((2,), F32, "acc_out")
        table = ipuxl.variable(TABLE, F32, name="table")
        count = ipuxl.variable(np.float32(0), F32, name="count")
        acc = ipuxl.variable(np.zeros(2, np.float32), F32, name="acc")

        def gather_step(table, count: ipuxl.TensorByRef, acc: ipuxl.TensorByRef):
            """One step, in sequence: ``count += 1``; store the all-reduced count; ``rows =
            table[idx]`` (idx loaded); ``acc += all_reduce(sum(rows, 0))``; store acc."""
            with ipuxl.in_sequence():
                ops.var_updates.accumulate_(count, ipuxl.constant(np.float32(1)))
                ops.host_store(total_stream, ops.collectives.replicated_all_reduce(count))
                rows = ops.gather(table, ops.host_load(idx_stream))  # <- the gather
                ops.var_updates.accumulate_(acc, ops.collectives.replicated_all_reduce(ops.sum(rows, 0)))
                ops.host_store(acc_stream, acc)

        ops.repeat(ir.create_graph(gather_step, table, count, acc), STEPS, table, count, acc)
    return ir, idx_stream, (count, acc), (total_stream, acc_stream)


def _numpy_steps(idx: np.ndarray, count: float, acc: np.ndarray):
    """numpy: the program's steps over ``idx`` shaped (steps, replicas, 2), from (count, acc)."""
    counts, accs = [], []
    acc = acc.copy()
    for step in idx:
        count += 1
        acc = acc + sum(TABLE[replica_idx].sum(0) for replica_idx in step)
        counts.append(count)
        accs.append(acc)
    return _scalar(count), acc, np.array(counts, np.float32), np.array(accs, np.float32)


GOOD = np.array([[0, 1], [2, 3], [3, 0]], np.int32)
BAD_IN_STEP_2 = np.array([[1, 2], [0, 9], [1, 1]], np.int32)


# -- (a) PopXL Session --------------------------------------------------------------------------
def test_a_failed_step_keeps_the_applied_steps_and_names_the_op_and_line():
    ir, idx_stream, (count, acc), (_, acc_stream) = _gather_program()
    with ipuxl.Session(ir, "cpu") as session:
        with pytest.raises(DeviceError) as info:
            session.run({idx_stream: BAD_IN_STEP_2})
        err = info.value
        assert (err.steps_applied, err.step, err.failed_op) == (1, 2, "gather")
        _assert_source(err.source, "# <- the gather", "gather_step")
        _assert_source(err.where.split(" (")[0], "# <- the gather", "gather_step")
        message = str(err)
        assert "the device program failed in step 2 of 3 at op 'gather' (from " in message
        assert "index out of range" in message
        assert "step 1 was applied and kept: the variables now hold their values after step 1" in message
        assert "step 2 had already updated 'count' in place before the failing op" in message
        assert "fix: check the labels / gather indices fed to stream 'idx' (step 2 has values 0 to 9)" in message
        assert isinstance(err.__cause__, IndexError)

        # step 1 applied; step 2's count update (before the gather) applied once, not re-applied
        count_1, acc_1, _, _ = _numpy_steps(BAD_IN_STEP_2[:1, None], 0.0, np.zeros(2, np.float32))
        assert_close(session.get_tensor_data(acc), acc_1)
        assert_close(session.get_tensor_data(count), _scalar(count_1 + 1))
        assert_close(session.get_tensors_data([count, acc])[acc], acc_1)

        # the next run continues from the device's values
        out = session.run({idx_stream: GOOD})
        count_end, acc_end, _, accs = _numpy_steps(GOOD[:, None], count_1 + 1, acc_1)
        assert_close(out[acc_stream], accs)
        assert_close(session.get_tensor_data(acc), acc_end)
        assert_close(session.get_tensor_data(count), count_end)


def test_a_failed_run_leaving_the_with_block_is_copied_back_on_exit():
    ir, idx_stream, (count, acc), _ = _gather_program()
    session = ipuxl.Session(ir, "cpu")
    with pytest.raises(DeviceError, match="failed in step 2 of 3"):
        with session:
            session.run({idx_stream: GOOD})
            session.run({idx_stream: BAD_IN_STEP_2})
    assert not session.is_attached
    count_1, acc_1, _, _ = _numpy_steps(np.concatenate([GOOD, BAD_IN_STEP_2[:1]])[:, None], 0.0,
                                        np.zeros(2, np.float32))
    assert_close(session.get_tensor_data(acc), acc_1)
    assert_close(session.get_tensor_data(count), _scalar(count_1 + 1))
    with session:  # attaching again loads the kept values
        session.run({idx_stream: GOOD})
        _, acc_end, _, _ = _numpy_steps(GOOD[:, None], count_1 + 1, acc_1)
        assert_close(session.get_tensor_data(acc), acc_end)


def test_the_first_step_failing_leaves_the_values_from_before_the_run():
    ir, idx_stream, (count, acc), _ = _gather_program()
    with ipuxl.Session(ir, "cpu") as session:
        session.run({idx_stream: GOOD})
        with pytest.raises(DeviceError) as info:
            session.run({idx_stream: np.array([[7, 0], [0, 0], [0, 0]], np.int32)})
        assert (info.value.steps_applied, info.value.step) == (0, 1)
        assert "no step of this run completed: the variables hold their values from before it" in str(info.value)
        count_0, acc_0, _, _ = _numpy_steps(GOOD[:, None], 0.0, np.zeros(2, np.float32))
        assert_close(session.get_tensor_data(acc), acc_0)
        assert_close(session.get_tensor_data(count), _scalar(count_0 + 1))


def test_when_the_step_passes_again_the_error_keeps_the_step_without_the_op(monkeypatch):
    ir, idx_stream, (_, acc), _ = _gather_program()
    monkeypatch.setattr(failures, "_rerun_failed_step", lambda session, failure: None)  # as if it did not repeat
    with ipuxl.Session(ir, "cpu") as session:
        with pytest.raises(DeviceError) as info:
            session.run({idx_stream: BAD_IN_STEP_2})
        err = info.value
        assert (err.steps_applied, err.step, err.failed_op, err.source) == (1, 2, None, None)
        assert str(err).startswith("the device program failed in step 2 of 3: index out of range")
        assert "step 1 was applied and kept" in str(err)
        _, acc_1, _, _ = _numpy_steps(BAD_IN_STEP_2[:1, None], 0.0, np.zeros(2, np.float32))
        assert_close(session.get_tensor_data(acc), acc_1)


# -- (b) in-process replicas ----------------------------------------------------------------------
def test_b_a_failing_replica_keeps_the_applied_steps_of_all_replicas():
    ir, idx_stream, (count, acc), (total_stream, acc_stream) = _gather_program(replication=2)
    bad = np.stack([GOOD, BAD_IN_STEP_2], axis=1)  # (steps, replicas, 2): replica 1 is bad in step 2
    with ipuxl.Session(ir, "cpu") as session:
        with pytest.raises(DeviceError) as info:
            session.run({idx_stream: bad})
        err = info.value
        assert (err.steps_applied, err.step, err.failed_op) == (1, 2, "gather")
        _assert_source(err.source, "# <- the gather", "gather_step")
        message = str(err)
        assert "the device program failed in step 2 of 3, replica 1 of 2 at op 'gather' (from " in message
        assert "step 1 was applied and kept" in message
        assert "step 2 had already updated 'count'" in message
        assert "stream 'idx' (step 2 has values 0 to 9)" in message

        count_1, acc_1, _, _ = _numpy_steps(bad[:1], 0.0, np.zeros(2, np.float32))
        assert_close(session.get_tensor_data(acc), acc_1)
        assert_close(session.get_tensor_data(count), _scalar(count_1 + 1))

        good = np.stack([GOOD, GOOD[::-1]], axis=1)
        out = session.run({idx_stream: good})
        count_end, acc_end, counts, accs = _numpy_steps(good, count_1 + 1, acc_1)
        assert_close(out[acc_stream], np.repeat(accs[:, None], 2, axis=1))  # both replicas agree
        assert_close(out[total_stream], np.repeat(2 * counts[:, None], 2, axis=1))
        assert_close(session.get_tensor_data(acc), acc_end)
        assert_close(session.get_tensor_data(count), count_end)


# -- (c) PopTorch-style model ---------------------------------------------------------------------
class _Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 5)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels):
        out = self.linear(x)
        loss = self.loss(out, labels)  # <- the loss
        return out, loss


def test_c_a_bad_label_names_the_loss_op_and_the_line_of_forward():
    torch.manual_seed(0)
    model = _Classifier()
    opts = ipuxl.Options().deviceIterations(4)
    training = ipuxl.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4 * 2, 6)
    labels = torch.randint(0, 5, (4 * 2,))
    labels[5] = 7  # micro-batch 3 of 4
    with pytest.raises(DeviceError) as info:
        training(x, labels)
    err = info.value
    assert err.step == 3 and err.steps_applied == 2
    assert err.failed_op.startswith("nll_loss")
    _assert_source(err.source, "# <- the loss", "forward")
    message = str(err)
    assert re.search(r"failed in step 3 of 4 at op 'nll_loss\w*' \(from .*test_failures\.py:"
                     fr"{_line_of('# <- the loss')} in forward\): Target 7 is out of bounds", message), message
    assert f"test_failures.py:{_line_of('# <- the loss')} in forward" in err.where
    assert "stream 'labels' (step 3 has values" in message


# -- (d) the IR changed after the Session was created -------------------------------------------
def _assert_fix(err: Exception) -> None:
    assert "create a new Session after changing the IR" in str(err)


def test_d_a_variable_added_after_the_session_is_refused_with_its_line():
    ir, idx_stream, (count, _), _ = _gather_program()
    session = ipuxl.Session(ir, "cpu")
    with ir.main_graph:
        late = ipuxl.variable(np.ones(2, np.float32), F32, name="late")  # <- late variable
    with pytest.raises(InvalidArgumentError) as info:
        session.get_tensor_data(late)
    assert "variable 'late' was added to the IR after this Session was created" in str(info.value)
    _assert_source(info.value.where, "# <- late variable", "test_d_a_variable_added_after_the_session_is_refused_with_its_line")
    _assert_fix(info.value)
    with pytest.raises(InvalidArgumentError, match="'late' was added"):
        session.write_variable_data(late, np.zeros(2, np.float32))
    assert_close(session.get_tensor_data(count), _scalar(0))  # known variables still work
    with session:
        with pytest.raises(DeviceError, match=r"the IR has 1 variable\(s\) more .*\('late'\)") as run_info:
            session.run({idx_stream: GOOD})
    _assert_fix(run_info.value)
    assert "Session.run at " in run_info.value.where and "the Session was created at " in run_info.value.where
    assert f"'late' made at {__file__}:{_line_of('# <- late variable')} in " in run_info.value.where


def test_d_replication_factor_changed_after_the_session_is_refused():
    ir, idx_stream, _, _ = _gather_program()
    with ipuxl.Session(ir, "cpu") as session:
        ir.replication_factor = 2
        with pytest.raises(ReplicationError, match="ir.replication_factor changed from 1 to 2") as info:
            session.run({idx_stream: np.stack([GOOD, GOOD], axis=1)})
        _assert_fix(info.value)
        assert session.replication_factor == 1
        ir.replication_factor = 1
        session.run({idx_stream: GOOD})  # back as compiled: runs


def test_d_num_host_transfers_changed_after_the_session_is_refused():
    ir, idx_stream, (_, acc), _ = _gather_program()
    with ipuxl.Session(ir, "cpu") as session:
        ir.num_host_transfers = 5
        with pytest.raises(DeviceError, match="ir.num_host_transfers changed from 3 to 5") as info:
            session.run({idx_stream: np.zeros((5, 2), np.int32)})
        _assert_fix(info.value)
        assert_close(session.get_tensor_data(acc), np.zeros(2, np.float32))  # nothing ran


# -- (e) the diagnosis works on copies -------------------------------------------------------------
def test_e_finding_the_op_leaves_the_variables_as_the_failed_run_did():
    """The failing op is in a graph called from two sites (compiled once, run by reference):
    re-running the step to find it must not update the device's variables again."""
    ir = ipuxl.Ir()
    ir.num_host_transfers = STEPS
    with ir.main_graph:
        a_stream = ipuxl.h2d_stream((2,), ipuxl.int32, "a")
        b_stream = ipuxl.h2d_stream((2,), ipuxl.int32, "b")
        table = ipuxl.variable(TABLE, F32, name="table")
        hits = ipuxl.variable(np.float32(0), F32, name="hits")
        acc = ipuxl.variable(np.zeros(2, np.float32), F32, name="acc")

        def bump_and_pick(counter: ipuxl.TensorByRef, t, idx):
            ops.var_updates.accumulate_(counter, ipuxl.constant(np.float32(1)))
            return ops.gather(t, idx)  # <- the callee's gather

        graph = ir.create_graph(bump_and_pick, hits, table, ipuxl.TensorSpec((2,), ipuxl.int32))

        def step(hits: ipuxl.TensorByRef, table, acc: ipuxl.TensorByRef):
            with ipuxl.in_sequence():
                rows_a, = ops.call(graph, hits, table, ops.host_load(a_stream))
                rows_b, = ops.call(graph, hits, table, ops.host_load(b_stream))
                ops.var_updates.accumulate_(acc, ops.sum(rows_a, 0) + ops.sum(rows_b, 0))

        ops.repeat(ir.create_graph(step, hits, table, acc), STEPS, hits, table, acc)
    a = GOOD
    b = BAD_IN_STEP_2
    with ipuxl.Session(ir, "cpu") as session:
        body = session.compiled_graph(ir.graphs[-1]).module.code
        assert len(re.findall(r"= ipuxl_compiled_call_\w*bump_and_pick\w*\(", body)) == 2  # not inlined
        with pytest.raises(DeviceError) as info:
            session.run({a_stream: a, b_stream: b})
        err = info.value
        assert (err.steps_applied, err.step, err.failed_op) == (1, 2, "gather")
        _assert_source(err.source, "# <- the callee's gather", "bump_and_pick")
        assert f"graph '{graph.name}' (called from the main program)" in err.where
        assert "step 2 had already updated 'hits'" in str(err)
        assert "stream 'b' (step 2 has values 0 to 9)" in str(err)
        # step 1: hits += 2, acc += rows; step 2 until the failing gather: hits += 2 (call a, then b's bump)
        acc_1 = TABLE[a[0]].sum(0) + TABLE[b[0]].sum(0)
        assert_close(session.get_tensor_data(hits), _scalar(4))
        assert_close(session.get_tensor_data(acc), acc_1)
        assert_close(session.get_tensor_data(table), TABLE)
        session.run({a_stream: a, b_stream: a})
        assert_close(session.get_tensor_data(hits), _scalar(4 + 2 * STEPS))
        assert_close(session.get_tensor_data(acc), acc_1 + 2 * sum(TABLE[i].sum(0) for i in a))


def test_e_a_failure_inside_a_repeated_graph_names_the_op_in_its_body():
    """Loop bodies are run node by node too: the error names the op of the inner loop's
    body (a loop inside the device loop), not the repeat."""
    ir = ipuxl.Ir()
    ir.num_host_transfers = STEPS
    with ir.main_graph:
        idx_stream = ipuxl.h2d_stream((2,), ipuxl.int32, "idx")
        table = ipuxl.variable(TABLE, F32, name="table")
        acc = ipuxl.variable(np.zeros(2, np.float32), F32, name="acc")

        def body(total, t, idx):
            return total + ops.sum(ops.gather(t, idx), 0)  # <- the loop body's gather

        graph = ir.create_graph(body, ipuxl.TensorSpec((2,), F32), table, ipuxl.TensorSpec((2,), ipuxl.int32))

        def step(table, acc: ipuxl.TensorByRef):
            total, = ops.repeat(graph, 2, ipuxl.constant(np.zeros(2, np.float32)), table, ops.host_load(idx_stream))
            ops.var_updates.accumulate_(acc, total)

        ops.repeat(ir.create_graph(step, table, acc), STEPS, table, acc)
    with ipuxl.Session(ir, "cpu") as session:
        with pytest.raises(DeviceError) as info:
            session.run({idx_stream: BAD_IN_STEP_2})
        err = info.value
        assert (err.steps_applied, err.step, err.failed_op) == (1, 2, "gather")
        _assert_source(err.source, "# <- the loop body's gather", "body")
        assert f"graph '{graph.name}' (called from the main program)" in err.where
        assert "stream 'idx' (step 2 has values 0 to 9)" in str(err)
        assert_close(session.get_tensor_data(acc), 2 * TABLE[BAD_IN_STEP_2[0]].sum(0))
