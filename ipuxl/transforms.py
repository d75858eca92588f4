"""PopXL's ``transforms``: ``autodiff`` and the ``GradGraphInfo`` it returns,
``decompose_sum``, and the exchange contexts ``merge_exchange`` and ``io_tile_exchange``.

The transform is the autodiff pass (``ipuxl.passes.autodiff``); its result types
live with the IR (``ipuxl.ir.grad_info``). This module only gives them PopXL's names.
"""
import contextlib
from typing import Iterator

from ipuxl.ir.grad_info import ExpectedConnection, ExpectedConnectionType, GradGraphInfo
from ipuxl.ir.graph import Graph
from ipuxl.passes.autodiff import autodiff

__all__ = ["autodiff", "GradGraphInfo", "ExpectedConnection", "ExpectedConnectionType", "decompose_sum",
           "merge_exchange", "io_tile_exchange"]


def decompose_sum(graph: Graph) -> Graph:
    """PopXL's ``decompose_sum``: returns ``graph``.

    Upstream rewrites the sums of many tensors that autodiff makes (a gradient read by
    several ops) into a chain of additions, each done as soon as its operands exist, so
    fewer gradients are live at once. It changes when the additions run on an IPU, not
    their values; ipuxl's grad graphs add gradients pairwise already and the device
    schedules for memory itself, so there is nothing to rewrite.
    """
    return graph


@contextlib.contextmanager
def merge_exchange() -> Iterator[None]:
    """PopXL's ``merge_exchange`` context: the host and remote transfers made inside it are
    merged into one exchange on an IPU (an IPU-side schedule: same values, fewer syncs).

    The simulated device has no exchange phases, so the ops inside run as written.
    """
    yield


@contextlib.contextmanager
def io_tile_exchange(verify_overlap: bool = True) -> Iterator[None]:
    """PopXL's ``io_tile_exchange`` context: the transfers inside it run on the IO tiles,
    overlapped with compute on an IPU. As ``merge_exchange``, it changes the IPU's schedule
    only; ``verify_overlap`` is accepted for upstream's signature."""
    yield
