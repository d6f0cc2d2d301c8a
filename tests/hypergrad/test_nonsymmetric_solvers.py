"""GMRES and BiCGStab (and Exact) on non-symmetric systems, checked against dense solves.

Operators act on flat pytrees of two tensors through one coupled dense matrix. Each report is
checked for honesty: ``converged`` only with a recomputed residual that met ``tol``, singular
inconsistent systems reported (``SolveInfo.failure``) and warned about, bad settings refused.
"""

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hypergrad as hg
from hypergrad.solvers import solve_bicgstab, solve_exact, solve_gmres
from hypergrad.solvers.base import DISPLAY_NAMES

F64 = torch.float64
HYP = settings(max_examples=30, deadline=None)
SOLVERS = {"gmres": solve_gmres, "bicgstab": solve_bicgstab}
CLASSES = {"gmres": hg.GMRES, "bicgstab": hg.BiCGStab}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _like(n, dtype=F64):
    """A flat pytree of two tensors with ``n`` elements in all (one leaf when n == 1)."""
    if n == 1:
        return (torch.zeros(1, dtype=dtype),)
    k = n // 2
    return (torch.zeros(k, dtype=dtype), torch.zeros(n - k, dtype=dtype))


def _ravel(v):
    return torch.cat([t.reshape(-1) for t in v])


def _unravel(vec, like):
    out, i = [], 0
    for t in like:
        out.append(vec[i : i + t.numel()].reshape(t.shape).to(t.dtype))
        i += t.numel()
    return tuple(out)


def _op(a, like):
    """``v -> A v`` on pytrees shaped like ``like`` (A coupled across the leaves)."""
    return lambda v: _unravel(a.to(v[0].dtype) @ _ravel(v), like)


def _nonsym(n, seed, shift=3.0):
    """A well-conditioned non-symmetric matrix: ``shift I + G / sqrt(n)`` (Gaussian ``G``)."""
    g = torch.randn(n, n, generator=_gen(seed), dtype=F64)
    return shift * torch.eye(n, dtype=F64) + g / math.sqrt(n)


def _similar(eigs, seed):
    """A non-normal, non-symmetric ``P diag(eigs) P^-1``."""
    n = len(eigs)
    p = torch.eye(n, dtype=F64) + 0.3 * torch.randn(n, n, generator=_gen(seed), dtype=F64)
    return p @ torch.diag(torch.as_tensor(eigs, dtype=F64)) @ torch.linalg.inv(p)


def _true_rel(a, x, b, damping=0.0):
    xs, bs = _ravel(x).to(F64), _ravel(b).to(F64)
    r = bs - (a @ xs + damping * xs)
    return float(r.norm() / bs.norm())


def _solve(name, a, b, x0=None, **kw):
    return SOLVERS[name](_op(a, b), b, x0, **kw)


# --------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("name", list(SOLVERS))
@HYP
@given(
    n=st.integers(1, 40),
    seed=st.integers(0, 10_000),
    damping=st.sampled_from([0.0, 0.5]),
)
def test_matches_numpy_solve(name, n, seed, damping):
    a = _nonsym(n, seed)
    like = _like(n)
    rhs = torch.randn(3, n, generator=_gen(seed + 1), dtype=F64)
    dense = a.numpy() + damping * np.eye(n)
    for j in range(3):  # several right-hand sides
        b = _unravel(rhs[j], like)
        x, info = _solve(name, a, b, tol=1e-10, damping=damping)
        ref = np.linalg.solve(dense, rhs[j].numpy())
        assert info.solver == name
        assert info.converged and info.failure is None
        assert info.extras["residual_verified"]
        assert info.residual <= 1e-10
        assert info.residual == pytest.approx(_true_rel(a, x, b, damping), rel=1e-6, abs=1e-15)
        err = np.linalg.norm(_ravel(x).numpy() - ref) / np.linalg.norm(ref)
        assert err <= 1e-8
        assert [t.shape for t in x] == [t.shape for t in b]
        assert info.matvecs >= info.iterations
        assert len(info.residuals) == info.iterations


@pytest.mark.parametrize("name", list(SOLVERS))
def test_solver_objects_and_names(name):
    a = _nonsym(12, 3)
    b = _unravel(torch.randn(12, generator=_gen(4), dtype=F64), _like(12))
    solver = CLASSES[name](tol=1e-10, damping=0.25)
    x, info = solver.solve(_op(a, b), b)
    x2, info2 = solver(_op(a, b), b)
    assert info.solver == info2.solver == name == solver.name
    assert DISPLAY_NAMES[name] == {"gmres": "GMRES", "bicgstab": "BiCGStab"}[name]
    assert info.converged
    assert _true_rel(a, x, b, 0.25) <= 1e-10
    assert torch.equal(_ravel(x), _ravel(x2))
    assert isinstance(solver, hg.Solver)


@pytest.mark.parametrize("name", list(SOLVERS))
def test_warm_start_needs_fewer_iterations(name):
    n = 30
    a = _similar(np.linspace(1.0, 50.0, n), seed=7)
    b = _unravel(torch.randn(n, generator=_gen(8), dtype=F64), _like(n))
    _, cold = _solve(name, a, b, tol=1e-10)
    exact = torch.linalg.solve(a, _ravel(b))
    near = _unravel(exact + 1e-6 * torch.randn(n, generator=_gen(9), dtype=F64), b)
    x, warm = _solve(name, a, b, near, tol=1e-10)
    assert cold.converged and warm.converged
    assert warm.iterations < cold.iterations
    assert _true_rel(a, x, b) <= 1e-10
    # a warm start that already meets tol costs one product and no iteration
    x, done = _solve(name, a, b, _unravel(exact, b), tol=1e-8)
    assert done.converged and done.iterations == 0 and done.matvecs == 1


@pytest.mark.parametrize("name", list(SOLVERS))
@pytest.mark.parametrize("n", [5, 40])
def test_float32(name, n):
    a = _nonsym(n, seed=n)
    like = _like(n, torch.float32)
    rhs = torch.randn(n, generator=_gen(n + 1), dtype=F64)
    b = _unravel(rhs, like)
    x, info = _solve(name, a, b, tol=1e-5)
    assert all(t.dtype == torch.float32 for t in x)
    assert info.converged and info.residual <= 1e-5
    ref = np.linalg.solve(a.numpy(), rhs.numpy())
    assert np.linalg.norm(_ravel(x).double().numpy() - ref) / np.linalg.norm(ref) <= 1e-4


def test_gmres_restart_shorter_than_n_still_converges():
    n = 40
    a = _nonsym(n, seed=11, shift=2.0)
    b = _unravel(torch.randn(n, generator=_gen(12), dtype=F64), _like(n))
    x, info = solve_gmres(_op(a, b), b, tol=1e-10, restart=5)
    assert info.converged and info.extras["restart"] == 5
    assert info.extras["restarts"] >= 2
    assert _true_rel(a, x, b) <= 1e-10
    _, full = solve_gmres(_op(a, b), b, tol=1e-10)
    assert full.converged and full.iterations < info.iterations  # restarts cost iterations
    # GMRES never lets the residual grow
    assert all(r1 <= r0 * (1 + 1e-12) for r0, r1 in zip(info.residuals, info.residuals[1:]))


def test_gmres_residuals_are_monotone_and_default_restart():
    n = 40
    a = _similar(np.linspace(1.0, 100.0, n), seed=5)
    b = _unravel(torch.randn(n, generator=_gen(6), dtype=F64), _like(n))
    _, info = solve_gmres(_op(a, b), b, tol=1e-12)
    assert info.extras["restart"] == 30  # min(numel, 30)
    assert all(r1 <= r0 * (1 + 1e-12) for r0, r1 in zip(info.residuals, info.residuals[1:]))
    b4 = (torch.ones(2, dtype=F64), torch.ones(2, dtype=F64))
    _, small = solve_gmres(_op(_nonsym(4, 1), b4), b4)
    assert small.extras["restart"] == 4  # min(numel, 30)


# --------------------------------------------------------------------------- honesty


def _singular(n, seed):
    """A non-symmetric singular matrix (eigenvalue 0 once) and a ``b`` outside its range."""
    eigs = np.concatenate([[0.0], np.linspace(1.0, 5.0, n - 1)])
    a = _similar(eigs, seed)
    b = torch.randn(n, generator=_gen(seed + 100), dtype=F64)
    return a, b


@pytest.mark.parametrize("name", list(SOLVERS))
@pytest.mark.parametrize("n,seed", [(2, 0), (6, 1), (12, 2), (25, 3)])
def test_singular_inconsistent_is_reported_and_warned(name, n, seed):
    a, rhs = _singular(n, seed)
    b = _unravel(rhs, _like(n))
    with pytest.warns(hg.HypergradWarning):
        x, info = _solve(name, a, b, tol=1e-10)
    assert not info.converged
    assert info.failure is not None
    assert info.residual == pytest.approx(_true_rel(a, x, b), rel=1e-6)
    floor = np.linalg.norm(
        a.numpy() @ np.linalg.lstsq(a.numpy(), rhs.numpy(), rcond=None)[0] - rhs.numpy()
    ) / np.linalg.norm(rhs.numpy())
    assert info.residual >= floor * (1 - 1e-6)  # no x does better than least squares


@pytest.mark.parametrize("name", list(SOLVERS))
def test_gmres_bicgstab_name_a_singular_system(name):
    """On these systems the report says why: the operator maps a vector to zero."""
    a = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=F64)  # singular, non-symmetric
    b = (torch.ones(2, dtype=F64),)
    with pytest.warns(hg.SingularSystemWarning):
        _, info = _solve(name, a, b, tol=1e-10)
    assert info.failure == "singular" and info.extras["singular"]
    assert not info.converged
    if name == "gmres":  # the least-squares floor; BiCGStab reports where it stopped
        assert info.extras["lstsq_residual"] == pytest.approx(math.sqrt(0.5), rel=1e-6)
    assert info.residual == pytest.approx(info.extras["lstsq_residual"], rel=1e-9)


@pytest.mark.parametrize("name", list(SOLVERS))
def test_zero_operator(name):
    b = (torch.ones(3, dtype=F64), torch.ones(2, dtype=F64))
    with pytest.warns(hg.SingularSystemWarning):
        x, info = SOLVERS[name](lambda v: tuple(torch.zeros_like(t) for t in v), b, tol=1e-8)
    assert info.failure == "singular" and info.extras["zero_operator"]
    assert info.residual == 1.0 and not info.converged
    assert all(bool((t == 0).all()) for t in x)


@pytest.mark.parametrize("name", list(SOLVERS))
@pytest.mark.parametrize("n,seed", [(6, 1), (12, 2), (25, 3)])
def test_singular_consistent_is_solved(name, n, seed):
    a, _ = _singular(n, seed)
    rhs = a @ torch.randn(n, generator=_gen(seed + 7), dtype=F64)  # in the range
    b = _unravel(rhs, _like(n))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on a solvable system
        x, info = _solve(name, a, b, tol=1e-9)
    assert info.converged and info.failure is None
    assert not info.extras["singular"]
    assert _true_rel(a, x, b) <= 1e-9


@pytest.mark.parametrize("name", list(SOLVERS))
def test_maxiter_too_small_is_honest(name):
    n = 30
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=_gen(1), dtype=F64))
    upper = torch.triu(torch.randn(n, n, generator=_gen(2), dtype=F64), 1)
    a = q @ (torch.diag(torch.logspace(0, 6, n, dtype=F64)) + upper) @ q.T  # cond ~1e6+
    b = _unravel(torch.randn(n, generator=_gen(3), dtype=F64), _like(n))
    x, info = _solve(name, a, b, tol=1e-10, maxiter=3)
    assert not info.converged
    assert info.iterations <= 3
    assert info.extras["residual_verified"]
    assert info.residual == pytest.approx(_true_rel(a, x, b), rel=1e-9)
    assert info.residual > 1e-10


BAD = [
    {"maxiter": 0},
    {"maxiter": -3},
    {"maxiter": 2.5},
    {"maxiter": True},
    {"tol": float("inf")},
    {"tol": float("nan")},
    {"tol": -1e-6},
    {"tol": "1e-6"},
    {"damping": -0.1},
    {"damping": float("nan")},
    {"damping": float("inf")},
]


@pytest.mark.parametrize("name", list(CLASSES))
@pytest.mark.parametrize("kwargs", BAD, ids=lambda k: repr(k))
def test_bad_settings_refused(name, kwargs):
    with pytest.raises(hg.HypergradValueError, match=DISPLAY_NAMES[name]):
        CLASSES[name](**kwargs)


@pytest.mark.parametrize("restart", [0, -1, 1.5, float("inf")])
def test_gmres_bad_restart_refused(restart):
    with pytest.raises(hg.HypergradValueError, match="GMRES restart"):
        hg.GMRES(restart=restart)


@pytest.mark.parametrize("name", list(CLASSES))
def test_settings_are_keyword_only_normalised_and_immutable(name):
    cls = CLASSES[name]
    with pytest.raises(TypeError):
        cls(10)
    solver = cls(maxiter=np.int64(20), tol=np.float32(1e-4), damping=1)
    assert type(solver.maxiter) is int and type(solver.tol) is float
    assert type(solver.damping) is float
    for field in ("maxiter", "tol", "damping"):
        with pytest.raises(hg.FrozenSettingError):  # also a dataclasses.FrozenInstanceError
            setattr(solver, field, 0)
    assert solver == cls(maxiter=20, tol=float(np.float32(1e-4)), damping=1.0)
    assert solver.replace(tol=1e-8).tol == 1e-8 and solver.tol == float(np.float32(1e-4))
    assert dataclasses.replace(solver, tol=1e-8).tol == 1e-8
    with pytest.raises(hg.HypergradValueError):
        dataclasses.replace(solver, maxiter=0)  # replace validates too
    if name == "gmres":
        with pytest.raises(dataclasses.FrozenInstanceError):
            solver.restart = 3


# --------------------------------------------------------------------------- real Jacobians


def _tanh_fixed_point(n, seed):
    """The fixed point ``z = tanh(W z + c)`` of a contraction and the Jacobian of
    ``F(z) = z - tanh(W z + c)`` at it (non-symmetric: ``I - diag(1 - z^2) W``)."""
    w = 0.5 * torch.randn(n, n, generator=_gen(seed), dtype=F64) / math.sqrt(n)
    c = torch.randn(n, generator=_gen(seed + 1), dtype=F64)

    def fmap(z):
        return torch.tanh(w @ z + c)

    z = torch.zeros(n, dtype=F64)
    for _ in range(200):
        z = fmap(z)
    jac = torch.func.jacrev(lambda z: z - fmap(z))(z)
    return fmap, z, jac


@pytest.mark.parametrize("name", ["gmres", "bicgstab", "exact"])
@pytest.mark.parametrize("transpose", [False, True])
def test_tanh_fixed_point_jacobian(name, transpose):
    n = 24
    fmap, z, jac = _tanh_fixed_point(n, seed=5)
    assert not torch.allclose(jac, jac.T)  # the system is genuinely non-symmetric

    def matvec(v):  # J v (forward mode) or J^T v (reverse mode), never the dense matrix
        if transpose:
            _, vjp = torch.func.vjp(lambda u: u - fmap(u), z)
            return vjp(v[0])
        return (torch.func.jvp(lambda u: u - fmap(u), (z,), (v[0],))[1],)

    rhs = torch.randn(n, generator=_gen(9), dtype=F64)
    solve = {"gmres": solve_gmres, "bicgstab": solve_bicgstab, "exact": solve_exact}[name]
    kw = {} if name == "exact" else {"tol": 1e-11}
    x, info = solve(matvec, (rhs,), **kw)
    mat = jac.T if transpose else jac
    ref = torch.linalg.solve(mat, rhs)
    assert info.converged and info.failure is None
    assert float((x[0] - ref).norm() / ref.norm()) <= 1e-9


def test_exact_uses_lu_on_the_nonsymmetric_matrix():
    """Exact solves the matrix as built (column j = A e_j), never a symmetrised one."""
    n = 9
    a = _nonsym(n, seed=21) + 2.0 * torch.triu(torch.ones(n, n, dtype=F64), 1)
    assert not torch.allclose(a, a.T)
    rhs = torch.randn(n, generator=_gen(22), dtype=F64)
    b = _unravel(rhs, _like(n))
    for damping in (0.0, 0.7):
        x, info = hg.Exact(damping=damping).solve(_op(a, b), b)
        ref = np.linalg.solve(a.numpy() + damping * np.eye(n), rhs.numpy())
        assert info.converged and info.residual <= 1e-12
        np.testing.assert_allclose(_ravel(x).numpy(), ref, rtol=1e-10, atol=1e-12)
        sym = np.linalg.solve((a.numpy() + a.numpy().T) / 2 + damping * np.eye(n), rhs.numpy())
        assert not np.allclose(_ravel(x).numpy(), sym)


def test_iterations_against_cg_and_minres_on_a_symmetric_system():
    """On an SPD system GMRES needs no more iterations than MINRES (both minimise the residual
    over the same Krylov space; GMRES's orthogonalised basis does not lose accuracy as Lanczos
    does, measured 38 against 48 here) and BiCGStab no more products than about twice CG's."""
    n = 40
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=_gen(31), dtype=F64))
    a = q @ torch.diag(torch.logspace(0, 2, n, dtype=F64)) @ q.T
    a = (a + a.T) / 2
    b = _unravel(torch.randn(n, generator=_gen(32), dtype=F64), _like(n))
    its = {}
    for name, solver in {
        "cg": hg.CG(tol=1e-8),
        "minres": hg.MINRES(tol=1e-8),
        "gmres": hg.GMRES(tol=1e-8, restart=n),
        "bicgstab": hg.BiCGStab(tol=1e-8),
    }.items():
        x, info = solver.solve(_op(a, b), b)
        assert info.converged, name
        assert _true_rel(a, x, b) <= 1e-8
        its[name] = (info.iterations, info.matvecs)
    assert its["gmres"][0] <= its["minres"][0]
    assert its["bicgstab"][1] <= 2 * its["cg"][1] + 4


def test_implicit_grad_with_nonsymmetric_solvers_matches_cg():
    x = torch.randn(30, 4, generator=_gen(41), dtype=F64)
    y = torch.randn(30, generator=_gen(42), dtype=F64)

    def inner(w, lam):
        return 0.5 * ((x @ w - y) ** 2).mean() + 0.5 * (lam * w**2).sum()

    def outer(w, lam):
        return 0.5 * ((x @ w - 1) ** 2).mean()

    lam = torch.full((4,), 0.1, dtype=F64)
    w = torch.linalg.solve(x.T @ x / 30 + torch.diag(lam), x.T @ y / 30)
    ref, _ = hg.implicit_grad(inner, outer, w, lam, solver=hg.Exact())
    for solver in (hg.GMRES(tol=1e-10), hg.BiCGStab(tol=1e-10)):
        grad, info = hg.implicit_grad(inner, outer, w, lam, solver=solver)
        assert info.solve.converged and info.solve.solver == solver.name
        torch.testing.assert_close(grad, ref, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("name", list(SOLVERS))
def test_result_worse_than_zero_is_a_warned_failure(name):
    n = 20
    a = _similar(np.linspace(1.0, 100.0, n), seed=3)
    b = _unravel(torch.randn(n, generator=_gen(4), dtype=F64), _like(n))
    x0 = _unravel(1e3 * torch.randn(n, generator=_gen(5), dtype=F64), b)  # residual ~1e4
    with pytest.warns(hg.HypergradWarning):
        x, info = _solve(name, a, b, x0, maxiter=1)
    assert info.failure == "residual above 1" and not info.converged
    assert info.residual == pytest.approx(_true_rel(a, x, b), rel=1e-9)
