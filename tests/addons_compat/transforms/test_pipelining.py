"""Pipelining: the textbook schedule, popxl.addons' ``pipelined_execution`` (numerics equal to the
same micro-batches run one after another; eager PyTorch as the oracle of the gradients), its
errors, and the schedule and idle fractions in the report."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.device.pipeline import pipeline_schedule
from ipuxl.errors import GraphContextError
from ipuxl.ir.meta import PIPELINE_STAGE

rng = np.random.default_rng(1818)


def _greedy_pipeline(stages: int, micro_batches: int) -> list[list[tuple[int, int]]]:
    """The oracle: each cycle every stage takes its next micro-batch as soon as the previous stage
    finished it in an earlier cycle (one micro-batch per stage per cycle)."""
    done = {s: -1 for s in range(-1, stages)}
    done[-1] = micro_batches - 1  # the input has every micro-batch ready
    cycles = []
    while done[stages - 1] < micro_batches - 1:
        ready = dict(done)
        cycle = []
        for s in range(stages):
            m = done[s] + 1
            if m < micro_batches and (s == 0 or ready[s - 1] >= m):
                cycle.append((s, m))
                done[s] = m
        cycles.append(cycle)
    return cycles


def test_schedule_of_4_stages_over_8_micro_batches_is_the_textbook_order():
    schedule = pipeline_schedule(4, 8)
    assert [list(c) for c in schedule.cycles] == _greedy_pipeline(4, 8)
    assert len(schedule.cycles) == 8 + 4 - 1
    phases = [schedule.phase(c) for c in range(len(schedule.cycles))]
    assert phases == ["ramp-up"] * 3 + ["steady"] * 5 + ["ramp-down"] * 3
    assert all(len(schedule.cycles[c]) == 4 for c in range(3, 8))  # steady state: every stage busy
    for s in range(4):  # each stage sees the micro-batches in order
        assert [m for st, m in schedule.steps() if st == s] == list(range(8))
    idle = schedule.idle_fraction()
    assert idle == {s: 1 - 8 / 11 for s in range(4)}
    shared = schedule.idle_fraction({0: 0, 1: 1, 2: 1, 3: 0})  # stage 0 runs cycles 0-7, 1: 1-8, 2: 2-9, 3: 3-10
    assert shared == {0: 0.0, 1: 1 - 9 / 11}


def test_schedule_counts_must_be_positive():
    with pytest.raises(ValueError, match="stages must be an int >= 1"):
        pipeline_schedule(0, 4)


def _four_stage_program(steps: int):
    ir = ipuxl.Ir()
    ir.num_host_transfers = steps
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((3,), ipuxl.float32, "x")
        y_stream = ipuxl.d2h_stream((3,), ipuxl.float32, "y")
        with addons.pipelined_execution(steps) as pipeline:
            with pipeline.stage(0), ipuxl.ipu(0):
                x = ops.host_load(x_stream)
                x = ops.exp(x).copy_to_ipu(1)
            with pipeline.stage(1), ipuxl.ipu(1):
                x = (x * 2.0).copy_to_ipu(2)
            with pipeline.stage(2), ipuxl.ipu(2):
                x = (x + 1.0).copy_to_ipu(3)
            with pipeline.stage(3), ipuxl.ipu(3):
                ops.host_store(y_stream, x * x)
    return ir, x_stream, y_stream


def test_four_stage_pipeline_gives_each_micro_batch_its_result_in_order():
    steps = 8
    ir, x_stream, y_stream = _four_stage_program(steps)
    x_np = rng.standard_normal((steps, 3)).astype(np.float32)
    with ipuxl.Session(ir, "ipu_model") as session:
        result = session.run({x_stream: x_np})[y_stream]
        report = session.report()
    assert_close(torch.from_numpy(result), (torch.exp(torch.from_numpy(x_np)) * 2 + 1) ** 2)
    calls = [n for n in ir.main_graph.fx.nodes if PIPELINE_STAGE in n.meta]
    assert [n.meta[PIPELINE_STAGE] for n in calls] == [s for s, _ in pipeline_schedule(4, steps).steps()]
    assert report.ipus.schedule == pipeline_schedule(4, steps)
    assert report.ipus.stage_ipus == {0: 0, 1: 1, 2: 2, 3: 3}
    assert [report.ipus.usage(i).idle_fraction for i in range(4)] == [1 - steps / (steps + 3)] * 4
    assert report.ipus.copies == {(0, 1): 12 * steps, (1, 2): 12 * steps, (2, 3): 12 * steps}
    text = str(report)
    assert "Pipeline: 4 stages x 8 micro-batches, 11 cycles" in text and "stage 3 (IPU 3)" in text


class _Linear(addons.Module):
    def __init__(self, out_features: int, relu: bool = True):
        super().__init__()
        self.out_features, self.relu = out_features, relu

    def build(self, x: ipuxl.Tensor) -> ipuxl.Tensor:
        w = self.add_variable_input("weight", partial(np.random.normal, 0, 0.5, (x.shape[-1], self.out_features)),
                                    x.dtype)
        b = self.add_variable_input("bias", partial(np.random.normal, 0, 0.1, (self.out_features,)), x.dtype)
        y = x @ w + b
        return ops.relu(y) if self.relu else y


def _training_program(steps: int, pipelined: bool, recompute: bool = False):
    """fc1 on IPU 0 (stage 0), fc2 + loss + fc2 backward on IPU 1 (stage 1), fc1 backward on IPU 0
    (stage 2); gradients accumulated (running mean) over ``steps`` micro-batches. Without
    pipelining the same ops run once per ``Session.run``."""
    np.random.seed(7)
    ir = ipuxl.Ir()
    ir.num_host_transfers = steps if pipelined else 1
    with ir.main_graph, ipuxl.in_sequence():
        x_stream = ipuxl.h2d_stream((4, 6), ipuxl.float32, "x")
        label_stream = ipuxl.h2d_stream((4,), ipuxl.int32, "labels")
        loss_stream = ipuxl.d2h_stream((), ipuxl.float32, "loss")
        spec1, spec2 = ipuxl.TensorSpec((4, 6), ipuxl.float32), ipuxl.TensorSpec((4, 5), ipuxl.float32)
        with ipuxl.ipu(0):
            facts1, fc1 = _Linear(5).create_graph(spec1)
            dfacts1, dfc1 = addons.autodiff_with_accumulation(fc1, fc1.args.tensors)
        with ipuxl.ipu(1):
            facts2, fc2 = _Linear(3, relu=False).create_graph(spec2)
            dfacts2, dfc2 = addons.autodiff_with_accumulation(fc2, fc2.args.tensors,
                                                              grads_required=(fc2.graph.inputs[0],))
        if recompute:
            dfc1 = addons.transforms.recompute_graph(dfc1)
        pipeline_context = addons.pipelined_execution(steps) if pipelined else None
        pipeline = pipeline_context.__enter__() if pipeline_context else None

        def stage(i: int):
            return pipeline.stage(i) if pipeline else ipuxl.in_sequence()

        with stage(0), ipuxl.ipu(0):
            v1 = facts1.init("fc1")
            info1 = fc1.bind(v1).call_with_info(ops.host_load(x_stream))
            h = info1.outputs[0].copy_to_ipu(1)
        with stage(1), ipuxl.ipu(1):
            v2, a2 = facts2.init("fc2"), dfacts2.init("fc2_grad")
            info2 = fc2.bind(v2).call_with_info(h)
            loss, dlogits = addons.ops.cross_entropy_with_grad(info2.outputs[0], ops.host_load(label_stream))
            ops.host_store(loss_stream, loss)
            (dh,) = dfc2.bind(a2).call(dlogits, args=dfc2.grad_graph_info.inputs_dict(info2))
            dh = dh.copy_to_ipu(0)
        with stage(2), ipuxl.ipu(0):
            a1 = dfacts1.init("fc1_grad")
            activations = (pipeline.stash_and_restore_activations(info1, dfc1.grad_graph_info) if pipeline
                           else dfc1.grad_graph_info.inputs_dict(info1))
            dfc1.bind(a1).call(dh, args=activations)
        if pipeline_context:
            pipeline_context.__exit__(None, None, None)
    weights = {**{f"fc1.{k}": t for k, t in v1.named_tensors.items()},
               **{f"fc2.{k}": t for k, t in v2.named_tensors.items()}}
    accums = {**{f"fc1.{k}": t for k, t in a1.named_tensors.items()},
              **{f"fc2.{k}": t for k, t in a2.named_tensors.items()}}
    return ir, (x_stream, label_stream, loss_stream), weights, accums


def _eager_mean_grads(weights: dict[str, np.ndarray], x: np.ndarray, labels: np.ndarray):
    w = {k: torch.from_numpy(v.copy()).double().requires_grad_() for k, v in weights.items()}
    losses = []
    for xm, lm in zip(torch.from_numpy(x).double(), torch.from_numpy(labels).long()):
        h = torch.relu(xm @ w["fc1.weight"] + w["fc1.bias"])
        losses.append(F.cross_entropy(h @ w["fc2.weight"] + w["fc2.bias"], lm))
    torch.stack(losses).mean().backward()
    return torch.stack(losses).detach(), {k: t.grad for k, t in w.items()}


@pytest.mark.parametrize("recompute", [False, True])
def test_pipelined_training_accumulates_what_the_micro_batches_run_one_by_one_do(recompute):
    steps = 6
    x = rng.standard_normal((steps, 4, 6)).astype(np.float32)
    labels = rng.integers(0, 3, (steps, 4)).astype(np.int32)

    ir, (xs, ls, loss_s), weights, accums = _training_program(steps, pipelined=True, recompute=recompute)
    with ipuxl.Session(ir, "ipu_model") as session:
        initial = {k: session.get_tensor_data(t).copy() for k, t in weights.items()}
        losses = session.run({xs: x, ls: labels})[loss_s]
        pipelined = {k: session.get_tensor_data(t) for k, t in accums.items()}
        assert session.num_ipus == 2

    ir, (xs, ls, loss_s), _, accums = _training_program(steps, pipelined=False, recompute=recompute)
    with ipuxl.Session(ir, "ipu_model") as session:
        plain_losses = [session.run({xs: x[m], ls: labels[m]})[loss_s] for m in range(steps)]
        plain = {k: session.get_tensor_data(t) for k, t in accums.items()}

    assert_close(torch.from_numpy(losses), torch.from_numpy(np.stack(plain_losses)))
    for name in plain:
        assert_close(torch.from_numpy(np.asarray(pipelined[name])), torch.from_numpy(np.asarray(plain[name])))
    eager_losses, grads = _eager_mean_grads(initial, x, labels)
    assert_close(torch.from_numpy(losses).double(), eager_losses, rtol=1e-4, atol=1e-5)
    for name, grad in grads.items():  # float32 device vs float64 eager
        assert_close(torch.from_numpy(pipelined[f"{name.split('.')[0]}.accum.{name.split('.')[1]}"]).double(),
                     grad, rtol=1e-4, atol=1e-5)
    assert float(pipelined["fc1.mean_accum_counter"]) == steps


def test_an_op_outside_every_stage_is_refused():
    ir = ipuxl.Ir()
    with ir.main_graph:
        v = ipuxl.variable(np.ones(2, np.float32))
        with pytest.raises(GraphContextError, match="must be created in a stage context"):
            with addons.pipelined_execution(4) as pipeline:
                with pipeline.stage(0):
                    y = v + 1.0
                y * 2.0


def test_steps_must_be_at_least_twice_the_stages():
    ir = ipuxl.Ir()
    with ir.main_graph:
        v = ipuxl.variable(np.ones(2, np.float32))
        with pytest.raises(ValueError, match=r"at least 2x the number of stages.*steps=3 stages=2"):
            with addons.pipelined_execution(3) as pipeline:
                with pipeline.stage(0), ipuxl.ipu(0):
                    y = (v + 1.0).copy_to_ipu(1)
                with pipeline.stage(1), ipuxl.ipu(1):
                    y * 2.0


def test_stash_outside_a_stage_is_refused():
    ir = ipuxl.Ir()
    with ir.main_graph:
        v = ipuxl.variable(np.ones(2, np.float32))
        with addons.pipelined_execution(4) as pipeline:
            with pipeline.stage(0):
                y = v + 1.0
            with pytest.raises(RuntimeError, match="must be called in a stage context"):
                pipeline.stash_and_restore_tensor(y)
            with pipeline.stage(1):
                z = pipeline.stash_and_restore_tensor(y) * 2.0
                with pytest.raises(RuntimeError, match="from_stage"):
                    pipeline.stash_and_restore_tensor(v)
    ops_left = [n for n in ir.main_graph.fx.nodes if n.op == "call_function"]
    assert z.name == "mul" and ops_left  # every op moved into a stage graph: only stage calls and their outputs left
    assert all(PIPELINE_STAGE in n.meta or n.args[0].meta[PIPELINE_STAGE] == 0 for n in ops_left)


def test_upstream_import_paths_give_the_pipeline():
    import ipuxl.compat

    was_installed = ipuxl.compat.is_installed()
    ipuxl.compat.install()
    try:
        from popxl_addons.transforms.pipelining import pipelined_execution
        import popxl
        import popxl_addons
    finally:
        if not was_installed:
            ipuxl.compat.uninstall()
    assert pipelined_execution is addons.pipelined_execution is popxl_addons.pipelined_execution
    assert popxl.ipu is ipuxl.ipu and popxl.io_tiles is ipuxl.io_tiles
