"""Where a drawn sequence layout's training step spends its host time, function by function:
each function on the step's path is wrapped with a clock (inclusive microseconds a step, a call
costing the wrapper well under a microsecond), and the steps run back to back as the benchmark's
do. Unlike cProfile it does not inflate small calls, and unlike step_host_costs' isolated items it
sees each function inside the real step (perf-notes v61: isolated items with many launches filled
CUDA's launch queue behind the held device and read 0.8 ms).

    python3 tools/host_breakdown.py [--layout SEED:INDEX] [--steps 300]
"""
import argparse
import time
from collections import defaultdict

import torch

_TOTAL = defaultdict(float)
_CALLS = defaultdict(int)


def _wrap(owner, name: str, label: str, static: bool = False) -> None:
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _TOTAL[label] += time.perf_counter() - t0
            _CALLS[label] += 1

    setattr(owner, name, staticmethod(timed) if static else timed)


def _targets():
    """(owner, attribute, label) of each function on the eager sequence step's path, outermost first."""
    import recom_rec
    from recom_rec.kernels import cuda_ext, pooled_cuda, pooled_triton, unpooled_triton
    from recom_rec.modules import embedding_collection, flat_tables
    from recom_rec.ops import pooled_embedding, unpooled_embedding

    t = [(torch.autograd, "backward", "torch.autograd.backward (the whole backward)"),
         (recom_rec.EmbeddingCollection, "forward", "EmbeddingCollection.forward (the whole forward)"),
         (recom_rec.EmbeddingCollection, "_lookup_arguments", "  _lookup_arguments"),
         (flat_tables, "count_step", "    count_step"),
         (embedding_collection, "_group_rows", "  _group_rows"),
         (embedding_collection, "segments_for", "    segments_for"),
         (embedding_collection, "unpooled_lookup", "    unpooled_lookup"),
         (unpooled_embedding, "_forward_impl", "      _forward_impl"),
         (unpooled_embedding, "kernel_report", "        kernel_report"),
         (unpooled_triton, "forward", "        unpooled_triton.forward (Triton launch)"),
         (unpooled_embedding, "_gradient_rows", "  _gradient_rows"),
         (unpooled_embedding, "_weight_grads", "  _weight_grads"),
         (pooled_cuda, "unpooled_backward", "    pooled_cuda.unpooled_backward (one call)"),
         (unpooled_embedding, "_as_pooled", "    _as_pooled"),
         (unpooled_triton, "backward_rows", "      unpooled_triton.backward_rows (Triton launch)"),
         (pooled_embedding, "_fused_update_impl", "    pooled_embedding._fused_update_impl"),
         (pooled_cuda, "_run_backward", "      pooled_cuda._run_backward"),
         (pooled_triton, "run_backward", "        pooled_triton.run_backward"),
         (pooled_cuda, "_cuda_plan", "          _cuda_plan"),
         (pooled_cuda, "_cuda_pieces", "          _cuda_pieces")]
    if cuda_ext.build_error() is None:
        ext = cuda_ext.extension()
        t += [(ext, "unpooled_forward", "        ext.unpooled_forward"),
              (ext, "unpooled_row_keys", "      ext.unpooled_row_keys"),
              (ext, "unpooled_backward", "      ext.unpooled_backward"),
              (ext, "plan_backward", "            ext.plan_backward"),
              (ext, "piece_update", "            ext.piece_update"),
              (ext, "singleton_update", "            ext.singleton_update")]
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", default="1517231538:1", metavar="SEED:INDEX",
                   help="the sequence layout random-seq-INDEX that `bench --workloads random --seed SEED` draws")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    from recom_rec.ops import unpooled_embedding
    from step_host_costs import layout_peers

    device = torch.device(args.device)
    w, kjt, peers = layout_peers(args.layout, device)

    def steps_us(peer, n: int) -> float:
        for _ in range(20):
            peer.train_step(kjt)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _TOTAL.clear()
        _CALLS.clear()
        t0 = time.perf_counter()
        for _ in range(n):
            peer.train_step(kjt)
        host = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return host * 1e6 / n

    print(f"{w.label()}: {w.describe()}")
    for name, peer in peers.items():
        print(f"  {steps_us(peer, args.steps):8.1f} us a step, host issue, {name} (unwrapped)")
    for owner, attr, label in _targets():
        _wrap(owner, attr, label)
    _wrap(unpooled_embedding._EagerLookup, "backward", "  _EagerLookup.backward", static=True)
    ours = steps_us(peers["recom_rec"], args.steps)
    print(f"  {ours:8.1f} us a step, host issue, recom_rec (wrapped); inclusive us a step, calls a step:")
    order = [label for _, _, label in _targets()] + ["  _EagerLookup.backward"]
    for label in sorted(_TOTAL, key=order.index):
        print(f"  {_TOTAL[label] * 1e6 / args.steps:8.1f}  {_CALLS[label] / args.steps:4.1f}  {label}")


if __name__ == "__main__":
    main()
