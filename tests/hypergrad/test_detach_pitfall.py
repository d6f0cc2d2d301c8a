"""The pitfall docs/modules.md shows: a .detach() inside the inner loss gives a wrong hypergradient
that converged solves cannot reveal, and hypergrad.testing catches it."""

from __future__ import annotations

import pytest
import torch

import hypergrad as hg
import hypergrad.testing as hgt

F64 = torch.float64


def _problem(detach: bool):
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(80, 3, generator=g, dtype=F64), torch.randn(80, generator=g, dtype=F64)
    Xv, yv = torch.randn(40, 3, generator=g, dtype=F64), torch.randn(40, generator=g, dtype=F64)

    def inner_loss(w, theta):
        losses = 0.5 * (X @ w - y) ** 2
        feature = losses.detach() if detach else losses
        weights = torch.sigmoid(theta[0] * feature + theta[1])
        return (weights * losses).mean() + 0.05 * (w**2).sum()

    def solve_inner(theta):  # Newton on the (possibly detached) gradient field: exact fixed point
        w = torch.zeros(3, dtype=F64)
        for _ in range(30):
            wr = w.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(inner_loss(wr, theta), wr)
            jac = torch.autograd.functional.jacobian(
                lambda v: torch.autograd.grad(inner_loss(v, theta), v, create_graph=True)[0], wr
            )
            w = w - torch.linalg.solve(jac, grad)
        return w

    def outer_loss(w, theta):
        return 0.5 * ((Xv @ w - yv) ** 2).mean()

    return solve_inner, inner_loss, outer_loss


THETA = torch.tensor([-0.5, 0.3], dtype=F64)


def test_without_detach_the_check_passes():
    report = hgt.check_hypergrad(*_problem(detach=False), THETA)
    assert report.passed, str(report)


def test_detach_is_invisible_to_the_solver_but_caught_by_the_check():
    solve_inner, inner, outer = _problem(detach=True)
    w = solve_inner(THETA)
    _, info = hg.implicit_grad(inner, outer, w, THETA, solver=hg.CG(tol=1e-12))
    assert info.solve.converged  # the solver cannot see the cut path
    report = hgt.check_hypergrad(solve_inner, inner, outer, THETA)
    assert not report.passed
    assert report.inner_ok  # blamed on the hypergradient, not on the inner solves
    assert "detach" in str(report)
    with pytest.raises(AssertionError, match="FAIL"):
        hgt.assert_hypergrad_close(solve_inner, inner, outer, THETA)
