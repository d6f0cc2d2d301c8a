"""Linear solvers on explicit matrices, checked against dense float64 solves and closed forms.

Operators act on multi-leaf flat pytrees (tuples of tensors) through one *coupled* dense matrix,
so every block between leaves matters.
"""

import math
import warnings

import pytest
import torch
from helpers import rel as _rel

import hypergrad as hg
from hypergrad.solvers import (
    dense_matrix,
    power_iteration,
    solve_cg,
    solve_exact,
    solve_minres,
    solve_neumann,
    solve_nystrom,
)

F64 = torch.float64
SHAPES = [(3,), (2, 4), (5,)]  # 16 unknowns over three leaves


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _ortho(n, seed):
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=_gen(seed), dtype=F64))
    return q


def _matrix(eigs, seed):
    q = _ortho(len(eigs), seed)
    a = q @ torch.diag(torch.as_tensor(eigs, dtype=F64)) @ q.T
    return 0.5 * (a + a.T), q


def _ravel(v):
    return torch.cat([t.reshape(-1) for t in v])


def _unravel(vec, shapes=SHAPES):
    out, i = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(vec[i : i + n].reshape(s))
        i += n
    return tuple(out)


def _matvec(a, shapes=SHAPES):
    counter = {"n": 0}

    def mv(v):
        counter["n"] += 1
        return _unravel(a @ _ravel(v).to(a.dtype), shapes)

    return mv, counter


def _rhs(seed, n=16):
    return torch.randn(n, generator=_gen(seed), dtype=F64)


def _spd(seed, n=16, lo=0.5, hi=20.0):
    eigs = torch.linspace(lo, hi, n, dtype=F64)
    return _matrix(eigs, seed)[0]


# --------------------------------------------------------------------------- CG


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cg_spd_multileaf_matches_dense(seed):
    a = _spd(seed)
    b = _rhs(seed + 10)
    mv, cnt = _matvec(a)
    x, info = solve_cg(mv, _unravel(b), tol=1e-13, maxiter=200)
    ref = torch.linalg.solve(a, b)
    assert [t.shape for t in x] == [torch.Size(s) for s in SHAPES]
    assert _rel(_ravel(x), ref) < 1e-10
    assert info.converged and not info.diverged and info.solver == "cg"
    # one product more than iterations: convergence is verified with a recomputed residual
    assert info.matvecs == cnt["n"] == info.iterations + 1
    true_res = float(torch.linalg.norm(a @ _ravel(x) - b) / torch.linalg.norm(b))
    assert info.residual <= 1e-13 and true_res < 1e-11
    assert len(info.residuals) == info.iterations


def test_cg_class_and_damping():
    a = _spd(4)
    b = _rhs(5)
    mv, _ = _matvec(a)
    for d in (0.0, 0.3, 5.0):
        x, info = hg.CG(maxiter=200, tol=1e-13, damping=d).solve(mv, _unravel(b))
        ref = torch.linalg.solve(a + d * torch.eye(16, dtype=F64), b)
        assert _rel(_ravel(x), ref) < 1e-10
        assert info.converged


def test_cg_three_distinct_eigenvalues_converges_in_three_iterations():
    eigs = [1.0] * 6 + [4.0] * 5 + [9.0] * 5
    a, _ = _matrix(eigs, 7)
    b = _rhs(8)
    mv, _ = _matvec(a)
    x, info = solve_cg(mv, _unravel(b), tol=1e-10, maxiter=50)
    assert info.converged
    assert info.iterations <= 4
    assert _rel(_ravel(x), torch.linalg.solve(a, b)) < 1e-9


def test_cg_indefinite_sets_diverged_and_warns():
    eigs = torch.tensor(
        [-4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5, -0.6] + [0.5, 1.0, 1.5, 2.0, 1.0, 0.7, 0.8, 0.9],
        dtype=F64,
    )
    a, q = _matrix(eigs, 12)
    # b = Q 1 makes the very first curvature b^T A b = sum(eigs) < 0
    b = q @ torch.ones(16, dtype=F64)
    assert float(b @ a @ b) < 0
    mv, _ = _matvec(a)
    with pytest.warns(hg.SolverDivergedWarning, match="positive definite"):
        x, info = solve_cg(mv, _unravel(b), tol=1e-10, maxiter=100)
    assert info.diverged and not info.converged
    assert info.extras["negative_curvature"] <= 0


# --------------------------------------------------------------------------- MINRES


def _indefinite(seed):
    eigs = torch.cat(
        [-torch.linspace(0.5, 6.0, 7, dtype=F64), torch.linspace(0.4, 8.0, 9, dtype=F64)]
    )
    return _matrix(eigs, seed)[0]


@pytest.mark.parametrize("seed", [0, 1])
def test_minres_indefinite_multileaf_matches_dense(seed):
    a = _indefinite(seed + 20)
    b = _rhs(seed + 30)
    mv, cnt = _matvec(a)
    x, info = solve_minres(mv, _unravel(b), tol=1e-13, maxiter=300)
    ref = torch.linalg.solve(a, b)
    assert _rel(_ravel(x), ref) < 1e-9
    assert info.solver == "minres" and info.matvecs == cnt["n"]
    true_res = float(torch.linalg.norm(a @ _ravel(x) - b) / torch.linalg.norm(b))
    assert true_res < 1e-10
    # the residual history of MINRES is monotone non-increasing
    h = info.residuals
    assert len(h) == info.iterations >= 2
    assert all(h[i + 1] <= h[i] * (1 + 1e-12) for i in range(len(h) - 1))


def test_minres_spd_and_damping_and_reported_residual():
    a = _indefinite(40)
    b = _rhs(41)
    mv, _ = _matvec(a)
    d = 0.25  # no eigenvalue at -0.25, so A + dI stays nonsingular
    x, info = hg.MINRES(maxiter=300, tol=1e-12, damping=d).solve(mv, _unravel(b))
    ad = a + d * torch.eye(16, dtype=F64)
    assert _rel(_ravel(x), torch.linalg.solve(ad, b)) < 1e-9
    # a looser tolerance: the reported (recurrence) residual agrees with the true one
    x, info = solve_minres(mv, _unravel(b), tol=1e-4, maxiter=300)
    true_res = float(torch.linalg.norm(a @ _ravel(x) - b) / torch.linalg.norm(b))
    assert info.converged and info.residual <= 1e-4
    assert true_res == pytest.approx(info.residual, rel=1e-6)


def test_minres_on_cg_failure_case():
    eigs = torch.tensor(
        [-4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5, -0.6] + [0.5, 1.0, 1.5, 2.0, 1.0, 0.7, 0.8, 0.9],
        dtype=F64,
    )
    a, q = _matrix(eigs, 12)
    b = q @ torch.ones(16, dtype=F64)
    mv, _ = _matvec(a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, info = solve_minres(mv, _unravel(b), tol=1e-12, maxiter=200)
    assert info.converged and not info.diverged
    assert _rel(_ravel(x), torch.linalg.solve(a, b)) < 1e-9


# --------------------------------------------------------------------------- Neumann


def _neumann_ref(a, b, alpha, k):
    n = a.shape[0]
    m = torch.eye(n, dtype=F64) - alpha * a
    return torch.linalg.solve(
        a, (torch.eye(n, dtype=F64) - torch.linalg.matrix_power(m, k + 1)) @ b
    )


@pytest.mark.parametrize("k", [0, 1, 3, 10])
def test_neumann_equals_exact_truncated_series(k):
    a = _spd(50, lo=0.5, hi=10.0)
    b = _rhs(51)
    alpha = 0.13
    mv, cnt = _matvec(a)
    x, info = solve_neumann(mv, _unravel(b), maxiter=k, alpha=alpha)
    ref = _neumann_ref(a, b, alpha, k)
    assert _rel(_ravel(x), ref) < 1e-12
    assert info.alpha == alpha and info.iterations == k and info.matvecs == k == cnt["n"]
    assert not info.diverged
    true_res = float(torch.linalg.norm(b - a @ _ravel(x)) / torch.linalg.norm(b))
    # reported residual is an upper bound of the exact one ...
    assert info.residual >= true_res * (1 - 1e-12)
    # ... and equals it with exact_residual=True (one more product)
    mv2, cnt2 = _matvec(a)
    x2, info2 = solve_neumann(mv2, _unravel(b), maxiter=k, alpha=alpha, exact_residual=True)
    assert _rel(_ravel(x2), ref) < 1e-12
    assert info2.residual == pytest.approx(true_res, rel=1e-9)
    assert info2.matvecs == cnt2["n"] == k + 1


def test_neumann_class_with_damping_and_warm_start():
    a = _spd(52, lo=0.5, hi=10.0)
    b = _rhs(53)
    mv, _ = _matvec(a)
    d, alpha, k = 0.7, 0.08, 5
    x, info = hg.Neumann(maxiter=k, alpha=alpha, damping=d).solve(mv, _unravel(b))
    ad = a + d * torch.eye(16, dtype=F64)
    assert _rel(_ravel(x), _neumann_ref(ad, b, alpha, k)) < 1e-12
    # warm start: the series is applied to the residual b - A x0
    x0 = _rhs(54)
    x, info = solve_neumann(mv, _unravel(b), x0=_unravel(x0), maxiter=k, alpha=alpha)
    ref = x0 + _neumann_ref(a, b - a @ x0, alpha, k)
    assert _rel(_ravel(x), ref) < 1e-12


def test_neumann_converges_to_solution_with_many_steps():
    a = _spd(55, lo=1.0, hi=10.0)
    b = _rhs(56)
    mv, _ = _matvec(a)
    x, info = solve_neumann(mv, _unravel(b), maxiter=400, alpha=0.1, tol=1e-12)
    assert info.converged
    assert _rel(_ravel(x), torch.linalg.solve(a, b)) < 1e-10


def test_neumann_alpha_none_uses_power_iteration():
    eigs = torch.cat([torch.linspace(0.5, 5.0, 15, dtype=F64), torch.tensor([10.0], dtype=F64)])
    a, _ = _matrix(eigs, 57)
    lam_max = float(torch.linalg.eigvalsh(a).max())
    b = _rhs(58)
    mv, cnt = _matvec(a)
    x, info = solve_neumann(mv, _unravel(b), maxiter=7, alpha=None, power_iters=20)
    assert info.alpha == pytest.approx(1.0 / lam_max, rel=1e-6)
    assert info.extras["lambda_max"] == pytest.approx(lam_max, rel=1e-6)
    assert info.matvecs == cnt["n"] == 20 + 7
    assert _rel(_ravel(x), _neumann_ref(a, b, info.alpha, 7)) < 1e-10
    lam, spent = power_iteration(mv, _unravel(b), iters=30)
    assert lam == pytest.approx(lam_max, rel=1e-8) and spent == 30


def test_neumann_power_iteration_does_not_consume_global_rng():
    a = _spd(59)
    mv, _ = _matvec(a)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    solve_neumann(mv, _unravel(_rhs(60)), maxiter=2, alpha=None)
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)


def test_neumann_too_large_alpha_diverges_and_warns():
    a, q = _matrix(torch.linspace(0.5, 10.0, 16, dtype=F64), 61)
    b = q @ torch.ones(16, dtype=F64)  # equal weight on every eigenvector
    alpha = 3.0 / 10.0  # > 2 / lambda_max: |1 - alpha lambda_max| = 2
    mv, _ = _matvec(a)
    with pytest.warns(hg.SolverDivergedWarning, match="alpha"):
        x, info = solve_neumann(mv, _unravel(b), maxiter=50, alpha=alpha)
    assert info.diverged and not info.converged
    assert info.iterations < 50
    assert info.extras["growth"] > 1.0


@pytest.mark.parametrize("factor", [2.04, 2.2])
def test_neumann_slightly_too_large_alpha_diverges_and_warns(factor):
    # alpha just above 2 / lambda_max: the top eigencomponent grows by |1 - factor| per term.
    # For SPD A and 0 < alpha <= 2 / lambda_max the terms never grow, so any sustained growth
    # means divergence; after 300 terms the "solution" is off by orders of magnitude.
    a, q = _matrix(torch.linspace(0.5, 10.0, 16, dtype=F64), 61)
    b = q @ torch.ones(16, dtype=F64)
    mv, _ = _matvec(a)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, info = solve_neumann(mv, _unravel(b), maxiter=300, alpha=factor / 10.0)
    err = _rel(_ravel(x), torch.linalg.solve(a, b))
    if not info.diverged:
        # what is returned then is garbage: say so in the failure message
        pytest.fail(
            f"alpha={factor}/lambda_max: diverged=False, residual={info.residual:.3g}, "
            f"relative error of x={err:.3g}, warnings={len(caught)}"
        )
    assert any(issubclass(w.category, hg.SolverDivergedWarning) for w in caught)
    assert not info.converged


def test_neumann_alpha_none_on_slightly_indefinite_operator_is_flagged():
    # one small negative eigenvalue: the power iteration sees lambda_max > 0, and the negative
    # component then grows by (1 + 0.02 alpha) per term -- slowly, but without bound
    eigs = torch.cat([torch.tensor([-0.02], dtype=F64), torch.linspace(0.5, 10.0, 15, dtype=F64)])
    a, q = _matrix(eigs, 62)
    b = q @ torch.ones(16, dtype=F64)
    mv, _ = _matvec(a)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            x, info = solve_neumann(mv, _unravel(b), maxiter=500, alpha=None)
        except hg.HypergradValueError:
            return  # refusing the indefinite operator is also acceptable
    err = _rel(_ravel(x), torch.linalg.solve(a, b))
    if not info.diverged:  # the returned x is garbage (err > 1 here): it must be flagged
        pytest.fail(
            f"indefinite operator: diverged=False, residual={info.residual:.3g}, relative error "
            f"of x={err:.3g}, warnings={len(caught)}"
        )
    assert any(issubclass(w.category, hg.SolverDivergedWarning) for w in caught)


def test_neumann_negative_definite_alpha_none_raises():
    a = -_spd(62)
    mv, _ = _matvec(a)
    with pytest.raises(hg.HypergradValueError, match="not positive"):
        solve_neumann(mv, _unravel(_rhs(63)), maxiter=3, alpha=None)


# --------------------------------------------------------------------------- Exact / Nystrom


def test_exact_keeps_off_diagonal_blocks():
    a = _spd(70)
    # make sure the coupling between leaves is substantial
    assert float(a[:3, 3:].abs().max()) > 0.1
    b = _rhs(71)
    mv, cnt = _matvec(a)
    m = dense_matrix(mv, _unravel(b))
    torch.testing.assert_close(m, a, rtol=0, atol=1e-14)
    x, info = solve_exact(mv, _unravel(b))
    ref = torch.linalg.solve(a, b)
    assert _rel(_ravel(x), ref) < 1e-12
    # a block-diagonal solve (what keeping only per-leaf blocks gives) is far off
    blk = torch.block_diag(a[:3, :3], a[3:11, 3:11], a[11:, 11:])
    assert _rel(torch.linalg.solve(blk, b), ref) > 1e-2
    assert info.converged and info.solver == "exact" and info.matvecs == 16
    cond1 = float(torch.linalg.cond(a, 1))  # the estimate is a lower bound, within 3x
    assert cond1 / 3 <= info.extras["condition_number"] <= cond1 * (1 + 1e-10)


def _spectrum(n, smallest):
    """Eigenvalues 1 (n - 1 times) and ``smallest``."""
    return torch.cat([torch.ones(n - 1, dtype=F64), torch.tensor([smallest], dtype=F64)])


@pytest.mark.parametrize("kind", ["spd", "log_spectrum", "nonsymmetric", "near_singular"])
def test_condition_estimate_against_the_exact_1_norm_condition_number(kind):
    """Hager-Higham from the LU factors: never above cond_1 (to rounding), within 3x of it."""
    from hypergrad.solvers.exact import condition_estimate

    g = torch.Generator().manual_seed(5)
    n = 60
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    a = {
        "spd": _spd(78, n=n),
        "log_spectrum": q @ torch.diag(torch.logspace(0, -9, n, dtype=F64)) @ q.T,
        "nonsymmetric": torch.randn(n, n, generator=g, dtype=F64),
        "near_singular": q
        @ torch.diag(torch.cat([torch.ones(n - 1), torch.tensor([1e-15])]).to(F64))
        @ q.T,
    }[kind]
    est = condition_estimate(a, *torch.linalg.lu_factor(a))
    ref = float(torch.linalg.cond(a, 1))
    assert ref / 3 <= est <= ref * (1 + 1e-6), (est, ref)


def test_exact_warns_when_numerically_singular_only():
    g = torch.Generator().manual_seed(6)
    q, _ = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=F64))
    b = _unravel(_rhs(79))
    for smallest, warns in ((1e-6, False), (1e-15, True)):
        a = (
            q
            @ torch.diag(
                torch.cat([torch.ones(15, dtype=F64), torch.tensor([smallest], dtype=F64)])
            )
            @ q.T
        )
        mv, _ = _matvec(a)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, info = solve_exact(mv, b)
        singular = [w for w in caught if "numerically singular" in str(w.message)]
        assert bool(singular) == warns, (smallest, info.extras["condition_number"])


def test_exact_damping_and_float32_leaves():
    a = _spd(72)
    b = _rhs(73)
    mv, _ = _matvec(a)
    x, _ = hg.Exact(damping=0.4).solve(mv, _unravel(b))
    assert _rel(_ravel(x), torch.linalg.solve(a + 0.4 * torch.eye(16, dtype=F64), b)) < 1e-12
    a32 = a.float()
    mv32, _ = _matvec(a32)
    x32, _ = solve_exact(mv32, _unravel(b.float()))
    assert all(t.dtype == torch.float32 for t in x32)
    assert _rel(_ravel(x32).double(), torch.linalg.solve(a, b)) < 1e-5


def test_exact_singular_gives_the_least_squares_solution_and_warns():
    # an exactly singular matrix no longer raises: the minimum-norm least-squares solution,
    # reported singular (b has a component outside the range) with a SingularSystemWarning
    a = torch.zeros(16, 16, dtype=F64)
    a[:15, :15] = _spd(74, n=15)
    mv, _ = _matvec(a)
    b = _rhs(75)
    with pytest.warns(hg.SingularSystemWarning, match="singular"):
        x, info = solve_exact(mv, _unravel(b))
    ref = torch.linalg.pinv(a) @ b
    assert _rel(_ravel(x), ref) < 1e-12
    assert info.failure == "singular" and not info.converged and info.extras["method"] == "pinv"
    assert info.residual == pytest.approx(float(b[15].abs() / b.norm()), rel=1e-12)
    # b in the range: a solution exists (the minimum-norm one), no warning
    b[15] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, info = solve_exact(mv, _unravel(b))
    assert info.converged and info.failure is None and info.extras["numerical_rank"] == 15
    assert _rel(_ravel(x), torch.linalg.pinv(a) @ b) < 1e-12


def test_exact_refuses_too_large_systems():
    a = _spd(76)
    mv, _ = _matvec(a)
    with pytest.raises(hg.HypergradValueError, match="max_numel"):
        hg.Exact(max_numel=10).solve(mv, _unravel(_rhs(77)))


@pytest.mark.parametrize("rho", [1e-3, 0.5])
def test_nystrom_full_rank_is_exact_for_damped_system(rho):
    a = _spd(80, lo=0.2, hi=20.0)
    b = _rhs(81)
    mv, _ = _matvec(a)
    x, info = hg.Nystrom(rank=16, damping=rho).solve(mv, _unravel(b))
    ref = torch.linalg.solve(a + rho * torch.eye(16, dtype=F64), b)
    assert _rel(_ravel(x), ref) < 1e-8
    assert info.converged and info.extras["rank"] == 16
    # rank above the size is capped
    x2, info2 = solve_nystrom(mv, _unravel(b), rank=100, damping=rho)
    assert info2.extras["rank"] == 16 and _rel(_ravel(x2), ref) < 1e-8


def test_nystrom_low_rank_exact_on_low_rank_operator():
    # A of rank 4 (PSD): a rank-k Nystrom approximation with k >= 4 sampled columns that span
    # the range reproduces A, hence (A + rho I)^{-1} b exactly
    q = _ortho(16, 82)[:, :4]
    a = q @ torch.diag(torch.tensor([1.0, 2.0, 5.0, 9.0], dtype=F64)) @ q.T
    b = _rhs(83)
    mv, _ = _matvec(a)
    rho = 0.3
    x, info = solve_nystrom(mv, _unravel(b), rank=8, damping=rho)
    ref = torch.linalg.solve(a + rho * torch.eye(16, dtype=F64), b)
    assert _rel(_ravel(x), ref) < 1e-8
    true_res = float(torch.linalg.norm((a + rho * torch.eye(16, dtype=F64)) @ _ravel(x) - b))
    assert info.residual == pytest.approx(true_res / float(torch.linalg.norm(b)), abs=1e-12)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "make",
    [
        lambda: hg.CG(tol=-1.0),
        lambda: hg.CG(maxiter=-3),
        lambda: hg.CG(maxiter=2.5),
        lambda: hg.CG(damping=-0.1),
        lambda: hg.MINRES(tol=-1e-6),
        lambda: hg.MINRES(maxiter=True),
        lambda: hg.Neumann(maxiter=-1),
        lambda: hg.Neumann(alpha=0.0),
        lambda: hg.Neumann(alpha=-0.1),
        lambda: hg.Neumann(tol=float("nan")),
        lambda: hg.Exact(damping=-1.0),
        lambda: hg.Nystrom(rank=0),
        lambda: hg.Nystrom(damping=0.0),
    ],
)
def test_bad_solver_arguments(make):
    with pytest.raises(hg.HypergradValueError, match="must be"):
        make()


@pytest.mark.parametrize("solver", ["cg", "minres"])
@pytest.mark.parametrize("warm", [False, True])
def test_krylov_start_vectors_are_freed_during_the_iteration(monkeypatch, solver, warm):
    """The start's x (zeros) and r (b - A x0 for a warm start) must not outlive the first
    iterations: a frame that kept them held one or two parameter-sized vectors through the
    whole solve (+3.1 MiB of a 72.8 MiB peak on an 813k-parameter MLP)."""
    import weakref

    from hypergrad.solvers import krylov

    a = _spd(80, n=40)
    b = (_rhs(81, n=40),)
    starts = []
    real_zeros, real_residual = krylov.tree_zeros_like, krylov.recomputed_residual

    def zeros(x):
        out = real_zeros(x)
        starts.extend(weakref.ref(t) for t in out)
        return out

    def residual(*args, **kw):
        r, rel = real_residual(*args, **kw)
        if not starts:
            starts.extend(weakref.ref(t) for t in r)  # the warm start's residual
        return r, rel

    monkeypatch.setattr(krylov, "tree_zeros_like", zeros)
    monkeypatch.setattr(krylov, "recomputed_residual", residual)
    alive_at = []

    def mv(v):
        alive_at.append(sum(ref() is not None for ref in starts))
        return (a @ v[0],)

    x0 = (torch.full((40,), 0.1, dtype=F64),) if warm else None
    fn = solve_cg if solver == "cg" else solve_minres
    x, info = fn(mv, b, x0, maxiter=200, tol=1e-10)
    assert starts and info.converged
    torch.testing.assert_close(x[0], torch.linalg.solve(a, b[0]), rtol=1e-8, atol=1e-12)
    assert alive_at[4] == 0, alive_at[:6]  # gone after the first few products


# ---- Neumann's advice fitted to what the caller knows of the operator (issue 30, item 3) ----


class _Operator:
    """A matvec over one tensor, telling the solver what is known of the operator's symmetry
    (``symmetric``: True, False, or absent), as ``custom_root``'s products can."""

    def __init__(self, a, symmetric=...):
        self.a = a
        if symmetric is not ...:
            self.symmetric = symmetric

    def __call__(self, v):
        return self.a @ v


def _fixed_point_jacobian():
    """``I - dT/dx`` of a non-symmetric contraction ``T`` (spectral radius 0.6): what
    ``custom_fixed_point`` solves with; ``alpha = 1`` is the adjoint fixed-point iteration."""
    t = torch.tensor([[0.3, 0.5, 0.0], [-0.4, 0.2, 0.3], [0.1, -0.5, 0.4]], dtype=F64)
    return torch.eye(3, dtype=F64) - t


def _neumann_warning(solver, op, b, category):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _, info = solver.solve(op, b)
    texts = [str(w.message) for w in rec if issubclass(w.category, category)]
    assert len(texts) == 1, [(w.category, str(w.message)) for w in rec]
    return texts[0], info


def test_neumann_divergence_advice_on_a_non_symmetric_operator_names_gmres_not_minres():
    """On an operator that is not known to be symmetric (a fixed point's ``I - dT/dx``) the
    advice is a smaller explicit alpha, GMRES or BiCGStab: ``alpha=None`` and MINRES assume a
    symmetric operator (and ``custom_root``/``custom_fixed_point`` refuse both there)."""
    a = _fixed_point_jacobian()
    b = torch.ones(3, dtype=F64)
    text, info = _neumann_warning(
        hg.Neumann(maxiter=30, alpha=3.0), _Operator(a, False), b, hg.SolverDivergedWarning
    )
    assert info.failure == "diverged"
    assert "lower alpha" in text and "GMRES" in text and "BiCGStab" in text
    assert "pass alpha=None" not in text and "use MINRES" not in text
    # the advice is right: alpha = 1 (smaller) converges, and so does GMRES
    x, info = hg.Neumann(maxiter=200, alpha=1.0, tol=1e-10).solve(_Operator(a, False), b)
    assert info.converged and _rel(x, torch.linalg.solve(a, b)) < 1e-9
    x, info = hg.GMRES(tol=1e-12).solve(_Operator(a, False), b)
    assert info.converged and _rel(x, torch.linalg.solve(a, b)) < 1e-10


def test_neumann_divergence_advice_on_a_symmetric_operator_keeps_alpha_none_and_minres():
    a = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=F64))
    b = torch.ones(3, dtype=F64)
    text, _ = _neumann_warning(
        hg.Neumann(maxiter=30, alpha=1.0), _Operator(a, True), b, hg.SolverDivergedWarning
    )
    assert "pass alpha=None" in text and "MINRES" in text and "GMRES" not in text


def test_neumann_divergence_advice_when_nothing_is_known_names_both_kinds():
    a = _fixed_point_jacobian()
    b = torch.ones(3, dtype=F64)
    text, _ = _neumann_warning(
        hg.Neumann(maxiter=30, alpha=3.0), _Operator(a), b, hg.SolverDivergedWarning
    )
    assert "GMRES" in text and "BiCGStab" in text
    assert "for a symmetric one, alpha=None" in text and "MINRES" in text


def test_neumann_stall_advice_on_a_non_symmetric_operator_names_gmres_not_minres():
    """A nilpotent non-symmetric operator (``A e_1 = e_2``, ``A e_2 = 0``) with ``b = e_2``: the
    system is solvable (``x = e_1``) but ``A b = 0``, so every term of the series equals ``b``
    and the series stalls. The warning advises GMRES (which reports singular systems), not
    MINRES (refused for a non-symmetric operator)."""
    a = torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=F64)
    b = torch.tensor([0.0, 1.0], dtype=F64)
    text, info = _neumann_warning(
        hg.Neumann(maxiter=10, alpha=0.5), _Operator(a, False), b, hg.SolverStalledWarning
    )
    assert info.failure == "stalled"
    assert "GMRES" in text and "MINRES" not in text
    text, _ = _neumann_warning(
        hg.Neumann(maxiter=10, alpha=0.5), _Operator(a, True), b, hg.SolverStalledWarning
    )
    assert "MINRES" in text and "GMRES" not in text


def test_neumann_alpha_none_error_on_a_non_symmetric_operator_names_gmres():
    a = -torch.eye(3, dtype=F64) + 0.1 * torch.triu(torch.ones(3, 3, dtype=F64), 1)
    with pytest.raises(hg.HypergradValueError, match="not positive definite") as err:
        hg.Neumann(maxiter=3).solve(_Operator(a, False), torch.ones(3, dtype=F64))
    assert "GMRES" in str(err.value) and "MINRES" not in str(err.value)
