"""The quantized lookup (recom_rec::quantized_pooled_lookup): the vectorised torch path and the
Triton kernel (interpreted) against the pure-torch dequantize-then-pool reference, and all of them
against fbgemm's own CPU IntN TBE."""
import pytest
import torch

from recom_rec.ops.quantized_lookup import quantized_pooled_lookup
from recom_rec.ops.backends import triton_interpreting
from recom_rec.ops.validation import encode_names
from recom_rec.quant.reference import reference_quantized_pooled
from recom_rec.quant.rows import RowType

from quant_cases import random_case
from ebc_cases import DEVICE


def _names(case):
    keys = [f"f{i}" for i in range((case.offsets.numel() - 1) // case.batch_size)]
    tables = case.meta[:, 7].tolist()
    return encode_names(keys, [keys[k] for k in case.key_index.tolist()], [f"t{t}" for t in tables])


def _run(case, output_dtype, backend):
    return quantized_pooled_lookup(case.flat, case.values, case.offsets, case.weights, case.meta, case.key_index,
                                   case.batch_size, case.total_dim, case.max_dim, output_dtype, backend, True,
                                   _names(case))


def _reference(case, output_dtype, arithmetic="cpu"):
    return reference_quantized_pooled(case.flat.cpu(), case.meta.cpu(), case.key_index.cpu(), case.values.cpu(),
                                      case.offsets.cpu(), None if case.weights is None else case.weights.cpu(),
                                      case.batch_size, case.total_dim, output_dtype, arithmetic)


def _on_gpu(case):
    for name in ("flat", "meta", "key_index", "values", "offsets", "weights"):
        t = getattr(case, name)
        setattr(case, name, t.cuda() if t is not None else None)
    return case


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("output_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_path_equals_reference_bit_for_bit(seed, weighted, output_dtype):
    case = random_case(seed, weighted)
    out = _run(case, output_dtype, "torch")
    assert out.dtype == output_dtype and out.shape == (case.batch_size, case.total_dim)
    assert torch.equal(_bits(out), _bits(_reference(case, output_dtype)))


@pytest.mark.skipif(not triton_interpreting(), reason="the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("output_dtype", [torch.float32, torch.float16])
def test_triton_kernel_matches_reference(seed, weighted, output_dtype):
    case = random_case(100 + seed, weighted)
    out = _run(case, output_dtype, "triton")
    ref = _reference(case, output_dtype)
    # The interpreter evaluates fma as a rounded product plus a sum; compiled, it is one rounding
    # (the GPU test checks bits).
    tol = dict(rtol=1e-5, atol=1e-5) if output_dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.skipif(not triton_interpreting(), reason="the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("batch_size", [1, 3, 70])
def test_triton_kernel_online_and_odd_batches(batch_size):
    """Tiles sized by the batch (one bag a program at batch 1) and a batch across two tiles."""
    case = random_case(11, True, batch_size=batch_size, max_len=3)
    torch.testing.assert_close(_run(case, torch.float32, "triton"), _reference(case, torch.float32),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not triton_interpreting(), reason="the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", list(RowType))
@pytest.mark.parametrize("row_alignment", [16, 4])
def test_triton_kernel_each_row_type(kind, row_alignment):
    case = random_case(7, True, kinds=[kind], num_tables=2, row_alignment=row_alignment)
    torch.testing.assert_close(_run(case, torch.float32, "triton"), _reference(case, torch.float32),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not triton_interpreting(), reason="the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("pooling", [0, 1])
def test_triton_kernel_cuda_arithmetic_matches_reference(seed, weighted, pooling):
    """The rounding of fbgemm's CUDA kernels (INT elements to fp16 first), run by the interpreter:
    bit for bit without weights (with weights the interpreter rounds its fma twice)."""
    from recom_rec.kernels import quantized_triton

    case = random_case(400 + seed, weighted, pooling=pooling)
    out = quantized_triton.forward(case.flat, case.values, case.offsets, case.weights, case.meta, case.key_index,
                                   case.batch_size, case.total_dim, case.max_dim, torch.float32, cuda_arithmetic=True)
    ref = _reference(case, torch.float32, "cuda")
    if weighted:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(_bits(out), _bits(ref))
    assert not torch.equal(ref, _reference(case, torch.float32, "cpu"))  # the two roundings do differ here


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("output_dtype", [torch.float32, torch.float16])
def test_triton_kernel_on_gpu_equals_reference_bit_for_bit(seed, weighted, output_dtype):
    case = random_case(200 + seed, weighted, batch_size=300, max_len=12)
    out = _run(_on_gpu(case), output_dtype, "triton").cpu()
    assert torch.equal(_bits(out), _bits(_reference(case, output_dtype, "cuda")))


def test_bad_id_names_feature_and_table():
    case = random_case(3, False)
    case.values = case.values.clone()
    case.values[0] = 10_000
    first_key = int(torch.nonzero(case.offsets[1:] > 0)[0, 0]) // case.batch_size
    with pytest.raises(ValueError, match=rf"feature 'f{first_key}' \(table 't\d'\): id 10000"):
        _run(case, torch.float32, "torch")


def _fbgemm_tbe_output(case, output_dtype, pooling, device="cpu"):
    """fbgemm's IntN TBE (CPU, or CUDA) on the same rows: its pooled output, in our output columns."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    sparse = {RowType.FP32: SparseType.FP32, RowType.FP16: SparseType.FP16, RowType.FP8: SparseType.FP8,
              RowType.INT8: SparseType.INT8, RowType.INT4: SparseType.INT4, RowType.INT2: SparseType.INT2}
    out_sparse = {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16}[output_dtype]
    tables = case.meta[:, 7].tolist()
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        [(s.name, s.num_embeddings, s.embedding_dim, sparse[s.kind],
          EmbeddingLocation.HOST if device == "cpu" else EmbeddingLocation.DEVICE) for s in case.slots],
        feature_table_map=tables, pooling_mode=PoolingMode.MEAN if pooling else PoolingMode.SUM,
        device=device, output_dtype=out_sparse, row_alignment=case.row_alignment,
    )
    tbe.initialize_weights()
    for s, (rows, _) in zip(case.slots, tbe.split_embedding_weights(split_scale_shifts=False)):
        rows.copy_(s.rows_of(case.flat))
    B = case.batch_size
    per_feature = [(case.offsets[k * B:(k + 1) * B + 1]) for k in case.key_index.tolist()]
    indices = torch.cat([case.values[o[0]:o[-1]] for o in per_feature])
    lengths = torch.cat([o[1:] - o[:-1] for o in per_feature])
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    weights = None
    if case.weights is not None:
        weights = torch.cat([case.weights[o[0]:o[-1]] for o in per_feature])
    to = (lambda t: t if t is None else t.to(device))
    pooled = tbe(to(indices), to(offsets), to(weights)).cpu()
    out = torch.empty(B, case.total_dim, dtype=output_dtype)
    col = 0
    for f in range(case.meta.shape[0]):
        dim, our_col = int(case.meta[f, 0]), int(case.meta[f, 2])
        out[:, our_col:our_col + dim] = pooled[:, col:col + dim]
        col += dim
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("pooling", [0, 1])
@pytest.mark.parametrize("output_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("row_alignment", [16, 1])
def test_equals_fbgemm_cpu_intn_tbe_bit_for_bit(seed, weighted, pooling, output_dtype, row_alignment):
    """Rows padded as fbgemm pads them (row_alignment 1: fbgemm's CPU default; our row stride is
    then longer than the row)."""
    case = random_case(300 + seed, weighted, pooling=pooling, batch_size=9, max_len=9, row_alignment=row_alignment)
    expected = _fbgemm_tbe_output(case, output_dtype, pooling)
    assert torch.equal(_bits(_run(case, output_dtype, "torch")), _bits(expected))
    assert torch.equal(_bits(_reference(case, output_dtype)), _bits(expected))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("pooling", [0, 1])
@pytest.mark.parametrize("output_dtype", [torch.float32, torch.float16])
def test_equals_fbgemm_cuda_intn_tbe_bit_for_bit(seed, weighted, pooling, output_dtype):
    """On a GPU, the kernel gives fbgemm's CUDA IntN TBE's numbers (rows padded to 16 bytes, as
    fbgemm's GPU kernels need), and the reference's everywhere. Except INT2 rows with fp32 output:
    there fbgemm 1.6's CUDA TBE gives other sums, nonzero ones for empty bags among them, the same
    on every call (H100; fp16 output matches; docs/quantized.md, "Known gaps")."""
    case = random_case(500 + seed, weighted, pooling=pooling, batch_size=33, max_len=9, row_alignment=16)
    expected = _fbgemm_tbe_output(case, output_dtype, pooling, device="cuda")
    out = _run(_on_gpu(case), output_dtype, "triton").cpu()
    assert torch.equal(_bits(out), _bits(_reference(case, output_dtype, "cuda")))
    compared = torch.ones(case.total_dim, dtype=torch.bool)
    if output_dtype == torch.float32:
        for f in range(case.meta.shape[0]):
            if int(case.meta[f, 6]) == int(RowType.INT2):
                compared[int(case.meta[f, 2]):int(case.meta[f, 2]) + int(case.meta[f, 0])] = False
    assert compared.any()
    assert torch.equal(_bits(out)[:, compared], _bits(expected)[:, compared])


@pytest.mark.parametrize("weighted", [False, True])
def test_the_op_passes_torch_library_opcheck(weighted):
    """Schema, fake kernel and tracing (AOTDispatcher, static and dynamic shapes) against eager on
    the module's device: on CUDA the traced path is the Triton kernel wrapped for Inductor, whose
    arguments the tracer functionalizes (an output passed twice came back stale there, v45)."""
    case = random_case(7, weighted)
    if DEVICE.type == "cuda":
        case = _on_gpu(case)
    args = (case.flat, case.values, case.offsets, case.weights, case.meta, case.key_index, case.batch_size,
            case.total_dim, case.max_dim, torch.float32, "auto", False, "")
    torch.library.opcheck(torch.ops.recom_rec.quantized_pooled_lookup.default, args)
