"""Fused ops: one folder per op, each with a pure-PyTorch reference and Triton kernels."""
