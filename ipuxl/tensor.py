"""PopXL's ``popxl.tensor`` module: tensor classes, tensor constructors and type aliases.

``import ipuxl.tensor`` (or ``ipuxl.tensor`` as an attribute) gives what programs
written for PopXL import from ``popxl.tensor``: ``Variable`` in type annotations,
``from popxl.tensor import graph_input``, the ``HostTensor`` aliases.
"""
from __future__ import annotations

from typing import Iterable, Union

import numpy as np
import torch

from ipuxl.ir.graph_builder import constant, graph_input, graph_output, variable
from ipuxl.ir.tensor import Constant, Tensor, TensorByRef, TensorSpec, Variable

__all__ = [
    "Tensor", "Variable", "Constant", "TensorSpec", "TensorByRef", "variable", "constant", "graph_input",
    "graph_output", "ScalarType", "HostTensor", "HostScalarTensor", "TensorLike",
]

ScalarType = Union[int, float, bool]
"""Python scalars that ops turn into constants."""
HostTensor = Union[np.ndarray, torch.Tensor, Iterable[ScalarType]]
"""Host containers that can initialise a tensor."""
HostScalarTensor = Union[ScalarType, HostTensor]
"""Host scalars or containers that can initialise a tensor."""
TensorLike = Union[Tensor, HostScalarTensor]
"""A tensor, or host data an op turns into a constant."""
