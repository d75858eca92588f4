"""popxl.addons compatibility (``import ipuxl.addons_compat as addons``).

Planned in the addons issue: Module, NamedTensors/DotTree, variable factories,
GraphWithNamedArgs, BoundGraph, GraphCache, autodiff helpers and layers. Nothing
is exported yet, so importing names from here fails loudly instead of half-working.
"""
__all__: list[str] = []
