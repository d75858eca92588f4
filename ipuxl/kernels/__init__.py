"""Runtime kernels: the functions and torch custom ops that run on the device.

An op of ``ipuxl.ops`` builds an fx node whose target is a torch function or one of
these kernels (``ops/X.py`` builds nodes that call ``kernels/X.py``: ``conv``, ``pool``,
``elementwise``, ``indexing``, ``nn``, ``reduce``, ``shape``, ``vision``, ``ipu_copy``,
``debug``...); the device (``ipuxl.device``) compiles the graph into code that calls
them, and its compile-time rewrites (``ipuxl.device.rewrites``) match them and swap in
fused ones or faster ones with the same results (``conv.convolution_backward``,
``pool.max_pool2d_with_indices``). Both sides import this package downwards, so neither
reaches into the other:

- ``var_updates``: the in-place variable updates and the fused Adam steps;
- ``random``: seeded draws, as plain functions and as ``torch.ops.ipuxl.*`` custom
  ops (registered on import);
- ``collectives``: exact collectives across replicas, run through the exchange the
  device installs while a replica runs;
- ``tp_collectives``: popxl.addons' tensor-parallel all-reduce and its gradient rules;
- ``host_io``: host loads and the per-stream cursors a run reads them from.
"""
from ipuxl.kernels import collectives, host_io, random, tp_collectives, var_updates

__all__ = ["collectives", "host_io", "random", "tp_collectives", "var_updates"]
