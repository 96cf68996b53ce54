"""An A/B of the eager variable-batch (VBE) step's autograd nodes in one process, on the vbe
workload and drawn VBE layouts (fused SGD), rounds interleaved, fbgemm's raw VBE TBE beside
(perf-notes v64). The arms:

- one-node: a one-group module's expansion runs inside the lookup's autograd node
  (pooled_embedding.pooled_lookup with an Expansion);
- two-nodes: the expansion in an autograd node of its own after the lookup (v63's path, which
  modules of several groups still take).

A host-bound step moves up to 36% between rounds of one arm on these hosts: compare medians of many
rounds, in one process. Each round runs every arm; the first round is a warm-up.

    python3 tools/vbe_arms_ab.py [--layouts named 9071203:0 ...] [--steps 200] [--rounds 9]
"""
import argparse

import torch

from host_breakdown import vbe_peers
from sequence_arms_ab import compare_arms

from recom_rec.modules import embedding_modules

_ONE_NODE = embedding_modules._one_group_expansion
ARMS = ("one-node", "two-nodes")


def use_arm(name: str) -> None:
    """Points the module's path choice at arm ``name`` (fbgemm's arm leaves it as it is)."""
    embedding_modules._one_group_expansion = (lambda *args: None) if name == "two-nodes" else _ONE_NODE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=["named"], metavar="named|SEED:INDEX")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    for layout in args.layouts:
        w, kjt, peers = vbe_peers(layout, device)
        compare_arms(f"{w.label()} ({layout}, {kjt.values().numel():,} ids): {w.describe()}", kjt, peers, args.arms,
                     use_arm, "one-node", args.steps, args.rounds, device)

if __name__ == "__main__":
    main()
