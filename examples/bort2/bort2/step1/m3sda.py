"""M3SDA (Peng et al., ICCV 2019): moment matching across all source and target domains.

With features ``h`` of ``[src_x; tgt_weak]`` grouped by domain (each source domain present in
the batch, and the target), the k-th moment of group ``g`` is ``E_g[h^k]`` (element-wise
power, mean over the group's rows) and::

    MD = sum_{k=1..K} mean_{pairs a<b of groups} || E_a[h^k] - E_b[h^k] ||_2
    loss = mean_i CE(head(h_i), src_y_i) + lambda_m * MD

The paper normalises its source-target and source-source sums separately by their pair
counts; here one mean over all pairs of the K+1 groups is used. Simplification: M3SDA trains
one classifier per source and combines them; this implementation keeps the model's single
head trained on all sources.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Step1Batch, Step1Method, require_target


def moment_distance(groups: list[torch.Tensor], moments: int = 2) -> torch.Tensor:
    """``sum_k mean_{a<b} ||E_a[h^k] - E_b[h^k]||_2`` over feature groups (each (n_g, D)).

    Returns 0 when fewer than two groups are given. The square root is taken of the squared
    distance clamped at 1e-12 so that the gradient stays finite for identical moments.
    """
    if len(groups) < 2:
        return groups[0].new_zeros(()) if groups else torch.zeros(())
    total = groups[0].new_zeros(())
    rows, cols = torch.triu_indices(len(groups), len(groups), offset=1)
    for k in range(1, moments + 1):
        mom = torch.stack([g.pow(k).mean(dim=0) for g in groups])  # (G, D)
        diff = mom[rows] - mom[cols]
        total = total + diff.pow(2).sum(dim=1).clamp_min(1e-12).sqrt().mean()
    return total


class M3SDA(Step1Method):
    """Cross-entropy on sources plus moment matching of features across domains.

    Args:
        model: Classifier (``features``/``head``).
        num_domains: Number of source domains.
        lambda_m: Weight of the moment distance.
        moments: Highest moment order matched (M3SDA uses 2).
    """

    name = "m3sda"

    @classmethod
    def config_kwargs(cls, s1) -> dict:
        return {"lambda_m": s1.lambda_m}

    def __init__(self, model: nn.Module, num_domains: int, lambda_m: float = 0.5, moments: int = 2):
        super().__init__(model, num_domains)
        self.lambda_m = float(lambda_m)
        self.moments = int(moments)

    def loss(self, batch: Step1Batch) -> tuple[torch.Tensor, dict[str, float]]:
        require_target(batch)
        n, m = batch.src_x.shape[0], batch.tgt_weak.shape[0]
        x = torch.cat([batch.src_x, batch.tgt_weak])
        d = torch.cat([batch.src_d, self._target_domains(m, batch.src_d)])
        h = self.features(x, d)
        loss_cls = F.cross_entropy(self.model.head(h[:n]), batch.src_y)
        h_src = h[:n]
        groups = [h_src[batch.src_d == k] for k in range(self.num_domains)]
        groups = [g for g in groups if g.shape[0] > 0] + [h[n:]]
        loss_md = moment_distance(groups, self.moments)
        loss = loss_cls + self.lambda_m * loss_md
        return loss, {
            "loss": loss.item(),
            "loss_src": loss_cls.item(),
            "loss_moment": loss_md.item(),
        }
