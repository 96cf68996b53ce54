"""Helpers the examples share: held-out splits, evaluation, the curve plot."""
import itertools
import json
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

import torch
from torchmetrics.functional.classification import binary_auroc

REPO = Path(__file__).resolve().parents[1]
SAMPLE_DATA = REPO / "tests" / "data"


def take_split(batches: Iterable, max_batches: int, eval_batches: int) -> Tuple[List, List]:
    """Reads at most ``max_batches`` batches and holds out the last ``eval_batches`` of them
    (at least one, at most a third, so tiny files still train on something)."""
    read = list(itertools.islice(batches, max_batches))
    if len(read) < 2:
        raise SystemExit(f"need at least 2 batches of data, got {len(read)}: use a smaller --batch-size")
    held = max(1, min(eval_batches, len(read) // 3))
    return read[:-held], read[-held:]


def cycle(batches: Sequence, steps: int):
    """``steps`` training batches, going over ``batches`` as many times as needed (epochs)."""
    return (batches[i % len(batches)] for i in range(steps))


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Sequence, predict: Callable, loss_fn: Callable) -> Dict[str, float]:
    """Mean loss and AUC (torchmetrics) over ``batches``; ``predict(model, batch)`` returns scores."""
    was_training = model.training
    model.eval()
    scores, labels, loss_sum, n = [], [], 0.0, 0
    for batch in batches:
        s = predict(model, batch)
        loss_sum += loss_fn(s, batch.labels).item() * batch.labels.numel()
        n += batch.labels.numel()
        scores.append(s.float().cpu())
        labels.append(batch.labels.cpu())
    model.train(was_training)
    labels_all = torch.cat(labels)
    auc = binary_auroc(torch.cat(scores), labels_all.long()).item() if 0 < labels_all.sum() < len(labels_all) else float("nan")
    return {"loss": loss_sum / n, "auc": auc}


def plot_curves(path: Path, title: str, train: List[Tuple[int, float]], evals: List[Tuple[int, Dict[str, float]]]) -> Path:
    """Train loss (and held-out loss) on the left, held-out AUC on the right, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    steps, losses = zip(*train)
    window = max(1, len(losses) // 20)
    smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]
    left.plot(steps, losses, alpha=0.3, label="train loss")
    left.plot(steps, smooth, label=f"train loss (mean of {window})")
    left.plot([s for s, _ in evals], [e["loss"] for _, e in evals], "o-", label="held-out loss")
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.legend()
    right.plot([s for s, _ in evals], [e["auc"] for _, e in evals], "o-", color="C2")
    right.set_xlabel("step")
    right.set_ylabel("held-out AUC")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def pick_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    return device

