"""A solve's report is the truth: recomputed residuals, singular systems, stalled series.

Every number is checked against an independent dense float64 reference computed here: the
Hessian from ``torch.autograd.functional.hessian``, the true relative residual ``||Hx - b||/||b||``
of the returned adjoint ``x``, and the least-squares floor ``||(I - H H^+) b||/||b||`` (the
smallest residual any ``x`` can reach) from ``torch.linalg.pinv``.
"""

import math
import warnings

import numpy as np
import pytest
import torch

import hypergrad as hg
from hypergrad.solvers import power_iteration, solve_cg, solve_minres, solve_neumann

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- references


def _hessian(inner, w, lam):
    return torch.autograd.functional.hessian(lambda v: inner(v, lam), w).reshape(w.numel(), -1)


def _outer_grad(outer, w, lam):
    w = w.detach().clone().requires_grad_(True)
    return torch.autograd.grad(outer(w, lam), w)[0].reshape(-1)


def _true_residual(h, x, b):
    return float(torch.linalg.norm(h @ x.reshape(-1) - b) / torch.linalg.norm(b))


def _lstsq_floor(h, b):
    """Smallest relative residual any x reaches: ||(I - H H^+) b|| / ||b||."""
    x = torch.linalg.pinv(h, hermitian=True) @ b
    return float(torch.linalg.norm(h @ x - b) / torch.linalg.norm(b)), x


def _mixed_t(inner, w, lam, x):
    """(d^2 L_in / d lam d w) x, the indirect part of the hypergradient, by autograd."""
    w = w.detach().clone().requires_grad_(True)
    lam = lam.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(inner(w, lam), w, create_graph=True)
    (m,) = torch.autograd.grad(g, lam, x.reshape(w.shape))
    return m


def _record(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w.category for w in caught], [str(w.message) for w in caught]


# --------------------------------------------------------------------------- problems


def _zero_hessian_problem():
    """Inner loss linear (piecewise) in w: its Hessian is exactly zero."""
    g = _gen(0)
    X = torch.randn(20, 3, generator=g, dtype=F64)
    w = torch.randn(3, generator=g, dtype=F64)
    lam = torch.tensor([0.3, 0.2, 0.1], dtype=F64)

    def inner(w, lam):
        return torch.relu(X @ w).sum() + (lam * w).sum()

    def outer(w, lam):
        return 0.5 * ((w - 1.0) ** 2).sum()

    return inner, outer, w, lam


def _dead_coordinate_problem(dtype=F64):
    """w[2] enters the inner loss only as ``0 * w[2]``; the outer loss depends on it."""
    g = _gen(1)
    X = torch.randn(20, 2, generator=g, dtype=F64)
    y = torch.randn(20, generator=g, dtype=F64)
    lam = torch.tensor(0.5, dtype=F64)
    w2 = torch.linalg.solve(X.T @ X / 20 + 0.5 * torch.eye(2, dtype=F64), X.T @ y / 20)
    w = torch.cat([w2, torch.tensor([0.5], dtype=F64)])
    X, y, w, lam = X.to(dtype), y.to(dtype), w.to(dtype), lam.to(dtype)

    def inner(w, lam):
        return 0.5 * ((X @ w[:2] - y) ** 2).mean() + 0.5 * lam * (w[:2] ** 2).sum() + 0 * w[2]

    def outer(w, lam):
        return ((X @ w[:2] - 1.0) ** 2).mean() + (w[2] - 3.0) ** 2

    return inner, outer, w, lam


def _duplicated_column_problem(dtype=F64):
    """Ridge regression with a duplicated feature column whose direction is not penalised."""
    g = _gen(2)
    X = torch.randn(30, 4, generator=g, dtype=F64)
    Xd = torch.cat([X, X[:, :1]], dim=1)  # column 4 == column 0: X^T X is singular
    y = torch.randn(30, generator=g, dtype=F64)
    Xv = torch.randn(10, 5, generator=g, dtype=F64)
    yv = torch.randn(10, generator=g, dtype=F64)
    lam = torch.tensor(0.1, dtype=F64)
    pen = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0], dtype=F64)  # w[0], w[4] not penalised
    h = Xd.T @ Xd + lam * torch.diag(pen)
    w = torch.linalg.pinv(h) @ (Xd.T @ y)  # a stationary point of the inner loss
    Xd, y, Xv, yv, lam, pen, w = (t.to(dtype) for t in (Xd, y, Xv, yv, lam, pen, w))

    def inner(w, lam):
        return 0.5 * ((Xd @ w - y) ** 2).sum() + 0.5 * lam * (pen * w**2).sum()

    def outer(w, lam):
        return 0.5 * ((Xv @ w - yv) ** 2).sum()

    return inner, outer, w, lam


def _spd(n, eigs, seed):
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=_gen(seed), dtype=F64))
    return q @ torch.diag(torch.as_tensor(eigs, dtype=F64)) @ q.T


def _mv(a):
    return lambda v: (a @ v[0].to(a.dtype),)


# --------------------------------------------------------------------------- 1. MINRES


def test_minres_zero_hessian_is_singular_not_converged():
    inner, outer, w, lam = _zero_hessian_problem()
    h, b = _hessian(inner, w, lam), _outer_grad(outer, w, lam)
    assert float(h.abs().max()) == 0.0  # the reference: H = 0
    (g, info), cats, msgs = _record(
        lambda: hg.implicit_grad(inner, outer, w, lam, solver=hg.MINRES())
    )
    s = info.solve
    x = info.extras["adjoint"]
    true_res = _true_residual(h, x, b)
    assert true_res == pytest.approx(1.0, abs=1e-15)
    assert s.residual == pytest.approx(true_res, rel=1e-12)
    assert not s.converged and s.extras["singular"] and s.extras["zero_operator"]
    floor, x_ls = _lstsq_floor(h, b)
    assert s.extras["lstsq_residual"] == pytest.approx(floor, rel=1e-12)
    # x is the minimum-norm least-squares solution (zero) and the indirect term vanishes
    torch.testing.assert_close(x, x_ls, rtol=0, atol=0)
    assert hg.SingularSystemWarning in cats and any("zero" in m for m in msgs)


@pytest.mark.parametrize("solver", [hg.MINRES(maxiter=10**6, tol=1e-12), hg.MINRES()])
def test_minres_dead_coordinate_reports_least_squares_floor(solver):
    inner, outer, w, lam = _dead_coordinate_problem()
    h, b = _hessian(inner, w, lam), _outer_grad(outer, w, lam)
    assert torch.linalg.matrix_rank(h) == 2  # exactly singular
    (g, info), cats, _ = _record(lambda: hg.implicit_grad(inner, outer, w, lam, solver=solver))
    s, x = info.solve, info.extras["adjoint"]
    floor, x_ls = _lstsq_floor(h, b)
    true_res = _true_residual(h, x, b)
    assert floor > 0.5  # inconsistent: no x solves H x = b
    assert s.residual == pytest.approx(true_res, rel=1e-9)  # the recomputed residual
    assert s.residual >= floor * (1 - 1e-12)  # never below what is achievable
    assert true_res == pytest.approx(floor, rel=1e-9)  # x is a least-squares solution
    assert s.extras["lstsq_residual"] == pytest.approx(floor, rel=1e-9)
    assert not s.converged and s.extras["singular"] and s.iterations <= 4
    assert hg.SingularSystemWarning in cats
    # lam only touches the identifiable block, so the hypergradient of every least-squares
    # solution is the pseudo-inverse one
    ref = -_mixed_t(inner, w, lam, x_ls)
    torch.testing.assert_close(g, ref, rtol=1e-9, atol=1e-12)


def test_minres_duplicated_column_ridge_reports_least_squares_floor():
    inner, outer, w, lam = _duplicated_column_problem()
    h, b = _hessian(inner, w, lam), _outer_grad(outer, w, lam)
    assert torch.linalg.matrix_rank(h) == 4
    (g, info), cats, _ = _record(
        lambda: hg.implicit_grad(inner, outer, w, lam, solver=hg.MINRES(tol=1e-12))
    )
    s, x = info.solve, info.extras["adjoint"]
    floor, x_ls = _lstsq_floor(h, b)
    true_res = _true_residual(h, x, b)
    assert floor > 1e-2
    assert s.residual == pytest.approx(true_res, rel=1e-6)
    assert true_res == pytest.approx(floor, rel=1e-6)
    assert s.extras["lstsq_residual"] == pytest.approx(floor, rel=1e-6)
    assert not s.converged and s.extras["singular"]
    assert hg.SingularSystemWarning in cats
    # the null direction (e0 - e4) is not penalised: every least-squares solution gives the
    # same hypergradient, the pseudo-inverse one
    torch.testing.assert_close(g, -_mixed_t(inner, w, lam, x_ls), rtol=1e-7, atol=1e-10)


def test_minres_singular_detection_in_float32():
    inner, outer, w, lam = _duplicated_column_problem(torch.float32)
    (g, info), cats, _ = _record(
        lambda: hg.implicit_grad(inner, outer, w, lam, solver=hg.MINRES(tol=1e-6))
    )
    w64, lam64 = w.double(), lam.double()
    inner64, outer64, _, _ = _duplicated_column_problem()
    h, b = _hessian(inner64, w64, lam64), _outer_grad(outer64, w64, lam64)
    floor, _ = _lstsq_floor(h, b)
    true_res = _true_residual(h, info.extras["adjoint"].double(), b)
    assert info.solve.residual == pytest.approx(true_res, rel=1e-3)
    assert true_res == pytest.approx(floor, rel=1e-3)
    assert not info.solve.converged and info.solve.extras["singular"]
    assert hg.SingularSystemWarning in cats


def test_minres_and_cg_report_the_recomputed_residual():
    a = _spd(16, torch.linspace(0.5, 20.0, 16), 3)
    b = torch.randn(16, generator=_gen(4), dtype=F64)
    calls = {"n": 0}

    def mv(v):
        calls["n"] += 1
        return (a @ v[0],)

    for solve in (solve_minres, solve_cg):
        calls["n"] = 0
        x, info = solve(mv, (b,), tol=1e-8, maxiter=100)
        true_res = float(torch.linalg.norm(a @ x[0] - b) / torch.linalg.norm(b))
        assert info.converged and true_res <= 1e-8
        assert info.residual == pytest.approx(true_res, rel=1e-12)  # the recomputed value
        assert info.matvecs == calls["n"] == info.iterations + 1  # the check is counted
        assert info.extras["residual_verified"] is True
        assert "recurrence_residual" in info.extras
        torch.testing.assert_close(x[0], torch.linalg.solve(a, b), rtol=1e-6, atol=0)


@pytest.mark.parametrize("lo", [1e-8, 1e-11])
def test_minres_ill_conditioned_nonsingular_is_not_called_singular(lo):
    # condition numbers 2e8 / 2e11 are not singularity. At 2e8 the recurrence residual drifts
    # from the true one (by ~300x here): the recomputed check restarts MINRES, which then
    # converges. At 2e11, tol=1e-6 is at the edge of what float64 can reach: whatever happens,
    # the report must be the recomputed residual and must not claim singularity.
    eigs = torch.cat([torch.logspace(math.log10(lo), 0, 15, dtype=F64), torch.tensor([-0.5])])
    a = _spd(16, eigs, 5)
    b = torch.randn(16, generator=_gen(6), dtype=F64)
    (x, info), cats, _ = _record(lambda: hg.MINRES(maxiter=2000, tol=1e-6).solve(_mv(a), (b,)))
    true_res = float(torch.linalg.norm(a @ x[0] - b) / torch.linalg.norm(b))
    assert info.residual == pytest.approx(true_res, rel=1e-9)
    assert not info.extras["singular"] and hg.SingularSystemWarning not in cats
    assert info.converged == (true_res <= 1e-6)
    if lo == 1e-8:
        assert info.converged and not cats and info.extras["restarts"] >= 1
        torch.testing.assert_close(x[0], torch.linalg.solve(a, b), rtol=1e-5, atol=0)
    elif not info.converged:  # the miss is reported, with a warning
        assert info.extras["residual_mismatch"] and hg.HypergradWarning in cats


def test_minres_singular_but_consistent_system_converges():
    # b in the range of a singular A: a solution exists, MINRES finds it without complaint
    eigs = torch.cat([torch.zeros(4, dtype=F64), torch.linspace(1.0, 5.0, 12, dtype=F64)])
    a = _spd(16, eigs, 7)
    b = a @ torch.randn(16, generator=_gen(8), dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, info = hg.MINRES(tol=1e-10).solve(_mv(a), (b,))
    true_res = float(torch.linalg.norm(a @ x[0] - b) / torch.linalg.norm(b))
    assert info.converged and true_res <= 1e-10
    assert info.residual == pytest.approx(true_res, rel=1e-12)
    # x0 = 0 keeps the iterates in range(A): x is the minimum-norm solution
    torch.testing.assert_close(x[0], torch.linalg.pinv(a, hermitian=True) @ b, rtol=1e-8, atol=0)


def test_minres_inconsistent_explicit_matrix_matches_lstsq():
    eigs = torch.cat(
        [
            torch.zeros(3, dtype=F64),  # a 3-dimensional null space
            -torch.linspace(0.5, 4.0, 6, dtype=F64),  # indefinite
            torch.linspace(0.7, 6.0, 7, dtype=F64),
        ]
    )
    a = _spd(16, eigs, 9)
    b = torch.randn(16, generator=_gen(10), dtype=F64)
    (x, info), cats, _ = _record(lambda: solve_minres(_mv(a), (b,), tol=1e-10, maxiter=500))
    floor, x_ls = _lstsq_floor(a, b)
    true_res = float(torch.linalg.norm(a @ x[0] - b) / torch.linalg.norm(b))
    assert info.residual == pytest.approx(true_res, rel=1e-12)
    assert true_res == pytest.approx(floor, rel=1e-8)
    assert info.extras["singular"] and not info.converged
    assert info.extras["lstsq_residual"] == pytest.approx(floor, rel=1e-8)
    # x0 = 0: the Krylov space contains the component of b in the null space, so x differs
    # from the minimum-norm solution only there
    p_range = a @ torch.linalg.pinv(a, hermitian=True)
    torch.testing.assert_close(p_range @ x[0], x_ls, rtol=1e-8, atol=1e-10)
    assert hg.SingularSystemWarning in cats


# --------------------------------------------------------------------------- 2. Neumann


def test_neumann_zero_hessian_is_stalled_and_warned():
    inner, outer, w, lam = _zero_hessian_problem()
    h, b = _hessian(inner, w, lam), _outer_grad(outer, w, lam)
    alpha, k = 0.1, 5
    (g, info), cats, msgs = _record(
        lambda: hg.implicit_grad(inner, outer, w, lam, solver=hg.Neumann(maxiter=k, alpha=alpha))
    )
    s, x = info.solve, info.extras["adjoint"]
    # the series is still the truncated series (alpha (K+1) b for H = 0) ...
    torch.testing.assert_close(x, alpha * (k + 1) * b, rtol=1e-15, atol=0)
    # ... but it is reported as a failure
    assert s.extras["stalled"] and not s.converged
    assert s.residual == pytest.approx(_true_residual(h, x, b), rel=1e-12)  # = 1
    assert hg.SolverStalledWarning in cats and any("shrink" in m for m in msgs)


def test_neumann_null_component_stalls_after_range_converges():
    # A = diag(1, 0.5, 0): the range part contracts, the null part of b never does
    a = torch.diag(torch.tensor([1.0, 0.5, 0.0], dtype=F64))
    b = torch.tensor([1.0, 2.0, 0.3], dtype=F64)
    (x, info), cats, _ = _record(lambda: solve_neumann(_mv(a), (b,), maxiter=60, alpha=0.5))
    m = torch.eye(3, dtype=F64) - 0.5 * a
    ref = 0.5 * sum(torch.linalg.matrix_power(m, j) @ b for j in range(61))
    torch.testing.assert_close(x[0], ref, rtol=1e-14, atol=0)
    assert info.extras["stalled"] and not info.converged
    assert info.extras["contraction"] == pytest.approx(1.0, abs=1e-12)
    assert hg.SolverStalledWarning in cats


def test_neumann_slow_but_contracting_series_is_not_stalled():
    a = 1e-3 * torch.eye(4, dtype=F64)  # ratio 1 - 1e-4 per term: slow, but contracting
    b = torch.randn(4, generator=_gen(11), dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, info = solve_neumann(_mv(a), (b,), maxiter=8, alpha=0.1, exact_residual=True)
    true_res = float(torch.linalg.norm(a @ x[0] - b) / torch.linalg.norm(b))
    assert not info.extras["stalled"] and not info.diverged
    assert info.residual == pytest.approx(true_res, rel=1e-9)
    assert true_res == pytest.approx((1 - 1e-4) ** 9, rel=1e-12)


def test_neumann_tol_convergence_is_verified():
    a = _spd(8, torch.linspace(1.0, 4.0, 8), 12)
    b = torch.randn(8, generator=_gen(13), dtype=F64)
    x, info = solve_neumann(_mv(a), (b,), maxiter=500, alpha=0.25, tol=1e-10)
    true_res = float(torch.linalg.norm(a @ x[0] - b) / torch.linalg.norm(b))
    assert info.converged and true_res <= 1e-10
    assert info.residual == pytest.approx(true_res, rel=1e-12)
    assert info.extras["residual_verified"] is True and not info.extras["residual_is_bound"]


# --------------------------------------------------------------------------- 3. settings


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: hg.CG(maxiter=0), r"CG maxiter must be .*>= 1"),
        (lambda: hg.MINRES(maxiter=0), r"MINRES maxiter must be .*>= 1"),
        (lambda: hg.CG(tol=float("inf")), r"CG tol must be >= 0 and finite"),
        (lambda: hg.MINRES(tol=float("nan")), r"MINRES tol must be >= 0 and finite"),
        (lambda: hg.CG(damping=float("inf")), r"CG damping must be >= 0 and finite"),
        (lambda: hg.MINRES(damping=-1.0), r"MINRES damping must be >= 0"),
        (lambda: hg.Neumann(alpha=float("inf")), r"Neumann alpha must be > 0 and finite"),
        (lambda: hg.Neumann(tol=float("inf")), r"Neumann tol must be >= 0 and finite"),
        (lambda: hg.Neumann(damping=float("nan")), r"Neumann damping must be >= 0 and finite"),
        (lambda: hg.Neumann(maxiter=None), r"Neumann maxiter must be a non-negative int"),
        (lambda: hg.Exact(damping=float("inf")), r"Exact damping must be >= 0 and finite"),
        (lambda: hg.Nystrom(damping=float("inf")), r"Nystrom damping must be > 0 and finite"),
        (lambda: hg.Nystrom(tol=-1.0), r"Nystrom tol must be >= 0"),
        (lambda: hg.CG(tol=True), r"CG tol must be a number"),
    ],
)
def test_settings_without_a_hypergradient_are_refused(make, match):
    with pytest.raises(hg.HypergradValueError, match=match):
        make()


def test_numpy_scalars_are_accepted_and_solve_correctly():
    a = _spd(6, torch.linspace(1.0, 3.0, 6), 14)
    b = torch.randn(6, generator=_gen(15), dtype=F64)
    ref = torch.linalg.solve(a + 0.5 * torch.eye(6, dtype=F64), b)
    for solver in (
        hg.CG(maxiter=np.int64(50), tol=np.float64(1e-12), damping=np.float32(0.5)),
        hg.MINRES(maxiter=np.int32(50), tol=np.float64(1e-12), damping=np.float64(0.5)),
        hg.Neumann(maxiter=np.int64(300), alpha=np.float64(0.25), damping=0.5, tol=1e-13),
        hg.Nystrom(rank=np.int64(6), damping=np.float64(0.5)),
    ):
        x, info = solver.solve(_mv(a), (b,))
        torch.testing.assert_close(x[0], ref, rtol=1e-9, atol=0)
        assert info.converged


def test_neumann_steps_zero_is_the_first_term():
    a = _spd(5, torch.linspace(1.0, 3.0, 5), 16)
    b = torch.randn(5, generator=_gen(17), dtype=F64)
    x, info = hg.Neumann(maxiter=0, alpha=0.3).solve(_mv(a), (b,))
    torch.testing.assert_close(x[0], 0.3 * b, rtol=0, atol=0)
    assert info.iterations == 0 and info.matvecs == 0 and not info.converged


# --------------------------------------------------------------------------- 4. errors


def _ridge():
    g = _gen(18)
    X = torch.randn(12, 3, generator=g, dtype=F64)
    y = torch.randn(12, generator=g, dtype=F64)
    lam = torch.tensor(0.5, dtype=F64)
    w = torch.linalg.solve(X.T @ X / 12 + lam * torch.eye(3, dtype=F64), X.T @ y / 12)

    def inner(w, lam):
        return 0.5 * ((X @ w - y) ** 2).mean() + 0.5 * lam * (w**2).sum()

    def outer(w, lam):
        return 0.5 * ((X @ w) ** 2).mean()

    return inner, outer, w, lam


@pytest.mark.parametrize(
    "x0,match",
    [
        (torch.zeros(3, dtype=torch.float32), r"x0 .*dtype torch.float32.*params .*float64"),
        (torch.zeros(3, dtype=F64, device="meta"), r"x0 .*device meta.*params .*cpu"),
        (torch.full((3,), float("nan"), dtype=F64), r"x0 contains NaN or Inf"),
        ((torch.zeros(3, dtype=F64),), r"x0 must have the structure"),
    ],
)
def test_bad_warm_start_names_x0(x0, match):
    inner, outer, w, lam = _ridge()
    with pytest.raises(hg.HypergradError, match=match):
        hg.implicit_grad(inner, outer, w, lam, solver=hg.CG(tol=1e-10), x0=x0)


def test_good_warm_start_matches_dense_reference():
    inner, outer, w, lam = _ridge()
    h, b = _hessian(inner, w, lam), _outer_grad(outer, w, lam)
    x_ref = torch.linalg.solve(h, b)
    g, info = hg.implicit_grad(inner, outer, w, lam, solver=hg.CG(tol=1e-12), x0=0.9 * x_ref)
    torch.testing.assert_close(g, -_mixed_t(inner, w, lam, x_ref), rtol=1e-9, atol=1e-14)


def _nan_hessian_problem():
    """``w[0] ** 1.5`` at ``w[0] = 0``: finite loss and gradient, infinite second derivative."""
    lam = torch.tensor(0.5, dtype=F64)
    w = torch.tensor([0.0, 0.4, -0.2], dtype=F64)

    def inner(w, lam):
        return w[0] ** 1.5 + 0.5 * lam * (w**2).sum()

    def outer(w, lam):
        return ((w - 1.0) ** 2).sum()

    return inner, outer, w, lam


@pytest.mark.parametrize(
    "solver,name",
    [
        (hg.CG(), "CG"),
        (hg.MINRES(), "MINRES"),
        (hg.Neumann(maxiter=3), "Neumann"),
        (hg.Neumann(maxiter=3, alpha=0.1), "Neumann"),
        (hg.Exact(), "Exact"),
        (hg.Nystrom(rank=3, damping=0.1), "Nystrom"),
    ],
)
def test_nan_hessian_vector_product_is_named(solver, name):
    inner, outer, w, lam = _nan_hessian_problem()
    h = _hessian(inner, w, lam)
    assert not bool(torch.isfinite(h).all())  # the reference Hessian is not finite
    with pytest.raises(hg.HypergradValueError, match=rf"{name}.*Hessian-vector product") as exc:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hg.implicit_grad(inner, outer, w, lam, solver=solver)
    msg = str(exc.value)
    assert "NaN/Inf" in msg and "positive definite" not in msg
    assert ("iteration" in msg) or ("column" in msg)


def test_power_iteration_nan_is_named():
    a = torch.tensor([[1.0, float("nan")], [float("nan"), 2.0]], dtype=F64)
    with pytest.raises(hg.HypergradValueError, match=r"power iteration 1 .*NaN/Inf"):
        power_iteration(_mv(a), (torch.zeros(2, dtype=F64),))
