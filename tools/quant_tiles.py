"""Times the quantized kernel under several tile rules (BLOCK_B x BLOCK_D and warps) on the inference workloads, beside fbgemm's IntN TBE on the same rows: the data behind
``quantized_triton.block_shape``. Batches of 64 or less are timed as CUDA-graph replays (as the
benchmark's latency rows), larger ones eagerly; the rules and fbgemm interleaved (A B B A rounds),
ours at its defaults (ids checked in the kernel). GPU only.

    python tools/quant_tiles.py [--workloads dlrm-kaggle many-500 many-4000] [--row-types int8 int4 fp16]
                                [--batches 64 0]   (0: the workload's own batch)
"""
import argparse

import torch
import triton

import statistics

from recom_rec.bench.inference import ROW_TYPES, _Forward, build_peers
from recom_rec.bench.timing import graph_replay, time_interleaved
from recom_rec.bench.workloads import get_workload
from recom_rec.kernels import quantized_triton


def rule(max_elems, max_b, warps_wide, warps_narrow):
    """A tile rule that, as the product's did before v60, takes no more bags than the batch has."""
    def block_shape(max_dim, batch_size):
        block_d = max(16, triton.next_power_of_2(int(max_dim)))
        block_b = max(1, min(max_b, max_elems // block_d))
        if isinstance(batch_size, int):
            block_b = min(block_b, triton.next_power_of_2(max(1, batch_size)))
        warps = warps_wide if block_d >= 128 else warps_narrow
        return block_b, block_d, max(1, min(warps, block_b * block_d // 256))
    return block_shape


DEFAULT = quantized_triton.block_shape
RULES = {  # (v14's first runs also had 8K-16K tiles with 2-8 warps: 0.5-0.9x of these)
    "product": DEFAULT,
    "4K/64 w2-4": rule(4096, 64, 2, 4),
    "2K/32 w2-2": rule(2048, 32, 2, 2),
    "1K/16 w1-2": rule(1024, 16, 1, 2),
    "512/8 w1-1": rule(512, 8, 1, 1),
    "1K/32 w1-2": rule(1024, 32, 1, 2),
    "2K/16 w2-2": rule(2048, 16, 2, 2),
    "256/4 w1-1": rule(256, 4, 1, 1),
    "4K/128 w4-4": rule(4096, 128, 4, 4),
    "512/16 w1-1": rule(512, 16, 1, 1),
    "1K/16 w1-1": rule(1024, 16, 1, 1),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", nargs="+", default=["dlrm-kaggle", "many-500", "many-4000"])
    p.add_argument("--row-types", nargs="+", default=["int8", "int4", "fp16"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--batches", nargs="+", type=int, default=[0], help="0: the workload's own batch")
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    args = p.parse_args()
    device = torch.device("cuda")
    print(f"{'workload':<12} {'rows':<5} {'batch':>6} {'fbgemm':>8} " + " ".join(f"{r:>13}" for r in args.rules))
    for wname in args.workloads:
        w = get_workload(wname, False)
        for t in args.row_types:
            peers = build_peers(w, ROW_TYPES[t], device, ["recom_rec", "fbgemm"])
            for batch in args.batches:
                sized = get_workload(wname, False)
                sized.batch_size = batch or w.batch_size
                kjt = sized.make_input(device, seed=batch)
                with torch.no_grad():
                    ref = peers["fbgemm"].forward(kjt)
                    steps, cells = {"fbgemm": _step(peers["fbgemm"], kjt, device)}, {}
                    for name in args.rules:
                        quantized_triton.block_shape = RULES[name]
                        try:
                            same = torch.equal(peers["recom_rec"].forward(kjt).float(), ref.float())
                            steps[name] = _step(peers["recom_rec"], kjt, device, RULES[name])
                            cells[name] = "" if same else "!"
                        except Exception as e:  # noqa: BLE001 - a rule that does not compile or fit
                            cells[name] = "err " + type(e).__name__[:8]
                        finally:
                            quantized_triton.block_shape = DEFAULT
                    samples = time_interleaved(steps, device, min_iters=args.iters)
                    fb = statistics.median(samples["fbgemm"])
                    for name in args.rules:
                        if name in samples:
                            ms = statistics.median(samples[name])
                            cells[name] = f"{ms:8.4f} {fb / ms:3.2f}{cells[name]}"
                row = " ".join(f"{cells[r]:>13}" for r in args.rules)
                print(f"{wname:<12} {t:<5} {sized.batch_size:>6} {fb:8.4f} {row}", flush=True)
            del peers
            torch.cuda.empty_cache()


def _step(peer, kjt, device, shape=None):
    """One timed run: a CUDA-graph replay (as the benchmark's latency rows) at batches up to 64,
    else an eager forward; ``shape``: the tile rule the launch uses (set for the run, so that the
    rules can be interleaved)."""
    def forward():
        if shape is not None:
            quantized_triton.block_shape = shape
        try:
            return peer.forward(kjt)
        finally:
            quantized_triton.block_shape = DEFAULT

    if kjt.stride() <= 64:
        return graph_replay(peer if shape is None else _Forward(lambda _kjt: forward()), kjt, device)
    return forward


if __name__ == "__main__":
    main()
