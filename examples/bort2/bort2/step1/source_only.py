"""Source-only baseline: cross-entropy on the labelled source images."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Step1Batch, Step1Method


class SourceOnly(Step1Method):
    """``loss = mean_i CE(model(src_x_i), src_y_i)``; target images are ignored."""

    name = "source_only"
    rows_of_single_pass = True

    def loss(self, batch: Step1Batch) -> tuple[torch.Tensor, dict[str, float]]:
        logits = self.logits(batch.src_x, batch.src_d)
        loss = F.cross_entropy(logits, batch.src_y)
        acc = (logits.argmax(1) == batch.src_y).float().mean()
        return loss, {"loss": loss.item(), "loss_src": loss.item(), "src_acc": acc.item()}
