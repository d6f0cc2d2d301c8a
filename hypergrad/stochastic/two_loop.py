"""Two-loop stochastic solvers: a warm-started inner SGD loop, then an adjoint estimate, then
one step of ``x``. The inner loop keeps ``z`` from the previous outer iteration (warm start), so
a few inner steps per outer step suffice (Ji et al. 2021; Arbel and Mairal 2022)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings import count, number
from ..tree import Tensors, tree_add, tree_axpy, tree_scale, tree_sub
from .base import StochasticSolver, StochasticState, draw_inner, draw_outer
from .oracles import Bilevel, Linearization, gradients


def inner_sgd(s: StochasticState, problem: Bilevel, steps: int, lr: float) -> None:
    """``steps`` SGD steps of ``z`` on fresh inner batches (one gradient call each), in ``s``."""
    for _ in range(steps):
        g, _ = gradients(
            problem.inner_loss, "inner_loss", s.specs, s.z, s.x, draw_inner(problem, s), False
        )
        with torch.no_grad():
            s.z = tree_axpy(-lr, g, s.z)
        s.inner_calls += 1


def outer_step(s: StochasticState, problem: Bilevel, fx: Tensors, lr: float) -> None:
    """``x -= lr (∇_x F + ∇²_xz G_i · v)`` with a fresh inner batch ``i`` for the cross product."""
    lin = Linearization(problem, s.specs, s.z, s.x, draw_inner(problem, s))
    _, cross = lin.products(s.v)
    with torch.no_grad():
        s.x = tree_axpy(-lr, tree_add(fx, cross), s.x)
    s.inner_calls += 1
    s.iteration += 1


@dataclass(kw_only=True)
class StocBiO(StochasticSolver):
    """StocBiO (Ji, Yang and Liang, "Bilevel optimization: convergence analysis and enhanced
    design", ICML 2021, Algorithm 2).

    Per outer iteration: ``T`` warm-started SGD steps of ``z`` (step ``α``); on one outer batch
    ``∇_z F`` and ``∇_x F``; the stochastic Neumann adjoint
    ``v = -η Σ_{q=0}^{Q} Π_{j≤q} (I - η ∇²_zz G_{B_j}) ∇_z F`` (one fresh inner batch per
    factor, so the product's mean is ``(I - η ∇²G)^q``: an unbiased estimate of the series
    truncated at ``Q``, whose bias ``(I - η ∇²G)^{Q+1}`` decays geometrically when
    ``η ≤ 1/L``); then ``x -= β (∇_x F + ∇²_xz G_{B_0} v)`` (Ji et al.'s Theorem 3: constant
    steps). Oracle calls: ``T + Q + 1`` inner, 2 outer. Memory: ``z``, ``x`` and two vectors of
    ``z``'s size.

    Args:
        step_inner: ``α``, the inner SGD step.
        inner_steps: ``T``.
        neumann_steps: ``Q``, the Hessian-vector products of the series.
        neumann_step: ``η`` (at most ``1/L``, ``L`` the inner Hessian's largest eigenvalue).
        step_outer: ``β``.
    """

    name: ClassVar[str] = "stocbio"
    step_inner: float = number(0.1, strict=True)
    inner_steps: int = count(10, minimum=1, allow_none=False)
    neumann_steps: int = count(10, allow_none=False)
    neumann_step: float = number(0.1, strict=True)
    step_outer: float = number(0.01, strict=True)

    def adjoint_estimate(self, s: StochasticState, problem: Bilevel, fz: Tensors) -> Tensors:
        """The stochastic Neumann adjoint at ``s`` for ``∇_z F = fz`` (draws ``Q`` batches)."""
        r, acc = fz, fz
        for _ in range(self.neumann_steps):
            lin = Linearization(problem, s.specs, s.z, s.x, draw_inner(problem, s))
            r = tree_axpy(-self.neumann_step, lin.hvp(r), r)
            acc = tree_add(acc, r)
            s.inner_calls += 1
        return tree_scale(-self.neumann_step, acc)

    def step(self, state: StochasticState, problem: Bilevel) -> StochasticState:
        s = state.copy()
        inner_sgd(s, problem, self.inner_steps, self.step_inner)
        fz, fx = gradients(
            problem.outer_loss, "outer_loss", s.specs, s.z, s.x, draw_outer(problem, s)
        )
        s.outer_calls += 2
        s.v = self.adjoint_estimate(s, problem, fz)
        outer_step(s, problem, fx, self.step_outer)
        return s


@dataclass(kw_only=True)
class AmIGO(StochasticSolver):
    """AmIGO (Arbel and Mairal, "Amortized implicit differentiation for stochastic bilevel
    optimization", ICLR 2022, Algorithm 1 with SGD as the inner and adjoint solvers).

    Per outer iteration: ``T`` warm-started SGD steps of ``z`` (step ``α``); on one outer batch
    ``∇_z F`` and ``∇_x F``; ``M`` warm-started SGD steps of the adjoint on the quadratic
    ``½ vᵀ ∇²_zz G v + ∇_z Fᵀ v``, ``v -= η (∇²_zz G_{B_m} v + ∇_z F)`` (a fresh inner batch
    each); then ``x -= β (∇_x F + ∇²_xz G_{B_0} v)``. The warm starts (amortization) are what
    let constant ``T``, ``M`` and steps converge (the paper's Theorem 1: constant steps, linear
    rate to an ``O(step)`` neighbourhood under strong convexity). Oracle calls: ``T + M + 1``
    inner, 2 outer; memory ``z``, ``v``, ``x``.

    Args:
        step_inner: ``α``, the inner SGD step.
        inner_steps: ``T``.
        step_adjoint: ``η``, the adjoint SGD step (at most ``1/L``).
        adjoint_steps: ``M``.
        step_outer: ``β``.
    """

    name: ClassVar[str] = "amigo"
    step_inner: float = number(0.1, strict=True)
    inner_steps: int = count(10, minimum=1, allow_none=False)
    step_adjoint: float = number(0.1, strict=True)
    adjoint_steps: int = count(10, minimum=1, allow_none=False)
    step_outer: float = number(0.01, strict=True)

    def step(self, state: StochasticState, problem: Bilevel) -> StochasticState:
        s = state.copy()
        inner_sgd(s, problem, self.inner_steps, self.step_inner)
        fz, fx = gradients(
            problem.outer_loss, "outer_loss", s.specs, s.z, s.x, draw_outer(problem, s)
        )
        s.outer_calls += 2
        v = s.v
        for _ in range(self.adjoint_steps):
            lin = Linearization(problem, s.specs, s.z, s.x, draw_inner(problem, s))
            v = tree_sub(v, tree_scale(self.step_adjoint, tree_add(lin.hvp(v), fz)))
            s.inner_calls += 1
        s.v = v
        outer_step(s, problem, fx, self.step_outer)
        return s
