"""An outlined graph's code exists once in the compiled program, however often it is called."""
from __future__ import annotations

import re

from tests.conftest import load_example


def test_outlined_linear_is_compiled_once_and_called_twice():
    example = load_example("addons_mnist")
    session, _, _, _ = example.test_program(4, "cpu", example.NetOutlined)
    linear = [g for g in session._compiled if g.base_name == "Linear"]
    assert len(linear) == 1, "one compiled function for the shared Linear graph"
    calls = re.findall(r"= (ipuxl_compiled_call_\w+)\(", session.code)
    assert len(calls) == 2 and calls[0] == calls[1]


def test_inlined_net_has_no_subgraph_calls():
    example = load_example("addons_mnist")
    session, _, _, _ = example.test_program(4, "cpu", example.Net)
    assert "ipuxl_compiled_call" not in session.code
    assert session.code.count("matmul(") + session.code.count("mm(") == 4
