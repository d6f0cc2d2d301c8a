"""Evaluation on the target test split: eval-mode logits, accuracy and its Wilson interval."""

from __future__ import annotations

import math

import torch
from torch import nn

from .inputs import norm, prepare


@torch.no_grad()
def predict_dataset(
    model: nn.Module,
    dataset,
    device: torch.device,
    max_n: int = 0,
    batch: int = 512,
    with_features: bool = False,
) -> dict[str, torch.Tensor]:
    """Eval-mode logits (and optionally penultimate features) over a dataset, in order.

    ``model`` needs ``features(x)`` and ``head(h)``; its training mode is restored afterwards.
    """
    was = model.training
    model.eval()
    n = len(dataset) if max_n <= 0 else min(max_n, len(dataset))
    images = getattr(dataset, "images", None)
    logits, feats, labels = [], [], []
    for start in range(0, n, batch):
        idx = range(start, min(n, start + batch))
        if images is not None:
            xb = images[start : start + len(idx)]
            yb = dataset.labels[start : start + len(idx)]
        else:
            items = [dataset[i] for i in idx]
            xb = torch.stack([it[0] for it in items])
            yb = torch.tensor([it[1] for it in items])
        x = norm(prepare(xb, device))
        h = model.features(x)
        logits.append(model.head(h).float().cpu())
        if with_features:
            feats.append(h.float().cpu())
        labels.append(yb)
    model.train(was)
    out = {"logits": torch.cat(logits), "labels": torch.cat(labels)}
    if with_features:
        out["features"] = torch.cat(feats)
    return out


def accuracy_with_ci(correct: int, n: int) -> dict[str, float]:
    """Accuracy with a 95% Wilson score interval."""
    if n == 0:
        return {"acc": float("nan"), "ci_low": float("nan"), "ci_high": float("nan"), "n": 0}
    p, z = correct / n, 1.959964
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return {"acc": p, "ci_low": centre - half, "ci_high": centre + half, "n": n}


def evaluate(model: nn.Module, dataset, device: torch.device, max_n: int = 0) -> dict[str, float]:
    """Accuracy (with its interval) of ``model`` in eval mode on ``dataset``."""
    out = predict_dataset(model, dataset, device, max_n)
    correct = int((out["logits"].argmax(1) == out["labels"]).sum())
    return accuracy_with_ci(correct, len(out["labels"]))
