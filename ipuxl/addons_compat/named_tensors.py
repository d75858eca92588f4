"""``NamedTensors``: a ``DotTree`` of ipuxl Tensors (popxl.addons' container), and
``NamedTensorData``: a ``DotTree`` of their host values (``TaskSession.get_named_tensors_data``)."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ipuxl.addons_compat.dot_tree import DotTree
from ipuxl.ir.tensor import Tensor, Variable

__all__ = ["NamedTensors", "NamedTensorData", "TensorMap"]

TensorMap = Mapping[Tensor, Tensor]


class NamedTensors(DotTree[Tensor]):
    """A tree of tensors. ``tensors`` is sorted by tensor name, as upstream."""

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(sorted(self.to_dict().values(), key=lambda t: t.name))

    @property
    def named_tensors(self) -> dict[str, Tensor]:
        return dict(self.to_dict())

    @property
    def variables(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if isinstance(t, Variable))

    @property
    def named_variables(self) -> dict[str, Tensor]:
        return {name: t for name, t in self.named_tensors.items() if isinstance(t, Variable)}

    def remap(self, mapping: TensorMap) -> "NamedTensors":
        """The same tree with every tensor replaced by ``mapping[tensor]``."""
        return self.map(lambda t: mapping[t])


class NamedTensorData(DotTree[np.ndarray]):
    """A tree of host arrays by (dotted) name: the data of a ``NamedTensors``, e.g.
    ``session.get_named_tensors_data().layer.weight``."""
