"""``ipuxl.kernels.embedding.add_embedding_grad`` against aten's dense embedding gradient plus
the other gradient (the oracle)."""
from __future__ import annotations

import pytest
import torch

from ipuxl.kernels.embedding import add_embedding_grad

aten = torch.ops.aten


def _inputs(pad_token: int | None):
    gen = torch.Generator().manual_seed(0)
    other = torch.randn(10, 6, generator=gen)
    grad = torch.randn(3, 4, 6, generator=gen)
    ids = torch.tensor([[1, 1, 7, 0], [9, 1, 3, 3], [0, 0, 2, 5]])
    return other, grad, ids


@pytest.mark.parametrize("padding_idx", [-1, 0, 3])
@pytest.mark.parametrize("in_place", [False, True])
def test_matches_other_plus_aten_dense_embedding_gradient(padding_idx, in_place):
    other, grad, ids = _inputs(padding_idx)
    want = other + aten.embedding_dense_backward(grad, ids, 10, padding_idx, False)
    before = other.clone()
    got = add_embedding_grad(other, grad, ids, padding_idx, in_place)
    torch.testing.assert_close(got, want)
    assert (got is other) == in_place
    if not in_place:
        assert torch.equal(other, before)  # the other gradient is left alone
    if padding_idx >= 0:  # the padding row gets nothing from its tokens
        assert torch.equal(got[padding_idx], before[padding_idx])


def test_rows_read_once_are_bit_for_bit_aten():
    other, grad, ids = _inputs(None)
    want = other + aten.embedding_dense_backward(grad, ids, 10, -1, False)
    got = add_embedding_grad(other.clone(), grad, ids, -1, True)
    counts = torch.bincount(ids.reshape(-1), minlength=10)
    once = counts <= 1
    assert torch.equal(got[once], want[once])
