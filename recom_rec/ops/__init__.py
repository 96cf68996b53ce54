"""Fused embedding ops (torch custom ops) and their pure-torch reference."""
from .backends import BACKENDS
from .pooled_embedding import (
    pooled_embedding_backward,
    pooled_embedding_forward,
    pooled_embedding_weights_backward,
)

__all__ = [
    "BACKENDS",
    "pooled_embedding_forward",
    "pooled_embedding_backward",
    "pooled_embedding_weights_backward",
]
