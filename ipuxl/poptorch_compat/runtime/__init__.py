"""The PopTorch runtime: a compiled program run on a device Session."""
