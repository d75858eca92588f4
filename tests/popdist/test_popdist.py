"""PopDist on ipuxl: answers from torchrun's environment (or one process), and a
tensor-parallel program run over processes gives the in-process bits.

Under torchrun the processes run this file as a script (``python test_popdist.py
OUT_DIR``, see the bottom): each writes its popdist answers and its replicas' results.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve()
TP, DP = 2, 2  # 4 replicas: 2 processes of 2 under torchrun, or 1 process of 4
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "POPDIST_NUM_TOTAL_REPLICAS", "POPDIST_NUM_LOCAL_REPLICAS", "POPDIST_REPLICA_INDEX_OFFSET",
              "POPDIST_NUM_IPUS_PER_REPLICA", "POPDIST_LOCAL_INSTANCE_INDEX")


@pytest.fixture
def one_process(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# -- one process ------------------------------------------------------------------------------
def test_one_process_answers_as_a_single_instance(one_process):
    import ipuxl.popdist as popdist

    assert not popdist.isPopdistEnvSet()
    assert (popdist.getNumInstances(), popdist.getInstanceIndex(), popdist.getLocalInstanceIndex()) == (1, 0, 0)
    assert (popdist.getNumTotalReplicas(), popdist.getNumLocalReplicas(), popdist.getReplicaIndexOffset()) == (1, 1, 0)
    assert popdist.getNumIpusPerReplica() == 1 and popdist.checkNumIpusPerReplica(4)
    assert popdist.execute_on_instances({0}, lambda a, b: a + b, 2, b=3) == 5


def test_multi_instance_calls_outside_a_launch_are_refused(one_process):
    import ipuxl.popdist as popdist
    import ipuxl.popdist.popart
    import ipuxl.popdist.poptorch
    from ipuxl.errors import InvalidValueError, PopdistError
    from ipuxl.ir.popart_options import SessionOptions

    for call, name in ((ipuxl.popdist.poptorch.Options, "poptorch.Options"),
                       (lambda: ipuxl.popdist.popart.configureSessionOptions(SessionOptions()),
                        "popart.configureSessionOptions"),
                       (popdist.initializeBackend, "initializeBackend")):
        with pytest.raises(PopdistError, match=f"popdist.{name} needs a multi-instance launch") as info:
            call()
        assert isinstance(info.value, RuntimeError) and "torchrun" in info.value.fix
    with pytest.raises(InvalidValueError, match=r"instances \[1\] do not exist; the program runs 1 instance"):
        popdist.execute_on_instances({0, 1}, print)


def test_poprun_variables_and_torchrun_variables_are_read(one_process):
    import ipuxl
    import ipuxl.popdist as popdist
    import ipuxl.popdist.popart
    import ipuxl.popdist.poptorch
    from ipuxl.errors import PopdistError
    from ipuxl.ir.popart_options import SessionOptions

    one_process.setenv("WORLD_SIZE", "2")
    one_process.setenv("RANK", "1")
    one_process.setenv("LOCAL_RANK", "1")
    assert popdist.isPopdistEnvSet()
    assert (popdist.getNumInstances(), popdist.getInstanceIndex(), popdist.getDeviceId()) == (2, 1, 1)
    assert (popdist.getNumTotalReplicas(), popdist.getReplicaIndexOffset()) == (2, 1)  # one replica per process
    assert ipuxl.Ir(replication="popdist").replication_factor == 2
    one_process.setenv("POPDIST_NUM_LOCAL_REPLICAS", "2")  # PopRun's variables take precedence
    assert (popdist.getNumTotalReplicas(), popdist.getNumLocalReplicas(), popdist.getReplicaIndexOffset()) == (4, 2, 2)
    ir = ipuxl.Ir(replication="popdist")
    assert (ir.replication_factor, ir.instance_replication_factor) == (4, 2)
    opts = SessionOptions()
    ipuxl.popdist.popart.configureSessionOptions(opts)
    assert (opts.replicatedGraphCount, opts.globalReplicaOffset, opts.globalReplicationFactor) == (2, 2, 4)
    assert opts.enableDistributedReplicatedGraphs
    options = ipuxl.popdist.poptorch.Options()
    # as upstream: replicationFactor is this instance's replicas (2 of the 4)
    assert (options.replication_factor, options.Distributed.processId, options.Distributed.numProcesses) == (2, 1, 2)
    assert options.total_replicas() == 4
    one_process.setenv("POPDIST_NUM_IPUS_PER_REPLICA", "2")
    with pytest.raises(PopdistError, match="ipus_per_replica=1 but the launch gives each replica 2"):
        ipuxl.popdist.poptorch.Options(ipus_per_replica=1)
    assert popdist.execute_on_instances({0}, lambda: "ran") is None  # instance 1 is not among them


def test_popdist_and_popart_are_importable_through_the_compat_hook():
    import ipuxl.compat as compat

    compat.install()
    try:
        import popart
        import popdist
        import popdist.poptorch

        assert popdist.getNumInstances() >= 1 and popdist.poptorch.Options.__module__ == "ipuxl.popdist.poptorch"
        assert popart.versionString().endswith("(ipuxl)")
        with pytest.raises(ModuleNotFoundError, match="PopART's C\\+\\+ IR"):
            import popart._internal.ir  # noqa: F401
    finally:
        compat.uninstall()


# -- torchrun: a TP x DP program over two processes -----------------------------------------------------
def tp_program():
    """A TP 2 x DP 2 feed-forward step of popxl.addons layers on ``Ir(replication="popdist")``
    (under torchrun) or 4 in-process replicas: the output and the gradients of every replica."""
    import ipuxl
    import ipuxl.addons_compat as addons
    import ipuxl.ops as ops
    import ipuxl.popdist as popdist
    from ipuxl.addons_compat.layers import Linear
    from ipuxl.addons_compat.ops.replicated_all_reduce_TP import (
        replicated_all_reduce_identical_grad_inputs, replicated_all_reduce_identical_inputs,
    )
    from ipuxl.addons_compat.patterns import apply_pre_alias_patterns

    class FeedForwardTP(addons.Module):
        def __init__(self, rg):
            super().__init__()
            self.rg = rg
            self.up, self.down = Linear(8 // TP, replica_grouping=rg), Linear(6, replica_grouping=rg)

        def build(self, x):
            z = replicated_all_reduce_identical_inputs(x, group=self.rg.transpose())
            y = self.down(ops.gelu(self.up(z)))
            return replicated_all_reduce_identical_grad_inputs(y, group=self.rg.transpose())

    np.random.seed(0)  # the same initial shards in every process
    ir = ipuxl.Ir(replication="popdist" if popdist.isPopdistEnvSet() else TP * DP)
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((3, 6), ipuxl.float32, "x")
        x = ops.host_load(x_stream)
        facts, graph = FeedForwardTP(ir.replica_grouping(stride=TP, group_size=DP)).create_graph(x)
        variables = facts.init()
        info = graph.bind(variables).call_with_info(x)
        grad = addons.autodiff(graph, grads_required=[graph.graph.inputs[0], *graph.args.tensors])
        grads = grad.call(ipuxl.constant(np.ones((3, 6), np.float32)), args=grad.grad_graph_info.inputs_dict(info))
        outputs = {}
        for name, t in [("y", info.outputs[0]), *((f"d{i}", g) for i, g in enumerate(grads))]:
            outputs[name] = ipuxl.d2h_stream(t.shape, t.dtype, name)
            ops.host_store(outputs[name], t)
    apply_pre_alias_patterns(ir)
    data = np.random.default_rng(1).standard_normal((DP, 3, 6)).astype(np.float32).repeat(TP, 0)  # per DP group
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run({x_stream: data})
    return {name: got[s] for name, s in outputs.items()}


def _run_over_processes(out: Path, processes: int) -> None:
    """torchrun this file on ``processes`` processes (this tree's ipuxl on ``PYTHONPATH``)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update({"OMP_NUM_THREADS": "1", "IPUXL_REPLICA_TIMEOUT": "60",
                "PYTHONPATH": os.pathsep.join([str(HERE.parents[2]), env.get("PYTHONPATH", "")])})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
           str(HERE), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_a_tp_program_over_two_processes_gives_the_in_process_bits(tmp_path, one_process):
    _run_over_processes(tmp_path, processes=2)
    local = tp_program()
    answers = [json.loads((tmp_path / f"popdist_{rank}.json").read_text()) for rank in range(2)]
    assert answers == [{"set": True, "instances": 2, "index": r, "total": 2, "local": 1, "offset": r}
                       for r in range(2)]
    for rank in range(2):  # each process gets every replica's outputs back, as in one process
        with np.load(tmp_path / f"tp_{rank}.npz") as got:
            assert sorted(got.files) == sorted(local)
            for name, value in local.items():
                np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert not np.array_equal(local["y"][0], local["y"][2])  # the two DP groups computed their own batches


def _main(out: Path) -> None:
    """A torchrun process: record the answers, run the TP program with two replicas per process."""
    import ipuxl.popdist as popdist

    rank = popdist.getInstanceIndex()
    answers = {"set": popdist.isPopdistEnvSet(), "instances": popdist.getNumInstances(), "index": rank,
               "total": popdist.getNumTotalReplicas(), "local": popdist.getNumLocalReplicas(),
               "offset": popdist.getReplicaIndexOffset()}
    (out / f"popdist_{rank}.json").write_text(json.dumps(answers))
    os.environ["POPDIST_NUM_LOCAL_REPLICAS"] = "2"  # 2 replicas per process: TP pairs within a process
    np.savez(out / f"tp_{rank}.npz", **tp_program())


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
