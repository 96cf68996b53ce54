"""Fused embedding ops (torch custom ops) and their pure-torch reference."""
from .backends import BACKENDS
from .pooled_embedding import (
    fused_embedding_update,
    pooled_embedding_backward,
    pooled_embedding_forward,
    pooled_embedding_weights_backward,
    JaggedBatch,
    KeyRouting,
    pooled_lookup,
)
from .plan import FusedStep, GroupPlan, LookupPlan

__all__ = [
    "fused_embedding_update",
    "BACKENDS",
    "pooled_embedding_forward",
    "pooled_embedding_backward",
    "pooled_embedding_weights_backward",
    "pooled_lookup",
    "FusedStep",
    "GroupPlan",
    "JaggedBatch",
    "KeyRouting",
    "LookupPlan",
]
