"""Differentiable functional optimizers: SGD, Adam and AdamW whose settings may be tensors.

:func:`hypergrad.unrolled_grad` (and ``HyperStep(method=hg.Unrolled(...))``) differentiate through
optimizer updates. To learn an optimizer's own settings (a learning rate, a momentum, Adam's
betas, a weight decay) the update must be a differentiable function of them. torchopt's
optimizers accept a tensor learning rate but not a tensor momentum, beta or weight decay (they
pass those to ``Tensor.add(..., alpha=...)``, which takes Python numbers only); these do.

Each factory returns an object with torchopt's functional protocol,
``init(params) -> state`` and ``update(grads, state, params=..., inplace=False) -> (updates,
state)`` with ``new_params = params + updates``, so the two kinds are interchangeable. The
arithmetic is that of ``torch.optim.SGD``/``Adam``/``AdamW`` (PyTorch 2.x documentation's
pseudo-code), step for step, so a float64 run reproduces ``torch.optim`` to rounding:

* SGD: ``g += wd * p``; momentum buffer ``b = g`` on the first step, then
  ``b = momentum * b + (1 - dampening) * g``; Nesterov uses ``g + momentum * b``; ``p -= lr * .``.
* Adam: ``g += wd * p`` (L2); ``m, v`` exponential averages; ``p -= lr / (1 - b1^t) * m /
  (sqrt(v / (1 - b2^t)) + eps)``.
* AdamW: decoupled decay ``p *= 1 - lr * wd``, then Adam without the L2 term.

Settings are validated: every setting must be finite and in the range ``torch.optim`` accepts
(``lr``, ``eps``, ``weight_decay`` >= 0; ``momentum`` and ``betas`` in [0, 1); ``dampening`` in
[0, 1]); a number or tensor outside it raises :class:`~hypergrad.HypergradValueError` when the
optimizer is built. A tensor setting can change afterwards (a learned learning rate stepped in
place by an outer optimizer): ``update`` re-reads every tensor setting at each step and, the
first time one is out of range or not finite, warns once per optimizer with
:class:`OptimizerSettingWarning` (a :class:`~hypergrad.HypergradWarning`) and carries on with the
value as it is, so a negative learning rate (steps that *ascend* the inner loss) does not go
unnoticed. The warning is the safety net, not the way to learn a setting:

**Parameterise learned settings so that they cannot leave their range.** Learn
``log_lr`` and pass ``lr=log_lr.exp()`` (always > 0; the hypergradient w.r.t. ``log_lr`` is
``lr`` times that w.r.t. ``lr``, so steps are relative), and a momentum or a beta through a
logit, ``momentum=torch.sigmoid(logit_m)`` (in (0, 1)); build the optimizer from the
hyperparameters inside ``optimizer=lambda h: hg.optim.sgd(lr=h["log_lr"].exp())`` so that every
call sees their current values (``examples/learn_lr.py`` does both).

Why these settings are not :class:`~hypergrad.settings.FrozenSettings` dataclasses like the
rest of the library's (solvers, inner solvers, method objects, the compiled step): a setting here
may be a tensor, often one that requires grad and is stepped *in place* by an outer optimizer
(that is how it is learned), so its value legitimately changes after the optimizer is built and
freezing the attribute would not freeze the value; the optimizer must read it at each update and
stay differentiable in it, and validating it there with an exception would abort a training run
for a transient excursion. So each setting is checked when the optimizer is built by the
library's scalar check (:func:`hypergrad.settings.check_number`, on the number or the tensor's
value; same ranges and messages as everywhere) and a tensor one is re-read at each update, with
a warning instead of an error; the settings are otherwise plain attributes, not declared fields.

Differentiability note: ``d sqrt(v)/dv`` is infinite at ``v = 0`` (a parameter whose gradient has
been exactly zero so far, e.g. behind a dead ReLU). Adam here treats that derivative as 0 there,
so such parameters contribute nothing instead of NaN; the values are unchanged.

Example:
    >>> import torch, hypergrad as hg
    >>> log_lr = torch.tensor(-2.0, requires_grad=True)
    >>> opt = hg.optim.sgd(lr=log_lr.exp(), momentum=0.9)
    >>> p = (torch.ones(2, requires_grad=True),)
    >>> state = opt.init(p)
    >>> updates, state = opt.update((2 * p[0],), state, params=p)
    >>> updates[0].requires_grad
    True
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import torch

from .errors import (
    FrozenSettingError,
    HypergradTypeError,
    HypergradValueError,
    HypergradWarning,
    warn,
)
from .settings import check_number

Setting = float | torch.Tensor
Tensors = tuple[torch.Tensor, ...]

__all__ = [
    "DifferentiableOptimizer",
    "OptimizerSettingWarning",
    "adam",
    "adam_step",
    "adamw",
    "sgd",
]


class OptimizerSettingWarning(HypergradWarning):
    """A tensor setting of a :mod:`hypergrad.optim` optimizer left its valid range (or became
    NaN/Inf) after the optimizer was built, e.g. a learned learning rate that turned negative:
    the steps now ascend the inner loss. Raised once per optimizer; parameterise the setting so
    that it cannot leave its range (``lr=log_lr.exp()``, ``momentum=torch.sigmoid(logit)``).
    """


def _bounds(low: float, high: float | None, closed: bool) -> str:
    if high is None:
        return f">= {low:g}"
    return f"in [{low:g}, {high:g}{']' if closed else ')'}"


def _out_of_range(x: float, low: float, high: float | None, closed: bool) -> bool:
    if not math.isfinite(x) or x < low:
        return True
    return high is not None and (x > high if closed else x >= high)


def _value(setting: Setting) -> float:
    """The value of a validated setting (a tensor's, read once; a host sync on an accelerator)."""
    return float(setting.detach()) if isinstance(setting, torch.Tensor) else float(setting)


def _setting(
    value: Any, name: str, low: float = 0.0, high: float | None = None, closed: bool = False
) -> Setting:
    """Validate a setting: a finite real number or a real scalar tensor (possibly requiring
    grad) in ``[low, high)`` (``[low, high]`` when ``closed``; ``>= low`` when ``high`` is None).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise HypergradTypeError(
                f"{name} must be a real number or a floating-point scalar tensor, got a tensor "
                f"of shape {tuple(value.shape)} and dtype {value.dtype}"
            )
        check = float(value.detach())
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        check = float(value)
    else:
        raise HypergradTypeError(f"{name} must be a real number or a tensor, got {value!r}")
    # the library's scalar check (hypergrad.settings), on the number or the tensor's value
    check_number(name, check, low, maximum=math.inf if high is None else high, closed=closed)
    # A tensor or a real number (int, float, NumPy real), returned unchanged: the numbers act as
    # the float they equal in the update arithmetic.
    return cast(Setting, value)


class SGDState(NamedTuple):
    """State of :func:`sgd`: the step count and one momentum buffer per leaf (or None)."""

    # ``count`` shadows tuple.count (a method), as in torchopt's states; the field is the API.
    count: int  # type: ignore[assignment]
    momentum: Tensors | None


class AdamState(NamedTuple):
    """State of :func:`adam`/:func:`adamw`: the step count, first and second moments."""

    count: int  # type: ignore[assignment]  # shadows tuple.count, see SGDState
    mu: Tensors
    nu: Tensors


class DifferentiableOptimizer:
    """Base of the optimizers of this module (torchopt's ``init``/``update`` protocol)."""

    #: the tensor settings re-checked at each update: (name, tensor, low, high, closed)
    _watched: list[tuple[str, torch.Tensor, float, float | None, bool]]
    _warned: bool = False
    _frozen: bool = False  # set at the end of a subclass's __init__

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen and not name.startswith("_"):
            raise FrozenSettingError(
                f"hypergrad.optim.{self._label()}: {name} is fixed when the optimizer is built "
                "(that is when it is checked); build a new optimizer. A setting meant to change "
                "(a learned learning rate) is a tensor: it is re-read at every update"
            )
        object.__setattr__(self, name, value)

    def _watch(
        self,
        value: Setting,
        name: str,
        low: float = 0.0,
        high: float | None = None,
        closed: bool = False,
    ) -> Setting:
        """``_setting`` (checked now), remembering a tensor to re-check at each update."""
        out = _setting(value, name, low, high, closed)
        if not hasattr(self, "_watched"):
            self._watched = []
        if isinstance(out, torch.Tensor):
            self._watched.append((name, out, low, high, closed))
        return out

    def _label(self) -> str:
        return "optimizer"

    def _check_watched(self) -> None:
        """Warn (once per optimizer) when a tensor setting left its range since it was built."""
        if self._warned or not getattr(self, "_watched", None):
            return
        for name, t, low, high, closed in self._watched:
            x = float(t.detach())
            if _out_of_range(x, low, high, closed):
                self._warned = True
                what = "is not finite" if not math.isfinite(x) else "is out of range"
                ascend = " (the steps now ascend the inner loss)" if name == "lr" and x < 0 else ""
                if name == "dampening" and getattr(self, "nesterov", False):
                    ascend = " (Nesterov momentum needs dampening = 0)"
                warn(
                    f"hypergrad.optim.{self._label()}: the tensor setting {name} "
                    f"{what}: {x:g}, expected {_bounds(low, high, closed)}{ascend}. It changed "
                    "after the optimizer was built (e.g. stepped by an outer optimizer); "
                    "parameterise it so it cannot leave its range (lr=log_lr.exp(), "
                    "momentum=torch.sigmoid(logit)). Warned once per optimizer.",
                    OptimizerSettingWarning,
                )
                return

    def init(self, params: Sequence[torch.Tensor]) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def update(
        self,
        updates: Sequence[torch.Tensor],
        state: Any,
        *,
        params: Sequence[torch.Tensor] | None = None,
        inplace: bool = False,
    ) -> tuple[Tensors, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def _params(
        params: Sequence[torch.Tensor] | None, needed: bool, what: str
    ) -> Sequence[torch.Tensor]:
        if needed and params is None:
            raise HypergradValueError(f"{what} needs params=... in update() (weight decay)")
        return params if params is not None else ()


class _SGD(DifferentiableOptimizer):
    def __init__(
        self,
        lr: Setting,
        momentum: Setting,
        dampening: Setting,
        weight_decay: Setting,
        nesterov: bool,
    ) -> None:
        self.lr = self._watch(lr, "lr")
        self.momentum = self._watch(momentum, "momentum", 0.0, 1.0)
        self.dampening = self._watch(dampening, "dampening", 0.0, 1.0, closed=True)
        self.weight_decay = self._watch(weight_decay, "weight_decay")
        if not isinstance(nesterov, bool):
            raise HypergradTypeError(f"nesterov must be a bool, got {nesterov!r}")
        uses_momentum = isinstance(momentum, torch.Tensor) or momentum != 0
        if nesterov:  # the same rule for a tensor as for a number: its value now
            if _value(self.momentum) == 0:
                raise HypergradValueError(
                    f"Nesterov momentum needs momentum > 0, got {_value(self.momentum):g}"
                )
            if _value(self.dampening) != 0:
                raise HypergradValueError(
                    f"Nesterov momentum needs dampening = 0, got {_value(self.dampening):g}"
                )
            # a tensor dampening is re-checked at each update against Nesterov's range, [0, 0]
            self._watched = [
                (n, t, 0.0, 0.0, True) if n == "dampening" else (n, t, lo, hi, c)
                for n, t, lo, hi, c in getattr(self, "_watched", [])
            ]
        self.nesterov, self.uses_momentum = nesterov, uses_momentum
        self._frozen = True

    def _label(self) -> str:
        return "sgd"

    def __repr__(self) -> str:
        return (
            f"hypergrad.optim.sgd(lr={self.lr}, momentum={self.momentum}, "
            f"dampening={self.dampening}, weight_decay={self.weight_decay}, "
            f"nesterov={self.nesterov})"
        )

    def init(self, params: Sequence[torch.Tensor]) -> SGDState:
        return SGDState(0, None)

    def update(
        self,
        updates: Sequence[torch.Tensor],
        state: SGDState,
        *,
        params: Sequence[torch.Tensor] | None = None,
        inplace: bool = False,
    ) -> tuple[Tensors, SGDState]:
        self._check_watched()
        decay = isinstance(self.weight_decay, torch.Tensor) or self.weight_decay != 0
        ps = self._params(params, decay, "sgd(weight_decay>0)")
        grads = [g + self.weight_decay * p for g, p in zip(updates, ps)] if decay else list(updates)
        bufs: Tensors | None = None
        if self.uses_momentum:
            if state.count == 0 or state.momentum is None:
                bufs = tuple(grads)
            else:
                bufs = tuple(
                    self.momentum * b + (1 - self.dampening) * g
                    for b, g in zip(state.momentum, grads)
                )
            if self.nesterov:
                grads = [g + self.momentum * b for g, b in zip(grads, bufs)]
            else:
                grads = list(bufs)
        return tuple(-self.lr * g for g in grads), SGDState(state.count + 1, bufs)


class _Adam(DifferentiableOptimizer):
    def __init__(
        self,
        lr: Setting,
        betas: tuple[Setting, Setting],
        eps: Setting,
        weight_decay: Setting,
        decoupled: bool,
    ) -> None:
        self.lr = self._watch(lr, "lr")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise HypergradTypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        self.b1 = self._watch(betas[0], "betas[0]", 0.0, 1.0)
        self.b2 = self._watch(betas[1], "betas[1]", 0.0, 1.0)
        self.eps = self._watch(eps, "eps")
        self.weight_decay = self._watch(weight_decay, "weight_decay")
        self.decoupled = decoupled
        self._frozen = True

    def _label(self) -> str:
        return "adamw" if self.decoupled else "adam"

    def __repr__(self) -> str:
        name = self._label()
        return (
            f"hypergrad.optim.{name}(lr={self.lr}, betas=({self.b1}, {self.b2}), "
            f"eps={self.eps}, weight_decay={self.weight_decay})"
        )

    def init(self, params: Sequence[torch.Tensor]) -> AdamState:
        zeros = tuple(torch.zeros_like(p, memory_format=torch.preserve_format) for p in params)
        return AdamState(0, zeros, zeros)

    def update(
        self,
        updates: Sequence[torch.Tensor],
        state: AdamState,
        *,
        params: Sequence[torch.Tensor] | None = None,
        inplace: bool = False,
    ) -> tuple[Tensors, AdamState]:
        self._check_watched()
        decay = isinstance(self.weight_decay, torch.Tensor) or self.weight_decay != 0
        ps = self._params(params, decay, "adam(weight_decay>0)")
        t = state.count + 1
        out, mu, nu = adam_step(
            tuple(updates), state.mu, state.nu, t, lr=self.lr, b1=self.b1, b2=self.b2,
            eps=self.eps, weight_decay=self.weight_decay, decoupled=self.decoupled, params=ps,
        )  # fmt: skip
        return out, AdamState(t, mu, nu)


def adam_step(
    grads: Tensors,
    mu: Tensors,
    nu: Tensors,
    t: int | torch.Tensor,
    *,
    lr: Setting,
    b1: Setting,
    b2: Setting,
    eps: Setting,
    weight_decay: Setting = 0.0,
    decoupled: bool = False,
    params: Sequence[torch.Tensor] = (),
) -> tuple[Tensors, Tensors, Tensors]:
    """One Adam step as a pure function, ``torch.optim.Adam``'s (``AdamW``'s with
    ``decoupled``) arithmetic: ``(updates, mu, nu)`` with the new parameters
    ``params + updates``.

    The one Adam of the library: :func:`adam` and :func:`adamw` (torchopt's protocol) and
    :class:`hypergrad.compiled_step.Adam` (inside a compiled outer step) are this function
    with their own settings checks. The settings are used as given (validate them first).

    Args:
        grads: the gradients, one per parameter leaf.
        mu, nu: the first and second moments before the step.
        t: the step number, >= 1 (an int, or a 0-d tensor, so that a compiled step runs one
            graph for every step).
        lr, b1, b2, eps, weight_decay: the settings (numbers, or tensors to differentiate).
        decoupled: AdamW's decay ``p *= 1 - lr * wd`` rather than L2 added to the gradient.
        params: the parameters (needed with a weight decay).

    Example:
        >>> g = (torch.tensor([1.0, -2.0]),)
        >>> zero = (torch.zeros(2),)
        >>> updates, mu, nu = adam_step(g, zero, zero, 1, lr=0.1, b1=0.9, b2=0.999, eps=1e-8)
        >>> updates[0]
        tensor([-0.1000,  0.1000])
    """
    decay = isinstance(weight_decay, torch.Tensor) or weight_decay != 0
    grads_l = list(grads)
    if decay and not decoupled:
        grads_l = [g + weight_decay * p for g, p in zip(grads_l, params)]
    mu = tuple(b1 * m + (1 - b1) * g for m, g in zip(mu, grads_l))
    nu = tuple(b2 * v + (1 - b2) * g * g for v, g in zip(nu, grads_l))
    bc1 = 1 - b1**t
    bc2_sqrt = (1 - b2**t) ** 0.5
    step = lr / bc1
    out = []
    for i, (m, v) in enumerate(zip(mu, nu)):
        u = -step * m / (_safe_sqrt(v) / bc2_sqrt + eps)
        if decay and decoupled:
            u = u - lr * weight_decay * params[i]
        out.append(u)
    return tuple(out), mu, nu


def _safe_sqrt(v: torch.Tensor) -> torch.Tensor:
    """``sqrt(v)`` whose derivative is 0 (not infinite) where ``v == 0``."""
    positive = v > 0
    return torch.where(positive, torch.where(positive, v, torch.ones_like(v)).sqrt(), 0.0)


def sgd(
    lr: Setting,
    momentum: Setting = 0.0,
    dampening: Setting = 0.0,
    weight_decay: Setting = 0.0,
    nesterov: bool = False,
) -> DifferentiableOptimizer:
    """SGD with momentum, dampening, Nesterov and L2 weight decay, as ``torch.optim.SGD``.

    Every setting is a number or a scalar tensor (a tensor that requires grad is differentiated
    through), finite and in range, else :class:`~hypergrad.HypergradValueError`; a tensor
    setting that leaves its range later warns :class:`OptimizerSettingWarning` once (see the
    module's documentation). To learn a setting, keep it in range by construction:
    ``lr=h["log_lr"].exp()``, ``momentum=torch.sigmoid(h["logit_momentum"])``.

    Args:
        lr: learning rate, >= 0 (learn it as ``log_lr.exp()``: a negative learning rate would
            ascend the inner loss).
        momentum: in [0, 1); dampening: in [0, 1]; weight_decay: >= 0 (added to the gradient).
            A tensor momentum always keeps the momentum buffer (so that the update is
            differentiable in it, at 0 too): at ``momentum = 0`` with a nonzero dampening its
            steps after the first are ``(1 - dampening)`` times those of ``torch.optim.SGD``,
            which drops the buffer and the dampening for ``momentum == 0``; with the default
            ``dampening=0`` they are the same.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0, numbers or tensors
            alike; a tensor dampening that leaves 0 later warns
            :class:`OptimizerSettingWarning`).

    Example:
        >>> opt = sgd(lr=torch.tensor(0.1), momentum=0.9, nesterov=True)
        >>> log_lr = torch.tensor(-2.0, requires_grad=True)  # a learned lr, always > 0
        >>> opt = sgd(lr=log_lr.exp(), momentum=torch.sigmoid(torch.tensor(2.0)))
    """
    return _SGD(lr, momentum, dampening, weight_decay, nesterov)


def adam(
    lr: Setting = 1e-3,
    betas: tuple[Setting, Setting] = (0.9, 0.999),
    eps: Setting = 1e-8,
    weight_decay: Setting = 0.0,
) -> DifferentiableOptimizer:
    """Adam with L2 weight decay added to the gradient, as ``torch.optim.Adam``.

    Args:
        lr, betas, eps, weight_decay: finite numbers or scalar tensors (differentiable when they
            require grad); lr, eps, weight_decay >= 0 and betas in [0, 1), else
            :class:`~hypergrad.HypergradValueError` (a tensor leaving its range after the
            optimizer was built warns :class:`OptimizerSettingWarning` once). Learn them in
            range by construction: ``lr=log_lr.exp()``, ``betas=(torch.sigmoid(logit_b1),
            0.999)``.

    Example:
        >>> opt = adam(lr=1e-2, betas=(torch.tensor(0.8), 0.999))
    """
    return _Adam(lr, betas, eps, weight_decay, decoupled=False)


def adamw(
    lr: Setting = 1e-3,
    betas: tuple[Setting, Setting] = (0.9, 0.999),
    eps: Setting = 1e-8,
    weight_decay: Setting = 1e-2,
) -> DifferentiableOptimizer:
    """AdamW: Adam with decoupled weight decay ``p *= 1 - lr * wd``, as ``torch.optim.AdamW``.

    Settings as in :func:`adam` (finite, in range; learn ``lr`` as ``log_lr.exp()`` and a weight
    decay as ``log_wd.exp()``).

    Example:
        >>> opt = adamw(lr=1e-3, weight_decay=torch.tensor(0.05, requires_grad=True))
    """
    return _Adam(lr, betas, eps, weight_decay, decoupled=True)
