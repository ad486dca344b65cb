"""GPU kernels in Triton (imported only where used, so bytediet imports without triton); run with TRITON_INTERPRET=1 on the CPU."""
