"""Call outputs that share an input's storage (``ipuxl.ir.output_sharing``): returned as
aliases where no caller could tell, copied where one could.

PopXL's calls return new tensors. Every test checks the program gives the values copies
would give (worked out with numpy from the initial weights); the compiled code then says
whether the output stayed an alias (no ``torch.clone`` in the called graph's code).
"""
from __future__ import annotations

import numpy as np
import pytest
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops

F32 = ipuxl.float32
W0 = np.arange(6, dtype=np.float32).reshape(2, 3)
ONES = np.ones((2, 3), np.float32)


def _transpose(x):
    return x.T


def _store(name: str, t: ipuxl.Tensor) -> ipuxl.streams.DeviceToHostStream:
    stream = ipuxl.d2h_stream(t.shape, t.dtype, name)
    ops.host_store(stream, t * 1.0)
    return stream


def _callee_code(session: ipuxl.Session, graph) -> str:
    compiled = session.compiled_graph(graph)
    assert compiled is not None, f"{graph.name} was inlined, not compiled once"
    return compiled.module.code


def _two_sites(update_between: tuple[bool, bool]):
    """``w.T`` from one graph called at two sites; the weight is updated between a call
    and its output's read where ``update_between`` says."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(W0, name="w")
        graph = ir.create_graph(_transpose, w)
        streams = []
        for site, update in enumerate(update_between):
            wt, = ops.call(graph, w)
            if update:
                ops.scaled_add_(w, ipuxl.constant(ONES))
            streams.append(_store(f"wt{site}", wt))
            if not update:
                ops.scaled_add_(w, ipuxl.constant(ONES))
    with ipuxl.Session(ir) as session:
        results = session.run()
    return session, graph, [results[s] for s in streams]


def test_output_of_a_graph_called_twice_stays_an_alias_when_no_site_writes_under_it():
    session, graph, (first, second) = _two_sites((False, False))
    assert_close(first, W0.T)
    assert_close(second, (W0 + 1).T)
    assert "torch.clone(" not in _callee_code(session, graph)


def test_one_site_writing_the_input_under_the_output_makes_every_call_copy():
    session, graph, (first, second) = _two_sites((False, True))
    assert_close(first, W0.T)
    assert_close(second, (W0 + 1).T)  # the copy made before the second update
    assert "torch.clone(" in _callee_code(session, graph)


def test_an_alias_of_an_alias_is_copied_when_the_first_input_is_written_under_it():
    """g2(g1(w)): g2's output shares w's storage through g1's; w is written after g2's
    call, before g2's output is read, so g2's output must be a copy of the old values."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(W0, name="w")
        g1 = ir.create_graph(_transpose, w)
        g2 = ir.create_graph(_transpose, ipuxl.constant(W0.T.copy()))
        streams = []
        for site in range(2):  # two sites each: compiled once, not inlined
            wt, = ops.call(g1, w)
            wtt, = ops.call(g2, wt)
            ops.scaled_add_(w, ipuxl.constant(ONES))
            streams.append(_store(f"wtt{site}", wtt))
    with ipuxl.Session(ir) as session:
        results = session.run()
    assert_close(results[streams[0]], W0)
    assert_close(results[streams[1]], W0 + 1)


def test_a_written_output_and_its_twin_are_copied_and_the_twin_does_not_see_the_write():
    """A graph returns two views of its input; the caller accumulates into one of them."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(W0, name="w")
        graph = ir.create_graph(lambda x: (x.T, x.reshape((6,))), w)
        streams = []
        for site in range(2):
            wt, flat = ops.call(graph, w)
            ops.var_updates.accumulate_(wt, ipuxl.constant(ONES.T.copy()))
            streams += [_store(f"wt{site}", wt), _store(f"flat{site}", flat)]
    with ipuxl.Session(ir) as session:
        results = session.run()
        w_after = session.get_tensor_data(w)
    for site in range(2):
        assert_close(results[streams[2 * site]], W0.T + 1)
        assert_close(results[streams[2 * site + 1]], W0.reshape(6))
    assert_close(w_after, W0)
    # the written one, and its twin: outputs that may share storage are read as one
    # storage by the callers, so a write to one is a write under the other
    code = _callee_code(session, graph)
    assert code.count("torch.clone(") == 2, code


def _nested(update_at_second_site: bool):
    """outer(w) returns inner(w)'s alias of ``w``; outer is called at two sites, the
    second one optionally updating ``w`` before reading outer's output."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(W0, name="w")
        inner = ir.create_graph(_transpose, w)

        def outer_fn(x):
            wt, = ops.call(inner, x)
            return wt

        outer = ir.create_graph(outer_fn, w)
        first_wt, = ops.call(outer, w)
        first = _store("first", first_wt)
        second_wt, = ops.call(outer, w)
        if update_at_second_site:
            ops.scaled_add_(w, ipuxl.constant(ONES))
        second = _store("second", second_wt)
        also_inner, = ops.call(inner, w)  # a second site: inner compiled once too
        third = _store("third", also_inner)
    with ipuxl.Session(ir) as session:
        results = session.run()
    return session, inner, [results[s] for s in (first, second, third)]


def test_an_alias_returned_through_a_caller_is_checked_at_the_callers_sites():
    session, inner, (first, second, third) = _nested(update_at_second_site=False)
    assert_close(first, W0.T)
    assert_close(second, W0.T)
    assert_close(third, W0.T)
    assert "torch.clone(" not in _callee_code(session, inner)

    session, inner, (first, second, third) = _nested(update_at_second_site=True)
    assert_close(first, W0.T)
    assert_close(second, W0.T)  # read after the update: a copy of the values before it
    assert_close(third, (W0 + 1).T)
    assert "torch.clone(" in _callee_code(session, inner)


def _two_views_of_a_new_tensor(ir: ipuxl.Ir, w: ipuxl.Tensor):
    """``view`` (``x.T``) and ``outer``: ``y = x * 2``, returning two calls of ``view`` on ``y``
    (an outlined layer returning the same activation saved for two projections)."""
    view = ir.create_graph(_transpose, w)

    def outer_fn(x):
        y = x * 2.0
        return ops.call(view, y)[0], ops.call(view, y)[0]

    return view, ir.create_graph(outer_fn, w)


@pytest.mark.parametrize("writing_site", [None, 0, 1])
def test_two_returned_aliases_of_one_new_tensor_are_copies_where_a_caller_writes_one(writing_site):
    """``outer`` returns two views of one new tensor; where a caller of outer writes one,
    the other must keep the values outer computed."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(W0, name="w")
        view, outer = _two_views_of_a_new_tensor(ir, w)
        streams = []
        for site in range(2):
            a, b = ops.call(outer, w)
            if site == writing_site:
                ops.var_updates.accumulate_(a, ipuxl.constant(ONES.T.copy()))
            streams += [_store(f"a{site}", a), _store(f"b{site}", b)]
    with ipuxl.Session(ir) as session:
        results = session.run()
    for site in range(2):
        assert_close(results[streams[2 * site]], 2 * W0.T + (1 if site == writing_site else 0))
        assert_close(results[streams[2 * site + 1]], 2 * W0.T)
    assert ("torch.clone(" in _callee_code(session, view)) == (writing_site is not None)


def test_aliases_sharing_one_new_tensor_stay_known_to_share_two_callers_up():
    """As above, one level deeper: ``mid`` returns both of ``outer``'s outputs, and the
    caller of ``mid`` writes one while the other is still to be read."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(W0, name="w")
        _, outer = _two_views_of_a_new_tensor(ir, w)

        def mid_fn(x):
            return tuple(ops.call(outer, x))

        mid = ir.create_graph(mid_fn, w)
        streams = []
        for site in range(2):
            a, b = ops.call(mid, w)
            if site == 1:
                ops.var_updates.accumulate_(a, ipuxl.constant(ONES.T.copy()))
            streams += [_store(f"a{site}", a), _store(f"b{site}", b)]
    with ipuxl.Session(ir) as session:
        results = session.run()
    assert_close(results[streams[0]], 2 * W0.T)
    assert_close(results[streams[1]], 2 * W0.T)
    assert_close(results[streams[2]], 2 * W0.T + 1)
    assert_close(results[streams[3]], 2 * W0.T)


@pytest.mark.parametrize("sites", [1, 2])
def test_a_tensor_and_its_view_returned_together_are_two_tensors(sites):
    """``return y, y.T``: a caller writing one output must not change the other (one call
    site: the graph is inlined; two: compiled once). Before outputs' shared storage was
    checked, the write showed through the other output."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(W0, name="w")

        def both(x):
            y = x * 2.0
            return y, y.T

        graph = ir.create_graph(both, w)
        streams = []
        for site in range(sites):
            y, yt = ops.call(graph, w)
            ops.var_updates.accumulate_(y, ipuxl.constant(ONES))
            streams += [_store(f"y{site}", y), _store(f"yt{site}", yt)]
    with ipuxl.Session(ir) as session:
        results = session.run()
    for site in range(sites):
        assert_close(results[streams[2 * site]], 2 * W0 + 1)
        assert_close(results[streams[2 * site + 1]], 2 * W0.T)


def test_an_alias_of_a_graphs_constant_is_never_returned():
    """A graph returns its constant's transpose (through a call); the caller writes the
    output: the constant must be the same on the next run."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(W0, name="w")
        view = ir.create_graph(_transpose, w)

        graph = ir.create_graph(lambda x: ops.call(view, ipuxl.constant(W0, name="c"))[0], w)
        streams = []
        for site in range(2):
            ct, = ops.call(graph, w)
            ops.var_updates.accumulate_(ct, ipuxl.constant(ONES.T.copy()))
            streams.append(_store(f"ct{site}", ct))
    with ipuxl.Session(ir) as session:
        for run in range(2):
            results = session.run()
            for stream in streams:
                assert_close(results[stream], W0.T + 1)


def test_a_repeated_graphs_outputs_are_copies():
    """A repeat's outputs are its next iteration's inputs: copied even where nothing
    writes the input afterwards (the rule is per graph: not analysed across iterations)."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="x")
        graph = ir.create_graph(lambda t: t.T.T, x)
        out, = ops.repeat(graph, 3, x)
        stream = _store("out", out)
    with ipuxl.Session(ir) as session:
        result = session.run()[stream]
    assert_close(result, W0)
    assert "torch.clone(" in _callee_code(session, graph)
