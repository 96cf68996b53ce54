"""``python -m recom_rec.bench --workloads sweep``: ours against fbgemm's TBE over a grid of table
layouts, to find the shapes where the fused kernel loses (issue 18).

The points: a base point (16 tables x 100k rows, dim 64, batch 4096, ragged bags of mean 10
ids, uniform ids, sum pooling, fp32) varied one axis at a time (batch, table count, Zipf ids,
sample weights, mean pooling, fp16/bf16 tables, odd dims for ours alone: fbgemm wants multiples
of 4, bags all of one length), plus a dim x ids-per-bag grid. Ragged bags have lengths uniform in
[0, 2 * mean] ("~50 ids"); "1 id" and "fixed bags" points ("50 ids") have every bag that long. A
point's batch and rows shrink where the table count or bag length would exceed fixed memory and
time caps (MAX_LOOKUPS, MAX_READ_BYTES, MAX_WEIGHT_BYTES), and the printed point says so.

Each point builds ours and fbgemm with the same weights, checks their forward outputs agree on
the same KJT, then times the forward (no_grad), a fused SGD step and a fused row-wise Adagrad
step (forward + backward with the optimizer inside, for both). Each training phase's first step
runs from the same weights for both and their updated tables are checked to agree too (the
update's difference over its size: what a backward that drops or doubles a lookup changes).
Ratios are fbgemm ms / ours ms, against fbgemm as sharded torchrec trains with it (its default
bounds check: a kernel before each lookup that clamps ids out of range) and against fbgemm without
it (``fbgemm_unchecked``, "ratio_unchecked"). Ours runs at its default, its kernels checking
every id as they read it (ops/input_check.py), so the first is the like-for-like one and the
second gives fbgemm the advantage of no check. At forward points that read
100 MB of rows or more, each peer's forward is also replayed from a CUDA graph (device time alone):
beside the copy ceiling, that tells a forward its kernels hold back from one its host start-up does.
Where the kernels read below 85% of the copy rate, a bare gather of the same rows (gather.py) is
timed too: what any kernel reading those rows reaches.

A phase builds both peers, warms each up until the product's tuners have decided every shape it
runs (timing.settle), records what ours chose ("choices": the forward's kernels, the backward's
path), then times the two interleaved in A B B A rounds for at least --iters runs and --min-ms
each (timing.time_interleaved), so that a drift between the two peers' timings cancels and a
0.1 ms point's median rests on hundreds of runs. `--compare A.json B.json` checks two runs
against each other (stability.py).
"""
import gc
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional

import numpy as np
import torch
from torchrec import DataType, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

import recom_rec

from .gather import gathers
from .peers import fbgemm_bounds_check
from .timing import graph_replay, time_interleaved
from .workloads import zipf_ids

PHASES = ("forward", "sgd", "rowwise_adagrad")
GRID_DIMS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
GRID_IDS = (1, 10, 50, 200)  # 1: exactly one id per bag; else the mean of ragged lengths
MAX_LOOKUPS = 16_000_000
MAX_READ_BYTES = 16e9  # rows a forward reads: bounds the slowest points' time
MAX_WEIGHT_BYTES = 4e9  # one copy of the tables (ours and fbgemm's each hold one)
BANDWIDTH_BOUND_BYTES = 100e6  # rows read at or above this: the forward is judged against the copy ceiling
CEILING_TARGET = 0.85  # issue 18's share of the copy rate for those forwards
UNCHECKED = "fbgemm_unchecked"  # fbgemm without its bounds check (ours checks ids in its kernels)
GRAPH_MIN_MS = 30.0  # each peer's graph replays timed at least this long at a bandwidth-bound point


@dataclass(frozen=True)
class Point:
    axis: str  # which axis this point varies from the base ("grid" for the dim x ids grid)
    tables: int = 16
    rows: int = 100_000
    dim: int = 64
    batch: int = 4096
    ids: int = 10
    zipf: bool = False
    weighted: bool = False
    mean: bool = False
    dtype: str = "fp32"
    fbgemm: bool = True  # fbgemm takes dims in multiples of 4 only
    fixed: bool = False  # every bag exactly `ids` long (padded histories), not ragged

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    def label(self) -> str:
        ids = "1 id" if self.ids == 1 else f"{self.ids} ids" if self.fixed else f"~{self.ids} ids"
        extra = [x for x, on in (("zipf", self.zipf), ("weighted", self.weighted), ("mean", self.mean)) if on]
        return (f"{self.tables}x{self.rows} D={self.dim} B={self.batch} {ids} {self.dtype}"
                + (" " + " ".join(extra) if extra else ""))

    def fitted(self) -> "Point":
        """This point with batch and rows cut to the caps."""
        batch = min(self.batch, MAX_LOOKUPS // (self.tables * self.ids),
                    int(MAX_READ_BYTES // (self.tables * self.ids * self.dim * self.itemsize)))
        rows = min(self.rows, int(MAX_WEIGHT_BYTES // (self.tables * self.dim * self.itemsize)))
        return replace(self, batch=max(batch, 1), rows=max(rows, 1))


def points(small: bool) -> List[Point]:
    if small:  # the CPU test's: every kind of point, tiny
        base = Point("base", tables=2, rows=500, dim=8, batch=16, ids=3)
        grid = [replace(base, axis="grid", dim=d, ids=i) for d in (4, 16) for i in (1, 3)]
        axes = [replace(base, axis="zipf", zipf=True), replace(base, axis="weighted", weighted=True),
                replace(base, axis="mean", mean=True), replace(base, axis="dtype", dtype="fp16"),
                replace(base, axis="odd dim", dim=17, fbgemm=False), replace(base, axis="fixed bags", fixed=True)]
        return [p.fitted() for p in grid + axes]
    base = Point("base")
    grid = [replace(base, axis="grid", dim=d, ids=i) for d in GRID_DIMS for i in GRID_IDS]
    axes = [replace(base, axis="batch", batch=b) for b in (64, 2048, 65536)]
    axes += [replace(base, axis="tables", tables=t) for t in (1, 26, 500, 4000)]
    axes += [replace(base, axis="zipf", zipf=True), replace(base, axis="zipf", zipf=True, dim=256, ids=50),
             replace(base, axis="weighted", weighted=True), replace(base, axis="mean", mean=True),
             replace(base, axis="dtype", dtype="fp16"), replace(base, axis="dtype", dtype="bf16"),
             replace(base, axis="dtype", dtype="fp16", dim=256, ids=50)]
    axes += [replace(base, axis="odd dim", dim=d, fbgemm=False) for d in (17, 100)]
    axes += [replace(base, axis="fixed bags", fixed=True, dim=d, ids=i) for d, i in ((8, 200), (16, 50), (64, 50),
                                                                                    (256, 50))]
    return [p.fitted() for p in grid + axes]


_DATA_TYPES = {"fp32": (DataType.FP32, torch.float32), "fp16": (DataType.FP16, torch.float16),
               "bf16": (DataType.BF16, torch.bfloat16)}


def make_kjt(p: Point, device: torch.device, seed: int = 0) -> KeyedJaggedTensor:
    """Table-major KJT (key ``f{i}`` for table ``i``), int64 ids, ragged lengths (or every bag
    ``ids`` long: one id, fixed bags)."""
    rng = np.random.default_rng(seed)
    lengths = (np.full((p.tables, p.batch), p.ids, dtype=np.int64) if p.ids == 1 or p.fixed
               else rng.integers(0, 2 * p.ids + 1, (p.tables, p.batch)))
    count = int(lengths.sum())
    ids = zipf_ids(rng, 1.1, p.rows, count) if p.zipf else rng.integers(0, p.rows, count)
    weights = torch.from_numpy(rng.uniform(0.5, 1.5, count).astype(np.float32)).to(device) if p.weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(p.tables)], values=torch.from_numpy(ids).to(device),
        lengths=torch.from_numpy(lengths.reshape(-1)).to(device), weights=weights)


def rows_read_bytes(p: Point, kjt: KeyedJaggedTensor) -> int:
    return kjt.values().numel() * p.dim * p.itemsize


class _Ours:
    def __init__(self, p: Point, device, optimizer: Optional[str], weights: List[torch.Tensor], backend: str):
        data_type = _DATA_TYPES[p.dtype][0]
        pooling = PoolingType.MEAN if p.mean else PoolingType.SUM
        tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=p.dim, num_embeddings=p.rows,
                                     feature_names=[f"f{i}"], pooling=pooling, data_type=data_type)
                  for i in range(p.tables)]
        self.module = recom_rec.EmbeddingBagCollection(tables, is_weighted=p.weighted, device=device,
                                                       backend=backend)
        with torch.no_grad():
            for i, w in enumerate(weights):
                self.module.embedding_bags[f"t{i}"].weight.copy_(w)
        if optimizer:
            self.module.enable_fused_optimizer(optimizer, lr=0.01)

    def forward(self, kjt):
        return self.module(kjt).values()

    def train_step(self, kjt, grad):
        self.module(kjt).values().backward(grad)

    def tables(self) -> List[torch.Tensor]:
        return [self.module.embedding_bags[f"t{i}"].weight.detach() for i in range(len(self.module.embedding_bags))]


class _Fbgemm:
    def __init__(self, p: Point, device, optimizer: Optional[str], weights: List[torch.Tensor],
                 bounds_checked: bool = True):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        cuda = device.type == "cuda"
        location = EmbeddingLocation.DEVICE if cuda else EmbeddingLocation.HOST
        compute = ComputeDevice.CUDA if cuda else ComputeDevice.CPU
        opt = EmbOptimType.EXACT_ROWWISE_ADAGRAD if optimizer == "rowwise_adagrad" else EmbOptimType.EXACT_SGD
        precision = {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "bf16": SparseType.BF16}[p.dtype]
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(p.rows, p.dim, location, compute)] * p.tables, optimizer=opt, learning_rate=0.01,
            pooling_mode=PoolingMode.MEAN if p.mean else PoolingMode.SUM, weights_precision=precision,
            output_dtype=SparseType.FP32, device=device if cuda else None,
            bounds_check_mode=fbgemm_bounds_check(bounds_checked))
        with torch.no_grad():
            for dst, w in zip(self.tbe.split_embedding_weights(), weights):
                dst.copy_(w)

    def forward(self, kjt):
        return self.tbe(kjt.values(), kjt.offsets(), per_sample_weights=kjt.weights_or_none())

    def train_step(self, kjt, grad):
        self.tbe(kjt.values(), kjt.offsets(), per_sample_weights=kjt.weights_or_none()).backward(grad)

    def tables(self) -> List[torch.Tensor]:
        return [w.detach() for w in self.tbe.split_embedding_weights()]


def _step(peer, kjt, grad, phase):
    if phase == "forward":
        def step():
            with torch.no_grad():
                peer.forward(kjt)
    else:
        def step():
            peer.train_step(kjt, grad)
    return step


def _agree(p: Point, ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Max relative difference of the two forwards (normalised by the output's scale)."""
    scale = theirs.abs().max().item() or 1.0
    return (ours - theirs).abs().max().item() / scale


def _update_agreement(p: Point, before: List[torch.Tensor], ours: List[torch.Tensor],
                      theirs: List[torch.Tensor]) -> float:
    """How far two peers' tables after one training step from the same ``before`` differ, over
    the size of the update (fbgemm's largest change of an element), less what the tables' own
    precision allows: fp16/bf16 rows round the updated weight (fbgemm rounds stochastically),
    so a difference of up to two of their ulps at the table's largest weight is no
    disagreement. 0 means the same tables."""
    def largest(maxima):  # one device sync for all tables (4000 of them at the sweep's widest point)
        return torch.stack(list(maxima)).max().item()

    diff = largest((o.float() - t.float()).abs().max() for o, t in zip(ours, theirs))
    update = largest((t.float() - b.float()).abs().max() for t, b in zip(theirs, before))
    top = largest(b.float().abs().max() for b in before)
    allowed = 0.0 if p.dtype == "fp32" else 2 * torch.finfo(_DATA_TYPES[p.dtype][1]).eps * top
    return max(0.0, diff - allowed) / (update or 1.0)


# Largest update agreement (above) taken as the same step: fp32 sums in another order and the
# optimizers' formulas in another order of operations differ by a few ulps of the weights.
UPDATE_TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 1e-2}


def run_point(p: Point, device: torch.device, warmup: int, iters: int, backend: str = "auto",
              with_fbgemm: bool = True, min_ms: float = 100.0) -> List[dict]:
    kjt = make_kjt(p, device)
    gen = torch.Generator(device=device).manual_seed(1)
    dtype = _DATA_TYPES[p.dtype][1]
    weights = [(torch.rand(p.rows, p.dim, generator=gen, device=device) - 0.5).to(dtype) for _ in range(p.tables)]
    grad = torch.ones(p.batch, p.tables * p.dim, device=device)
    base = {"point": p.label(), "axis": p.axis, **asdict(p), "rows_read_bytes": rows_read_bytes(p, kjt),
            "lookup_bytes": rows_read_bytes(p, kjt) + p.batch * p.tables * p.dim * 4}
    peers = {"recom_rec": lambda opt: _Ours(p, device, opt, weights, backend)}
    if with_fbgemm and p.fbgemm:
        peers["fbgemm"] = lambda opt: _Fbgemm(p, device, opt, weights)
        peers[UNCHECKED] = lambda opt: _Fbgemm(p, device, opt, weights, bounds_checked=False)
    out = {}
    for name, make in [(n, m) for n, m in peers.items() if n != UNCHECKED]:  # the same kernels as fbgemm's
        try:
            peer = make(None)
            with torch.no_grad():
                out[name] = peer.forward(kjt).float()
            del peer
        except Exception as e:  # noqa: BLE001 - a layout a peer does not take (fbgemm: bf16 on some builds)
            peers.pop(name)
            base.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:200]}"
    if "fbgemm" in out and "recom_rec" in out:
        base["max_rel_diff"] = _agree(p, out["recom_rec"], out["fbgemm"])
        base["agree"] = base["max_rel_diff"] <= (1e-5 if p.dtype == "fp32" else 1e-2)
    del out
    rows = [_run_phase(p, phase, peers, base, kjt, grad, device, warmup, iters, min_ms, weights)
            for phase in PHASES]
    del weights, kjt, grad
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _run_phase(p: Point, phase: str, peers: dict, base: dict, kjt, grad, device, warmup: int, iters: int,
               min_ms: float, weights: List[torch.Tensor]) -> dict:
    """One phase of a point: both peers built, a first step of each (training: from the same
    weights, the updated tables compared), each warmed up (ours until its tuners decided), ours'
    choices recorded, then both timed interleaved."""
    row = {**base, "phase": phase}
    if device.type == "cuda":
        _forget_choices()  # this phase's model tunes afresh, and its choices are this phase's alone
    made, steps = {}, {}
    for name, make in peers.items():
        try:
            made[name] = make("sgd" if phase == "forward" else phase)
            steps[name] = _step(made[name], kjt, grad, phase)
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:200]}"
    for name in list(steps):  # a peer that cannot run this phase is dropped, the other still timed
        try:
            steps[name]()
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:200]}"
            del steps[name]
    if phase != "forward" and {"recom_rec", "fbgemm"} <= set(steps):
        row["update_max_rel_diff"] = _update_agreement(p, weights, made["recom_rec"].tables(),
                                                       made["fbgemm"].tables())
        row["agree"] = row.get("agree", True) and row["update_max_rel_diff"] <= UPDATE_TOLERANCE[p.dtype]
    try:
        samples = time_interleaved(steps, device, warmup=warmup, min_iters=iters, min_ms=min_ms)
        for name, times in samples.items():
            row[f"{name}_ms"] = statistics.median(times)
            row[f"{name}_runs"] = len(times)
            # the fast end of the samples: host-bound steps' run-to-run spread is mostly slow runs
            row[f"{name}_p10_ms"] = statistics.quantiles(times, n=10)[0] if len(times) > 1 else times[0]
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        row.setdefault("errors", {})["timing"] = f"{type(e).__name__}: {str(e)[:200]}"
    if device.type == "cuda" and "recom_rec" in steps:
        row["choices"] = _choices()
        row["choice"] = (row["choices"].get("backward_path", "") if phase != "forward" else
                         "+".join(filter(None, (row["choices"].get("forward"), row["choices"].get("forward_order")))))
    if phase == "forward" and device.type == "cuda" and base["rows_read_bytes"] >= BANDWIDTH_BOUND_BYTES:
        _time_graphs(row, {name: made[name] for name in steps}, kjt, device, iters)
    del steps, made
    gc.collect()
    for name, key in (("fbgemm", "ratio"), (UNCHECKED, "ratio_unchecked")):
        if row.get("recom_rec_ms") and row.get(f"{name}_ms"):
            row[key] = row[f"{name}_ms"] / row["recom_rec_ms"]
            row[key + "_p10"] = row[f"{name}_p10_ms"] / row["recom_rec_p10_ms"]
    return row


def _time_graphs(row: dict, peers: dict, kjt, device, iters: int) -> None:
    """Each peer's forward replayed from a CUDA graph, timed interleaved: its device time alone
    (``{name}_graph_ms``). A run from an idle device (the forward's timing) also counts the host's
    time until the kernels start; the two apart tell a forward the kernels hold back from one its
    host start-up does."""
    try:
        replays = {name: graph_replay(peer, kjt, device) for name, peer in peers.items()}
        samples = time_interleaved(replays, device, warmup=2, min_iters=iters, min_ms=GRAPH_MIN_MS)
        for name, times in samples.items():
            row[f"{name}_graph_ms"] = statistics.median(times)
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        row.setdefault("errors", {})["graph"] = f"{type(e).__name__}: {str(e)[:200]}"


def _time_gather(row: dict, p: Point, device, iters: int, ceiling_gbs: float) -> None:
    """At a forward whose kernels read below the target share of the copy rate: the bare gather of
    the same rows (gather.py) replayed from CUDA graphs at each block size, the fastest kept:
    ``gather_graph_ms``, its share of the copy rate (the rows' bytes: it writes almost nothing) and
    ours' share of its rate, ``of_gather`` (each counting the bytes it moves: ours the rows and its
    output, which at one id a bag are as many again). What a kernel reading these rows reaches."""
    try:
        kjt = make_kjt(p, device)
        weights = torch.rand(p.tables * p.rows, p.dim, device=device).to(_DATA_TYPES[p.dtype][1])
        replays = {name: graph_replay(g, kjt, device) for name, g in gathers(weights, kjt, p.tables, p.rows)}
        samples = time_interleaved(replays, device, warmup=2, min_iters=iters, min_ms=GRAPH_MIN_MS / 4)
        ms = {name: statistics.median(times) for name, times in samples.items()}
        best = min(ms, key=ms.get)
        row["gather_graph_ms"], row["gather_block"] = ms[best], best.split()[1]
        row["gather_ceiling_share"] = row["rows_read_bytes"] / (ms[best] * 1e-3) / 1e9 / ceiling_gbs
        row["of_gather"] = row["graph_ceiling_share"] / row["gather_ceiling_share"]
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        row.setdefault("errors", {})["gather"] = f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        replays = weights = kjt = None
        gc.collect()
        torch.cuda.empty_cache()


def _forget_choices() -> None:
    """Forget the CUDA backend's measured choices: the next model may sit where the last one's
    weights were (the address is part of a choice's key)."""
    from ..kernels import selection

    selection.forget_all()


def _choices() -> Dict[str, str]:
    """What ours chose by measurement since the last _forget_choices, by tuner: the forward's
    kernels (backend auto), the CUDA forward's launch order (backend cuda), the backward's path."""
    from ..kernels import pooled_cuda, selection

    tuners = {"forward": selection.FORWARD, "forward_order": pooled_cuda.FORWARD_ORDER_TUNER,
              "backward_path": pooled_cuda.BACKWARD_PATH_TUNER}
    made = {name: "+".join(sorted(set(t.decisions().values()))) for name, t in tuners.items()}
    return {name: choice for name, choice in made.items() if choice}


def run_sweep(device: torch.device, small: bool, warmup: int, iters: int, backend: str = "auto",
              ceiling_gbs: Optional[float] = None, progress=None, min_ms: float = 100.0) -> List[dict]:
    results = []
    for p in points(small):
        rows = run_point(p, device, warmup, iters, backend, min_ms=min_ms)
        for r in rows:
            if r["phase"] == "forward" and ceiling_gbs:
                for key, timed in (("ceiling_share", "recom_rec_ms"), ("fbgemm_ceiling_share", "fbgemm_ms"),
                                   ("graph_ceiling_share", "recom_rec_graph_ms"),
                                   ("fbgemm_graph_ceiling_share", "fbgemm_graph_ms")):
                    if r.get(timed):
                        r[key] = r["lookup_bytes"] / (r[timed] * 1e-3) / 1e9 / ceiling_gbs
                if r.get("graph_ceiling_share", 1.0) < CEILING_TARGET:
                    _time_gather(r, p, device, iters, ceiling_gbs)
        results.extend(rows)
        if progress:
            progress(rows)
    return results


def summarize(results: List[dict]) -> Dict[str, dict]:
    """Per phase: points with a ratio, the minimum and geometric mean, the points below 1.0x and
    the five worst."""
    summary = {}
    for phase in PHASES:
        for name, key in ((phase, "ratio"), (f"{phase} vs {UNCHECKED}", "ratio_unchecked")):
            stats = _ratio_stats([r for r in results if r["phase"] == phase and r.get(key)], key)
            if stats:
                summary[name] = stats
    fwd = [r for r in results if r["phase"] == "forward" and r.get("ceiling_share")
           and r["rows_read_bytes"] >= BANDWIDTH_BOUND_BYTES]
    if fwd:
        below = [r for r in fwd if r["ceiling_share"] < CEILING_TARGET]
        summary["forward_bandwidth_bound"] = {
            "points": len(fwd), "min_ceiling_share": min(r["ceiling_share"] for r in fwd),
            "below_85pct": [(r["point"], round(r["ceiling_share"], 3)) for r in below],
            # the same forwards replayed from CUDA graphs (device time alone): those still below
            # 85% are held back by their kernels, the others by the host's start-up
            "graphed": sum(1 for r in fwd if r.get("graph_ceiling_share")),
            "graph_below_85pct": [(r["point"], round(r["graph_ceiling_share"], 3)) for r in fwd
                                  if r.get("graph_ceiling_share") and r["graph_ceiling_share"] < CEILING_TARGET],
            # those beside a bare gather of their rows: (point, ours' share of copy, the gather's, ours'
            # share of the gather's rate)
            "gather": [(r["point"], round(r["graph_ceiling_share"], 3), round(r["gather_ceiling_share"], 3),
                        round(r["of_gather"], 3)) for r in fwd if r.get("gather_graph_ms")]}
    return summary


def _ratio_stats(rated: List[dict], key: str) -> Optional[dict]:
    if not rated:
        return None
    ratios = [r[key] for r in rated]
    worst = sorted(rated, key=lambda r: r[key])
    return {
        "points": len(rated), "min": min(ratios),
        "geomean": math.exp(statistics.fmean(math.log(x) for x in ratios)),
        "below_1": [(r["point"], round(r[key], 3)) for r in worst if r[key] < 1.0],
        "worst5": [(r["point"], round(r[key], 3)) for r in worst[:5]],
    }


def format_results(meta: dict, results: List[dict], summary: Dict[str, dict]) -> str:
    lines = [f"sweep on {meta['device']} (copy ceiling {meta['copy_gbs']:.0f} GB/s), ratio = fbgemm ms / ours ms; "
             f"fbgemm with its default bounds check, 'unchk' without it (ours checks ids in its kernels)"]
    head = (f"{'point':52} {'phase':16} {'ours ms':>9} {'fbgemm ms':>9} {'ratio':>6} {'unchk':>6} {'copy%':>6} "
            f"{'graph%':>6} {'choice':>10}")
    lines.append(head)

    def cell(r, key, fmt, pct=False):
        return (f"{100 * r[key]:.0f}%" if pct else fmt.format(r[key])) if r.get(key) else "-"

    for r in results:
        ours = f"{r['recom_rec_ms']:.3f}" if r.get("recom_rec_ms") else "error"
        diff = r.get("update_max_rel_diff", r.get("max_rel_diff"))
        flag = "" if r.get("agree", True) else f"  MISMATCH {diff:.1e}"
        if r.get("errors"):
            flag += "  " + "; ".join(f"{k}: {v[:60]}" for k, v in r["errors"].items())
        lines.append(f"{r['point']:52} {r['phase']:16} {ours:>9} {cell(r, 'fbgemm_ms', '{:.3f}'):>9} "
                     f"{cell(r, 'ratio', '{:.2f}'):>6} {cell(r, 'ratio_unchecked', '{:.2f}'):>6} "
                     f"{cell(r, 'ceiling_share', '', True):>6} {cell(r, 'graph_ceiling_share', '', True):>6} "
                     f"{r.get('choice', ''):>10}{flag}")
    for phase, s in summary.items():
        if phase == "forward_bandwidth_bound":
            lines.append(f"forward, rows read >= 100 MB: {s['points']} points, min {100 * s['min_ceiling_share']:.0f}% "
                         f"of copy; below 85%: {len(s['below_85pct'])}; replayed from CUDA graphs (device time "
                         f"alone, {s['graphed']} points), below 85%: {len(s['graph_below_85pct'])}")
            lines += [f"  {point}: ours {100 * ours:.0f}% of copy; a bare gather of its rows {100 * gather:.0f}%, "
                      f"ours at {100 * share:.0f}% of the gather's rate"
                      for point, ours, gather, share in s.get("gather", [])]
            continue
        lines.append(f"{phase}: {s['points']} points, min {s['min']:.2f}x, geomean {s['geomean']:.2f}x, "
                     f"below 1.0x: {len(s['below_1'])}; worst: "
                     + "; ".join(f"{n} {x:.2f}x" for n, x in s["worst5"]))
    return "\n".join(lines)


def plot_heatmap(results: List[dict], path: str) -> None:
    """Ratio over dim x ids per bag (the grid points), one panel per phase; a row against fbgemm
    with its bounds check, a row against fbgemm without it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [r for r in results if r["axis"] == "grid"]
    dims = sorted({r["dim"] for r in grid})
    ids = sorted({r["ids"] for r in grid})
    against = [(key, title) for key, title in (("ratio", "fbgemm"), ("ratio_unchecked", "fbgemm unchecked"))
               if any(r.get(key) for r in grid)] or [("ratio", "fbgemm")]
    fig, axes = plt.subplots(len(against), len(PHASES), figsize=(5 * len(PHASES), 4.3 * len(against)), squeeze=False)
    for row_axes, (key, title) in zip(axes, against):
        for ax, phase in zip(row_axes, PHASES):
            m = np.full((len(ids), len(dims)), np.nan)
            for r in grid:
                if r["phase"] == phase and r.get(key):
                    m[ids.index(r["ids"]), dims.index(r["dim"])] = r[key]
            im = ax.imshow(np.log2(m), cmap="RdYlGn", vmin=-1.5, vmax=1.5, aspect="auto")
            for (i, j), v in np.ndenumerate(m):
                if not np.isnan(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(dims)), [str(d) for d in dims])
            ax.set_yticks(range(len(ids)), ["1" if i == 1 else f"~{i}" for i in ids])
            ax.set_xlabel("dim")
            ax.set_ylabel("ids per bag")
            ax.set_title(f"{phase}\n{title} ms / ours ms", fontsize=10)
    fig.subplots_adjust(hspace=0.4)
    fig.colorbar(im, ax=axes.ravel().tolist(), label="log2 ratio")
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main_sweep(args, device: torch.device, ceiling: float) -> None:
    small = args.small or device.type == "cpu"
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "copy_gbs": ceiling, "small": small, "backend": args.backend}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    done: List[dict] = []
    started = time.perf_counter()

    def write(results, summary):
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "summary": summary, "results": results}, f, indent=1)

    def progress(rows):
        print(format_results(meta, rows, {}).split("\n", 2)[2], flush=True)
        # the points so far, so that a run cut off by a time limit still leaves them (to --compare)
        done.extend(rows)
        meta["seconds"], meta["complete"] = round(time.perf_counter() - started, 1), False
        write(done, {})

    results = run_sweep(device, small, args.warmup, args.iters, args.backend, ceiling, progress, args.min_ms)
    meta["seconds"], meta["complete"] = round(time.perf_counter() - started, 1), True
    summary = summarize(results)
    print(format_results(meta, results, summary).split("\n")[0])
    print("\n".join(format_results(meta, [], summary).split("\n")[2:]))
    write(results, summary)
    plot_heatmap(results, args.out + ".png")
    print(f"wrote {args.out}.json and {args.out}.png; the sweep took {meta['seconds']:.0f} s")
