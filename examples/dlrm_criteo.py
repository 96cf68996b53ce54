"""torchrec's DLRM with recom_rec.EmbeddingBagCollection on Criteo data.

Reads a real Criteo file (tab-separated Kaggle/Terabyte dump, .gz, or the CSV sample with a
header) through recom_rec.data, or draws synthetic Criteo-shaped batches when no --data is
given. The embedding tables are trained with row-wise Adagrad fused into the backward
(torchrec's apply_optimizer_in_backward, or --fused-optimizer NAME through
enable_fused_optimizer), the MLPs with a dense Adagrad. Held-out batches give loss and AUC
(torchmetrics) every --eval-every steps; the curve is written as a PNG to --out.

At the end the model and both optimizers are checkpointed (the module's state_dict carries the
fused optimizer's state) and restored into a freshly built model: the example checks that the
restored model gives the same held-out loss, and that one more training step from the original
and from the restored model gives the same loss again.

    python examples/dlrm_criteo.py                                # synthetic, ~1 min on a 2-core CPU
    python examples/dlrm_criteo.py --data tests/data/criteo_sample.csv --batch-size 32
    python examples/dlrm_criteo.py --data day_0.gz --max-rows 1000000 --device cuda --steps 5000
    python examples/dlrm_criteo.py --ps memory://criteo       # large tables in the parameter-server tier
    python examples/dlrm_criteo.py --ps redis://127.0.0.1:6379/0?prefix=dlrm --max-rows 10000000
    python examples/dlrm_criteo.py --quantize int8 int4          # + held-out AUC of quantized copies

With --quantize, the trained model is converted by recom_rec.quantize (INT8 / INT4 / INT2 / FP16
rows, recom_rec.quant.EmbeddingBagCollection) and its held-out loss and AUC are reported beside the
fp32 model's.

With --ps URL, tables of at least --ps-min-rows rows live in the store at URL with --ps-cache-rows
of their rows cached in the module; the checkpoint flushes them to the store, and the restored
model reads them back from the same store (so the URL must name a shared store: memory://NAME,
not a private memory://).
"""
import argparse
import itertools
import time
import warnings
from pathlib import Path

import torch
from torchrec import EmbeddingBagConfig
from torchrec.models.dlrm import DLRM
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from tqdm import tqdm

import recom_rec
import recom_rec.ps
from recom_rec.data import criteo_batches, criteo_hash_sizes, synthetic_criteo_batches

from _common import cycle, evaluate, pick_device, plot_curves, take_split, write_json


def build_model(hash_sizes, dim, device, fused_optimizer, lr, ps=None):
    tables = [EmbeddingBagConfig(name=f"t_C{i + 1}", embedding_dim=dim, num_embeddings=n, feature_names=[f"C{i + 1}"])
              for i, n in enumerate(hash_sizes)]
    ebc = recom_rec.EmbeddingBagCollection(tables, device=device, ps=ps)
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=13,
                 dense_arch_layer_sizes=[64, dim], over_arch_layer_sizes=[64, 32, 1]).to(device)
    if fused_optimizer == "apply_optimizer_in_backward":  # torchrec's way; recom_rec fuses it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": lr})
    else:
        ebc.enable_fused_optimizer(fused_optimizer, lr=lr)
    return model, ebc


def dense_optimizer(model, lr):
    return torch.optim.Adagrad([p for name, p in model.named_parameters() if ".embedding_bags." not in name], lr=lr)


def predict(model, batch):
    return model(batch.dense_features, batch.sparse_features).squeeze(-1)


loss_fn = torch.nn.functional.binary_cross_entropy_with_logits
QUANTIZED_DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "int2": torch.quint2x4, "fp16": torch.half}


def evaluate_quantized(model, held_out, kinds, fp32):
    """Held-out loss and AUC of quantized copies of ``model`` beside the fp32 model's."""
    results = {}
    for kind in kinds:
        quantized = recom_rec.quantize(model, QUANTIZED_DTYPES[kind])
        m = evaluate(quantized, held_out, predict, loss_fn)
        results[kind] = {**m, "auc_minus_fp32": m["auc"] - fp32["auc"]}
        print(f"quantized {kind:>5}: held-out loss {m['loss']:.4f}  AUC {m['auc']:.4f}  "
              f"(fp32 AUC {fp32['auc']:.4f}, difference {m['auc'] - fp32['auc']:+.4f})")
    return results


def train_step(model, opt, batch):
    opt.zero_grad()
    loss = loss_fn(predict(model, batch), batch.labels)
    loss.backward()  # the embedding rows are updated here (fused)
    opt.step()       # the MLPs
    return loss.item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="*", default=None, help="Criteo file(s): TSV, .gz or CSV with header; none = synthetic")
    p.add_argument("--steps", type=int, default=1500, help="training steps (epochs over small files)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--eval-batches", type=int, default=10, help="held-out batches (the last ones read)")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--max-rows", type=int, default=20_000, help="cap on each table's rows (hash size)")
    p.add_argument("--max-batches", type=int, default=2_000, help="read at most this many batches of a file")
    p.add_argument("--lr", type=float, default=0.05, help="embedding (fused) learning rate")
    p.add_argument("--dense-lr", type=float, default=0.05)
    p.add_argument("--fused-optimizer", default="apply_optimizer_in_backward",
                   help="'apply_optimizer_in_backward' (torchrec's RowWiseAdagrad) or a name for "
                        "enable_fused_optimizer: sgd, adagrad, rowwise_adagrad, adam, adamw")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", type=Path, default=Path("out/dlrm_criteo"), help="directory for the plot, metrics and checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ps", default=None, metavar="URL",
                   help="parameter-server store for the large tables, e.g. memory://criteo or redis://host:6379/0")
    p.add_argument("--ps-min-rows", type=int, default=10_000, help="tables with at least this many rows go to --ps")
    p.add_argument("--ps-cache-rows", type=int, default=4096, help="rows of each PS-backed table cached in the module")
    p.add_argument("--ps-prefetch", type=int, default=0, metavar="N",
                   help="stage the PS rows of the next N batches (up to 4) while one trains (recom_rec.ps.wrap)")
    p.add_argument("--quantize", nargs="+", default=[], choices=list(QUANTIZED_DTYPES),
                   help="also evaluate copies of the trained model with quantized tables")
    args = p.parse_args(argv)
    if args.quantize and args.ps:
        raise SystemExit("--quantize needs every row in the module: it cannot be combined with --ps")
    device = pick_device(args.device)
    torch.manual_seed(args.seed)

    hash_sizes = criteo_hash_sizes(args.max_rows)
    if args.data:
        source = ", ".join(args.data)
        train, held_out = take_split(criteo_batches(args.data, args.batch_size, hash_sizes), args.max_batches, args.eval_batches)
    else:
        source = "synthetic Criteo-shaped batches"
        train = None  # a fresh stream of batches, drawn as we go
        held_out = list(synthetic_criteo_batches(args.eval_batches, args.batch_size, hash_sizes, seed=args.seed + 10_000))
    held_out = [b.to(device) for b in held_out]
    if train is None:
        stream = synthetic_criteo_batches(args.steps + 1, args.batch_size, hash_sizes, seed=args.seed)
        train_batches = (b.to(device) for b in stream)
    else:
        train = [b.to(device) for b in train]
        train_batches = cycle(train, args.steps + 1)

    ps = None
    if args.ps:
        if args.ps.rstrip("/") == "memory:":
            raise SystemExit("--ps memory:// is private to one module: name it (memory://NAME) so the "
                             "restored model can read the checkpointed rows")
        from recom_rec.ps import PSConfig

        ps = {f"t_C{i + 1}": PSConfig(url=args.ps, cache_rows=args.ps_cache_rows)
              for i, n in enumerate(hash_sizes) if n >= args.ps_min_rows}
    model, ebc = build_model(hash_sizes, args.embedding_dim, device, args.fused_optimizer, args.lr, ps)
    opt = dense_optimizer(model, args.dense_lr)
    print(f"DLRM on {source}: {'a stream of' if train is None else len(train)} training batches of "
          f"{args.batch_size}, {len(held_out)} held out; "
          f"26 tables (rows capped at {args.max_rows}), dim {args.embedding_dim}, {args.steps} steps on {device}")
    if ps:
        print(f"parameter-server tier: {len(ps)} tables of >= {args.ps_min_rows} rows on {args.ps}, "
              f"{args.ps_cache_rows} rows cached each")

    if train is not None and len(train) * args.batch_size < 10_000:
        print(f"note: {len(train) * args.batch_size} training rows are too few to measure model quality "
              "(the model overfits them); this run shows the pipeline - give a full dataset with --data")
    train_curve, eval_curve = [], [(0, evaluate(model, held_out, predict, loss_fn))]
    start = time.perf_counter()
    bar = tqdm(total=args.steps, desc="train")
    step = 0
    while step < args.steps:  # an evaluation after every eval_every steps and after the last
        interval = itertools.islice(train_batches, min(args.eval_every, args.steps - step))
        if ps and args.ps_prefetch:
            # The next batches' rows are staged while one trains; only the loop's own batches may go
            # through the model inside it, so each interval is a loop and evaluation comes between.
            interval = recom_rec.ps.wrap(interval, model, prefetch=args.ps_prefetch)
        before = step
        for batch in interval:
            step += 1
            bar.update()
            train_curve.append((step, train_step(model, opt, batch)))
        if step == before:
            break  # the batches ran out
        eval_curve.append((step, evaluate(model, held_out, predict, loss_fn)))
        bar.set_postfix(eval_loss=f"{eval_curve[-1][1]['loss']:.4f}", auc=f"{eval_curve[-1][1]['auc']:.4f}")
    elapsed = time.perf_counter() - start
    bar.close()
    final = eval_curve[-1][1]
    print(f"trained {args.steps} steps in {elapsed:.1f} s ({args.steps / elapsed:.1f} steps/s)")
    print(f"held-out: loss {final['loss']:.4f}  AUC {final['auc']:.4f}  (before training: loss "
          f"{eval_curve[0][1]['loss']:.4f}  AUC {eval_curve[0][1]['auc']:.4f})")
    print(f"embedding optimizer: {type(ebc.fused_optimizer).__name__} with state "
          f"{sorted({k for s in ebc.fused_optimizer.state.values() for k in s})}")
    quantized = evaluate_quantized(model, held_out, args.quantize, final)

    # Checkpoint: the module's state_dict holds weights and the fused optimizer's state.
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.out / "checkpoint.pt"
    if ps:  # PS-backed rows are checkpointed in their store, not in the state_dict
        print(f"flushed {recom_rec.ps.flush(model)} dirty rows to {args.ps}")
    torch.save({"model": model.state_dict(), "dense_optimizer": opt.state_dict(), "step": args.steps}, ckpt_path)
    torch.manual_seed(args.seed + 1)  # a fresh model with different random weights
    restored, _ = build_model(hash_sizes, args.embedding_dim, device, args.fused_optimizer, args.lr, ps)
    restored_opt = dense_optimizer(restored, args.dense_lr)
    ckpt = torch.load(ckpt_path, map_location=device, weights_only=True)
    restored.load_state_dict(ckpt["model"])  # strict: every key, optimizer state included
    restored_opt.load_state_dict(ckpt["dense_optimizer"])
    loss_orig = evaluate(model, held_out, predict, loss_fn)["loss"]
    loss_restored = evaluate(restored, held_out, predict, loss_fn)["loss"]
    print(f"checkpoint {ckpt_path}: held-out loss original {loss_orig:.6f}, restored {loss_restored:.6f}, "
          f"{'identical' if loss_orig == loss_restored else 'DIFFERENT'}")
    extra = next(train_batches)
    if ps:
        # Both models now share one store: training either would change the other's rows.
        step_orig = step_restored = after_orig = after_restored = None
        print("one more step: not compared with --ps (the original and the restored model share the store)")
    else:
        # One more step from both: equal only if the optimizer states were restored too.
        step_orig, step_restored = train_step(model, opt, extra), train_step(restored, restored_opt, extra)
        after_orig = evaluate(model, held_out, predict, loss_fn)["loss"]
        after_restored = evaluate(restored, held_out, predict, loss_fn)["loss"]
        print(f"one more step: held-out loss original {after_orig:.6f}, restored {after_restored:.6f}, "
              f"{'identical' if after_orig == after_restored else 'DIFFERENT'}")

    plot = plot_curves(args.out / "dlrm_criteo.png", f"DLRM + recom_rec EBC on {source}", train_curve, eval_curve)
    metrics = {"source": source, "steps": args.steps, "steps_per_s": args.steps / elapsed, "final": final,
               "eval_curve": eval_curve, "restore": {"eval_loss": [loss_orig, loss_restored],
                                                     "after_one_step": [after_orig, after_restored],
                                                     "train_loss_one_step": [step_orig, step_restored]},
               "plot": str(plot), "checkpoint": str(ckpt_path), "quantized": quantized}
    write_json(args.out / "metrics.json", metrics)
    print(f"plot: {plot}")
    return metrics


if __name__ == "__main__":
    main()
