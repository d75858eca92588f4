"""The PopTorch compiler: a wrapped model to a device program."""
