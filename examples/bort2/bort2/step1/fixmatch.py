"""FixMatch for multi-source domain adaptation, and FixMatch-CM (CutMix + MixStyle).

FixMatch (``cutmix=False``), one forward pass over ``[src_x, tgt_weak, tgt_strong]``::

    L_src = mean_i CE(f(src_x_i), src_y_i)
    p_j   = softmax(f(tgt_weak_j))          (detached),  yhat_j = argmax p_j
    m_j   = 1[max p_j >= threshold]
    L_u   = (1/M) sum_j m_j * CE(f(tgt_strong_j), yhat_j)     (averaged over all M)
    loss  = L_src + lambda_u * L_u

:class:`FixMatchCM` (which also requires MixStyle in the model) has two variants.

``variant="official"`` (the default) follows the BORT² authors' Dassl trainer
(``dassl/engine/da/fixmatch_cutmix.py``); with N source and M target rows per batch:

1. pseudo-labels for *all* N + M rows, source included: one no-grad forward of
   ``[src_x; tgt_weak]`` (the weak views, model in its current, training mode) with MixStyle
   disabled (:func:`~bort2.models.mixstyle.mixstyle_disabled`), ``yhat = argmax p`` and
   ``w = 1[max p >= threshold]``; the source ground truth is not used here;
2. clean source loss ``L_x = mean_i CE(f(src_x_i), src_y_i)`` (MixStyle on);
3. :func:`~bort2.step1.cutmix.cutmix` (always applied: one box, one permutation ``pi`` over the
   whole batch) on the strong views ``X2 = [src_strong; tgt_strong]``, forwarded with MixStyle on;
4. ``L_u = lam mean_i w_i CE(f(X2_mix_i), yhat_i) + (1 - lam) mean_i w_pi(i)
   CE(f(X2_mix_i), yhat_pi(i))``, both means over all N + M rows;
5. ``loss = L_x + lambda_u * L_u``.

``variant="mixed"`` (this example's original loss; ``FixMatch(cutmix=True)``):

1. pseudo-labels ``yhat``/masks ``m`` from a separate no-grad forward of ``tgt_weak`` (model in
   its current, training mode, MixStyle on);
2. the batch ``X = [src_x; tgt_strong]`` gets one-hot labels ``Y = [onehot(src_y);
   onehot(yhat)]`` and masks ``W = [1; m]``;
3. :func:`~bort2.step1.cutmix.cutmix` mixes ``X`` with *mask-weighted* labels ``W * Y`` across
   the whole source+target batch, giving ``t_i = lam W_i Y_i + (1 - lam) W_pi(i) Y_pi(i)``;
4. masked soft CE ``c_i = -sum_k t_ik log softmax(f(X_mix_i))_k``, i.e.
   ``lam W_i CE(.., Y_i) + (1 - lam) W_pi(i) CE(.., Y_pi(i))``: a pasted region from an
   unconfident target image contributes no label;
5. ``loss = mean_{i < N} c_i + lambda_u * mean_{i >= N} c_i`` (rows by position: the first N
   mixed images have a source background, the last M a target background).

MixStyle domain labels follow the position (source domain or target) of every row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.mixstyle import has_mixstyle, mixstyle_disabled
from .base import Step1Batch, Step1Method, require_target
from .cutmix import cutmix

FIXMATCH_CM_VARIANTS: tuple[str, ...] = ("official", "mixed")
"""Valid ``variant`` values of :class:`FixMatchCM` (see the module docstring)."""


class FixMatch(Step1Method):
    """FixMatch with a labelled multi-source batch (optionally with CutMix, see module doc).

    Args:
        model: Classifier (``features``/``head``).
        num_domains: Number of source domains.
        threshold: Confidence threshold of the pseudo-labels.
        lambda_u: Weight of the unlabelled (target) loss.
        cutmix: Mix the whole source+target batch with CutMix (the loss of
            ``FixMatchCM(variant="mixed")``).
        cutmix_alpha: Beta(alpha, alpha) parameter of CutMix.
        generator: Optional generator for CutMix's draws.
    """

    name = "fixmatch"
    needs_strong_target = True

    @classmethod
    def config_kwargs(cls, s1) -> dict:
        return {"threshold": s1.threshold, "lambda_u": s1.lambda_u}

    def __init__(
        self,
        model: nn.Module,
        num_domains: int,
        threshold: float = 0.95,
        lambda_u: float = 1.0,
        cutmix: bool = False,
        cutmix_alpha: float = 1.0,
        generator: torch.Generator | None = None,
    ):
        super().__init__(model, num_domains)
        self.threshold = float(threshold)
        self.lambda_u = float(lambda_u)
        self.use_cutmix = bool(cutmix)
        self.cutmix_alpha = float(cutmix_alpha)
        self.generator = generator

    def pseudo_labels(self, logits_weak: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hard pseudo-labels and float masks ``max softmax >= threshold`` (no gradient)."""
        probs = logits_weak.detach().softmax(dim=1)
        max_p, labels = probs.max(dim=1)
        return labels, (max_p >= self.threshold).float()

    def loss(self, batch: Step1Batch) -> tuple[torch.Tensor, dict[str, float]]:
        require_target(batch, strong=True)
        if self.use_cutmix:
            return self._loss_cutmix(batch)
        n, m = batch.src_x.shape[0], batch.tgt_weak.shape[0]
        x = torch.cat([batch.src_x, batch.tgt_weak, batch.tgt_strong])
        t = self._target_domains(m, batch.src_d)
        logits = self.logits(x, torch.cat([batch.src_d, t, t]))
        logits_src, logits_weak, logits_strong = logits.split([n, m, m])
        loss_src = F.cross_entropy(logits_src, batch.src_y)
        labels, mask = self.pseudo_labels(logits_weak)
        loss_u = (F.cross_entropy(logits_strong, labels, reduction="none") * mask).mean()
        loss = loss_src + self.lambda_u * loss_u
        return loss, {
            "loss": loss.item(),
            "loss_src": loss_src.item(),
            "loss_unsup": loss_u.item(),
            "mask_rate": float(mask.mean()),
        }

    def _loss_cutmix(self, batch: Step1Batch) -> tuple[torch.Tensor, dict[str, float]]:
        n, m = batch.src_x.shape[0], batch.tgt_weak.shape[0]
        t = self._target_domains(m, batch.src_d)
        with torch.no_grad():
            logits_weak = self.logits(batch.tgt_weak, t)
        labels, mask = self.pseudo_labels(logits_weak)
        k = logits_weak.shape[1]
        x = torch.cat([batch.src_x, batch.tgt_strong])
        y = F.one_hot(torch.cat([batch.src_y, labels]), k).to(x.dtype)
        w = torch.cat([torch.ones(n, dtype=x.dtype, device=x.device), mask.to(x.dtype)])
        mixed = cutmix(x, y * w[:, None], w, self.generator, self.cutmix_alpha)
        logits = self.logits(mixed.x, torch.cat([batch.src_d, t]))
        ce = -(mixed.y * logits.log_softmax(dim=1)).sum(dim=1)
        loss_src, loss_u = ce[:n].mean(), ce[n:].mean()
        loss = loss_src + self.lambda_u * loss_u
        return loss, {
            "loss": loss.item(),
            "loss_src": loss_src.item(),
            "loss_unsup": loss_u.item(),
            "mask_rate": float(mask.mean()),
            "cutmix_lam": float(mixed.lam),
        }


class FixMatchCM(FixMatch):
    """FixMatch-CM: FixMatch + CutMix over the source+target batch + MixStyle in the model.

    ``variant="official"`` (default) is the authors' loss (pseudo-labels for source and target
    rows from a MixStyle-off forward, clean source CE, CutMix of the strong views); it needs
    ``batch.src_strong``. ``variant="mixed"`` is ``FixMatch(cutmix=True)``'s loss. See the
    module docstring for both.

    Args:
        model: Classifier built with MixStyle enabled (e.g. ``DigitCNN(mixstyle=True)``).
        num_domains: Number of source domains.
        threshold: Confidence threshold of the pseudo-labels.
        lambda_u: Weight of the CutMix (unlabelled) loss.
        cutmix_alpha: Beta(alpha, alpha) parameter of CutMix.
        require_mixstyle: Raise when the model has no MixStyle module with ``p > 0``.
        generator: Optional generator for CutMix's draws.
        variant: ``"official"`` or ``"mixed"``.

    Raises:
        ValueError: For a model without MixStyle (unless ``require_mixstyle=False``) or an
            unknown ``variant``.
    """

    name = "fixmatch_cm"
    uses_mixstyle = True

    @classmethod
    def config_kwargs(cls, s1) -> dict:
        return {"threshold": s1.threshold, "lambda_u": s1.lambda_u, "variant": s1.cm_variant}

    @property
    def needs_strong_source(self) -> bool:
        return self.variant == "official"

    def __init__(
        self,
        model: nn.Module,
        num_domains: int,
        threshold: float = 0.95,
        lambda_u: float = 1.0,
        cutmix_alpha: float = 1.0,
        require_mixstyle: bool = True,
        generator: torch.Generator | None = None,
        variant: str = "official",
    ):
        if variant not in FIXMATCH_CM_VARIANTS:
            raise ValueError(
                f"unknown FixMatchCM variant {variant!r}; valid: {list(FIXMATCH_CM_VARIANTS)}"
            )
        if require_mixstyle and not has_mixstyle(model):
            raise ValueError(
                "FixMatchCM needs MixStyle in the model: build it with mixstyle=True (or a "
                "MixStyle instance), or pass require_mixstyle=False for the CutMix-only ablation"
            )
        super().__init__(
            model,
            num_domains,
            threshold=threshold,
            lambda_u=lambda_u,
            cutmix=True,
            cutmix_alpha=cutmix_alpha,
            generator=generator,
        )
        self.variant = variant

    def loss(self, batch: Step1Batch) -> tuple[torch.Tensor, dict[str, float]]:
        if self.variant == "mixed":
            return super().loss(batch)
        require_target(batch, strong=True)
        if batch.src_strong is None:
            raise ValueError(
                "FixMatchCM(variant='official') needs batch.src_strong (a strong view of the "
                "source images); build the batch with it or use variant='mixed'"
            )
        return self._loss_official(batch)

    def _loss_official(self, batch: Step1Batch) -> tuple[torch.Tensor, dict[str, float]]:
        n, m = batch.src_x.shape[0], batch.tgt_weak.shape[0]
        domains = torch.cat([batch.src_d, self._target_domains(m, batch.src_d)])
        with torch.no_grad(), mixstyle_disabled(self.model):
            logits_weak = self.logits(torch.cat([batch.src_x, batch.tgt_weak]), domains)
        labels, mask = self.pseudo_labels(logits_weak)
        loss_x = F.cross_entropy(self.logits(batch.src_x, batch.src_d), batch.src_y)

        x2 = torch.cat([batch.src_strong, batch.tgt_strong])
        w = mask.to(x2.dtype)
        y = F.one_hot(labels, logits_weak.shape[1]).to(x2.dtype)
        mixed = cutmix(x2, y, w, self.generator, self.cutmix_alpha)
        logits = self.logits(mixed.x, domains)
        ce_a = F.cross_entropy(logits, labels, reduction="none")
        ce_b = F.cross_entropy(logits, labels[mixed.perm], reduction="none")
        loss_u = mixed.lam * (w * ce_a).mean() + (1.0 - mixed.lam) * (w[mixed.perm] * ce_b).mean()
        loss = loss_x + self.lambda_u * loss_u
        return loss, {
            "loss": loss.item(),
            "loss_x": loss_x.item(),
            "loss_u": loss_u.item(),
            "mask_rate": float(mask[n:].mean()),
            "src_mask_rate": float(mask[:n].mean()),
            "cutmix_lam": float(mixed.lam),
        }
