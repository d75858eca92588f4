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
]
