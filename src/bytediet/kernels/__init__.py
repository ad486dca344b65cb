"""Kernels: ``reference`` holds the plain-PyTorch truth; ``cpu`` and ``triton`` hold fast versions tested against it."""
