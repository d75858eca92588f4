"""Graph passes: each takes IR graphs and returns transformed ones (one pass per file)."""
from ipuxl.passes.autodiff import differentiate

__all__ = ["differentiate"]
