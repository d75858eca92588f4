"""PopXL's ``transforms``: ``autodiff`` and the ``GradGraphInfo`` it returns.

The transform is the autodiff pass (``ipuxl.passes.autodiff``); its result types
live with the IR (``ipuxl.ir.grad_info``). This module only gives them PopXL's names.
"""
from ipuxl.ir.grad_info import ExpectedConnection, ExpectedConnectionType, GradGraphInfo
from ipuxl.passes.autodiff import autodiff

__all__ = ["autodiff", "GradGraphInfo", "ExpectedConnection", "ExpectedConnectionType"]
