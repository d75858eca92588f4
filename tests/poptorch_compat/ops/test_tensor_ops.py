"""PopTorch's tensor ops (``dynamic_slice``/``dynamic_update``, ``ctc_beam_search_decoder``, ``fps``,
``nearest``: ``ipuxl.poptorch_compat.ops.tensor_ops``) inside PopTorch models, against eager PyTorch
and reference implementations."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import OpArgumentError, OpContextError
from tests.poptorch_compat._checks import as_poptorch
from tests.poptorch_compat._checks import raises_in
from tests.poptorch_compat.ops._harness import Wrap, assert_same_weights, train_both

raises = raises_in(__file__)


# -- dynamic_slice / dynamic_update -----------------------------------------------------------------
@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_dynamic_slice_reads_the_start_at_run_time(step, dtype):
    model = Wrap(lambda m, t, s: poptorch.dynamic_slice(t, 1, s, 4, step))
    table = (torch.arange(16.0).reshape(2, 8) % 3).to(dtype)
    inference = poptorch.inferenceModel(model)
    for start in (1, 4, 0, 3):  # compiled with the first, run with the others
        got = inference(table, torch.tensor([start]))
        assert got.dtype == dtype
        torch.testing.assert_close(got, table[:, start:start + 4:step])
        torch.testing.assert_close(got, model(table, torch.tensor([start])))


def test_dynamic_slice_clamps_a_start_past_the_end():
    inference = poptorch.inferenceModel(Wrap(lambda m, t, s: poptorch.dynamic_slice(t, 0, s, 4, 1)))
    t = torch.arange(8.0)
    torch.testing.assert_close(inference(t, torch.tensor([7])), t[4:8])


def test_dynamic_slice_and_update_train_like_eager():
    def forward(m, x, s, y):
        h = m.fc(x)
        window = poptorch.dynamic_slice(h, 1, s, 2, 1)
        written = poptorch.dynamic_update(h, window * 3, 1, s + 2, 2)
        return written, F.mse_loss(written.sum(1), y)

    torch.manual_seed(0)
    device, eager = train_both(Wrap(forward, fc=nn.Linear(3, 8)), (torch.randn(4, 3), torch.tensor([1]),
                                                                   torch.randn(4)))
    assert_same_weights(device, eager)


def test_dynamic_update_writes_the_slice_at_run_time():
    inference = poptorch.inferenceModel(Wrap(lambda m, t, u, s: poptorch.dynamic_update(t, u, 0, s, 2)))
    t, u = torch.arange(8.0), torch.tensor([-1.0, -2.0])
    for start in (1, 5):
        want = t.clone()
        want[start:start + 2] = u
        torch.testing.assert_close(inference(t, u, torch.tensor([start])), want)


@pytest.mark.parametrize("call, fragment", [
    (lambda t, s: poptorch.dynamic_slice(t, 0, s, 0, 1), "The start and end of a slice must be different."),
    (lambda t, s: poptorch.dynamic_slice(t, 0, s, -2, 1), "end less than the start is not supported."),
    (lambda t, s: poptorch.dynamic_slice(t, 0, s, 7, 1),
     "The size of the slice (7) must be a factor of the slicing dimension (8)."),
    (lambda t, s: poptorch.dynamic_slice(t, 0, 1, 2, 1), "Slice start argument to dynamic_slice must be a torch"),
    (lambda t, s: poptorch.dynamic_slice(t, 0.5, s, 2, 1), "Dimension must be an integer."),
    (lambda t, s: poptorch.dynamic_update(t, t[:2].int(), 0, s, 2), "must have same dtype"),
    (lambda t, s: poptorch.dynamic_update(t, t[:2, None], 0, s, 2), "must have same dimensionality"),
])
def test_dynamic_slice_and_update_refuse_bad_arguments(call, fragment):
    with raises(OpArgumentError, fragment):
        poptorch.inferenceModel(Wrap(lambda m, t, s: call(t, s)))(torch.arange(8.0), torch.tensor([1]))


# -- ctc_beam_search_decoder ---------------------------------------------------------------------------
def brute_force_ctc(log_probs: torch.Tensor, length: int, blank: int) -> dict[tuple[int, ...], float]:
    """log P(labels) of every label sequence: the log-sum-exp over all its alignments."""
    totals: dict[tuple[int, ...], list[float]] = {}
    classes = log_probs.shape[1]
    for alignment in itertools.product(range(classes), repeat=length):
        merged = [c for i, c in enumerate(alignment) if c != blank and (i == 0 or c != alignment[i - 1])]
        score = float(sum(log_probs[t, c] for t, c in enumerate(alignment)))
        totals.setdefault(tuple(merged), []).append(score)
    return {labels: float(torch.logsumexp(torch.tensor(v, dtype=torch.float64), 0)) for labels, v in totals.items()}


def test_ctc_beam_search_decoder_finds_the_most_probable_label_sequences():
    torch.manual_seed(42)
    time, batch, classes = 5, 3, 3
    log_probs = torch.randn(time, batch, classes).log_softmax(-1)
    lengths = torch.tensor([5, 3, 4], dtype=torch.int32)
    model = Wrap(lambda m, p, n: poptorch.ctc_beam_search_decoder(p, n, blank=1, beam_width=64, top_paths=3))
    scores, sizes, paths = poptorch.inferenceModel(model)(log_probs, lengths)
    assert scores.shape == (batch, 3) and sizes.shape == (batch, 3) and paths.shape == (batch, 3, time)
    assert sizes.dtype == paths.dtype == torch.int32
    for b in range(batch):
        exact = brute_force_ctc(log_probs[:, b], int(lengths[b]), blank=1)
        best = sorted(exact.items(), key=lambda kv: -kv[1])[:3]
        for k, (labels, score) in enumerate(best):
            assert int(sizes[b, k]) == len(labels)
            assert tuple(paths[b, k, :len(labels)].tolist()) == labels and not paths[b, k, len(labels):].any()
            torch.testing.assert_close(float(scores[b, k]), score, rtol=1e-5, atol=1e-5)


def test_ctc_beam_search_decoder_checks_its_arguments():
    with raises(OpArgumentError, "ctc_beam_search_decoder: lengths must be a torch.tensor argument."):
        poptorch.ctc_beam_search_decoder(torch.zeros(4, 2, 3), [4, 4])
    with raises(OpArgumentError, "top_paths must be an int in [1, 2]"):
        poptorch.ctc_beam_search_decoder(torch.zeros(4, 2, 3), torch.tensor([4, 4]), beam_width=2, top_paths=3)
    with raises(OpArgumentError, "blank must be an int in [0, 2]"):
        poptorch.ctc_beam_search_decoder(torch.zeros(4, 2, 3), torch.tensor([4, 4]), blank=3)


# -- fps / nearest ------------------------------------------------------------------------------------
def numpy_fps(points: np.ndarray, count: int) -> list[int]:
    chosen, nearest = [0], ((points - points[0]) ** 2).sum(1)
    while len(chosen) < count:
        chosen.append(int(nearest.argmax()))
        nearest = np.minimum(nearest, ((points - points[chosen[-1]]) ** 2).sum(1))
    return chosen


def test_fps_samples_the_farthest_points_of_each_sample():
    torch.manual_seed(0)
    src, ptr = torch.randn(25, 3), [0, 10, 25]
    inference = poptorch.inferenceModel(Wrap(lambda m, s: poptorch.fps(s, ptr, 0.3)))
    for points in (src, src * 2 + 1):  # the sampling runs on each call's values
        got = inference(points)
        want = numpy_fps(points[:10].numpy(), 3) + [10 + i for i in numpy_fps(points[10:].numpy(), 5)]
        assert got.tolist() == want
    with raises(OpArgumentError, "`ptr` must containt at least 2 elements."):
        poptorch.fps(src, [0], 0.5)
    with raises(OpArgumentError, "`ratio` must be of float type."):
        poptorch.fps(src, ptr, 1)
    with raises(OpContextError, "random_start=True is not supported"):
        poptorch.fps(src, ptr, 0.5, random_start=True)


@pytest.mark.parametrize("as_list", [False, True])
def test_nearest_finds_the_closest_point_of_the_same_sample(as_list):
    torch.manual_seed(0)
    x, y = torch.randn(8, 2), torch.randn(5, 2)
    batch_x, batch_y = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1]), torch.tensor([0, 0, 1, 1, 1])
    args = (batch_x.tolist(), batch_y.tolist()) if as_list else (batch_x, batch_y)
    got = poptorch.inferenceModel(Wrap(lambda m, a, b: poptorch.nearest(a, b, *args)))(x, y)
    distance = torch.cdist(x, y) + (batch_x[:, None] != batch_y[None, :]) * 1e9
    torch.testing.assert_close(got, as_poptorch(distance.argmin(1)))
    torch.testing.assert_close(poptorch.nearest(x, y), torch.cdist(x, y).argmin(1))
