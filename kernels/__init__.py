"""Compute kernels: Triton on CUDA, plain torch references everywhere else.

`kernels.ops` is the one entry point the model uses; it picks the Triton
kernel for CUDA tensors and the reference in `kernels.reference` otherwise.
"""
