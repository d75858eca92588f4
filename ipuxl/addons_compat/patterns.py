"""popxl.addons' ``patterns``: PopART's pre-alias patterns, applied to every graph of an Ir.

Upstream, ``apply_pre_alias_patterns(ir, level)`` sets the IR's PopART pattern level and
runs PopART's pre-alias patterns on every graph: rewrites of ops into other ops
(decompositions for Poplar, fusions, identities). On ipuxl those that only change how
an IPU would compute a value have no counterpart: the device computes each op's value
directly (see ``docs/applications.md``). The pattern whose result programs depend on is
``OpToIdentity``: it turns ops that *can be replaced by an identity* into identities,
which popxl.addons' tensor-parallel all-reduces with identical inputs need before they
run (``ipuxl.passes.op_to_identity``). As in PopART it belongs to the ``default`` and
``all`` levels, not to ``minimal`` (mandatory patterns only) or ``no_patterns``.
"""
from __future__ import annotations

from typing import Literal

from ipuxl.errors import UnknownKeyError
from ipuxl.ir import context
from ipuxl.ir.ir import Ir
from ipuxl.passes.op_to_identity import replace_ops_by_identity

__all__ = ["apply_pre_alias_patterns", "patterns_level"]

PatternsLevel = Literal["no_patterns", "minimal", "default", "all"]

#: The levels and whether each runs ``OpToIdentity`` (PopART: a default-enabled, non-mandatory pattern).
patterns_level: dict[str, bool] = {"no_patterns": False, "minimal": False, "default": True, "all": True}


def apply_pre_alias_patterns(ir: Ir, level: PatternsLevel = "default") -> None:
    """Apply the pre-alias patterns of ``level`` to every graph of ``ir``, in place.

    Args:
        ir: the IR whose graphs are rewritten.
        level: ``no_patterns`` (nothing), ``minimal`` (mandatory patterns only),
            ``default`` or ``all`` (both include ``OpToIdentity``).

    Raises:
        UnknownKeyError: (a KeyError, as upstream's table lookup) an unknown level.

    Example:
        >>> grad = addons.autodiff(graph)
        >>> apply_pre_alias_patterns(ir, level="default")  # TP identities, after autodiff
    """
    if level not in patterns_level:
        raise UnknownKeyError(f"apply_pre_alias_patterns: unknown patterns level {level!r}",
                              where=context.user_source_line(), fix=f"use one of {list(patterns_level)}")
    if patterns_level[level]:
        for graph in ir.graphs:
            replace_ops_by_identity(graph)
