"""Phased execution with replicated tensor sharding (RTS): an MLP whose weights and Adam
state do not fit one simulated IPU trains on two replicas.

The same model is built two ways, with the same maths:

* **plain**: every weight and its Adam state are on-chip variables; gradients are
  averaged over the replicas with an all-reduce. On ``"ipu_model"`` it does not fit:
  ``Session`` raises ``OutOfMemoryError``: 6 layers of 4096 x 4096 weights with Adam's
  two moments need ~1.3 GiB, a Mk2 has ~897 MiB (``--ipu-memory-mib`` shrinks the
  simulated IPU to show the same with a small model).
* **phased**: each layer's weights and Adam state live in Streaming Memory (remote
  buffers, one entry per layer), sharded over the replicas. Each layer is a phase:
  load its shards, all-gather the weights, run it; the backward phases load weights and
  state again, reduce-scatter the gradients (each replica keeps the mean of its shard),
  update the shards with Adam and store them. Only one layer's weights are on-chip at a
  time, so the on-chip peak (``session.report()``) is that of the largest phase.

Both train on the same random data on ``"cpu"`` and end with the same weights.

    python examples/phased_mlp.py                       # 6 x 4096^2 against a Mk2 (minutes on CPU)
    python examples/phased_mlp.py --hidden 256 --layers 4 --ipu-memory-mib 2
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from functools import partial

import numpy as np

import ipuxl as popxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.addons_compat.rts import all_gather_replica_sharded_graph, reduce_replica_sharded_graph
from ipuxl.addons_compat.rts import replica_sharded_spec
from ipuxl.device.resources import get_spec, use_spec
from ipuxl.errors import OutOfMemoryError

PARAMS = ("bias", "weight")  # sorted: the order of load/store graph outputs


class Layer(addons.Module):
    """``gelu(x @ weight + bias)``; each ``init`` draws the next layer's weights."""

    def __init__(self, weights: list[np.ndarray]):
        super().__init__()
        self.weights = iter(weights)

    def build(self, x: popxl.Tensor) -> popxl.Tensor:
        w = self.add_variable_input("weight", self.weights, popxl.float32)
        b = self.add_variable_input("bias", partial(np.zeros, w.shape[-1], np.float32), popxl.float32)
        return ops.gelu(x @ w + b)


class Adam(addons.Module):
    """Adam with bias correction for one (possibly replica-sharded) tensor; the step
    counter is an on-chip tensor passed by reference (incremented by the updater)."""

    @popxl.in_sequence()
    def build(self, var: popxl.TensorByRef, grad: popxl.Tensor, step: popxl.TensorByRef, *, lr: float,
              beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-5) -> None:
        shape = var.meta_shape or var.shape
        if var.meta_shape:  # a shard: the moments are sharded alike
            over = int(np.prod(var.meta_shape)) // int(np.prod(var.shape))
            first = self.add_replica_sharded_variable_input("first_order", partial(np.zeros, shape), popxl.float32,
                                                            by_ref=True, shard_over=over)
            second = self.add_replica_sharded_variable_input("second_order", partial(np.zeros, shape),
                                                             popxl.float32, by_ref=True, shard_over=over)
        else:
            first = self.add_variable_input("first_order", partial(np.zeros, shape), popxl.float32, by_ref=True)
            second = self.add_variable_input("second_order", partial(np.zeros, shape), popxl.float32, by_ref=True)
        ops.var_updates.accumulate_moving_average_(first, grad, f=beta1)
        ops.var_updates.accumulate_moving_average_square_(second, grad, f=beta2)
        updater = ops.var_updates.adam_updater(first, second, time_step=step, beta1=beta1, beta2=beta2, epsilon=eps)
        ops.scaled_add_(var, updater, b=-lr)


@dataclass
class Config:
    hidden: int = 4096
    layers: int = 6
    micro_batch: int = 8
    replicas: int = 2
    steps: int = 2
    lr: float = 1e-3
    seed: int = 0


def _init_weights(cfg: Config) -> list[np.ndarray]:
    rng = np.random.default_rng(cfg.seed)
    return [rng.normal(0, cfg.hidden ** -0.5, (cfg.hidden, cfg.hidden)).astype(np.float32)
            for _ in range(cfg.layers)]


def _data(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(cfg.seed + 1)
    x = rng.normal(size=(cfg.steps, cfg.replicas, cfg.micro_batch, cfg.hidden)).astype(np.float32)
    labels = rng.integers(0, cfg.hidden, (cfg.steps, cfg.replicas, cfg.micro_batch)).astype(np.int32)
    return x, labels


def _streams(cfg: Config) -> tuple[popxl.HostToDeviceStream, popxl.HostToDeviceStream]:
    return (popxl.h2d_stream((cfg.micro_batch, cfg.hidden), popxl.float32, "x"),
            popxl.h2d_stream((cfg.micro_batch,), popxl.int32, "labels"))


def _grad_args(grad: addons.GraphWithNamedArgs, layer: addons.GraphWithNamedArgs, info: ops.CallSiteInfo,
               params: NamedTensors) -> dict:
    """The gradient graph's activation inputs from forward call ``info``, except the
    layer's parameters, which come from ``params`` (loaded again for the backward phase,
    so the forward phase's copies need not stay on-chip)."""
    args = grad.grad_graph_info.inputs_dict(info)
    by_fwd_input = {layer.args.to_dict()[name]: params.to_dict()[name] for name in PARAMS}
    for index, connection in enumerate(grad.grad_graph_info.expected_inputs):
        if connection.fwd_tensor in by_fwd_input:
            args[grad.graph.inputs[index]] = by_fwd_input[connection.fwd_tensor]
    return args


def build_plain(cfg: Config) -> tuple[popxl.Ir, dict, dict]:
    """All weights and Adam state on-chip; gradients all-reduced (mean) over the replicas."""
    ir = popxl.Ir(replication=cfg.replicas)
    with ir.main_graph, popxl.in_sequence(True):
        x_stream, label_stream = _streams(cfg)
        facts, layer = Layer(_init_weights(cfg)).create_graph(x_stream.spec)
        grad = addons.autodiff(layer)
        variables = [facts.init(f"layer{i}") for i in range(cfg.layers)]
        optimisers, states, steps = {}, [], []
        for name in PARAMS:
            optimisers[name] = Adam().create_graph(layer.args.to_dict()[name], layer.args.to_dict()[name],
                                                   popxl.TensorSpec((), popxl.float32), lr=cfg.lr)
        for i in range(cfg.layers):
            states.append({n: optimisers[n][0].init(f"layer{i}.{n}") for n in PARAMS})
            steps.append({n: popxl.variable(0.0, popxl.float32, f"layer{i}.{n}.step") for n in PARAMS})
        x, labels = ops.host_load(x_stream, "x"), ops.host_load(label_stream, "labels")
        infos = []
        for i in range(cfg.layers):
            infos.append(layer.bind(variables[i]).call_with_info(x))
            x = infos[-1].outputs[0]
        _, dx = addons.ops.cross_entropy_with_grad(x, labels)
        for i in reversed(range(cfg.layers)):
            grad_info = grad.call_with_info(dx, args=_grad_args(grad, layer, infos[i], variables[i]))
            grads = grad.grad_graph_info.fwd_graph_ins_to_grad_parent_outs(grad_info)
            dx = grads[layer.graph.inputs[0]]
            for name in PARAMS:
                g = ops.collectives.replicated_all_reduce(grads[layer.args.to_dict()[name]], "mean")
                var = variables[i].to_dict()[name]
                optimisers[name][1].bind(states[i][name]).call(var, g, steps[i][name])
    weights = {f"layer{i}.{n}": variables[i].to_dict()[n] for i in range(cfg.layers) for n in PARAMS}
    return ir, {"x": x_stream, "labels": label_stream}, weights


def build_phased(cfg: Config) -> tuple[popxl.Ir, dict, dict]:
    """Weights and Adam state in Streaming Memory, sharded over the replicas; one phase per
    layer forward, then one per layer backward + optimiser (module docstring)."""
    ir = popxl.Ir(replication=cfg.replicas)
    with ir.main_graph, popxl.in_sequence(True):
        x_stream, label_stream = _streams(cfg)
        facts, layer = Layer(_init_weights(cfg)).create_graph(x_stream.spec)
        grad = addons.autodiff(layer)
        shard_group = ir.replica_grouping()
        # Streaming Memory: one entry per layer, weights sharded over all replicas
        buffers = addons.named_variable_buffers(facts, entries=cfg.layers, shard_over_dict=True)
        variables = [facts.init_remote(buffers, i, f"layer{i}") for i in range(cfg.layers)]
        optimisers, opt_buffers = {}, {}
        for name in PARAMS:
            spec = replica_sharded_spec(layer.args.to_dict()[name], shard_over=shard_group)
            optimisers[name] = Adam().create_graph(spec, spec, popxl.TensorSpec((), popxl.float32), lr=cfg.lr)
            opt_buffers[name] = addons.named_variable_buffers(optimisers[name][0], entries=cfg.layers)
        for i in range(cfg.layers):
            for name in PARAMS:
                optimisers[name][0].init_remote(opt_buffers[name], i, f"layer{i}.{name}")
        steps = [{n: popxl.variable(0.0, popxl.float32, f"layer{i}.{n}.step") for n in PARAMS}
                 for i in range(cfg.layers)]
        state_buffers = addons.NamedRemoteBuffers(params=buffers, **{f"{n}_state": opt_buffers[n] for n in PARAMS})
        load_params, param_names = addons.load_remote_graph(buffers, cfg.layers)
        load_all, all_names = addons.load_remote_graph(state_buffers, cfg.layers)
        store_all = addons.store_remote_graph(state_buffers, cfg.layers)
        gather, gather_names = all_gather_replica_sharded_graph(NamedTensors.pack(param_names, load_params.graph.outputs))
        reduce, reduce_names = reduce_replica_sharded_graph(
            NamedTensors.from_dict({n: layer.args.to_dict()[n] for n in PARAMS}), "mean")

        x, labels = ops.host_load(x_stream, "x"), ops.host_load(label_stream, "labels")
        infos = []
        for i in range(cfg.layers):  # forward phases
            shards = NamedTensors.pack(param_names, load_params.call(i))
            whole = NamedTensors.pack(gather_names, gather.bind(shards).call())
            infos.append(layer.bind(whole).call_with_info(x))
            x = infos[-1].outputs[0]
        _, dx = addons.ops.cross_entropy_with_grad(x, labels)
        for i in reversed(range(cfg.layers)):  # backward + optimiser phases
            state = NamedTensors.pack(all_names, load_all.call(i))
            whole = NamedTensors.pack(gather_names, gather.bind(state.params).call())
            grad_info = grad.call_with_info(dx, args=_grad_args(grad, layer, infos[i], whole))
            grads = grad.grad_graph_info.fwd_graph_ins_to_grad_parent_outs(grad_info)
            dx = grads[layer.graph.inputs[0]]
            by_name = NamedTensors.from_dict({n: grads[layer.args.to_dict()[n]] for n in PARAMS})
            shard_grads = NamedTensors.pack(reduce_names, reduce.bind(by_name).call()).to_dict()
            for name in PARAMS:
                optimisers[name][1].bind(state.get(f"{name}_state")).call(
                    state.params.get(name), shard_grads[name], steps[i][name])
            store_all.bind(state).call(i)
    weights = {f"layer{i}.{n}": variables[i].to_dict()[n] for i in range(cfg.layers) for n in PARAMS}
    return ir, {"x": x_stream, "labels": label_stream}, weights


def train(ir: popxl.Ir, streams: dict, weights: dict, cfg: Config, device: str = "cpu") -> dict[str, np.ndarray]:
    """Run the program for ``cfg.steps`` steps; the final weights by name."""
    x, labels = _data(cfg)
    session = popxl.Session(ir, device)
    with session:
        for step in range(cfg.steps):
            session.run({streams["x"]: x[step], streams["labels"]: labels[step]})
    data = session.get_tensors_data(list(weights.values()))
    return {name: data[t] for name, t in weights.items()}


def fits(ir: popxl.Ir) -> bool:
    """Whether ``Session(ir, "ipu_model")`` accepts the program (the resource check)."""
    try:
        popxl.Session(ir, "ipu_model")
    except OutOfMemoryError:
        return False
    return True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=Config.hidden)
    parser.add_argument("--layers", type=int, default=Config.layers)
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--ipu-memory-mib", type=float, default=None,
                        help="on-chip memory of the simulated IPU (default: a Mk2's ~897 MiB)")
    args = parser.parse_args(argv)
    cfg = Config(hidden=args.hidden, layers=args.layers, steps=args.steps)
    spec = get_spec()
    if args.ipu_memory_mib is not None:
        spec = dataclasses.replace(spec, memory_bytes_override=int(args.ipu_memory_mib * 2 ** 20))
    with use_spec(spec):
        plain = build_plain(cfg)
        phased = build_phased(cfg)
        plain_fits, phased_fits = fits(plain[0]), fits(phased[0])
        print(f"plain program fits one IPU: {plain_fits}; phased program fits: {phased_fits}")
        report = popxl.Session(phased[0], "cpu").report()
        print(report)
    plain_weights = train(*plain, cfg)
    phased_weights = train(*phased, cfg)
    worst = max(float(np.abs(plain_weights[k] - phased_weights[k]).max()) for k in plain_weights)
    print(f"largest weight difference, phased vs plain: {worst:.3g}")
    return {"plain_fits": plain_fits, "phased_fits": phased_fits, "report": report, "plain": plain_weights,
            "phased": phased_weights, "spec": spec}


if __name__ == "__main__":
    main()
