"""Row formats of quantized tables, byte for byte fbgemm's IntN TBE (``SparseType``) layout.

A row is ``[header][elements][padding]``, padded to ``row_alignment`` bytes (torchrec's default
is 16):

* INT8 / INT4 / INT2: a 4-byte header, the row's fp16 scale then fp16 bias, then the elements
  packed little end first (INT4: element 2k in the low nibble of byte k; INT2: element 4k in the
  two low bits); an element dequantizes to ``scale * q + bias``.
* FP16, FP32: the row as IEEE halves / floats.
* FP8: fbgemm's "hfp8" byte (1 sign, 4 exponent bits with bias 7, 3 mantissa bits, subnormals, no
  inf/NaN: code 0x7f is 480), the same bits as ``float8_e4m3fn`` except that code.
"""
from enum import IntEnum
from typing import Optional, Tuple

import torch
from torchrec.modules.embedding_configs import DataType

SCALE_BIAS_BYTES = 4
DEFAULT_ROW_ALIGNMENT = 16  # torchrec's DEFAULT_ROW_ALIGNMENT
TABLE_ALIGNMENT = 128  # fbgemm starts each table on a cache line
FP8_EXPONENT_BITS = 4  # SparseType.FP8.default_config()
FP8_EXPONENT_BIAS = 7
FP8_MAX = 480.0  # (2 - 2**-3) * 2**(15 - 7)


class RowType(IntEnum):
    """Codes the kernels read from the per-feature metadata."""

    FP32 = 0
    FP16 = 1
    FP8 = 2
    INT8 = 3
    INT4 = 4
    INT2 = 5

    @property
    def bits(self) -> int:
        return {RowType.FP32: 32, RowType.FP16: 16, RowType.FP8: 8, RowType.INT8: 8, RowType.INT4: 4,
                RowType.INT2: 2}[self]

    @property
    def has_scale_bias(self) -> bool:
        return self in (RowType.INT8, RowType.INT4, RowType.INT2)


_FROM_DATA_TYPE = {
    DataType.FP32: RowType.FP32, DataType.FP16: RowType.FP16, DataType.INT8: RowType.INT8,
    DataType.UINT8: RowType.INT8, DataType.INT4: RowType.INT4, DataType.INT2: RowType.INT2,
}
if hasattr(DataType, "NFP8"):  # torchrec >= 1.7 names 8-bit float rows NFP8
    _FROM_DATA_TYPE[DataType.NFP8] = RowType.FP8


def row_type(data_type: DataType, table: str = "?") -> RowType:
    if data_type not in _FROM_DATA_TYPE:
        raise ValueError(
            f"table {table!r}: data_type {data_type} has no quantized row format; use one of "
            f"{', '.join(str(d) for d in _FROM_DATA_TYPE)}"
        )
    return _FROM_DATA_TYPE[data_type]


def data_bytes(kind: RowType, dim: int) -> int:
    """Bytes of a row's elements (no header, no padding)."""
    return dim * kind.bits // 8


def unpadded_row_bytes(kind: RowType, dim: int) -> int:
    return data_bytes(kind, dim) + (SCALE_BIAS_BYTES if kind.has_scale_bias else 0)


def row_bytes(kind: RowType, dim: int, row_alignment: int) -> int:
    r = unpadded_row_bytes(kind, dim)
    return -(-r // row_alignment) * row_alignment


def check_dim(kind: RowType, dim: int, table: str) -> None:
    """INT rows pack 8 / bits elements a byte, in an even number of bytes (fbgemm's quantizer
    writes the fp16 scale and bias right after them)."""
    multiple = 2 * 8 // kind.bits if kind.has_scale_bias else 1
    if dim <= 0 or dim % multiple:
        raise ValueError(f"table {table!r}: embedding_dim {dim} does not fit {kind.name} rows; "
                         f"it must be a positive multiple of {multiple}")


# ---- float -> rows -------------------------------------------------------------------------------
def _fbgemm_op(name: str):
    import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm

    return getattr(torch.ops.fbgemm, name)


QUANTIZE_BLOCK_ELEMENTS = 1 << 30


def quantize_rows(weight: torch.Tensor, kind: RowType) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(elements [rows, data_bytes] uint8, scale_bias [rows, 4] uint8 or None)`` of a float
    table, by fbgemm's own quantizers (the numbers torchrec's ``from_float`` stores)."""
    w = weight.detach()
    if w.dtype not in (torch.float32, torch.float16):
        w = w.float()
    if kind == RowType.FP32:
        return w.float().contiguous().view(torch.uint8), None
    if kind == RowType.FP16:
        return w.half().contiguous().view(torch.uint8), None
    if kind == RowType.FP8:
        q = _fbgemm_op("FloatToHFP8Quantized")(w.float().contiguous(), FP8_EXPONENT_BITS, FP8_EXPONENT_BIAS, FP8_MAX)
        return q.view(torch.uint8), None
    quantizer = _fbgemm_op("FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf")
    # fbgemm's CUDA quantizer indexes elements in 32 bits: a table of 2**31 elements or more (10M
    # rows x 256) faults. Its rows are independent: quantize blocks of them.
    rows_a_block = max(1, QUANTIZE_BLOCK_ELEMENTS // max(1, w.shape[1]))
    fused = torch.cat([quantizer(block.contiguous(), kind.bits) for block in w.split(rows_a_block)]) \
        if w.shape[0] > rows_a_block else quantizer(w.contiguous(), kind.bits)
    # fbgemm's quantizer puts the scale and bias last; the TBE's rows (and torchrec) put them first.
    return fused[:, :-SCALE_BIAS_BYTES], fused[:, -SCALE_BIAS_BYTES:]


def pack_rows(elements: torch.Tensor, scale_bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """Writes rows into ``out`` ([rows, row_bytes] uint8): header, elements, zero padding."""
    out.zero_()
    start = 0
    if scale_bias is not None:
        out[:, :SCALE_BIAS_BYTES].copy_(scale_bias)
        start = SCALE_BIAS_BYTES
    out[:, start:start + elements.shape[1]].copy_(elements)


# ---- rows -> float (pure torch; the reference and the CPU path use it) -----------------------------
def fp8_to_float(codes: torch.Tensor) -> torch.Tensor:
    """hfp8 (4 exponent bits, bias 7) bytes to fp32, exactly."""
    c = codes.to(torch.int32)
    mbits = 7 - FP8_EXPONENT_BITS
    exp = (c >> mbits) & ((1 << FP8_EXPONENT_BITS) - 1)
    mant = c & ((1 << mbits) - 1)
    # normal: (8 + m) * 2**(e - bias - 3); subnormal (e = 0): m * 2**(1 - bias - 3)
    significand = torch.where(exp > 0, mant + (1 << mbits), mant).to(torch.float32)
    power = (torch.clamp(exp, min=1) - FP8_EXPONENT_BIAS - mbits).to(torch.float32)
    value = significand * torch.exp2(power)
    return torch.where((c & 0x80) != 0, -value, value)


def unpack_elements(row_data: torch.Tensor, kind: RowType, dim: int) -> torch.Tensor:
    """``[n, dim]`` fp32 element values (integer codes for INT types) of rows' element bytes
    ``[n, >= data_bytes]`` uint8."""
    n = row_data.shape[0]
    data = row_data[:, :data_bytes(kind, dim)].contiguous()
    if kind == RowType.FP32:
        return data.view(torch.float32).reshape(n, dim)
    if kind == RowType.FP16:
        return data.view(torch.float16).reshape(n, dim).float()
    if kind == RowType.FP8:
        return fp8_to_float(data)
    if kind == RowType.INT8:
        return data.float()
    bits = kind.bits
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=data.device, dtype=torch.int32) * bits
    codes = (data.to(torch.int32)[:, :, None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(n, dim).float()


def scale_bias_of(header: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 scale and bias ``[n]`` from rows' 4-byte headers ``[n, >= 4]`` uint8."""
    sb = header[:, :SCALE_BIAS_BYTES].contiguous().view(torch.float16).float()
    return sb[:, 0], sb[:, 1]
