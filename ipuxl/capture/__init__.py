"""``nn.Module`` capture (the PopTorch front end's tracer), one concern per module:

* ``trace``: ``trace_module`` records a module's forward with make_fx (``TracedModule``);
* ``mode``: the torch function mode a trace runs under; ``identity_loss`` and finding the loss;
* ``dropout``: seeded dropout, the seed schedule and ``DropoutReplay``;
* ``grad_mode``: ``torch.no_grad``/``requires_grad_`` keep their eager meaning while tracing;
* ``constants``: tensors from outside the module (closures, plain attributes) become constants;
* ``reductions``: product ``scatter_reduce``/``index_reduce`` with a gradient that traces;
* ``failures``: trace errors that keep torch's error type; ops with value-dependent shapes refused;
* ``blocks``: repeated block modules traced once and called;
* ``mutations``: in-place writes of parameters, buffers and inputs made into outputs;
* ``to_ir``: ``graph_from_trace`` imports a trace into the IR;
* ``arguments``, ``nodes``: a call's flattened arguments; typed reads of a traced graph.
"""
