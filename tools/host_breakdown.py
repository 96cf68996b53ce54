"""Where a drawn sequence layout's (or a VBE layout's) training step spends its host time, function by function:
each function on the step's path is wrapped with a clock (inclusive microseconds a step, a call
costing the wrapper well under a microsecond), and the steps run back to back as the benchmark's
do. Unlike cProfile it does not inflate small calls, and unlike step_host_costs' isolated items it
sees each function inside the real step (perf-notes v61: isolated items with many launches filled
CUDA's launch queue behind the held device and read 0.8 ms).

    python3 tools/host_breakdown.py [--layout SEED:INDEX] [--steps 300]
    python3 tools/host_breakdown.py --vbe [SEED:INDEX]   # bench/vbe.py's workload, or a drawn VBE layout
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


def _vbe_targets():
    """(owner, attribute, label) of each function on the eager VBE step's path (an
    EmbeddingBagCollection of one group, fused SGD), outermost first."""
    import recom_rec
    from recom_rec.kernels import cuda_ext, pooled_cuda, selection
    from recom_rec.modules import embedding_modules, flat_tables
    from recom_rec.ops import expand_bags, pooled_embedding, variable_batch

    t = [(torch.autograd, "backward", "torch.autograd.backward (the whole backward)"),
         (recom_rec.EmbeddingBagCollection, "forward", "EmbeddingBagCollection.forward (the whole forward)"),
         (flat_tables, "count_step", "    count_step"),
         (embedding_modules, "_python_lookup", "    _python_lookup"),
         (embedding_modules, "uniform_batch", "      uniform_batch"),
         (variable_batch, "output_rows", "        output_rows"),
         (variable_batch, "pad_to_uniform", "        pad_to_uniform"),
         (embedding_modules, "check_inverse_indices", "      check_inverse_indices"),
         (embedding_modules, "inverse_check", "      inverse_check"),
         (embedding_modules, "_one_group_expansion", "      _one_group_expansion"),
         (embedding_modules, "key_routing", "      key_routing"),
         (embedding_modules, "pooled_lookup", "      pooled_lookup"),
         (pooled_embedding, "_forward_impl", "        _forward_impl"),
         (pooled_embedding, "kernel_report", "          kernel_report"),
         (selection, "forward", "          selection.forward"),
         (expand_bags.Expansion, "forward", "        Expansion.forward"),
         (embedding_modules, "expand_rows_checked", "      expand_rows_checked (its own node)"),
         (expand_bags.Expansion, "backward", "    Expansion.backward"),
         (pooled_embedding, "_grads", "    _grads"),
         (pooled_embedding, "_fused_update_impl", "      _fused_update_impl"),
         (pooled_cuda, "_run_backward", "        pooled_cuda._run_backward")]
    if cuda_ext.build_error() is None:
        ext = cuda_ext.extension()
        t += [(ext, "count_step", "      ext.count_step"),
              (ext, "pooled_forward", "            ext.pooled_forward"),
              (ext, "expand_rows_forward", "          ext.expand_rows_forward"),
              (ext, "expand_rows_backward", "      ext.expand_rows_backward"),
              (ext, "plan_backward", "          ext.plan_backward"),
              (ext, "piece_update", "          ext.piece_update"),
              (ext, "singleton_update", "          ext.singleton_update")]
    return t


def _targets():
    """(owner, attribute, label) of each function on the eager sequence step's path, outermost first."""
    import recom_rec
    from recom_rec.kernels import cuda_ext, pooled_cuda, pooled_triton, unpooled_triton
    from recom_rec.modules import embedding_collection, flat_tables
    from recom_rec.ops import pooled_embedding, unpooled_embedding

    t = [(torch.autograd, "backward", "torch.autograd.backward (the whole backward)"),
         (torch.autograd, "_make_grads", "  _make_grads"),
         (torch.autograd, "_engine_run_backward", "  _engine_run_backward (the engine, our node inside)"),
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


def vbe_peers(layout: str, device: torch.device):
    """(workload, kjt, {name: peer}) of bench/vbe.py's workload ("named") or the drawn VBE layout
    ``layout`` ("SEED:INDEX": random-vbe-INDEX of `bench --workloads random --seed SEED`): ours with
    fused SGD, and fbgemm's raw VBE TBE where it runs."""
    from recom_rec.bench import vbe
    from recom_rec.bench.peers import fbgemm_available
    from recom_rec.bench.random_layouts import random_unpooled_workloads

    if layout == "named":
        w = vbe.workloads(device.type == "cpu")[0]
    else:
        seed, index = (int(x) for x in layout.split(":"))
        w = random_unpooled_workloads(seed, 8, device.type == "cpu")[1][index]
    kjt = w.make_input(device)
    names = ["recom_rec"] + (["fbgemm"] if device.type == "cuda" and fbgemm_available(device) else [])
    return w, kjt, {n: vbe._make_peer(n, w, device, "sgd") for n in names}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", default="1517231538:1", metavar="SEED:INDEX",
                   help="the sequence layout random-seq-INDEX that `bench --workloads random --seed SEED` draws")
    p.add_argument("--vbe", nargs="?", const="named", metavar="SEED:INDEX",
                   help="a VBE step instead: bench/vbe.py's workload, or random-vbe-INDEX of seed SEED")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    from recom_rec.bench.timing import settle
    from recom_rec.ops import pooled_embedding, unpooled_embedding
    from step_host_costs import layout_peers

    device = torch.device(args.device)
    if args.vbe:
        w, kjt, peers = vbe_peers(args.vbe, device)
        targets, eager = _vbe_targets(), pooled_embedding._EagerLookup
    else:
        w, kjt, peers = layout_peers(args.layout, device)
        targets, eager = _targets(), unpooled_embedding._EagerLookup

    def steps_us(peer, n: int) -> float:
        # every tuner decided first (trials back to back, as the benchmark's warm-up): a paced trial
        # inside the timed steps would count the trial's own cost as the step's
        settle(lambda: peer.train_step(kjt), device, 20)
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
    if device.type == "cuda":
        for name, peer in peers.items():
            settle(lambda: peer.train_step(kjt), device, 20)
            _print_launches(name, peer, kjt, device)
    for name, peer in peers.items():
        print(f"  {steps_us(peer, args.steps):8.1f} us a step, host issue, {name} (unwrapped)")
    for owner, attr, label in targets:
        _wrap(owner, attr, label)
    _wrap(eager, "backward", "  _EagerLookup.backward", static=True)
    ours = steps_us(peers["recom_rec"], args.steps)
    print(f"  {ours:8.1f} us a step, host issue, recom_rec (wrapped); inclusive us a step, calls a step:")
    order = [label for _, _, label in targets] + ["  _EagerLookup.backward"]
    _print(order, args.steps)
    if "fbgemm" in peers:  # the peer's split the same way: its forward, its backward (engine and all)
        tbe = peers["fbgemm"].tbe
        _wrap(type(tbe), "forward", "fbgemm TBE forward")
        fbgemm = steps_us(peers["fbgemm"], args.steps)
        print(f"  {fbgemm:8.1f} us a step, host issue, fbgemm (wrapped):")
        _print(["fbgemm TBE forward"] + order, args.steps)


def _print_launches(name: str, peer, kjt, device: torch.device) -> None:
    """The CUDA runtime and driver calls a step makes (launches, memsets, copies, syncs) and the
    kernels it runs (runtime_api_costs): on these hosts each crossing costs microseconds of a
    host-bound step."""
    from runtime_api_costs import runtime_costs

    calls, kernels = runtime_costs(peer, kjt, 20, device)
    print(f"  {name}: runtime calls a step " + ", ".join(
        f"{call} {count:g}" for call, (count, _) in sorted(calls.items(), key=lambda kv: -kv[1][0])))
    for kernel, count in sorted(kernels.items(), key=lambda kv: -kv[1]):
        print(f"    {count:5.2f}  {kernel[:70]}")


def _print(order, steps: int) -> None:
    for label in sorted(_TOTAL, key=order.index):
        print(f"  {_TOTAL[label] * 1e6 / steps:8.1f}  {_CALLS[label] / steps:4.1f}  {label}")


if __name__ == "__main__":
    main()
