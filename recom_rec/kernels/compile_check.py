"""Compiles every Triton kernel variant the package launches, for a given GPU architecture,
without a GPU (Triton's compiler and ptxas run on any machine).

The Triton interpreter used by the CPU test suite does not run the compiler, so a kernel can pass
every interpreted test and still fail to compile for the GPU; this check closes that gap.

    python -m recom_rec.kernels.compile_check [--arch 90]
"""
import argparse
import itertools
import multiprocessing
import os
import sys


def _variants():
    from . import pooled_triton as k

    ptr = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16", "i32": "*i32", "i64": "*i64"}
    for wdtype, idx, has_w, block_d, report in itertools.product(("fp32", "fp16", "bf16"), ("i32", "i64"),
                                                                 (False, True), (16, 32, 128, 256, 1024, 2048),
                                                                 (False, True)):
        block_b = max(8, min(128, 8192 // block_d))
        yield k._pooled_forward_kernel, {
            "flat_ptr": ptr[wdtype], "values_ptr": ptr[idx], "offsets_ptr": ptr[idx],
            "weights_ptr": "*fp32" if has_w else ptr[wdtype], "meta_ptr": "*i64", "key_index_ptr": "*i64",
            "out_ptr": "*fp32", "batch_size": "i32", "total_dim": "i32", "num_values": "i32", "last_offset": "i32",
            "claim_ptr": "*i32" if report else "*fp32", "report_ptr": "*i64" if report else "*fp32",
        }, {"META_W": 8, "HAS_WEIGHTS": has_w, "BLOCK_B": block_b, "BLOCK_D": block_d, "REPORT": report}, \
            {"num_warps": k.forward_warps(block_d)}
    for key, has_w, block_b, positional in itertools.product(("i32", "i64"), (False, True), (64, 1024), (False, True)):
        yield k._expand_kernel, {
            "values_ptr": ptr[key], "offsets_ptr": ptr[key], "weights_ptr": "*fp32", "meta_ptr": "*i64",
            "key_index_ptr": "*i64", "feature_base_ptr": "*i64", "row_key_ptr": ptr[key], "src_ptr": "*i64",
            "scale_ptr": "*fp32", "feature_ptr": "*i32", "batch_size": "i32", "total_dim": "i32",
            "num_values": "i32", "last_offset": "i32", "n": "i32",
        }, {"META_W": 8, "HAS_WEIGHTS": has_w, "POSITIONAL": positional, "BLOCK_B": block_b,
             "BLOCK_V": k.EXPAND_LOOKUPS, "SEARCH_STEPS": block_b.bit_length()}, {"num_warps": 4}
    for key in ("i32", "i64"):
        yield k._plan_kernel, {
            "row_key_ptr": ptr[key], "n": "i32", "piece_ptr": "*i64", "split_row_ptr": "*i64", "counts_ptr": "*i32",
        }, {"PIECE": k.PIECE, "BLOCK": k.PLAN_BLOCK}, {"num_warps": 4}
    for wdtype, opt, block_d, key in itertools.product(("fp32", "fp16", "bf16"), (-1, 0, 1, 2, 3), (16, 128, 256, 2048),
                                                       ("i32", "i64")):
        block_r, unroll, num_warps = k.piece_launch(block_d)
        common = {"out_ptr": ptr[wdtype], "state1_ptr": "*fp32", "state2_ptr": "*fp32",
                  "hyper_ptr": "*fp32", "step_ptr": "*i64"}
        sorted_lookups = {"row_key_ptr": ptr[key], "order_ptr": "*i64"}
        yield k._piece_kernel, {
            **sorted_lookups, "src_ptr": "*i64", "scale_ptr": "*fp32", "feature_ptr": "*i32",
            "grad_out_ptr": "*fp32", "meta_ptr": "*i64", "piece_ptr": "*i64", "counts_ptr": "*i32", "n": "i32",
            "partial_ptr": "*fp32", **common,
        }, {"META_W": 8, "PIECE": k.PIECE, "BLOCK_R": block_r, "UNROLL": unroll, "BLOCK_D": block_d, "OPT": opt}, \
            {"num_warps": num_warps}
        yield k._split_row_kernel, {
            **sorted_lookups, "feature_ptr": "*i32", "meta_ptr": "*i64", "split_row_ptr": "*i64",
            "counts_ptr": "*i32", "n": "i32", "partial_ptr": "*fp32", **common,
        }, {"META_W": 8, "PIECE": k.PIECE, "BLOCK_R": 1, "BLOCK_K": k.split_block_k(block_d),
            "BLOCK_D": block_d, "OPT": opt}, {"num_warps": 4}
    yield from _quantized_variants(ptr)
    yield from _unpooled_variants(ptr)


def _unpooled_variants(ptr):
    """The EmbeddingCollection's gather and row keys, and the variable-batch expansion and padding."""
    from . import expand_triton as e
    from . import pad_offsets_triton as p
    from . import unpooled_triton as u

    for wdtype, idx, dim, report in itertools.product(("fp32", "fp16", "bf16"), ("i32", "i64"), (8, 64, 256, 1024),
                                                      (False, True)):
        block_r, block_d, num_warps = u._forward_block(dim)
        yield u._unpooled_forward_kernel, {
            "flat_ptr": ptr[wdtype], "values_ptr": ptr[idx], "seg_ptr": "*i64", "meta_ptr": "*i64",
            "offsets_ptr": ptr[idx], "out_ptr": "*fp32", "claim_ptr": "*i32" if report else "*fp32",
            "report_ptr": "*i64" if report else "*fp32", "num_outputs": "i32", "num_features": "i32",
            "seg_stride": "i32", "dim": "i32", "num_values": "i32", "num_bags": "i32",
        }, {"META_W": 8, "BLOCK_R": block_r, "BLOCK_D": block_d, "SEARCH_STEPS": 3, "REPORT": report}, \
            {"num_warps": num_warps}
    # (the backward's gradient rows come without a report)
    for idx, (report, grad_rows) in itertools.product(("i32", "i64"), ((False, False), (True, False), (False, True))):
        yield u._row_key_kernel, {
            "values_ptr": ptr[idx], "seg_ptr": "*i64", "meta_ptr": "*i64", "offsets_ptr": ptr[idx],
            "row_key_ptr": "*i64", "claim_ptr": "*i32" if report else "*i64", "report_ptr": "*i64",
            "grad_table_ptr": "*i64", "grad_row_ptr": "*i64",
            "num_outputs": "i32", "num_features": "i32", "seg_stride": "i32", "num_values": "i32", "num_bags": "i32",
        }, {"META_W": 8, "BLOCK_R": 1024, "SEARCH_STEPS": 5, "REPORT": report, "GRAD_ROWS": grad_rows}, \
            {"num_warps": 4}
    for dtype, check in itertools.product(("fp32", "fp16", "bf16"), (False, True)):
        yield e._expand_forward_kernel, {
            "pooled_ptr": ptr[dtype], "inverse_ptr": "*i64", "col_feature_ptr": "*i32", "out_ptr": ptr[dtype],
            "batch": "i32", "cols": "i32", "inverse_stride": "i32", "num_bags": "i32",
            "limit_ptr": "*i64" if check else ptr[dtype], "claim_ptr": "*i32" if check else ptr[dtype],
            "report_ptr": "*i64" if check else ptr[dtype],
        }, {"BLOCK_B": e.BLOCK_B, "BLOCK_C": e.BLOCK_C, "CHECK": check}, {"num_warps": 4}
    yield e._moved_features_kernel, {
        "inverse_ptr": "*i64", "moved_ptr": "*i32", "batch": "i32", "inverse_stride": "i32",
    }, {"BLOCK": e.MOVED_BLOCK}, {"num_warps": 4}
    yield e._expand_backward_kernel, {
        "grad_ptr": "*fp32", "inverse_ptr": "*i64", "col_feature_ptr": "*i32", "moved_ptr": "*i32",
        "grad_pooled_ptr": "*fp32", "batch": "i32", "cols": "i32", "inverse_stride": "i32", "num_bags": "i32",
    }, {"BLOCK_B": e.BLOCK_B, "BLOCK_C": e.BLOCK_C}, {"num_warps": 4}
    for idx in ("i32", "i64"):
        yield p._pad_offsets_kernel, {
            "offsets_ptr": ptr[idx], "per_key_ptr": "*i64", "out_ptr": ptr[idx], "num_keys": "i32", "width": "i32",
            "bags": "i32", "n": "i32",
        }, {"BLOCK": p.BLOCK}, {"num_warps": 4}


def _quantized_variants(ptr):
    from . import quantized_triton as q

    # CUDA_ARITHMETIC 2 (a GPU) and 0; 1 is the interpreter's emulation, never compiled
    shapes = [(16, 2048), (64, 2048), (256, 2048), (32, 1), (32, 16), (128, 64)]  # (max_dim, batch)
    for out, idx, has_w, (max_dim, batch), cuda, report in itertools.product(
            ("fp32", "fp16", "bf16"), ("i32", "i64"), (False, True), shapes, (2, 0), (False, True)):
        block_b, block_d, num_warps = q.block_shape(max_dim, batch)
        yield q._quantized_forward_kernel, {
            "flat_u8": "*u8", "flat_i32": "*i32", "flat_f16": "*fp16", "flat_f32": "*fp32", "values_ptr": ptr[idx],
            "offsets_ptr": ptr[idx], "weights_ptr": "*fp32", "meta_ptr": "*i64", "key_index_ptr": "*i64",
            "out_ptr": ptr[out], "batch_size": "i32", "total_dim": "i32", "num_values": "i32", "last_offset": "i32",
            "claim_ptr": "*i32" if report else ptr[out], "report_ptr": "*i64" if report else ptr[out],
        }, {"META_W": 8, "CUDA_ARITHMETIC": cuda, "HAS_WEIGHTS": has_w, "REPORT": report, "BLOCK_B": block_b,
            "BLOCK_D": block_d}, {"num_warps": num_warps}


def _aligned_pointers(kernel, signature):
    """The attributes a launch with 16-byte-aligned tensors passes (Triton's ``tt.divisibility``)."""
    return {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
            for name, kind in signature.items() if kind.startswith("*")}


def _integers_one(signature):
    """A launch passing 1 for an integer argument (a batch of one, a single id) makes it a
    constexpr 1 (Triton's specialisation): the kernel must compile with every such argument 1."""
    return {name: 1 for name, kind in signature.items() if kind in ("i32", "i64")}


def _integers_sixteen(kernel, signature):
    """A launch passing integers that are multiples of 16 (a batch of 8192, 3,328 columns) marks
    them so (Triton's ``tt.divisibility``), which can change the layouts and vector widths chosen."""
    return {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
            for name, kind in signature.items() if kind in ("i32", "i64")}


def _compile_share(arch: int, worker: int, workers: int):
    """Compiles every ``workers``-th variant, starting at ``worker``; returns (count, failure lines)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    count, failures = 0, []
    for i, (kernel, signature, constexprs, options) in enumerate(_variants()):
        if i % workers != worker:
            continue
        aligned = _aligned_pointers(kernel, signature)
        # The specialisations a launch makes: pointers of unknown alignment, (the usual case, which
        # takes other paths through the layout passes) every pointer 16-byte aligned, integer
        # arguments multiples of 16, and integer arguments equal to 1.
        for name, consts, attrs in (("", constexprs, {}), ("aligned", constexprs, aligned),
                                    ("aligned, integers multiples of 16", constexprs,
                                     {**aligned, **_integers_sixteen(kernel, signature)}),
                                    ("aligned, integers 1", {**constexprs, **_integers_one(signature)}, aligned)):
            count += 1
            sig = {**signature, **{n: "constexpr" for n in consts}}
            try:
                triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                               target=target, options=options)
            except Exception as e:  # noqa: BLE001 - report every failing variant
                failures.append(f"FAILED {kernel.__name__} {constexprs} {name}: {str(e).splitlines()[0][:300]}")
    return count, failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes (default: one a core)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    # ~2,600 compiles of a few hundred ms each, independent: one process a core.
    jobs = max(1, args.jobs)
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        shares = pool.starmap(_compile_share, [(args.arch, w, jobs) for w in range(jobs)])
    count = sum(c for c, _ in shares)
    failures = [line for _, lines in shares for line in lines]
    for line in failures:
        print(line, file=sys.stderr)
    print(f"compiled {count - len(failures)}/{count} kernel variants for sm_{args.arch}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
