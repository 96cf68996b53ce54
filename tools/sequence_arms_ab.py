"""An A/B of the eager EmbeddingCollection's lookup paths in one process, on drawn sequence layouts'
training steps (fused SGD), rounds interleaved, fbgemm's TBE beside (perf-notes v62). The arms:

- ext: the CUDA extension's unpooled kernels, the per-batch tables in their launch parameters, the
  eager backward in one extension call (pooled_cuda.unpooled_backward);
- ext-chain: the same kernels, the backward as the chain of calls the one call stands for
  (_as_pooled, then the pooled backward: perf-notes v62's path);
- ext-device: the same kernels, the tables pinned and copied to the device;
- triton: the Triton kernels (device tables);
- ext-v64: the ext arm as v64 ran it: the step counted by a launch of its own, and the one call's
  whole-buffer meta copied from pageable memory once (cached) (perf-notes v65).

A host-bound step moves up to 36% between rounds of one arm on these hosts: compare medians of many
rounds, in one process. Each round runs every arm; the first round is a warm-up.

    python3 tools/sequence_arms_ab.py [--layouts 1517231538:0 1517231538:1] [--steps 200] [--rounds 9]
                                      [--arms ext ext-chain ext-device triton]
"""
import argparse
import functools
import time

import torch

from step_host_costs import layout_peers

from recom_rec.bench.timing import settle
from recom_rec.modules import embedding_collection
from recom_rec.ops import unpooled_embedding

_EXTENSION = unpooled_embedding._extension
_TABLES_ON_HOST = embedding_collection.tables_on_host
_ONE_CALL = unpooled_embedding._one_call
_WHOLE_META = unpooled_embedding._whole_buffer_meta
_FUSED_STEP = embedding_collection.EmbeddingCollection._fused_step_for_forward
ARMS = ("ext", "ext-chain", "ext-device", "triton", "ext-v64")


@functools.lru_cache(maxsize=64)  # (as v64's: one copy a key, not one a step)
def _v64_whole_meta(device, dim, num_rows):
    meta = torch.zeros(1, unpooled_embedding.META_WIDTH, dtype=torch.int64)
    meta[0, unpooled_embedding.META_DIM], meta[0, unpooled_embedding.META_NUM_EMBEDDINGS] = dim, num_rows
    return meta.to(device)


def _v64_fused_step(module, count_in_lookup=False):
    return _FUSED_STEP(module, False)


def use_arm(name: str) -> None:
    """Points the module's path choices at arm ``name`` (fbgemm's arm leaves them as they are)."""
    unpooled_embedding._extension = (lambda backend, device: None) if name == "triton" else _EXTENSION
    embedding_collection.tables_on_host = (lambda backend, flat: False) if name == "ext-device" else _TABLES_ON_HOST
    unpooled_embedding._one_call = (lambda *args: None) if name == "ext-chain" else _ONE_CALL
    unpooled_embedding._whole_buffer_meta = _v64_whole_meta if name == "ext-v64" else _WHOLE_META
    embedding_collection.EmbeddingCollection._fused_step_for_forward = (_v64_fused_step if name == "ext-v64"
                                                                        else _FUSED_STEP)


def step_us(peer, kjt, steps: int, device: torch.device) -> float:
    """Microseconds a training step over ``steps`` steps, to the device's end of the last."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        peer.train_step(kjt)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e6 / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=["1517231538:0", "1517231538:1"], metavar="SEED:INDEX")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--arms", nargs="+", default=["ext", "ext-chain", "triton"], choices=ARMS)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    for layout in args.layouts:
        w, kjt, peers = layout_peers(layout, device)
        compare_arms(f"{w.label()} ({layout}): {w.describe()}", kjt, peers, args.arms, use_arm, "ext", args.steps,
                     args.rounds, device)


def compare_arms(label: str, kjt, peers: dict, arms_wanted, use_arm, default_arm: str, steps: int, rounds: int,
                 device: torch.device) -> None:
    """Our peer (``peers["recom_rec"]``) under each of ``arms_wanted`` (``use_arm(name)`` points the
    module at one; ``default_arm`` after) and the other peers, every arm settled first, then
    ``rounds`` rounds of ``steps`` steps each after a warm-up round; prints each arm's median beside
    fbgemm's."""
    ours = peers.pop("recom_rec")
    arms = {**{name: ours for name in arms_wanted}, **peers}
    times = {name: [] for name in arms}
    for name, peer in arms.items():  # every arm's tuners decided first: no paced trial in a round
        use_arm(name)
        settle(lambda: peer.train_step(kjt), device, 5)
    for r in range(rounds + 1):
        for name, peer in arms.items():
            use_arm(name)
            step_us(peer, kjt, max(1, steps // 10), device)
            t = step_us(peer, kjt, steps, device)
            if r > 0:
                times[name].append(t)
    use_arm(default_arm)
    print(label)
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    base = median.get("fbgemm")
    for name, t in times.items():
        ratio = f"  {base / median[name]:.2f}x fbgemm" if base else ""
        print(f"  {name:10s} median {median[name]:8.1f} us a step{ratio}   rounds: "
              + " ".join(f"{x:.0f}" for x in t))

if __name__ == "__main__":
    main()
