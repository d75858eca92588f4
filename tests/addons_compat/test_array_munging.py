"""popxl.addons' ``array_munging``: sharding an axis and undoing it, repeats, pads and squeezes, and
tensor-parallel inputs. numpy is the oracle."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from ipuxl.addons_compat import array_munging as am


def test_shard_splits_an_axis_onto_a_new_first_axis_and_unshard_undoes_it():
    x = np.arange(24).reshape(4, 6)
    assert_close(torch.from_numpy(am.shard(x, 2, 0)), torch.from_numpy(np.stack([x[:2], x[2:]])))
    assert_close(torch.from_numpy(am.shard(x, 3, -1)), torch.from_numpy(np.stack([x[:, :2], x[:, 2:4], x[:, 4:]])))
    for axis in (0, 1, -1):
        np.testing.assert_array_equal(am.unshard(am.shard(x, 2, axis), axis), x)
    s2 = am.shard2D(x, 2, 3, 0, 1)  # axis 0 outermost: (rows 0-1, cols 0-1), (rows 0-1, cols 2-3), ...
    np.testing.assert_array_equal(s2[1], x[:2, 2:4])
    np.testing.assert_array_equal(s2[3], x[2:, :2])
    np.testing.assert_array_equal(am.unshard2D(s2, 2, 3, 0, 1), x)
    with pytest.raises(ValueError, match="same rank"):
        am.unshard_arrays([np.zeros((1, 2)), np.zeros((1, 2, 3))], 0)
    with pytest.raises(ValueError, match="2 \\* 2 = 4 shards"):
        am.unshard2D(s2, 2, 2, 0, 1)


def test_repeats_pads_and_squeezes():
    x = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(am.repeat(x, 2, 1), np.stack([x, x], axis=1))
    np.testing.assert_array_equal(am.repeat_axis(x, 2, 0), np.concatenate([x, x], axis=0))
    np.testing.assert_array_equal(am.repeat_axis(x, 2, 1), np.concatenate([x, x], axis=1))
    data = np.arange(4)
    np.testing.assert_array_equal(am.repeat_shard(data, 2, 2, 0), [[0, 1], [2, 3], [0, 1], [2, 3]])
    np.testing.assert_array_equal(am.repeat_shard(data, 2, 2, 0, "strided"), [[0, 1], [0, 1], [2, 3], [2, 3]])
    with pytest.raises(ValueError, match="'contiguous' or 'strided'"):
        am.repeat_shard(data, 2, 2, 0, "diagonal")
    np.testing.assert_array_equal(am.pad_axis(x, 5, 1, value=-1), np.pad(x, [(0, 0), (0, 2)], constant_values=-1))
    assert am.squeeze_safe(np.zeros((1, 3, 1)), [0, 1]).shape == (3, 1)
    assert am.squeeze_safe(np.zeros((1, 3, 1))).shape == (3,)
    assert am.handle_negative_axis(x, -1) == 1
    with pytest.raises(IndexError, match="out of range"):
        am.handle_negative_axis(x, 2)
    with pytest.raises(IndexError, match="0-dimensional"):
        am.handle_negative_axis(np.float32(1.0), 0)


@pytest.mark.parametrize("tp, rf", [(1, 2), (2, 2), (2, 4)])
def test_tensor_parallel_input_gives_a_tp_group_one_sample_and_output_reads_it_back(tp, rf):
    samples = np.arange(8 * 3).reshape(8, 3)
    laid_out = am.tensor_parallel_input(samples, tp, rf)
    dp = rf // tp
    expected = np.repeat(samples.reshape(-1, dp, 1, 3), tp, axis=2).reshape(-1, rf, 3)
    np.testing.assert_array_equal(laid_out, expected)
    back = am.tensor_parallel_output(laid_out, laid_out.shape[0], tp, rf, (3,))
    np.testing.assert_array_equal(back, samples)
    with pytest.raises(ValueError, match="does not equally divide"):
        am.tensor_parallel_input(samples, 3, 4)
