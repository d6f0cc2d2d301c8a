"""BORT²'s stochastic target models and the entropy-hinge robustness term.

The target model ``M_psi`` of BORT² step 2 classifies a Gaussian sample ``z = mu + sigma * e``,
``e ~ N(0, I)`` (one sample per instance in training, ``z = mu`` in evaluation). Two variants
("sigma heads", listed in :data:`SIGMA_HEADS` and built by :func:`build_stochastic`):

- ``"official"`` (:class:`OfficialStochasticClassifier`), as in the authors' code: ``mu`` is the
  classifier's own penultimate features ``h`` (no extra layer) and ``sigma = softplus(raw)``
  comes from a separate branch. For the Digit-Five CNN the branch reads the post-dropout FC1
  activation ``a1``: ``raw = dropout(ReLU(BN1d(Linear(a1))))``, so ``sigma >= log 2``; for
  ResNets it is a 7x7 convolution of the ``layer4`` map. The wrapped classifier keeps its state
  dict keys, so the target model's eval-mode classifier is the plain classifier itself.
- ``"linear"`` (:class:`StochasticClassifier` / :class:`StochasticLayer`): two linear heads on
  ``h``::

      mu = W_mu h + b_mu,   sigma = softplus(W_s h + b_s) + eps

  followed by a new linear classifier on ``z``.

:func:`entropy_hinge` pushes the log standard deviations above a margin.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..dist import RowDropout, row_draw
from .digit_cnn import DigitCNN
from .resnet import ResNetClassifier

SIGMA_HEADS: tuple[str, ...] = ("official", "linear")
"""Valid ``kind`` values of :func:`build_stochastic`."""


def entropy_hinge(sigma: torch.Tensor, margin: float = 4.0, eps: float = 0.0) -> torch.Tensor:
    """BORT²'s robustness term ``mean_i (m - mean_d log(sigma_id + eps))^+``.

    The paper writes the inner term with a *sum* over feature dimensions; the authors' code
    (and this function) uses the *mean* over dimensions, which keeps the margin independent
    of the feature width.

    Args:
        sigma: Positive standard deviations (N, D).
        margin: The margin ``m``.
        eps: Added to ``sigma`` inside the logarithm (the authors use ``1e-7``; the default
            ``0.0`` takes the plain logarithm).

    Returns:
        A scalar tensor.
    """
    log_sigma = sigma.log() if eps == 0.0 else (sigma + eps).log()
    return F.relu(margin - log_sigma.mean(dim=1)).mean()


def _inverse_softplus(y: float) -> float:
    return y + math.log(-math.expm1(-y))


def _noise(mu: torch.Tensor) -> torch.Tensor:
    """Standard normal noise shaped like ``mu`` (``torch.randn_like``; under
    :func:`bort2.dist.global_rows`, this rank's rows of the global batch's draw)."""
    return row_draw(mu.shape, lambda s: torch.randn(s, dtype=mu.dtype, device=mu.device))


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
            z = mu + sigma * _noise(mu)
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

    def classifier_state(self) -> dict[str, torch.Tensor]:
        """A state dict for the plain classifier this model was built from.

        The entries are the backbone's (``backbone.`` prefix removed; its ``head`` was replaced
        by an identity, so it contributes none) plus a composed head: the classifier applied to
        the mu head is the single linear map ``head.weight = W_c @ W_mu``,
        ``head.bias = W_c @ b_mu + b_c``. A plain classifier built like the one given to
        :meth:`from_classifier` (head ``Linear(feature_dim, num_classes)``) loaded with this
        state gives exactly this model's eval-mode logits (up to rounding of the composition).

        Returns:
            Backbone tensors shared with this model (as :meth:`state_dict` returns them) and
            newly computed, detached ``head.weight`` (num_classes, feature_dim) and
            ``head.bias`` (num_classes,).
        """
        state = dict(self.backbone.state_dict())
        w_mu, b_mu = self.stochastic.mu_head.weight, self.stochastic.mu_head.bias
        w_c, b_c = self.classifier.weight, self.classifier.bias
        with torch.no_grad():
            state["head.weight"] = (w_c @ w_mu).detach()
            state["head.bias"] = (w_c @ b_mu + b_c).detach()
        return state


class OfficialStochasticClassifier(nn.Module):
    """BORT²'s target model ``M_psi`` as in the authors' code: a classifier plus a sigma branch.

    ``mu`` is the wrapped classifier's penultimate features ``h = net.features(x)`` (no extra
    layer); ``sigma = softplus(raw)`` comes from a branch reading an intermediate activation:

    - :class:`DigitCNN`: ``raw = Dropout(0.5)(ReLU(BN1d(Linear(fc1_dim -> feature_dim)(a1))))``
      with ``a1`` the post-dropout FC1 activation (see :meth:`DigitCNN.features_with_fc1`).
      Since ``raw >= 0``, ``sigma >= log 2``.
    - :class:`ResNetClassifier`: ``raw = Conv2d(C, C, 7)(AdaptiveAvgPool2d(7)(fmap))``
      flattened to (N, C), ``sigma = softplus(raw + 1e-10)``, with ``fmap`` the ``layer4`` map
      and ``C = feature_dim``. The authors apply the 7x7 convolution (no padding) directly to
      the 7x7 map of a 224-px input; the adaptive average pool is the identity there and makes
      other input sizes work (it replicates smaller maps, e.g. the 1x1 map of a 32-px input,
      and averages larger ones to 7x7).

    In training ``logits = net.head(mu + sigma * e)`` with ``e ~ N(0, I)`` (one sample per
    instance, global RNG, drawn after the dropout masks); in evaluation
    ``logits = net.head(mu)``, so the eval-mode model is the plain classifier ``net``.
    The sigma branch uses PyTorch's default initialisation and is moved to the device and
    dtype of ``net``'s parameters.

    Args:
        net: A :class:`DigitCNN` or :class:`ResNetClassifier` with a linear ``head``. It is
            taken over as ``self.net`` (not copied; pass a deep copy to keep the original), so
            ``self.net.state_dict()`` has exactly the plain classifier's keys.

    Raises:
        TypeError: For any other network.
    """

    def __init__(self, net: nn.Module):
        super().__init__()
        if isinstance(net, DigitCNN):
            dim = int(net.feature_dim)
            branch = nn.Sequential(
                nn.Linear(net.fc1_dim, dim),
                nn.BatchNorm1d(dim),
                nn.ReLU(),
                RowDropout(0.5),
            )
            self._raw_offset = 0.0
        elif isinstance(net, ResNetClassifier):
            dim = int(net.feature_dim)
            branch = nn.Sequential(
                nn.AdaptiveAvgPool2d(7),
                nn.Conv2d(dim, dim, kernel_size=7, padding=0, bias=True),
                nn.Flatten(),
            )
            self._raw_offset = 1e-10
        else:
            raise TypeError(
                "OfficialStochasticClassifier needs a DigitCNN or a ResNetClassifier, "
                f"got {type(net).__name__}"
            )
        ref = next(net.parameters(), None)
        if ref is not None:
            branch = branch.to(device=ref.device, dtype=ref.dtype)
        self.net = net
        self.sigma_branch = branch
        self.feature_dim = dim
        self.latent_dim = dim
        head = getattr(net, "head", None)
        self.num_classes = int(
            head.out_features if isinstance(head, nn.Linear) else net.num_classes
        )

    def sigma_from(self, raw: torch.Tensor) -> torch.Tensor:
        """``sigma = softplus(raw)`` (``softplus(raw + 1e-10)`` for ResNets, as the authors)."""
        if self._raw_offset:
            raw = raw + self._raw_offset
        return F.softplus(raw)

    def forward_with_sigma(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(logits, sigma)`` for images ``x``.

        Args:
            x: Images (N, 3, H, W).

        Returns:
            Logits (N, num_classes), sampled in training and on the mean path in evaluation,
            and ``sigma`` (N, feature_dim).
        """
        if isinstance(self.net, DigitCNN):
            mu, inner = self.net.features_with_fc1(x)
        else:
            mu, inner = self.net.features_with_map(x)
        sigma = self.sigma_from(self.sigma_branch(inner))
        z = mu + sigma * _noise(mu) if self.training else mu
        return self.net.head(z), sigma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits (N, num_classes)."""
        return self.forward_with_sigma(x)[0]

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Deterministic penultimate features ``mu = net.features(x)`` (N, feature_dim)."""
        return self.net.features(x)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """``net.head(h)``: in eval mode ``head(features(x))`` equals the eval logits."""
        return self.net.head(h)

    def classifier_state(self) -> dict[str, torch.Tensor]:
        """A state dict for a plain classifier built like ``net``: ``net.state_dict()``.

        A plain classifier loaded with it gives exactly this model's eval-mode logits.
        The tensors are shared with this model, as :meth:`state_dict` returns them.
        """
        return self.net.state_dict()


def build_stochastic(
    net: nn.Module,
    kind: str,
    num_classes: int | None = None,
    sigma_init: float = 0.1,
) -> nn.Module:
    """Build BORT²'s step-2 target model from a trained classifier; ``net`` is not modified.

    Args:
        net: The step-1 classifier (``features``/``head``/``feature_dim``).
        kind: ``"official"`` (:class:`OfficialStochasticClassifier` on a deep copy of ``net``)
            or ``"linear"`` (:meth:`StochasticClassifier.from_classifier`); see
            :data:`SIGMA_HEADS`.
        num_classes: Output classes. For ``"linear"`` as in
            :meth:`StochasticClassifier.from_classifier`; for ``"official"`` the head of
            ``net`` is kept, and a different ``num_classes`` is an error.
        sigma_init: Initial ``sigma`` of the ``"linear"`` head (unused by ``"official"``).

    Returns:
        The new target model.

    Raises:
        ValueError: For an unknown ``kind``, or a ``num_classes`` that the official head
            cannot honour.
    """
    if kind == "official":
        out = OfficialStochasticClassifier(copy.deepcopy(net))
        if num_classes is not None and int(num_classes) != out.num_classes:
            raise ValueError(
                f"num_classes={num_classes} differs from the classifier's {out.num_classes}; "
                "the official sigma head keeps the classifier's head"
            )
        return out
    if kind == "linear":
        return StochasticClassifier.from_classifier(net, sigma_init, num_classes)
    raise ValueError(f"unknown sigma head kind {kind!r}; valid kinds: {list(SIGMA_HEADS)}")
