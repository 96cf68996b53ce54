"""The quantized pooled lookup as a torch custom op, ``recom_rec::quantized_pooled_lookup``.

One call pools every feature of a module's quantized tables (INT8 / INT4 / INT2 / FP8 / FP16 /
FP32 rows, mixed) from one flat byte buffer: the Triton kernel (kernels/quantized_triton.py) on
CUDA, the vectorised torch path (ops/quantized_torch.py) on the CPU (or the Triton kernel under
``TRITON_INTERPRET=1`` with ``backend="triton"``). Inference only: no autograd formula.

It is a ``torch.library.triton_op``: ``torch.export`` keeps it as one node, and Inductor
(``torch.compile``, AOTInductor) traces into it and compiles the Triton kernel into its own code,
so an AOTInductor package runs it without Python. The parts Inductor cannot see into are opaque
custom ops of their own: the traced graph's input check (``quantized_lookup_checked_offsets``,
on the host, with a sync) and the CPU path (``quantized_pooled_lookup_host``). In plain eager mode
``quantized_lookup`` skips the custom-op layers (their host time is more than a small batch's
kernel, docs/perf-notes.md v7), and the Triton kernel checks ids and bags as it reads them and
reports without a sync (ops/input_check.py), as the float kernels do. Whether checked or not, the
kernel reads nothing out of bounds: an id outside its table reads row 0 (fbgemm's default
clamps so too), a bag outside the values reads nothing.
"""
from functools import lru_cache
from typing import Optional

import torch
from torch import Tensor

from . import quantized_torch
from .backends import resolve_backend
from .input_check import kernel_report
from .pooled_embedding import _eager_ok
from .validation import check_device, check_shapes, decode_names, validate_inputs

OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@lru_cache(maxsize=None)
def _triton():
    from ..kernels import quantized_triton

    return quantized_triton


def load_kernels(backend: str) -> None:
    """pooled_embedding.load_kernels for the quantized lookup's kernel."""
    if backend != "torch" and torch.cuda.is_available():
        _triton()


@torch.library.custom_op("recom_rec::quantized_lookup_checked_offsets", mutates_args=())
def checked_offsets(values: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor], feature_meta: Tensor,
                    key_index: Tensor, batch_size: int, names: str) -> Tensor:
    """The KJT offsets, after checking ids and lengths (a ``ValueError`` naming feature and
    table). Returned (a copy) so that the lookup depends on the check and no graph drops it."""
    validate_inputs(values, offsets, per_sample_weights, feature_meta, key_index, batch_size, names)
    return offsets.clone()


@checked_offsets.register_fake
def _(values, offsets, per_sample_weights, feature_meta, key_index, batch_size, names):
    return torch.empty_like(offsets)


def _host(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size, total_dim, max_dim,
          output_dtype, backend, check=None):
    if resolve_backend(backend, flat.device) == "triton":  # the interpreter (or a GPU, eagerly)
        return _triton().forward(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size,
                                 total_dim, max_dim, output_dtype, check=check)
    return quantized_torch.forward(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size,
                                   total_dim, max_dim, output_dtype)


@torch.library.custom_op("recom_rec::quantized_pooled_lookup_host", mutates_args=())
def quantized_pooled_lookup_host(flat: Tensor, values: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
                                 feature_meta: Tensor, key_index: Tensor, batch_size: int, total_dim: int,
                                 max_dim: int, output_dtype: torch.dtype, backend: str) -> Tensor:
    """The lookup off CUDA (an opaque op: its torch code has data-dependent shapes)."""
    return _host(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size, total_dim, max_dim,
                 output_dtype, backend)


@quantized_pooled_lookup_host.register_fake
def _(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size, total_dim, max_dim,
      output_dtype, backend):
    return flat.new_empty((batch_size, total_dim), dtype=output_dtype)


def _lookup(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size, total_dim, max_dim,
            output_dtype, backend, validate, names, traced: bool, report_id: int = 0):
    if output_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {OUTPUT_DTYPES}, got {output_dtype}")
    check_device(flat, values, offsets, per_sample_weights, names)
    kernel = resolve_backend(backend, flat.device) == "triton"
    check = None
    if validate:
        if traced:  # Inductor compiles the kernel into its own code: no report slot to hand it
            offsets = checked_offsets(values, offsets, per_sample_weights, feature_meta, key_index, batch_size, names)
        elif kernel:
            check_shapes(values, offsets, per_sample_weights, len(decode_names(names)[0]), batch_size)
            check = kernel_report(flat, names, report_id)
        else:
            validate_inputs(values, offsets, per_sample_weights, feature_meta, key_index, batch_size, names)
    if flat.device.type == "cuda" and kernel:
        return _triton().forward(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size,
                                 total_dim, max_dim, output_dtype,
                                 wrap=torch.library.wrap_triton if traced else None, check=check)
    args = (flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size, total_dim, max_dim,
            output_dtype, backend)
    return quantized_pooled_lookup_host(*args) if traced else _host(*args, check=check)


@torch.library.triton_op("recom_rec::quantized_pooled_lookup", mutates_args=())
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
    ``[num_keys * batch_size + 1]``, ``key_index[f]`` the KJT key feature f reads; ``validate``
    checks the input (``names`` as ``ops.validation.encode_names`` packs them)."""
    return _lookup(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size, total_dim, max_dim,
                   output_dtype, backend, validate, names, traced=True)


def quantized_lookup(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size, total_dim,
                     max_dim, output_dtype, backend, validate, names, report_id: int = 0) -> Tensor:
    """``quantized_pooled_lookup``, through the registered op when traced or compiled (the check
    then runs on the host), else through the same code at eager cost (the kernel's input reports
    go to module ``report_id``'s slots, input_check)."""
    if _eager_ok([], flat, values, offsets, per_sample_weights, feature_meta, key_index):
        return _lookup(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size, total_dim,
                       max_dim, output_dtype, backend, validate, names, traced=False, report_id=report_id)
    return quantized_pooled_lookup(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size,
                                   total_dim, max_dim, output_dtype, backend, validate, names)
