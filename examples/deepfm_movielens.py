"""torchrec's SimpleDeepFMNN with recom_rec.EmbeddingBagCollection on MovieLens.

Reads MovieLens-1M (the directory with ratings.dat, users.dat, movies.dat) or the joined CSV
sample through recom_rec.data: user, movie, gender, age, occupation and zip are one id per bag,
the genres a weighted multi-hot bag (each of a movie's k genres weighs 1/k), so the collection
is built with is_weighted=True and its genres bag is the mean of the genre embeddings. The
label is "rating >= 4". The tables train with Adagrad fused into the backward
(enable_fused_optimizer), the dense layers with torch's Adagrad; held-out loss and AUC
(torchmetrics) are plotted to a PNG in --out.

    python examples/deepfm_movielens.py                        # the CSV sample in tests/data
    python examples/deepfm_movielens.py --data ml-1m --steps 3000 --batch-size 1024 --device cuda
"""
import argparse
import time
from pathlib import Path

import torch
from torchrec.models.deepfm import SimpleDeepFMNN
from tqdm import tqdm

import recom_rec
from recom_rec.data import movielens_batches, movielens_table_configs

from _common import SAMPLE_DATA, cycle, evaluate, pick_device, plot_curves, take_split, write_json


def predict(model, batch):
    return model(batch.dense_features, batch.sparse_features).squeeze(-1)  # a probability (Sigmoid)


def loss_fn(prob, labels):
    return torch.nn.functional.binary_cross_entropy(prob.clamp(1e-7, 1 - 1e-7), labels)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=SAMPLE_DATA / "movielens_sample.csv",
                   help="ML-1M directory or joined CSV (default: %(default)s)")
    p.add_argument("--steps", type=int, default=300, help="training steps (epochs over small files)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-batches", type=int, default=20, help="held-out batches (at most a third of what is read)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--max-batches", type=int, default=5_000, help="read at most this many batches")
    p.add_argument("--shuffle-buffer", type=int, default=100_000, help="rows shuffled together while reading")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64, help="SimpleDeepFMNN's hidden_layer_size")
    p.add_argument("--deep-fm-dim", type=int, default=16, help="SimpleDeepFMNN's deep_fm_dimension")
    p.add_argument("--lr", type=float, default=0.05, help="embedding (fused Adagrad) learning rate")
    p.add_argument("--dense-lr", type=float, default=0.01)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", type=Path, default=Path("out/deepfm_movielens"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    if not args.data.exists():
        raise SystemExit(f"--data {args.data}: not found (give an ML-1M directory or the joined CSV)")

    batches = movielens_batches(args.data, args.batch_size, shuffle_buffer=args.shuffle_buffer, seed=args.seed)
    train, held_out = take_split(batches, args.max_batches, args.eval_batches)
    train = [b.to(device) for b in train]
    held_out = [b.to(device) for b in held_out]

    tables = movielens_table_configs(args.embedding_dim)
    ebc = recom_rec.EmbeddingBagCollection(tables, is_weighted=True, device=device)
    model = SimpleDeepFMNN(num_dense_features=1, embedding_bag_collection=ebc, hidden_layer_size=args.hidden,
                           deep_fm_dimension=args.deep_fm_dim).to(device)
    ebc.enable_fused_optimizer("adagrad", lr=args.lr)
    opt = torch.optim.Adagrad([p for n, p in model.named_parameters() if ".embedding_bags." not in n], lr=args.dense_lr)
    print(f"SimpleDeepFMNN on {args.data}: {len(train)} training batches of {args.batch_size}, "
          f"{len(held_out)} held out; {len(tables)} tables ({', '.join(t.feature_names[0] for t in tables)}), "
          f"weighted genres, dim {args.embedding_dim}, {args.steps} steps on {device}")

    if train is not None and len(train) * args.batch_size < 10_000:
        print(f"note: {len(train) * args.batch_size} training rows are too few to measure model quality "
              "(the model overfits them); this run shows the pipeline - give a full dataset with --data")
    train_curve, eval_curve = [], [(0, evaluate(model, held_out, predict, loss_fn))]
    start = time.perf_counter()
    bar = tqdm(cycle(train, args.steps), total=args.steps, desc="train")
    for step, batch in enumerate(bar, 1):
        opt.zero_grad()
        loss = loss_fn(predict(model, batch), batch.labels)
        loss.backward()
        opt.step()
        train_curve.append((step, loss.item()))
        if step % args.eval_every == 0 or step == args.steps:
            eval_curve.append((step, evaluate(model, held_out, predict, loss_fn)))
            bar.set_postfix(eval_loss=f"{eval_curve[-1][1]['loss']:.4f}", auc=f"{eval_curve[-1][1]['auc']:.4f}")
    elapsed = time.perf_counter() - start
    bar.close()
    best = max(eval_curve, key=lambda e: e[1]["auc"])
    final = eval_curve[-1][1]
    print(f"trained {args.steps} steps in {elapsed:.1f} s ({args.steps / elapsed:.1f} steps/s)")
    print(f"held-out: loss {final['loss']:.4f}  AUC {final['auc']:.4f}  (before training: loss "
          f"{eval_curve[0][1]['loss']:.4f}  AUC {eval_curve[0][1]['auc']:.4f}; best AUC {best[1]['auc']:.4f} at step {best[0]})")
    plot = plot_curves(args.out / "deepfm_movielens.png", f"SimpleDeepFMNN + recom_rec EBC on {args.data.name}",
                       train_curve, eval_curve)
    write_json(args.out / "metrics.json", {"data": str(args.data), "steps": args.steps, "final": final,
                                           "eval_curve": eval_curve, "plot": str(plot)})
    print(f"plot: {plot}")


if __name__ == "__main__":
    main()
