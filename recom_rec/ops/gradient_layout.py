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
plus 4 a feature. The padded columns are computed on the device from ``feature_meta``, once per
meta tensor, as is whether its columns are aligned (that one read on the host). The padding columns
are left unwritten: no kernel reads a column past its feature's dim.
"""
import weakref
from typing import Dict, Optional, Tuple

import torch

from .layout import META_DIM, META_OUT_COL


class _MetaLayout:
    """What one meta tensor's features need: whether their columns are all aligned, and the padded
    layout (meta, column index), computed when first needed."""

    def __init__(self, meta: torch.Tensor, width: int, aligned: bool) -> None:
        self.meta_ref, self.version, self.width, self.aligned = weakref.ref(meta), meta._version, width, aligned
        self.padding: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def holds(self, meta: torch.Tensor, width: int) -> bool:
        return self.meta_ref() is meta and self.version == meta._version and self.width == width


_CACHE: Dict[int, _MetaLayout] = {}  # id(meta) -> its layout


def padded_width(width: int, num_features: int) -> int:
    """The padded gradient's width: the output's, rounded up to 4, plus 4 a feature."""
    return (width + 3) // 4 * 4 + 4 * num_features


def _padded_columns(feature_meta: torch.Tensor, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(meta with each feature's padded first column, ``[width]`` int64: each output column's
    column in the padded layout)."""
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


def _columns_aligned(feature_meta: torch.Tensor) -> Optional[bool]:
    """Whether every feature's output column is a multiple of 4; None where it cannot be read now
    (a CUDA graph is being captured: a read from the device would break the capture)."""
    if feature_meta.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return bool((feature_meta[:, META_OUT_COL] % 4 == 0).all())


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
        aligned = _columns_aligned(feature_meta) if width % 4 == 0 else False
        if aligned is None:  # (not cached: read after the capture)
            return grad_output, feature_meta
        for k in [k for k, v in _CACHE.items() if v.meta_ref() is None]:  # (the dead modules' entries)
            del _CACHE[k]
        layout = _CACHE[key] = _MetaLayout(feature_meta, width, aligned)
    if layout.aligned and grad_output.data_ptr() % 16 == 0 and grad_output.is_contiguous():
        return grad_output, feature_meta
    if layout.padding is None:
        layout.padding = _padded_columns(feature_meta, width)
    meta, index = layout.padding
    padded = grad_output.new_empty(batch, padded_width(width, feature_meta.shape[0]))
    padded.index_copy_(1, index, grad_output.contiguous())
    return padded, meta
