"""Which of a traced forward's losses is the final one, as PopTorch decides.

PopTorch calls every loss in the graph (each ``identity_loss`` and each torch loss
function: ``F.nll_loss``, ``nn.MSELoss``...) a loss, and drops the losses that another
loss uses (``partial = identity_loss(x - t); identity_loss(partial * partial)``: the inner
one is part of the outer). Exactly one loss must remain among those the outputs use:
none is "Couldn't find a loss in graph", several (``nll_loss(o, t) + nll_loss(o, t) * 5``
returned unwrapped) is "Multiple independent losses found in graph".

``LossCandidates`` records the losses in call order and, from the first one on, which
losses each traced tensor was computed from (``follow``, called for every op of the
capture); ``final`` then names the losses no other one uses.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["LossCandidates", "MULTIPLE_LOSSES", "NO_LOSS"]

NO_LOSS = "Couldn't find a loss in graph"
MULTIPLE_LOSSES = ("Multiple independent losses found in graph. Graph must have one final loss. "
                   "Wrap final graph loss in poptorch.identity_loss.")


class LossCandidates:
    """The losses of a capture and the losses each tensor depends on (see the module docstring)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._uses: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> indices of the losses it uses

    def uses(self, value: Any) -> frozenset[int]:
        """The losses ``value`` (a tensor, or a structure of them) was computed from, or is."""
        found: frozenset[int] = frozenset()
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                found |= self._uses.get(leaf, frozenset())
        return found

    def add(self, loss: torch.Tensor, inputs: Any = ()) -> None:
        """Record ``loss``, computed from ``inputs``, as a loss (once, however often marked)."""
        if any(loss is t for t in self.tensors):
            return
        self._uses[loss] = self.uses(inputs) | self.uses(loss) | {len(self.tensors)}
        self.tensors.append(loss)

    def follow(self, inputs: Any, out: Any) -> None:
        """An op made ``out`` from ``inputs``: ``out`` uses the losses they use (an in-place op's
        result, its written argument, keeps those it used already)."""
        if not self.tensors:
            return
        used = self.uses(inputs)
        if not used:
            return
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._uses[leaf] = self._uses.get(leaf, frozenset()) | used

    def final(self, outputs: list[torch.Tensor]) -> list[int]:
        """The losses the outputs use that no other such loss uses, in call order."""
        alive = sorted(self.uses(outputs))
        return [i for i in alive
                if not any(j != i and i in self._uses.get(self.tensors[j], frozenset()) for j in alive)]
