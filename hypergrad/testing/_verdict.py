"""The verdict prose of a check: what failed, where, and what to do next."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..tree import Tensors
from ._report import HypergradCheckRow
from ._settings import dot, norm

#: What re-computes the inner solution at each point, by front end.
SOLVE, RETRAIN, PROCEDURE = "solve_inner", "retrain", "procedure"


@dataclass
class Outcome:
    """The numbers a verdict is written from."""

    rows: list[HypergradCheckRow]
    atol: float
    source: str  # SOLVE, RETRAIN or PROCEDURE
    inner_ok: bool
    center_ok: bool
    center_grad_norm: float
    has_adjoint: bool
    low: float  # the largest machine epsilon of hparams, params and the loss
    rounding: float  # how far rounding alone can move the differences
    # whether grad differs from the implicit hypergradient at theta (None: not computed)
    implicit_disagrees: bool | None = None

    @property
    def failed(self) -> list[str]:
        return [r.direction for r in self.rows if not r.passed]

    @property
    def grad_ok(self) -> bool:
        return all(r.passed for r in self.rows)

    @property
    def blind(self) -> list[HypergradCheckRow]:
        """Directions where a zero (or any other value below atol) would have matched too."""
        return [r for r in self.rows if max(abs(r.fd), abs(r.analytic)) <= self.atol]

    @property
    def inconclusive(self) -> bool:
        return self.inner_ok and self.grad_ok and len(self.blind) == len(self.rows)

    @property
    def worst_inner(self) -> float:
        """The largest estimated effect of the inner solves, in units of the tolerance."""
        return max((r.inner_err / r.tol for r in self.rows if r.tol > 0), default=float("nan"))

    @property
    def looks_unrolled(self) -> bool:
        """Solves not stationary, yet every informative direction matches: ``grad`` is the
        derivative of ``solve_inner`` as it is (an unrolled procedure), which a correct
        gradient checked through inexact solves matches only when the solves are nearly good
        enough (their effect below 10 x the tolerance) and ``grad`` is the implicit one."""
        far = not self.has_adjoint or not self.worst_inner < 10.0
        return (
            self.source == SOLVE
            and not self.inner_ok
            and (far or bool(self.implicit_disagrees))
            and self.grad_ok
            and len(self.blind) < len(self.rows)
        )

    @property
    def precision_limited(self) -> bool:
        f64 = torch.finfo(torch.float64).eps
        max_abs = max((r.abs_err for r in self.rows), default=0.0)
        return self.low > f64 and max_abs <= self.rounding


def _plural(n: int) -> str:
    return "all " + str(n) + " directions" if n != 1 else "the direction"


def _reason_inconclusive(o: Outcome) -> str:
    fd_max = max(abs(r.fd) for r in o.rows)
    an_max = max(abs(r.analytic) for r in o.rows)
    size = (
        "the finite differences are exactly zero (the outer loss does not move at this eps)"
        if fd_max == 0
        else f"lower atol below the hypergradient's size (e.g. atol={fd_max / 100:.0e}) or "
        "rescale the outer loss"
    )
    solves = "" if o.source == PROCEDURE else " The inner solves are converged."
    return (
        f"the hypergradient is below atol in every direction: max |finite diff| = "
        f"{fd_max:.2e} and max |analytic| = {an_max:.2e}, both <= atol = {o.atol:.0e}, so a "
        f"zero (or any other) hypergradient this small would match too and the check cannot "
        f"tell whether it is right; {size}.{solves}"
    )


def _reason_passed(o: Outcome) -> str:
    blind = o.blind
    seen = [r for r in o.rows if max(abs(r.fd), abs(r.analytic)) > o.atol]
    rel = max((r.rel_err for r in seen), default=0.0)
    below = (
        f" over the {len(seen)} directions above atol; in {len(blind)} "
        f"({', '.join(r.direction for r in blind[:4])}"
        f"{', ...' if len(blind) > 4 else ''}) both values are below atol = {o.atol:.0e} "
        "and were not told apart from zero"
        if blind
        else ""
    )
    if o.source == PROCEDURE:
        return (
            f"the hypergradient matches central differences of the re-run procedure in "
            f"{_plural(len(o.rows))} (max rel err {rel:.1e}{below})."
        )
    return (
        f"the hypergradient matches central differences in {_plural(len(o.rows))} (max rel err "
        f"{rel:.1e}{below}) and every inner solve is stationary enough."
    )


def _not_converged(o: Outcome) -> tuple[list[str], float]:
    bad = (["theta"] if not o.center_ok else []) + [
        f"theta +- eps*{r.direction}" for r in o.rows if not r.inner_ok
    ]
    gmax = max([o.center_grad_norm] + [r.inner_grad_norm for r in o.rows])
    return bad, gmax


def _reason_not_a_solve(o: Outcome) -> str:
    bad, gmax = _not_converged(o)
    rel = max(r.rel_err for r in o.rows if max(abs(r.fd), abs(r.analytic)) > o.atol)
    unlike = (
        ", and differs from the implicit hypergradient at solve_inner(hparams)"
        if o.implicit_disagrees
        else ""
    )
    also = (
        " (grad is also the implicit hypergradient at solve_inner(hparams), to the tolerance: "
        "if solve_inner is meant to solve the inner problem, solve it more accurately instead)"
        if o.implicit_disagrees is False
        else ""
    )
    return (
        f"solve_inner does not reach a stationary point of inner_loss: ||dL_in/dpsi|| reaches "
        f"{gmax:.2e} (at {', '.join(bad[:2])}{', ...' if len(bad) > 2 else ''}). Yet grad "
        f"matches the central differences of solve_inner as it is in {_plural(len(o.rows))} "
        f"(max rel err {rel:.1e}){unlike}: grad looks like the derivative of an "
        "unrolled procedure (optimizer steps differentiated through, as hg.unrolled_grad "
        "does). check_hypergrad needs stationary solves; check an unrolled hypergradient with "
        "hypergrad.testing.check_unrolled(solve_inner, outer_loss, hparams, grad), which re-runs "
        f"the procedure and skips the stationarity check{also}."
    )


def _reason_inner(o: Outcome) -> str:
    bad, gmax = _not_converged(o)
    worst = o.worst_inner
    effect = (
        f" their estimated effect on the finite differences reaches {worst:.1e} x the "
        "tolerance, so the comparison cannot judge the hypergradient."
        if o.has_adjoint and math.isfinite(worst)
        else ""
    )
    n, failed = len(o.rows), o.failed
    also = (
        f" {len(failed)} of {n} directions also disagree, which may come from the inexact "
        "solves alone."
        if failed
        else ""
    )
    unrolled = (
        " (An unrolled procedure, a fixed number of optimizer steps differentiated through, is "
        "checked by hypergrad.testing.check_unrolled.)"
        if o.source == SOLVE
        else ""
    )
    return (
        f"the inner solve is not converged at {', '.join(bad[:4])}"
        f"{' and ' + str(len(bad) - 4) + ' more' if len(bad) > 4 else ''}: "
        f"||dL_in/dpsi|| reaches {gmax:.2e};{effect}{also} Solve the inner problem more "
        "accurately (tighter tolerance, more iterations) or raise eps; this is not a verdict "
        f"on the hypergradient.{unrolled}"
    )


def _reason_hypergradient(
    o: Outcome, dirs: list[list[torch.Tensor]], direct: Tensors | None
) -> str:
    failed, n = o.failed, len(o.rows)
    max_abs = max((r.abs_err for r in o.rows), default=0.0)
    max_rel = max((r.rel_err for r in o.rows), default=0.0)
    reason = (
        f"the hypergradient disagrees with central differences in {len(failed)} of {n} "
        f"directions ({', '.join(failed[:6])}{', ...' if len(failed) > 6 else ''}); "
        f"max abs err {max_abs:.2e}, max rel err {max_rel:.2e}; "
        + (
            "the procedure is re-run as it is"
            if o.source == PROCEDURE
            else "the inner solves are converged"
        )
    )
    if o.precision_limited:
        return reason + (
            f", but the computation is not float64 and rounding alone moves the differences "
            f"by up to ~{o.rounding:.1e}: errors of this size are no verdict on the "
            "hypergradient; check a float64 copy of the problem."
        )
    reason += ", so the hypergradient itself is wrong." + _hints(o, dirs, direct)
    if o.low > torch.finfo(torch.float64).eps:
        reason += (
            f" (The computation is not float64: rounding alone moves the differences by "
            f"up to ~{o.rounding:.1e}.)"
        )
    return reason


def write_reason(o: Outcome, dirs: list[list[torch.Tensor]], direct: Tensors | None) -> str:
    """The verdict paragraph, for the first of: inconclusive, passed, not an inner solve,
    inner solves not converged, wrong (or imprecise) hypergradient."""
    if o.inconclusive:
        return _reason_inconclusive(o)
    if o.inner_ok and o.grad_ok:
        return _reason_passed(o)
    if o.looks_unrolled:
        return _reason_not_a_solve(o)
    if not o.inner_ok:
        return _reason_inner(o)
    return _reason_hypergradient(o, dirs, direct)


def _hints(o: Outcome, dirs: list[list[torch.Tensor]], direct: Tensors | None) -> str:
    """Patterns in the failing rows that point at a known mistake."""
    bad = [(r, d) for r, d in zip(o.rows, dirs) if not r.passed]
    if not bad or not all(math.isfinite(r.fd) and math.isfinite(r.analytic) for r, _ in bad):
        return ""
    if all(abs(r.fd + r.analytic) <= r.tol for r, _ in bad):
        return (
            " The analytic values are the finite differences with the opposite sign: a sign flip "
            "(hypergrad returns the gradient of the outer loss, to be minimised)."
        )
    if direct is not None and norm(direct) > 0:
        plus = [abs(r.fd - (r.analytic + dot(direct, d))) <= r.tol for r, d in bad]
        minus = [abs(r.fd - (r.analytic - dot(direct, d))) <= r.tol for r, d in bad]
        if all(plus):
            return (
                " Adding the direct term dL_out/dtheta (the outer loss's explicit dependence on "
                "theta) makes them match: the hypergradient misses the direct term."
            )
        if all(minus):
            return (
                " Subtracting the direct term dL_out/dtheta makes them match: the hypergradient "
                "counts the direct term twice."
            )
    return _ratio_hint([r for r, _ in bad], o.source)


def _ratio_hint(bad: list[HypergradCheckRow], source: str) -> str:
    ratios = [r.analytic / r.fd for r in bad if r.fd != 0]
    if not ratios:
        return ""
    span = f"[{min(ratios):.4g}, {max(ratios):.4g}]"
    if source == PROCEDURE:
        return (
            f" analytic / finite difference ranges over {span} in the failing directions: "
            "does grad differentiate through every step of this very procedure (truncate < "
            "steps differentiates only the last ones), with the same optimizer settings, start "
            "and number of steps, and no path cut by .detach() (or .item(), .numpy())?"
        )
    if 0 < min(ratios) and max(ratios) < 1:
        return (
            f" The analytic values are smaller in magnitude in every failing direction "
            f"(analytic / finite difference in {span}): a "
            "damped or truncated adjoint solve (solver damping, too few iterations), or a "
            "path from the parameters cut by .detach() inside the inner loss?"
        )
    return (
        f" analytic / finite difference ranges over {span} "
        "in the failing directions. With converged inner solves, look for a path from the "
        "parameters or hyperparameters cut by .detach() (or .item(), .numpy()) inside a loss."
    )
