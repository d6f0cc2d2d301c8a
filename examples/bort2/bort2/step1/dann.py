"""DANN (Ganin & Lempitsky, 2015): adversarial source-vs-target feature alignment.

With features ``h = f(x)`` of ``[src_x; tgt_weak]``, a discriminator ``D`` and a gradient
reversal layer ``R_c`` (identity forward, ``-c * grad`` backward)::

    loss = mean_i CE(head(h_i), src_y_i) + lambda_d * mean_j BCE(D(R_c(h_j)), s_j)

with ``s_j = 1`` for source and ``0`` for target rows (all sources form one domain). ``D``
minimises the BCE; through the reversal the feature extractor maximises ``c`` times it. The
coefficient follows ``c = 2 / (1 + exp(-10 p)) - 1`` of the training progress ``p`` set with
:meth:`~bort2.step1.base.Step1Method.set_progress`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import Step1Batch, Step1Method, require_target


class GradReverse(torch.autograd.Function):
    """Gradient reversal: forward identity, backward ``-coef * grad``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.coef = float(coef)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -ctx.coef * grad, None


def grad_reverse(x: torch.Tensor, coef: float = 1.0) -> torch.Tensor:
    """Apply :class:`GradReverse` with coefficient ``coef``."""
    return GradReverse.apply(x, coef)


def grl_schedule(p: float, gamma: float = 10.0) -> float:
    """DANN's reversal coefficient ``2 / (1 + exp(-gamma p)) - 1`` (0 at p=0, ~1 at p=1)."""
    return 2.0 / (1.0 + math.exp(-gamma * p)) - 1.0


class DANN(Step1Method):
    """Domain-adversarial training with a source-vs-target MLP discriminator.

    Args:
        model: Classifier (``features``/``head``/``feature_dim``).
        num_domains: Number of source domains.
        lambda_d: Weight of the domain loss.
        hidden: Hidden width of the discriminator ``D -> hidden -> hidden -> 1`` (ReLU).
    """

    name = "dann"

    @classmethod
    def config_kwargs(cls, s1) -> dict:
        return {"lambda_d": s1.lambda_d}

    def __init__(
        self, model: nn.Module, num_domains: int, lambda_d: float = 1.0, hidden: int = 1024
    ):
        super().__init__(model, num_domains)
        self.lambda_d = float(lambda_d)
        d = int(model.feature_dim)
        self.discriminator = nn.Sequential(
            nn.Linear(d, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, 1),
        )

    @property
    def grl_coef(self) -> float:
        """Current gradient-reversal coefficient."""
        return grl_schedule(self.progress)

    def loss(self, batch: Step1Batch) -> tuple[torch.Tensor, dict[str, float]]:
        require_target(batch)
        n, m = batch.src_x.shape[0], batch.tgt_weak.shape[0]
        x = torch.cat([batch.src_x, batch.tgt_weak])
        d = torch.cat([batch.src_d, self._target_domains(m, batch.src_d)])
        h = self.features(x, d)
        loss_cls = F.cross_entropy(self.model.head(h[:n]), batch.src_y)
        dom_logits = self.discriminator(grad_reverse(h, self.grl_coef)).squeeze(1)
        is_src = torch.cat([torch.ones(n, device=h.device), torch.zeros(m, device=h.device)])
        loss_dom = F.binary_cross_entropy_with_logits(dom_logits, is_src.to(dom_logits.dtype))
        loss = loss_cls + self.lambda_d * loss_dom
        dom_acc = ((dom_logits > 0).float() == is_src).float().mean()
        return loss, {
            "loss": loss.item(),
            "loss_src": loss_cls.item(),
            "loss_dom": loss_dom.item(),
            "dom_acc": dom_acc.item(),
            "grl_coef": self.grl_coef,
        }
