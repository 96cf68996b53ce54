"""Small-batch latency under CUDA graphs, taken apart: for ours and fbgemm's IntN TBE (the
`inference` benchmark's peers) at batches 1 / 16 / 64, the replay latency as the benchmark times it
(events around one replay on an idle device), the back-to-back replay time, the host's time in
`replay()`, and the kernels the graph holds (profiled replays). Beside them the floors: graphs of
one and of two 1-element kernels, timed the same way, and the "gather floor": a kernel that only
reads the same number of random rows of the same size from a table as large as the workload's
(each program reads 128 rows and writes one word), timed alone: the rate at which this GPU reads
random rows. GPU only.

    python tools/graph_latency.py --workloads dlrm-kaggle many-500 many-4000 --row-types int8
"""
import argparse
import statistics
import time

import torch
import triton
import triton.language as tl

from recom_rec.bench.timing import graph_replay
from recom_rec.bench.inference import ROW_TYPES, build_peers
from recom_rec.bench.timing import _timed_run
from recom_rec.bench.workloads import get_workload
from recom_rec.quant.rows import row_bytes, row_type

GATHER_BLOCK = 128


@triton.jit
def _read_rows(table_ptr, ids_ptr, out_ptr, ROW_WORDS: tl.constexpr, BLOCK_WORDS: tl.constexpr,
               BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + r).to(tl.int64)
    w = tl.arange(0, BLOCK_WORDS)
    x = tl.load(table_ptr + ids[:, None] * ROW_WORDS + w[None, :], mask=(w < ROW_WORDS)[None, :], other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(x, 1), 0))


def gather_floor_us(total_rows: int, row_words: int, lookups: int) -> float:
    """us to read ``lookups`` uniformly random rows of ``row_words`` 32-bit words."""
    n = max(GATHER_BLOCK, lookups // GATHER_BLOCK * GATHER_BLOCK)
    table = torch.ones(total_rows, row_words, dtype=torch.int32, device="cuda")
    ids = torch.randint(0, total_rows, (n,), dtype=torch.int32, device="cuda")
    out = torch.empty(n // GATHER_BLOCK, dtype=torch.int32, device="cuda")

    def run():
        _read_rows[(n // GATHER_BLOCK,)](table, ids, out, ROW_WORDS=row_words,
                                         BLOCK_WORDS=triton.next_power_of_2(row_words), BLOCK=GATHER_BLOCK, num_warps=4)
    run()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()  # 20 launches a replay: the host's launch time drops out
    with torch.cuda.graph(graph):
        for _ in range(20):
            run()
    us = statistics.median(_timed_run(graph.replay, torch.device("cuda")) for _ in range(20)) * 1e3 / 20
    del table
    torch.cuda.empty_cache()
    return us * lookups / n


def _latency(replay, n=300):
    for _ in range(20):
        replay()
    torch.cuda.synchronize()
    single = statistics.median(_timed_run(replay, torch.device("cuda")) for _ in range(n)) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        replay()
    end.record()
    end.synchronize()
    back_to_back = start.elapsed_time(end) / n * 1e3
    t0 = time.perf_counter()
    for _ in range(n):
        replay()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return single, back_to_back, host


def _kernels(replay):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count:
            rows.append(f"{e.key[:60]} x{e.count / 20:g} {e.device_time_total / e.count:.1f}us")
    return "; ".join(rows) or "(none seen)"


def _floor(kernels: int):
    x = torch.zeros(1, device="cuda")

    class One:
        def forward(self, _):
            for _ in range(kernels):
                x.add_(1)
            return x

    return graph_replay(One(), None, torch.device("cuda"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", nargs="+", default=["dlrm-kaggle", "many-500", "many-4000"])
    p.add_argument("--row-types", nargs="+", default=["int8"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    args = p.parse_args()
    device = torch.device("cuda")
    print("| graph | batch | replay us (bench) | back-to-back us | host us | gather floor us | kernels (per replay, device us) |")
    print("|---|---|---|---|---|---|---|")
    for k in (1, 2):
        s, b, h = _latency(_floor(k))
        print(f"| floor: {k} tiny kernel(s) | - | {s:.1f} | {b:.1f} | {h:.1f} | | |", flush=True)
    for wname in args.workloads:
        for t in args.row_types:
            w = get_workload(wname, False)
            peers = build_peers(w, ROW_TYPES[t], device, ["recom_rec", "fbgemm"])
            for batch in args.batches:
                small = get_workload(wname, False)
                small.batch_size = batch
                kjt = small.make_input(device, seed=batch)
                words = row_bytes(row_type(ROW_TYPES[t]), max(w.dims), 16) // 4
                floor = gather_floor_us(sum(w.rows), words, kjt.values().numel())
                for name, peer in peers.items():
                    replay = graph_replay(peer, kjt, device)
                    s, b, h = _latency(replay)
                    print(f"| {wname} {t} {name} | {batch} | {s:.1f} | {b:.1f} | {h:.1f} | {floor:.1f} | {_kernels(replay)} |",
                          flush=True)
            del peers
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
