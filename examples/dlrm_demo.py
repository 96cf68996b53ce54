"""`make demo`: torchrec's DLRM trained on synthetic Criteo-shaped data, once with torchrec's
EmbeddingBagCollection and once with recom_rec's, side by side (loss, AUC, steps/s).

Both runs start from the same weights, see the same batches and train with Adagrad: torchrec's
module with dense gradients and torch.optim.Adagrad, ours with Adagrad fused into the backward
(torchrec's apply_optimizer_in_backward) - the same update, since Adagrad leaves rows without
gradient untouched. So the losses must agree; the difference is speed.

With ``--ps URL`` (``make demo`` uses ``memory://demo``) our module keeps its large tables in the
parameter-server tier: their rows live in the store at URL and only ``--ps-cache-rows`` of them
at a time in the module's buffer. The starting weights are written into the store through
load_state_dict, so the losses must still agree with torchrec's; the report adds the cache's hit
rate and the rows pulled and pushed.
"""
import argparse
import copy
import time
import warnings

import torch
import torchrec
from torchmetrics.functional.classification import binary_auroc
from torchrec import EmbeddingBagConfig
from torchrec.models.dlrm import DLRM
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from tqdm import tqdm

import recom_rec
from recom_rec.data import CRITEO_KAGGLE_CARDINALITIES, synthetic_criteo_batches


def build_tables(max_rows: int, dim: int):
    return [
        EmbeddingBagConfig(name=f"t_C{i + 1}", embedding_dim=dim, num_embeddings=min(card, max_rows),
                           feature_names=[f"C{i + 1}"])
        for i, card in enumerate(CRITEO_KAGGLE_CARDINALITIES)
    ]


def train(model, batches, lr, desc):
    # Parameters whose optimizer is fused into the backward never get a .grad: Adagrad skips them.
    opt = torch.optim.Adagrad(model.parameters(), lr=lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses, logits_all, labels_all = [], [], []
    start = time.perf_counter()
    for batch in tqdm(batches, desc=desc, leave=False):
        opt.zero_grad()
        logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = loss_fn(logits, batch.labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        logits_all.append(logits.detach())
        labels_all.append(batch.labels)
    elapsed = time.perf_counter() - start
    tail = len(batches) // 5 or 1  # AUC over the last fifth of training, on batches not yet fit
    auc = binary_auroc(torch.cat(logits_all[-tail:]), torch.cat(labels_all[-tail:]).long()).item()
    return {"loss": sum(losses[-tail:]) / tail, "auc": auc, "steps_per_s": len(batches) / elapsed}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--max-rows", type=int, default=20_000, help="cap on each table's rows (fits a laptop)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ps", default=None, metavar="URL",
                   help="put tables of at least --ps-min-rows rows in the parameter-server tier at URL "
                   "(e.g. memory://demo or redis://127.0.0.1:6379/0)")
    p.add_argument("--ps-min-rows", type=int, default=10_000)
    p.add_argument("--ps-cache-rows", type=int, default=4096, help="cached rows per PS-backed table")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    tables = build_tables(args.max_rows, args.embedding_dim)
    hash_sizes = [t.num_embeddings for t in tables]
    batches = list(synthetic_criteo_batches(args.steps, args.batch_size, hash_sizes, zipf_a=1.05, seed=args.seed))

    def dlrm(ebc):
        return DLRM(embedding_bag_collection=ebc, dense_in_features=13,
                    dense_arch_layer_sizes=[64, args.embedding_dim], over_arch_layer_sizes=[64, 1])

    stock = dlrm(torchrec.EmbeddingBagCollection(copy.deepcopy(tables)))
    ps = None
    if args.ps:
        from recom_rec.ps import PSConfig

        ps = {t.name: PSConfig(url=args.ps, cache_rows=args.ps_cache_rows)
              for t in tables if t.num_embeddings >= args.ps_min_rows}
    ebc = recom_rec.EmbeddingBagCollection(copy.deepcopy(tables), ps=ps)
    fused = dlrm(ebc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": args.lr})
    # Same start, so the curves must match (PS-backed tables: the weights go into the store,
    # with the fused optimizer's state beside them - hence the optimizer is asked for first).
    fused.load_state_dict(stock.state_dict())

    print(f"DLRM, 26 Criteo-shaped tables (rows capped at {args.max_rows}), dim {args.embedding_dim}, "
          f"batch {args.batch_size}, {args.steps} steps, Adagrad lr {args.lr}")
    if ps:
        print(f"recom_rec: {len(ps)} tables of >= {args.ps_min_rows} rows on {args.ps}, "
              f"{args.ps_cache_rows} rows cached each")
    results = {name: train(model, batches, args.lr, name)
               for name, model in (("torchrec EBC", stock), ("recom_rec EBC", fused))}
    print(f"{'module':<16}{'loss':>10}{'AUC':>10}{'steps/s':>10}")
    for name, r in results.items():
        print(f"{name:<16}{r['loss']:>10.4f}{r['auc']:>10.4f}{r['steps_per_s']:>10.1f}")
    if ps:
        from recom_rec import ps as ps_tier

        stats = [t.cache.stats for tier in ps_tier.tiers_of(fused) for t in tier.tables.values()]
        hits, misses = sum(s["hits"] for s in stats), sum(s["misses"] for s in stats)
        pushed = sum(s["pushed"] for s in stats) + ps_tier.flush(fused)
        print(f"parameter-server tier: cache hit rate {hits / max(1, hits + misses):.1%}, "
              f"{misses} rows pulled, {pushed} rows pushed (flushed at the end)")
    a, b = results["torchrec EBC"], results["recom_rec EBC"]
    print(f"speed-up {b['steps_per_s'] / a['steps_per_s']:.2f}x; |loss difference| {abs(a['loss'] - b['loss']):.2e}")
    return results


if __name__ == "__main__":
    main()
