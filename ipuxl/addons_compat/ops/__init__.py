"""popxl.addons' ops: cross entropy (``cross_entropy``) and host transfers (``streams``)."""
from ipuxl.addons_compat.ops.cross_entropy import cross_entropy, cross_entropy_with_grad
from ipuxl.addons_compat.ops.streams import host_load, host_store

__all__ = ["cross_entropy", "cross_entropy_with_grad", "host_load", "host_store"]
