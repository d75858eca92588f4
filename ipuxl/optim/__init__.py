"""Optimisers as graph-building code whose updates are in-place ``var_updates`` ops.

The full set (SGD with momentum, Adam, AdamW, LAMB, RMSprop) arrives with the
popxl.addons issue; for now plain SGD, the update seed 001 writes by hand.
"""
from ipuxl.optim.sgd import sgd_update_

__all__ = ["sgd_update_"]
