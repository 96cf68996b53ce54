"""A Triton kernel compiles once per tile shape, not once per batch: the counts that change with
every batch (bags, ids, lookups) are not specialized on, so a server's varied batch sizes and a
training run's ragged batches compile no new variant after the first (v53: a stream of batch sizes
1-1024 compiled three variants of the quantized kernel inside its first 100 requests, 3.1 s).
Checked with Triton's own launch-time binder for an sm_90 target, which needs no GPU."""
import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from recom_rec.kernels.compile_check import _variants  # noqa: E402

# each kernel's arguments that a new batch changes; the others (strides, widths, feature counts)
# are fixed by the model and may stay specialized
BATCH_COUNTS = {
    "_pooled_forward_kernel": ("batch_size", "num_values", "last_offset"),
    "_expand_kernel": ("batch_size", "num_values", "last_offset", "n"),
    "_plan_kernel": ("n",),
    "_piece_kernel": ("n",),
    "_split_row_kernel": ("n",),
    "_unpooled_forward_kernel": ("num_outputs", "num_values"),
    "_row_key_kernel": ("num_outputs", "num_values"),
    "_quantized_forward_kernel": ("batch_size", "num_values", "last_offset"),
    "_expand_forward_kernel": ("batch", "inverse_stride", "num_bags"),
    "_moved_features_kernel": ("batch", "inverse_stride"),
    "_expand_backward_kernel": ("batch", "inverse_stride", "num_bags"),
    "_pad_offsets_kernel": ("width", "bags", "n"),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int32,
          "i64": torch.int64, "u8": torch.uint8}
COUNTS = (1, 2, 3, 15, 16, 17, 32, 1000, 1024, 4096)


def _first_variant_of_each_kernel():
    seen = {}
    for kernel, signature, constexprs, _ in _variants():
        seen.setdefault(kernel.__name__, (kernel, signature, constexprs))
    return seen


VARIANTS = _first_variant_of_each_kernel()


def test_every_kernel_the_package_compiles_is_listed():
    """(a new kernel states which of its arguments change with a batch)"""
    assert set(VARIANTS) == set(BATCH_COUNTS)


def _jitted(kernel) -> JITFunction:
    """The kernel as compiled for a GPU: under TRITON_INTERPRET (the CPU suite) the decorator made
    an interpreted function, which keeps the decorator's arguments to build it from."""
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)


def _specialization(kernel, signature, constexprs, ints):
    kernel = _jitted(kernel)
    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    args = {}
    for name, kind in signature.items():
        args[name] = torch.zeros(64, dtype=DTYPES[kind[1:]]) if kind.startswith("*") else ints.get(name, 24)
    return str(binder(**args, **constexprs)[1])


@pytest.mark.parametrize("name", sorted(BATCH_COUNTS))
def test_a_new_batch_compiles_no_new_variant(name):
    kernel, signature, constexprs = VARIANTS[name]
    keys = {_specialization(kernel, signature, constexprs, {arg: count for arg in BATCH_COUNTS[name]})
            for count in COUNTS}
    assert len(keys) == 1, f"{name}: {len(keys)} variants over counts {COUNTS}"


@pytest.mark.parametrize("name", sorted(n for n in BATCH_COUNTS if set(VARIANTS[n][1]) - set(BATCH_COUNTS[n])
                                        - {a for a, k in VARIANTS[n][1].items() if k.startswith("*")}))
def test_the_model_fixed_integers_stay_specialized(name):
    """(the binder does specialize: a stride that is a multiple of 16 still makes its own variant)"""
    kernel, signature, constexprs = VARIANTS[name]
    fixed = [a for a, k in signature.items() if not k.startswith("*") and a not in BATCH_COUNTS[name]]
    keys = {_specialization(kernel, signature, constexprs, {a: v for a in fixed}) for v in (16, 17)}
    assert len(keys) == 2
