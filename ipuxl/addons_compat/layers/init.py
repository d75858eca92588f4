"""Initial values of the layers' variables, drawn as popxl.addons draws them."""
from __future__ import annotations

import numpy as np

__all__ = ["truncated_normal"]


def truncated_normal(shape: tuple[int, ...], scale: float = 0.02, bound: float = 2.0) -> np.ndarray:
    """Normal(0, ``scale``) values truncated to ``[-bound * scale, bound * scale]`` (upstream's
    ``truncnorm.rvs(-2, 2, loc=0, scale=0.02)``), from numpy's global generator, so
    ``np.random.seed`` makes them reproducible."""
    values = np.random.normal(0.0, scale, shape)
    outside = np.abs(values) > bound * scale
    while outside.any():  # redraw the tail: the distribution conditioned on the interval
        values[outside] = np.random.normal(0.0, scale, int(outside.sum()))
        outside = np.abs(values) > bound * scale
    return values
