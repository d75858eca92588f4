"""Which ipuxl module stands for each module of PopXL, popxl.addons, PopTorch, PopDist and PopART.

Five tables, one per upstream package, map an upstream module path to the ipuxl
module that provides its names (``None``: upstream has the module, ipuxl does not
yet). A ``popxl`` or ``popxl_addons`` path missing from its table maps by name
(``popxl.X`` -> ``ipuxl.X``, ``popxl_addons.X`` -> ``ipuxl.addons_compat.X``); ``poptorch`` is
``ipuxl.poptorch_compat`` (PopTorch's own namespace, apart from PopXL's) and only its
listed paths exist. ``popxl.ops.<file>`` (PopXL has one file per op) maps to the ipuxl
module that defines the op named in ``OP_FILES``, found when imported. ``popdist`` is
``ipuxl.popdist`` (its paths map by name); ``popart`` is ``ipuxl.popart_compat``, the few
PopART names programs use, and only its listed paths exist (``popart._internal``,
PopART's C++ IR, cannot).
"""
from __future__ import annotations

__all__ = ["POPXL", "POPXL_ADDONS", "POPTORCH", "POPDIST", "POPART", "TABLES", "LISTED_ONLY", "OP_FILES", "ROOTS",
           "PACKAGE_NAMES"]

#: upstream top-level package -> the ipuxl module it is
ROOTS: dict[str, str] = {"popxl": "ipuxl", "popxl_addons": "ipuxl.addons_compat", "poptorch": "ipuxl.poptorch_compat",
                         "popdist": "ipuxl.popdist", "popart": "ipuxl.popart_compat"}

#: upstream top-level package -> its name in messages
PACKAGE_NAMES: dict[str, str] = {"popxl": "PopXL", "popxl_addons": "popxl.addons", "poptorch": "PopTorch",
                                 "popdist": "PopDist", "popart": "PopART"}

#: packages of which only the listed paths exist (others are not mapped by name)
LISTED_ONLY = ("poptorch", "popart")

POPXL: dict[str, str | None] = {
    "popxl.context": "ipuxl.ir.context",
    "popxl.dtypes": "ipuxl.dtypes",
    "popxl.errors": "ipuxl.errors",
    "popxl.graph": "ipuxl.ir.graph",
    "popxl.ir": "ipuxl.ir",
    "popxl.module": "ipuxl.ir.graph_builder",
    "popxl.random_seed": "ipuxl.ops.random",
    "popxl.replica_grouping": "ipuxl.ir.replica_grouping",
    "popxl.session": "ipuxl.device.session",
    "popxl.streams": "ipuxl.ir.streams",
    "popxl.tensor": "ipuxl.tensor",
    "popxl.utils": "ipuxl.utils",
    "popxl.transforms": "ipuxl.transforms",
    "popxl.transforms.autodiff": "ipuxl.transforms",
    "popxl.ops": "ipuxl.ops",
    "popxl.ops.collectives": "ipuxl.ops.collectives",
    "popxl.ops.collectives.collectives": "ipuxl.ops.collectives",
    "popxl.ops.collectives.all_reduce": "ipuxl.ops.collectives",
    "popxl.ops.collectives.replicated_all_gather": "ipuxl.ops.collectives",
    "popxl.ops.collectives.replicated_all_reduce": "ipuxl.ops.collectives",
    "popxl.ops.collectives.replicated_reduce_scatter": "ipuxl.ops.collectives",
    "popxl.ops.var_updates": "ipuxl.ops.var_updates",
    "popxl.ops.var_updates.accumulate": "ipuxl.ops.var_updates",
    "popxl.ops.var_updates.adam_updater": "ipuxl.ops.var_updates",
    "popxl.ops.var_updates.adam_var_update": "ipuxl.ops.var_updates",
    "popxl.ops.var_updates.copy_var_update": "ipuxl.ops.var_updates",
    "popxl.ops.var_updates.utils": "ipuxl.ops.var_updates",
    "popxl.ops.utils": "ipuxl.ops.utils",
    "popxl.fp8_utils": "ipuxl.fp8_utils",
    "popxl.remote_buffer": "ipuxl.ir.remote",  # Streaming Memory
    "popxl.tensorlocation": "ipuxl.ir.remote",
    "popxl.ops.collectives.replica_sharded_slice": "ipuxl.ops.collectives",
    "popxl.ops.collectives.replicated_slice": "ipuxl.ops.collectives",
    "popxl.transforms.merge_exchange": "ipuxl.transforms",
    "popxl.transforms.io_tile_exchange": "ipuxl.transforms",
    "popxl.transforms.decompose_sum": "ipuxl.transforms",
}

#: PopXL's op files (``popxl/ops/<file>.py``) -> an op each defines
OP_FILES: dict[str, str] = {
    "abs": "abs", "add": "add", "argminmax": "argmax", "batch_norm": "batch_norm_inference", "call": "call",
    "cast": "cast", "ceil": "ceil", "clip": "clip", "code_copy": "remote_code_load", "concat": "concat",
    "conditional": "conditional", "conv": "conv", "cos": "cos", "cumsum": "cumsum", "detach": "detach",
    "div": "div", "dropout": "dropout", "dynamic_slice": "dynamic_slice", "dynamic_update": "dynamic_update",
    "equal": "equal", "exp": "exp", "floor": "floor", "fmod": "fmod", "gather": "gather", "gelu": "gelu",
    "geluerf": "geluerf", "greater": "greater", "group_norm": "group_norm", "histogram": "histogram",
    "host_load": "host_load", "host_store": "host_store", "identity": "identity", "increment_mod": "increment_mod",
    "init": "init", "interpolate": "interpolate", "io_tile_copy": "io_tile_copy", "ipu_copy": "ipu_copy",
    "isfinite": "isfinite", "isinf": "isinf", "isnan": "isnan", "l1": "l1", "l2": "l2", "lamb": "lamb_square",
    "log": "log", "logical_and": "logical_and", "logical_not": "logical_not", "logical_or": "logical_or",
    "logsum": "logsum", "logsumexp": "logsumexp", "matmul": "matmul", "max": "max", "mean": "mean",
    "median": "median", "min": "min", "mul": "mul", "negate": "negate", "negative_log_likelihood": "nll_loss",
    "onehot": "onehot", "pool": "max_pool", "pow": "pow", "print_tensor": "print_tensor", "prod": "prod",
    "random": "random_normal", "random_seed": "split_random_seed", "relu": "relu", "remote_load": "remote_load",
    "remote_store": "remote_store", "repeat": "repeat", "reshape": "reshape", "roialign": "roi_align",
    "scaled_add": "scaled_add", "scatter": "scatter", "scatter_reduce": "scatter_reduce",
    "shaped_dropout": "shaped_dropout", "sign": "sign", "sin": "sin", "slice": "slice", "softmax": "softmax",
    "split": "split", "sqrt": "sqrt", "squeeze": "squeeze", "sub": "sub", "subsample": "subsample", "sum": "sum",
    "sumsquare": "sumsquare", "swish": "swish", "tanh": "tanh", "topk": "topk", "transpose": "transpose",
    "where": "where",
}

POPXL_ADDONS: dict[str, str | None] = {
    "popxl_addons.layers.linear_fp8": "ipuxl.addons_compat.layers.linear_fp8",
    "popxl_addons.ops.cross_entropy": "ipuxl.addons_compat.ops",
    "popxl_addons.ops.replicated_all_reduce_TP.replicated_all_reduce_TP":
        "ipuxl.addons_compat.ops.replicated_all_reduce_TP",
    "popxl_addons.ops.cross_entropy_sharded_loss.cross_entropy_sharded_loss":
        "ipuxl.addons_compat.ops.cross_entropy_sharded_loss",
    "popxl_addons.ops.cross_entropy_sharded_wr_loss": "ipuxl.addons_compat.ops.cross_entropy_sharded_wr_loss",
    "popxl_addons.ops.cross_entropy_sharded_wr_loss.cross_entropy_sharded_wr_loss":
        "ipuxl.addons_compat.ops.cross_entropy_sharded_wr_loss",
    "popxl_addons.ops.layer_norm_distributed.layer_norm_distributed":
        "ipuxl.addons_compat.ops.layer_norm_distributed",
    "popxl_addons.ops.rotary_pos_embed.rotary_pos_embed": "ipuxl.addons_compat.ops.rotary_pos_embed",
    "popxl_addons.ops.grad_reduce_square_add.grad_reduce_square_add": "ipuxl.addons_compat.ops.grad_reduce_square_add",
    "popxl_addons.ops.group_quantize_decompress.group_quantize_decompress":
        "ipuxl.addons_compat.ops.group_quantize_decompress",
    "popxl_addons.ops.replicated_strided_collectives.replicated_all_gather_strided":
        "ipuxl.addons_compat.ops.replicated_strided_collectives",
    "popxl_addons.ops.replicated_strided_collectives.replicated_reduce_scatter_strided":
        "ipuxl.addons_compat.ops.replicated_strided_collectives",
    "popxl_addons.ops.replicated_strided_collectives.replicated_all_reduce_strided":
        "ipuxl.addons_compat.ops.replicated_strided_collectives",
    "popxl_addons.ops.fp8_amax_scale": "ipuxl.addons_compat.ops.fp8_amax_scale",
    "popxl_addons.ops.fp8_mse_scale": "ipuxl.addons_compat.ops.fp8_mse_scale",
    "popxl_addons.ops.fp8_mse_scale.fp8_mse_scale": "ipuxl.addons_compat.ops.fp8_mse_scale",
    "popxl_addons.ops.fp8_utils": "ipuxl.addons_compat.ops.fp8_utils",
    "popxl_addons.ops.static_sparse_ops": None,
    "popxl_addons.ops.linear_layout": None,
    "popxl_addons.debugging": None,
    "popxl_addons.graph_common": None,
    "popxl_addons.input_factory": None,
    "popxl_addons.remote": "ipuxl.addons_compat.remote",
    "popxl_addons.route_tensor": "ipuxl.addons_compat.route_tensor",
    "popxl_addons.rts": "ipuxl.addons_compat.rts",
    "popxl_addons.transforms.batch_serialisation": "ipuxl.addons_compat.transforms.batch_serialisation",
    "popxl_addons.transforms.phased": None,
    "popxl_addons.transforms.pipelining": "ipuxl.addons_compat.transforms.pipelining",
    "popxl_addons.transforms.use_fc_pass": None,
}

POPTORCH: dict[str, str | None] = {
    "poptorch.enums": "ipuxl.poptorch_compat.enums",
    "poptorch.options": "ipuxl.poptorch_compat.options",
    "poptorch.optim": "ipuxl.poptorch_compat.optim",
    "poptorch.ops": "ipuxl.poptorch_compat.ops",
    "poptorch.logging": "ipuxl.poptorch_compat.poptorch_logging",
    "poptorch._logging": "ipuxl.poptorch_compat.poptorch_logging",
    "poptorch._poplar_executor": "ipuxl.poptorch_compat.runtime.executor",
    "poptorch._dataloader": "ipuxl.poptorch_compat.dataloader",
    "poptorch._impl": "ipuxl.poptorch_compat.wrapping",
    "poptorch.autocasting": None,
    "poptorch.distributed": None,
    "poptorch.eager": None,
    "poptorch.experimental": None,
    "poptorch.profiling": None,
    "poptorch.testing": None,
    "poptorch.poptorch_core": "ipuxl.poptorch_compat.poptorch_core",
}

POPDIST: dict[str, str | None] = {
    "popdist.popart": "ipuxl.popdist.popart",
    "popdist.poptorch": "ipuxl.popdist.poptorch",
    "popdist.tensorflow": None,
}

POPART: dict[str, str | None] = {
    "popart._internal": None,  # PopART's C++ IR: no reimplementation can provide it
    "popart._internal.ir": None,
}

#: every table, for lookups across them
TABLES: tuple[dict[str, str | None], ...] = (POPXL, POPXL_ADDONS, POPTORCH, POPDIST, POPART)
