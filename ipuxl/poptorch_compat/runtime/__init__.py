"""The PopTorch runtime: a compiled program run on a device ``Session``, in step with the host.

* ``executor``: ``trainingModel``, ``inferenceModel``, ``load`` and ``PoplarExecutor``
  (PopTorch's ``poptorch._poplar_executor``), with its perf counters, tensor names,
  anchored tensors, random state and files;
* ``compiled_model``: the core of a ``PoplarExecutor``: compile on demand (``compile``),
  calls, weights, optimiser, attachment;
* ``call_inputs``: a call bound to ``forward`` and checked against the compiled call
  (PopTorch's fixed inputs under ``import poptorch``); ``live_models``: the live wrappers;
* ``weights``, ``weight_sync``: where a wrapped model's weights live, and when they move;
* ``executable_file``: what ``save`` writes and ``load`` reads;
* ``connection``: ``Options.connectionType``; ``perf``: the last call's timestamps.
"""
