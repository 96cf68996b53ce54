"""Device-side investigation (not a benchmark): the host's time of one no-grad forward of a named
workload, ours and fbgemm's (with and without its bounds check), with the GPU kept busy so that
no call waits for the device; then a cProfile of ours' forward in microseconds a call.
Usage: python tools/forward_host.py --workloads many-1000 dlrm-kaggle
       python tools/forward_host.py --workloads mixed many-1000 --peers recom_rec --repeat 15 --host-only
(--repeat N: N medians of --reps calls each, their min and median: the host's speed moves by up to
2x between fractions of a second, perf-notes v37, and the min is its fast state's.)"""
import argparse
import statistics

import torch

from host_cost import host_us, idle_trace
from profile_step import host_profile, kernel_table
from recom_rec.bench.peers import make_peer
from recom_rec.bench.timing import settle
from recom_rec.bench.workloads import get_workload


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workloads", nargs="+", default=["many-1000"])
    p.add_argument("--peers", nargs="+", default=["recom_rec", "fbgemm", "fbgemm_unchecked"])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--repeat", type=int, default=1, help="medians of --reps calls to take (min and median printed)")
    p.add_argument("--host-only", action="store_true", help="only the host's time: no kernel table or profile")
    p.add_argument("--trace", default="", help="also write a chrome trace of 5 forwards, each from an idle device "
                   "(as the benchmark times them), to TRACE-<workload>-<peer>.json")
    args = p.parse_args()
    dev = torch.device("cuda")
    for name in args.workloads:
        w = get_workload(name, False)
        kjt = w.make_input(dev)
        for peer_name in args.peers:
            peer = make_peer(peer_name, w, dev, "sgd")

            def forward():
                with torch.no_grad():
                    peer.forward(kjt)

            settle(forward, dev, warmup=10)
            medians = [host_us(forward, args.reps) for _ in range(args.repeat)]
            spread = f" (min of {args.repeat} medians; their median {statistics.median(medians):.1f})" \
                if args.repeat > 1 else ""
            print(f"== {name} {peer_name}: no-grad forward, host {min(medians):.1f} us a call{spread}", flush=True)
            if not args.host_only:
                print(kernel_table(forward), flush=True)
                if args.trace:
                    idle_trace(forward, f"{args.trace}-{name}-{peer_name}.json", calls=5)
                if peer_name == "recom_rec":
                    print(host_profile(forward, steps=100, top=40), flush=True)
            del peer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
