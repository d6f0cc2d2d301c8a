"""Single-loop solvers: the inner variable ``z``, the adjoint ``v`` and ``x`` move together,
one step each per iteration (Dagréou, Ablin, Vaiter and Moreau, "A framework for bilevel
optimization that enables stochastic and global variance reduction algorithms", NeurIPS 2022).

Each iteration draws one inner batch ``i`` and one outer batch ``j`` and forms the three
directions at the current ``(z, v, x)``:

* ``D_z = ∇_z G_i(z, x)``;
* ``D_v = ∇²_zz G_i(z, x) v + ∇_z F_j(z, x)``;
* ``D_x = ∇²_xz G_i(z, x) v + ∇_x F_j(z, x)``;

then ``z -= ρ D_z``, ``v -= ρ D_v``, ``x -= γ D_x`` (3 inner oracle calls, the gradient and
both products from one linearization, and 2 outer ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import HypergradTypeError
from ..settings import flag, number
from ..tree import Tensors, tree_add, tree_axpy, tree_sub
from .base import StochasticSolver, StochasticState, draw_inner, draw_outer
from .oracles import Bilevel, Linearization, gradients


def _update(
    s: StochasticState, rho: float, gamma: float, d: tuple[Tensors, Tensors, Tensors]
) -> None:
    dz, dv, dx = d
    with torch.no_grad():
        s.z = tree_axpy(-rho, dz, s.z)
        s.v = tree_axpy(-rho, dv, s.v)
        s.x = tree_axpy(-gamma, dx, s.x)
    s.inner_calls += 3
    s.outer_calls += 2
    s.iteration += 1


@dataclass(kw_only=True)
class SOBA(StochasticSolver):
    """SOBA (Dagréou et al., NeurIPS 2022, Algorithm 1): the single-loop stochastic solver.

    Per iteration: one inner batch (``∇_z G``, ``∇²_zz G v``, ``∇²_xz G v`` from one
    linearization: 3 inner oracle calls) and one outer batch (``∇_z F``, ``∇_x F``: 2), then
    ``z -= ρ_k D_z``, ``v -= ρ_k D_v``, ``x -= γ_k D_x`` (module docstring). Memory: ``z``,
    ``v``, ``x``.

    Step sizes (the paper's rules): constant ``ρ``, ``γ`` (Theorem 2's regime, ``γ = O(ρ)``;
    the iterates then reach an ``O(ρ)`` noise floor), or with ``decay=True`` the decreasing
    steps of its Theorem 1, ``ρ_k = ρ (k+1)^{-2/5}``, ``γ_k = γ (k+1)^{-3/5}``.

    Args:
        step_inner: ``ρ``, the step of ``z`` and ``v`` (below ``1/L`` of the inner Hessian).
        step_outer: ``γ``, the step of ``x``.
        decay: the decreasing steps of Theorem 1.

    Example:
        >>> SOBA(step_inner=0.5, step_outer=0.05).rates(3)
        (0.5, 0.05)
    """

    name: ClassVar[str] = "soba"
    step_inner: float = number(0.1, strict=True)
    step_outer: float = number(0.01, strict=True)
    decay: bool = flag(False)

    def rates(self, k: int) -> tuple[float, float]:
        """``(ρ_k, γ_k)`` at iteration ``k`` (0-based)."""
        if not self.decay:
            return self.step_inner, self.step_outer
        return self.step_inner * (k + 1) ** -0.4, self.step_outer * (k + 1) ** -0.6

    def directions(
        self, state: StochasticState, problem: Bilevel, inner: Any, outer: Any
    ) -> tuple[Tensors, Tensors, Tensors]:
        """``(D_z, D_v, D_x)`` at ``state`` on the inner batch ``inner`` and outer ``outer``."""
        lin = Linearization(problem, state.specs, state.z, state.x, inner)
        hv, cross = lin.products(state.v)
        fz, fx = gradients(problem.outer_loss, "outer_loss", state.specs, state.z, state.x, outer)
        return lin.grad, tree_add(hv, fz), tree_add(cross, fx)

    def step(self, state: StochasticState, problem: Bilevel) -> StochasticState:
        s = state.copy()
        rho, gamma = self.rates(s.iteration)
        d = self.directions(s, problem, draw_inner(problem, s), draw_outer(problem, s))
        _update(s, rho, gamma, d)
        return s


def _blocks(sampler: Any, which: str) -> int:
    n = getattr(sampler, "num_blocks", None)
    if not isinstance(n, int) or not callable(getattr(sampler, "block", None)):
        raise HypergradTypeError(
            f"SABA needs a {which} sampler with num_blocks and block(k) -> (b, batch) "
            "(hypergrad.stochastic.IndexSampler): its memory is one entry per block"
        )
    return n


class _Saga:
    """SAGA's estimator of a mean over blocks, in a state's memory: ``new - mem[b] + mean``."""

    def __init__(self, s: StochasticState, key: str, like: Tensors, blocks: int):
        self.s, self.key = s, key
        if key not in s.memory:
            s.memory[key] = tuple(t.new_zeros((blocks, *t.shape)) for t in like)
            s.memory[key + "_mean"] = tuple(torch.zeros_like(t) for t in like)

    def __call__(self, b: int, new: Tensors) -> Tensors:
        mem, mean = self.s.memory[self.key], self.s.memory[self.key + "_mean"]
        old = tuple(m[b] for m in mem)
        out = tree_add(tree_sub(new, old), mean)
        n = mem[0].shape[0]
        with torch.no_grad():
            self.s.memory[self.key + "_mean"] = tree_axpy(1.0 / n, tree_sub(new, old), mean)
            table = tuple(m.clone() for m in mem)
            for m, t in zip(table, new, strict=True):
                m[b] = t
            self.s.memory[self.key] = table
        return out


@dataclass(kw_only=True)
class SABA(StochasticSolver):
    """SABA (Dagréou et al., NeurIPS 2022, Algorithm 2): SOBA with SAGA variance reduction of
    each of the five oracle quantities (``∇_z G``, ``∇²_zz G v``, ``∇²_xz G v`` per inner
    block; ``∇_z F``, ``∇_x F`` per outer block).

    The samplers must be block samplers (:meth:`IndexSampler.block
    <hypergrad.stochastic.IndexSampler.block>`): each iteration draws one block ``b`` uniformly,
    and each quantity is estimated by ``q_b(new) - q_b(memory) + mean(memory)``, unbiased
    whatever the memory holds; the memory starts at zero. Per iteration 3 inner and 2 outer
    oracle calls, like SOBA; memory ``n_inner_blocks·(2|z| + |x|) + n_outer_blocks·(|z| + |x|)``
    besides ``z``, ``v``, ``x``. With constant steps the estimator's variance vanishes as the
    iterates converge (Theorem 2: linear convergence under a PL outer objective), so SABA
    converges to ``x*`` itself where SOBA stops at a noise floor.

    Args:
        step_inner: ``ρ``, the step of ``z`` and ``v``.
        step_outer: ``γ``, the step of ``x``.
    """

    name: ClassVar[str] = "saba"
    step_inner: float = number(0.1, strict=True)
    step_outer: float = number(0.01, strict=True)

    def directions(
        self, state: StochasticState, problem: Bilevel
    ) -> tuple[Tensors, Tensors, Tensors]:
        """The variance-reduced ``(D_z, D_v, D_x)``; draws two blocks and updates the memory of
        ``state`` (which must be a copy owned by the caller)."""
        ni = _blocks(problem.inner_sampler, "inner")
        no = _blocks(problem.outer_sampler, "outer")
        bi, inner = problem.inner_sampler.block(state.inner_draws)  # type: ignore[attr-defined]
        bo, outer = problem.outer_sampler.block(state.outer_draws)  # type: ignore[attr-defined]
        state.inner_draws += 1
        state.outer_draws += 1
        lin = Linearization(problem, state.specs, state.z, state.x, inner)
        hv, cross = lin.products(state.v)
        fz, fx = gradients(problem.outer_loss, "outer_loss", state.specs, state.z, state.x, outer)
        dz = _Saga(state, "grad_inner", lin.grad, ni)(bi, lin.grad)
        hv = _Saga(state, "hvp", hv, ni)(bi, hv)
        cross = _Saga(state, "cross", cross, ni)(bi, cross)
        fz = _Saga(state, "grad_outer_z", fz, no)(bo, fz)
        fx = _Saga(state, "grad_outer_x", fx, no)(bo, fx)
        return dz, tree_add(hv, fz), tree_add(cross, fx)

    def step(self, state: StochasticState, problem: Bilevel) -> StochasticState:
        s = state.copy()
        d = self.directions(s, problem)
        _update(s, self.step_inner, self.step_outer, d)
        return s
