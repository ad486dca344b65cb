"""kernels/cpu"""
