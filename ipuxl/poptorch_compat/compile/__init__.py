"""The PopTorch compiler: a wrapped ``nn.Module`` to a device program (an ``Ir`` and its handles).

``compile_model.compile_model`` runs the steps in order; the other modules are what
the steps use, one concern each:

* ``compile_model``: capture -> import into the IR -> autodiff -> ``build_program`` -> outline;
* ``program``: the device program's main graph around the captured forward (``Program``);
* ``batching``: the combined batch's layout in the program's streams, outputs per output mode;
* ``anchors``: ``Options.anchorTensor``'s streams, and their values after a run;
* ``translate``: a ``torch.optim`` optimiser to per-parameter ``ipuxl.optim`` plans;
* ``placement``, ``placement_passes``: PopTorch blocks give ops, gradients and variables
  their stage and IPU; ``stages``, ``pipelined``: the pipelined step; ``report``: the
  copies between stages and the schedule in ``report()``;
* ``locations``, ``precision``, ``memory_format``: ``Options.TensorLocations``,
  ``Options.Precision`` and the inputs' memory format as the compile applies them;
* ``hooks``, ``log``: PopTorch's compile hooks, and what a compile logs;
* ``overlap``: upstream's checks of the ``set_overlap_for_input/output`` marks in the capture.

The compiler produces a program; ``runtime`` runs it. No module here imports ``runtime``
(``tests/test_layering.py``).
"""
