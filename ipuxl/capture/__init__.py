"""``nn.Module`` capture (the PopTorch front end's tracer): ``trace_module`` records a
module's forward with make_fx into the IR (``graph_from_trace``); ``grad_mode`` gives
``torch.no_grad``/``requires_grad_`` their eager meaning while tracing."""
