"""PopXL's ``popxl.utils`` (``ipuxl.utils``): ``to_numpy`` with PopXL's downcasting, and its table."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipuxl
from ipuxl import errors, utils


@pytest.mark.parametrize("data, kwargs, expected", [
    ([1.5, 2.5], {}, np.float32),
    (np.arange(3, dtype=np.int64), {}, np.int32),
    (np.arange(3, dtype=np.uint64), {}, np.uint32),
    (np.arange(3, dtype=np.int64), {"downcast": False}, np.int64),
    ([1, 2], {"dtype": ipuxl.float16}, np.float16),
    (torch.arange(4, dtype=torch.int16), {}, np.int16),
    (torch.ones(2, dtype=torch.bfloat16), {}, np.float32),
    (np.ones(2, np.float64), {"dtype": torch.float64}, np.float64),
])
def test_to_numpy_matches_numpy_with_popxl_downcasting(data, kwargs, expected):
    out = utils.to_numpy(data, **kwargs)
    source = data.float().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
    assert out.dtype == np.dtype(expected) and out.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(out, source.astype(expected))


def test_to_numpy_copies_unless_told_not_to():
    data = np.arange(4, dtype=np.float32)
    assert not np.shares_memory(utils.to_numpy(data), data)
    assert utils.to_numpy(data, copy=False) is data


def test_to_numpy_refuses_float8_options():
    with pytest.raises(errors.UnsupportedError, match="log2_scale") as info:
        utils.to_numpy([1.0], log2_scale=2)
    assert isinstance(info.value, RuntimeError)


def test_downcast_table_is_popxls():
    assert utils.downcast_np_dtypes == {np.dtype("int64"): np.dtype("int32"),
                                        np.dtype("uint64"): np.dtype("uint32"),
                                        np.dtype("float64"): np.dtype("float32")}
