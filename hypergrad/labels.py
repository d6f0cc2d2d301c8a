"""Label hyper-networks: Gumbel-softmax labelers, confidence thresholds and the soft-target loss.

This module owns the pieces that turn a labeling network F_θ into training targets for an inner
model, so that θ becomes a hyperparameter of the inner problem:

- :class:`GumbelLabeler` samples differentiable class labels from F_θ's logits with the
  Gumbel-softmax trick (straight-through one-hot labels when ``hard=True``).
- :class:`AdaptiveThreshold` keeps BORT²'s curriculum confidence threshold (initialised at
  mean+std of the batch max-probabilities, clamped to ``max_init``, then an exponential moving
  average towards mean−std), globally or per predicted class, in buffers.
- :func:`soft_cross_entropy` is the (optionally masked) cross-entropy against soft or one-hot
  targets.

It depends only on torch; the hypergradient machinery lives elsewhere (``implicit/``,
``unrolled.py``, ``modules.py``).
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import HypergradTypeError, HypergradValueError

__all__ = ["GumbelLabeler", "AdaptiveThreshold", "gumbel_softmax_labels", "soft_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


def _check_positive_finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HypergradTypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise HypergradValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def gumbel_softmax_labels(
    logits: Tensor,
    temperature: float = 1.0,
    hard: bool = True,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Gumbel-softmax sample of class labels from ``logits`` (the functional core of
    :class:`GumbelLabeler`).

    Args:
        logits: ``(N, C)`` class logits.
        temperature: softmax temperature (> 0).
        hard: straight-through one-hot labels (value exactly one-hot, gradient of the soft
            sample) when True; the soft sample otherwise.
        generator: generator of the uniform draws behind the Gumbel noise, on any device: the
            draw is made there and moved to the logits' device (a CPU generator gives CUDA logits
            the same noise as CPU ones).

    Raises:
        HypergradTypeError: ``logits`` is not a tensor, or ``temperature`` is not a real number.
        HypergradValueError: ``logits`` is not 2-D floating point, or ``temperature`` is not
            finite and > 0.

    Example:
        >>> y = gumbel_softmax_labels(torch.zeros(2, 3), generator=torch.Generator().manual_seed(0))
        >>> y.sum(1)
        tensor([1., 1.])
    """
    _check_positive_finite("temperature", temperature)
    if not isinstance(logits, Tensor):
        raise HypergradTypeError(f"logits must be a tensor, got {type(logits).__name__}")
    if logits.dim() != 2 or not logits.is_floating_point():
        raise HypergradValueError(
            "logits must be a 2-D floating-point tensor of shape (N, C), "
            f"got shape {tuple(logits.shape)} and dtype {logits.dtype}"
        )
    finfo = torch.finfo(logits.dtype)
    # the noise is drawn on the generator's device and moved to the logits' device: a CPU
    # generator then drives CUDA logits too, with the same draw as on the CPU
    where = logits.device if generator is None else generator.device
    u = torch.rand(logits.shape, generator=generator, dtype=logits.dtype, device=where)
    u = u.to(logits.device)
    u = u.clamp(min=finfo.tiny, max=1.0 - finfo.eps)
    gumbel = -torch.log(-torch.log(u))
    y_soft = torch.softmax((logits + gumbel) / temperature, dim=1)
    if not hard:
        return y_soft
    index = y_soft.argmax(dim=1, keepdim=True)
    y_hard = torch.zeros_like(y_soft).scatter_(1, index, 1.0)
    # y_hard + (y_soft - y_soft.detach()) has the value of y_hard exactly (the bracket is an
    # exact zero) and the gradient of y_soft: the straight-through estimator.
    return y_hard + (y_soft - y_soft.detach())


class GumbelLabeler(nn.Module):
    """Differentiable class labels sampled from a network's logits by Gumbel-softmax.

    For inputs ``x`` with logits ``z = net(x)`` of shape ``(N, C)``, one Gumbel sample per row is
    drawn, ``g = -log(-log(U))`` with ``U ~ Uniform(0, 1)``, and the relaxed sample is
    ``y_soft = softmax((z + g) / temperature)``. With ``hard=True`` the returned labels are the
    straight-through estimator: their forward value is exactly the one-hot vector of
    ``argmax(y_soft)`` while their gradient is the gradient of ``y_soft``. With ``hard=False`` the
    labels are ``y_soft`` itself.

    ``net`` is registered as a submodule, so ``labeler.parameters()`` are the parameters of
    ``net`` (the hyperparameters θ of a label hyper-network).

    Args:
        net: Module mapping a batch of inputs to class logits of shape ``(N, C)``.
        temperature: Softmax temperature (> 0). Small values make ``y_soft`` close to one-hot.
        hard: Return straight-through one-hot labels (``True``) or the soft sample (``False``).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from hypergrad.labels import GumbelLabeler
        >>> labeler = GumbelLabeler(nn.Linear(4, 3), temperature=1.0, hard=True)
        >>> gen = torch.Generator().manual_seed(0)
        >>> labels, confidence = labeler(torch.randn(5, 4), generator=gen)
        >>> labels.shape, confidence.shape
        (torch.Size([5, 3]), torch.Size([5]))
        >>> bool((labels.sum(dim=1) == 1).all())
        True
    """

    def __init__(self, net: nn.Module, temperature: float = 1.0, hard: bool = True) -> None:
        super().__init__()
        if not isinstance(net, nn.Module):
            raise HypergradTypeError(f"net must be an nn.Module, got {type(net).__name__}")
        self.net = net
        self.temperature = temperature
        self.hard = bool(hard)

    @property
    def temperature(self) -> float:
        """Softmax temperature of the relaxed sample (validated to be > 0 when set)."""
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self._temperature = _check_positive_finite("temperature", value)

    def forward(self, x: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Sample labels for a batch.

        Args:
            x: Inputs accepted by ``net``.
            generator: Optional ``torch.Generator`` for the uniform draws behind the Gumbel noise
                (on the logits' device). Identically seeded generators give identical samples.

        Returns:
            ``(labels, confidence)``: ``labels`` of shape ``(N, C)`` (one-hot in value when
            ``hard``, differentiable w.r.t. the net's parameters in both modes) and
            ``confidence`` of shape ``(N,)``, the detached maximum class probability
            ``softmax(net(x)).max(dim=1)`` of the clean (noise-free) logits.

        Raises:
            HypergradValueError: If ``net(x)`` is not a 2-D floating-point tensor (a
                ``ValueError`` subclass).
        """
        logits = self.net(x)
        if not isinstance(logits, Tensor) or logits.dim() != 2:
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise HypergradValueError(f"net(x) must return 2-D logits of shape (N, C), got {shape}")
        if not logits.is_floating_point():
            raise HypergradValueError(
                f"net(x) must return floating-point logits, got {logits.dtype}"
            )

        labels = gumbel_softmax_labels(logits, self._temperature, self.hard, generator)
        with torch.no_grad():
            confidence = torch.softmax(logits, dim=1).max(dim=1).values
        return labels, confidence.detach()

    def extra_repr(self) -> str:
        return f"temperature={self._temperature}, hard={self.hard}"


class AdaptiveThreshold(nn.Module):
    """BORT²'s curriculum confidence threshold, kept in buffers.

    Each call receives the batch's max class probabilities ``p`` (e.g. the ``confidence`` of
    :class:`GumbelLabeler`) and returns the mask ``p >= τ``. The threshold τ evolves as:

    1. on the first call only, ``τ = min(mean(p) + std(p), max_init)``;
    2. on every call (the first included), ``τ ← alpha·τ + (1 − alpha)·(mean(p) − std(p))``;
    3. the mask uses the updated τ.

    ``std`` is torch's default unbiased estimate (correction 1); a batch of one sample uses
    ``std = 0``. An empty batch returns an empty mask and leaves τ unchanged. Statistics are
    computed in float64 without gradient.

    With ``per_class=True`` there is one τ per class: ``pred`` (the predicted class of each
    sample) is required, each class's τ is initialised the first time that class appears and is
    updated only from the samples predicted as that class, and each sample is compared with the
    τ of its predicted class. **A sample whose class has no threshold yet is masked out
    (False)**, and :attr:`threshold` reports ``nan`` for classes never seen. Because a class is
    initialised in the very call where it first appears (before the mask is computed), this rule
    never drops samples of the current batch by itself; it is the defined behaviour for classes
    without a threshold rather than an extra filter.

    τ and the per-class "initialised" flags are buffers, so ``state_dict`` / ``load_state_dict``
    round-trip the curriculum exactly.

    Args:
        alpha: EMA factor in ``[0, 1)``; BORT² uses 0.999.
        per_class: Keep one threshold per predicted class.
        max_init: Upper clamp of the initial threshold (0.95 in BORT²).
        num_classes: Number of classes; required when ``per_class`` is true.

    Example:
        >>> import torch
        >>> from hypergrad.labels import AdaptiveThreshold
        >>> thr = AdaptiveThreshold(alpha=0.5)
        >>> mask = thr(torch.tensor([0.2, 0.4, 0.6, 0.8]))
        >>> mask.tolist()
        [False, False, True, True]
        >>> round(float(thr.threshold), 4)
        0.5
    """

    tau: Tensor
    initialized: Tensor

    def __init__(
        self,
        alpha: float = 0.999,
        per_class: bool = False,
        max_init: float = 0.95,
        num_classes: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise HypergradTypeError(f"alpha must be a real number, got {type(alpha).__name__}")
        if not 0.0 <= float(alpha) < 1.0:
            raise HypergradValueError(f"alpha must lie in [0, 1), got {alpha}")
        if isinstance(max_init, bool) or not isinstance(max_init, (int, float)):
            raise HypergradTypeError(
                f"max_init must be a real number, got {type(max_init).__name__}"
            )
        if not math.isfinite(float(max_init)):
            raise HypergradValueError(f"max_init must be finite, got {max_init}")
        self.alpha = float(alpha)
        self.per_class = bool(per_class)
        self.max_init = float(max_init)
        if self.per_class:
            if num_classes is None:
                raise HypergradValueError("num_classes is required when per_class=True")
            if isinstance(num_classes, bool) or not isinstance(num_classes, int):
                raise HypergradTypeError(
                    f"num_classes must be an int, got {type(num_classes).__name__}"
                )
            if num_classes < 1:
                raise HypergradValueError(f"num_classes must be >= 1, got {num_classes}")
            shape: tuple[int, ...] = (num_classes,)
        else:
            if num_classes is not None and (
                isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1
            ):
                raise HypergradValueError(
                    f"num_classes must be a positive int or None, got {num_classes}"
                )
            shape = ()
        self.num_classes = num_classes
        self.register_buffer("tau", torch.full(shape, float("nan"), dtype=torch.float64))
        self.register_buffer("initialized", torch.zeros(shape, dtype=torch.bool))

    @property
    def threshold(self) -> Tensor:
        """Current τ (a 0-d tensor, or one entry per class); ``nan`` where not yet initialised."""
        return self.tau.detach().clone()

    def _check_inputs(self, confidence: Tensor, pred: Tensor | None) -> None:
        if not isinstance(confidence, Tensor):
            raise HypergradTypeError(
                f"confidence must be a tensor, got {type(confidence).__name__}"
            )
        if confidence.dim() != 1:
            raise HypergradValueError(
                f"confidence must be 1-D of shape (N,), got shape {tuple(confidence.shape)}"
            )
        if not confidence.is_floating_point():
            raise HypergradValueError(f"confidence must be floating point, got {confidence.dtype}")
        if self.per_class and pred is None:
            raise HypergradValueError(
                "pred (predicted class per sample) is required when per_class=True"
            )
        if pred is not None:
            if not isinstance(pred, Tensor):
                raise HypergradTypeError(f"pred must be a tensor, got {type(pred).__name__}")
            if pred.shape != confidence.shape:
                raise HypergradValueError(
                    f"pred must have the shape of confidence {tuple(confidence.shape)}, "
                    f"got {tuple(pred.shape)}"
                )
            if pred.is_floating_point() or pred.is_complex() or pred.dtype == torch.bool:
                raise HypergradValueError(f"pred must be an integer tensor, got {pred.dtype}")
            if self.per_class and pred.numel() > 0:
                lo, hi = int(pred.min()), int(pred.max())
                # per_class: __init__ made num_classes a positive int.
                if lo < 0 or hi >= cast(int, self.num_classes):
                    raise HypergradValueError(
                        f"pred values must lie in [0, {self.num_classes}), got range [{lo}, {hi}]"
                    )

    @torch.no_grad()
    def forward(self, confidence: Tensor, pred: Tensor | None = None) -> Tensor:
        """Update τ from a batch and return the confidence mask.

        Args:
            confidence: Max class probabilities ``p`` of shape ``(N,)``.
            pred: Predicted class of each sample, integer tensor of shape ``(N,)``; required
                with ``per_class=True`` and ignored otherwise.

        Returns:
            Bool tensor of shape ``(N,)``: ``p >= τ`` (per-class τ of each sample's class).

        Raises:
            HypergradValueError: On a non-1-D or non-float ``confidence``, a missing
                (per-class), mis-shaped or non-integer ``pred``, or ``pred`` values outside
                ``[0, num_classes)`` (a ``ValueError`` subclass).
            HypergradTypeError: If ``confidence`` or ``pred`` is not a tensor (a ``TypeError``
                subclass).
        """
        self._check_inputs(confidence, pred)
        if confidence.numel() == 0:
            return torch.zeros_like(confidence, dtype=torch.bool)
        p = confidence.detach().to(device=self.tau.device, dtype=torch.float64)
        if self.per_class:
            # _check_inputs raised if pred is None with per_class.
            mask = self._update_per_class(p, cast(Tensor, pred).detach().to(self.tau.device))
        else:
            mask = self._update_global(p)
        return mask.to(confidence.device)

    def _update_global(self, p: Tensor) -> Tensor:
        mean = p.mean()
        std = p.std() if p.numel() > 1 else torch.zeros_like(mean)
        tau = self.tau.to(torch.float64)
        if not bool(self.initialized):
            tau = torch.clamp(mean + std, max=self.max_init)
            self.initialized.fill_(True)
        tau = self.alpha * tau + (1.0 - self.alpha) * (mean - std)
        self.tau.copy_(tau)
        return p >= tau

    def _update_per_class(self, p: Tensor, pred: Tensor) -> Tensor:
        c = cast(int, self.num_classes)  # per_class: __init__ made it a positive int
        pred = pred.long()
        counts = torch.zeros(c, dtype=torch.float64, device=p.device).index_add_(
            0, pred, torch.ones_like(p)
        )
        sums = torch.zeros(c, dtype=torch.float64, device=p.device).index_add_(0, pred, p)
        present = counts > 0
        mean = sums / counts.clamp(min=1.0)
        sq = torch.zeros(c, dtype=torch.float64, device=p.device).index_add_(
            0, pred, (p - mean[pred]) ** 2
        )
        std = torch.where(
            counts > 1, torch.sqrt(sq / (counts - 1.0).clamp(min=1.0)), torch.zeros_like(sq)
        )
        tau = self.tau.to(torch.float64)
        fresh = present & ~self.initialized
        tau = torch.where(fresh, torch.clamp(mean + std, max=self.max_init), tau)
        updated = self.alpha * tau + (1.0 - self.alpha) * (mean - std)
        tau = torch.where(present, updated, tau)
        self.tau.copy_(tau)
        self.initialized |= present
        return (p >= tau[pred]) & self.initialized[pred]

    def extra_repr(self) -> str:
        parts = [f"alpha={self.alpha}", f"per_class={self.per_class}", f"max_init={self.max_init}"]
        if self.num_classes is not None:
            parts.append(f"num_classes={self.num_classes}")
        return ", ".join(parts)


def soft_cross_entropy(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor | None = None,
    reduction: str = "mean",
) -> Tensor:
    """Cross-entropy against soft (or one-hot) targets, with an optional per-sample mask.

    The per-sample loss is ``-Σ_c targets[n, c] · log_softmax(logits)[n, c]``; it equals
    ``F.cross_entropy`` when the targets are one-hot. A ``mask`` (bool or float, shape ``(N,)``)
    multiplies the per-sample losses. ``"mean"`` divides the masked sum by the whole batch size
    ``N`` (masked-out samples count as zeros, as in FixMatch/BORT²), ``"sum"`` returns the masked
    sum and ``"none"`` the masked per-sample vector.

    Args:
        logits: Class logits of shape ``(N, C)``.
        targets: Target distributions (or straight-through one-hot labels) of shape ``(N, C)``;
            gradients flow into them, which is how a label hyper-network receives its signal.
        mask: Optional per-sample weights or bool mask of shape ``(N,)``.
        reduction: One of ``"mean"``, ``"sum"``, ``"none"``.

    Returns:
        A scalar for ``"mean"``/``"sum"``, a tensor of shape ``(N,)`` for ``"none"``.

    Raises:
        HypergradValueError: If ``logits`` is not 2-D, ``targets`` or ``mask`` has the wrong
            shape, or ``reduction`` is not a valid choice (a ``ValueError`` subclass).

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from hypergrad.labels import soft_cross_entropy
        >>> logits = torch.randn(4, 3)
        >>> y = torch.tensor([0, 2, 1, 2])
        >>> loss = soft_cross_entropy(logits, F.one_hot(y, 3).float())
        >>> bool(torch.allclose(loss, F.cross_entropy(logits, y)))
        True
    """
    if reduction not in _REDUCTIONS:
        choices = ", ".join(repr(r) for r in _REDUCTIONS)
        raise HypergradValueError(f"reduction must be one of {choices}, got {reduction!r}")
    if not isinstance(logits, Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise HypergradValueError(f"logits must be a 2-D tensor of shape (N, C), got {shape}")
    if not isinstance(targets, Tensor) or targets.shape != logits.shape:
        shape = tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
        raise HypergradValueError(
            f"targets must have the shape of logits {tuple(logits.shape)}, got {shape}"
        )
    losses = -(targets * F.log_softmax(logits, dim=1)).sum(dim=1)
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.shape != losses.shape:
            shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise HypergradValueError(
                f"mask must have shape (N,) = {tuple(losses.shape)}, got {shape}"
            )
        losses = losses * mask.to(losses.dtype)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / losses.shape[0]
