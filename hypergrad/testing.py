"""Gradient checks for hypergradients, as :func:`torch.autograd.gradcheck` is for autograd.

:func:`check_hypergrad` compares a hypergradient ``dL_out/dtheta`` with central finite
differences of the *re-solved* bilevel problem. Along each direction ``d`` it solves the inner
problem again at ``theta + eps d`` and ``theta - eps d`` and forms

    fd = (L_out(psi*(theta + eps d), theta + eps d) - L_out(psi*(theta - eps d), theta - eps d))
         / (2 eps),

the derivative of the *total* outer loss (its direct dependence on ``theta`` included), and
compares it with ``<grad, d>``. A direction passes when
``|fd - <grad, d>| <= atol + rtol * max(|fd|, |<grad, d>|)``.

A direction in which both ``|fd|`` and ``|<grad, d>|`` are at most ``atol`` cannot tell a right
hypergradient from a wrong one (zero would pass too). When that is so in *every* direction the
check is **inconclusive**: ``report.passed`` is False, ``report.inconclusive`` True and the verdict
says ``INCONCLUSIVE`` with the numbers; lower ``atol`` or rescale the problem. Directions must be
non-zero, finite and large enough that ``theta +- eps d`` differ from ``theta`` by more than
rounding, else :class:`~hypergrad.HypergradValueError`.

Finite differences of a re-solved problem are only as good as the inner solves, so every solve
is checked too: at each point the gradient ``g = dL_in/dpsi`` of the inner loss is computed and,
with ``x = H^{-1} dL_out/dpsi`` the adjoint of the implicit hypergradient, ``|<x, g>|`` estimates
(to first order) how far the outer loss at the returned parameters is from its value at the exact
inner solution. When the inner solves move the finite differences by more than half the
comparison tolerance the report says the *inner solve* failed (``inner_ok=False``), not the
hypergradient. See ``docs/testing.md``.

:func:`check_hyperstep` is the same check for :class:`~hypergrad.HyperStep` users (modules
instead of pytrees); :func:`assert_hypergrad_close` and :func:`assert_hyperstep_close` raise an
``AssertionError`` carrying the report's table when a check fails.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import textwrap
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from ._core import HypergradInfo, Loss, check_leaves
from .errors import HypergradError, HypergradTypeError, HypergradValueError, HypergradWarning
from .implicit import implicit_grad
from .modules import HyperStep, frozen_buffers
from .solvers import MINRES
from .tree import PyTree, Tensors, leaf_paths, tree_flatten, tree_unflatten

__all__ = [
    "HypergradCheckReport",
    "HypergradCheckRow",
    "assert_hypergrad_close",
    "assert_hyperstep_close",
    "check_hypergrad",
    "check_hyperstep",
]

#: Up to this many hyperparameter elements, every coordinate is a direction by default.
ALL_COORDINATES_UP_TO = 16
#: Number of random unit directions by default above that.
DEFAULT_RANDOM_DIRECTIONS = 8
#: Share of the comparison tolerance the inner solves may use up (automatic inner criterion).
INNER_BUDGET = 0.5


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
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
            adjoint and ``g+-`` the inner gradients (NaN when no adjoint was available).
        inner_grad_norm: the larger ``||dL_in/dpsi||`` of the two solves.
        passed: ``abs_err <= tol`` (and both values finite).
        inner_ok: the two inner solves are accurate enough for this comparison.
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
    """Result of :func:`check_hypergrad` / :func:`check_hyperstep`; ``str()`` gives the table.

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
            lines.append(
                f"{r.direction:<{width}}  {r.fd:>16.9e}  {r.analytic:>16.9e}  {r.abs_err:>9.2e}  "
                f"{r.rel_err:>9.2e}  {r.inner_err:>9.2e}  {'ok' if r.passed else 'FAIL':>4}  "
                f"{'ok' if r.inner_ok else 'BAD':>5}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        kind = "coordinate" if self.directions == "coordinates" else self.directions
        title = (
            f"hypergradient check: {len(self.rows)} {kind} direction"
            f"{'s' if len(self.rows) != 1 else ''}, eps={self.eps:.0e}, rtol={self.rtol:.0e}, "
            f"atol={self.atol:.0e}" + (f" ({self.dtype})" if self.dtype else "")
        )
        gmax = max([self.center_inner_grad_norm] + [r.inner_grad_norm for r in self.rows])
        inner = (
            f"inner solves: {'ok' if self.inner_ok else 'NOT CONVERGED'}: max ||dL_in/dpsi|| = "
            f"{gmax:.2e} over {1 + 2 * len(self.rows)} solves ({self.center_inner_grad_norm:.2e} "
            f"at theta)\n  criterion: {self.inner_criterion}"
        )
        if self.passed:
            verdict = "PASSED: " + self.reason
        elif self.inconclusive:
            verdict = "INCONCLUSIVE: " + self.reason
        elif not self.inner_ok:
            verdict = "FAILED (INNER SOLVE): " + self.reason
        elif self.precision_limited:
            verdict = "FAILED (PRECISION): " + self.reason
        else:
            verdict = "FAILED (HYPERGRADIENT): " + self.reason
        verdict = textwrap.fill(verdict, width=100, subsequent_indent="  ", break_long_words=False)
        return "\n".join([title, self.table(), inner, verdict])


# --------------------------------------------------------------------------------------------
# shared machinery
# --------------------------------------------------------------------------------------------
@dataclass
class _Point:
    """One re-solved point: total outer loss, inner loss and inner gradient there."""

    outer: float
    inner: float
    grad: Tensors
    dtype: torch.dtype = torch.float64


def _check_settings(eps: Any, rtol: Any, atol: Any, seed: Any, inner_tol: Any) -> None:
    def real(v: Any) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

    if not real(eps) or not eps > 0:
        raise HypergradValueError(f"eps must be a finite number > 0, got {eps!r}")
    for name, v in (("rtol", rtol), ("atol", atol)):
        if not real(v) or v < 0:
            raise HypergradValueError(f"{name} must be a finite number >= 0, got {v!r}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise HypergradTypeError(f"seed must be an int, got {type(seed).__name__}")
    if inner_tol is not None and (not real(inner_tol) or inner_tol < 0):
        raise HypergradValueError(
            f"inner_tol must be None or a finite number >= 0, got {inner_tol!r}"
        )


def _warn_low_precision(tensors: Sequence[torch.Tensor], what: str, eps: float) -> None:
    low = sorted({str(t.dtype) for t in tensors if t.dtype != torch.float64})
    if low:
        warnings.warn(
            f"{what} {'is' if len(low) == 1 else 'are'} {', '.join(low)}: central differences "
            f"with eps={eps:g} cancel all but a few digits of the loss in this precision "
            "(rounding ~ machine epsilon * |L| / eps), so the check is unreliable; cast the "
            "problem to float64 (.double()) to check the hypergradient",
            HypergradWarning,
            stacklevel=3,
        )


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run a block with the RNG seeded to ``seed``; the caller's RNG streams are untouched."""
    # torch.cuda.is_initialized is unannotated in torch, hence the ignore.
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _scalar(loss: object, name: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise HypergradTypeError(f"{name} must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1 or not loss.is_floating_point():
        raise HypergradValueError(
            f"{name} must return a floating-point scalar tensor, got shape {tuple(loss.shape)} "
            f"and dtype {loss.dtype}"
        )
    return loss.reshape(())


def _grads(loss: torch.Tensor, wrt: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """``d loss / d wrt`` with None for unused inputs (all None when the loss is constant)."""
    if not loss.requires_grad:
        return (None,) * len(wrt)
    return torch.autograd.grad(loss, list(wrt), allow_unused=True)


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return float(sum((x.detach().double() * y.detach().double()).sum() for x, y in zip(a, b)))


def _norm(a: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float((x.detach().double() ** 2).sum()) for x in a))


def _index_label(name: str, shape: torch.Size, flat: int) -> str:
    if len(shape) == 0:
        return name
    idx = []
    for s in reversed(shape):
        idx.append(flat % s)
        flat //= s
    return f"{name}[{', '.join(str(i) for i in reversed(idx))}]"


def _directions(
    theta: list[torch.Tensor],
    names: list[str],
    directions: Any,
    seed: int,
    flatten_given: Callable[[Any, int], list[torch.Tensor]],
) -> tuple[str, list[tuple[str, list[torch.Tensor]]]]:
    numel = sum(t.numel() for t in theta)
    if directions is None:
        directions = "all" if numel <= ALL_COORDINATES_UP_TO else DEFAULT_RANDOM_DIRECTIONS
    if isinstance(directions, str):
        if directions != "all":
            raise HypergradValueError(
                f"directions must be None, 'all', an int >= 1 or a sequence of directions, got "
                f"{directions!r}"
            )
        out = []
        for i, (t, n) in enumerate(zip(theta, names)):
            for j in range(t.numel()):
                d = [torch.zeros_like(s) for s in theta]
                d[i].view(-1)[j] = 1.0
                out.append((_index_label(n, t.shape, j), d))
        return "coordinates", out
    if isinstance(directions, numbers.Integral) and not isinstance(directions, bool):
        if directions < 1:
            raise HypergradValueError(f"directions must be >= 1, got {directions}")
        gen = torch.Generator().manual_seed(int(seed))
        out = []
        for k in range(int(directions)):
            v = torch.randn(numel, generator=gen, dtype=torch.float64)
            v = v / v.norm()
            d, i = [], 0
            for t in theta:
                d.append(v[i : i + t.numel()].reshape(t.shape).to(dtype=t.dtype, device=t.device))
                i += t.numel()
            out.append((f"random #{k}", d))
        return "random", out
    if isinstance(directions, Sequence) and len(directions) > 0:
        return "given", [(f"direction #{k}", flatten_given(d, k)) for k, d in enumerate(directions)]
    raise HypergradValueError(
        "directions must be None, 'all', an int >= 1 or a non-empty sequence of directions, got "
        f"{type(directions).__name__}"
    )


def _check_directions(
    theta: list[torch.Tensor], dirs: list[tuple[str, list[torch.Tensor]]], eps: float
) -> None:
    """Refuse directions that are zero, not finite, or so small that ``theta +- eps d`` is
    ``theta`` up to rounding (the differences would be noise and every comparison below atol)."""
    scale = max([1.0] + [float(t.detach().abs().max()) for t in theta if t.numel()])
    unit = max(torch.finfo(t.dtype).eps for t in theta)
    for label, d in dirs:
        size = max((float(v.detach().abs().max()) for v in d if v.numel()), default=0.0)
        finite = all(bool(torch.isfinite(v).all()) for v in d)
        if not finite or size == 0.0:
            raise HypergradValueError(
                f"{label} is {'not finite' if not finite else 'zero'}: a direction must be a "
                "non-zero finite pytree like hparams"
            )
        if eps * size < 100 * unit * scale:
            raise HypergradValueError(
                f"{label} is degenerate: its largest entry is {size:.1e}, so the step eps * d "
                f"({eps * size:.1e}) is lost in the rounding of hparams (|hparams| up to "
                f"{scale:.1e}, machine eps {unit:.1e}) and every comparison would be below atol; "
                "directions are used as given, not normalised: scale it up (e.g. to unit norm)"
            )


def _flatten_like(
    tree: Any, theta: list[torch.Tensor], spec: Any, what: str, to_flat: Callable[[Any], Any]
) -> list[torch.Tensor]:
    """Flatten ``tree`` and check it has the structure and shapes of ``theta``."""
    leaves, tspec = to_flat(tree)
    if (spec is not None and tspec != spec) or len(leaves) != len(theta):
        raise HypergradValueError(
            f"{what} must have the structure of hparams ({len(theta)} tensors), got {tspec!r}"
        )
    out = []
    for i, (a, t) in enumerate(zip(leaves, theta)):
        if not isinstance(a, torch.Tensor) or a.shape != t.shape:
            shape = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
            raise HypergradValueError(
                f"{what}: leaf {i} has shape {shape}, expected {tuple(t.shape)}"
            )
        out.append(a.detach().to(dtype=t.dtype, device=t.device))
    return out


def _hints(
    rows: list[HypergradCheckRow],
    dirs: list[list[torch.Tensor]],
    direct: Tensors | None,
) -> str:
    """Patterns in the failing rows that point at a known mistake."""
    bad = [(r, d) for r, d in zip(rows, dirs) if not r.passed]
    if not bad or not all(math.isfinite(r.fd) and math.isfinite(r.analytic) for r, _ in bad):
        return ""
    if all(abs(r.fd + r.analytic) <= r.tol for r, _ in bad):
        return (
            " The analytic values are the finite differences with the opposite sign: a sign flip "
            "(hypergrad returns the gradient of the outer loss, to be minimised)."
        )
    if direct is not None and _norm(direct) > 0:
        plus = [abs(r.fd - (r.analytic + _dot(direct, d))) <= r.tol for r, d in bad]
        minus = [abs(r.fd - (r.analytic - _dot(direct, d))) <= r.tol for r, d in bad]
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
    ratios = [r.analytic / r.fd for r, _ in bad if r.fd != 0]
    if ratios and 0 < min(ratios) and max(ratios) < 1:
        return (
            f" The analytic values are smaller in magnitude in every failing direction "
            f"(analytic / finite difference in [{min(ratios):.4g}, {max(ratios):.4g}]): a "
            "damped or truncated adjoint solve (solver damping, too few iterations), or a "
            "path from the parameters cut by .detach() inside the inner loss?"
        )
    if ratios:
        return (
            f" analytic / finite difference ranges over [{min(ratios):.4g}, {max(ratios):.4g}] "
            "in the failing directions. With converged inner solves, look for a path from the "
            "parameters or hyperparameters cut by .detach() (or .item(), .numpy()) inside a loss."
        )
    return ""


def _run_check(
    theta: list[torch.Tensor],
    names: list[str],
    evaluate: Callable[[list[torch.Tensor]], _Point],
    center: _Point,
    grad: list[torch.Tensor],
    adjoint: Tensors | None,
    direct: Tensors | None,
    directions: Any,
    eps: float,
    rtol: float,
    atol: float,
    seed: int,
    inner_tol: float | None,
    flatten_given: Callable[[Any, int], list[torch.Tensor]],
) -> HypergradCheckReport:
    kind, dirs = _directions(theta, names, directions, seed, flatten_given)
    _check_directions(theta, dirs, eps)
    gnorm_c = _norm(center.grad)
    finfo = torch.finfo(theta[0].dtype)
    # the least precise of hparams, params and the loss sets the rounding of the differences
    low = max(
        [torch.finfo(t.dtype).eps for t in theta]
        + [torch.finfo(t.dtype).eps for t in center.grad if t.is_floating_point()]
        + [torch.finfo(center.dtype).eps]
    )
    rounding = 0.0

    def loss_err(p: _Point) -> float:
        return abs(_dot(adjoint, p.grad)) if adjoint is not None else float("nan")

    def fallback_ok(p: _Point) -> bool:
        return _norm(p.grad) <= math.sqrt(finfo.eps) * max(1.0, abs(p.inner))

    if inner_tol is not None:
        criterion = f"each ||dL_in/dpsi|| must be <= inner_tol = {inner_tol:.1e}"
    elif adjoint is not None:
        criterion = f"inner err <= {INNER_BUDGET:g} x (atol + rtol * max(|fd|, |analytic|))"
    else:
        criterion = (
            "no adjoint available: each ||dL_in/dpsi|| must be <= sqrt(machine eps) x "
            "max(1, |L_in|)"
        )

    rows: list[HypergradCheckRow] = []
    for label, d in dirs:
        plus = [t + eps * v for t, v in zip(theta, d)]
        minus = [t - eps * v for t, v in zip(theta, d)]
        pp, pm = evaluate(plus), evaluate(minus)
        # the step actually taken (rounding of theta +- eps d), so the comparison is exact in it
        d_eff = [(a.double() - b.double()) / (2 * eps) for a, b in zip(plus, minus)]
        fd = (pp.outer - pm.outer) / (2 * eps)
        rounding = max(rounding, low * (abs(pp.outer) + abs(pm.outer)) / (2 * eps))
        an = _dot(grad, d_eff)
        scale = max(abs(fd), abs(an))
        abs_err = abs(fd - an)
        rel_err = abs_err / scale if scale > 0 else (0.0 if abs_err == 0 else float("inf"))
        tol = atol + rtol * scale
        ok = math.isfinite(fd) and math.isfinite(an) and abs_err <= tol
        inner_err = (loss_err(pp) + loss_err(pm)) / (2 * eps)
        gmax = max(_norm(pp.grad), _norm(pm.grad))
        if inner_tol is not None:
            iok = gmax <= inner_tol
        elif adjoint is not None:
            iok = inner_err <= INNER_BUDGET * tol
        else:
            iok = fallback_ok(pp) and fallback_ok(pm)
        rows.append(
            HypergradCheckRow(
                label, fd, an, abs_err, rel_err, tol, inner_err, gmax, bool(ok), bool(iok)
            )
        )

    if inner_tol is not None:
        center_ok = gnorm_c <= inner_tol
    elif adjoint is not None:
        # the solve at theta is held to the standard of one side of the tightest difference
        center_ok = loss_err(center) / eps <= INNER_BUDGET * min(r.tol for r in rows)
    else:
        center_ok = fallback_ok(center)
    inner_ok = center_ok and all(r.inner_ok for r in rows)
    grad_ok = all(r.passed for r in rows)
    max_abs = max((r.abs_err for r in rows), default=0.0)
    max_rel = max((r.rel_err for r in rows), default=0.0)
    failed = [r.direction for r in rows if not r.passed]
    n = len(rows)
    precision_limited = False
    # directions where a zero (or any other value below atol) would have matched just as well
    blind = [r for r in rows if max(abs(r.fd), abs(r.analytic)) <= atol]
    inconclusive = inner_ok and grad_ok and len(blind) == n

    if inconclusive:
        fd_max = max(abs(r.fd) for r in rows)
        an_max = max(abs(r.analytic) for r in rows)
        size = (
            "the finite differences are exactly zero (the outer loss does not move at this eps)"
            if fd_max == 0
            else f"lower atol below the hypergradient's size (e.g. atol={fd_max / 100:.0e}) or "
            "rescale the outer loss"
        )
        reason = (
            f"the hypergradient is below atol in every direction: max |finite diff| = "
            f"{fd_max:.2e} and max |analytic| = {an_max:.2e}, both <= atol = {atol:.0e}, so a "
            f"zero (or any other) hypergradient this small would match too and the check cannot "
            f"tell whether it is right; {size}. The inner solves are converged."
        )
    elif inner_ok and grad_ok:
        seen = [r for r in rows if max(abs(r.fd), abs(r.analytic)) > atol]
        rel = max((r.rel_err for r in seen), default=0.0)
        reason = (
            f"the hypergradient matches central differences in "
            f"{'all ' + str(n) + ' directions' if n != 1 else 'the direction'} (max rel err "
            f"{rel:.1e}"
            + (
                f" over the {len(seen)} directions above atol; in {len(blind)} "
                f"({', '.join(r.direction for r in blind[:4])}"
                f"{', ...' if len(blind) > 4 else ''}) both values are below atol = {atol:.0e} "
                "and were not told apart from zero"
                if blind
                else ""
            )
            + ") and every inner solve is stationary enough."
        )
    elif not inner_ok:
        bad = (["theta"] if not center_ok else []) + [
            f"theta +- eps*{r.direction}" for r in rows if not r.inner_ok
        ]
        gmax = max([gnorm_c] + [r.inner_grad_norm for r in rows])
        worst = max((r.inner_err / r.tol for r in rows if r.tol > 0), default=float("nan"))
        effect = (
            f" their estimated effect on the finite differences reaches {worst:.1e} x the "
            "tolerance, so the comparison cannot judge the hypergradient."
            if adjoint is not None and math.isfinite(worst)
            else ""
        )
        also = (
            f" {len(failed)} of {n} directions also disagree, which may come from the inexact "
            "solves alone."
            if failed
            else ""
        )
        reason = (
            f"the inner solve is not converged at {', '.join(bad[:4])}"
            f"{' and ' + str(len(bad) - 4) + ' more' if len(bad) > 4 else ''}: "
            f"||dL_in/dpsi|| reaches {gmax:.2e};{effect}{also} Solve the inner problem more "
            "accurately (tighter tolerance, more iterations) or raise eps; this is not a verdict "
            "on the hypergradient."
        )
    else:
        reason = (
            f"the hypergradient disagrees with central differences in {len(failed)} of {n} "
            f"directions ({', '.join(failed[:6])}{', ...' if len(failed) > 6 else ''}); "
            f"max abs err {max_abs:.2e}, max rel err {max_rel:.2e}; the inner solves are "
            "converged"
        )
        precision_limited = low > torch.finfo(torch.float64).eps and max_abs <= rounding
        if precision_limited:
            reason += (
                f", but the computation is not float64 and rounding alone moves the differences "
                f"by up to ~{rounding:.1e}: errors of this size are no verdict on the "
                "hypergradient; check a float64 copy of the problem."
            )
        else:
            reason += ", so the hypergradient itself is wrong." + _hints(
                rows, [d for _, d in dirs], direct
            )
            if low > torch.finfo(torch.float64).eps:
                reason += (
                    f" (The computation is not float64: rounding alone moves the differences by "
                    f"up to ~{rounding:.1e}.)"
                )
    return HypergradCheckReport(
        passed=bool(inner_ok and grad_ok and not inconclusive),
        inner_ok=bool(inner_ok),
        rows=rows,
        max_abs_err=max_abs,
        max_rel_err=max_rel,
        reason=reason,
        eps=float(eps),
        rtol=float(rtol),
        atol=float(atol),
        directions=kind,
        inner_criterion=criterion,
        center_inner_grad_norm=gnorm_c,
        center_inner_ok=bool(center_ok),
        dtype=str(theta[0].dtype).replace("torch.", ""),
        precision_limited=bool(precision_limited and not (inner_ok and grad_ok)),
        inconclusive=bool(inconclusive),
        blind=[r.direction for r in blind],
    )


def _quiet_adjoint(compute: Callable[[], Tensors]) -> Tensors | None:
    """An adjoint ``H^{-1} dL_out/dpsi`` for the inner criterion, or None when it fails."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            x = compute()
    except (HypergradError, RuntimeError):
        return None
    return x if all(bool(torch.isfinite(t).all()) for t in x) else None


# --------------------------------------------------------------------------------------------
# pytrees
# --------------------------------------------------------------------------------------------
def check_hypergrad(
    solve_inner: Callable[[PyTree], PyTree],
    inner_loss: Loss,
    outer_loss: Loss,
    hparams: PyTree,
    grad: PyTree | None = None,
    *,
    directions: int | str | Sequence[PyTree] | None = None,
    eps: float = 1e-4,
    rtol: float = 1e-4,
    atol: float = 1e-8,
    seed: int = 0,
    inner_tol: float | None = None,
) -> HypergradCheckReport:
    """Check a hypergradient against central finite differences of the re-solved problem.

    Args:
        solve_inner: ``hparams -> params``, solving the inner problem (approximately) from
            scratch: the same procedure, deterministic, at any ``hparams`` (it runs with the RNG
            seeded to ``seed`` every time, your RNG stream untouched). ``params`` is a pytree
            like :func:`~hypergrad.implicit_grad`'s.
        inner_loss: ``(params, hparams) -> scalar``, as in :func:`~hypergrad.implicit_grad`.
        outer_loss: ``(params, hparams) -> scalar``; its direct dependence on ``hparams`` is part
            of the finite differences.
        hparams: where to check, a pytree (tensor / tuple / list / dict) of float tensors.
        grad: the hypergradient to check, a pytree like ``hparams``; None computes it with
            ``hg.implicit_grad(inner_loss, outer_loss, solve_inner(hparams), hparams)`` and its
            default solver.
        directions: None: every coordinate when ``hparams`` has at most 16 elements, else 8
            random unit directions; ``"all"``: every coordinate; an int: that many random unit
            directions (drawn with ``seed``); a sequence of pytrees like ``hparams``: those
            directions, used as given (not normalised).
        eps: finite-difference step along each direction.
        rtol: relative tolerance of the comparison.
        atol: absolute tolerance of the comparison.
        seed: seed of the random directions and of the RNG around each ``solve_inner`` call.
        inner_tol: None (default) judges each inner solve by its estimated effect on the finite
            differences, ``|<x, dL_in/dpsi>| / eps`` with ``x`` the adjoint, against half the
            tolerance; a number instead requires ``||dL_in/dpsi|| <= inner_tol`` at every point.

    Returns:
        A :class:`HypergradCheckReport`; ``print(report)`` shows the table and the verdict.

    Raises:
        HypergradError: bad arguments, or ``solve_inner`` returning a structure that changes.

    Warns:
        HypergradWarning: ``hparams`` or ``params`` are not float64 (finite differences in
            float32 are unreliable).

    Example:
        >>> import hypergrad.testing as hgt
        >>> X, y = torch.randn(40, 3, dtype=torch.float64), torch.randn(40, dtype=torch.float64)
        >>> def solve(lam):  # closed-form ridge regression
        ...     return torch.linalg.solve(X.T @ X / 40 + torch.diag(lam), X.T @ y / 40)
        >>> inner = lambda w, lam: 0.5 * ((X @ w - y) ** 2).mean() + 0.5 * (lam * w**2).sum()
        >>> outer = lambda w, lam: ((X @ w - 1) ** 2).mean() + 0.1 * (lam**2).sum()
        >>> report = hgt.check_hypergrad(solve, inner, outer, torch.full((3,), 0.5).double())
        >>> report.passed, report.inner_ok, [r.direction for r in report.rows]
        (True, True, ['hparams[0]', 'hparams[1]', 'hparams[2]'])
    """
    if not callable(solve_inner):
        raise HypergradTypeError(f"solve_inner must be callable, got {type(solve_inner).__name__}")
    for name, fn in (("inner_loss", inner_loss), ("outer_loss", outer_loss)):
        if not callable(fn):
            raise HypergradTypeError(f"{name} must be callable, got {type(fn).__name__}")
    _check_settings(eps, rtol, atol, seed, inner_tol)
    h_leaves, h_spec = tree_flatten(hparams, "hparams")
    names = leaf_paths(h_spec, "hparams")
    theta0 = [t.detach().clone() for t in h_leaves]
    check_leaves(theta0, names, "hparams")
    _warn_low_precision(theta0, "hparams", eps)

    def solve(theta: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        with _seeded(seed):
            out = solve_inner(tree_unflatten(h_spec, [t.clone() for t in theta]))
        leaves, spec = tree_flatten(out, "solve_inner(hparams)")
        return [p.detach() for p in leaves], spec

    p0, p_spec = solve(theta0)
    p_names = leaf_paths(p_spec, "params")
    check_leaves(p0, p_names, "solve_inner(hparams)")
    _warn_low_precision(p0, "the params returned by solve_inner", eps)

    def H(leaves: Sequence[torch.Tensor]) -> PyTree:
        return tree_unflatten(h_spec, list(leaves))

    def P(leaves: Sequence[torch.Tensor]) -> PyTree:
        return tree_unflatten(p_spec, list(leaves))

    def point(theta: list[torch.Tensor], params: list[torch.Tensor]) -> _Point:
        lo = _scalar(outer_loss(P(params), H(theta)), "outer_loss")
        ps = [p.detach().requires_grad_(True) for p in params]
        with torch.enable_grad():
            li = _scalar(inner_loss(P(ps), H(theta)), "inner_loss")
            g_raw = _grads(li, ps)
        g = tuple(torch.zeros_like(p) if gi is None else gi.detach() for gi, p in zip(g_raw, ps))
        return _Point(float(lo.detach()), float(li.detach()), g, lo.dtype)

    def evaluate(theta: list[torch.Tensor]) -> _Point:
        params, spec = solve(theta)
        if spec != p_spec or any(a.shape != b.shape for a, b in zip(params, p0)):
            raise HypergradValueError(
                f"solve_inner returned {spec!r} with shapes {[tuple(a.shape) for a in params]} "
                f"at a perturbed point but {p_spec!r} with shapes {[tuple(a.shape) for a in p0]} "
                "at hparams: it must return the same structure everywhere"
            )
        return point(theta, params)

    def adjoint_of(solver: Any = None) -> tuple[PyTree, Tensors]:
        g, info = implicit_grad(inner_loss, outer_loss, P(p0), H(theta0), solver=solver)
        return g, tuple(tree_flatten(info.extras["adjoint"])[0])

    def flat(tree: Any) -> tuple[list[torch.Tensor], Any]:
        return tree_flatten(tree, "grad")

    adjoint: Tensors | None
    if grad is None:
        g_tree, adjoint = adjoint_of()
        grad_leaves = [t.detach() for t in tree_flatten(g_tree, "grad")[0]]
    else:
        grad_leaves = _flatten_like(grad, theta0, h_spec, "grad", flat)
        adjoint = _quiet_adjoint(lambda: adjoint_of(MINRES())[1])

    ths = [t.detach().requires_grad_(True) for t in theta0]
    with torch.enable_grad():
        lo = _scalar(outer_loss(P(p0), H(ths)), "outer_loss")
        dg = _grads(lo, ths)
    direct = tuple(torch.zeros_like(t) if d is None else d.detach() for d, t in zip(dg, ths))

    def given(d: Any, k: int) -> list[torch.Tensor]:
        return _flatten_like(d, theta0, h_spec, f"directions[{k}]", flat)

    return _run_check(
        theta0,
        names,
        evaluate,
        point(theta0, p0),
        grad_leaves,
        adjoint,
        direct,
        directions,
        eps,
        rtol,
        atol,
        seed,
        inner_tol,
        given,
    )


def assert_hypergrad_close(
    solve_inner: Callable[[PyTree], PyTree],
    inner_loss: Loss,
    outer_loss: Loss,
    hparams: PyTree,
    grad: PyTree | None = None,
    *,
    directions: int | str | Sequence[PyTree] | None = None,
    eps: float = 1e-4,
    rtol: float = 1e-4,
    atol: float = 1e-8,
    seed: int = 0,
    inner_tol: float | None = None,
) -> HypergradCheckReport:
    """:func:`check_hypergrad`, raising ``AssertionError`` (message: the table) on failure.

    Args:
        solve_inner: as in :func:`check_hypergrad`.
        inner_loss: as in :func:`check_hypergrad`.
        outer_loss: as in :func:`check_hypergrad`.
        hparams: as in :func:`check_hypergrad`.
        grad: as in :func:`check_hypergrad`.
        directions: as in :func:`check_hypergrad`.
        eps: as in :func:`check_hypergrad`.
        rtol: as in :func:`check_hypergrad`.
        atol: as in :func:`check_hypergrad`.
        seed: as in :func:`check_hypergrad`.
        inner_tol: as in :func:`check_hypergrad`.

    Returns:
        The :class:`HypergradCheckReport` when the check passed.

    Raises:
        AssertionError: the check failed; the message is ``str(report)``.

    Example:
        >>> import hypergrad.testing as hgt
        >>> X = torch.randn(30, 2, dtype=torch.float64)
        >>> solve = lambda lam: torch.linalg.solve(X.T @ X + lam * torch.eye(2).double(), X.sum(0))
        >>> inner = lambda w, lam: 0.5 * w @ (X.T @ X) @ w - w @ X.sum(0) + 0.5 * lam * w @ w
        >>> outer = lambda w, lam: (w ** 2).sum()
        >>> lam = torch.tensor(1.0, dtype=torch.float64)
        >>> _ = hgt.assert_hypergrad_close(solve, inner, outer, lam)  # passes silently
        >>> hgt.assert_hypergrad_close(solve, inner, outer, lam, grad=torch.zeros_like(lam))
        Traceback (most recent call last):
        ...
        AssertionError: hypergradient check: 1 coordinate direction, ...
    """
    report = check_hypergrad(
        solve_inner,
        inner_loss,
        outer_loss,
        hparams,
        grad,
        directions=directions,
        eps=eps,
        rtol=rtol,
        atol=atol,
        seed=seed,
        inner_tol=inner_tol,
    )
    if not report.passed:
        raise AssertionError(str(report))
    return report


# --------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------
class _ModuleSnapshot:
    """Everything :func:`check_hyperstep` may change: parameter and buffer objects and values,
    ``.grad``, train/eval flags, and free hyper tensors; :meth:`restore` puts it all back."""

    def __init__(self, modules: Sequence[nn.Module], tensors: Sequence[torch.Tensor]):
        self.slots: list[tuple[nn.Module, str, str, torch.Tensor]] = []
        self.values: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self.flags: list[tuple[nn.Module, bool]] = []
        seen_mod: set[int] = set()
        seen_t: set[int] = set()

        def keep(t: torch.Tensor) -> None:
            if id(t) not in seen_t:
                seen_t.add(id(t))
                g = t.grad.detach().clone() if t.grad is not None else None
                self.values.append((t, t.detach().clone(), g))

        for root in modules:
            for mod in root.modules():
                if id(mod) in seen_mod:
                    continue
                seen_mod.add(id(mod))
                self.flags.append((mod, mod.training))
                for kind in ("_parameters", "_buffers"):
                    for name, t in getattr(mod, kind).items():
                        if t is not None:
                            self.slots.append((mod, kind, name, t))
                            keep(t)
        for t in tensors:
            keep(t)

    def restore(self) -> None:
        for mod, kind, name, t in self.slots:
            getattr(mod, kind)[name] = t
        with torch.no_grad():
            for t, value, g in self.values:
                t.copy_(value)
                t.grad = g
        for mod, flag in self.flags:
            mod.training = flag


def _as_tensor_list(x: Any, what: str) -> list[Any]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return list(x)
    raise HypergradTypeError(
        f"{what} must be a tensor or a list/tuple of tensors (one per hyper parameter, in the "
        f"order of step.theta), got {type(x).__name__}"
    )


def check_hyperstep(
    step: HyperStep,
    batch: Any,
    retrain: Callable[[Any], None],
    outer_batch: Any = None,
    grad: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    directions: int | str | Sequence[Sequence[torch.Tensor]] | None = None,
    eps: float = 1e-4,
    rtol: float = 1e-4,
    atol: float = 1e-8,
    seed: int = 0,
    inner_tol: float | None = None,
) -> HypergradCheckReport:
    """Check a :class:`~hypergrad.HyperStep`'s hypergradient against finite differences.

    The hyper parameters ``step.theta`` are moved in place to ``theta +- eps d``, the inner
    model is retrained there by ``retrain(step.hyper)``, and the outer loss
    ``step.outer_loss(step.inner, outer_batch)`` is differenced. The analytic side is
    ``step.compute(batch, outer_batch)`` after ``retrain`` at ``theta`` (the hypergradient before
    any ``clip_norm``), or ``grad``. Afterwards every parameter, buffer, ``.grad`` and
    train/eval flag of ``step.inner`` and ``step.hyper`` is what it was before, even if the
    check raises.

    How to write ``retrain(hyper) -> None``: reset the inner model to a *fixed* starting state
    (``step.inner.load_state_dict(init)`` with ``init`` a ``copy.deepcopy`` of a state dict
    taken beforehand) and train it to convergence with the current hyper parameters, updating
    the parameters *in place* (optimizer steps, or ``p.copy_(...)`` under ``torch.no_grad()``
    for a closed form): the HyperStep holds the Parameter objects, so they must not be replaced.
    Each call runs with the RNG seeded to ``seed`` (your RNG stream untouched), so shuffling and
    dropout draw the same numbers at every point; the losses should be deterministic (dropout in
    eval mode) for a meaningful check.

    Args:
        step: the :class:`~hypergrad.HyperStep` to check.
        batch: the inner batch (passed to ``step.inner_loss``).
        retrain: ``hyper -> None``, retrains ``step.inner`` in place (see above); receives
            ``step.hyper``.
        outer_batch: the outer batch (default ``batch``), as in ``step(batch, outer_batch)``.
        grad: the hypergradient to check, one tensor per entry of ``step.theta`` (None:
            ``step.compute(batch, outer_batch)``).
        directions: as in :func:`check_hypergrad`; given directions are sequences of tensors
            shaped like ``step.theta``.
        eps: finite-difference step.
        rtol: relative tolerance.
        atol: absolute tolerance.
        seed: seed of the random directions and of the RNG around each retrain and evaluation.
        inner_tol: as in :func:`check_hypergrad` (gradient of ``step.inner_loss`` with respect to
            the inner model's trainable parameters).

    Returns:
        A :class:`HypergradCheckReport`.

    Raises:
        HypergradError: bad arguments, or ``retrain`` replacing the inner model's Parameters.
        HypergradValueError: ``step`` uses ``method="unrolled"``: its hypergradient is that of
            the look-ahead procedure, not of a re-solved inner problem, so differences of
            retrained models do not check it (difference the look-ahead itself instead, as
            ``tests/hypergrad/test_hyperstep_unrolled.py`` does).

    Example:
        >>> import hypergrad as hg, hypergrad.testing as hgt
        >>> X, y = torch.randn(32, 3).double(), torch.randn(32, 1).double()
        >>> model = nn.Linear(3, 1, bias=False).double()
        >>> decay = nn.Linear(1, 1, bias=False).double()  # weight = log penalty
        >>> inner = lambda m, b: ((m(b[0]) - b[1]) ** 2).mean() + decay.weight.exp().sum() * (
        ...     m.weight ** 2).sum()
        >>> outer = lambda m, b: ((m(b[0]) - 1.0) ** 2).mean()
        >>> def retrain(hyper):  # closed form: (X^T X / n + exp(w) I) W^T = X^T y / n
        ...     A = X.T @ X / 32 + hyper.weight.exp().sum() * torch.eye(3).double()
        ...     with torch.no_grad():
        ...         model.weight.copy_(torch.linalg.solve(A, X.T @ y / 32).T)
        >>> step = hg.HyperStep(model, decay, inner, outer, solver=hg.CG(tol=1e-12))
        >>> report = hgt.check_hyperstep(step, (X, y), retrain)
        >>> report.passed, report.rows[0].direction
        (True, 'hyper.weight[0, 0]')
    """
    if not isinstance(step, HyperStep):
        raise HypergradTypeError(f"step must be a hg.HyperStep, got {type(step).__name__}")
    if step.method != "implicit":
        raise HypergradValueError(
            f"check_hyperstep checks implicit hypergradients (the inner model retrained at "
            f"theta +- eps d); this step uses method={step.method!r}, whose hypergradient is "
            "that of the look-ahead steps: difference the look-ahead itself instead"
        )
    if not callable(retrain):
        raise HypergradTypeError(f"retrain must be callable, got {type(retrain).__name__}")
    _check_settings(eps, rtol, atol, seed, inner_tol)
    outer_batch = batch if outer_batch is None else outer_batch
    hyper_modules = [step.hyper] if isinstance(step.hyper, nn.Module) else []
    modules = [step.inner] + hyper_modules
    snapshot = _ModuleSnapshot(modules, list(step.theta))
    theta_t, psi_t = list(step.theta), list(step.psi)
    names = list(step.theta_names)
    theta0 = [t.detach().clone() for t in theta_t]
    check_leaves(theta0, names, "the hyper parameters")
    _warn_low_precision(theta0, "the hyper parameters", eps)
    _warn_low_precision(psi_t, "the inner model's parameters", eps)

    def resolve(theta: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for t, v in zip(theta_t, theta):
                t.copy_(v)
        with _seeded(seed):
            retrain(step.hyper)
        live = {id(p) for p in step.inner.parameters()}
        if any(id(p) not in live for p in psi_t):
            raise HypergradValueError(
                "retrain replaced Parameters of the inner model: the HyperStep holds the original "
                "Parameter objects, so update them in place (optimizer steps, load_state_dict, or "
                "p.copy_(...) under torch.no_grad())"
            )

    def point() -> _Point:
        with frozen_buffers(modules), _seeded(seed):
            lo = _scalar(step.outer_loss(step.inner, outer_batch), "outer_loss")
            with torch.enable_grad():
                li = _scalar(step.inner_loss(step.inner, batch), "inner_loss")
                g_raw = _grads(li, psi_t)
        g = tuple(torch.zeros_like(p) if gi is None else gi.detach() for gi, p in zip(g_raw, psi_t))
        return _Point(float(lo.detach()), float(li.detach()), g, lo.dtype)

    def evaluate(theta: list[torch.Tensor]) -> _Point:
        resolve(theta)
        return point()

    def flat(tree: Any) -> tuple[list[Any], Any]:
        return _as_tensor_list(tree, "grad"), None

    adjoint: Tensors | None
    try:
        resolve(theta0)
        center = point()
        if grad is None:
            with _seeded(seed):
                hyper, info = step.compute(batch, outer_batch)
            grad_leaves = [h.detach() for h in hyper]
            # an implicit step (checked on entry): its info is a HypergradInfo
            adjoint = tuple(cast(HypergradInfo, info).extras["adjoint"])
        else:
            grad_leaves = _flatten_like(grad, theta0, None, "grad", flat)
            probe = HyperStep(
                step.inner,
                step.hyper,
                step.inner_loss,
                step.outer_loss,
                solver=MINRES(),
                buffers=step.buffers,
                engine=step.engine,
            )

            def compute() -> Tensors:
                with _seeded(seed):
                    # probe uses the implicit method, so its info is a HypergradInfo.
                    probe_info = cast(HypergradInfo, probe.compute(batch, outer_batch)[1])
                    return tuple(probe_info.extras["adjoint"])

            adjoint = _quiet_adjoint(compute)
        with frozen_buffers(modules), _seeded(seed), torch.enable_grad():
            lo = _scalar(step.outer_loss(step.inner, outer_batch), "outer_loss")
            dg = _grads(lo, theta_t)
        direct = tuple(
            torch.zeros_like(t) if d is None else d.detach() for d, t in zip(dg, theta_t)
        )

        def given(d: Any, k: int) -> list[torch.Tensor]:
            return _flatten_like(d, theta0, None, f"directions[{k}]", flat)

        return _run_check(
            theta0,
            names,
            evaluate,
            center,
            grad_leaves,
            adjoint,
            direct,
            directions,
            eps,
            rtol,
            atol,
            seed,
            inner_tol,
            given,
        )
    finally:
        snapshot.restore()


def assert_hyperstep_close(
    step: HyperStep,
    batch: Any,
    retrain: Callable[[Any], None],
    outer_batch: Any = None,
    grad: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    directions: int | str | Sequence[Sequence[torch.Tensor]] | None = None,
    eps: float = 1e-4,
    rtol: float = 1e-4,
    atol: float = 1e-8,
    seed: int = 0,
    inner_tol: float | None = None,
) -> HypergradCheckReport:
    """:func:`check_hyperstep`, raising ``AssertionError`` (message: the table) on failure.

    Args:
        step: as in :func:`check_hyperstep`.
        batch: as in :func:`check_hyperstep`.
        retrain: as in :func:`check_hyperstep`.
        outer_batch: as in :func:`check_hyperstep`.
        grad: as in :func:`check_hyperstep`.
        directions: as in :func:`check_hyperstep`.
        eps: as in :func:`check_hyperstep`.
        rtol: as in :func:`check_hyperstep`.
        atol: as in :func:`check_hyperstep`.
        seed: as in :func:`check_hyperstep`.
        inner_tol: as in :func:`check_hyperstep`.

    Returns:
        The :class:`HypergradCheckReport` when the check passed.

    Raises:
        AssertionError: the check failed; the message is ``str(report)``.

    Example:
        >>> import hypergrad as hg, hypergrad.testing as hgt
        >>> X = torch.randn(32, 2).double()
        >>> model, lam = nn.Linear(2, 1, bias=False).double(), nn.Linear(1, 1).double()
        >>> inner = lambda m, x: ((m(x) - x.sum(1, keepdim=True)) ** 2).mean() + (
        ...     lam.weight.exp().sum() * (m.weight ** 2).sum())
        >>> outer = lambda m, x: (m.weight ** 2).sum() + (lam.bias ** 2).sum()
        >>> def retrain(hyper):
        ...     A = X.T @ X / 32 + hyper.weight.exp().sum() * torch.eye(2).double()
        ...     with torch.no_grad():
        ...         model.weight.copy_(torch.linalg.solve(A, X.T @ X.sum(1) / 32))
        >>> step = hg.HyperStep(model, lam, inner, outer, solver=hg.CG(tol=1e-12))
        >>> _ = hgt.assert_hyperstep_close(step, X, retrain)  # passes silently
        >>> before = model.weight.clone()
        >>> hgt.assert_hyperstep_close(step, X, retrain, grad=[torch.ones(1, 1), torch.ones(1)])
        Traceback (most recent call last):
        ...
        AssertionError: hypergradient check: 2 coordinate directions, ...
        >>> torch.equal(model.weight, before)  # the modules are left as they were
        True
    """
    report = check_hyperstep(
        step,
        batch,
        retrain,
        outer_batch,
        grad,
        directions=directions,
        eps=eps,
        rtol=rtol,
        atol=atol,
        seed=seed,
        inner_tol=inner_tol,
    )
    if not report.passed:
        raise AssertionError(str(report))
    return report
