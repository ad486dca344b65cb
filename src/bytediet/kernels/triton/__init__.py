"""kernels/triton"""
