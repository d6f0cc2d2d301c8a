"""Pseudo-labels, thresholds and the step-2 losses, written plainly."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hypergrad import AdaptiveThreshold, soft_cross_entropy
from hypergrad.labels import gumbel_softmax_labels

from ..models import StochasticClassifier, build_stochastic, entropy_hinge
from ..stages_index import SPECS


def teacher_labels(
    labeler: nn.Module,
    x_weak: torch.Tensor,
    mode: str = "gumbel",
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labels of F_theta on the weak view.

    Args:
        labeler: F_theta (a classifier returning logits).
        x_weak: weak-augmented target images.
        mode: ``"argmax"`` (one-hot of the prediction) or ``"gumbel"`` (straight-through
            Gumbel-softmax sample, differentiable w.r.t. F_theta's parameters).
        temperature: Gumbel-softmax temperature.
        generator: generator of the Gumbel noise.

    Returns:
        ``(labels (N, C), confidence (N,), prediction (N,))``; confidence is the max softmax
        probability of the clean logits, prediction its argmax.
    """
    if mode not in ("gumbel", "argmax"):
        raise ValueError(f"mode must be 'gumbel' or 'argmax', got {mode!r}")
    logits = labeler(x_weak)
    conf, pred = logits.detach().softmax(1).max(1)
    if mode == "gumbel":
        labels = gumbel_softmax_labels(logits, temperature, hard=True, generator=generator)
    else:
        labels = F.one_hot(pred, logits.shape[1]).to(logits.dtype)
    return labels, conf, pred


def build_threshold(kind: str, fixed_tau: float, alpha: float, num_classes: int) -> Callable:
    """``(confidence, prediction) -> bool mask``: fixed tau, adaptive, or per-class adaptive.

    The returned object is an ``nn.Module`` (its state is checkpointed) for the adaptive kinds.
    """
    if kind == "fixed":

        class Fixed(nn.Module):
            def forward(self, conf: torch.Tensor, pred: torch.Tensor | None = None):
                return conf >= fixed_tau

            @property
            def threshold(self) -> torch.Tensor:
                return torch.tensor(fixed_tau)

        return Fixed()
    if kind == "adaptive":
        return AdaptiveThreshold(alpha=alpha)
    if kind == "per_class":
        return AdaptiveThreshold(alpha=alpha, per_class=True, num_classes=num_classes)
    raise ValueError(f"threshold must be fixed, adaptive or per_class, got {kind!r}")


def plain_copy(labeler: nn.Module) -> nn.Module:
    """A deep copy of a classifier with MixStyle (a step-1 multi-source device) switched off."""
    base = copy.deepcopy(labeler)
    if hasattr(base, "mixstyle"):
        base.mixstyle = nn.Identity()
    return base


def build_student(
    labeler: nn.Module,
    variant: str | bool,
    num_classes: int,
    sigma_init: float = 0.1,
    sigma_head: str = "official",
) -> nn.Module:
    """M_psi as a copy of F_theta: plain, or with the stochastic layer.

    MixStyle is switched off in the copy: step 2 sees one domain.

    Args:
        labeler: F_theta (left untouched).
        variant: a step-2 method's name (its row of :data:`bort2.stages_index.SPECS` says
            whether its student is plain), or directly ``True`` for a plain copy and ``False``
            for the stochastic layer.
        num_classes: number of classes.
        sigma_init: initial sigma of the ``linear`` head.
        sigma_head: ``"official"`` (the authors' sigma branch, see
            :class:`~bort2.models.OfficialStochasticClassifier`) or ``"linear"``.
    """
    plain = variant if isinstance(variant, bool) else SPECS[f"step2/{variant}"].plain_student
    base = plain_copy(labeler)
    if plain:
        return base
    return build_stochastic(base, sigma_head, num_classes=num_classes, sigma_init=sigma_init)


def naive_loss(
    student: nn.Module, x: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Masked cross-entropy of the student against hard pseudo-labels (mean over the batch)."""
    return soft_cross_entropy(student(x), labels, mask)


#: reductions of the entropy hinge and the outer loss over sigma's feature dimensions
REDUCTIONS = ("mean", "sum")


def hinge(
    sigma: torch.Tensor, margin: float = 4.0, eps: float = 0.0, reduction: str = "mean"
) -> torch.Tensor:
    """The entropy hinge ``mean_i (m - R_d log(sigma_id + eps))+`` with ``R`` the ``reduction``.

    ``"mean"`` is the authors' code (:func:`bort2.models.entropy_hinge`, bit for bit);
    ``"sum"`` the paper's Eq. 5, ``L_ment(sigma_i) = (m - sum log sigma_i)+``. Either way the
    result is averaged over the batch (the paper's ``1/|T| sum_i``).
    """
    if reduction == "mean":
        return entropy_hinge(sigma, margin, eps=eps)
    if reduction != "sum":
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    log_sigma = sigma.log() if eps == 0.0 else (sigma + eps).log()
    return F.relu(margin - log_sigma.sum(dim=1)).mean()


def robust_loss(
    student: StochasticClassifier,
    x: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    hinge_lambda: float = 0.1,
    margin: float = 4.0,
    eps: float = 0.0,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """BORT2's inner loss: masked CE on sampled logits + lambda * mean_i (m - R_d log sigma)+.

    The true cross-entropy ``-sum_c y_c log p_c`` (what M_psi is trained on in the authors' code
    too; only their hypergradient flips its sign, see :mod:`bort2.step2.hyper`). ``eps`` is added
    to sigma inside the log (the authors use 1e-7). ``reduction`` over the feature dimensions
    ``d``: ``"mean"`` (the authors') or ``"sum"`` (the paper's Eq. 5), see :func:`hinge`.

    Returns:
        ``(loss, sigma)``.
    """
    logits, sigma = student.forward_with_sigma(x)
    hinge_value = hinge(sigma, margin, eps=eps, reduction=reduction)
    loss = soft_cross_entropy(logits, labels, mask) + hinge_lambda * hinge_value
    return loss, sigma
