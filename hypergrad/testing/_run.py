"""The comparison every check runs: directions, re-solved points, rows, and the report."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import HypergradError
from ..tree import Tensors
from ._directions import check_directions, draw_directions
from ._report import HypergradCheckReport, HypergradCheckRow
from ._settings import INNER_BUDGET, CheckSettings, dot, norm
from ._verdict import PROCEDURE, Outcome, write_reason


@dataclass
class Point:
    """One re-solved point: total outer loss, inner loss and inner gradient there."""

    outer: float
    inner: float
    grad: Tensors
    dtype: torch.dtype = torch.float64


@dataclass
class Problem:
    """What a front end (pytrees, a HyperStep, a procedure) builds for :func:`run_check`.

    Attributes:
        theta: the hyperparameters to check at, one tensor per leaf.
        names: their labels (``hparams['lam']``, ``hyper.log_lam``).
        evaluate: ``theta -> Point``: re-solves (re-runs) the inner problem there.
        center: the point at ``theta`` itself.
        grad: the hypergradient to check, one tensor per leaf of ``theta``.
        adjoint: ``H^{-1} dL_out/dpsi`` at ``theta``, or None (the fallback inner criterion).
        direct: ``dL_out/dtheta`` at ``theta`` (for the hints), or None.
        flatten_given: ``(direction, k) -> leaves``, for directions given by the user.
        param_dtypes: dtypes of the inner parameters (their rounding bounds the precision).
        source: ``"solve_inner"``, ``"retrain"`` or ``"procedure"`` (no stationarity check).
        implicit: the implicit hypergradient at ``theta`` (when computed), which tells the
            derivative of an unrolled procedure from a correct gradient and an inexact solve.
    """

    theta: list[torch.Tensor]
    names: list[str]
    evaluate: Callable[[list[torch.Tensor]], Point]
    center: Point
    grad: list[torch.Tensor]
    adjoint: Tensors | None
    direct: Tensors | None
    flatten_given: Callable[[Any, int], list[torch.Tensor]]
    param_dtypes: list[torch.dtype]
    source: str
    implicit: Tensors | None = None


class _InnerCriterion:
    """How the inner solves are judged: ``inner_tol``, the adjoint's first-order effect on the
    outer loss, a fallback bound on the gradient, or (a procedure) not at all."""

    def __init__(self, problem: Problem, settings: CheckSettings):
        self.adjoint, self.tol = problem.adjoint, settings.inner_tol
        self.procedure = problem.source == PROCEDURE
        self.bound = math.sqrt(torch.finfo(problem.theta[0].dtype).eps)
        if self.procedure:
            self.text = "none: an unrolled procedure is not a solve, so no stationarity check"
        elif self.tol is not None:
            self.text = f"each ||dL_in/dpsi|| must be <= inner_tol = {self.tol:.1e}"
        elif self.adjoint is not None:
            self.text = f"inner err <= {INNER_BUDGET:g} x (atol + rtol * max(|fd|, |analytic|))"
        else:
            self.text = (
                "no adjoint available: each ||dL_in/dpsi|| must be <= sqrt(machine eps) x "
                "max(1, |L_in|)"
            )

    def effect(self, p: Point) -> float:
        """``|<x, g>|``: how far the outer loss at ``p`` is from that at the exact solution."""
        if self.adjoint is None or self.procedure:
            return float("nan")
        return abs(dot(self.adjoint, p.grad))

    def grad_norm(self, p: Point) -> float:
        return float("nan") if self.procedure else norm(p.grad)

    def _fallback_ok(self, p: Point) -> bool:
        return norm(p.grad) <= self.bound * max(1.0, abs(p.inner))

    def pair_ok(self, pp: Point, pm: Point, inner_err: float, tol: float) -> bool:
        """The two solves of one direction are accurate enough for its comparison."""
        if self.procedure:
            return True
        if self.tol is not None:
            return max(norm(pp.grad), norm(pm.grad)) <= self.tol
        if self.adjoint is not None:
            return inner_err <= INNER_BUDGET * tol
        return self._fallback_ok(pp) and self._fallback_ok(pm)

    def center_ok(self, center: Point, eps: float, rows: list[HypergradCheckRow]) -> bool:
        if self.procedure:
            return True
        if self.tol is not None:
            return norm(center.grad) <= self.tol
        if self.adjoint is not None:
            # the solve at theta is held to the standard of one side of the tightest difference
            return self.effect(center) / eps <= INNER_BUDGET * min(r.tol for r in rows)
        return self._fallback_ok(center)


def _compare(
    problem: Problem,
    settings: CheckSettings,
    inner: _InnerCriterion,
    label: str,
    d: list[torch.Tensor],
) -> tuple[HypergradCheckRow, float]:
    """One direction's row, and the loss's rounding in its difference."""
    eps = settings.eps
    plus = [t + eps * v for t, v in zip(problem.theta, d)]
    minus = [t - eps * v for t, v in zip(problem.theta, d)]
    pp, pm = problem.evaluate(plus), problem.evaluate(minus)
    # the step actually taken (rounding of theta +- eps d), so the comparison is exact in it
    d_eff = [(a.double() - b.double()) / (2 * eps) for a, b in zip(plus, minus)]
    fd = (pp.outer - pm.outer) / (2 * eps)
    rounding = (abs(pp.outer) + abs(pm.outer)) / (2 * eps)
    an = dot(problem.grad, d_eff)
    scale = max(abs(fd), abs(an))
    abs_err = abs(fd - an)
    rel_err = abs_err / scale if scale > 0 else (0.0 if abs_err == 0 else float("inf"))
    tol = settings.atol + settings.rtol * scale
    ok = math.isfinite(fd) and math.isfinite(an) and abs_err <= tol
    inner_err = (inner.effect(pp) + inner.effect(pm)) / (2 * eps)
    gmax = max(inner.grad_norm(pp), inner.grad_norm(pm))
    iok = inner.pair_ok(pp, pm, inner_err, tol)
    row = HypergradCheckRow(label, fd, an, abs_err, rel_err, tol, inner_err, gmax, ok, iok)
    return row, rounding


def run_check(*, problem: Problem, settings: CheckSettings) -> HypergradCheckReport:
    """Difference ``problem`` along the directions of ``settings`` and judge the result."""
    kind, dirs = draw_directions(
        problem.theta, problem.names, settings.directions, settings.seed, problem.flatten_given
    )
    check_directions(problem.theta, dirs, settings.eps)
    inner = _InnerCriterion(problem, settings)
    compared = [_compare(problem, settings, inner, label, d) for label, d in dirs]
    rows = [row for row, _ in compared]
    # the least precise of hparams, params and the loss sets the rounding of the differences
    low = max(
        [torch.finfo(t.dtype).eps for t in problem.theta]
        + [torch.finfo(dt).eps for dt in problem.param_dtypes if dt.is_floating_point]
        + [torch.finfo(problem.center.dtype).eps]
    )
    center_ok = inner.center_ok(problem.center, settings.eps, rows)
    implicit = problem.implicit
    disagrees = (
        None
        if implicit is None
        else any(abs(dot(implicit, d) - r.analytic) > r.tol for r, (_, d) in zip(rows, dirs))
    )
    outcome = Outcome(
        rows=rows,
        atol=settings.atol,
        source=problem.source,
        inner_ok=center_ok and all(r.inner_ok for r in rows),
        center_ok=center_ok,
        center_grad_norm=inner.grad_norm(problem.center),
        has_adjoint=problem.adjoint is not None and not inner.procedure,
        low=low,
        rounding=low * max((r for _, r in compared), default=0.0),
        implicit_disagrees=disagrees,
    )
    return _report(outcome, settings, kind, inner.text, [d for _, d in dirs], problem)


def _report(
    o: Outcome,
    settings: CheckSettings,
    kind: str,
    criterion: str,
    dirs: list[list[torch.Tensor]],
    problem: Problem,
) -> HypergradCheckReport:
    return HypergradCheckReport(
        passed=bool(o.inner_ok and o.grad_ok and not o.inconclusive),
        inner_ok=bool(o.inner_ok),
        rows=o.rows,
        max_abs_err=max((r.abs_err for r in o.rows), default=0.0),
        max_rel_err=max((r.rel_err for r in o.rows), default=0.0),
        reason=write_reason(o, dirs, problem.direct),
        eps=float(settings.eps),
        rtol=float(settings.rtol),
        atol=float(settings.atol),
        directions=kind,
        inner_criterion=criterion,
        center_inner_grad_norm=o.center_grad_norm,
        center_inner_ok=bool(o.center_ok),
        dtype=str(problem.theta[0].dtype).replace("torch.", ""),
        precision_limited=bool(o.precision_limited and o.inner_ok and not o.grad_ok),
        inconclusive=bool(o.inconclusive),
        blind=[r.direction for r in o.blind],
        procedure=o.source == PROCEDURE,
        looks_unrolled=bool(o.looks_unrolled),
    )


def quietly(compute: Callable[[], tuple[Tensors, ...]]) -> tuple[Tensors, ...] | None:
    """``compute()`` (an adjoint ``H^{-1} dL_out/dpsi`` for the inner criterion, and so on) with
    warnings silenced, or None when it raises or returns a tensor that is not finite."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = compute()
    except (HypergradError, RuntimeError):
        return None
    return out if all(bool(torch.isfinite(t).all()) for x in out for t in x) else None
