"""The report of a check: one row per direction, the verdict, and the printed table."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field


@dataclass
class HypergradCheckRow:
    """One direction of a hypergradient check.

    Attributes:
        direction: label, e.g. ``"hparams['lam'][2]"`` (a coordinate) or ``"random #0"``.
        fd: central finite difference of the total outer loss along the direction.
        analytic: ``<grad, d>``, the checked hypergradient along the direction.
        abs_err: ``|fd - analytic|``.
        rel_err: ``abs_err / max(|fd|, |analytic|)`` (0 when both are 0).
        tol: the allowed error, ``atol + rtol * max(|fd|, |analytic|)``.
        inner_err: first-order estimate of how much the inexact inner solves at
            ``theta +- eps d`` move ``fd``: ``(|<x, g+>| + |<x, g->|) / (2 eps)`` with ``x`` the
            adjoint and ``g+-`` the inner gradients (NaN when no adjoint was available, and in
            :func:`check_unrolled`, which does not judge the inner procedure).
        inner_grad_norm: the larger ``||dL_in/dpsi||`` of the two solves (NaN in
            :func:`check_unrolled`).
        passed: ``abs_err <= tol`` (and both values finite).
        inner_ok: the two inner solves are accurate enough for this comparison (always True in
            :func:`check_unrolled`).
    """

    direction: str
    fd: float
    analytic: float
    abs_err: float
    rel_err: float
    tol: float
    inner_err: float
    inner_grad_norm: float
    passed: bool
    inner_ok: bool


@dataclass
class HypergradCheckReport:
    """Result of :func:`check_hypergrad` / :func:`check_hyperstep` / :func:`check_unrolled`;
    ``str()`` gives the table.

    Attributes:
        passed: every direction matched, every inner solve was accurate enough, and the check
            could tell (not ``inconclusive``).
        inner_ok: every inner solve (at ``theta`` and at each ``theta +- eps d``) was accurate
            enough for the comparison; when False the finite differences cannot judge the
            hypergradient and ``passed`` is False whatever the rows say.
        rows: one :class:`HypergradCheckRow` per direction.
        max_abs_err: largest ``abs_err`` over the rows.
        max_rel_err: largest ``rel_err`` over the rows.
        reason: one-paragraph verdict (what failed, where, and what to do).
        eps: finite-difference step.
        rtol: relative tolerance.
        atol: absolute tolerance.
        directions: ``"coordinates"``, ``"random"`` or ``"given"``.
        inner_criterion: how the inner solves were judged (see ``docs/testing.md``).
        center_inner_grad_norm: ``||dL_in/dpsi||`` at ``theta`` itself.
        center_inner_ok: whether the solve at ``theta`` passed the inner criterion.
        dtype: dtype of the hyperparameters (the first leaf's).
        precision_limited: the comparison failed, but not in float64 and by no more than the
            rounding of the differences can explain: the verdict blames the precision.
        inconclusive: every direction matched, but only because both the finite difference and
            the analytic value are at most ``atol`` in every direction: any hypergradient that
            small, zero included, would have matched, so ``passed`` is False.
        blind: labels of the directions where ``|fd|`` and ``|analytic|`` are both at most
            ``atol`` (the comparison there cannot tell a wrong value from a right one).
        procedure: the check was :func:`check_unrolled`: the inner procedure was re-run and
            differenced as it is, with no stationarity check.
        looks_unrolled: :func:`check_hypergrad` only: the inner solves are far from stationary,
            yet ``grad`` matches the differences of ``solve_inner`` as it is in every direction,
            so ``solve_inner`` looks like an unrolled procedure and ``grad`` its derivative
            (``passed`` is False; the verdict points at :func:`check_unrolled`).

    Example:
        >>> import hypergrad.testing as hgt
        >>> X = torch.randn(30, 2, dtype=torch.float64)
        >>> solve = lambda lam: torch.linalg.solve(X.T @ X + lam * torch.eye(2, dtype=X.dtype),
        ...                                        X.T @ X.sum(1))
        >>> inner = lambda w, lam: 0.5 * ((X @ w - X.sum(1)) ** 2).sum() + 0.5 * lam * w @ w
        >>> outer = lambda w, lam: (w ** 2).sum()
        >>> report = hgt.check_hypergrad(solve, inner, outer, torch.tensor(2.0, dtype=X.dtype))
        >>> report.passed, len(report.rows), report.rows[0].direction
        (True, 1, 'hparams')
    """

    passed: bool
    inner_ok: bool
    rows: list[HypergradCheckRow]
    max_abs_err: float
    max_rel_err: float
    reason: str
    eps: float
    rtol: float
    atol: float
    directions: str = "coordinates"
    inner_criterion: str = ""
    center_inner_grad_norm: float = float("nan")
    center_inner_ok: bool = True
    dtype: str = ""
    precision_limited: bool = False
    inconclusive: bool = False
    blind: list[str] = field(default_factory=list)
    procedure: bool = False
    looks_unrolled: bool = False

    @property
    def failed(self) -> list[str]:
        """Labels of the directions whose comparison failed."""
        return [r.direction for r in self.rows if not r.passed]

    def table(self) -> str:
        """The aligned per-direction table (header, one line per direction)."""
        width = max([len("direction")] + [len(r.direction) for r in self.rows])
        head = (
            f"{'direction':<{width}}  {'finite diff':>16}  {'analytic':>16}  {'abs err':>9}  "
            f"{'rel err':>9}  {'inner err':>9}  {'ok':>4}  {'inner':>5}"
        )
        lines = [head, "-" * len(head)]
        for r in self.rows:
            inner_err = "-" if self.procedure else f"{r.inner_err:.2e}"
            inner = "-" if self.procedure else "ok" if r.inner_ok else "BAD"
            lines.append(
                f"{r.direction:<{width}}  {r.fd:>16.9e}  {r.analytic:>16.9e}  {r.abs_err:>9.2e}  "
                f"{r.rel_err:>9.2e}  {inner_err:>9}  {'ok' if r.passed else 'FAIL':>4}  "
                f"{inner:>5}"
            )
        return "\n".join(lines)

    def _inner_lines(self) -> str:
        points = 1 + 2 * len(self.rows)
        if self.procedure:
            return (
                f"inner procedure: re-run at {points} points and differenced as it is\n"
                f"  criterion: {self.inner_criterion}"
            )
        gmax = max([self.center_inner_grad_norm] + [r.inner_grad_norm for r in self.rows])
        return (
            f"inner solves: {'ok' if self.inner_ok else 'NOT CONVERGED'}: max ||dL_in/dpsi|| = "
            f"{gmax:.2e} over {points} solves ({self.center_inner_grad_norm:.2e} "
            f"at theta)\n  criterion: {self.inner_criterion}"
        )

    def _label(self) -> str:
        if self.passed:
            return "PASSED"
        if self.inconclusive:
            return "INCONCLUSIVE"
        if self.looks_unrolled:
            return "NOT AN INNER SOLVE (use check_unrolled)"
        if not self.inner_ok:
            return "FAILED (INNER SOLVE)"
        if self.precision_limited:
            return "FAILED (PRECISION)"
        return "FAILED (HYPERGRADIENT)"

    def __str__(self) -> str:
        kind = "coordinate" if self.directions == "coordinates" else self.directions
        title = (
            f"hypergradient check: {len(self.rows)} {kind} direction"
            f"{'s' if len(self.rows) != 1 else ''}, eps={self.eps:.0e}, rtol={self.rtol:.0e}, "
            f"atol={self.atol:.0e}" + (f" ({self.dtype})" if self.dtype else "")
        )
        verdict = textwrap.fill(
            f"{self._label()}: {self.reason}",
            width=100,
            subsequent_indent="  ",
            break_long_words=False,
        )
        return "\n".join([title, self.table(), self._inner_lines(), verdict])
