"""Chooses the implementation behind the fused-lookup ops: "torch" (vectorised torch, any
device), "triton" (GPU, or CPU under ``TRITON_INTERPRET=1``), "cuda" (the CUDA C++ kernels of
csrc/lookup, built at install time, else on first use: kernels/cuda_ext.py) and "auto"."""
import os

import torch

BACKENDS = ("auto", "torch", "triton", "cuda")


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return backend


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that will actually run for tensors on ``device``."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not triton_interpreting():
        raise ValueError(
            "backend='triton' on the CPU needs TRITON_INTERPRET=1 in the environment before "
            "recom_rec is imported (the Triton interpreter); use backend='torch' or 'auto' instead"
        )
    if backend == "cuda" and device.type != "cuda":
        raise ValueError(f"backend='cuda' needs CUDA tensors (got {device.type}); use 'auto', 'triton' or 'torch'")
    return backend
