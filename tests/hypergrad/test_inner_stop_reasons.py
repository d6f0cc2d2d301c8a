"""hg.inner: every solve says why it stopped (``InnerInfo.reason``) and warns on anything but
convergence (issue 30).

One table runs each reason on each solver where it can occur (converged, maxiter, stalled,
diverged, line_search, saddle) and checks the report and the warning (its class, its text, the
user's line, once per call site). Then the defects themselves, against independent numbers:
the stalls of a tight-tolerance float64 logistic regression (L-BFGS ran all 2,000 iterations,
Newton all 50 Hessians), run-away Picard iterations (``3x + 1``:
``x_k = (3^(k+1) − 1) / 2``), a loss steep at the origin that certified ``x = 1.1`` for a
minimiser at 1, Newton started at a maximum or saddle (the minimisers ``±1/√2`` of
``−x² + x⁴``), and float32/float64 mixes (a clear ``HypergradTypeError`` naming the
arguments)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hypergrad as hg
from hypergrad import inner

F64, F32 = torch.float64, torch.float32


def _tanh(n: int = 20, seed: int = 0):
    """``tanh(W x + b)`` with ``W`` symmetric, eigenvalues in [-0.5, 0.98]: a slow contraction."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    W = Q @ torch.diag(torch.linspace(-0.5, 0.98, n, dtype=F64)) @ Q.T
    b = 0.2 * torch.randn(n, generator=g, dtype=F64)
    return (lambda x, h: torch.tanh(W @ x + h)), b


def _lasso(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(60, 15, generator=g, dtype=F64)
    y = torch.randn(60, generator=g, dtype=F64)
    L = float(torch.linalg.matrix_norm(X, ord=2) ** 2 / X.shape[0])
    return (lambda w, _: 0.5 * ((X @ w - y) ** 2).mean()), L


def _logreg(n: int, d: int, seed: int = 0, scale: float = 1.0):
    """A float64 logistic regression (intercept column) whose tight-tolerance solves stall."""
    g = torch.Generator().manual_seed(seed)
    X = scale * torch.randn(n, d, generator=g, dtype=F64)
    X[:, 0] = 1.0
    w = torch.randn(d, generator=g, dtype=F64)
    y = (torch.rand(n, generator=g, dtype=F64) < torch.sigmoid(X @ w)).to(F64)

    def loss(w: torch.Tensor, lam: float) -> torch.Tensor:
        z = X @ w
        return (F.softplus(z) - y * z).mean() + 0.5 * lam * (w @ w)

    return loss


_A = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=F64)
_B = torch.tensor([1.0, 1.0], dtype=F64)


def _quadratic(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return 0.5 * x @ _A @ x - b @ x


def _z(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=F64)


def _three_x(x: torch.Tensor, _: Any) -> torch.Tensor:
    return 3 * x + 1


def _kink(x: torch.Tensor, _: Any) -> torch.Tensor:
    """Smooth enough for a gradient at 1.5, not for a finite Hessian there."""
    return ((x - 2) ** 2 + (x - 1.5).abs() ** 1.5).sum()


# (solver, reason, solve): one row per reason that can occur on that solver (L-BFGS never
# accepts a non-finite value, so it cannot diverge; only Newton looks at curvature)
Solve = Callable[[], tuple[Any, inner.InnerInfo]]
T20, B20 = _tanh()
T200, B200 = _tanh(200)
LASSO, L_LASSO = _lasso()
P = hg.prox.prox_lasso
CASES: list[tuple[str, str, Solve]] = [
    (
        "picard",
        "converged",
        lambda: inner.FixedPoint(T20, method="picard", maxiter=2000, tol=1e-10).solve(_z(20), B20),
    ),
    (
        "picard",
        "maxiter",
        lambda: inner.FixedPoint(T20, method="picard", maxiter=5, tol=1e-10).solve(_z(20), B20),
    ),
    (
        "picard",
        "stalled",
        lambda: inner.FixedPoint(T20, method="picard", maxiter=3000, tol=1e-18).solve(_z(20), B20),
    ),
    (
        "picard",
        "diverged",
        lambda: inner.FixedPoint(_three_x, method="picard", maxiter=100).solve(
            torch.ones(2, dtype=F64), None
        ),
    ),
    ("anderson", "converged", lambda: inner.FixedPoint(T20, tol=1e-10).solve(_z(20), B20)),
    ("anderson", "maxiter", lambda: inner.FixedPoint(T20, maxiter=3, tol=1e-10).solve(_z(20), B20)),
    (
        "anderson",
        "stalled",
        lambda: inner.FixedPoint(T200, maxiter=2000, tol=1e-17).solve(_z(200), B200),
    ),
    (
        "anderson",
        "diverged",
        lambda: inner.FixedPoint(lambda x, _: torch.sqrt(x) - 5.0).solve(
            torch.ones(2, dtype=F64), None
        ),
    ),
    (
        "fista",
        "converged",
        lambda: inner.ProximalGradient(LASSO, P, tol=1e-10).solve(_z(15), (None, 0.05)),
    ),
    (
        "fista",
        "maxiter",
        lambda: inner.ProximalGradient(LASSO, P, maxiter=3).solve(_z(15), (None, 0.05)),
    ),
    (
        "fista",
        "stalled",
        lambda: inner.ProximalGradient(LASSO, P, maxiter=3000, tol=1e-18).solve(
            _z(15), (None, 0.05)
        ),
    ),
    (
        "fista",
        "diverged",
        lambda: inner.ProximalGradient(LASSO, P, stepsize=3 / L_LASSO).solve(_z(15), (None, 0.05)),
    ),
    (
        "fista",
        "line_search",
        lambda: inner.ProximalGradient(
            lambda x, _: 0.5 * (x**2).sum() - x.sum(), P, init_stepsize=1e6, max_backtracks=1
        ).solve(_z(2), (None, 0.1)),
    ),
    (
        "ista",
        "stalled",
        lambda: inner.ProximalGradient(LASSO, P, maxiter=3000, tol=1e-18, accelerated=False).solve(
            _z(15), (None, 0.05)
        ),
    ),
    (
        "ista",
        "diverged",
        lambda: inner.ProximalGradient(LASSO, P, stepsize=3 / L_LASSO, accelerated=False).solve(
            _z(15), (None, 0.05)
        ),
    ),
    ("newton", "converged", lambda: inner.Newton(_quadratic, tol=1e-12).solve(_z(2), _B)),
    ("newton", "maxiter", lambda: inner.Newton(_logreg(80, 6), maxiter=2).solve(_z(6), 0.05)),
    (
        "newton",
        "stalled",
        lambda: inner.Newton(_logreg(300, 40, scale=5.0), tol=1e-12).solve(_z(40), 1e-6),
    ),
    (
        "newton",
        "diverged",
        lambda: inner.Newton(_kink).solve(torch.full((1,), 1.5, dtype=F64), None),
    ),
    (
        "newton",
        "line_search",
        lambda: inner.Newton(lambda x, _: torch.sqrt(1 + x**2).sum(), max_backtracks=1).solve(
            torch.full((1,), 2.0, dtype=F64), None
        ),
    ),
    (
        "newton",
        "saddle",
        lambda: inner.Newton(lambda x, _: (-(x**2) + 100 * x**4).sum(), max_backtracks=1).solve(
            _z(1), None
        ),
    ),
    ("lbfgs", "converged", lambda: inner.LBFGS(_quadratic, tol=1e-12).solve(_z(2), _B)),
    ("lbfgs", "maxiter", lambda: inner.LBFGS(_logreg(80, 6), maxiter=2).solve(_z(6), 0.05)),
    (
        "lbfgs",
        "stalled",
        lambda: inner.LBFGS(_logreg(300, 10), tol=1e-12, maxiter=2000).solve(_z(10), 1e-3),
    ),
    (
        "lbfgs",
        "line_search",
        lambda: inner.LBFGS(lambda x, _: (1e3 * x**2).sum(), max_linesearch=1).solve(
            torch.full((1,), 0.1, dtype=F64), None
        ),
    ),
]
WARNING = {
    "maxiter": hg.SolverStalledWarning,
    "stalled": hg.SolverStalledWarning,
    "line_search": hg.SolverStalledWarning,
    "diverged": hg.SolverDivergedWarning,
    "saddle": hg.SolverDivergedWarning,
}


def _hg_warnings(rec: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in rec if issubclass(w.category, hg.HypergradWarning)]


@pytest.mark.parametrize("solver,reason,solve", CASES, ids=[f"{s}-{r}" for s, r, _ in CASES])
def test_every_stop_has_a_reason_and_anything_but_convergence_warns(
    solver: str, reason: str, solve: Solve
) -> None:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        x, info = solve()
    assert info.solver == solver
    assert info.reason == reason, info
    assert info.converged == (reason == "converged")
    assert info.diverged == (reason == "diverged")
    assert torch.isfinite(torch.as_tensor(x)).all()
    got = _hg_warnings(rec)
    if reason == "converged":
        assert not got, [str(w.message) for w in got]
        assert info.residual <= info.tol
        return
    assert len(got) == 1, [str(w.message) for w in got]
    (w,) = got
    assert w.category is WARNING[reason]
    assert f"reason == '{reason}'" in str(w.message) and f"({solver})" in str(w.message)
    assert w.filename == __file__  # the user's line (the lambda above), not the library's
    if reason in ("maxiter", "stalled"):
        assert not info.residual <= info.tol or info.extras.get("model_residual", 0) > info.tol
    if reason in ("diverged", "line_search", "stalled", "saddle"):
        assert isinstance(info.extras["reason"], str) and info.extras["reason"]


def test_the_warning_shows_once_per_call_site() -> None:
    """The text is fixed per solver and reason, so the default filter shows it once per line."""
    T, b = _tanh()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("default")
        for _ in range(3):
            inner.FixedPoint(T, maxiter=2, tol=1e-12).solve(_z(20), b)  # the same line three times
        inner.FixedPoint(T, maxiter=3, tol=1e-12).solve(_z(20), b)  # another line
    got = _hg_warnings(rec)
    assert len(got) == 2 and len({w.lineno for w in got}) == 2
    assert "Raise maxiter" in str(got[0].message)


def test_the_wrappers_warn_at_the_users_run_line() -> None:
    T, b = _tanh()
    layer = inner.FixedPoint(T, maxiter=2, tol=1e-12)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        layer.run(_z(20), b.clone().requires_grad_(True))
    (w,) = [w for w in _hg_warnings(rec) if w.category is hg.SolverStalledWarning]
    assert w.filename == __file__
    assert layer.last_info is not None and layer.last_info.reason == "maxiter"


# ---------------------------------------------------------------------------------------------
# stalls: the tight-tolerance float64 runs stop early, at the floor of the residual


def test_lbfgs_stall_stops_early_at_the_floor() -> None:
    """On main this solve ran all 2,000 iterations (about 80,000 loss evaluations, 7 CPU-s
    here) and reported neither convergence nor a reason; the residual had stopped at 7e-12."""
    loss = _logreg(300, 10)
    with pytest.warns(hg.SolverStalledWarning, match="'stalled'"):
        x, info = inner.LBFGS(loss, tol=1e-12, maxiter=2000).solve(_z(10), 1e-3)
    assert info.reason == "stalled" and not info.converged
    assert info.iterations < 100 and info.evaluations < 2000
    # stalled at the solution: Newton's answer (which reaches 1e-14 here) to 1e-9
    ref, rinfo = inner.Newton(loss, tol=1e-13).solve(_z(10), 1e-3)
    assert rinfo.converged
    assert float((x - ref).norm() / ref.norm()) < 1e-9
    assert info.residual < 1e-10


def test_newton_stall_stops_before_maxiter() -> None:
    """On main Newton computed all 50 Hessians (maxiter) at a residual stuck at 1.6e-11."""
    loss = _logreg(300, 40, scale=5.0)
    with pytest.warns(hg.SolverStalledWarning, match="'stalled'"):
        x, info = inner.Newton(loss, tol=1e-12).solve(_z(40), 1e-6)
    assert info.reason == "stalled" and info.iterations < 30 and info.extras["hessians"] < 30
    g = torch.func.grad(loss)(x, 1e-6)
    assert float(g.norm()) / info.extras["reference"] == pytest.approx(info.residual, rel=1e-6)
    assert info.residual < 1e-10


@pytest.mark.parametrize("method", ["picard", "anderson"])
def test_fixed_point_below_rounding_stalls_instead_of_running_maxiter(method: str) -> None:
    T, b = _tanh(200)
    with pytest.warns(hg.SolverStalledWarning, match="'stalled'"):
        x, info = inner.FixedPoint(T, method=method, maxiter=3000, tol=1e-17).solve(_z(200), b)
    assert info.reason == "stalled" and info.iterations < 1000  # main: all 3000 (Picard)
    assert float((T(x, b) - x).norm() / x.norm()) < 1e-15  # at the solution, to rounding


@pytest.mark.parametrize("accelerated", [True, False])
def test_fista_below_rounding_stalls_instead_of_running_maxiter(accelerated: bool) -> None:
    f, _ = _lasso()
    with pytest.warns(hg.SolverStalledWarning, match="'stalled'"):
        _, info = inner.ProximalGradient(
            f, P, maxiter=3000, tol=1e-18, accelerated=accelerated
        ).solve(_z(15), (None, 0.05))
    assert info.reason == "stalled" and info.iterations < 1000 and info.residual < 1e-14


# ---------------------------------------------------------------------------------------------
# growth: a run-away iteration is diverged, not a slow convergence


def test_picard_run_away_is_diverged() -> None:
    """``x ↦ 3x + 1`` from 1: ``x_k = (3^(k+1) − 1) / 2``, 8e47 after 100 steps; main reported
    ``diverged=False`` and nothing until a backward pass warned about stationarity."""
    with pytest.warns(hg.SolverDivergedWarning, match="'diverged'"):
        x, info = inner.FixedPoint(lambda x, _: 3 * x + 1, method="picard", maxiter=100).solve(
            torch.ones(2, dtype=F64), None
        )
    assert info.diverged and info.reason == "diverged" and info.iterations == 100
    torch.testing.assert_close(x, torch.full((2,), (3.0**101 - 1) / 2, dtype=F64))
    assert "grew" in info.extras["reason"]
    # growth below the factor (2^30 for 2x + 1 in 30 steps) is a plain maxiter
    with pytest.warns(hg.SolverStalledWarning, match="'maxiter'"):
        _, info = inner.FixedPoint(lambda x, _: 2 * x + 1, method="picard", maxiter=30).solve(
            torch.ones(2, dtype=F64), None
        )
    assert info.reason == "maxiter" and not info.diverged


# ---------------------------------------------------------------------------------------------
# a loss steep at the origin cannot certify a point far from the minimiser


def _steep(x: torch.Tensor, _: Any) -> torch.Tensor:
    """``(x − 1)² + 1000 exp(−1000 x)``: minimiser 1 (to float64), ``|f'(0)| ≈ 1e6``, so the
    origin-relative residual at ``x = 1.1`` is ``0.2 / 1e6 = 2e-7`` (below the default tol)."""
    return ((x - 1) ** 2).sum() + 1e3 * torch.exp(-1e3 * x).sum()


@pytest.mark.parametrize(
    "name,solve",
    [
        ("lbfgs", lambda x0: inner.LBFGS(_steep, tol=1e-6).solve(x0, None)),
        ("newton", lambda x0: inner.Newton(_steep, tol=1e-6).solve(x0, None)),
        (
            "fista",
            lambda x0: inner.ProximalGradient(
                _steep, hg.prox.projection_non_negative, tol=1e-6, stepsize=0.25
            ).solve(x0, (None, None)),
        ),
        (
            "fista-ls",
            lambda x0: inner.ProximalGradient(
                _steep, hg.prox.projection_non_negative, tol=1e-6
            ).solve(x0, (None, None)),
        ),
    ],
)
def test_a_steep_origin_cannot_certify_a_wrong_point(name: str, solve: Callable) -> None:
    """On main each of these returned x0 = 1.1 after 0 iterations with converged=True."""
    x0 = torch.full((1,), 1.1, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hg.HypergradWarning)
        x, info = solve(x0)
    assert info.converged and info.iterations >= 1
    assert abs(float(x) - 1.0) < 1e-5
    assert info.residual < 1e-6 and info.extras["model_residual"] <= 1e-6
    # the model residual at 1.1: |f'(1.1)| / |f'(1.1) + f''(1.1)(0 − 1.1)| = 0.2 / 2 = 0.1
    _, at = inner.LBFGS(_steep, tol=1.0).solve(x0, None)
    assert at.iterations == 0 and at.extras["model_residual"] == pytest.approx(0.1, rel=1e-6)


@pytest.mark.parametrize("fn", [inner.Newton, inner.LBFGS])
def test_the_model_residual_of_a_quadratic_is_the_residual(fn: Callable) -> None:
    """For ``½xᵀAx − bᵀx`` both are ``||A(x − x*)|| / ||b||``: the rule is unchanged there."""
    x = torch.tensor([0.7, -0.3], dtype=F64)
    _, info = fn(_quadratic, tol=1e300).solve(x, _B)
    expect = float((_A @ x - _B).norm() / _B.norm())
    assert info.iterations == 0 and info.residual == pytest.approx(expect, rel=1e-12)
    assert info.extras["model_residual"] == pytest.approx(expect, rel=1e-8)


# ---------------------------------------------------------------------------------------------
# Newton at a stationary point that is not a minimum


def test_newton_leaves_a_maximum_for_the_minimiser() -> None:
    """``−x² + x⁴`` from its maximum 0 (main: returned 0 with converged=True): the minimisers
    are ``±1/√2``; the 2-D saddle ``x² − y² + y⁴`` at the origin: ``(0, ±1/√2)``."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", hg.HypergradWarning)
        x, info = inner.Newton(lambda x, _: (-(x**2) + x**4).sum(), tol=1e-12).solve(_z(1), None)
        assert info.converged and info.extras["escapes"] == 1
        assert abs(abs(float(x)) - 1 / math.sqrt(2)) < 1e-12
        assert info.extras["reference_point"] == "escape"
        v, info = inner.Newton(lambda v, _: v[0] ** 2 - v[1] ** 2 + v[1] ** 4, tol=1e-12).solve(
            _z(2), None
        )
        assert info.converged and info.extras["escapes"] == 1
        assert abs(float(v[0])) < 1e-12 and abs(abs(float(v[1])) - 1 / math.sqrt(2)) < 1e-12
        # a maximum away from the origin, x0 = (1, 1) of -(|x − 1|²) + |x − 1|⁴: radius 1/√2
        f = lambda v, _: -((v - 1) ** 2).sum() + ((v - 1) ** 2).sum() ** 2  # noqa: E731
        v, info = inner.Newton(f, tol=1e-12).solve(torch.ones(2, dtype=F64), None)
        assert info.converged and float((v - 1).norm()) == pytest.approx(2**-0.5, abs=1e-12)
    # a minimum is accepted at once (the curvature check costs one Hessian)
    _, info = inner.Newton(lambda x, _: ((x - 1) ** 2).sum()).solve(torch.ones(3, dtype=F64), None)
    assert info.converged and info.iterations == 0 and info.extras["hessians"] == 1


def test_newton_at_a_saddle_it_cannot_leave_reports_it() -> None:
    with pytest.warns(hg.SolverDivergedWarning, match="'saddle'"):
        x, info = inner.Newton(lambda x, _: (-(x**2) + 100 * x**4).sum(), max_backtracks=1).solve(
            _z(1), None
        )
    assert info.reason == "saddle" and not info.converged and float(x) == 0.0
    assert info.residual == 0.0  # the gradient test alone would have passed
    assert "-2" in info.extras["reason"]  # the Hessian's eigenvalue at 0


# ---------------------------------------------------------------------------------------------
# float32 / float64 mixes: a clear error naming the arguments


def _matmul_loss(x: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    return 0.5 * x @ A @ x - x.sum()


@pytest.mark.parametrize(
    "name,solve,what",
    [
        (
            "newton",
            lambda: inner.Newton(_matmul_loss).solve(torch.zeros(2, dtype=F32), _A),
            "hparams",
        ),
        (
            "lbfgs",
            lambda: inner.LBFGS(_matmul_loss).solve(torch.zeros(2, dtype=F32), _A),
            "hparams",
        ),
        (
            "fixed_point",
            lambda: inner.FixedPoint(lambda x, A: torch.tanh(0.1 * A @ x + 1)).solve(
                torch.zeros(2, dtype=F32), _A
            ),
            "hparams",
        ),
        (
            "fista",
            lambda: inner.ProximalGradient(_matmul_loss, P).solve(
                torch.zeros(2, dtype=F32), (_A, 0.1)
            ),
            "hparams_smooth",
        ),
        (
            "Newton.run",
            lambda: inner.Newton(_matmul_loss).run(
                torch.zeros(2, dtype=F32), _A.clone().requires_grad_(True)
            ),
            "hparams",
        ),
    ],
)
def test_mixed_dtypes_raise_a_clear_error(name: str, solve: Callable, what: str) -> None:
    with pytest.raises(hg.HypergradTypeError) as err:
        solve()
    msg = str(err.value)
    assert "x0 is torch.float32" in msg and f"{what} is torch.float64" in msg
    assert "one dtype" in msg
    assert isinstance(err.value, TypeError)


def test_a_closed_over_tensor_of_another_dtype_is_named_as_the_cause() -> None:
    with pytest.raises(hg.HypergradTypeError, match="closure"):
        inner.LBFGS(lambda x, _: _matmul_loss(x, _A)).solve(torch.zeros(2, dtype=F32), None)


def test_a_loss_that_promotes_still_works() -> None:
    """``(x − b)²`` with float32 ``x`` and float64 ``b`` promotes: not refused."""
    b = torch.tensor([1.0, 2.0], dtype=F64)
    for fn in (inner.Newton, inner.LBFGS):
        x, info = fn(lambda x, b: ((x - b) ** 2).sum()).solve(torch.zeros(2, dtype=F32), b)
        assert info.converged and x.dtype == F32
        torch.testing.assert_close(x, b.float())
