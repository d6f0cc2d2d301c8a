"""The single-loop meta step of :class:`~hypergrad.HyperStep` (``method=hg.SingleLoop(step=ρ)``):
the adjoint ``v ≈ H⁻¹ ∇_ψ L_out`` is a state kept across outer steps and advanced by one
product per step, as SOBA does (Dagréou, Ablin, Vaiter and Moreau, NeurIPS 2022):

    hypergradient_t = ∇_θ L_out − M v_t,        v_{t+1} = v_t + ρ (∇_ψ L_out − H v_t)

with ``H = ∇²_ψψ L_in`` and ``M = ∇²_θψ L_in`` at the current ψ. ``H v_t`` and ``M v_t`` come from
one backward pass through the inner gradient's graph
(:meth:`~hypergrad.operators.InnerOperator.hvp_and_mixed`). The first step starts from
``v_0 = ρ ∇_ψ L_out`` (the Richardson iterate from zero, which needs no product), so its result
is :class:`~hypergrad.FirstOrder`'s with ``alpha=ρ`` (computed by exact products). The
recursion contracts when ``ρ < 2 / λ_max(H)`` and ``H`` is positive definite; on a fixed
problem ``v_t → H⁻¹ ∇_ψ L_out`` at the rate ``max |1 − ρ λ|`` over H's spectrum, so the bias of
the implicit hypergradient decays over outer steps instead of being paid at every step.

Cost per meta step: the outer loss's forward and backward, the inner loss's forward and
``create_graph`` backward, and one backward through that graph.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import HypergradError
from .operators import InnerOperator, check_scalar_loss
from .report import Reduce
from .tree import Tensors, tree_norm

FlatLoss = Callable[[Tensors, Tensors], torch.Tensor]


@dataclass
class SingleLoopInfo:
    """Diagnostics of one single-loop meta step.

    Attributes:
        step: outer steps taken with the kept adjoint (1 at the first call or after a reset).
        adjoint_residual: ``||∇_ψ L_out − H v_t|| / ||∇_ψ L_out||``, the relative residual of
            the kept adjoint before its update (1 at ``v = 0``; NaN when the gradient is zero).
        failure: None, or why the result is not a hypergradient (the names of
            :attr:`SolveInfo.failure <hypergrad.SolveInfo.failure>`): ``"residual above 1"``
            (the kept adjoint is a worse answer than 0: the step size is too large for this
            Hessian, or the problem moved far) or ``"non-finite residual"``;
            :class:`~hypergrad.HyperStep` then warns, applies ``on_diverged`` and drops the
            state (the next step restarts from ``step · ∇_ψ L_out``).
        outer_loss, inner_loss: the losses at ψ.
        outer_grad_norm, direct_norm, indirect_norm, hypergrad_norm: as in
            :class:`~hypergrad.HypergradInfo`.
        time_s: wall time.
        clipped, skipped, skip_reason: as in :class:`~hypergrad.HypergradInfo`.
    """

    step: int = 0
    adjoint_residual: float = float("nan")
    failure: str | None = None
    outer_loss: float = float("nan")
    inner_loss: float = float("nan")
    outer_grad_norm: float = float("nan")
    direct_norm: float = float("nan")
    indirect_norm: float = float("nan")
    hypergrad_norm: float = float("nan")
    time_s: float = 0.0
    clipped: bool = False
    skipped: bool = False
    skip_reason: str | None = None


def single_loop_step(
    inner: FlatLoss,
    outer: FlatLoss,
    psi: Tensors,
    theta: Tensors,
    v: Tensors | None,
    step: float,
    *,
    engine: str = "reuse",
    reduce: Reduce | None = None,
    psi_names: list[str] | None = None,
) -> tuple[Tensors, Tensors, SingleLoopInfo]:
    """One single-loop step (module docstring): ``(hypergradient, v_{t+1}, info)``.

    ``v`` None starts from ``ρ ∇_ψ L_out``. ``reduce`` (a distributed run's all-reduce) is
    applied once to ``(∇_ψ L_out, H v)`` (twice parameter-sized, one collective) and once to the
    result (hyper-sized); at the first step once more to ``∇_ψ L_out``, to build the same
    ``v_0`` on every process.

    Raises:
        HypergradError: hyperparameters that reach neither the inner gradient nor the outer loss.
    """
    t0 = time.perf_counter()
    info = SingleLoopInfo()
    with torch.enable_grad():  # the outer loss first: its random draws come first
        lo = check_scalar_loss(outer(psi, theta), "outer_loss")
        grads = torch.autograd.grad(lo, psi + theta, allow_unused=True)
    g = tuple(torch.zeros_like(p) if d is None else d.detach() for d, p in zip(grads, psi))
    direct = [None if d is None else d.detach() for d in grads[len(psi) :]]
    if v is None:
        v = tuple(step * x for x in (g if reduce is None else reduce(g)))
    op = InnerOperator(inner, psi, theta, engine=engine, psi_names=psi_names)
    hv, mv = op.hvp_and_mixed(v)
    unused = [i for i, (m, d) in enumerate(zip(mv, direct)) if m is None and d is None]
    if unused:
        raise HypergradError(
            f"hyper tensors {unused} influence neither the inner gradient nor the outer loss: "
            "the hypergradient would be silently zero"
        )
    if reduce is not None:  # the global g and H v, in one collective
        both = reduce(g + hv)
        g, hv = both[: len(psi)], both[len(psi) :]
    residual = tuple(gi - h for gi, h in zip(g, hv))
    hyper = tuple(
        (torch.zeros_like(t) if d is None else d) - (torch.zeros_like(t) if m is None else m)
        for d, m, t in zip(direct, mv, theta)
    )
    if reduce is not None:
        hyper = reduce(hyper)
    new_v = tuple(x + step * r for x, r in zip(v, residual))
    g_norm = float(tree_norm(g))
    r_norm = float(tree_norm(residual))
    info.adjoint_residual = r_norm / g_norm if g_norm > 0 else float("nan")
    if not math.isfinite(r_norm):
        info.failure = "non-finite residual"
    elif info.adjoint_residual > 1:
        info.failure = "residual above 1"
    info.outer_loss, info.inner_loss = float(lo.detach()), op.loss_value
    info.outer_grad_norm = g_norm
    info.direct_norm = float(
        tree_norm(tuple(torch.zeros_like(t) if d is None else d for d, t in zip(direct, theta)))
    )
    info.indirect_norm = float(
        tree_norm(tuple(torch.zeros_like(t) if m is None else m for m, t in zip(mv, theta)))
    )
    info.hypergrad_norm = float(tree_norm(hyper))
    info.time_s = time.perf_counter() - t0
    return hyper, new_v, info
