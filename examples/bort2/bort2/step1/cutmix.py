"""CutMix (Yun et al., ICCV 2019) with soft labels and per-sample masks.

One box and one permutation per batch: ``lam0 ~ Beta(alpha, alpha)``; the box has side
``sqrt(1 - lam0)`` times the image side around a uniform centre, clipped at the borders; pixels
inside the box come from ``x[perm]``. The returned ``lam`` is recomputed from the clipped box,
``lam = 1 - box_area / (H * W)``, and labels and masks are mixed with it::

    y_mix = lam * y + (1 - lam) * y[perm],   mask_mix = lam * mask + (1 - lam) * mask[perm]
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..models.mixstyle import _randperm, _uniform, sample_beta


class CutMixResult(NamedTuple):
    """Output of :func:`cutmix`.

    Attributes:
        x: Mixed images (N, C, H, W).
        y: Mixed soft labels (N, K).
        mask: Mixed masks (N,).
        lam: Fraction of each image that is *not* pasted (a Python float).
        perm: Partner indices (N,).
        box: ``(y0, y1, x0, x1)`` of the pasted region (half-open).
    """

    x: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor
    lam: float
    perm: torch.Tensor
    box: tuple[int, int, int, int]


def cutmix(
    x: torch.Tensor,
    y_soft: torch.Tensor,
    mask: torch.Tensor,
    generator: torch.Generator | None = None,
    alpha: float = 1.0,
) -> CutMixResult:
    """Paste one random box from a permuted batch into every image.

    Args:
        x: Images (N, C, H, W).
        y_soft: Soft labels (N, K), e.g. one-hot.
        mask: Per-sample weights/masks (N,).
        generator: Optional generator for the box, ``lam0`` and the permutation.
        alpha: Beta(alpha, alpha) concentration of ``lam0``.

    Returns:
        A :class:`CutMixResult`; ``lam`` equals ``1 - box_area / (H * W)`` exactly.
    """
    n, _, h, w = x.shape
    lam0 = float(sample_beta(alpha, (1,), generator))
    cut = math.sqrt(1.0 - lam0)
    cut_h, cut_w = int(round(h * cut)), int(round(w * cut))
    centre = _uniform((2,), generator, "cpu")
    cy, cx = int(centre[0] * h), int(centre[1] * w)
    y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h - cut_h // 2, h)
    x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w - cut_w // 2, w)
    perm = _randperm(n, generator, x.device)
    x_mix = x.clone()
    x_mix[:, :, y0:y1, x0:x1] = x[perm][:, :, y0:y1, x0:x1]
    lam = 1.0 - (y1 - y0) * (x1 - x0) / float(h * w)
    y_mix = lam * y_soft + (1.0 - lam) * y_soft[perm]
    mask_mix = lam * mask + (1.0 - lam) * mask[perm]
    return CutMixResult(x_mix, y_mix, mask_mix, lam, perm, (y0, y1, x0, x1))
