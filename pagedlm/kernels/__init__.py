"""Compiled kernels (C/OpenMP on the CPU) with PyTorch fallbacks at their call sites."""
