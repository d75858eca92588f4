"""popxl.addons' float8 scale helpers and ``LinearFP8``, against numpy/torch oracles written
from upstream's definitions: ``fp8_amax_scale`` (floor(log2(max / amax)) in the source
dtype), ``fp8_mse_scale`` (the device's histogram search, float32, bin by bin),
``host_fp8_mse_scale`` (PopXL's host search, float64) and the float8 linear layer."""
from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.compat as compat
from ipuxl.addons_compat.layers.linear_fp8 import LinearFP8
from ipuxl.addons_compat.ops import fp8_utils
from ipuxl.addons_compat.ops.fp8_amax_scale import fp8_amax_scale
from ipuxl.addons_compat.ops.fp8_mse_scale import fp8_mse_scale
from ipuxl.addons_compat.testing_utils import TensorInput, run_module
from ipuxl.fp8_utils import host_fp8_mse_scale

FORMATS = [ipuxl.float8_143, ipuxl.float8_152]
TORCH_FP8 = {ipuxl.float8_143: torch.float8_e4m3fnuz, ipuxl.float8_152: torch.float8_e5m2fnuz}
MANTISSA = {ipuxl.float8_143: 3, ipuxl.float8_152: 2}


# -- oracles ----------------------------------------------------------------------------------------------
def _exponents(fmt) -> tuple[int, int]:
    """The float8 format's smallest (subnormal) and largest binade exponents, from torch."""
    info = torch.finfo(TORCH_FP8[fmt])
    smallest = int(math.log2(info.smallest_normal)) - MANTISSA[fmt]
    return smallest, math.frexp(info.max)[1] - 1


def host_oracle(x: np.ndarray, fmt) -> tuple[float, int]:
    """PopXL's host search, element by element in float64: 63 biases b in [-31, 31]."""
    limits = [math.ldexp(1.0, e) for e in range(-126, 127)]  # 2**-126 .. 2**126
    hist = [0.0] * 254
    for value in x.reshape(-1).tolist():
        a = abs(value)
        if a < limits[0]:
            hist[0] += 1
        elif a > limits[-1]:
            hist[-1] += 1
        else:
            hist[math.frexp(a)[1] + 126] += 1
    hist = [h / x.size for h in hist]
    low, high = _exponents(fmt)
    span = high - low + 1
    q = 2 ** (-2.0 * ((23 if x.dtype == np.float32 else 10) - MANTISSA[fmt]))
    costs = {}
    for index in range(63):
        start = low - 31 + 126 + index
        cost = 0.0
        for i in range(len(limits)):
            if i < start:
                if i == 0:
                    cost += (limits[0] / 2) ** 2
                cost += limits[i] ** 2 * hist[i + 1]
            elif i < start + span:
                cost += limits[i] ** 2 * hist[i + 1] * q
            else:
                cost += (limits[index + span - 1] - limits[i]) ** 2 * hist[i + 1]
        costs.setdefault(cost, []).append(index - 31)
    best = min(costs)
    return best, -sorted(costs[best])[len(costs[best]) // 2]


def device_oracle(x: np.ndarray, fmt) -> int:
    """The device op's search: float32, bins 1..253 added one by one, 62 candidates; the levels
    2**-126 .. 2**127 in the source dtype; the quantisation error of float16 data."""
    f32 = np.float32
    low, high = _exponents(fmt)
    span = high - low + 1
    q = f32(2.0 ** (-2 * (10 - MANTISSA[fmt])))
    bins = np.ldexp(np.float32(1), np.arange(-126, 128)).astype(np.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        levels = bins.astype(x.dtype)
        placed = np.searchsorted(levels, np.abs(x.reshape(-1)), side="right")
        h = (np.bincount(placed, minlength=255).astype(np.float32) / f32(x.size))[1:]
        costs = []
        for k in range(62):
            first = low - 31 + 126 + k
            cost = f32(0)
            for c in range(1, 254):
                if c < first:
                    term = f32(f32(h[c] * bins[c]) * bins[c])
                elif c < first + span:
                    term = f32(f32(f32(h[c] * bins[c]) * bins[c]) * q)
                else:
                    d = f32(bins[first + span - 1] - bins[c])
                    term = f32(f32(h[c] * d) * d)
                cost = f32(cost + term)
            costs.append(cost)
    costs = np.array(costs)
    return 31 - (int(np.argmin(costs)) + int(np.sum(costs == costs.min())) // 2)


def amax_oracle(x: np.ndarray, fmt) -> int:
    info = torch.finfo(TORCH_FP8[fmt])
    with np.errstate(divide="ignore", over="ignore"):
        ratio = x.dtype.type(info.max) / np.abs(x).max()
        return int(np.clip(np.floor(np.log2(ratio)), -31, 31))


def _datasets() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    np.random.seed(0)
    out = [np.random.uniform(-(2**5), -(2**6), 10)]  # upstream's test data
    for _ in range(5):
        lo = rng.uniform(-20, 5)
        out.append(np.sign(rng.standard_normal(40)) * 2.0 ** rng.uniform(lo, lo + rng.uniform(0, 20), 40))
    out.append(rng.standard_normal((4, 8)) * 1e-3)
    out.append(rng.standard_normal(50) * 300)  # beyond float8_143's range
    return out


def _run_scales(op, arrays: list[np.ndarray], fmt) -> list[int]:
    ir = ipuxl.Ir()
    with ir.main_graph:
        streams = [addons.host_store(op(ipuxl.variable(a), fmt)) for a in arrays]
    with ipuxl.Session(ir, "ipu_model") as session:
        out = session.run()
    for s in streams:
        assert out[s].shape == () and out[s].dtype == np.int32
    return [int(out[s]) for s in streams]


# -- formats ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fdef, fmt", [(fp8_utils.float8_143_def, ipuxl.float8_143),
                                       (fp8_utils.float8_152_def, ipuxl.float8_152)])
def test_float8_definitions_are_torchs_formats(fdef, fmt):
    info = torch.finfo(TORCH_FP8[fmt])
    assert fdef.max_value == info.max
    assert (fdef.min_exp, fdef.max_exp) == _exponents(fmt)
    assert fdef.num_mantissa_bits == MANTISSA[fmt] and fdef.num_exp_bits == 7 - MANTISSA[fmt]


def test_ieee_definitions():
    assert fp8_utils.ieee_fp16_denorms.max_value == torch.finfo(torch.float16).max
    assert fp8_utils.ieee_fp32_no_denorms.max_value == pytest.approx(torch.finfo(torch.float32).max, rel=1e-7)
    assert (fp8_utils.ieee_fp32_no_denorms.min_exp, fp8_utils.ieee_fp32_no_denorms.max_exp) == (-126, 127)
    assert fp8_utils.ieee_fp16_denorms._fields == fp8_utils.FpDef._fields


# -- host_fp8_mse_scale ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("np_dtype", [np.float16, np.float32])
def test_host_mse_scale_is_popxls_definition(fmt, np_dtype):
    for data in _datasets() + [np.array([0.0, 0.0, 1.0]), np.array([1e-30, 5.0])]:
        x = data.astype(np_dtype)
        assert host_fp8_mse_scale(x, fmt) == host_oracle(x, fmt)


def test_host_mse_scale_of_upstreams_test_data():
    np.random.seed(0)
    x = np.random.uniform(-(2**5), -(2**6), 10).astype(np.float32)
    assert host_fp8_mse_scale(x, ipuxl.float8_143)[1] == -7  # [32, 64) centred in the 18 binades
    assert host_fp8_mse_scale(x, ipuxl.float8_152)[1] == -6
    assert host_fp8_mse_scale(torch.from_numpy(x))[1] == -7  # torch data; dtype None: float8_143


@pytest.mark.parametrize("src, dtype, error, fragment", [
    (np.arange(4, dtype=np.int32), ipuxl.float8_143, RuntimeError, "dtype int32 not currently supported"),
    (np.ones(4, np.float64), ipuxl.float8_143, RuntimeError, "dtype float64 not currently supported"),
    (np.ones(4, np.float32), ipuxl.float16, RuntimeError, "not currently supported"),
    (np.ones(0, np.float32), ipuxl.float8_143, ValueError, "src has no elements"),
])
def test_host_mse_scale_errors(src, dtype, error, fragment):
    with pytest.raises(error, match=fragment):
        host_fp8_mse_scale(src, dtype)


# -- fp8_mse_scale (device) --------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("np_dtype", [np.float16, np.float32])
def test_device_mse_scale_is_the_device_definition(fmt, np_dtype):
    arrays = [d.astype(np_dtype) for d in _datasets()]
    assert _run_scales(fp8_mse_scale, arrays, fmt) == [device_oracle(a, fmt) for a in arrays]


@pytest.mark.parametrize("fmt", FORMATS)
def test_device_and_host_agree_on_ordinary_data(fmt):
    arrays = [d.astype(t) for d in _datasets()[:6] for t in (np.float16, np.float32)]
    assert _run_scales(fp8_mse_scale, arrays, fmt) == [host_fp8_mse_scale(a, fmt)[1] for a in arrays]


def test_float16_zeros_count_just_below_float16s_smallest_subnormal():
    # on the device the levels are float16: 2**-126 .. 2**-25 are 0, so a float16 zero falls in
    # the [2**-25, 2**-24) bin, an underflow for the candidates above 16: of the 18 that hold
    # 2**-12 (12..29), the five below win, whose scales are higher; float32 zeros cost nothing
    x = np.concatenate([np.zeros(60), np.full(4, 2.0**-12)]).astype(np.float16)
    got = _run_scales(fp8_mse_scale, [x, x.astype(np.float32)], ipuxl.float8_143)
    assert got == [31 - 14, 31 - 21] == [device_oracle(x, ipuxl.float8_143),
                                         device_oracle(x.astype(np.float32), ipuxl.float8_143)]
    assert host_fp8_mse_scale(x, ipuxl.float8_143)[1] == 31 - 21  # the host bins by float32 binade


def test_device_mse_scale_in_a_subgraph():
    x_np = np.linspace(-3, 3, 24, dtype=np.float32).reshape(4, 6)
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(x_np)
        graph = ir.create_graph(lambda t: fp8_mse_scale(t, ipuxl.float8_152), x)
        (scale,) = ipuxl.ops.call(graph, x)
        stream = addons.host_store(scale)
    with ipuxl.Session(ir, "ipu_model") as session:
        assert int(session.run()[stream]) == device_oracle(x_np, ipuxl.float8_152)


# -- fp8_amax_scale -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("np_dtype", [np.float16, np.float32])
def test_amax_scale(fmt, np_dtype):
    arrays = [d.astype(np_dtype) for d in _datasets()]
    arrays.append(np.array([3e4, -1.0], np_dtype))  # a negative scale
    got = _run_scales(fp8_amax_scale, arrays, fmt)
    assert got == [amax_oracle(a, fmt) for a in arrays]


def test_amax_scale_is_clipped_to_31():
    arrays = [np.zeros(3, np.float32), np.array([1e-30], np.float32), np.array([3e38], np.float32)]
    assert _run_scales(fp8_amax_scale, arrays, ipuxl.float8_143) == [31, 31, -31]


@pytest.mark.parametrize("op", [fp8_amax_scale, fp8_mse_scale])
def test_scale_op_errors(op):
    ir = ipuxl.Ir()
    with ir.main_graph:
        ints = ipuxl.variable(np.arange(3, dtype=np.int32))
        floats = ipuxl.variable(np.ones(3, np.float32))
        with pytest.raises(RuntimeError, match="dtype int32 not currently supported"):
            op(ints, ipuxl.float8_143)
        with pytest.raises(RuntimeError, match="must be float8_143 or float8_152"):
            op(floats, ipuxl.float16)


# -- LinearFP8 ----------------------------------------------------------------------------------------------
def _cast8(t: torch.Tensor, scale: int, fmt) -> torch.Tensor:
    """cast(t * 2**scale) to float8 and back to float32: torch's fnuz types (NaN beyond the range)."""
    return (t.float() * 2.0**scale).to(TORCH_FP8[fmt]).float()


@pytest.mark.parametrize("metric", ["amax", "mse", "manual_scale"])
def test_linear_fp8_forward(metric):
    torch.manual_seed(0)
    layer = torch.nn.Linear(12, 6)
    x = np.random.default_rng(1).random((3, 12)).astype(np.float16)
    fp8 = LinearFP8(6, scale_metric=metric, scale=2)
    (got,) = run_module(fp8, TensorInput(x), weights=lambda v: LinearFP8.torch_mapping(v, layer, ipuxl.float16))
    w = layer.weight.detach().T.half()
    scale = {"amax": amax_oracle, "mse": device_oracle, "manual_scale": lambda a, f: 2}[metric]
    sw, sx = scale(w.numpy(), ipuxl.float8_143), scale(x, ipuxl.float8_143)
    mm = _cast8(torch.from_numpy(x), sx, ipuxl.float8_143) @ _cast8(w, sw, ipuxl.float8_143)
    expected = (mm * 2.0 ** (-sw - sx)).half() + layer.bias.detach().half()
    assert got.dtype == np.float16
    assert_close(torch.from_numpy(got), expected, rtol=1e-3, atol=1e-3)
    assert_close(torch.from_numpy(got).float(), layer(torch.from_numpy(x).float()).detach(), rtol=0, atol=0.1)


def test_linear_fp8_gradients_are_build_grads_float8_gradients():
    rng = np.random.default_rng(3)
    x_np = rng.standard_normal((4, 8)).astype(np.float32)
    dy_np = rng.standard_normal((4, 5)).astype(np.float32)
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(x_np, name="x")
        facts, graph = LinearFP8(5).create_graph(x)
        bwd = graph.autodiff()
        variables = facts.init()
        info = graph.bind(variables).call_with_info(x)
        dy = ipuxl.constant(dy_np)
        grads_info = bwd.call_with_info(dy, args=bwd.grad_graph_info.inputs_dict(info))
        grads = bwd.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(info, grads_info)
        streams = {k: addons.host_store(grads[t]) for k, t in variables.named_tensors.items()}
        streams["x"] = addons.host_store(grads_info.outputs[0])
    session = ipuxl.Session(ir, "ipu_model")
    w = torch.from_numpy(session.get_tensor_data(variables.weight).copy())
    with session:
        out = {k: torch.from_numpy(v) for k, v in session.run().items()}
    got = {k: out[s] for k, s in streams.items()}
    f143, f152 = ipuxl.float8_143, ipuxl.float8_152
    sw, sx = amax_oracle(w.numpy(), f143), amax_oracle(x_np, f143)
    sd = max(amax_oracle(dy_np, f152) - 3, -31)
    dy8 = _cast8(torch.from_numpy(dy_np), sd, f152)
    dx = ((dy8 @ _cast8(w, sw, f143).T) * 2.0 ** (-sw - sd)).half().float()
    dw = ((dy8.T @ _cast8(torch.from_numpy(x_np), sx, f143)) * 2.0 ** (-sx - sd)).half().float().T
    assert_close(got["x"].float(), dx, rtol=1e-3, atol=1e-3)
    assert_close(got["weight"].float(), dw, rtol=1e-3, atol=1e-3)
    assert_close(got["bias"], torch.from_numpy(dy_np).sum(0))
    # and close to the float gradients
    assert_close(got["weight"].float(), torch.from_numpy(x_np).T @ torch.from_numpy(dy_np), rtol=0.15, atol=0.15)


def test_linear_fp8_rejects_an_unknown_metric():
    with pytest.raises(ValueError, match="The scale_metric option no_scale is not available"):
        LinearFP8(4, scale_metric="no_scale")


def test_linear_fp8_torch_mapping_without_bias():
    layer = torch.nn.Linear(3, 2, bias=False)
    x = np.ones((1, 3), np.float32)
    (got,) = run_module(LinearFP8(2, bias=False, scale_metric="manual_scale"), TensorInput(x),
                        weights=lambda v: LinearFP8.torch_mapping(v, layer))
    assert got.dtype == np.float32
    expected = (_cast8(torch.ones(1, 3), 0, ipuxl.float8_143) @ _cast8(layer.weight.detach().T, 0, ipuxl.float8_143))
    assert_close(torch.from_numpy(got), expected.half().float())


# -- the upstream module paths -----------------------------------------------------------------------------------
def test_upstream_paths_resolve():
    compat.install()
    try:
        from popxl.fp8_utils import host_fp8_mse_scale as host
        from popxl_addons.layers.linear_fp8 import LinearFP8 as layer
        from popxl_addons.ops.fp8_amax_scale import fp8_amax_scale as amax
        from popxl_addons.ops.fp8_mse_scale import fp8_mse_scale as mse
        from popxl_addons.ops.fp8_utils import float8_143_def

        inner = importlib.import_module("popxl_addons.ops.fp8_mse_scale.fp8_mse_scale")
        assert (host, layer, amax, mse, inner.fp8_mse_scale) == (host_fp8_mse_scale, LinearFP8, fp8_amax_scale,
                                                                 fp8_mse_scale, fp8_mse_scale)
        assert float8_143_def is fp8_utils.float8_143_def
    finally:
        compat.uninstall()
