"""The quantized pooled lookup as a torch custom op, ``recom_rec::quantized_pooled_lookup``.

One call pools every feature of a module's quantized tables (INT8 / INT4 / INT2 / FP8 / FP16 /
FP32 rows, mixed) from one flat byte buffer: the Triton kernel (kernels/quantized_triton.py) on
CUDA (and on the CPU under ``TRITON_INTERPRET=1`` with ``backend="triton"``), the vectorised torch
path (ops/quantized_torch.py) otherwise. A fake implementation keeps ``torch.compile`` /
``torch.export`` in one graph. Inference only: there is no autograd formula.
"""
from functools import lru_cache
from typing import Optional

import torch
from torch import Tensor

from . import quantized_torch
from .backends import resolve_backend
from .validation import validate_inputs

OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@lru_cache(maxsize=None)
def _triton():
    from ..kernels import quantized_triton

    return quantized_triton


@torch.library.custom_op("recom_rec::quantized_pooled_lookup", mutates_args=())
def quantized_pooled_lookup(
    flat: Tensor,
    values: Tensor,
    offsets: Tensor,
    per_sample_weights: Optional[Tensor],
    feature_meta: Tensor,
    key_index: Tensor,
    batch_size: int,
    total_dim: int,
    max_dim: int,
    output_dtype: torch.dtype,
    backend: str,
    validate: bool,
    names: str,
) -> Tensor:
    """Pooled embeddings ``[batch_size, total_dim]`` in ``output_dtype``. ``flat`` is the uint8
    buffer, ``feature_meta`` the ``quant.layout`` metadata, ``offsets`` the KJT's
    ``[num_keys * batch_size + 1]``, ``key_index[f]`` the KJT key feature f reads."""
    if output_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {OUTPUT_DTYPES}, got {output_dtype}")
    if validate:
        validate_inputs(values, offsets, per_sample_weights, feature_meta, key_index, batch_size, names)
    if resolve_backend(backend, flat.device) == "torch":
        return quantized_torch.forward(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size,
                                       total_dim, max_dim, output_dtype)
    return _triton().forward(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size, total_dim,
                             max_dim, output_dtype)


@quantized_pooled_lookup.register_fake
def _(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size, total_dim, max_dim, output_dtype,
      backend, validate, names):
    return flat.new_empty((batch_size, total_dim), dtype=output_dtype)
