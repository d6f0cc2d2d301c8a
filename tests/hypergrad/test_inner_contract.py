"""The properties every inner solver of ``hg.inner`` keeps, run over :data:`ALL_INNER`
(``tests/helpers.py``), as ``test_solver_contract.py`` does for the linear solvers: a report
that states only what was measured, warm starts, a reason for every stop, frozen settings,
and ``run``'s derivative against central finite differences of re-solved problems (float64)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hypergrad as hg
from hypergrad.inner._common import REASONS
from tests.helpers import ALL_INNER


def _solve(case, solver=None, x0=None, theta=None):
    solver = case.make() if solver is None else solver
    theta = case.theta if theta is None else theta
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, info = solver.solve(case.x0 if x0 is None else x0, case.hparams(theta))
    return x, info, [w.category for w in caught]


@pytest.mark.parametrize("case", ALL_INNER)
def test_converged_only_with_the_residual_within_tol_at_the_returned_point(case) -> None:
    solver = case.make()
    x, info, caught = _solve(case, solver)
    assert info.converged and info.reason == "converged" and not caught, (info, caught)
    true = case.residual(x, case.theta, info)
    assert true <= solver.tol * (1 + 1e-6) + 1e-15, (true, info.residual)
    assert info.residual == pytest.approx(true, rel=1e-6, abs=1e-15)
    # a budget too small to meet tol: not converged, said why and warned, residual still true
    x1, info1, caught1 = _solve(case, solver.replace(maxiter=1, tol=1e-15))
    assert not info1.converged and info1.reason != "converged" and caught1
    assert all(issubclass(c, hg.HypergradWarning) for c in caught1)
    assert info1.residual == pytest.approx(case.residual(x1, case.theta, info1), rel=1e-6)


@pytest.mark.parametrize("case", ALL_INNER)
def test_a_warm_start_from_a_solution_stops_at_once(case) -> None:
    solver = case.make()
    x, info, _ = _solve(case, solver)
    x2, info2, caught = _solve(case, solver, x0=x)
    assert info2.converged and info2.iterations == 0 and not caught, info2
    assert torch.equal(x2, x)


@pytest.mark.parametrize("case", ALL_INNER)
def test_every_stop_has_a_reason(case) -> None:
    solver = case.make()
    for variant in (solver, solver.replace(maxiter=1, tol=0.0), solver.replace(maxiter=3)):
        _, info, caught = _solve(case, variant)
        assert info.reason in REASONS, info
        assert info.converged == (info.reason == "converged")
        assert info.diverged == (info.reason == "diverged")
        assert bool(caught) == (info.reason != "converged"), (info.reason, caught)
        assert info.iterations <= variant.maxiter and info.residuals
        assert info.tol == variant.tol


@pytest.mark.parametrize("case", ALL_INNER)
def test_settings_are_frozen_and_replace_validates(case) -> None:
    solver = case.make()
    with pytest.raises(hg.FrozenSettingError, match="build a new"):
        solver.tol = float("inf")
    with pytest.raises(hg.FrozenSettingError):
        solver.maxiter = 0
    with pytest.raises(hg.HypergradValueError):
        solver.replace(maxiter=0)
    with pytest.raises(hg.HypergradValueError):
        solver.replace(tol=float("inf"))
    assert solver.replace(tol=1e-3).tol == 1e-3 and solver.tol != 1e-3


@pytest.mark.parametrize("case", ALL_INNER)
def test_run_gradient_equals_central_differences_of_resolved_problems(case) -> None:
    solver = case.make()
    theta = case.theta.clone().requires_grad_(True)
    c = torch.linspace(0.5, 1.5, case.x0.numel(), dtype=torch.float64)
    x = solver.run(case.x0, case.hparams(theta))
    (c @ x).backward()
    assert solver.last_info is not None and solver.last_info.converged
    assert solver.last_implicit_info is not None
    flat = case.theta.reshape(-1)
    fd = torch.zeros_like(flat)
    eps = 1e-6
    for i in range(flat.numel()):
        e = torch.zeros_like(flat)
        e[i] = eps
        plus, *_ = _solve(case, theta=(flat + e).reshape(case.theta.shape))
        minus, *_ = _solve(case, theta=(flat - e).reshape(case.theta.shape))
        fd[i] = (c @ plus - c @ minus) / (2 * eps)
    torch.testing.assert_close(theta.grad.reshape(-1), fd, rtol=1e-5, atol=1e-8)
