"""The package's walls: which ipuxl packages may import which, read off the source.

Layers, bottom up: ``errors``/``dtypes`` -> ``ir`` (data, construction, aliases, calls)
and ``ops``/``kernels`` -> ``passes`` -> ``device`` -> the front ends
(``capture`` + ``poptorch_compat``, ``addons_compat``). A module may import its own
layer and the ones below. Every import counts, including one inside a function.

Inside ``poptorch_compat``, the same shape: PopTorch's namespace modules (its top level)
-> ``compile`` (the compiler makes a program) -> ``runtime`` (which runs it).

Beside the import walls, four rules about what code may do where (docs/architecture.md,
"The walls"): only ``ir/`` copies nodes between graphs or writes alias records (so a
copy never keeps records naming another graph's nodes); ``from X import name`` names
something in X's ``__all__`` (a module's ``__all__`` is what other modules may use);
functions that nodes call as targets (kernels) are defined in ``kernels/``. Each rule
is a function of the source, and each has a test that feeds it a violation.
"""
from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import ipuxl
from ipuxl.ir import copy as ir_copy
from ipuxl.ir import meta as ir_meta

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
    "_native_batch_norm_legit_no_training", "_unsafe_index", "_log_softmax", "_log_softmax_backward_data", "_softmax",
    "_softmax_backward_data", "_to_copy", "_optimizer_step_code", "_cuda_getDeviceCount", "_debug_set_autodiff_subgraph_inlining",
    "_is_compiling_flag", "_is_exporting_flag",  # torch.compiler's flags, set as torch.export sets them
    "_DisableFuncTorch", "_get_node_type", "_scaled_dot_product_attention_math",  # torch internals capture leans on
    "_exit_code", "_stacklevel", "_record_function_enter", "_pin_memory", "_use_new_zipfile_serialization",
    "_DisableFuncTorch",  # known values: plain eager computation inside a functionalized trace
    "_scaled_dot_product_attention_math",  # attention whose mask needs a gradient: aten's math kernel
    "_get_node_type",  # pytree's node type of an object (is it a container pytree flattens?)
    "_dispatch_has_kernel_for_dispatch_key",  # whether an op's out= form has a device kernel (memory plan)
    # the CPU's fused attention a host trace records, replaced on other devices (device.retarget)
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    # CUDA's fused attention they become there (kernels.fused_attention)
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_local_scalar_dense",  # aten's read of a tensor's value on the host (refused in a CUDA graph capture)
    # a torch.library.custom_op's registered formula, and calling an op below autograd (kernels.custom_ops)
    "_setup_context_fn", "_backward_fn", "_AutoDispatchBelowAutograd",
    # aten's runtime checks, kept as ops (capture.runtime_checks, device.rewrites.dead_code)
    "_assert_async", "_assert_scalar",
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


# -- only ir/ copies nodes between graphs and writes alias records ------------------------------------------
#: The meta keys that name nodes or inputs a node writes or aliases (``ir.copy`` remaps them).
ALIAS_KEYS = {name: getattr(ir_meta, name) for name in ("MODIFIES", "VIEW_OF", "WRITES", "BY_REF_ARGS")}
assert set(ALIAS_KEYS.values()) == {*ir_copy.NODE_RECORDS, ir_meta.BY_REF_ARGS}  # the list ir.copy keeps
IR = ("ipuxl.ir",)
#: Code outside ir/ that copies nodes with fx's ``node_copy``, and why that is not an IR copy.
NODE_COPIES_ALLOWED = {
    # labelled copies of compiled code (plain fx after lowering, never an IR graph again): its
    # alias records are lowering's, named as ir.lower left them
    "ipuxl/device/profile.py",
}
#: Code outside ir/ that writes alias records, the keys it writes, and why: each builds the node
#: it records on (in its own graph), so nothing is copied.
ALIAS_WRITES_ALLOWED = {
    # ops.call's CallSiteInfo.set_parent_input_modified: a call made by reference records what it writes
    ("ipuxl/ops/call.py", "BY_REF_ARGS"), ("ipuxl/ops/call.py", "WRITES"),
    # PopXL's in-place view ops (reshape_, transpose_...): the new result is an in-place result of its input
    ("ipuxl/ops/shape.py", "MODIFIES"), ("ipuxl/ops/shape.py", "VIEW_OF"),
    # outlining makes the call of a region: the call writes by reference what the region wrote
    ("ipuxl/passes/outline.py", "BY_REF_ARGS"), ("ipuxl/passes/outline.py", "WRITES"),
}


def _alias_key(node: ast.expr | None) -> str | None:
    """The alias key ``node`` names (``MODIFIES``, ``meta.MODIFIES``, ``"ipuxl_modifies"``), if any."""
    if isinstance(node, ast.Name) and node.id in ALIAS_KEYS:
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in ALIAS_KEYS:
        return node.attr
    if isinstance(node, ast.Constant) and node.value in ALIAS_KEYS.values():
        return next(k for k, v in ALIAS_KEYS.items() if v == node.value)
    return None


def _is_meta(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "meta"


def _node_copies(tree: ast.Module) -> list[int]:
    """Lines that copy fx nodes: ``graph.node_copy(...)`` / ``graph.graph_copy(...)``."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("node_copy", "graph_copy")]


def _alias_writes(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, key) of every write of an alias record: ``x.meta[KEY] = / del``, and
    ``x.meta.setdefault/pop/__setitem__(KEY, ...)`` or ``x.meta.update({KEY: ...})``."""
    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            if isinstance(target, ast.Subscript) and _is_meta(target.value) and (key := _alias_key(target.slice)):
                found.append((node.lineno, key))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_meta(node.func.value):
            if node.func.attr in ("setdefault", "pop", "__setitem__", "__delitem__") and node.args:
                if key := _alias_key(node.args[0]):
                    found.append((node.lineno, key))
            elif node.func.attr == "update" and node.args and isinstance(node.args[0], ast.Dict):
                found.extend((node.lineno, key) for key in map(_alias_key, node.args[0].keys) if key)
    return sorted(found)


def _relative(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _copies_outside_ir(module: str, path: pathlib.Path, tree: ast.Module) -> list[str]:
    if _within(module, IR) or _relative(path) in NODE_COPIES_ALLOWED:
        return []
    return [f"{_relative(path)}:{line} copies nodes" for line in _node_copies(tree)]


def _alias_writes_outside_ir(module: str, path: pathlib.Path, tree: ast.Module) -> list[str]:
    if _within(module, IR):
        return []
    return [f"{_relative(path)}:{line} writes {key}" for line, key in _alias_writes(tree)
            if (_relative(path), key) not in ALIAS_WRITES_ALLOWED]


def test_only_the_ir_copies_nodes_between_graphs():
    """``ir.copy.copy_node`` is the one copier (it remaps alias records); a plain fx copy elsewhere
    would keep records naming the old graph's nodes."""
    assert [v for m, p, t in SOURCES for v in _copies_outside_ir(m, p, t)] == []
    # the scan sees real copies: ir's own, and the allowed one (which is still there)
    assert _node_copies(dict((m, t) for m, _, t in SOURCES)["ipuxl.ir.copy"])
    assert all(_node_copies(next(t for _, p, t in SOURCES if _relative(p) == path)) for path in NODE_COPIES_ALLOWED)


def test_only_the_ir_writes_alias_records():
    assert [v for m, p, t in SOURCES for v in _alias_writes_outside_ir(m, p, t)] == []
    seen = {(_relative(p), key) for _, p, t in SOURCES for _, key in _alias_writes(t)}
    assert ALIAS_WRITES_ALLOWED <= seen  # every allowance is still used (a stale one is removed)
    assert {key for path, key in seen if path.startswith("ipuxl/ir/")} == set(ALIAS_KEYS)  # ir writes them all


def test_the_copy_and_alias_rules_catch_a_violation():
    bad = ast.parse("new = graph.node_copy(node, env.__getitem__)\n"
                    "new.meta[MODIFIES] = env[old]\n"
                    "new.meta.setdefault(meta.WRITES, []).append(x)\n"
                    "new.meta.update({'ipuxl_view_of': y, 'val': v})\n"
                    "del new.meta[BY_REF_ARGS]\n"
                    "new.meta['val'] = v\n")
    path = PACKAGE / "passes" / "bad.py"
    assert _copies_outside_ir("ipuxl.passes.bad", path, bad) == ["ipuxl/passes/bad.py:1 copies nodes"]
    assert _alias_writes_outside_ir("ipuxl.passes.bad", path, bad) == [
        "ipuxl/passes/bad.py:2 writes MODIFIES", "ipuxl/passes/bad.py:3 writes WRITES",
        "ipuxl/passes/bad.py:4 writes VIEW_OF", "ipuxl/passes/bad.py:5 writes BY_REF_ARGS"]
    assert _copies_outside_ir("ipuxl.ir.bad", PACKAGE / "ir" / "bad.py", bad) == []
    assert _alias_writes_outside_ir("ipuxl.ir.bad", PACKAGE / "ir" / "bad.py", bad) == []


# -- an import names something in its target's __all__ ------------------------------------------------------
def _static_all(tree: ast.Module) -> list[str] | None:
    """A module's ``__all__`` when its source spells it out (``=``, ``+=``), else None."""
    names: list[str] | None = None
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                try:
                    value = list(ast.literal_eval(node.value))
                except ValueError:
                    return None
                names = (names or []) + value if isinstance(node, ast.AugAssign) else value
    return names


def _exports() -> dict[str, set[str] | None]:
    """Each module's ``__all__`` (read from the source; a computed one from the module itself);
    None for a module without one."""
    out: dict[str, set[str] | None] = {}
    for module, _, tree in SOURCES:
        names = _static_all(tree)
        if names is None and any(isinstance(n, (ast.Assign, ast.AugAssign)) and "__all__" in ast.unparse(n).split("=")[0]
                                 for n in tree.body):
            names = list(importlib.import_module(module).__all__)  # computed (``sorted(_LAZY)``)
        out[module] = set(names) if names is not None else None
    return out


EXPORTS = _exports()


def _names_outside_all(module: str, target: str, names: list[str]) -> list[str]:
    """The names of ``from target import names`` that ``target`` does not export (submodules are
    modules, not names)."""
    if not _within(target, ("ipuxl",)) or target not in EXPORTS:
        return []
    exported = EXPORTS[target] or set()
    return [n for n in names if n not in exported and f"{target}.{n}" not in EXPORTS]


def test_imports_name_what_their_module_exports():
    """A module's ``__all__`` is what other modules may import from it; importing another name
    reaches past it (add the name to ``__all__``, or import it from the module that defines it)."""
    found = [f"{_relative(path)}:{line} imports {n} from {target}"
             for module, path, tree in SOURCES for line, target, names in _imports(module, path, tree)
             for n in _names_outside_all(module, target, names)]
    assert found == []


def test_the_all_rule_catches_a_violation():
    assert EXPORTS["ipuxl.ir.aliases"] and "storage_owner" in EXPORTS["ipuxl.ir.aliases"]
    assert "Options" in (EXPORTS["ipuxl.poptorch_compat"] or set())  # a computed __all__ is read too
    bad = ast.parse("from ipuxl.ir.aliases import storage_owner, secret\nfrom ipuxl.ir import copy\n")
    found = [n for _, t, names in _imports("ipuxl.passes.bad", PACKAGE / "passes" / "bad.py", bad)
             for n in _names_outside_all("ipuxl.passes.bad", t, names)]
    assert found == ["secret"]  # not storage_owner (exported), not copy (a submodule)


# -- kernels live in kernels/ ---------------------------------------------------------------------------------
#: Where nodes are built that call kernels: ops (PopXL's), addons' ops, the device's rewrites.
NODE_BUILDERS = ("ipuxl.ops", "ipuxl.addons_compat.ops", "ipuxl.device.rewrites")
#: Kernels still defined beside the op that records them, and why.
KERNELS_ALLOWED = {
    # popxl.addons' own ops: their kernels are written with the op in the addons front end
    ("ipuxl/addons_compat/ops/grad_reduce_square_add.py", "_reduce_square_add"),
    ("ipuxl/addons_compat/ops/group_quantize_decompress.py", "_decompress"),
    ("ipuxl/addons_compat/ops/rotary_pos_embed.py", "_rotate"),
}


def _kernels_defined_in(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of functions of a module's top level that take torch tensors and are passed
    as a value to a call (``emit(name, kernel, ...)``, a factory ``_unary_(name, kernel)``):
    kernels. ``meta_fn=`` functions compute shapes at build time and are not kernels."""
    over_tensors = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)
                    and any(a.annotation is not None and "torch.Tensor" in ast.unparse(a.annotation)
                            for a in f.args.args + f.args.kwonlyargs)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            values = [*node.args, *(k.value for k in node.keywords if k.arg != "meta_fn")]
            found.extend((a.lineno, a.id) for a in values if isinstance(a, ast.Name) and a.id in over_tensors)
    return found


def _kernels_outside_kernels(module: str, path: pathlib.Path, tree: ast.Module) -> list[str]:
    if not _within(module, NODE_BUILDERS):
        return []
    return [f"{_relative(path)}:{line} defines the kernel {name}" for line, name in _kernels_defined_in(tree)
            if (_relative(path), name) not in KERNELS_ALLOWED]


def test_kernels_live_in_kernels():
    """``ops/X`` builds nodes that call ``kernels/Y`` functions (and so do addons' ops and the
    device's rewrites); they define no kernels of their own. tests/kernels/test_kernel_targets.py
    checks the same on the targets of real programs."""
    assert [v for m, p, t in SOURCES for v in _kernels_outside_kernels(m, p, t)] == []
    seen = {(_relative(p), name) for _, p, t in SOURCES for _, name in _kernels_defined_in(t)}
    assert KERNELS_ALLOWED <= seen  # every allowance is still used


def test_the_kernel_rule_catches_a_violation():
    bad = ast.parse("import torch\n\ndef _k(x: torch.Tensor) -> torch.Tensor:\n    return x\n\n"
                    "def op(t):\n    return emit('k', _k, (t,), meta_fn=_k)\n")
    assert _kernels_defined_in(bad) == [(7, "_k")]
    assert _kernels_outside_kernels("ipuxl.ops.bad", PACKAGE / "ops" / "bad.py", bad) == [
        "ipuxl/ops/bad.py:7 defines the kernel _k"]
    assert _kernels_outside_kernels("ipuxl.kernels.bad", PACKAGE / "kernels" / "bad.py", bad) == []
