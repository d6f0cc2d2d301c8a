"""SRBA: the single-loop solver with SARAH/SPIDER recursive variance reduction (Dagréou, Moreau,
Vaiter and Ablin, "A lower bound and a near-optimal algorithm for bilevel empirical risk
minimization", AISTATS 2024, Algorithm 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import HypergradTypeError
from ..settings import count, number
from ..tree import Tensors, tree_add, tree_axpy, tree_norm, tree_scale, tree_sub
from .base import StochasticSolver, StochasticState, draw_inner, draw_outer
from .oracles import Bilevel, Linearization, gradients

_KEYS = ("srba_dz", "srba_dv", "srba_dx", "srba_z", "srba_v", "srba_x")


def _full(sampler: Any, which: str) -> Any:
    full = getattr(sampler, "full", None)
    if not callable(full):
        raise HypergradTypeError(
            f"SRBA needs a {which} sampler with full() -> the whole data set "
            "(hypergrad.stochastic.IndexSampler): it refreshes its directions on the full batch"
        )
    return full()


def _directions(
    s: StochasticState, problem: Bilevel, z: Tensors, v: Tensors, x: Tensors, inner: Any, outer: Any
) -> tuple[Tensors, Tensors, Tensors]:
    """``(D_z, D_v, D_x)`` at ``(z, v, x)`` on the batches ``inner``, ``outer`` (3 + 2 calls)."""
    lin = Linearization(problem, s.specs, z, x, inner)
    hv, cross = lin.products(v)
    fz, fx = gradients(problem.outer_loss, "outer_loss", s.specs, z, x, outer)
    s.inner_calls += 3
    s.outer_calls += 2
    return lin.grad, tree_add(hv, fz), tree_add(cross, fx)


@dataclass(kw_only=True)
class SRBA(StochasticSolver):
    """SRBA (Dagréou, Moreau, Vaiter and Ablin, AISTATS 2024, Algorithm 1): SOBA's three
    directions estimated by the recursive (SARAH/SPIDER) estimator.

    With ``D_z(z, x) = ∇_z G``, ``D_v(z, v, x) = ∇²_zz G v + ∇_z F`` and
    ``D_x(z, v, x) = ∇²_xz G v + ∇_x F`` (SOBA's directions), iteration ``t`` forms

    * if ``t ≡ 0 (mod q)``: the full-batch directions ``D^t = D(z_t, v_t, x_t)`` (every sample
      of both losses, ``IndexSampler.full``);
    * otherwise, on one inner batch ``i`` and one outer batch ``j``, the recursive corrections
      ``D^t = D^{t-1} + D_{i,j}(z_t, v_t, x_t) - D_{i,j}(z_{t-1}, v_{t-1}, x_{t-1})``, the same
      batches at the current and the previous iterate;

    then ``z_{t+1} = z_t - ρ D_z^t``, ``v_{t+1} = Π(v_t - ρ D_v^t)``, ``x_{t+1} = x_t - γ D_x^t``.
    Unlike SOBA's, the estimate is biased given the past, but its error within a period is a sum
    of terms proportional to the iterates' moves, so it vanishes as they converge: with constant
    steps SRBA converges to ``x*`` itself, without SABA's per-block tables. The paper proves
    ``O((n + m)^{1/2} ε^{-1})`` oracle calls to an ``ε``-stationary point (its abstract; optimal
    by its lower bound) for a refresh period and constant steps chosen from the problem's
    constants in its analysis; here ``q``, ``ρ`` and ``γ`` are settings and the batch size is
    the samplers'.

    Choices where the paper leaves one: ``Π`` is the identity by default (the analysis projects
    ``v`` onto a ball of radius ``C_F / μ_G`` bounding ``v*``; ``adjoint_radius`` sets such a
    ball); ``v_0 = 0``; the refresh comes first (``t = 0``), and a state without the recursion's
    memory (e.g. built by another solver) is refreshed too.

    Oracle calls: a refresh 3 inner and 2 outer on the full batch (each as costly as
    ``n / batch_size`` minibatch calls); a recursive iteration 6 inner and 4 outer on minibatches
    (two linearizations and two outer gradients on the same batches). Memory besides ``z``,
    ``v``, ``x``: the three directions and the previous iterate, ``4|z| + 2|x|``.

    Args:
        step_inner: ``ρ``, the step of ``z`` and ``v`` (below ``1/L`` of the inner Hessian).
        step_outer: ``γ``, the step of ``x``.
        period: ``q``, iterations between full-batch refreshes (1: full-batch SOBA).
        adjoint_radius: radius of the ball ``v`` is projected onto (None: no projection).

    Example:
        >>> SRBA(step_inner=0.5, step_outer=0.1, period=8).period
        8
    """

    name: ClassVar[str] = "srba"
    step_inner: float = number(0.1, strict=True)
    step_outer: float = number(0.01, strict=True)
    period: int = count(10, minimum=1, allow_none=False)
    adjoint_radius: float | None = number(None, strict=True, allow_none=True)

    def _project(self, v: Tensors) -> Tensors:
        if self.adjoint_radius is None:
            return v
        norm = float(tree_norm(v))
        return v if norm <= self.adjoint_radius else tree_scale(self.adjoint_radius / norm, v)

    def directions(
        self, state: StochasticState, problem: Bilevel
    ) -> tuple[Tensors, Tensors, Tensors]:
        """The recursive ``(D_z, D_v, D_x)`` at ``state`` (which must be a copy owned by the
        caller: it draws batches, counts the calls and stores the directions and iterate)."""
        s, mem = state, state.memory
        if s.iteration % self.period == 0 or any(k not in mem for k in _KEYS):
            d = _directions(
                s,
                problem,
                s.z,
                s.v,
                s.x,
                _full(problem.inner_sampler, "inner"),
                _full(problem.outer_sampler, "outer"),
            )
        else:
            bi, bo = draw_inner(problem, s), draw_outer(problem, s)
            new = _directions(s, problem, s.z, s.v, s.x, bi, bo)
            old = _directions(s, problem, mem["srba_z"], mem["srba_v"], mem["srba_x"], bi, bo)
            prev = (mem["srba_dz"], mem["srba_dv"], mem["srba_dx"])
            d = (
                tree_add(prev[0], tree_sub(new[0], old[0])),
                tree_add(prev[1], tree_sub(new[1], old[1])),
                tree_add(prev[2], tree_sub(new[2], old[2])),
            )
        mem["srba_dz"], mem["srba_dv"], mem["srba_dx"] = d
        mem["srba_z"], mem["srba_v"], mem["srba_x"] = s.z, s.v, s.x
        return d

    def step(self, state: StochasticState, problem: Bilevel) -> StochasticState:
        s = state.copy()
        dz, dv, dx = self.directions(s, problem)
        with torch.no_grad():
            s.z = tree_axpy(-self.step_inner, dz, s.z)
            s.v = self._project(tree_axpy(-self.step_inner, dv, s.v))
            s.x = tree_axpy(-self.step_outer, dx, s.x)
        s.iteration += 1
        return s
