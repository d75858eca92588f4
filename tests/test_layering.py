"""The package's walls: which ipuxl packages may import which, read off the source.

Layers, bottom up: ``errors``/``dtypes`` -> ``ir`` (data, construction, aliases, calls)
and ``ops``/``kernels`` -> ``passes`` -> ``device`` -> the front ends
(``capture`` + ``poptorch_compat``, ``addons_compat``). A module may import its own
layer and the ones below. Every import counts, including one inside a function.

Inside ``poptorch_compat``, the same shape: PopTorch's namespace modules (its top level)
-> ``compile`` (the compiler makes a program) -> ``runtime`` (which runs it).
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import ipuxl

PACKAGE = pathlib.Path(ipuxl.__file__).parent
FRONT_ENDS = ("ipuxl.poptorch_compat", "ipuxl.addons_compat")
# ``ipuxl.compat`` (running Graphcore's programs unchanged) aliases both front ends: it sits above them.
# ``ipuxl.popdist`` (PopDist, which programs import through the aliases) builds on both front ends too
# (``popdist.poptorch.Options`` is a ``poptorch.Options``); only the aliases reach it.
ALIASES = ("ipuxl.compat", "ipuxl.popdist")
# Public namespaces that re-export the front ends' names (loaded lazily, PEP 562).
FACADES = ("ipuxl", "ipuxl.optim")
# PopTorch's front end: its namespace (the package's top level), its compiler and its runtime
POPTORCH = "ipuxl.poptorch_compat"
POPTORCH_COMPILE = ("ipuxl.poptorch_compat.compile",)
POPTORCH_RUNTIME = ("ipuxl.poptorch_compat.runtime",)
UPPER = ("ipuxl.capture", "ipuxl.passes", "ipuxl.device", "ipuxl.transforms", *FRONT_ENDS, *ALIASES)

# Private attributes of torch and Python that ipuxl reads on purpose (no public API exists).
FOREIGN_PRIVATES = {
    "_jit_pass_propagate_shapes_on_graph",  # torch's TorchScript pass (poptorch_core.propagateInputShapes)
    "_debugGetPopartIR",  # PopTorch's own private API, which its users call (poptorch_core._getPopartIR)
    "_standard_gamma", "_standard_gamma_grad", "_sample_dirichlet", "_dirichlet_grad",  # torch.distributions' samplers
    "_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
    "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "_non_persistent_buffers_set", "_version", "_base", "_schema", "_ops",
    "_getframe", "_pytree", "_subclasses", "_functorch", "_C", "_dynamo", "_guards", "_decomp", "_prims_common",
    "_python_dispatch", "_mode_utils", "_subclasses", "_meta_registrations", "_library", "_inductor", "_tensor",
    "_get_current_dispatch_mode", "_disable_current_modes", "_fields", "_asdict", "_replace", "_make",
    "_get_tracing_state", "_thread_local", "_cached_len", "_graph", "_out_spec", "_in_spec", "_codegen",
    "_is_fx_tracing", "_lazy_init", "_initialized", "_to_functional_tensor", "_from_functional_tensor",
    "_sync", "_is_functional_tensor", "_enable_functionalization", "_disable_functionalization", "_foreach_add_",
    "_unsafe_view", "_foreach_mul_", "_foreach_addcdiv_", "_foreach_addcmul_", "_foreach_sqrt", "_foreach_div_",
    "_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "_log_softmax", "_log_softmax_backward_data", "_softmax",
    "_softmax_backward_data", "_to_copy", "_optimizer_step_code", "_cuda_getDeviceCount", "_debug_set_autodiff_subgraph_inlining",
    "_is_compiling_flag", "_is_exporting_flag",  # torch.compiler's flags, set as torch.export sets them
    "_exit_code", "_stacklevel", "_record_function_enter", "_pin_memory", "_use_new_zipfile_serialization",
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> list[tuple[str, pathlib.Path, ast.Module]]:
    return [(_module_name(p), p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def _imports(module: str, path: pathlib.Path, tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names) for every import of ``tree``, relative ones resolved."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [a.name for a in node.names]
            found.append((node.lineno, base, names))
            found.extend((node.lineno, f"{base}.{n}", []) for n in names)  # `from pkg import submodule`
    return found


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


SOURCES = _sources()


def _violations(rule) -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
            for module, path, tree in SOURCES for line, target, names in _imports(module, path, tree)
            if rule(module, target, names)]


def test_the_scan_sees_the_package():
    modules = {m for m, _, _ in SOURCES}
    assert {"ipuxl.ir.graph", "ipuxl.ops.call", "ipuxl.passes.autodiff", "ipuxl.device.session"} <= modules
    # the rules below hold for a reason, not because nothing was read
    assert any(t.startswith("ipuxl.ir") for m, p, tree in SOURCES if m == "ipuxl.passes.autodiff"
               for _, t, _ in _imports(m, p, tree))


def test_ir_and_ops_import_nothing_above_them():
    def rule(module, target, names):
        return _within(module, ("ipuxl.ir", "ipuxl.ops", "ipuxl.kernels")) and _within(target, UPPER)

    assert _violations(rule) == []


def test_only_the_front_ends_import_the_front_ends():
    def rule(module, target, names):
        return (_within(target, FRONT_ENDS) and not _within(module, (*FRONT_ENDS, *ALIASES))
                and module not in FACADES)

    assert _violations(rule) == []


def test_nothing_imports_the_compat_aliases():
    assert _violations(lambda m, t, n: _within(t, ALIASES) and not _within(m, ALIASES)) == []


def test_passes_do_not_import_the_device():
    assert _violations(lambda m, t, n: _within(m, ("ipuxl.passes",)) and _within(t, ("ipuxl.device", *FRONT_ENDS))) == []


def _compile_imports_runtime(module: str, target: str, names: list[str]) -> bool:
    return _within(module, POPTORCH_COMPILE) and _within(target, POPTORCH_RUNTIME)


def _namespace_imports_compile_or_runtime(module: str, target: str, names: list[str]) -> bool:
    namespace = _within(module, (POPTORCH,)) and module != POPTORCH \
        and not _within(module, (*POPTORCH_COMPILE, *POPTORCH_RUNTIME))
    return namespace and _within(target, (*POPTORCH_COMPILE, *POPTORCH_RUNTIME))


def test_the_scan_sees_poptorchs_compiler_and_runtime():
    """The two rules below read real modules: both packages are there, and the runtime
    does import the compiler (the direction the rules allow)."""
    modules = {m for m, _, _ in SOURCES}
    assert {"ipuxl.poptorch_compat.compile.compile_model", "ipuxl.poptorch_compat.compile.program"} <= modules
    assert {"ipuxl.poptorch_compat.runtime.executor", "ipuxl.poptorch_compat.runtime.weights"} <= modules
    assert {"ipuxl.poptorch_compat.options", "ipuxl.poptorch_compat.blocks"} <= modules
    assert any(_within(t, POPTORCH_COMPILE) for m, p, tree in SOURCES if _within(m, POPTORCH_RUNTIME)
               for _, t, _ in _imports(m, p, tree))
    assert any(_within(t, (POPTORCH,)) for m, p, tree in SOURCES if _within(m, POPTORCH_COMPILE)
               for _, t, _ in _imports(m, p, tree))


def test_poptorchs_compiler_does_not_import_its_runtime():
    """The compiler produces a program; the runtime runs it (never the other way round)."""
    assert _violations(_compile_imports_runtime) == []


def test_poptorchs_namespace_imports_neither_compiler_nor_runtime():
    """``options``, ``blocks``, ``ops``... are what the user writes; the package's
    ``__init__`` (PopTorch's lazy namespace) may name anything."""
    assert _violations(_namespace_imports_compile_or_runtime) == []


def test_the_poptorch_rules_catch_a_violation():
    bad = ast.parse("from ipuxl.poptorch_compat.runtime.weights import HostSlots\n"
                    "import ipuxl.poptorch_compat.compile.program\n")
    compile_module = ("ipuxl.poptorch_compat.compile.bad", PACKAGE / "poptorch_compat" / "compile" / "bad.py")
    namespace_module = ("ipuxl.poptorch_compat.bad", PACKAGE / "poptorch_compat" / "bad.py")
    assert any(_compile_imports_runtime(compile_module[0], t, n) for _, t, n in _imports(*compile_module, bad))
    assert any(_namespace_imports_compile_or_runtime(namespace_module[0], t, n)
               for _, t, n in _imports(*namespace_module, bad))
    runtime_module = ("ipuxl.poptorch_compat.runtime.ok", PACKAGE / "poptorch_compat" / "runtime" / "ok.py")
    assert not any(_compile_imports_runtime(runtime_module[0], t, n) for _, t, n in _imports(*runtime_module, bad))


def test_capture_does_not_import_the_poptorch_wrappers():
    assert _violations(lambda m, t, n: _within(m, ("ipuxl.capture",)) and _within(t, FRONT_ENDS)) == []


def test_no_module_imports_another_modules_private_names():
    def rule(module, target, names):
        return target.startswith("ipuxl") and any(n.startswith("_") and not n.startswith("__") for n in names)

    assert _violations(rule) == []


def _own_attributes(tree: ast.Module) -> set[str]:
    """Names a module defines itself: its functions, classes, and attributes it assigns."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
    return own


def test_no_module_reads_another_modules_private_attributes():
    found = []
    for module, path, tree in SOURCES:
        own = _own_attributes(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if node.attr in own or node.attr in FOREIGN_PRIVATES:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} reads .{node.attr}")
    assert found == []


def test_the_checks_catch_a_violation(tmp_path):
    """The rules above can fail: an upward import and a private read are seen."""
    bad = ast.parse("from ipuxl.device.session import _x\nimport ipuxl.passes\ny = obj._secret\n")
    targets = [(t, n) for _, t, n in _imports("ipuxl.ir.bad", PACKAGE / "ir" / "bad.py", bad)]
    assert ("ipuxl.passes", []) in targets and ("ipuxl.device.session", ["_x"]) in targets
    assert "_secret" not in _own_attributes(bad) and "_secret" not in FOREIGN_PRIVATES


@pytest.mark.parametrize("module, absent", [
    ("ipuxl.ops", ("ipuxl.device", "ipuxl.passes", "ipuxl.capture", *FRONT_ENDS)),
    ("ipuxl.ir", ("ipuxl.device", "ipuxl.passes", "ipuxl.capture", *FRONT_ENDS)),
    ("ipuxl.passes", ("ipuxl.device", *FRONT_ENDS)),
    ("ipuxl", ("ipuxl.compat",)),
])
def test_importing_a_layer_loads_nothing_above_it(module, absent):
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert module in loaded
    assert [m for m in loaded if _within(m, absent)] == []
