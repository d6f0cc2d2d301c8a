"""BORT²'s stochastic Gaussian layer and its entropy-hinge robustness term.

The target model ``M_psi`` of BORT² step 2 replaces the deterministic penultimate features
``h`` with a Gaussian sample::

    mu = W_mu h + b_mu,   sigma = softplus(W_s h + b_s) + eps,   z = mu + sigma * e,  e ~ N(0, I)

(one sample per instance in training, ``z = mu`` in evaluation) and classifies ``z`` with a
linear layer. :func:`entropy_hinge` pushes the log standard deviations above a margin.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn


def entropy_hinge(sigma: torch.Tensor, margin: float = 4.0) -> torch.Tensor:
    """BORT²'s robustness term ``mean_i (m - mean_d log sigma_id)^+``.

    The paper writes the inner term with a *sum* over feature dimensions; the authors' code
    (and this function) uses the *mean* over dimensions, which keeps the margin independent
    of the feature width.

    Args:
        sigma: Positive standard deviations (N, D).
        margin: The margin ``m``.

    Returns:
        A scalar tensor.
    """
    return F.relu(margin - sigma.log().mean(dim=1)).mean()


def _inverse_softplus(y: float) -> float:
    return y + math.log(-math.expm1(-y))


class StochasticLayer(nn.Module):
    """Gaussian layer with learned mean and (softplus) standard deviation heads.

    Args:
        in_dim: Input feature dimension.
        out_dim: Latent dimension of ``z``.
        eps: Added to ``softplus`` so that ``sigma > 0`` strictly.
    """

    def __init__(self, in_dim: int, out_dim: int, eps: float = 1e-6):
        super().__init__()
        self.in_dim = int(in_dim)
        self.out_dim = int(out_dim)
        self.eps = float(eps)
        self.mu_head = nn.Linear(in_dim, out_dim)
        self.sigma_head = nn.Linear(in_dim, out_dim)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(z, sigma)``: a sample ``mu + sigma * e`` in training, ``mu`` in eval."""
        mu = self.mu_head(h)
        sigma = F.softplus(self.sigma_head(h)) + self.eps
        if self.training:
            z = mu + sigma * torch.randn_like(mu)
        else:
            z = mu
        return z, sigma


class StochasticClassifier(nn.Module):
    """A feature extractor, a :class:`StochasticLayer` and a linear classifier on ``z``.

    ``features(x)`` is the base's feature extractor, ``head(h)`` the stochastic layer followed
    by the classifier, and ``forward(x) = head(features(x))``.

    Args:
        base: A classifier with ``features(x) -> (N, D)`` and ``feature_dim``. It is taken
            over: its own ``head`` module, if any, is replaced by :class:`torch.nn.Identity` so
            that no unused parameters remain (use :meth:`from_classifier` to keep the original).
        num_classes: Number of output classes.
        latent_dim: Dimension of ``z`` (default: ``base.feature_dim``).
        eps: Lower bound added to ``sigma``.
    """

    def __init__(
        self,
        base: nn.Module,
        num_classes: int,
        latent_dim: int | None = None,
        eps: float = 1e-6,
    ):
        super().__init__()
        if not hasattr(base, "features") or not hasattr(base, "feature_dim"):
            raise TypeError("base must expose features(x) and feature_dim")
        if isinstance(getattr(base, "head", None), nn.Module):
            base.head = nn.Identity()
        self.backbone = base
        self.feature_dim = int(base.feature_dim)
        self.latent_dim = int(latent_dim or self.feature_dim)
        self.num_classes = int(num_classes)
        self.stochastic = StochasticLayer(self.feature_dim, self.latent_dim, eps=eps)
        self.classifier = nn.Linear(self.latent_dim, num_classes)

    @classmethod
    def from_classifier(
        cls,
        model: nn.Module,
        sigma_init: float = 0.1,
        num_classes: int | None = None,
    ) -> StochasticClassifier:
        """Build the step-2 target model from a trained step-1 classifier.

        Initialisation (so that eval-mode logits equal the classifier's at the start):
        a deep copy of ``model`` provides the feature extractor; the mu head is the identity
        (``W_mu = I``, ``b_mu = 0``, latent width D); the classifier copies ``model.head``
        (when it is a ``Linear``, otherwise a fresh layer); the sigma head has zero weights
        and bias ``softplus^-1(sigma_init)``, so every ``sigma`` starts at ``sigma_init + eps``.
        ``model`` itself is left untouched.

        Args:
            model: Classifier with ``features``, ``feature_dim`` and ``head``.
            sigma_init: Initial standard deviation of every latent dimension.
            num_classes: Output classes (default: ``model.head.out_features``).

        Returns:
            A new :class:`StochasticClassifier` on the same device as ``model``.
        """
        old_head = getattr(model, "head", None)
        if num_classes is None:
            if not isinstance(old_head, nn.Linear):
                raise ValueError("num_classes is required when model.head is not nn.Linear")
            num_classes = old_head.out_features
        base = copy.deepcopy(model)
        out = cls(base, num_classes)
        ref = next(base.parameters(), None)
        if ref is not None:
            out = out.to(device=ref.device, dtype=ref.dtype)
        layer = out.stochastic
        with torch.no_grad():
            layer.mu_head.weight.copy_(torch.eye(out.latent_dim, out.feature_dim))
            layer.mu_head.bias.zero_()
            layer.sigma_head.weight.zero_()
            layer.sigma_head.bias.fill_(_inverse_softplus(sigma_init))
            if isinstance(old_head, nn.Linear) and old_head.out_features == num_classes:
                out.classifier.weight.copy_(old_head.weight)
                out.classifier.bias.copy_(old_head.bias)
        return out

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Deterministic penultimate features (N, feature_dim)."""
        return self.backbone.features(x)

    def head_with_sigma(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and ``sigma`` (N, latent_dim) from penultimate features ``h``."""
        z, sigma = self.stochastic(h)
        return self.classifier(z), sigma

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits from penultimate features (sampled in training, mean path in eval)."""
        return self.head_with_sigma(h)[0]

    def forward_with_sigma(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(logits, sigma)`` for images ``x``."""
        return self.head_with_sigma(self.features(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits (N, num_classes)."""
        return self.head(self.features(x))
