"""The host time of a drawn sequence layout's training step, item by item, without cProfile
(perf-notes v60 section 4: the step is host-bound, 0.77x fbgemm's, and cProfile's per-call cost
inflates small calls). Each item is called many times in a row while a sleep kernel queued ahead
keeps the device busy, so no launch waits for the device; the host's time a call is printed
(median of rounds), beside the whole step's and fbgemm's.

    python3 tools/step_host_costs.py [--layout SEED:INDEX] [--calls 200] [--rounds 5]
"""
import argparse
import statistics
import time

import torch


def host_us(fn, device: torch.device, calls: int, rounds: int, hold: bool = True) -> float:
    """Median over ``rounds`` of the host's microseconds a call of ``fn``, ``calls`` calls a round;
    ``hold``: a sleep kernel queued ahead of each round (not for calls that read the device: they
    would wait it out)."""
    samples = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            if hold:
                torch.cuda._sleep(int(3e9 * 0.1))  # ~0.1 s or more queued ahead: no launch waits on the device
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return statistics.median(samples)


def layout_peers(layout: str, device: torch.device):
    """(workload, kjt, {name: peer}) of the sequence layout ``layout`` ("SEED:INDEX": random-seq-INDEX
    of `bench --workloads random --seed SEED`): ours with fused SGD, and fbgemm's TBE where it runs."""
    from recom_rec.bench import sequence
    from recom_rec.bench.random_layouts import random_unpooled_workloads

    seed, index = (int(x) for x in layout.split(":"))
    w = random_unpooled_workloads(seed, 8, device.type == "cpu")[0][index]
    kjt = w.make_input(device)
    peers = {"recom_rec": sequence._Ours(w, device, train=True)}
    if device.type == "cuda":
        from recom_rec.bench.peers import fbgemm_available

        if fbgemm_available(device):
            peers["fbgemm"] = sequence._Fbgemm(w, device, True, kjt.keys())
    return w, kjt, peers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", default="1517231538:1", metavar="SEED:INDEX",
                   help="the sequence layout random-seq-INDEX that `bench --workloads random --seed SEED` draws")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    import recom_rec
    from recom_rec.kernels import cuda_ext, unpooled_triton
    from recom_rec.ops.step_counter import count_step
    from recom_rec.ops.plan import group_states
    from recom_rec.ops.unpooled_embedding import _as_pooled, _fused_update_impl, _gradient_rows, _on_kernels, segments_for

    device = torch.device(args.device)
    w, kjt, peers = layout_peers(args.layout, device)
    module: recom_rec.EmbeddingCollection = peers["recom_rec"].module
    for peer in peers.values():
        peer.train_step(kjt)  # (first calls: loads, compiles, the upstream gradient made)

    from recom_rec.modules.embedding_collection import _key_index

    values, offsets = kjt.values(), kjt.offsets()
    length_per_key, offset_per_key, stride_per_key = kjt.length_per_key(), kjt.offset_per_key(), kjt.stride_per_key()
    group = module._plan.groups[0]
    key_index = _key_index(kjt.keys(), group.features, group.tables)
    sizes = [length_per_key[k] for k in key_index]
    segments = segments_for(key_index, length_per_key, offset_per_key, stride_per_key, device)
    flat = module._lookup_flats()[0]
    meta = getattr(module, module._groups[0].meta_name)
    n = sum(sizes)
    grads = [torch.ones(k, w.dim, device=device) for k in sizes]
    rows = _gradient_rows(grads, sizes, w.dim, device)
    step = torch.zeros(1, dtype=torch.int64, device=device)

    def forward():
        with torch.no_grad():
            module(kjt)

    steps = {f"training step, {name} (no hold: the step's time)": (lambda p=peer: p.train_step(kjt))
             for name, peer in peers.items()}
    items = {"forward under no_grad, recom_rec": forward,
             "segments_for (a pinned table to the device)": lambda: segments_for(
                 key_index, length_per_key, offset_per_key, stride_per_key, device),
             "_gradient_rows (a pinned table to the device)": lambda: _gradient_rows(grads, sizes, w.dim, device),
             "Triton launch: the forward": lambda: unpooled_triton.forward(
                 flat, values, segments, meta, offsets, n, w.dim),
             "torch add_ on the step counter": lambda: step.add_(1)}
    if rows is not None:
        table = rows[1].table
        items["Triton launch: the backward's row keys"] = lambda: unpooled_triton.backward_rows(
            values, segments, meta, n, table)
        num_rows = flat.numel() // w.dim
        items["_as_pooled (row keys, offsets, metadata)"] = lambda: _as_pooled(
            values, segments, meta, n, w.dim, num_rows, module._plan.backend, rows[1], eager=True)
        with torch.enable_grad():
            fused = module._fused_step_for_forward()
        if fused is not None and _on_kernels(module._plan.backend, device):
            state1, state2 = group_states(fused, 0)
            backend = module._plan.backend
            items["the fused backward (_fused_update_impl, all of it)"] = lambda: _fused_update_impl(
                rows[0], flat, state1, state2, fused.state1_is_row, fused.hyper, fused.step, values, segments,
                meta, w.dim, fused.kind, backend, grad_rows=rows[1], eager=True)
    if device.type == "cuda" and cuda_ext.build_error() is None:
        items["count_step (the extension)"] = lambda: count_step(step)
        if rows is not None:
            from recom_rec.kernels import pooled_cuda

            keys, ones, whole, first, _ = _as_pooled(values, segments, meta, n, w.dim, flat.numel() // w.dim,
                                                     module._plan.backend, rows[1], eager=True)
            items["pooled_cuda._cuda_plan (the extension's plan_backward)"] = lambda: pooled_cuda._cuda_plan(
                keys, ones, None, whole, first, n, flat.numel() // w.dim, w.dim, n)
    print(f"{w.label()}: {w.describe()}; {n:,} ids; host us a call (median of {args.rounds} rounds of "
          f"{args.calls} calls, the device kept busy)")
    for name, fn in steps.items():
        print(f"  {host_us(fn, device, args.calls // 4, args.rounds, hold=False):9.1f}  {name}", flush=True)
    # Items of many launches a call get fewer calls a round: CUDA's launch queue (about a thousand
    # launches) filled behind the held device and the host then waited out the hold (v61: 0.8 ms read).
    many = ("_as_pooled", "the fused backward", "_cuda_plan")
    for name, fn in items.items():
        calls = max(1, args.calls // 10) if any(m in name for m in many) else args.calls
        print(f"  {host_us(fn, device, calls, args.rounds):9.1f}  {name}", flush=True)


if __name__ == "__main__":
    main()
