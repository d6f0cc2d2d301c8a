"""First-order solvers: no Hessian-vector or cross products, only gradients of ``F`` and ``G``;
each keeps a second copy of the inner variable (F²SA's ``y``; BOME's ``θ``, recomputed each
iteration)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import HypergradValueError
from ..settings import count, number
from ..tree import Tensors, tree_axpy, tree_scale, tree_sq_norm, tree_sub, tree_vdot
from .base import StochasticSolver, StochasticState, draw_inner, draw_outer
from .oracles import Bilevel, gradients


@dataclass(kw_only=True)
class F2SA(StochasticSolver):
    """F²SA (Kwon, Kwon, Wright and Nowak, "A fully first-order method for stochastic bilevel
    optimization", ICML 2023, Algorithm 1).

    The penalty ``L_λ(x, y, z) = F(y, x) + λ (G(y, x) - G(z, x))``: ``z`` tracks ``z*(x)``,
    ``y`` the minimiser of ``F + λ G``, and ``∇_x L_λ`` tends to ``∇h(x)`` as ``O(1/λ)``
    (their Lemma 3.1), with ``λ (y - z) → -[∇²G]⁻¹∇_zF``, the adjoint. Per outer iteration
    ``k``: ``K`` steps, each on one inner batch ``i`` and one outer batch ``j``,
    ``z -= α ∇_z G_i(z)``, ``y -= (α/λ_k)(∇_z F_j(y) + λ_k ∇_z G_i(y))``
    (the step of ``y`` scaled by ``1/λ_k``, as ``F + λ G`` is ``λ``-times smoother); then on fresh
    batches ``x -= ξ (∇_x F_j(y) + λ_k (∇_x G_i(y) - ∇_x G_i(z)))``, the same inner batch for
    both ``G`` terms so their noise cancels to ``O(λ|y - z|)``. The penalty grows as the paper's
    rule ``λ_{k+1} = λ_k + δ`` (``δ`` constant), capped at ``lambda_max``. Oracle calls:
    ``3K + 3`` gradients (``2K + 2`` inner, ``K + 1`` outer); memory ``x``, ``y``, ``z``.

    Args:
        step_inner: ``α`` (below ``1/L`` of the inner Hessian).
        inner_steps: ``K``.
        step_outer: ``ξ``.
        lambda0: ``λ_0 > 0``.
        lambda_step: ``δ``, the penalty's increase per outer iteration.
        lambda_max: the penalty's cap (None: none).
    """

    name: ClassVar[str] = "f2sa"
    step_inner: float = number(0.1, strict=True)
    inner_steps: int = count(10, minimum=1, allow_none=False)
    step_outer: float = number(0.01, strict=True)
    lambda0: float = number(1.0, strict=True)
    lambda_step: float = number(0.0)
    lambda_max: float | None = number(None, strict=True, allow_none=True)

    def check(self) -> None:
        if self.lambda_max is not None and self.lambda_max < self.lambda0:
            raise HypergradValueError(
                f"F2SA lambda_max ({self.lambda_max}) must be >= lambda0 ({self.lambda0})"
            )

    def penalty(self, k: int) -> float:
        """``λ_k``."""
        lam = self.lambda0 + self.lambda_step * k
        return lam if self.lambda_max is None else min(lam, self.lambda_max)

    def _init(self, state: StochasticState) -> StochasticState:
        state.y = tuple(t.clone() for t in state.z)
        state.multiplier = self.penalty(0)
        return state

    def adjoint(self, state: StochasticState) -> Tensors | None:
        return tree_scale(state.multiplier, tree_sub(state.y, state.z))

    def step(self, state: StochasticState, problem: Bilevel) -> StochasticState:
        s = state.copy()
        lam = self.penalty(s.iteration)
        g_in, f_out, sp = problem.inner_loss, problem.outer_loss, s.specs
        for _ in range(self.inner_steps):
            bi, bo = draw_inner(problem, s), draw_outer(problem, s)
            gz, _ = gradients(g_in, "inner_loss", sp, s.z, s.x, bi, False)
            gy, _ = gradients(g_in, "inner_loss", sp, s.y, s.x, bi, False)
            fy, _ = gradients(f_out, "outer_loss", sp, s.y, s.x, bo, False)
            with torch.no_grad():
                s.z = tree_axpy(-self.step_inner, gz, s.z)
                s.y = tree_axpy(-self.step_inner, tree_axpy(1.0 / lam, fy, gy), s.y)
            s.inner_calls += 2
            s.outer_calls += 1
        bi, bo = draw_inner(problem, s), draw_outer(problem, s)
        _, gx_y = gradients(g_in, "inner_loss", sp, s.y, s.x, bi)
        _, gx_z = gradients(g_in, "inner_loss", sp, s.z, s.x, bi)
        _, fx = gradients(f_out, "outer_loss", sp, s.y, s.x, bo)
        with torch.no_grad():
            d = tree_axpy(lam, tree_sub(gx_y, gx_z), fx)
            s.x = tree_axpy(-self.step_outer, d, s.x)
        s.inner_calls += 2
        s.outer_calls += 1
        s.iteration += 1
        s.multiplier = lam
        return s


@dataclass(kw_only=True)
class BOME(StochasticSolver):
    """BOME (Ye, Liu, Liu and Liu, "BOME! Bilevel optimization made easy: a simple first-order
    approach", NeurIPS 2022, Algorithm 1).

    The bilevel problem as ``min F(z, x)`` subject to ``q(z, x) = G(z, x) - G(θ_T, x) ≤ 0``,
    ``θ_T`` = ``T`` gradient steps (step ``α``) of ``G(·, x)`` from ``z`` (held constant in
    ``∇q``), so ``q ≥ 0`` with equality exactly at ``z = z*(x)`` for a strongly convex ``G``.
    Each iteration moves ``(z, x)`` along the dynamic-barrier direction
    ``d = ∇F + λ ∇q``, ``λ = max((φ - ⟨∇F, ∇q⟩) / ||∇q||², 0)``, ``φ = η ||∇q||²``:
    the component of ``∇F`` along ``∇q`` replaced by ``η ∇q``, so ``q`` decreases whenever
    ``∇q ≠ 0``. Per iteration, one inner batch for all of ``q``'s gradients (``T`` steps plus
    ``∇_{z,x} G(z)`` and ``∇_x G(θ_T)``: ``T + 2`` inner gradients) and one outer batch
    (``∇_z F``, ``∇_x F``): ``T + 3`` gradient evaluations, no Hessian products. Memory ``z``,
    ``x``, ``θ``. The paper's guarantee is on the KKT residual
    ``min_λ ||∇F + λ ∇q||² + q``, at an ``O(k^{-1/4})`` rate; it keeps no adjoint, so
    :meth:`diagnose` reports no adjoint residual.

    Args:
        step_size: ``ξ``, the step of ``(z, x)``.
        inner_steps: ``T``.
        step_inner: ``α``, the step of ``θ``'s gradient descent.
        eta: ``η`` in ``φ = η ||∇q||²`` (the paper's default 0.5).
    """

    name: ClassVar[str] = "bome"
    step_size: float = number(0.01, strict=True)
    inner_steps: int = count(10, minimum=1, allow_none=False)
    step_inner: float = number(0.1, strict=True)
    eta: float = number(0.5, strict=True)

    def _init(self, state: StochasticState) -> StochasticState:
        state.v = ()
        return state

    def direction(self, s: StochasticState, problem: Bilevel) -> tuple[Tensors, Tensors, float]:
        """``(d_z, d_x, λ)`` at ``s``; draws one inner and one outer batch."""
        bi, bo = draw_inner(problem, s), draw_outer(problem, s)
        g_in, sp = problem.inner_loss, s.specs
        theta = s.z
        for _ in range(self.inner_steps):
            g, _ = gradients(g_in, "inner_loss", sp, theta, s.x, bi, False)
            theta = tree_axpy(-self.step_inner, g, theta)
        qz, gx = gradients(g_in, "inner_loss", sp, s.z, s.x, bi)
        _, gx_theta = gradients(g_in, "inner_loss", sp, theta, s.x, bi)
        qx = tree_sub(gx, gx_theta)
        fz, fx = gradients(problem.outer_loss, "outer_loss", sp, s.z, s.x, bo)
        s.inner_calls += self.inner_steps + 2
        s.outer_calls += 2
        nq = float(tree_sq_norm(qz) + tree_sq_norm(qx))
        dot = float(tree_vdot(fz, qz) + tree_vdot(fx, qx))
        lam = max((self.eta * nq - dot) / nq, 0.0) if nq > 0.0 else 0.0
        return tree_axpy(lam, qz, fz), tree_axpy(lam, qx, fx), lam

    def step(self, state: StochasticState, problem: Bilevel) -> StochasticState:
        s = state.copy()
        dz, dx, lam = self.direction(s, problem)
        with torch.no_grad():
            s.z = tree_axpy(-self.step_size, dz, s.z)
            s.x = tree_axpy(-self.step_size, dx, s.x)
        s.iteration += 1
        s.multiplier = lam
        return s
