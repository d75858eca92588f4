"""docs/popxl.md lists every name of ipuxl's PopXL and popxl.addons surface and every
upstream module of ``ipuxl.compat.table``, and the names it calls working exist."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.addons_compat.ops.replicated_strided_collectives as strided
import ipuxl.addons_compat.transforms.batch_serialisation as batch_serialisation
from ipuxl.compat import resolve
from ipuxl.compat.table import POPXL, POPXL_ADDONS
from tests.test_public_api import ADDONS, IPUXL, OPS, TRANSFORMS

DOC = (Path(__file__).resolve().parents[2] / "docs" / "popxl.md").read_text(encoding="utf-8")
WORKING = ("supported", "simulated", "accepted without effect")
STATUSES = (*WORKING, "not provided", "not applicable")
#: ipuxl's own names beside PopXL's at its top level (the PopTorch front end's, documented in docs/poptorch.md)
POPTORCH_NAMES = {"trainingModel", "inferenceModel", "Options", "DataLoader", "DataLoaderMode", "AnchorMode",
                  "OutputMode", "PoplarExecutor", "identity_loss", "optim", "__version__"}


def _rows() -> list[tuple[str, str, str]]:
    """``(section, first cell, status)`` of every table row."""
    rows, section = [], ""
    for line in DOC.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 3 and cells[0] not in ("name", "---"):
            rows.append((section, cells[0], cells[1]))
    return rows


def _names(cell: str) -> set[str]:
    """Every identifier in the backticked code of ``cell`` (dotted paths split)."""
    found: set[str] = set()
    for code in re.findall(r"`([^`]+)`", cell):
        found.update(re.findall(r"[A-Za-z_]\w*", code.split("(")[0]))
        found.update(re.findall(r"[A-Za-z_]\w*", code))
    return found


DOCUMENTED = set().union(*(_names(cell) for _, cell, _ in _rows()))


@pytest.mark.parametrize("name", sorted(set(IPUXL) - POPTORCH_NAMES) + sorted(OPS) + sorted(TRANSFORMS) + sorted(ADDONS))
def test_every_pinned_name_has_a_row(name):
    assert name in DOCUMENTED, f"docs/popxl.md has no row naming {name}"


@pytest.mark.parametrize("module", sorted(m for m in [*POPXL, *POPXL_ADDONS] if not m.startswith("popxl.ops.")))
def test_every_upstream_module_of_the_table_has_a_row(module):
    assert f"`{module}`" in DOC or module.split(".")[-1] in DOCUMENTED, f"docs/popxl.md has no row for {module}"


def test_every_row_has_a_known_status():
    for section, cell, status in _rows():
        assert status.startswith(STATUSES), (section, cell, status)


def _exists(section: str, path: str) -> bool:
    if "." in path:  # an upstream module path: the module ipuxl.compat maps it to imports
        target = resolve(path)
        return target is not None and importlib.import_module(target) is not None
    spaces: list[object] = {
        "Top-level names": [ipuxl, ipuxl.utils],
        "popxl.ops": [ipuxl.ops, ipuxl.ops.collectives, ipuxl.ops.var_updates, ipuxl.ops.random],
        "popxl.transforms": [ipuxl.transforms],
    }.get(section, [addons, addons.layers, addons.ops, addons.transforms, addons.optimizers,
                    batch_serialisation, strided])
    for space in spaces:
        if hasattr(space, path):
            return True
        try:  # a submodule not imported by its package (``popxl_addons.ops.rotary_pos_embed``)
            module = importlib.import_module(f"{space.__name__}.{path}")  # type: ignore[attr-defined]
        except ImportError:
            continue
        return module is not None
    return False


def test_names_documented_as_working_exist():
    missing = []
    for section, cell, status in _rows():
        if not status.startswith(WORKING):
            continue
        for code in re.findall(r"`([^`]+)`", cell):
            path = code.split("(")[0].strip()
            if path.startswith(("popxl.", "popxl_addons.")) or re.fullmatch(r"[A-Za-z_]\w*", path):
                if path in ("popxl.testing",):  # ipuxl.testing: a module of ipuxl's own name
                    path = "testing"
                if not _exists(section, path):
                    missing.append(f"{section}: {path}")
    assert missing == []


def test_the_checks_can_fail():
    assert "no_such_op" not in DOCUMENTED
    assert not _exists("popxl.ops", "no_such_op")
