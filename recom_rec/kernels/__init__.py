"""Triton kernels of the fused lookup (imported lazily: Triton is optional on CPU machines)."""
