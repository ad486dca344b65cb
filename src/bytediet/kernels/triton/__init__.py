"""GPU kernels in Triton (runnable on the CPU under TRITON_INTERPRET=1); triton is imported only by their modules."""
