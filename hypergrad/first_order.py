"""The first-order meta step of :class:`~hypergrad.HyperStep` (``method=hg.FirstOrder(...)``):
no second-order graph, only ordinary gradient passes.

The implicit hypergradient is ``∇_θ L_out − M H⁻¹ ∇_ψ L_out`` with ``H = ∇²_ψψ L_in`` and
``M = ∇²_θψ L_in``. The first-order step replaces ``H⁻¹`` by a diagonal ``P`` (``alpha·I``, or
the derivative of the inner optimizer's next update with respect to the gradient:
:func:`update_derivative`), optionally refined by ``terms`` steps of the preconditioned Richardson
iteration ``v ← v + P (g − H v)``, and takes every product by a central finite difference of two
ordinary gradients of the inner loss at ``ψ ± ε v``:

    [∇L_in(ψ + εv) − ∇L_in(ψ − εv)] / (2ε) = (H v, M v) + O(ε² ||v||³ ||∇³L_in||)

(both blocks from one backward pass per side). The two sides of a pair see the same random
draws (dropout, Gumbel noise): the RNG state is replayed for each side, as the recompute engine
of :mod:`hypergrad.operators` does. Step rule: ``ε = fd_step · max(1, ||ψ||) / ||v||``, the
perturbation ``ε v`` of norm ``fd_step · max(1, ||ψ||)``; ``fd_step=None`` takes ``eps^{1/3}``
of the dtype (4.9e-3 in float32, 6.1e-6 in float64), the step that balances a central
difference's truncation error against its rounding error.

Cost per meta step, in forward+backward passes: 1 (outer loss) + 2 (the pair for ``M v``) +
2 per Richardson term. The result is biased by ``M (H⁻¹ − P_K) ∇_ψ L_out`` (``P_K`` the
truncated series), which is zero only when ``P_K = H⁻¹`` on that vector: see
``docs/modules.md``, "The first-order method", for the bias measured against the exact
hypergradient.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import HypergradError, HypergradTypeError, HypergradValueError
from .operators import _RNGSnapshot, check_scalar_loss
from .report import Reduce
from .tree import Tensors, tree_norm

FlatLoss = Callable[[Tensors, Tensors], torch.Tensor]


@dataclass
class FirstOrderInfo:
    """Diagnostics of one first-order meta step (``HyperStep(method=hg.FirstOrder(...))``).

    Attributes:
        terms: Richardson terms run.
        fd_eps: the finite-difference step ``ε`` of the last pair (its perturbation ``ε v``).
        passes: forward+backward passes (1 + 2 (terms + 1)).
        outer_loss: the outer loss at ψ.
        outer_grad_norm: ``||∇_ψ L_out||``.
        direct_norm: ``||∇_θ L_out||``.
        indirect_norm: ``||M v||``.
        hypergrad_norm: norm of the result (before any clipping).
        time_s: wall time.
        clipped, skipped, skip_reason: as in :class:`~hypergrad.HypergradInfo`.
    """

    terms: int
    fd_eps: float = float("nan")
    passes: int = 0
    outer_loss: float = float("nan")
    outer_grad_norm: float = float("nan")
    direct_norm: float = float("nan")
    indirect_norm: float = float("nan")
    hypergrad_norm: float = float("nan")
    time_s: float = 0.0
    clipped: bool = False
    skipped: bool = False
    skip_reason: str | None = None


#: the optimizers :func:`update_derivative` adapts to (their classes, not subclasses)
ADAPTABLE = ("SGD", "Adam", "AdamW")


def update_derivative(optimizer: torch.optim.Optimizer, params: Tensors) -> Tensors:
    """``P = −∂Δψ/∂g``: the derivative of ``optimizer``'s next update ``Δψ`` of each of
    ``params`` with respect to the loss gradient ``g``, elementwise, at ``g = 0`` (SGD's update
    is affine in ``g``, so its derivative is exact at any ``g``).

    * ``torch.optim.SGD``: ``lr`` before the first step of a momentum buffer (and without
      momentum), then ``lr (1 − dampening)``; Nesterov: ``lr (1 + momentum)``, then
      ``lr (1 + momentum (1 − dampening))``.
    * ``torch.optim.Adam`` / ``AdamW`` (after at least one step: the second moment exists):
      with ``m' = β₁ m + (1−β₁) g₀``, ``v' = β₂ v + (1−β₂) g₀²``, the bias corrections
      ``c₁ = 1 − β₁^{t+1}``, ``c₂ = 1 − β₂^{t+1}`` and ``s = √(v'/c₂)``:
      ``lr [(1−β₁)/c₁ (s + ε) − (m'/c₁)(1−β₂) g₀ / (c₂ s)] / (s + ε)²``, where ``g₀`` is the
      L2 term ``weight_decay · ψ`` of Adam (0 for AdamW, whose decay is decoupled). The first
      term is the preconditioner SAMA adapts to (Choe et al., NeurIPS 2023); the second is the
      second moment's own derivative.

    Raises:
        HypergradTypeError: another optimizer class.
        HypergradValueError: a parameter the optimizer does not hold, ``maximize``,
            ``amsgrad``, or an Adam with no state yet.
    """
    kind = type(optimizer).__name__
    if kind not in ADAPTABLE or type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
        raise HypergradTypeError(
            f"FirstOrder adapts to torch.optim.{', '.join(ADAPTABLE)}, got "
            f"{type(optimizer).__name__}; pass alpha=... instead (H⁻¹ ≈ alpha·I)"
        )
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out = []
    for i, p in enumerate(params):
        group = groups.get(id(p))
        if group is None:
            raise HypergradValueError(
                f"the inner optimizer does not hold parameter {i} of the inner model "
                f"(shape {tuple(p.shape)}): FirstOrder adapts to the optimizer that trains it"
            )
        for key in ("maximize", "amsgrad"):
            if group.get(key, False):
                raise HypergradValueError(f"FirstOrder cannot adapt to {kind}({key}=True)")
        state = optimizer.state.get(p, {})
        out.append(
            _sgd_derivative(group, state, p)
            if kind == "SGD"
            else _adam_derivative(kind, group, state, p)
        )
    return tuple(out)


def _sgd_derivative(group: dict[str, Any], state: dict[Any, Any], p: torch.Tensor) -> torch.Tensor:
    lr, mu, damp = float(group["lr"]), float(group["momentum"]), float(group["dampening"])
    started = mu != 0 and state.get("momentum_buffer") is not None
    keep = (1.0 - damp) if started else 1.0  # the first step copies g into the buffer
    scale = lr * (1.0 + mu * keep) if group.get("nesterov", False) else lr * (keep if mu else 1.0)
    return torch.full_like(p, scale).detach()


def _adam_derivative(
    kind: str, group: dict[str, Any], state: dict[Any, Any], p: torch.Tensor
) -> torch.Tensor:
    if "exp_avg_sq" not in state:
        raise HypergradValueError(
            f"{kind} has no state yet (no step taken): FirstOrder adapts to its second-moment "
            "estimate; call the hyper step after the optimizer's first step, or pass alpha=..."
        )
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    b1, b2 = (float(b) for b in group["betas"])
    t = float(state["step"]) + 1.0
    with torch.no_grad():
        g0 = wd * p.detach() if kind == "Adam" and wd else torch.zeros_like(p)
        m = b1 * state["exp_avg"] + (1 - b1) * g0
        v = b2 * state["exp_avg_sq"] + (1 - b2) * g0 * g0
        c1, c2 = 1 - b1**t, 1 - b2**t
        s = (v / c2).sqrt()
        first = (1 - b1) / c1 * (s + eps)
        second = torch.where(s > 0, (m / c1) * (1 - b2) * g0 / (c2 * s), torch.zeros_like(s))
        out: torch.Tensor = (lr * (first - second) / (s + eps) ** 2).detach()
        return out


def _check_direction(p: Tensors, psi: Tensors) -> None:
    for i, (a, b) in enumerate(zip(p, psi)):
        if a.shape != b.shape:
            raise HypergradValueError(
                f"the base Jacobian P has shape {tuple(a.shape)} for parameter {i} of shape "
                f"{tuple(b.shape)}"
            )


class _Pairs:
    """Central differences of the inner loss's gradient over (ψ, θ) at ``ψ ± ε v``, with the
    same random draws for every evaluation (the RNG state at the first one, replayed)."""

    def __init__(self, inner: FlatLoss, psi: Tensors, theta: Tensors, fd_step: float):
        self.inner, self.psi, self.theta, self.fd_step = inner, psi, theta, fd_step
        self.scale = max(1.0, float(tree_norm(tuple(p.detach() for p in psi))))
        self.rng = _RNGSnapshot()
        self.passes, self.eps = 0, math.nan

    def _grads(self, shift: Tensors) -> tuple[torch.Tensor | None, ...]:
        ctx = self.rng.replay()
        try:
            with torch.enable_grad():
                ps = tuple((p.detach() + s).requires_grad_(True) for p, s in zip(self.psi, shift))
                loss = check_scalar_loss(self.inner(ps, self.theta), "inner_loss")
                out = torch.autograd.grad(loss, ps + self.theta, allow_unused=True)
        finally:
            ctx.__exit__(None, None, None)
        self.passes += 1
        return out

    def products(self, v: Tensors) -> tuple[Tensors, list[torch.Tensor | None]]:
        """``(H v, M v)`` (``M v`` None for a θ leaf the inner gradient does not reach)."""
        norm = float(tree_norm(v))
        if norm == 0.0:
            return tuple(torch.zeros_like(p) for p in self.psi), [None] * len(self.theta)
        self.eps = self.fd_step * self.scale / norm
        plus = self._grads(tuple(self.eps * x for x in v))
        minus = self._grads(tuple(-self.eps * x for x in v))
        diff = [
            None if a is None or b is None else (a - b) / (2 * self.eps)
            for a, b in zip(plus, minus)
        ]
        n = len(self.psi)
        hv = tuple(torch.zeros_like(p) if d is None else d for d, p in zip(diff[:n], self.psi))
        return hv, diff[n:]


def first_order_hypergrad(
    inner: FlatLoss,
    outer: FlatLoss,
    psi: Tensors,
    theta: Tensors,
    base: Tensors,
    *,
    terms: int = 0,
    fd_step: float | None = None,
    reduce: Reduce | None = None,
) -> tuple[Tensors, FirstOrderInfo]:
    """The first-order hypergradient ``∇_θ L_out − M v`` with ``v = P Σ_{k≤terms} (I − H P)^k g``
    (``g = ∇_ψ L_out``, ``P = diag(base)``), every product by central differences of ordinary
    gradients (module docstring). ``reduce`` (a distributed run's all-reduce) is applied to
    ``g`` (one parameter-sized collective), to each ``H v`` of the Richardson terms, and to the
    θ-sized result.

    Raises:
        HypergradError: hyperparameters that reach neither the inner gradient nor the outer loss.
    """
    t0 = time.perf_counter()
    _check_direction(base, psi)
    info = FirstOrderInfo(terms=terms)
    with torch.enable_grad():
        lo = check_scalar_loss(outer(psi, theta), "outer_loss")
        grads = torch.autograd.grad(lo, psi + theta, allow_unused=True)
    g = tuple(torch.zeros_like(p) if d is None else d.detach() for d, p in zip(grads, psi))
    direct = [None if d is None else d.detach() for d in grads[len(psi) :]]
    if reduce is not None:
        g = reduce(g)
    dtype = psi[0].dtype
    step = torch.finfo(dtype).eps ** (1 / 3) if fd_step is None else fd_step
    pairs = _Pairs(inner, psi, theta, step)
    v = tuple(b * x for b, x in zip(base, g))
    for _ in range(terms):
        hv, _ = pairs.products(v)
        if reduce is not None:
            hv = reduce(hv)
        v = tuple(x + b * (gi - h) for x, b, gi, h in zip(v, base, g, hv))
    _, mv = pairs.products(v)
    names = [i for i, (m, d) in enumerate(zip(mv, direct)) if m is None and d is None]
    if names and float(tree_norm(v)) > 0:
        raise HypergradError(
            f"hyper tensors {names} influence neither the inner gradient nor the outer loss: the "
            "hypergradient would be silently zero"
        )
    indirect = tuple(torch.zeros_like(t) if m is None else m.detach() for m, t in zip(mv, theta))
    hyper = tuple(
        (torch.zeros_like(t) if d is None else d) - m for d, m, t in zip(direct, indirect, theta)
    )
    if reduce is not None:
        hyper = reduce(hyper)
    info.fd_eps, info.passes = pairs.eps, 1 + pairs.passes
    info.outer_loss = float(lo.detach())
    info.outer_grad_norm = float(tree_norm(g))
    info.direct_norm = float(
        tree_norm(tuple(torch.zeros_like(t) if d is None else d for d, t in zip(direct, theta)))
    )
    info.indirect_norm = float(tree_norm(indirect))
    info.hypergrad_norm = float(tree_norm(hyper))
    info.time_s = time.perf_counter() - t0
    return hyper, info
