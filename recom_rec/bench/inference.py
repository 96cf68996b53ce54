"""``--phases inference``: quantized tables, ours against fbgemm's IntN TBE and torchrec's
quantized EmbeddingBagCollection, same rows, same inputs.

Per workload and row type: the forward at the workload's batch, then the latency at batches 1, 16
and 64 replayed from a CUDA graph (on the CPU: eager, there are no CUDA graphs), the peers timed
interleaved (A B B A rounds) as in the sweep. All of them hold the same rows (ours loads
torchrec's state_dict, fbgemm's TBE gets the same rows) and their outputs are checked against each
other before anything is timed. Ours runs at its defaults (ids checked).
"""
import gc
import statistics
import sys
from typing import Callable, Dict, List, Optional

import torch
from torchrec.modules.embedding_configs import DataType
from tqdm import tqdm

from ..quant.rows import row_bytes, row_type
from .timing import time_interleaved
from .workloads import Workload, get_workload

ROW_TYPES = {"int8": DataType.INT8, "int4": DataType.INT4, "int2": DataType.INT2, "fp16": DataType.FP16}
INFERENCE_WORKLOADS = ("dlrm-kaggle", "many-500", "many-4000")
INFERENCE_PEERS = ("recom_rec", "fbgemm", "fbgemm_unchecked", "torchrec")
GRAPH_BATCHES = (1, 16, 64)


def _quant_tables(w: Workload, data_type: DataType):
    tables = w.tables()
    for t in tables:
        t.data_type = data_type
    return tables


def lookup_bytes(w: Workload, data_type: DataType) -> int:
    """Bytes a forward moves at least: every looked-up row (fbgemm's row layout), the fp32 output."""
    kind = row_type(data_type)
    rows = sum(L * row_bytes(kind, d, 16) for L, d in zip(w.pooling_factors, w.dims)) * w.batch_size
    return rows + w.batch_size * sum(w.dims) * 4


class _Forward:
    """What the timing loop and the graph capture call: ``forward(kjt)``."""

    def __init__(self, fn):
        self.forward = fn


def _fill_rows(tbe) -> None:
    """Random rows that decode to ordinary numbers: random element bytes, then INT rows' fp16
    scale and bias set to small values and FP16 rows to normal values (random bytes would make
    NaNs and subnormals, which some CPUs handle slowly)."""
    tbe.fill_random_weights()
    for elements, scale_bias in tbe.split_embedding_weights(split_scale_shifts=True):
        if scale_bias is not None:
            header = scale_bias.view(torch.float16)
            header[:, 0].uniform_(1e-3, 1e-2)
            header[:, 1].uniform_(-0.5, 0.0)
        elif elements.shape[1]:
            elements.view(torch.float16).normal_()


def build_peers(w: Workload, data_type: DataType, device: torch.device, wanted) -> Dict[str, _Forward]:
    """The peers on the same random rows: torchrec's module draws them, ours loads its state_dict, fbgemm's TBE is torchrec's own TBE called
    directly (no KJT permute, no KeyedTensor)."""
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as TorchrecQuantEBC

    from ..quant import EmbeddingBagCollection as QuantEBC

    torch.manual_seed(0)
    theirs = TorchrecQuantEBC(_quant_tables(w, data_type), is_weighted=False, device=device)
    for tbe in theirs._emb_modules:
        _fill_rows(tbe)
    peers: Dict[str, _Forward] = {}
    if "recom_rec" in wanted:
        # At its defaults (ids checked, in the kernel on a GPU): fbgemm at its defaults is the like-for-like peer.
        ours = QuantEBC(_quant_tables(w, data_type), is_weighted=False, device=device)
        ours.load_state_dict(theirs.state_dict())
        peers["recom_rec"] = _Forward(lambda kjt: ours(kjt).values())
    if "fbgemm" in wanted or "fbgemm_unchecked" in wanted:
        (tbe,) = theirs._emb_modules  # one pooling type: one TBE
        cast = (lambda t: t.int()) if device.type == "cuda" else (lambda t: t)
        converted: Dict[int, tuple] = {}

        def fbgemm_forward(kjt):
            if id(kjt) not in converted:  # the index casts once per input, outside the timing
                converted.clear()
                converted[id(kjt)] = (kjt, cast(kjt.values()), cast(kjt.offsets()))
            _, values, offsets = converted[id(kjt)]
            return tbe(values, offsets)

        if "fbgemm" in wanted:
            peers["fbgemm"] = _Forward(fbgemm_forward)
        if "fbgemm_unchecked" in wanted:
            from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

            def unchecked_forward(kjt):
                # The same TBE with its bounds check off for the call (it reads the mode each
                # forward), as torchrec's inference helpers build their TBEs: less work than ours.
                checked, tbe.bounds_check_mode_int = tbe.bounds_check_mode_int, BoundsCheckMode.NONE.value
                try:
                    return fbgemm_forward(kjt)
                finally:
                    tbe.bounds_check_mode_int = checked

            peers["fbgemm_unchecked"] = _Forward(unchecked_forward)
    if "torchrec" in wanted:
        peers["torchrec"] = _Forward(lambda kjt: theirs(kjt).values())
    return peers


def _agree(peers: Dict[str, _Forward], kjt) -> str:
    with torch.no_grad():
        outs = {name: p.forward(kjt).float() for name, p in peers.items()}
    ref = outs.get("torchrec", outs.get("fbgemm"))
    if ref is None or "recom_rec" not in outs:
        return "-"
    diff = (outs["recom_rec"] - ref).abs().max().item()
    return "bits" if diff == 0 else f"{diff:.1e}"


def _time_peers(peers: Dict[str, _Forward], steps: Dict[str, Callable[[], object]], device: torch.device, args,
                base: dict, failed: Optional[Dict[str, str]] = None) -> List[dict]:
    """One row per peer: the median ms of its step, the steps timed interleaved (A B B A rounds,
    timing.time_interleaved), so that a drift of the host or device between the peers' timings
    falls on all of them alike. A peer whose step fails is recorded with its error."""
    errors = dict(failed or {})
    for name in list(steps):
        try:
            with torch.no_grad():
                steps[name]()
        except (RuntimeError, torch.OutOfMemoryError) as e:
            errors[name] = str(e)[:200]
            del steps[name]
    samples: Dict[str, List[float]] = {}
    if steps:
        with torch.no_grad():
            samples = time_interleaved(steps, device, warmup=args.warmup, min_iters=args.iters)
    rows = []
    for name in peers:
        row = {**base, "peer": name}
        if name in samples:
            row["ms"] = statistics.median(samples[name])
        else:
            row["error"] = errors.get(name, "not timed")
        rows.append(row)
    return rows


def run_inference(args, device: torch.device, ceiling: float, small: bool) -> List[dict]:
    from .timing import graph_replay

    from .workloads import WORKLOADS

    names = [n for n in args.workloads if n in WORKLOADS] if args.workloads else list(INFERENCE_WORKLOADS)
    wanted = [p for p in args.peers if p in INFERENCE_PEERS]
    results = []
    for wname in tqdm(names, desc="inference workloads", file=sys.stderr):
        w = get_workload(wname, small)
        if args.batch_size:
            w.batch_size = args.batch_size
        for type_name in args.row_types:
            data_type = ROW_TYPES[type_name]
            try:
                peers = build_peers(w, data_type, device, wanted)
            except (RuntimeError, ValueError, torch.OutOfMemoryError) as e:
                results += [{"workload": wname, "peer": p, "phase": f"{type_name} forward", "error": str(e)[:200]}
                            for p in wanted]
                continue
            kjt = w.make_input(device)
            agree = _agree(peers, kjt)
            rows = _time_peers(peers, {name: (lambda p=peer: p.forward(kjt)) for name, peer in peers.items()},
                               device, args, {"workload": wname, "phase": f"{type_name} B={w.batch_size}",
                                              "agree": agree})
            for row in rows:
                if "ms" in row:
                    row["gbs"] = lookup_bytes(w, data_type) / (row["ms"] * 1e-3) / 1e9
                    row["ceiling_share"] = row["gbs"] / ceiling
            results += rows
            for batch in GRAPH_BATCHES:
                small_batch = get_workload(wname, small)
                small_batch.batch_size = batch
                small_kjt = small_batch.make_input(device, seed=batch)
                mode = "graph" if device.type == "cuda" else "eager"
                steps, failed = {}, {}
                for name, peer in peers.items():
                    try:
                        steps[name] = (graph_replay(peer, small_kjt, device) if device.type == "cuda"
                                       else (lambda p=peer: p.forward(small_kjt)))
                    except Exception as e:  # noqa: BLE001 - a peer whose forward cannot be captured
                        failed[name] = str(e)[:200]
                results += _time_peers(peers, steps, device, args,
                                       {"workload": wname, "phase": f"{type_name} B={batch} {mode}"}, failed)
            del peers
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results
