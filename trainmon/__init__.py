"""trainmon: per-layer training-state monitor for PyTorch."""
