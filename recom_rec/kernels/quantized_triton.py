"""Triton kernel of the quantized lookup: every table of a group, whatever its row type, in one
launch.

One program per (feature, block of bags), as the float forward (pooled_triton.py): it reads the
feature's row of ``feature_meta`` (dim, table's first byte, row stride, row type, output column,
pooling), walks its bags' ids in lock-step and dequantizes and accumulates their rows in fp32 with
fbgemm's arithmetic (quant/reference.py): ``fma(scale * w, q, acc + bias * w)`` for INT rows,
``fma(w, x, acc)`` for float rows. The row type is uniform within a program, so the branch on it
is taken once per program, outside the loop over ids. The output row is written once, in the
output dtype.

The buffer is passed as bytes and as fp16 and fp32 views of the same memory: FP16 and FP32 rows
are read as elements (their rows start on element boundaries: tables start on 128-byte lines and
row strides are multiples of the element size), INT rows' scale and bias as bytes (a row stride
of an INT row need not be even).
"""
import torch
import triton
import triton.language as tl

from ..quant.layout import QMETA_WIDTH


@triton.jit
def _scale_bias(row, live):
    """fp32 scale and bias of rows starting at byte pointers ``row`` ([BLOCK_B])."""
    s = tl.load(row, mask=live, other=0).to(tl.int32) | (tl.load(row + 1, mask=live, other=0).to(tl.int32) << 8)
    b = tl.load(row + 2, mask=live, other=0).to(tl.int32) | (tl.load(row + 3, mask=live, other=0).to(tl.int32) << 8)
    scale = s.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    bias = b.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return scale, bias


@triton.jit
def _fp8_to_float(code):
    """fbgemm's hfp8 (4 exponent bits, bias 7, subnormals, no inf/NaN) to fp32, exactly."""
    c = code.to(tl.int32)
    e = (c >> 3) & 15
    m = c & 7
    significand = tl.where(e > 0, m + 8, m).to(tl.float32)
    # 2**(max(e, 1) - 10) built from its exponent bits (exact, no exp2 approximation).
    power = ((tl.maximum(e, 1) - 10 + 127) << 23).to(tl.float32, bitcast=True)
    v = significand * power
    return tl.where((c & 128) != 0, -v, v)


@triton.jit
def _pool(flat_u8, flat_f16, flat_f32, values_ptr, weights_ptr, start, length, max_length, base, row_bytes, d, d_mask,
          KIND: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    """Sum of the bags' dequantized rows (weighted), [BLOCK_B, BLOCK_D] fp32, rows of type KIND
    (the RowType codes: 0 FP32, 1 FP16, 2 FP8, 3 INT8, 4 INT4, 5 INT2)."""
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    i = 0
    # A while loop: the interpreter cannot take a reduced value as a range bound.
    while i < max_length:
        live = i < length
        idx = tl.load(values_ptr + start + i, mask=live, other=0).to(tl.int64)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + start + i, mask=live, other=0.0).to(tl.float32)
        else:
            w = tl.full([BLOCK_B], 1.0, tl.float32)
        row = base + idx * row_bytes  # first byte of each bag's i-th row
        m = live[:, None] & d_mask[None, :]
        if KIND == 0:
            x = tl.load(flat_f32 + (row // 4)[:, None] + d[None, :], mask=m, other=0.0)
            acc = tl.fma(w[:, None], x, acc)
        elif KIND == 1:
            x = tl.load(flat_f16 + (row // 2)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
            acc = tl.fma(w[:, None], x, acc)
        elif KIND == 2:
            x = _fp8_to_float(tl.load(flat_u8 + row[:, None] + d[None, :], mask=m, other=0))
            acc = tl.fma(w[:, None], x, acc)
        else:
            scale, bias = _scale_bias(flat_u8 + row, live)
            data = flat_u8 + row + 4
            if KIND == 3:
                q = tl.load(data[:, None] + d[None, :], mask=m, other=0).to(tl.float32)
            elif KIND == 4:
                byte = tl.load(data[:, None] + (d // 2)[None, :], mask=m, other=0).to(tl.int32)
                q = ((byte >> ((d % 2) * 4)[None, :]) & 15).to(tl.float32)
            else:
                byte = tl.load(data[:, None] + (d // 4)[None, :], mask=m, other=0).to(tl.int32)
                q = ((byte >> ((d % 4) * 2)[None, :]) & 3).to(tl.float32)
            acc = tl.fma((scale * w)[:, None], q, acc + (bias * w)[:, None])
        i += 1
    return acc


@triton.jit
def _quantized_forward_kernel(
    flat_u8, flat_f16, flat_f32, values_ptr, offsets_ptr, weights_ptr, meta_ptr, key_index_ptr, out_ptr,
    batch_size, total_dim,
    META_W: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):
    f = tl.program_id(0)
    pid_b = tl.program_id(1)
    dim = tl.load(meta_ptr + f * META_W + 0)
    base = tl.load(meta_ptr + f * META_W + 1)
    col = tl.load(meta_ptr + f * META_W + 2)
    pooling = tl.load(meta_ptr + f * META_W + 3)
    row_bytes = tl.load(meta_ptr + f * META_W + 5)
    kind = tl.load(meta_ptr + f * META_W + 6)
    key = tl.load(key_index_ptr + f).to(tl.int64)
    b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    b_mask = b < batch_size
    bag = key * batch_size + b
    start = tl.load(offsets_ptr + bag, mask=b_mask, other=0).to(tl.int64)
    length = tl.load(offsets_ptr + bag + 1, mask=b_mask, other=0).to(tl.int64) - start
    max_length = tl.max(length, axis=0)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < dim
    if kind == 3:
        acc = _pool(flat_u8, flat_f16, flat_f32, values_ptr, weights_ptr, start, length, max_length, base, row_bytes,
                    d, d_mask, 3, HAS_WEIGHTS, BLOCK_B, BLOCK_D)
    elif kind == 4:
        acc = _pool(flat_u8, flat_f16, flat_f32, values_ptr, weights_ptr, start, length, max_length, base, row_bytes,
                    d, d_mask, 4, HAS_WEIGHTS, BLOCK_B, BLOCK_D)
    elif kind == 1:
        acc = _pool(flat_u8, flat_f16, flat_f32, values_ptr, weights_ptr, start, length, max_length, base, row_bytes,
                    d, d_mask, 1, HAS_WEIGHTS, BLOCK_B, BLOCK_D)
    elif kind == 5:
        acc = _pool(flat_u8, flat_f16, flat_f32, values_ptr, weights_ptr, start, length, max_length, base, row_bytes,
                    d, d_mask, 5, HAS_WEIGHTS, BLOCK_B, BLOCK_D)
    elif kind == 2:
        acc = _pool(flat_u8, flat_f16, flat_f32, values_ptr, weights_ptr, start, length, max_length, base, row_bytes,
                    d, d_mask, 2, HAS_WEIGHTS, BLOCK_B, BLOCK_D)
    else:
        acc = _pool(flat_u8, flat_f16, flat_f32, values_ptr, weights_ptr, start, length, max_length, base, row_bytes,
                    d, d_mask, 0, HAS_WEIGHTS, BLOCK_B, BLOCK_D)
    # fbgemm multiplies by 1/L (not a division by L); an empty bag stays 0.
    inv_len = 1.0 / tl.maximum(length, 1).to(tl.float32)
    acc = tl.where(pooling == 1, acc * inv_len[:, None], acc)
    tl.store(out_ptr + b[:, None] * total_dim + col + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=b_mask[:, None] & d_mask[None, :])


def block_shape(max_dim: int):
    """(BLOCK_B, BLOCK_D, num_warps): ~4K-element tiles (the float forward's H100 sweep,
    docs/perf-notes.md, halved: a quantized row adds its decode to the registers it needs)."""
    block_d = max(16, triton.next_power_of_2(int(max_dim)))
    block_b = max(4, min(64, 4096 // block_d))
    return block_b, block_d, (2 if block_d >= 128 else 4)


def forward(flat: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, per_sample_weights, feature_meta: torch.Tensor,
            key_index: torch.Tensor, batch_size: int, total_dim: int, max_dim: int, output_dtype: torch.dtype,
            wrap=None) -> torch.Tensor:
    """Launches the kernel; ``wrap`` is ``torch.library.wrap_triton`` when the launch is to be
    traced (the custom op under torch.compile / AOTInductor: Inductor then compiles the kernel
    into its own code)."""
    out = torch.empty(batch_size, total_dim, dtype=output_dtype, device=flat.device)
    num_features = feature_meta.shape[0]
    if num_features == 0 or batch_size == 0:
        return out.zero_()
    block_b, block_d, num_warps = block_shape(max_dim)
    weights = per_sample_weights if per_sample_weights is not None else out
    kernel = _quantized_forward_kernel if wrap is None else wrap(_quantized_forward_kernel)
    kernel[(num_features, triton.cdiv(batch_size, block_b))](
        flat, flat.view(torch.float16), flat.view(torch.float32), values, offsets, weights, feature_meta, key_index,
        out, batch_size, total_dim,
        META_W=QMETA_WIDTH, HAS_WEIGHTS=per_sample_weights is not None, BLOCK_B=block_b, BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return out
