"""GPU kernels in Triton, imported only where used (bytediet imports without triton); TRITON_INTERPRET=1 runs them."""
