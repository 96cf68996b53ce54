"""Profiles the quantized forward of ours and fbgemm's IntN TBE on one inference workload and row
type: kernel time table and the host's time per forward. GPU only.

    python tools/profile_quant.py --workload many-4000 --row-types int8 int4 fp16
"""
import argparse
import cProfile
import io
import pstats
import time

import torch

from recom_rec.bench.inference import ROW_TYPES, build_peers
from recom_rec.bench.workloads import get_workload


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="many-4000")
    p.add_argument("--row-types", nargs="+", default=["int8", "int4", "fp16"])
    p.add_argument("--host", action="store_true", help="also a cProfile of our forward's host side")
    args = p.parse_args()
    device = torch.device("cuda")
    w = get_workload(args.workload, False)
    for t in args.row_types:
        peers = build_peers(w, ROW_TYPES[t], device, ["recom_rec", "fbgemm"])
        kjt = w.make_input(device)
        with torch.no_grad():
            for name, peer in peers.items():
                for _ in range(5):
                    peer.forward(kjt)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    peer.forward(kjt)
                host = (time.perf_counter() - t0) / 20 * 1e3
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        peer.forward(kjt)
                    torch.cuda.synchronize()
                print(f"== {args.workload} {t} {name}: host issue {host:.3f} ms a forward")
                if args.host and name == "recom_rec":  # where the host's time goes, 20 forwards
                    profiler = cProfile.Profile()
                    profiler.enable()
                    for _ in range(20):
                        peer.forward(kjt)
                    profiler.disable()
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
                    print(text.getvalue())
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=70))
        del peers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
