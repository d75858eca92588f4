"""PopXL's float8 types (float8_143 / float8_152 = torch's float8_e4m3fnuz / float8_e5m2fnuz),
its host float8 casts (popxl.fp8_utils, popxl.utils) and its float8 ops, against torch."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ipuxl
import ipuxl.ops as ops
from ipuxl import dtypes, errors, fp8_utils, utils
from ipuxl.dtypes import float8_143, float8_152, np_dtype_float8_143, np_dtype_float8_152

FORMATS = [(float8_143, torch.float8_e4m3fnuz, np_dtype_float8_143, 240.0),
           (float8_152, torch.float8_e5m2fnuz, np_dtype_float8_152, 57344.0)]
ALL_FLOAT16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)


def _bits(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint8)


def _reference_value(code: int, exponent_bits: int, bias: int) -> float:
    """The value of a float8 code in Graphcore's formats, from their definition (NaN: 0x80 only)."""
    if code == 0x80:
        return float("nan")
    mantissa_bits = 7 - exponent_bits
    sign = -1.0 if code & 0x80 else 1.0
    exponent = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = code & ((1 << mantissa_bits) - 1)
    if exponent == 0:
        return sign * mantissa * 2.0 ** (1 - bias - mantissa_bits)
    return sign * (1 + mantissa / 2 ** mantissa_bits) * 2.0 ** (exponent - bias)


# -- dtypes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, torch_dtype, np_dtype, _max", FORMATS)
def test_float8_dtypes_are_popxls_and_torchs_fnuz_types(dtype, torch_dtype, np_dtype, _max):
    assert getattr(ipuxl, dtype.name) is dtype and dtype == torch_dtype
    assert (dtype.itemsize, dtype.is_floating_point, dtype.is_int, dtype.is_signed) == (1, True, False, True)
    assert dtype.as_numpy() == np_dtype and np_dtype == np.dtype([(dtype.name, "u1")])
    assert ipuxl.dtype.as_dtype(np.zeros(3, np_dtype)) is dtype and ipuxl.dtype.from_name(dtype.name) is dtype
    assert dtypes.to_numpy_dtype(torch_dtype) == np_dtype


@pytest.mark.parametrize("dtype, torch_dtype, exponent_bits, bias", [
    (float8_143, torch.float8_e4m3fnuz, 4, 8), (float8_152, torch.float8_e5m2fnuz, 5, 16)])
def test_every_float8_code_decodes_as_graphcores_format(dtype, torch_dtype, exponent_bits, bias):
    codes = np.arange(256, dtype=np.uint8).view(dtype.as_numpy())
    got = fp8_utils.host_pow2scale_cast_from_fp8(codes, ipuxl.float64, 0)
    expected = np.array([_reference_value(c, exponent_bits, bias) for c in range(256)])
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got, torch.arange(256, dtype=torch.uint8).view(torch_dtype).double().numpy())


# -- host casts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("log2_scale", [-4, 0, 3])
@pytest.mark.parametrize("dtype, torch_dtype, _np, _max", FORMATS)
def test_host_cast_of_every_float16_is_torchs_fnuz_cast(dtype, torch_dtype, _np, _max, log2_scale):
    got = fp8_utils.host_pow2scale_cast_to_fp8(ALL_FLOAT16.numpy(), dtype, log2_scale, True)
    assert got.dtype == dtype.as_numpy() and got.shape == (65536,)
    expected = (ALL_FLOAT16.float() * 2.0 ** log2_scale).to(torch_dtype).view(torch.uint8).numpy()
    np.testing.assert_array_equal(_bits(got), expected)


@pytest.mark.parametrize("dtype, _t, _np, largest", FORMATS)
def test_overflow_gives_nan_or_saturates(dtype, _t, _np, largest):
    data = np.array([largest * 4, -largest * 4, np.inf, -np.inf, np.nan, -0.0, largest], np.float32)
    with_nan = _bits(fp8_utils.host_pow2scale_cast_to_fp8(data, dtype, 0, True))
    saturated = fp8_utils.host_pow2scale_cast_to_fp8(data, dtype, 0, False)
    top = _bits(fp8_utils.host_pow2scale_cast_to_fp8(np.float32(largest), dtype))
    np.testing.assert_array_equal(with_nan, [0x80, 0x80, 0x80, 0x80, 0x80, 0x00, int(top)])
    back = fp8_utils.host_pow2scale_cast_from_fp8(saturated, ipuxl.float32)
    np.testing.assert_array_equal(back, [largest, -largest, largest, -largest, np.nan, 0.0, largest])


def test_float64_data_are_rounded_once():
    # just above / below the ties between float8_143 neighbours: float64 -> float32 -> float8 would round to even
    data = np.array([1 + 1 / 16 + 2.0 ** -40, -(1 + 3 / 16 - 2.0 ** -40), 1 + 1 / 16])
    got = fp8_utils.host_pow2scale_cast_to_fp8(data, float8_143)
    np.testing.assert_array_equal(fp8_utils.host_pow2scale_cast_from_fp8(got, ipuxl.float64), [1.125, -1.125, 1.0])


def test_host_casts_refuse_what_popxl_refuses():
    with pytest.raises(RuntimeError, match="not currently supported"):
        fp8_utils.host_pow2scale_cast_to_fp8(np.ones(2, np.float32), ipuxl.float16)
    with pytest.raises(RuntimeError, match="not currently supported"):
        utils.host_pow2scale_then_cast(np.ones(2, np.float16), float8_143)  # PopXL's takes float32/64 only
    with pytest.raises(RuntimeError, match="not currently supported"):
        fp8_utils.host_pow2scale_cast_from_fp8(np.ones(2, np.uint8), ipuxl.float32)
    with pytest.raises(RuntimeError, match="not currently supported"):
        utils.host_cast_then_pow2scale(utils.host_pow2scale_then_cast(np.ones(2), float8_143), ipuxl.float16)


def test_to_numpy_casts_float_data_to_float8_and_keeps_float8_data():
    got = utils.to_numpy([1.0, 3.0, 1000.0], float8_152, log2_scale=2, nan_on_overflow=False)
    expected = (torch.tensor([4.0, 12.0, 4000.0])).to(torch.float8_e5m2fnuz).view(torch.uint8).numpy()
    np.testing.assert_array_equal(_bits(got), expected)
    assert utils.to_numpy(got, float8_152, copy=False) is got
    with pytest.raises(errors.UnsupportedError, match="log2_scale"):
        utils.to_numpy([1.0], ipuxl.float32, log2_scale=1)


# -- variables and constants -------------------------------------------------------------------
@pytest.mark.parametrize("dtype, torch_dtype, np_dtype, largest", FORMATS)
def test_float8_variables_take_float_data_with_popxls_options(dtype, torch_dtype, np_dtype, largest):
    ir = ipuxl.Ir()
    with ir.main_graph:
        scaled = ipuxl.variable([1.0, -2.5, 1e6], dtype, log2_scale=-1, nan_on_overflow=False, name="w")
        given = ipuxl.variable(np.array([1, 2], np.uint8).view(np_dtype), name="bits")
        from_torch = ipuxl.variable(torch.tensor([0.5, 3.0]).to(torch_dtype), name="t")
    assert (scaled.dtype, given.dtype, from_torch.dtype) == (dtype, dtype, dtype)
    data = {r.tensor.name: r.data for r in ir.variable_records.values()}
    expected = torch.tensor([0.5, -1.25, 1e6]).clamp(-largest, largest).to(torch_dtype)
    np.testing.assert_array_equal(data["w"], fp8_utils.to_host(expected))
    np.testing.assert_array_equal(_bits(data["bits"]), [1, 2])
    np.testing.assert_array_equal(_bits(data["t"]), torch.tensor([0.5, 3.0]).to(torch_dtype).view(torch.uint8))
    with ir.main_graph, pytest.raises(errors.UnsupportedError, match="log2_scale"):
        ipuxl.variable([1.0], ipuxl.float16, log2_scale=1)


# -- ops ------------------------------------------------------------------------------------------
def _run(ir, feeds, outputs):
    streams = {}
    with ir.main_graph:
        for name, t in outputs.items():
            streams[name] = ipuxl.d2h_stream(t.shape, t.dtype, name)
            ops.host_store(streams[name], t)
    with ipuxl.Session(ir, "ipu_model") as session:
        out = session.run(feeds)
    return {name: out[s] for name, s in streams.items()}


@pytest.mark.parametrize("log2_scale", [-3, 0, 2])
@pytest.mark.parametrize("dtype, torch_dtype, _np, _max", FORMATS)
def test_device_casts_match_torch_and_the_host_casts(dtype, torch_dtype, _np, _max, log2_scale):
    data = torch.randn(6, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float32).half() * 50
    ir = ipuxl.Ir()
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream(data.shape, ipuxl.float16, "x")
        x = ops.host_load(x_stream)
        scale = ipuxl.constant(log2_scale, ipuxl.int32)
        x8 = ops.pow2scale_cast_to_fp8(x, scale, dtype)
        assert x8.dtype == dtype and x8.shape == (6, 7)
        back = ops.pow2scale_cast_from_fp8(x8, ipuxl.constant(-log2_scale, ipuxl.int32), ipuxl.float32)
        assert back.dtype == ipuxl.float32
    got = _run(ir, {x_stream: data.numpy()}, {"back": back})["back"]
    expected = (data.float() * 2.0 ** log2_scale).to(torch_dtype).float() * 2.0 ** -log2_scale
    torch.testing.assert_close(torch.from_numpy(got), expected, rtol=0, atol=0, equal_nan=True)
    host = fp8_utils.host_pow2scale_cast_from_fp8(
        fp8_utils.host_pow2scale_cast_to_fp8(data.numpy(), dtype, log2_scale), ipuxl.float32, -log2_scale)
    np.testing.assert_array_equal(got, host)


@pytest.mark.parametrize("log2_scale", [-1, 2])
@pytest.mark.parametrize("dtype, torch_dtype, _np, _max", FORMATS)
def test_matmul_and_conv_pow2scaled_are_float32_results_scaled_to_float16(dtype, torch_dtype, _np, _max,
                                                                         log2_scale):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.rand(3, 5, generator=gen), torch.rand(5, 4, generator=gen)
    img, kernel = torch.rand(2, 3, 9, 9, generator=gen), torch.rand(4, 3, 3, 3, generator=gen)
    ir = ipuxl.Ir()
    with ir.main_graph:
        scale = ipuxl.constant(log2_scale, ipuxl.int32)
        zero = ipuxl.constant(0, ipuxl.int32)
        to8 = [ops.pow2scale_cast_to_fp8(ipuxl.constant(v.numpy()), zero, dtype) for v in (a, b, img, kernel)]
        mm = ops.matmul_pow2scaled(to8[0], to8[1], scale)
        conv = ops.conv_pow2scaled(to8[2], to8[3], scale, stride=(2, 2), padding=(1, 1, 1, 1))
        convt = ops.conv_transpose_pow2scaled(to8[2], ops.transpose(to8[3], (1, 0, 2, 3)), scale)
        assert (mm.dtype, conv.dtype, convt.dtype) == (ipuxl.float16,) * 3
    got = _run(ir, {}, {"mm": mm, "conv": conv, "convt": convt})
    a8, b8, img8, k8 = (v.to(torch_dtype).float() for v in (a, b, img, kernel))
    factor = 2.0 ** log2_scale
    torch.testing.assert_close(torch.from_numpy(got["mm"]), (a8 @ b8 * factor).half(), rtol=0, atol=0)
    torch.testing.assert_close(torch.from_numpy(got["conv"]),
                               (F.conv2d(img8, k8, stride=2, padding=1) * factor).half(), rtol=0, atol=0)
    torch.testing.assert_close(torch.from_numpy(got["convt"]),
                               (F.conv_transpose2d(img8, k8.transpose(0, 1)) * factor).half(), rtol=0, atol=0)


def test_float8_view_changes_keep_the_bits():
    data = fp8_utils.host_pow2scale_cast_to_fp8(np.random.default_rng(0).random((4, 4, 4)), float8_143)
    ir = ipuxl.Ir()
    with ir.main_graph:
        t = ipuxl.constant(data)
        assert t.dtype == float8_143
        views = {"reshape": ops.reshape(t, (2, 4, 8)), "transpose": ops.transpose(t, (0, 2, 1)),
                 "slice": ops.slice(t, start=1, stop=3, axis=0), "concat": ops.concat([t, t], 1)}
        back = {k: ops.pow2scale_cast_from_fp8(v, ipuxl.constant(0, ipuxl.int32), ipuxl.float32)
                for k, v in views.items()}
    got = _run(ir, {}, back)
    values = torch.from_numpy(data.view(np.uint8)).view(torch.float8_e4m3fnuz).float()
    expected = {"reshape": values.reshape(2, 4, 8), "transpose": values.permute(0, 2, 1),
                "slice": values[1:3], "concat": torch.cat([values, values], 1)}
    for k, v in expected.items():
        torch.testing.assert_close(torch.from_numpy(got[k]), v, rtol=0, atol=0)


def test_float8_ops_refuse_popxls_bad_arguments():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x16 = ipuxl.constant(np.ones((2, 2), np.float16))
        x8 = ops.pow2scale_cast_to_fp8(x16, ipuxl.constant(0, ipuxl.int32), float8_152)
        with pytest.raises(TypeError, match="must be of dtype popxl.float8_143 or popxl.float8_152"):
            ops.matmul_pow2scaled(x16, x16, ipuxl.constant(0, ipuxl.int32))
        with pytest.raises(ValueError, match="must be a scalar tensor"):
            ops.conv_pow2scaled(ops.reshape(x8, (1, 1, 2, 2)), ops.reshape(x8, (1, 1, 2, 2)),
                                ipuxl.constant([1, 2], ipuxl.int32))
        with pytest.raises(TypeError, match="must be of type popxl.int32"):
            ops.matmul_pow2scaled(x8, x8, ipuxl.constant(1, ipuxl.int8))
        with pytest.raises(TypeError, match="float8"):
            ops.pow2scale_cast_to_fp8(x16, ipuxl.constant(0, ipuxl.int32), ipuxl.float16)
        with pytest.raises(TypeError, match="float8"):
            ops.pow2scale_cast_from_fp8(x16, ipuxl.constant(0, ipuxl.int32), ipuxl.float16)


@pytest.mark.parametrize("log2_scale", [-50, 100])
@pytest.mark.parametrize("op", ["to_fp8", "from_fp8", "matmul"])
def test_a_scale_out_of_range_stops_the_run_unless_the_option_is_off(op, log2_scale):
    """PopART's ``throwIfLog2ScaleTensorNotInRange`` (on by default): a scale outside the
    device's 6-bit range [-32, 32) stops the run with Poplar's application error; off, the
    scale is clipped into the range."""
    data = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)

    def run(scale_value: int, throw: bool | None) -> np.ndarray:
        ir = ipuxl.Ir()
        if throw is not None:
            ir._pb_ir.getSessionOptions().throwIfLog2ScaleTensorNotInRange = throw
        with ir.main_graph:
            scale = ipuxl.constant(scale_value, ipuxl.int32)
            if op == "to_fp8":
                out = ops.pow2scale_cast_to_fp8(ipuxl.variable(data, ipuxl.float16), scale, float8_143)
            else:
                x = ipuxl.variable(data, float8_143, log2_scale=0)
                out = (ops.pow2scale_cast_from_fp8(x, scale, ipuxl.float16) if op == "from_fp8"
                       else ops.matmul_pow2scaled(x, x, scale))
            stream = ipuxl.d2h_stream(out.shape, out.dtype, "out")
            ops.host_store(stream, out)
        with ipuxl.Session(ir, "cpu") as session:
            return np.asarray(session.run()[stream]).view(np.uint8 if op == "to_fp8" else np.float16)

    for throw in (None, True):
        with pytest.raises(errors.ApplicationRuntimeError, match=rf"holds {log2_scale}, outside the range") as info:
            run(log2_scale, throw)
        assert isinstance(info.value, ValueError) and info.value.type == "poplar_application_runtime_error"
    np.testing.assert_array_equal(run(log2_scale, False), run(max(-32, min(31, log2_scale)), True))
