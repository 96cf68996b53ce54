"""What the quantized kernel's own input check costs: the same quantized module checked
(``validate_inputs=True``: ids and bags checked in the kernel, reported without a sync) and
unchecked (the kernel clamps, reports nothing), timed interleaved (A B B A), eagerly at the
workload's batch and replayed from CUDA graphs at small batches. GPU only.

    python tools/quant_check_cost.py --workloads dlrm-kaggle many-500 many-4000 --row-types int8 int4
"""
import argparse
import statistics

import torch

from recom_rec.bench.inference import ROW_TYPES, _Forward, _quant_tables
from recom_rec.bench.timing import graph_replay, time_interleaved
from recom_rec.bench.workloads import get_workload
from recom_rec.quant import EmbeddingBagCollection as QuantEBC


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", nargs="+", default=["dlrm-kaggle", "many-500", "many-4000"])
    p.add_argument("--row-types", nargs="+", default=["int8", "int4"])
    p.add_argument("--batches", nargs="+", type=int, default=[16, 64])
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    device = torch.device("cuda")
    print("| workload | rows | batch | mode | checked ms | unchecked ms | cost |")
    print("|---|---|---|---|---|---|---|")
    for name in args.workloads:
        for row_type in args.row_types:
            w = get_workload(name, False)
            torch.manual_seed(0)
            checked = QuantEBC(_quant_tables(w, ROW_TYPES[row_type]), is_weighted=False, device=device)
            unchecked = QuantEBC(_quant_tables(w, ROW_TYPES[row_type]), is_weighted=False, device=device,
                                 validate_inputs=False)
            unchecked.load_state_dict(checked.state_dict())
            peers = {name: _Forward(lambda kjt, m=m: m(kjt).values())
                     for name, m in (("checked", checked), ("unchecked", unchecked))}
            runs = [(w.batch_size, "eager", w.make_input(device))]
            for b in args.batches:
                small = get_workload(name, False)
                small.batch_size = b
                runs.append((b, "graph", small.make_input(device, seed=b)))
            for batch, mode, kjt in runs:
                with torch.no_grad():
                    outs = [peer.forward(kjt) for peer in peers.values()]
                    assert torch.equal(*outs), "checked and unchecked differ on a good batch"
                    if mode == "eager":
                        steps = {k: (lambda peer=peer: peer.forward(kjt)) for k, peer in peers.items()}
                    else:
                        steps = {k: graph_replay(peer, kjt, device) for k, peer in peers.items()}
                    samples = time_interleaved(steps, device, min_iters=args.iters)
                checked.check_inputs()
                ms = {k: statistics.median(v) for k, v in samples.items()}
                print(f"| {name} | {row_type} | {batch} | {mode} | {ms['checked']:.4f} | {ms['unchecked']:.4f} | "
                      f"{ms['checked'] / ms['unchecked'] - 1:+.1%} |", flush=True)
            del checked, unchecked, peers
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
