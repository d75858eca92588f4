"""torch's random functions in a captured module, drawn from the model's seed as in PopTorch.

PopTorch runs ``torch.rand``, ``randn``, ``normal``, ``bernoulli``, ``Tensor.uniform_``...
on the device, from the generator that ``Options.randomSeed`` seeds: each device
iteration, micro-batch and replica draws new numbers, and a seed gives the same
numbers again. While a module is captured (and in ``DropoutReplay``), each call of
a function in ``RANDOM_FUNCTIONS`` is replaced by a draw from a seeded
``torch.ops.ipuxl`` op (``kernels.random``): the k-th draw of a module, dropouts
included, uses ``modify_seed(seed, k)`` (``DropoutMode``). The kernels run torch's
own samplers on a generator seeded from that seed, so every draw has exactly torch's
distribution, dtype and shape. ``torch.dropout`` and its feature/alpha variants (in-place
forms included: ``torch.dropout_``..., multiplying their input in place), and the
dropout between the layers of ``nn.GRU``/``LSTM``/``RNN`` (padded input), draw seeded
masks too.

Gradients are eager torch's: a draw is noise that no gradient flows into
(``torch.normal(mean, std)``, ``bernoulli(p)``, ``poisson(rates)`` give them zero gradients);
``Normal(...).rsample()`` is ``loc + noise * scale`` (differentiable in both),
``F.rrelu`` in training flows through its random slopes, and ``torch._standard_gamma``
and ``torch._sample_dirichlet`` (``Gamma``/``Chi2``/``StudentT``/``Dirichlet``/``Beta``
``rsample``) have torch's implicit gradients.

Differences from eager torch: a ``generator=`` argument is ignored, as in PopTorch
(every draw comes from the device's seed); ``requires_grad=True`` on a factory
(``torch.rand(..., requires_grad=True)``) is not honoured; argument checks that need
tensor values (probabilities in [0, 1]) happen when the program runs.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributions
import torch.nn.functional as F

import ipuxl.kernels.random  # noqa: F401  (registers the ipuxl::* random custom ops)
from ipuxl.errors import InvalidArgumentError, TraceError
from ipuxl.ir.context import user_source_line

__all__ = ["NextSeed", "RANDOM_FUNCTIONS", "draw", "unseeded_op_error", "capturable_distributions"]

#: gives the seed of the next draw (each call takes the next seed modifier)
NextSeed = Callable[[], torch.Tensor]
_Replacement = Callable[[NextSeed, tuple, dict], Any]
_ALPHA = 1.7580993408473766  # SELU's alpha: alpha dropout keeps SELU's mean and variance
# torch's private samplers and gradients that torch.distributions is built on, and the
# class default of its argument validation; read by name, here only (torch has no public ones)
_STANDARD_GAMMA, _STANDARD_GAMMA_GRAD = torch._standard_gamma, torch._standard_gamma_grad
_SAMPLE_DIRICHLET, _DIRICHLET_GRAD = torch._sample_dirichlet, torch._dirichlet_grad
_VALIDATE_ARGS = "_validate_args"


def draw(func: Callable, next_seed: NextSeed, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` with its random numbers drawn from ``next_seed()``."""
    return RANDOM_FUNCTIONS[func](next_seed, args, dict(kwargs))


def unseeded_op_error(op: str, module: str, where: str | None) -> TraceError:
    """The error for an aten random op that reached the trace without going through ``draw``."""
    return TraceError(
        f"module {module} draws random numbers with aten.{op}, which ipuxl cannot seed from "
        "Options.randomSeed (it was called as an aten op, torch.ops.aten..., or inside another op, not through a "
        "torch function)", where=where,
        fix="use the torch random functions ipuxl seeds (torch.rand/randn/randint/randperm/normal/bernoulli/"
            "multinomial/poisson, Tensor.uniform_/normal_/bernoulli_/exponential_..., F.dropout, F.rrelu, "
            "torch.distributions), or draw the values on the host and pass them as an input")


@contextlib.contextmanager
def capturable_distributions() -> Iterator[None]:
    """``torch.distributions`` as a capture can run them: no argument validation (it needs
    tensor values, and ``bool(tensor)`` cannot be traced), and ``Dirichlet.rsample`` (so
    ``Beta``) without torch's ``autograd.Function``, which make_fx's functorch transforms
    refuse: it calls ``torch._sample_dirichlet``, whose draw carries torch's gradient."""
    distribution, dirichlet = torch.distributions.Distribution, torch.distributions.Dirichlet
    validate, rsample = getattr(distribution, _VALIDATE_ARGS), dirichlet.rsample
    distribution.set_default_validate_args(False)
    setattr(dirichlet, "rsample", _dirichlet_rsample)
    try:
        yield
    finally:
        distribution.set_default_validate_args(validate)
        setattr(dirichlet, "rsample", rsample)


def _dirichlet_rsample(self: torch.distributions.Dirichlet, sample_shape: Sequence[int] = ()) -> torch.Tensor:
    shape = torch.Size(sample_shape) + self.batch_shape + self.event_shape
    return _SAMPLE_DIRICHLET(self.concentration.expand(shape))


# -- the seeded draws ----------------------------------------------------------------------------
def _fill(seed: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, kind: str, args: Sequence[float]) -> torch.Tensor:
    return torch.ops.ipuxl.random_fill(seed, [int(d) for d in shape], dtype, kind, [float(a) for a in args])


def _sample(seed: torch.Tensor, kind: str, inputs: list[torch.Tensor], args: Sequence[float] = ()) -> torch.Tensor:
    return torch.ops.ipuxl.random_sample(seed, kind, [t.detach() for t in inputs], [float(a) for a in args])


def _check(ok: bool, func: str, what: str, fix: str) -> None:
    if not ok:
        raise TraceError(f"{func}: {what}", where=user_source_line(), fix=fix)


def _check_float(func: str, dtype: torch.dtype) -> None:
    _check(dtype.is_floating_point, func, f"the result dtype must be a floating point type, got {dtype}",
           "pass a floating dtype (dtype=torch.float32), or use torch.randint for integers")


def _size(args: tuple, kwargs: dict) -> list[int]:
    size: Any = kwargs.pop("size", args)
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = size[0]
    return [int(d) for d in size]


def _out(result: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = kwargs.get("out")
    return result if out is None else out.copy_(result)


def _bind(func: str, names: Sequence[str], defaults: dict[str, Any], args: Sequence, kwargs: dict) -> dict[str, Any]:
    """Positional ``args`` and keyword ``kwargs`` by parameter name (``defaults`` fill the rest);
    a wrong call is an ``InvalidArgumentError`` (a ``TypeError``, as torch raises)."""
    bound = {**defaults, **dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
    missing = [n for n in names if n not in bound]
    if len(args) > len(names) or missing:
        what = f"missing argument(s) {', '.join(missing)}" if missing else f"too many arguments ({len(args)})"
        raise InvalidArgumentError(f"{func}: {what}; it takes ({', '.join(names)})", where=user_source_line(),
                                   fix="pass the arguments as torch documents them")
    return bound


def _no_gradient(out: torch.Tensor, *inputs: Any) -> torch.Tensor:
    """``out`` with a zero gradient for each float tensor of ``inputs``, as torch gives the
    probabilities, rates, means... of a draw (a zero gradient, not none: weight decay and
    momentum still apply)."""
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            out = out + torch.where(torch.zeros((), dtype=torch.bool, device=t.device), t, 0.0).to(out.dtype)
    return out


# -- factories: torch.rand, randn, randint, randperm and their *_like -----------------------------
def _factory(kind: str, func: str, args: Sequence[float]) -> _Replacement:
    def replace(next_seed: NextSeed, a: tuple, kwargs: dict) -> torch.Tensor:
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        _check_float(func, dtype)
        return _out(_fill(next_seed(), _size(a, kwargs), dtype, kind, args), kwargs)
    return replace


def _like(kind: str, func: str, args: Sequence[float]) -> _Replacement:
    def replace(next_seed: NextSeed, a: tuple, kwargs: dict) -> torch.Tensor:
        like: torch.Tensor = a[0] if a else kwargs["input"]
        dtype = kwargs.get("dtype") or like.dtype
        _check_float(func, dtype)
        return _fill(next_seed(), like.shape, dtype, kind, args)
    return replace


def _integers(next_seed: NextSeed, shape: Sequence[int], dtype: torch.dtype, low: int, high: int,
              func: str) -> torch.Tensor:
    _check(low < high, func, f"low must be less than high, got low={low}, high={high}",
           "pass a non-empty range [low, high)")
    return torch.ops.ipuxl.random_integers(next_seed(), [int(d) for d in shape], dtype, int(low), int(high))


def _randint(next_seed: NextSeed, args: tuple, kwargs: dict) -> torch.Tensor:
    given = len(args) + sum(k in kwargs for k in ("low", "high", "size"))
    names = ("low", "high", "size") if given == 3 else ("high", "size")
    a = _bind("torch.randint", names, {"low": 0}, args, kwargs)
    result = _integers(next_seed, a["size"], kwargs.get("dtype") or torch.int64, a["low"], a["high"], "torch.randint")
    return _out(result, kwargs)


def _randint_like(next_seed: NextSeed, args: tuple, kwargs: dict) -> torch.Tensor:
    given = len(args) - 1 + sum(k in kwargs for k in ("low", "high"))
    names = ("low", "high") if given == 2 else ("high",)
    like: torch.Tensor = args[0]
    a = _bind("torch.randint_like", names, {"low": 0}, args[1:], kwargs)
    return _integers(next_seed, like.shape, kwargs.get("dtype") or like.dtype, a["low"], a["high"], "torch.randint_like")


def _randperm(next_seed: NextSeed, args: tuple, kwargs: dict) -> torch.Tensor:
    n = int(args[0] if args else kwargs["n"])
    _check(n >= 0, "torch.randperm", f"n must be non-negative, got {n}", "pass n >= 0")
    dtype = kwargs.get("dtype") or torch.int64
    return _out(torch.ops.ipuxl.random_permutation(next_seed(), n, dtype), kwargs)


# -- torch.normal ---------------------------------------------------------------------------------
def _normal(next_seed: NextSeed, args: tuple, kwargs: dict) -> torch.Tensor:
    a = _bind("torch.normal", ("mean", "std", "size"), {"std": 1.0, "size": None}, args, kwargs)
    mean, std = a["mean"], a["std"]
    if not isinstance(mean, torch.Tensor) and not isinstance(std, torch.Tensor):
        _check(a["size"] is not None, "torch.normal", "with a float mean and std, size is required", "pass size=(...)")
        _check(std >= 0.0, "torch.normal", f"std must be >= 0.0, got {std}", "pass a non-negative std")
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        return _out(_fill(next_seed(), _size(tuple(a["size"]), {}), dtype, "normal", [mean, std]), kwargs)
    if not isinstance(std, torch.Tensor):
        _check(std >= 0.0, "torch.normal", f"std must be >= 0.0, got {std}", "pass a non-negative std")
    tensors = [t for t in (mean, std) if isinstance(t, torch.Tensor)]
    dtype = tensors[0].dtype if len(tensors) == 1 else torch.result_type(mean, std)
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    # torch gives mean and std a zero gradient: the noise is scaled and shifted by detached values
    plain = [t.detach() if isinstance(t, torch.Tensor) else t for t in (mean, std)]
    noise = _fill(next_seed(), shape, dtype, "normal", [0.0, 1.0])
    return _out(_no_gradient(noise * plain[1] + plain[0], mean, std), kwargs)


# -- in-place fills: Tensor.uniform_, normal_, bernoulli_, exponential_ ... ---------------------
_FILLS: dict[str, tuple[tuple[str, ...], dict[str, float]]] = {
    "uniform": (("from", "to"), {"from": 0.0, "to": 1.0}),
    "normal": (("mean", "std"), {"mean": 0.0, "std": 1.0}),
    "exponential": (("lambd",), {"lambd": 1.0}),
    "geometric": (("p",), {}),
    "cauchy": (("median", "sigma"), {"median": 0.0, "sigma": 1.0}),
    "log_normal": (("mean", "std"), {"mean": 1.0, "std": 2.0}),
    "bernoulli": (("p",), {"p": 0.5}),
}
_FILL_CHECKS: dict[str, tuple[Callable[[dict], bool], str]] = {
    "uniform": (lambda a: a["from"] <= a["to"], "from <= to"),
    "normal": (lambda a: a["std"] >= 0.0, "std >= 0.0"),
    "exponential": (lambda a: a["lambd"] > 0.0, "lambd > 0.0"),
    "geometric": (lambda a: 0.0 < a["p"] < 1.0, "0 < p < 1"),
    "cauchy": (lambda a: a["sigma"] > 0.0, "sigma > 0.0"),
    "log_normal": (lambda a: a["std"] > 0.0, "std > 0.0"),
    "bernoulli": (lambda a: 0.0 <= a["p"] <= 1.0, "0 <= p <= 1"),
}


def _fill_(kind: str) -> _Replacement:
    func = f"torch.Tensor.{kind}_"
    names, defaults = _FILLS[kind]

    def replace(next_seed: NextSeed, args: tuple, kwargs: dict) -> torch.Tensor:
        self: torch.Tensor = args[0]
        a = _bind(func, names, defaults, args[1:], kwargs)
        if kind == "bernoulli" and isinstance(a["p"], torch.Tensor):
            p = a["p"] if a["p"].is_floating_point() else a["p"].to(torch.get_default_dtype())
            return self.copy_(_sample(next_seed(), "bernoulli", [p.expand(self.shape)]))
        check, rule = _FILL_CHECKS[kind]
        _check(check(a), func, f"expects {rule}, got {', '.join(f'{n}={a[n]}' for n in names)}",
               f"pass arguments with {rule}")
        if kind != "bernoulli":
            _check_float(func, self.dtype)
        return self.copy_(_fill(next_seed(), self.shape, self.dtype, kind, [a[n] for n in names]))
    return replace


def _random_(next_seed: NextSeed, args: tuple, kwargs: dict) -> torch.Tensor:
    self: torch.Tensor = args[0]
    if len(args) == 1 and not {"from", "to"} & set(kwargs):  # random_(): torch's default range for the dtype
        return self.copy_(torch.ops.ipuxl.random_integers(next_seed(), list(self.shape), self.dtype, None, None))
    if len(args) == 2 and not {"from", "to"} & set(kwargs):  # random_(to)
        low, high = 0, args[1]
    else:
        a = _bind("torch.Tensor.random_", ("from", "to"), {"to": None}, args[1:], kwargs)
        low, high = a["from"], a["to"]
    _check(high is None or low < high, "torch.Tensor.random_", f"expects from < to, got from={low}, to={high}",
           "pass a non-empty range")
    result = torch.ops.ipuxl.random_integers(next_seed(), list(self.shape), self.dtype, int(low),
                                             None if high is None else int(high))
    return self.copy_(result)


# -- samplers on tensors: bernoulli, multinomial, poisson, binomial, gamma ------------------------
def _bernoulli(next_seed: NextSeed, args: tuple, kwargs: dict) -> torch.Tensor:
    a = _bind("torch.bernoulli", ("input", "p"), {"p": None}, args, kwargs)
    x: torch.Tensor = a["input"]
    if a["p"] is not None:
        p = float(a["p"])
        _check(0.0 <= p <= 1.0, "torch.bernoulli", f"expects 0 <= p <= 1, got p={p}", "pass a probability")
        return _out(_fill(next_seed(), x.shape, x.dtype, "bernoulli", [p]), kwargs)
    _check(x.dtype.is_floating_point, "torch.bernoulli", f"probabilities must be floating point, got {x.dtype}",
           "pass float probabilities")
    return _out(_no_gradient(_sample(next_seed(), "bernoulli", [x]), x), kwargs)


def _multinomial(next_seed: NextSeed, args: tuple, kwargs: dict) -> torch.Tensor:
    a = _bind("torch.multinomial", ("input", "num_samples", "replacement"), {"replacement": False}, args, kwargs)
    probs: torch.Tensor = a["input"]
    n, replacement = int(a["num_samples"]), bool(a["replacement"])
    _check(probs.dim() in (1, 2), "torch.multinomial", f"prob_dist must be 1 or 2 dim, got {probs.dim()} dims",
           "pass probabilities of shape (categories,) or (rows, categories)")
    _check(n > 0, "torch.multinomial", f"cannot sample {n} samples", "pass num_samples > 0")
    _check(replacement or n <= probs.shape[-1], "torch.multinomial",
           f"cannot sample {n} > {probs.shape[-1]} categories without replacement", "pass replacement=True")
    return _out(_sample(next_seed(), "multinomial", [probs], [n, float(replacement)]), kwargs)


def _sampler(kind: str, names: tuple[str, ...]) -> _Replacement:
    def replace(next_seed: NextSeed, args: tuple, kwargs: dict) -> torch.Tensor:
        a = _bind(f"torch.{kind}", names, {}, args, kwargs)
        inputs = [a[n] for n in names]
        return _no_gradient(_sample(next_seed(), kind, inputs), *inputs)
    return replace


def _standard_gamma(next_seed: NextSeed, args: tuple, kwargs: dict) -> torch.Tensor:
    alpha: torch.Tensor = args[0] if args else kwargs["input"]
    value = _sample(next_seed(), "standard_gamma", [alpha])
    # torch's implicit reparameterisation: d value / d alpha = _standard_gamma_grad(alpha, value)
    slope = _STANDARD_GAMMA_GRAD(alpha.detach(), value)
    return value + (alpha - alpha.detach()) * slope


def _sample_dirichlet(next_seed: NextSeed, args: tuple, kwargs: dict) -> torch.Tensor:
    alpha: torch.Tensor = args[0] if args else kwargs["input"]
    value = _sample(next_seed(), "dirichlet", [alpha])
    # torch's Dirichlet gradient: d value / d alpha applied to g is slope * (g - sum(value * g))
    plain = alpha.detach()
    slope = _DIRICHLET_GRAD(value, plain, plain.sum(-1, True).expand_as(plain))
    shift = slope * (alpha - plain)  # zero; its gradient is slope
    return value + shift - value * shift.sum(-1, True)


# -- activations and dropouts with random parts ---------------------------------------------------
def _rrelu(inplace_default: bool) -> _Replacement:
    def replace(next_seed: NextSeed, args: tuple, kwargs: dict) -> torch.Tensor:
        a = _bind("torch.nn.functional.rrelu", ("input", "lower", "upper", "training", "inplace"),
                  {"lower": 1.0 / 8, "upper": 1.0 / 3, "training": False, "inplace": inplace_default}, args, kwargs)
        x: torch.Tensor = a["input"]
        if not a["training"]:
            return F.leaky_relu(x, (a["lower"] + a["upper"]) / 2, inplace=a["inplace"])
        slopes = _fill(next_seed(), x.shape, x.dtype, "uniform", [a["lower"], a["upper"]])
        if a["inplace"]:  # x * 1 is x: in place, x times its slopes
            return x.mul_(torch.where(x <= 0, slopes, 1.0))
        return torch.where(x <= 0, x * slopes, x)  # torch's rule: a random slope where x <= 0
    return replace


def _alpha_dropout(feature: bool) -> _Replacement:
    """``F.alpha_dropout`` / ``feature_alpha_dropout``: eager's formula, ``x * (keep * a) + b``
    with ``b = (keep - 1) * alpha * a + alpha * a * p``; in place, ``x.mul_(...).add_(b)``."""
    def replace(next_seed: NextSeed, args: tuple, kwargs: dict) -> torch.Tensor:
        a = _bind("torch.nn.functional.alpha_dropout", ("input", "p", "training", "inplace"),
                  {"p": 0.5, "training": False, "inplace": False}, args, kwargs)
        x: torch.Tensor = a["input"]
        p = float(a["p"])
        _check(0.0 <= p <= 1.0, "alpha_dropout", f"p must be in [0, 1], got {p}", "pass a probability")
        if not a["training"] or p == 0.0:
            return x
        if p == 1.0:
            return x.mul_(0.0) if a["inplace"] else x * 0.0
        shape = [*x.shape[:2], *[1] * (x.dim() - 2)] if feature else list(x.shape)
        keep = _fill(next_seed(), shape, x.dtype, "bernoulli", [1.0 - p])
        scale = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
        shift = (keep - 1) * (_ALPHA * scale) + _ALPHA * scale * p
        return x.mul_(keep * scale).add_(shift) if a["inplace"] else x * (keep * scale) + shift
    return replace


def _torch_dropout(feature: bool, alpha: bool, inplace: bool = False) -> _Replacement:
    """``torch.dropout``, ``feature_dropout``, their alpha variants and their in-place forms
    (``torch.dropout_``...: what ``F.dropout``... call; ``DropoutMode`` seeds the ``F``
    functions themselves)."""
    name = f"torch.{'feature_' if feature else ''}{'alpha_' if alpha else ''}dropout{'_' if inplace else ''}"

    def replace(next_seed: NextSeed, args: tuple, kwargs: dict) -> torch.Tensor:
        a = _bind(name, ("input", "p", "train"), {}, args, kwargs)
        if alpha:
            return _alpha_dropout(feature)(next_seed, (a["input"], a["p"], a["train"], inplace), {})
        x, p = a["input"], float(a["p"])
        _check(0.0 <= p <= 1.0, name, f"p must be in [0, 1], got {p}", "pass a probability")
        if not a["train"] or p == 0.0:
            return x
        shape = [*x.shape[:2], *[1] * (x.dim() - 2)] if feature else list(x.shape)
        mask = 0.0 if p == 1.0 else torch.ops.ipuxl.dropout_mask(next_seed(), shape, p, x.dtype)
        return x.mul_(mask) if inplace else x * mask
    return replace


def _native_dropout(next_seed: NextSeed, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    a = _bind("torch.native_dropout", ("input", "p", "train"), {}, args, kwargs)
    x, p = a["input"], float(a["p"])
    if a["train"] is False or p == 0.0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    mask = torch.ops.ipuxl.dropout_mask(next_seed(), list(x.shape), p, x.dtype) if p < 1.0 else torch.zeros_like(x)
    return x * mask, mask != 0


def _recurrent(kind: str) -> _Replacement:
    """``torch.gru``/``lstm``/``rnn_tanh``/``rnn_relu`` (``nn.GRU``... on padded input) with a
    seeded dropout between layers: layer by layer, as torch's kernel runs them."""
    run = getattr(torch, kind)

    def replace(next_seed: NextSeed, args: tuple, kwargs: dict) -> Any:
        if len(args) != 9 or kwargs or not isinstance(args[2], list):  # packed sequences: torch's kernel
            return run(*args, **kwargs)
        x, hx, params, has_biases, layers, p, train, bidirectional, batch_first = args
        if not (train and p > 0.0 and layers > 1):
            return run(*args)
        width, states = len(params) // layers, (tuple(hx) if kind == "lstm" else (hx,))
        rows = states[0].shape[0] // layers  # state rows per layer: one per direction
        finals = []
        for layer in range(layers):
            if layer > 0:
                x = x * torch.ops.ipuxl.dropout_mask(next_seed(), list(x.shape), float(p), x.dtype)
            layer_hx = tuple(s[layer * rows:(layer + 1) * rows] for s in states)
            x, *final = run(x, layer_hx if kind == "lstm" else layer_hx[0],
                            params[layer * width:(layer + 1) * width], has_biases, 1, 0.0, train, bidirectional,
                            batch_first)
            finals.append(final)
        return (x, *(torch.cat(parts) for parts in zip(*finals)))
    return replace


#: every torch function ipuxl draws from the model's seed, and its replacement
RANDOM_FUNCTIONS: dict[Callable, _Replacement] = {
    torch.rand: _factory("uniform", "torch.rand", [0.0, 1.0]),
    torch.randn: _factory("normal", "torch.randn", [0.0, 1.0]),
    torch.rand_like: _like("uniform", "torch.rand_like", [0.0, 1.0]),
    torch.randn_like: _like("normal", "torch.randn_like", [0.0, 1.0]),
    torch.randint: _randint,
    torch.randint_like: _randint_like,
    torch.randperm: _randperm,
    torch.normal: _normal,
    **{getattr(torch.Tensor, kind + "_"): _fill_(kind) for kind in _FILLS},
    torch.Tensor.random_: _random_,
    torch.bernoulli: _bernoulli,
    torch.Tensor.bernoulli: _bernoulli,
    torch.multinomial: _multinomial,
    torch.Tensor.multinomial: _multinomial,
    torch.poisson: _sampler("poisson", ("input",)),
    torch.binomial: _sampler("binomial", ("count", "prob")),
    _STANDARD_GAMMA: _standard_gamma,
    _SAMPLE_DIRICHLET: _sample_dirichlet,
    F.rrelu: _rrelu(False),
    F.rrelu_: _rrelu(True),
    torch.rrelu: _rrelu(False),
    torch.rrelu_: _rrelu(True),
    F.alpha_dropout: _alpha_dropout(False),
    F.feature_alpha_dropout: _alpha_dropout(True),
    **{getattr(torch, kind): _recurrent(kind) for kind in ("gru", "lstm", "rnn_tanh", "rnn_relu")},
    torch.dropout: _torch_dropout(False, False),
    torch.feature_dropout: _torch_dropout(True, False),
    torch.alpha_dropout: _torch_dropout(False, True),
    torch.feature_alpha_dropout: _torch_dropout(True, True),
    torch.dropout_: _torch_dropout(False, False, inplace=True),
    torch.feature_dropout_: _torch_dropout(True, False, inplace=True),
    torch.alpha_dropout_: _torch_dropout(False, True, inplace=True),
    torch.feature_alpha_dropout_: _torch_dropout(True, True, inplace=True),
    torch.native_dropout: _native_dropout,
}
