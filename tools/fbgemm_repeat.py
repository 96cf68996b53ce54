"""Does fbgemm's CUDA IntN TBE give the same output on two identical calls? The cases of
tests/test_quantized_lookup.py::test_equals_fbgemm_cuda_intn_tbe_bit_for_bit, each run three
times, against ours and the reference. GPU only (diagnostic)."""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import test_quantized_lookup as t  # noqa: E402
from quant_cases import random_case  # noqa: E402

for out_dtype in (torch.float32, torch.float16):
    for pooling in (0, 1):
        for weighted in (False, True):
            for seed in range(2):
                case = random_case(500 + seed, weighted, pooling=pooling, batch_size=33, max_len=9, row_alignment=16)
                runs = [t._fbgemm_tbe_output(case, out_dtype, pooling, device="cuda") for _ in range(3)]
                ref = t._reference(case, out_dtype, "cuda")
                ours = t._run(t._on_gpu(case), out_dtype, "triton").cpu()
                same = [torch.equal(t._bits(runs[0]), t._bits(r)) for r in runs[1:]]
                diff = (t._bits(ours) != t._bits(runs[0]))
                where = diff.nonzero()[:2].tolist()
                cols = sorted({int(c) for c in diff.nonzero()[:, 1].tolist()})
                feats = sorted({f for f in range(case.meta.shape[0]) for c in cols
                                if int(case.meta[f, 2]) <= c < int(case.meta[f, 2]) + int(case.meta[f, 0])})
                if diff.any():
                    print(f"   differing elements {int(diff.sum())}, "
                          f"bags {sorted(set(diff.nonzero()[:, 0].tolist()))[:12]}, features {feats} "
                          f"(kinds {[int(case.meta[f, 6]) for f in feats]}, dims {[int(case.meta[f, 0]) for f in feats]}, "
                          f"tables {[int(case.meta[f, 7]) for f in feats]}, keys {[int(case.key_index[f]) for f in feats]}); "
                          f"meta rows: {case.meta.tolist()}", flush=True)
                print(f"{out_dtype} pooling={pooling} weighted={weighted} seed={seed}: fbgemm repeats equal {same}; "
                      f"ours==fbgemm {not diff.any()}, ours==ref {torch.equal(t._bits(ours), t._bits(ref))}, "
                      f"fbgemm==ref {torch.equal(t._bits(runs[0]), t._bits(ref))}; first diffs "
                      + ", ".join(f"[{i},{j}] ours {ours[i, j]:.6g} fbgemm {runs[0][i, j]:.6g} {runs[1][i, j]:.6g} ref {ref[i, j]:.6g}"
                                  for i, j in where), flush=True)
