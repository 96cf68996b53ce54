"""Inference latency of a RECom-style model with hundreds of feature columns.

RECom (ASPLOS'23) points at industrial models with 500+ sparse feature columns: many small
tables of mixed dims, each looked up once per sample. torchrec's stock EmbeddingBagCollection
runs one nn.EmbeddingBag per table; recom_rec's runs every table in one fused kernel. This
example builds such a model (tables -> concatenated pooled embeddings -> MLP -> logit), copies
the same weights into both modules, checks that they give the same outputs, and prints the median
latency (ms) of one inference batch for torchrec's EBC, ours, and ours under torch.compile
(fullgraph). A bar chart goes to --out.

    python examples/many_columns_inference.py                     # 520 columns on the CPU
    python examples/many_columns_inference.py --columns 1000 --batch-size 2048 --device cuda
"""
import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torchrec
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from tqdm import tqdm

import recom_rec

from _common import pick_device, write_json


class ManyColumnsModel(nn.Module):
    def __init__(self, ebc: nn.Module, hidden: int) -> None:
        super().__init__()
        self.ebc = ebc
        width = sum(c.embedding_dim * len(c.feature_names) for c in ebc.embedding_bag_configs())
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.mlp(self.ebc(features).values()).squeeze(-1)


def make_tables(columns: int, seed: int):
    """``columns`` tables (one feature each) of 10..50k rows and dims 4/8/16/32; every fourth
    column is a multi-hot bag with MEAN pooling."""
    rng = np.random.default_rng(seed)
    dims = rng.choice([4, 8, 16, 32], size=columns, p=[0.3, 0.35, 0.25, 0.1])
    rows = np.exp(rng.uniform(np.log(10), np.log(50_000), size=columns)).astype(int)
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=int(dims[i]), num_embeddings=int(rows[i]),
                               feature_names=[f"f{i}"], pooling=PoolingType.MEAN if i % 4 == 3 else PoolingType.SUM)
            for i in range(columns)]


def make_batch(tables, batch_size: int, seed: int, device) -> KeyedJaggedTensor:
    rng = np.random.default_rng(seed)
    lengths, values = [], []
    for i, t in enumerate(tables):
        n = rng.integers(0, 6, size=batch_size) if i % 4 == 3 else np.ones(batch_size, dtype=np.int64)
        lengths.append(n)
        values.append(rng.integers(0, t.num_embeddings, size=int(n.sum())))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[t.feature_names[0] for t in tables], values=torch.from_numpy(np.concatenate(values)),
        lengths=torch.from_numpy(np.concatenate(lengths))).to(device)


@torch.inference_mode()
def median_ms(models, batches, warmup: int, iters: int, device):
    """Median latency of each model, timed round-robin (one batch each in turn) so that a
    change in the machine's load hits every model alike."""
    for model in models.values():
        for b in batches[:warmup]:
            model(b)
    times = {name: [] for name in models}
    for i in tqdm(range(iters), desc="timing", leave=False):
        b = batches[i % len(batches)]
        for name, model in models.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(b)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--columns", type=int, default=520, help="feature columns (one table each)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--iters", type=int, default=30, help="timed batches per module")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", type=Path, default=Path("out/many_columns_inference"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = pick_device(args.device)

    tables = make_tables(args.columns, args.seed)
    torch.manual_seed(args.seed)
    stock = ManyColumnsModel(torchrec.EmbeddingBagCollection(tables, device=device), args.hidden).to(device).eval()
    ours = ManyColumnsModel(recom_rec.EmbeddingBagCollection(tables, device=device, validate_inputs=False),
                            args.hidden).to(device).eval()
    ours.load_state_dict(stock.state_dict())  # same weights: the outputs must agree
    batches = [make_batch(tables, args.batch_size, args.seed + i, device) for i in range(4)]
    dims = sorted({t.embedding_dim for t in tables})
    print(f"{args.columns} feature columns ({len(tables)} tables, dims {dims}, "
          f"{sum(t.num_embeddings for t in tables):,} rows in all), batch {args.batch_size}, {device}")

    with torch.inference_mode():
        ref = stock(batches[0])
        diff = (ours(batches[0]) - ref).abs().max().item()
    models = {"torchrec EBC": stock, "recom_rec EBC": ours}
    if not args.no_compile:
        compiled = torch.compile(ours, fullgraph=True, dynamic=False)
        start = time.perf_counter()
        with torch.inference_mode():
            diff = max(diff, (compiled(batches[0]) - ref).abs().max().item())
        print(f"torch.compile(fullgraph=True) of our model: {time.perf_counter() - start:.1f} s to compile")
        models["recom_rec EBC + compile"] = compiled
    rows = median_ms(models, batches, args.warmup, args.iters, device)

    base = rows["torchrec EBC"]
    print(f"{'module':<26}{'median ms':>11}{'speed-up':>10}")
    for name, ms in rows.items():
        print(f"{name:<26}{ms:>11.2f}{base / ms:>9.2f}x")
    print(f"max |output difference| vs torchrec: {diff:.2e}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(rows), list(rows.values()), color=["C0", "C1", "C2"][:len(rows)])
    ax.set_ylabel("median latency (ms)")
    ax.set_title(f"{args.columns} columns, batch {args.batch_size}, {device}")
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    plot = args.out / "many_columns_inference.png"
    fig.savefig(plot, dpi=100)
    write_json(args.out / "metrics.json", {"columns": args.columns, "batch_size": args.batch_size,
                                           "median_ms": rows, "max_abs_diff": diff, "plot": str(plot)})
    print(f"plot: {plot}")
    return rows


if __name__ == "__main__":
    main()
