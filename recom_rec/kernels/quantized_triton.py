"""Triton kernel of the quantized lookup: every table of a group, whatever its row type, in one
launch.

One program per (feature, block of bags), as the float forward (pooled_triton.py): it reads the
feature's row of ``feature_meta`` (dim, table's first byte, row stride, row type, output column,
pooling), walks its bags' ids in lock-step and dequantizes and accumulates their rows in fp32 with
fbgemm's arithmetic (quant/reference.py) of the device it runs on: on a GPU its CUDA kernels'
(an INT element dequantized to fp16, ``fma(w, v, acc)``), elsewhere its CPU kernels' (``fma(scale
* w, q, acc + bias * w)``); float rows ``fma(w, x, acc)``. The row type is uniform within a
program, so the branch on it is taken once per program, outside the loop over ids. The output row
is written once, in the output dtype.

Tables start on 128-byte lines and row strides are multiples of 16 bytes (quant/layout.py), so
every row starts on a 16-byte boundary, an INT row's data one word after its scale-and-bias word.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..ops.backends import triton_interpreting
from ..quant.layout import QMETA_WIDTH
from .grid_math import cdiv, next_power_of_2
from .pooled_triton import BATCH_COUNTS, _checked_bag_block, _dense, _report_bad_input


@triton.jit
def _fp16(bits16):
    return bits16.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _fp8_to_float(code):
    """fbgemm's hfp8 (4 exponent bits, bias 7, subnormals, no inf/NaN) to fp32, exactly."""
    e = (code >> 3) & 15
    m = code & 7
    significand = tl.where(e > 0, m + 8, m).to(tl.float32)
    # 2**(max(e, 1) - 10) built from its exponent bits (exact, no exp2 approximation).
    power = ((tl.maximum(e, 1) - 10 + 127) << 23).to(tl.float32, bitcast=True)
    v = significand * power
    return tl.where((code & 128) != 0, -v, v)


@triton.jit
def _half_of_exact_sum(s, bias):
    """``s + bias`` rounded once to fp16 (as fbgemm's CUDA kernels' fp16 ``hfma2`` rounds
    ``q * scale + bias``; ``s = q * scale`` is exact in fp32), computed in fp32: the fp32 sum
    ``t`` and its rounding error ``e`` (TwoSum); ``t`` rounded to fp16 is right unless ``t`` is
    a tie between two fp16 values and ``e`` leans to the other one. (Sums past the fp16 range
    give inf, except ties at its edge.)"""
    t = s + bias
    bp = t - s
    e = (s - (t - bp)) + (bias - bp)
    h = t.to(tl.float16).to(tl.float32)
    diff = t - h  # exact: t and h are within an fp16 step
    other = h + 2.0 * diff  # the fp16 neighbour when t is a tie
    tie = (diff != 0.0) & (other.to(tl.float16).to(tl.float32) == other)
    return tl.where(tie & (e * diff > 0.0), other, h)


@triton.jit
def _pool(flat_u8, flat_i32, flat_f16, flat_f32, values_ptr, weights_ptr, start, end, length, max_length, base,
          row_stride, dim, rows, flagged, KIND: tl.constexpr, CUDA_ARITHMETIC: tl.constexpr,
          HAS_WEIGHTS: tl.constexpr, REPORT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    """Sum of the bags' dequantized rows (weighted), [BLOCK_B, BLOCK_D] fp32 (columns past
    ``dim`` hold values the caller does not store), rows of type KIND (the RowType codes: 0 FP32,
    1 FP16, 2 FP8, 3 INT8, 4 INT4, 5 INT2); an id outside ``[0, rows)`` reads row 0. Also returns
    ``flagged`` with the bags that met such an id added (with REPORT).

    Each lane loads its own elements (a byte, or the byte holding its 4 or 2 bits; an fp16 or fp32
    element): no reshuffle of packed words between lanes. An INT row's fp16 scale and bias are its
    first word. CUDA_ARITHMETIC (1 or 2): INT rows dequantize as fbgemm's CUDA kernels do (``v =
    q * scale + bias`` rounded once to fp16, then ``fma(w, v, acc)``): 2 with the GPU's fp16 fma,
    1 emulated exactly in fp32 (the interpreter's numpy has no single-rounding fp16 fma; ~4x the
    instructions); 0: as its CPU kernels (``fma(scale * w, q, acc + bias * w)``)."""
    BITS: tl.constexpr = 32 if KIND == 0 else (16 if KIND == 1 else (8 if KIND <= 3 else (4 if KIND == 4 else 2)))
    PER_BYTE: tl.constexpr = 8 // BITS if BITS < 8 else 1
    HEADER_BYTES: tl.constexpr = 4 if KIND >= 3 else 0
    d = tl.arange(0, BLOCK_D)
    d_mask = d < dim
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    i = 0
    # A while loop: the interpreter cannot take a reduced value as a range bound.
    while i < max_length:
        live = i < length
        # Unmasked id loads: a bag past its end (or past the batch) reads a neighbouring bag's id,
        # whose row loads below are masked off. (A masked load of the ids feeding the row
        # addresses fails Triton 3.6's layout pass on sm_90: "mask type matches ptr type". The
        # loop runs only while some bag has ids, and the caller's bags lie within the values,
        # so values[0] exists.)
        pos = tl.minimum(start + i, tl.maximum(end - 1, 0))
        idx = tl.load(values_ptr + pos).to(tl.int64)
        out_of_table = (idx < 0) | (idx >= rows)
        if REPORT:
            flagged = flagged | (live & out_of_table)
        idx = tl.where(out_of_table, 0, idx)
        if HAS_WEIGHTS:
            wt = tl.where(live, tl.load(weights_ptr + pos).to(tl.float32), 0.0)
        else:
            wt = tl.full([BLOCK_B], 1.0, tl.float32)
        row = tl.multiple_of(base + idx * row_stride, 16)  # first byte of each bag's i-th row
        m = live[:, None] & d_mask[None, :]
        if KIND == 0:
            x = tl.load(flat_f32 + (row // 4)[:, None] + d[None, :], mask=m, other=0.0)
            acc = tl.fma(wt[:, None], x, acc)
        elif KIND == 1:
            x = tl.load(flat_f16 + (row // 2)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
            acc = tl.fma(wt[:, None], x, acc)
        else:
            byte = tl.load(flat_u8 + (row + HEADER_BYTES)[:, None] + (d // PER_BYTE)[None, :], mask=m,
                           other=0).to(tl.int32)
            if PER_BYTE == 1:
                codes = byte
            else:  # element k of a byte sits at bit k * BITS (little end first)
                codes = (byte >> ((d % PER_BYTE) * BITS)[None, :]) & ((1 << BITS) - 1)
            if KIND == 2:
                acc = tl.fma(wt[:, None], _fp8_to_float(codes), acc)
            else:
                header = tl.load(flat_i32 + row // 4, mask=live, other=0)  # fp16 scale, fp16 bias
                scale16 = _fp16(header & 0xFFFF)
                bias16 = _fp16((header >> 16) & 0xFFFF)
                scale = scale16.to(tl.float32)
                bias = bias16.to(tl.float32)
                if CUDA_ARITHMETIC == 2:  # compiled for a GPU: the fp16 fma itself (fma.rn.f16)
                    v = tl.fma(codes.to(tl.float16), scale16[:, None], bias16[:, None]).to(tl.float32)
                    acc = tl.fma(wt[:, None], v, acc)
                elif CUDA_ARITHMETIC == 1:
                    v = _half_of_exact_sum(codes.to(tl.float32) * scale[:, None], bias[:, None])
                    acc = tl.fma(wt[:, None], v, acc)
                else:
                    # bias * w as an fma with +0: a plain product would be contracted with the add
                    # below into one fma (Triton compiles with fp-contract=fast), which rounds once
                    # where fbgemm rounds twice. (It differs from bias * w only in a zero's sign.)
                    bias_w = tl.fma(bias, wt, 0.0)
                    acc = tl.fma((scale * wt)[:, None], codes.to(tl.float32), acc + bias_w[:, None])
        i += 1
    return acc, flagged


# (pooled_triton.BATCH_COUNTS: v53's stream of batch sizes 1-1024 compiled 3 variants of this
# kernel, 3.1 s of its first 100 INT8 requests)
@triton.jit(do_not_specialize=BATCH_COUNTS)
def _quantized_forward_kernel(
    flat_u8, flat_i32, flat_f16, flat_f32, values_ptr, offsets_ptr, weights_ptr, meta_ptr, key_index_ptr, out_ptr,
    batch_size, total_dim, num_values, last_offset, claim_ptr, report_ptr,
    META_W: tl.constexpr, CUDA_ARITHMETIC: tl.constexpr, HAS_WEIGHTS: tl.constexpr, REPORT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Ids outside their table read row 0, bags outside the values are empty, as in the float
    kernels (ops/input_check.py); REPORT: the first of them is reported."""
    f = tl.program_id(0)
    pid_b = tl.program_id(1)
    dim = tl.load(meta_ptr + f * META_W + 0)
    base = tl.load(meta_ptr + f * META_W + 1)
    col = tl.load(meta_ptr + f * META_W + 2)
    pooling = tl.load(meta_ptr + f * META_W + 3)
    rows = tl.load(meta_ptr + f * META_W + 4)
    row_stride = tl.load(meta_ptr + f * META_W + 5)
    kind = tl.load(meta_ptr + f * META_W + 6)
    key = tl.load(key_index_ptr + f).to(tl.int64)
    # flagged (REPORT): bags outside the values, then bags with a bad id
    b, b_mask, start, end, flagged = _checked_bag_block(offsets_ptr, key, pid_b, batch_size, num_values, last_offset,
                                                        claim_ptr, report_ptr, REPORT, BLOCK_B)
    length = end - start
    max_length = tl.max(length, axis=0)
    if kind == 3:
        acc, flagged = _pool(flat_u8, flat_i32, flat_f16, flat_f32, values_ptr, weights_ptr, start, end, length,
                             max_length, base, row_stride, dim, rows, flagged, 3, CUDA_ARITHMETIC, HAS_WEIGHTS, REPORT,
                             BLOCK_B, BLOCK_D)
    elif kind == 4:
        acc, flagged = _pool(flat_u8, flat_i32, flat_f16, flat_f32, values_ptr, weights_ptr, start, end, length,
                             max_length, base, row_stride, dim, rows, flagged, 4, CUDA_ARITHMETIC, HAS_WEIGHTS, REPORT,
                             BLOCK_B, BLOCK_D)
    elif kind == 1:
        acc, flagged = _pool(flat_u8, flat_i32, flat_f16, flat_f32, values_ptr, weights_ptr, start, end, length,
                             max_length, base, row_stride, dim, rows, flagged, 1, CUDA_ARITHMETIC, HAS_WEIGHTS, REPORT,
                             BLOCK_B, BLOCK_D)
    elif kind == 5:
        acc, flagged = _pool(flat_u8, flat_i32, flat_f16, flat_f32, values_ptr, weights_ptr, start, end, length,
                             max_length, base, row_stride, dim, rows, flagged, 5, CUDA_ARITHMETIC, HAS_WEIGHTS, REPORT,
                             BLOCK_B, BLOCK_D)
    elif kind == 2:
        acc, flagged = _pool(flat_u8, flat_i32, flat_f16, flat_f32, values_ptr, weights_ptr, start, end, length,
                             max_length, base, row_stride, dim, rows, flagged, 2, CUDA_ARITHMETIC, HAS_WEIGHTS, REPORT,
                             BLOCK_B, BLOCK_D)
    else:
        acc, flagged = _pool(flat_u8, flat_i32, flat_f16, flat_f32, values_ptr, weights_ptr, start, end, length,
                             max_length, base, row_stride, dim, rows, flagged, 0, CUDA_ARITHMETIC, HAS_WEIGHTS, REPORT,
                             BLOCK_B, BLOCK_D)
    if REPORT:
        _report_bad_input(claim_ptr, report_ptr, values_ptr, offsets_ptr, key_index_ptr, meta_ptr, batch_size, flagged,
                          num_values, META_W, BLOCK_B)
    # fbgemm multiplies by 1/L (not a division by L), 1/L rounded correctly (Triton's "/" on fp32
    # is the approximate division); an empty bag stays 0.
    inv_len = tl.math.div_rn(tl.full([BLOCK_B], 1.0, tl.float32), tl.maximum(length, 1).to(tl.float32))
    acc = tl.where(pooling == 1, acc * inv_len[:, None], acc)
    d = tl.arange(0, BLOCK_D)
    tl.store(out_ptr + b[:, None] * total_dim + col + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=b_mask[:, None] & (d[None, :] < dim))


def block_shape(max_dim: int, batch_size: int):
    """(BLOCK_B, BLOCK_D, num_warps): small tiles, ~512 elements (at most 8 bags), one warp. The
    kernel is bound by its chains of dependent loads (offsets, id, row), so many small programs
    keep more rows in flight than few large ones. Measured on the H100 (tools/quant_tiles.py,
    docs/perf-notes.md v25, and "Quantized inference v2" for 2K-16K tiles with 2-8 warps): as
    fast as or faster than ~1K-element tiles on every inference workload and row type, by 10-18%
    with INT4 rows. One tile for every batch size, so a server's batches share one compiled kernel:
    a tile per batch class (BLOCK_B clipped to the batch) compiled again for each, 1.0-1.3 s of a
    stream's first 100 requests, and batches of 1-16 ran as fast either way (v60). ``batch_size``
    stays in the signature for the rules tools/quant_tiles.py compares."""
    block_d = max(16, next_power_of_2(int(max_dim)))
    return max(1, min(8, 512 // block_d)), block_d, 1


def _rounding(cuda_arithmetic: bool) -> int:
    """The kernel's CUDA_ARITHMETIC: fbgemm's CUDA rounding with the fp16 fma when compiled (2),
    emulated in fp32 under the interpreter (1); its CPU rounding (0)."""
    if not cuda_arithmetic:
        return 0
    return 1 if triton_interpreting() else 2


def forward(flat: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, per_sample_weights, feature_meta: torch.Tensor,
            key_index: torch.Tensor, batch_size: int, total_dim: int, max_dim: int, output_dtype: torch.dtype,
            wrap=None, cuda_arithmetic: Optional[bool] = None, check=None) -> torch.Tensor:
    """Launches the kernel; ``wrap`` is ``torch.library.wrap_triton`` when the launch is to be
    traced (the custom op under torch.compile / AOTInductor: Inductor then compiles the kernel
    into its own code). ``cuda_arithmetic`` (default: on a GPU) gives fbgemm's CUDA results
    rather than its CPU ones (they differ in INT rows' rounding; see _pool). ``check``: an
    input_check.KernelReport to report bad ids and bags to (they are clamped either way)."""
    num_features = feature_meta.shape[0]
    if num_features == 0 or batch_size == 0:
        return torch.zeros(batch_size, total_dim, dtype=output_dtype, device=flat.device)
    out = torch.empty(batch_size, total_dim, dtype=output_dtype, device=flat.device)
    # the kernel indexes the batch's tensors densely (a KJT may hold views)
    values, offsets, per_sample_weights = _dense(values, offsets, per_sample_weights)
    block_b, block_d, num_warps = block_shape(max_dim, batch_size)
    words, halves, floats = flat.view(torch.int32), flat.view(torch.float16), flat.view(torch.float32)
    weights = per_sample_weights if per_sample_weights is not None else floats  # (not read)
    if check is not None:
        claim, report_words = check.claim, check.words
    elif wrap is None:
        claim = report_words = out  # (not written: REPORT is off)
    else:
        # Traced: every argument the kernel may write gets a tensor of its own. Functionalization
        # copies each such argument and writes the copies back in turn, so `out` passed again here
        # would end as its own unwritten copy (v45: the compiled module returned stale memory).
        claim, report_words = out.new_empty(0, dtype=torch.int32), out.new_empty(0, dtype=torch.int64)
    kernel = _quantized_forward_kernel if wrap is None else wrap(_quantized_forward_kernel)
    kernel[(num_features, cdiv(batch_size, block_b))](
        flat, words, halves, floats, values, offsets, weights, feature_meta, key_index,
        out, batch_size, total_dim, values.numel(), offsets.numel() - 1, claim, report_words,
        META_W=QMETA_WIDTH, CUDA_ARITHMETIC=_rounding(flat.is_cuda if cuda_arithmetic is None else cuda_arithmetic),
        HAS_WEIGHTS=per_sample_weights is not None, REPORT=check is not None, BLOCK_B=block_b, BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return out
