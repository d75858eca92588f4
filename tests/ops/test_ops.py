"""``ipuxl.ops`` as a whole: every op checks shapes when it is built (``ShapeMismatchError`` at the
user's line), and every op of the namespace has a test (the tests of each ops module are in
``test_<module>.py`` here; Streaming Memory's and placement's ops are tested with the device and the IR)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import ShapeMismatchError

vu = ops.var_updates


SHAPE_ERRORS = [
    ("add", lambda a, b: ops.add(a, b), (2, 3), (4,)),
    ("mul", lambda a, b: a * b, (2, 3), (3, 2)),
    ("matmul", ops.matmul, (2, 3), (4, 5)),
    ("concat", lambda a, b: ops.concat([a, b], axis=0), (2, 3), (2, 4)),
    ("reshape", lambda a, b: ops.reshape(a, (5, 5)), (2, 3), (1,)),
    ("split", lambda a, b: ops.split(a, 4, axis=1), (2, 3), (1,)),
    ("squeeze", lambda a, b: ops.squeeze(a, [1]), (2, 3), (1,)),
    ("unsqueeze", lambda a, b: ops.unsqueeze(a, [0, -4]), (2, 3), (1,)),
    ("where", lambda a, b: ops.where(ops.greater(a, 0.0), a, b), (2, 3), (4,)),
    ("accumulate_", lambda a, b: vu.accumulate_(a, b), (2, 3), (3,)),
    ("accumulate_square_", lambda a, b: vu.accumulate_square_(a, b), (2, 3), (1, 3)),
    ("accumulate_mean_", lambda a, b: vu.accumulate_mean_(a, b, 1.0), (2, 3), (2, 1)),
    ("accumulate_moving_average_", lambda a, b: vu.accumulate_moving_average_(a, b, 0.9), (2, 3), (3, 2)),
    ("accumulate_moving_average_square_", lambda a, b: vu.accumulate_moving_average_square_(a, b, 0.9),
     (2, 3), (6,)),
    ("copy_var_update_", vu.copy_var_update_, (2, 3), (3,)),
    ("sparse_accumulate_", lambda a, b: vu.sparse_accumulate_(a, b, ops.cast(b, ipuxl.int32)[:1]), (2, 3), (2, 4)),
    ("scaled_add_", lambda a, b: ops.scaled_add_(a, b, b=0.5), (2, 3), (3,)),
]


@pytest.mark.parametrize("op_name, fn, shape_a, shape_b", SHAPE_ERRORS, ids=[e[0] for e in SHAPE_ERRORS])
def test_shape_mismatch_raises_at_build_time(op_name, fn, shape_a, shape_b):
    ir = ipuxl.Ir()
    with ir.main_graph:
        a = ipuxl.variable(np.zeros(shape_a, np.float32), name="a")
        b = ipuxl.variable(np.zeros(shape_b, np.float32), name="b")
        with pytest.raises(ShapeMismatchError, match=rf"'{re.escape(op_name)}'") as err:
            fn(a, b)
    assert err.value.where and __file__.rsplit("/", 1)[-1] in err.value.where  # points at the user's line


def test_every_op_is_tested():
    tests = Path(__file__).parents[1]  # the ops' tests, and those of Streaming Memory and of placement on IPUs
    files = [*(tests / "ops").glob("test_*.py"), *(tests / "device").glob("test_streaming_memory*.py"),
             tests / "device" / "test_resources_streaming_memory.py", tests / "device" / "test_ipus.py",
             tests / "ir" / "test_placement.py", tests / "addons_compat" / "transforms" / "test_pipelining.py",
             tests / "reference" / "test_popxl_pipelining.py"]
    source = "".join(p.read_text() for p in sorted(files))
    used = set(re.findall(r"\bops\.(\w+)", source)) | set(re.findall(r"\bvu\.(\w+)", source))
    # collectives have their own tests (tests/ops/test_collectives.py)
    missing = sorted(n for n in set(ops.__all__) - used - {"var_updates", "collectives"} if not n[0].isupper())
    missing += sorted(f"var_updates.{n}" for n in set(vu.__all__) - used)
    assert not missing, f"ops without a test: {missing}"
