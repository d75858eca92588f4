"""PopXL-style ops. Each builds one fx node in the current graph (``ipuxl.gcg()``)."""
from ipuxl.ops import collectives, var_updates
from ipuxl.ops.call import CallSiteInfo, call, call_with_info, repeat, repeat_with_info
from ipuxl.ops.elementwise import (
    abs, add, add_, ceil, clip, cos, div, equal, exp, floor, fmod, gelu, greater, isinf, isnan, less, log,
    logical_and, logical_not, logical_or, maximum, minimum, mul, negate, pow, relu, scaled_add, scaled_add_,
    sigmoid, sign, sin, sqrt, sub, swish, tanh, where,
)
from ipuxl.ops.host import host_load, host_store
from ipuxl.ops.nn import (
    average_pool, conv, layer_norm, log_softmax, matmul, max_pool, nll_loss, nll_loss_with_softmax_grad, softmax,
)
from ipuxl.ops.random import create_seeds, dropout, random_normal, random_uniform, split_random_seed
from ipuxl.ops.reduce import (
    argmax, argmin, l1, l2, lamb_square, logsumexp, max, mean, min, prod, reduce_max, reduce_mean, reduce_min,
    reduce_sum, sum, sumsquare,
)
from ipuxl.ops.shape import (
    cast, concat, detach, flatten, gather, getitem, identity, onehot, reshape, slice, split, squeeze, transpose,
    unsqueeze,
)
# in-place variants, indexing, vision, conditional...
from ipuxl.ops.elementwise import (
    clamp, exp_, gelu_, geluerf, geluerf_, increment_mod, increment_mod_, isfinite, log2, relu_, swish_,
)
from ipuxl.ops.reduce import cumsum, logsum, median
from ipuxl.ops.conv import PadType, conv_transpose
from ipuxl.ops.nn import batch_norm_inference, group_norm
from ipuxl.ops.random import shaped_dropout
from ipuxl.ops.debug import init, print_tensor
from ipuxl.ops.conditional import ConditionalSiteInfo, conditional, conditional_with_info
from ipuxl.ops.vision import interpolate, roi_align
from ipuxl.ops.indexing import (
    dynamic_slice, dynamic_update, dynamic_update_, histogram, scatter, scatter_reduce, tied_gather, topk,
)
from ipuxl.ops.shape import concat_, detach_, flatten_, reshape_, slice_, subsample, transpose_
from ipuxl.ops.ipu_copy import io_tile_copy, ipu_copy  # several IPUs
from ipuxl.ops.remote import remote_code_load, remote_load, remote_load_, remote_store  # Streaming Memory
from ipuxl.ops.float8 import (  # float8
    conv_pow2scaled, conv_transpose_pow2scaled, matmul_pow2scaled, pow2scale_cast_from_fp8, pow2scale_cast_to_fp8,
)

__all__ = [
    "collectives", "var_updates", "CallSiteInfo", "call", "call_with_info", "repeat", "repeat_with_info",
    "abs", "add", "add_", "ceil", "clip", "cos", "div", "equal", "exp", "floor", "fmod", "gelu", "greater",
    "isinf", "isnan", "less", "log", "logical_and", "logical_not", "logical_or", "maximum", "minimum", "mul",
    "negate", "pow", "relu", "scaled_add", "scaled_add_", "sigmoid", "sign", "sin", "sqrt", "sub", "swish",
    "tanh", "where", "host_load", "host_store", "average_pool", "conv", "layer_norm", "log_softmax", "matmul",
    "max_pool", "nll_loss", "nll_loss_with_softmax_grad", "softmax", "create_seeds", "dropout", "random_normal",
    "random_uniform", "split_random_seed", "argmax", "argmin", "l1", "l2", "lamb_square", "logsumexp", "max",
    "mean", "min", "prod", "reduce_max", "reduce_mean", "reduce_min", "reduce_sum", "sum", "sumsquare", "cast",
    "concat", "detach", "flatten", "gather", "getitem", "identity", "onehot", "reshape", "slice", "split",
    "squeeze", "transpose", "unsqueeze",
    # in-place variants, indexing, vision, conditional...
    "clamp", "isfinite", "exp_", "relu_", "gelu_", "swish_", "geluerf", "geluerf_", "log2", "increment_mod",
    "increment_mod_", "logsum", "median", "cumsum", "reshape_", "flatten_", "transpose_", "concat_", "slice_",
    "subsample", "detach_", "conv_transpose", "PadType", "dynamic_slice", "dynamic_update", "dynamic_update_",
    "histogram", "scatter", "scatter_reduce", "tied_gather", "topk", "batch_norm_inference", "group_norm",
    "interpolate", "roi_align", "shaped_dropout", "init", "print_tensor", "ConditionalSiteInfo", "conditional",
    "conditional_with_info",
    # several IPUs
    "ipu_copy", "io_tile_copy",
    # Streaming Memory
    "remote_load", "remote_load_", "remote_store", "remote_code_load",
    # float8
    "pow2scale_cast_to_fp8", "pow2scale_cast_from_fp8", "matmul_pow2scaled", "conv_pow2scaled",
    "conv_transpose_pow2scaled",
]
