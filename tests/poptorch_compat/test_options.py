"""``ipuxl.poptorch_compat.options``: PopTorch-style ``Options`` defaults, setters, validation and freezing."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from ipuxl.errors import FrozenOptionsError, InvalidArgumentError, OptionsError
from ipuxl.poptorch_compat.options import AnchorMode, Options, OutputMode
from tests.poptorch_compat._checks import raises_in

raises = raises_in(__file__)


# -- defaults and setters -------------------------------------------------------------
def test_defaults():
    opts = Options()
    assert opts.device_iterations == 1
    assert opts.replication_factor == 1
    assert opts.gradient_accumulation == 1
    assert opts.Training.gradient_accumulation == 1
    assert opts.output_mode is OutputMode.Default
    assert opts.defaultOutputMode()
    assert opts.output_return_period == 1
    assert opts.random_seed is None
    assert opts.use_ipu_model is False
    assert opts.device_type == "ipu_hw"
    assert opts.static_shapes is False
    assert opts.frozen is False


def test_setters_chain_and_store_values():
    opts = Options()
    result = (opts.deviceIterations(4).replicationFactor(2).outputMode(OutputMode.Sum)
              .randomSeed(7).useIpuModel(True).staticShapes())
    assert result is opts
    assert opts.Training.gradientAccumulation(3) is opts.Training
    assert (opts.device_iterations, opts.replication_factor, opts.gradient_accumulation) == (4, 2, 3)
    assert opts.Training.gradient_accumulation == 3
    assert opts.output_mode is OutputMode.Sum and not opts.defaultOutputMode()
    assert opts.random_seed == 7
    assert opts.use_ipu_model is True and opts.device_type == "ipu_model"
    assert opts.static_shapes is True
    assert opts.staticShapes(False).static_shapes is False
    assert opts.useIpuModel(False).device_type == "ipu_hw"


def test_numpy_integers_are_accepted_as_ints():
    opts = Options().deviceIterations(np.int64(5))
    assert opts.device_iterations == 5 and type(opts.device_iterations) is int


def test_random_seed_also_seeds_torch_like_upstream():
    Options().randomSeed(1234)
    first = torch.rand(3)
    Options().randomSeed(1234)
    assert torch.equal(torch.rand(3), first)
    assert Options().randomSeed(0).random_seed == 0
    assert Options().randomSeed(2**64 - 1).random_seed == 2**64 - 1


# -- validation ---------------------------------------------------------------------
@pytest.mark.parametrize("call, fragment", [
    (lambda o: o.deviceIterations(0),
     "Options.deviceIterations: device_iterations must be a positive int (>= 1), got 0"),
    (lambda o: o.deviceIterations(-2), "got -2"),
    (lambda o: o.deviceIterations(2.0), "device_iterations must be a positive int, got 2.0 (float)"),
    (lambda o: o.deviceIterations(True), "got True (bool)"),
    (lambda o: o.deviceIterations("4"), "got '4' (str)"),
    (lambda o: o.replicationFactor(0), "Options.replicationFactor: replication_factor must be a positive int"),
    (lambda o: o.replicationFactor(None), "got None (NoneType)"),
    (lambda o: o.Training.gradientAccumulation(0),
     "Options.Training.gradientAccumulation: gradient_accumulation must be a positive int"),
    (lambda o: o.Training.gradientAccumulation(1.5), "got 1.5 (float)"),
    (lambda o: o.randomSeed(-1), "Options.randomSeed: random_seed must be in [0, 2**64), got -1"),
    (lambda o: o.randomSeed(2**64), "must be in [0, 2**64)"),
    (lambda o: o.randomSeed(1.0), "Options.randomSeed: random_seed must be an int, got 1.0 (float)"),
    (lambda o: o.randomSeed(False), "got False (bool)"),
    (lambda o: o.useIpuModel(1), "Options.useIpuModel: use_model must be True or False, got 1 (int)"),
    (lambda o: o.staticShapes("yes"), "Options.staticShapes: enabled must be True or False"),
    (lambda o: o.outputMode("All"), "Options.outputMode: output_mode must be an OutputMode, got 'All' (str)"),
    (lambda o: o.outputMode(2), "must be an OutputMode, got 2 (int)"),
    (lambda o: o.anchorMode("Final"), "Options.anchorMode: anchor_mode must be an OutputMode"),
])
def test_setter_validation(call, fragment):
    opts = Options()
    with raises(OptionsError, fragment) as info:
        call(opts)
    assert isinstance(info.value, ValueError)
    assert not isinstance(info.value, FrozenOptionsError)
    assert opts.to_dict() == Options().to_dict(), "a refused value must not be stored"


def test_validation_error_lists_the_valid_output_modes():
    with raises(OptionsError, "OutputMode.Final", "OutputMode.EveryN", "OutputMode.Default"):
        Options().outputMode(None)


def test_assigning_an_option_runs_its_setter_as_upstream():
    # upstream's OptionsDict.__setattr__: ``opts.key = value`` sets option ``key``
    opts = Options()
    opts.device_iterations = 4
    opts.Training.gradient_accumulation = 2
    assert (opts.device_iterations, opts.Training.gradient_accumulation) == (4, 2)
    with raises(OptionsError, "Options.deviceIterations: device_iterations must be a positive int"):
        opts.device_iterations = 0  # the setter's checks apply
    with raises(OptionsError, "Options.deviceIteration cannot be assigned", "not an option"):
        opts.deviceIteration = 4  # a typo must not silently create an attribute
    assert opts.device_iterations == 4


# -- output modes -------------------------------------------------------------------
def test_output_mode_values_match_upstream():
    assert [(m.name, int(m)) for m in OutputMode] == [
        ("Final", 0), ("EveryN", 1), ("All", 2), ("Sum", 3), ("Default", 4)]


def test_default_output_mode_resolves_per_model_kind():
    opts = Options()
    assert opts.resolved_output_mode(training=True) is OutputMode.Final
    assert opts.resolved_output_mode(training=False) is OutputMode.All
    assert opts.output_mode is OutputMode.Default, "resolving must not change the stored mode"
    opts.outputMode(OutputMode.Sum)
    assert opts.resolved_output_mode(True) is OutputMode.Sum
    assert opts.resolved_output_mode(False) is OutputMode.Sum


def test_resolved_output_mode_needs_a_bool():
    with raises(InvalidArgumentError, "training must be True or False, got 'train'"):
        Options().resolved_output_mode("train")


def test_every_n_needs_a_positive_period():
    opts = Options().outputMode(OutputMode.EveryN, 5)
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.EveryN, 5)
    assert opts.resolved_output_mode(training=True) is OutputMode.EveryN
    with raises(OptionsError, "OutputMode.EveryN needs output_return_period"):
        Options().outputMode(OutputMode.EveryN)
    with raises(OptionsError, "output_return_period must be a positive int (>= 1), got 0"):
        Options().outputMode(OutputMode.EveryN, 0)
    with raises(OptionsError, "output_return_period must be a positive int, got 2.5"):
        Options().outputMode(OutputMode.EveryN, 2.5)


def test_period_with_another_mode_is_ignored_with_a_warning_as_upstream():
    with pytest.warns(UserWarning, match=r"output_return_period=3 is ignored with OutputMode.All") as record:
        opts = Options().outputMode(OutputMode.All, 3)
    assert record[0].filename == __file__, "the warning points at the caller"
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.All, 1)


def test_switching_away_from_every_n_resets_the_period():
    opts = Options().outputMode(OutputMode.EveryN, 4).outputMode(OutputMode.Final)
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.Final, 1)


def test_anchor_mode_is_the_older_spelling():
    assert AnchorMode.All is OutputMode.All and AnchorMode.EveryN is OutputMode.EveryN
    opts = Options().anchorMode(AnchorMode.EveryN, 2)
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.EveryN, 2)
    assert (opts.anchor_mode, opts.anchor_return_period) == (OutputMode.EveryN, 2)
    assert Options().anchorMode(AnchorMode.Final).output_mode is OutputMode.Final
    assert Options().outputMode(AnchorMode.Sum).output_mode is OutputMode.Sum
    with raises(OptionsError, "OutputMode.EveryN needs anchor_return_period", "opts.anchorMode("):
        Options().anchorMode(AnchorMode.EveryN)
    with pytest.warns(UserWarning, match="anchor_return_period=7 is ignored"):
        Options().anchorMode(AnchorMode.All, 7)


# -- combined batch factor ------------------------------------------------------------
def test_combined_batch_factor_training():
    opts = Options().deviceIterations(3).replicationFactor(2)
    opts.Training.gradientAccumulation(5)
    assert opts.combined_batch_factor(training=True) == 30
    assert Options().combined_batch_factor(training=True) == 1


def test_combined_batch_factor_inference_refuses_gradient_accumulation():
    opts = Options().deviceIterations(3).replicationFactor(2)
    assert opts.combined_batch_factor(training=False) == 6
    opts.Training.gradientAccumulation(4)
    with raises(OptionsError, "You must set poptorch.Options().Training.gradientAccumulation to 1", "(it is 4",
                "opts.Training.gradientAccumulation(1)"):
        opts.combined_batch_factor(training=False)
    with raises(InvalidArgumentError, "training must be True or False"):
        opts.combined_batch_factor(1)


# -- freezing -------------------------------------------------------------------------
FROZEN_SETTERS = {
    "deviceIterations": lambda o: o.deviceIterations(2),
    "replicationFactor": lambda o: o.replicationFactor(2),
    "outputMode": lambda o: o.outputMode(OutputMode.All),
    "anchorMode": lambda o: o.anchorMode(AnchorMode.All),
    "randomSeed": lambda o: o.randomSeed(1),
    "useIpuModel": lambda o: o.useIpuModel(True),
    "staticShapes": lambda o: o.staticShapes(True),
    "Training.gradientAccumulation": lambda o: o.Training.gradientAccumulation(2),
}


@pytest.mark.parametrize("name", FROZEN_SETTERS)
def test_frozen_options_refuse_every_setter(name):
    opts = Options()
    opts._freeze()
    assert opts.frozen
    before = opts.to_dict()
    with raises(FrozenOptionsError, f"cannot change Options.{name}()", "frozen", "opts.clone()") as info:
        FROZEN_SETTERS[name](opts)
    assert isinstance(info.value, OptionsError) and isinstance(info.value, AttributeError)
    assert opts.to_dict() == before


def test_frozen_check_comes_before_validation():
    opts = Options()
    opts._freeze()
    with raises(FrozenOptionsError, "Options.deviceIterations"):
        opts.deviceIterations(0)


def test_clone_is_an_unfrozen_deep_copy():
    opts = Options().deviceIterations(4).outputMode(OutputMode.EveryN, 3).randomSeed(9).staticShapes()
    opts.Training.gradientAccumulation(2)
    opts._freeze()
    copy = opts.clone()
    assert copy is not opts and copy.Training is not opts.Training
    assert copy.to_dict() == opts.to_dict()
    assert not copy.frozen and opts.frozen
    copy.deviceIterations(8).Training.gradientAccumulation(6)  # the copy's Training is unfrozen too
    assert (copy.device_iterations, copy.gradient_accumulation) == (8, 6)
    assert (opts.device_iterations, opts.gradient_accumulation) == (4, 2)
    copy._freeze()
    with raises(FrozenOptionsError, "Options.Training.gradientAccumulation"):
        copy.Training.gradientAccumulation(1)
    opts._unfreeze()
    assert opts.deviceIterations(1).device_iterations == 1


def test_options_pickle_round_trip():
    opts = Options().deviceIterations(2).outputMode(OutputMode.Sum)
    opts.Training.gradientAccumulation(3)
    restored = pickle.loads(pickle.dumps(opts))
    assert restored.to_dict() == opts.to_dict()
    assert restored.Training.gradientAccumulation(4).gradient_accumulation == 4
    assert restored.gradient_accumulation == 4 and opts.gradient_accumulation == 3


def test_repr_is_readable():
    opts = Options().deviceIterations(2).outputMode(OutputMode.EveryN, 5)
    opts.Training.gradientAccumulation(3)
    assert repr(opts) == (
        "Options(device_iterations=2, replication_factor=1, gradient_accumulation=3, "
        "output_mode=OutputMode.EveryN, output_return_period=5, random_seed=None, use_ipu_model=False, "
        "static_shapes=False, frozen=False)")
    assert repr(opts.Training) == "_TrainingOptions(gradient_accumulation=3)"
