"""The pooled output's gradient laid out for 16-byte reads: each feature's columns moved to a
column that is a multiple of 4.

The CUDA backward reads a lookup's gradient row 16 bytes at a time only where the row's address
allows it: the output width, the feature's first column and the buffer's start all multiples of 4
(kernels.cuh ``row_lanes``). A group with any table dim off a multiple of 4 has columns off it
(and mostly its width too), and then those features' gradient rows are read 4 bytes at a time, a
lane a column (perf-notes v57: 0% of the gradient bytes in the 16-byte layout at 19 of 27 drawn
layouts). One copy of the gradient into a padded layout (~2x its bytes, once a step) lets every
feature read 16 bytes at a time. A width that is a multiple of 4 does not say the columns are:
about a quarter of the drawn layouts with odd dims have such a width, most of their gradient bytes
at columns off a multiple of 4 (v58); their columns are read on the host once per meta tensor
(one wait for the device, not under a CUDA graph's capture).

The padded column of a feature is ``4 * ceil(col / 4) + 4 * rank``, ``rank`` its place among the
group's features by output column: the features stay in order and cannot overlap (the next one's
column is past this one's end by at least 1), and the width is at most the output's rounded up
plus 4 a feature. Both the padded columns and whether the columns are aligned are worked out once
per meta tensor, on the host from one copy of the meta, and the layout copied to the device: on
the device the dozen small torch ops took 167 ms of a process's first training step, loading
their kernels (argsort alone 75 ms; v59, against fbgemm's whole first step of 78 ms). During a
CUDA graph's capture, where the meta cannot be read, the padded layout is computed on the device
as before. The padding columns are left unwritten: no kernel reads a column past its feature's dim.
"""
import weakref
from typing import Dict, Optional, Tuple

import torch

from ..kernels import cuda_ext
from .layout import META_DIM, META_OUT_COL


class _MetaLayout:
    """What one meta tensor's features need: whether their columns are all aligned, and the padded
    layout (meta, column index), computed when first needed from the meta's host copy."""

    def __init__(self, meta: torch.Tensor, width: int, host_meta: torch.Tensor) -> None:
        self.meta_ref, self.version, self.width = weakref.ref(meta), meta._version, width
        self.host_meta = host_meta
        self.aligned = width % 4 == 0 and bool((host_meta[:, META_OUT_COL] % 4 == 0).all())
        self.padding: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def holds(self, meta: torch.Tensor, width: int) -> bool:
        return self.meta_ref() is meta and self.version == meta._version and self.width == width


_CACHE: Dict[int, _MetaLayout] = {}  # id(meta) -> its layout


def padded_width(width: int, num_features: int) -> int:
    """The padded gradient's width: the output's, rounded up to 4, plus 4 a feature."""
    return (width + 3) // 4 * 4 + 4 * num_features


def _padded_columns(feature_meta: torch.Tensor, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(meta with each feature's padded first column, ``[width]`` int64: each output column's
    column in the padded layout), on ``feature_meta``'s device."""
    cols, dims = feature_meta[:, META_OUT_COL], feature_meta[:, META_DIM]
    order = torch.argsort(cols)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    padded = (cols + 3) // 4 * 4 + 4 * rank
    meta = feature_meta.clone()
    meta[:, META_OUT_COL] = padded
    shift = (padded - cols)[order]
    index = torch.arange(width, device=feature_meta.device) + \
        torch.repeat_interleave(shift, dims[order], output_size=width)
    return meta, index


def _host_meta(feature_meta: torch.Tensor) -> Optional[torch.Tensor]:
    """The meta on the host; None where it cannot be read now (a CUDA graph is being captured: a
    read from the device would break the capture)."""
    if feature_meta.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return feature_meta.cpu()


def aligned_gradient(grad_output: torch.Tensor, feature_meta: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(gradient, feature_meta)`` for the backward's kernels: as given where every feature's
    gradient rows are already 16-byte aligned (width and columns multiples of 4, the start
    aligned); else the gradient copied into the padded layout and the meta with the padded
    columns. The group's features must cover its output's columns (as the module's layout does)."""
    batch, width = grad_output.shape
    if batch == 0 or feature_meta.shape[0] == 0:
        return grad_output, feature_meta
    key = id(feature_meta)
    layout = _CACHE.get(key)
    if layout is None or not layout.holds(feature_meta, width):
        host_meta = _host_meta(feature_meta)
        if host_meta is None:  # a capture: nothing cached (the meta is read after it)
            if width % 4 == 0:  # (its columns unknown: the gradient as given, read 4 bytes at a time)
                return grad_output, feature_meta
            meta, index = _padded_columns(feature_meta, width)  # (on the device, into the graph)
            return _padded(grad_output, feature_meta.shape[0], index), meta
        for k in [k for k, v in _CACHE.items() if v.meta_ref() is None]:  # (the dead modules' entries)
            del _CACHE[k]
        layout = _CACHE[key] = _MetaLayout(feature_meta, width, host_meta)
    if layout.aligned and grad_output.data_ptr() % 16 == 0 and grad_output.is_contiguous():
        return grad_output, feature_meta
    if layout.padding is None:
        meta, index = _padded_columns(layout.host_meta, width)
        layout.padding = (meta.to(feature_meta.device), index.to(feature_meta.device))
    meta, index = layout.padding
    return _padded(grad_output, feature_meta.shape[0], index), meta


_PADDED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the extension's pad_gradient_columns


def _padded(grad_output: torch.Tensor, num_features: int, index: torch.Tensor) -> torch.Tensor:
    """``grad_output`` copied into the padded layout (``index``: each column's padded column), by
    the CUDA extension's kernel where it is loaded: torch's ``index_copy_`` loaded torch's indexing
    kernels at its first launch in a process, ~22 ms of a first training step (perf-notes v60)."""
    batch, width = grad_output.shape
    grad, padded = grad_output.contiguous(), grad_output.new_empty(batch, padded_width(width, num_features))
    ext = cuda_ext.loaded() if grad.is_cuda and grad.dtype in _PADDED_DTYPES else None
    if ext is not None:
        ext.pad_gradient_columns(grad, index, padded)
    else:
        padded.index_copy_(1, index, grad)
    return padded
