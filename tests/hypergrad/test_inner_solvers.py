"""hg.inner: fixed-point (Picard, Anderson), FISTA/ISTA, Newton and L-BFGS against independent
solutions (a float64 Picard run, scikit-learn's Lasso, scipy's nnls and minimize), diagnostics
that never claim convergence they did not reach, refused settings, and the differentiable
wrappers' hypergradients against closed forms (lasso on its active set, ridge/logistic through
the Hessian, a DEQ layer through a dense solve)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize, nnls
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hypergrad as hg
from hypergrad import inner

F64 = torch.float64


def _tanh_problem(n: int = 20, seed: int = 0):
    """``W`` symmetric with eigenvalues in [-0.5, 0.98]: ``tanh(W x + b)`` contracts slowly."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    W = Q @ torch.diag(torch.linspace(-0.5, 0.98, n, dtype=F64)) @ Q.T
    b = 0.2 * torch.randn(n, generator=g, dtype=F64)  # small: tanh stays near its linear part
    return W, b


# ---------------------------------------------------------------------------------------------
# fixed point


def test_anderson_beats_picard_on_a_contractive_tanh_map() -> None:
    W, b = _tanh_problem()
    T = lambda x, h: torch.tanh(W @ x + h)  # noqa: E731
    x0 = torch.zeros(20, dtype=F64)
    ref, rinfo = inner.FixedPoint(T, method="picard", maxiter=20000, tol=1e-14).solve(x0, b)
    assert rinfo.converged and rinfo.solver == "picard"
    x, info = inner.FixedPoint(T, method="anderson", maxiter=500, tol=1e-12).solve(x0, b)
    assert info.converged and info.solver == "anderson"
    assert info.iterations < rinfo.iterations / 3
    assert float((x - ref).abs().max()) < 1e-10
    # the reported residual is the one at the returned point
    assert info.residual == pytest.approx(float((T(x, b) - x).norm() / x.norm()), rel=1e-6)
    assert info.evaluations == info.iterations + 1
    # Picard with the same tolerance takes more iterations too
    _, pinfo = inner.FixedPoint(T, method="picard", maxiter=20000, tol=1e-12).solve(x0, b)
    assert pinfo.converged and info.iterations < pinfo.iterations


def test_fixed_point_pytree_and_mixing() -> None:
    W, b = _tanh_problem(6, seed=1)

    def T(z, h):
        u, v = z["u"], z["v"]
        return {"u": torch.tanh(W[:3] @ torch.cat([u, v]) + h[:3]), "v": 0.5 * v + 0.1 * u}

    z0 = {"u": torch.zeros(3, dtype=F64), "v": torch.ones(3, dtype=F64)}
    for method in ("anderson", "picard"):
        for mixing in (1.0, 0.6):
            z, info = inner.FixedPoint(
                T, method=method, mixing=mixing, tol=1e-12, maxiter=1000
            ).solve(z0, b)
            assert info.converged, (method, mixing, info)
            Tz = T(z, b)
            assert set(z) == {"u", "v"}
            for k in z:
                assert float((Tz[k] - z[k]).abs().max()) < 1e-10
            assert not z["u"].requires_grad


def test_fixed_point_divergence_is_reported() -> None:
    x, info = inner.FixedPoint(lambda x, _: x**2 + 1.0, method="picard").solve(
        torch.ones(2, dtype=F64), None
    )
    assert info.diverged and not info.converged
    assert torch.isfinite(x).all()
    assert "non-finite" in info.extras["reason"]
    # a map that grows without overflowing: not converged, not diverged, honest residual
    T = lambda x, _: 2 * x + 1  # noqa: E731
    x, info = inner.FixedPoint(T, method="picard", maxiter=30).solve(torch.ones(2, dtype=F64), None)
    assert not info.converged and not info.diverged and info.iterations == 30
    assert info.residual == pytest.approx(float((T(x, None) - x).norm() / x.norm()), rel=1e-12)
    # Anderson solves an affine map exactly, even a repelling one: x = -1
    x, info = inner.FixedPoint(T, maxiter=30, tol=1e-12).solve(torch.ones(2, dtype=F64), None)
    assert info.converged and info.iterations <= 3
    torch.testing.assert_close(x, -torch.ones(2, dtype=F64))


class _PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages allocated inside the block and alive at once (the
    meter of examples/deq_fashion_mnist.py, reduced)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                old = self.live.get(key)
                if key not in inputs and (old is None or old[0].expired()):
                    self.live[key] = (StorageWeakRef(st), st.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


@pytest.mark.parametrize("memory", [1, 5, 8])
def test_anderson_history_memory_is_a_ring_buffer(memory: int) -> None:
    """A batch of 256 tanh fixed points (a DEQ layer's shape): the solve holds the 2 x memory
    history rows and a few iterate-sized vectors, not re-stacked copies of the history (the
    former implementation peaked at about 7 x memory + 1 vectors)."""
    g = torch.Generator().manual_seed(3)
    W = 0.9 * torch.linalg.qr(torch.randn(32, 32, generator=g, dtype=F64))[0]
    u = torch.randn(256, 32, generator=g, dtype=F64)
    T = lambda z, h: torch.tanh(z @ h[0].T + h[1])  # noqa: E731
    z0 = torch.zeros_like(u)
    with _PeakTensorBytes() as meter:
        z, info = inner.FixedPoint(T, memory=memory, tol=1e-12, maxiter=200).solve(z0, (W, u))
    assert info.converged
    vectors = meter.peak / z0.nbytes
    assert vectors <= 2 * memory + 8, vectors
    # the same fixed point as Picard's
    ref, _ = inner.FixedPoint(T, method="picard", tol=1e-14, maxiter=2000).solve(z0, (W, u))
    assert float((z - ref).abs().max()) < 1e-10


def test_anderson_ring_buffer_wraps_and_restarts() -> None:
    """memory 2 on a 20-dimensional problem: the buffer wraps many times; the iterates agree
    with a plain reimplementation that re-stacks the history (same rounding up to order)."""
    W, b = _tanh_problem(20, seed=4)
    T = lambda x, h: torch.tanh(W @ x + h)  # noqa: E731
    x0 = torch.zeros(20, dtype=F64)
    x, info = inner.FixedPoint(T, memory=2, tol=1e-13, maxiter=500).solve(x0, b)
    assert info.converged and info.extras["restarts"] == 0
    # reference: Walker-Ni type II with explicit stacking, same regularisation
    xs, g = x0, T(x0, b) - x0
    dX: list[torch.Tensor] = []
    dG: list[torch.Tensor] = []
    for _ in range(info.iterations):
        if dG:
            G, X = torch.stack(dG, 1), torch.stack(dX, 1)
            A = G.T @ G
            A = A + 1e-10 * float(A.diagonal().max()) * torch.eye(len(dG), dtype=F64)
            gamma = torch.linalg.solve(A, G.T @ g)
            xn = xs + g - (X + G) @ gamma
        else:
            xn = xs + g
        gn = T(xn, b) - xn
        dX, dG = (dX + [xn - xs])[-2:], (dG + [gn - g])[-2:]
        xs, g = xn, gn
    assert float((x - xs).abs().max()) < 1e-10


# ---------------------------------------------------------------------------------------------
# proximal gradient


def _lasso_data(n: int = 60, p: int = 15, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, p))
    w_true = np.zeros(p)
    w_true[:5] = rng.standard_normal(5) * 2
    y = X @ w_true + 0.3 * rng.standard_normal(n)
    return torch.tensor(X), torch.tensor(y)


@pytest.mark.parametrize("accelerated", [True, False])
@pytest.mark.parametrize("fixed_step", [False, True])
def test_fista_lasso_matches_sklearn(accelerated: bool, fixed_step: bool) -> None:
    from sklearn.linear_model import Lasso

    X, y = _lasso_data()
    n = X.shape[0]
    alpha = 0.1
    # scikit-learn's objective: 1/(2n) ||y - Xw||^2 + alpha ||w||_1
    ref = Lasso(alpha=alpha, fit_intercept=False, tol=1e-14, max_iter=100_000).fit(X, y).coef_
    f = lambda w, _: 0.5 * ((X @ w - y) ** 2).mean()  # noqa: E731
    L = float(torch.linalg.matrix_norm(X, ord=2) ** 2 / n)
    w, info = inner.ProximalGradient(
        f,
        hg.prox.prox_lasso,
        stepsize=1 / L if fixed_step else None,
        maxiter=20000,
        tol=1e-10,
        accelerated=accelerated,
    ).solve(torch.zeros(X.shape[1], dtype=F64), (None, alpha))
    assert info.converged and info.solver == ("fista" if accelerated else "ista")
    np.testing.assert_allclose(w.numpy(), ref, rtol=0, atol=1e-6)
    assert 0 < int((w != 0).sum()) < X.shape[1]  # a sparse solution with exact zeros
    if not fixed_step:
        assert info.stepsize is not None and info.stepsize >= 0.5 / L


def test_fista_acceleration_takes_fewer_steps() -> None:
    X, y = _lasso_data(seed=1)
    f = lambda w, _: 0.5 * ((X @ w - y) ** 2).mean()  # noqa: E731
    x0 = torch.zeros(X.shape[1], dtype=F64)
    _, fast = inner.ProximalGradient(f, hg.prox.prox_lasso, tol=1e-9, maxiter=20000).solve(
        x0, (None, 0.05)
    )
    _, slow = inner.ProximalGradient(
        f, hg.prox.prox_lasso, tol=1e-9, maxiter=20000, accelerated=False
    ).solve(x0, (None, 0.05))
    assert fast.converged and slow.converged and fast.iterations < slow.iterations


def test_projected_gradient_matches_scipy_nnls() -> None:
    X, y = _lasso_data(40, 10, seed=2)
    y = y - 3.0  # some coefficients want to be negative
    ref, _ = nnls(X.numpy(), y.numpy())
    f = lambda w, _: 0.5 * ((X @ w - y) ** 2).sum()  # noqa: E731
    w, info = inner.ProximalGradient(
        f, hg.prox.projection_non_negative, tol=1e-12, maxiter=20000
    ).solve(torch.zeros(10, dtype=F64), (None, None))
    assert info.converged
    assert 0 < int((w == 0).sum()) < 10
    np.testing.assert_allclose(w.numpy(), ref, rtol=0, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# Newton and L-BFGS


def _logistic_data(n: int = 80, p: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, p))
    y = (X @ rng.standard_normal(p) + 0.5 * rng.standard_normal(n) > 0).astype(float) * 2 - 1
    return torch.tensor(X), torch.tensor(y)


def _logistic_scipy(X: torch.Tensor, y: torch.Tensor, lam: float) -> np.ndarray:
    Xn, yn = X.numpy(), y.numpy()
    n = Xn.shape[0]

    def fun(w):
        m = yn * (Xn @ w)
        return np.logaddexp(0, -m).mean() + 0.5 * lam * w @ w

    def jac(w):
        m = yn * (Xn @ w)
        return -(Xn.T @ (yn / (1 + np.exp(m)))) / n + lam * w

    def hess(w):
        s = 1 / (1 + np.exp(-yn * (Xn @ w)))
        return (Xn.T * (s * (1 - s))) @ Xn / n + lam * np.eye(len(w))

    res = minimize(
        fun,
        np.zeros(Xn.shape[1]),
        jac=jac,
        hess=hess,
        method="trust-exact",
        options={"gtol": 1e-10},
    )
    assert res.success
    return res.x


def _logistic_loss(X: torch.Tensor, y: torch.Tensor):
    return lambda w, lam: torch.nn.functional.softplus(-y * (X @ w)).mean() + 0.5 * lam * (w @ w)


@pytest.mark.parametrize("solver", ["newton", "lbfgs"])
def test_smooth_solvers_match_scipy_on_logistic_regression(solver: str) -> None:
    X, y = _logistic_data()
    lam = 0.05
    ref = _logistic_scipy(X, y, lam)
    fn = inner.Newton if solver == "newton" else inner.LBFGS
    w, info = fn(_logistic_loss(X, y), tol=1e-10).solve(torch.zeros(X.shape[1], dtype=F64), lam)
    assert info.converged and info.solver == solver
    np.testing.assert_allclose(w.numpy(), ref, rtol=0, atol=1e-6)
    if solver == "newton":
        assert info.iterations <= 15  # quadratic convergence


def test_smooth_solvers_on_pytrees() -> None:
    X, y = _logistic_data(seed=3)
    loss = lambda p, lam: (  # noqa: E731
        torch.nn.functional.softplus(-y * (X @ p["w"] + p["b"])).mean()
        + 0.5 * lam * (p["w"] @ p["w"])
    )
    p0 = {"w": torch.zeros(X.shape[1], dtype=F64), "b": torch.zeros((), dtype=F64)}
    pn, ni = inner.Newton(loss, tol=1e-11).solve(p0, 0.1)
    pl, li = inner.LBFGS(loss, tol=1e-11).solve(p0, 0.1)
    assert ni.converged and li.converged
    for k in ("w", "b"):
        assert pn[k].shape == p0[k].shape
        torch.testing.assert_close(pn[k], pl[k], rtol=0, atol=1e-8)


def test_newton_handles_indefinite_start() -> None:
    # a non-convex function: the Hessian at 0 is indefinite; damping keeps the step a descent
    f = lambda x, _: (x**4).sum() / 4 - (x[0] ** 2) / 2 + (x[1] - 1) ** 2  # noqa: E731
    x, info = inner.Newton(f, tol=1e-12).solve(torch.tensor([0.1, 0.0], dtype=F64), None)
    assert info.converged
    # stationary: x0^3 = x0 (x0 = ±1 are minima, 0 a maximum), x1^3 + 2 x1 - 2 = 0
    x1 = [r.real for r in np.roots([1, 0, 2, -2]) if abs(r.imag) < 1e-12][0]
    assert abs(abs(float(x[0])) - 1) < 1e-12 and abs(float(x[1]) - x1) < 1e-12
    assert info.extras["hessians"] >= 1


# ---------------------------------------------------------------------------------------------
# honest diagnostics


def _prox_grad_residual(f, prox, hp, x, s) -> float:
    xr = x.detach().requires_grad_(True)
    (g,) = torch.autograd.grad(f(xr, None), xr)
    return float((x - prox(x - s * g, hp, s)).norm() / s)


def test_diagnostics_never_claim_unreached_convergence() -> None:
    # fixed point: a slow contraction (rate 0.99)
    T = lambda x, _: 0.99 * x + 1.0  # noqa: E731
    x0 = torch.zeros(3, dtype=F64)
    for method in ("picard", "anderson"):
        x, info = inner.FixedPoint(T, method=method, maxiter=1, tol=1e-12).solve(x0, None)
        ref = float((T(x, None) - x).norm()) / max(float(x.norm()), float(T(x0, None).norm()))
        assert info.iterations == 1 and info.residual == pytest.approx(ref, rel=1e-12)
        assert not info.converged and info.extras["reference"] == pytest.approx(3**0.5)
    x, info = inner.FixedPoint(T, method="picard", maxiter=5, tol=1e-12).solve(x0, None)
    ref = float((T(x, None) - x).norm()) / max(float(x.norm()), float(T(x0, None).norm()))
    assert not info.converged and info.residual == pytest.approx(ref, rel=1e-12)
    # proximal gradient
    X, y = _lasso_data(seed=4)
    f = lambda w, _: 0.5 * ((X @ w - y) ** 2).mean()  # noqa: E731
    x0 = torch.zeros(X.shape[1], dtype=F64)
    for acc in (True, False):
        w, info = inner.ProximalGradient(
            f, hg.prox.prox_lasso, maxiter=3, tol=1e-12, accelerated=acc
        ).solve(x0, (None, 0.05))
        assert not info.converged and info.iterations == 3
        G = _prox_grad_residual(f, hg.prox.prox_lasso, 0.05, w, info.stepsize)
        assert info.residual == pytest.approx(G / info.extras["reference"], rel=1e-12)
        assert info.residual > 1e-6
    # smooth
    Xl, yl = _logistic_data()
    loss = _logistic_loss(Xl, yl)
    w0 = torch.zeros(Xl.shape[1], dtype=F64)
    g0 = torch.func.grad(loss)(w0, 0.05).norm()
    for fn in (inner.Newton, inner.LBFGS):
        w, info = fn(loss, maxiter=1, tol=1e-12).solve(w0, 0.05)
        ref = float(torch.func.grad(loss)(w, 0.05).norm() / g0)
        assert not info.converged and info.iterations == 1
        assert info.residual == pytest.approx(ref, rel=1e-10)
        assert info.residuals[-1] == info.residual
    # tol=0: converged only on an exact zero residual
    _, info = inner.LBFGS(loss, maxiter=5, tol=0.0).solve(w0, 0.05)
    assert not info.converged and info.iterations == 5


def test_fista_reported_residual_is_measured_at_the_returned_point() -> None:
    X, y = _lasso_data(seed=5)
    f = lambda w, _: 0.5 * ((X @ w - y) ** 2).mean()  # noqa: E731
    x0 = torch.zeros(X.shape[1], dtype=F64)
    L = float(torch.linalg.matrix_norm(X, ord=2) ** 2 / X.shape[0])
    for maxiter in (2, 7, 5000):
        w, info = inner.ProximalGradient(
            f, hg.prox.prox_lasso, stepsize=1 / L, maxiter=maxiter, tol=1e-9
        ).solve(x0, (None, 0.1))
        ref = _prox_grad_residual(f, hg.prox.prox_lasso, 0.1, w, 1 / L) / _prox_grad_residual(
            f, hg.prox.prox_lasso, 0.1, x0, 1 / L
        )
        assert info.residual == pytest.approx(ref, rel=1e-9, abs=1e-15)
        assert info.converged == (ref <= 1e-9)
    assert info.converged


def test_exact_start_needs_no_iteration() -> None:
    T = lambda x, _: 0.5 * x + 1.0  # noqa: E731
    x, info = inner.FixedPoint(T).solve(torch.full((2,), 2.0, dtype=F64), None)
    assert info.converged and info.iterations == 0 and info.residual == 0.0
    loss = lambda w, _: ((w - 1.0) ** 2).sum()  # noqa: E731
    for fn in (inner.Newton, inner.LBFGS):
        _, info = fn(loss).solve(torch.ones(3, dtype=F64), None)
        assert info.converged and info.iterations == 0 and info.residual == 0.0
    _, info = inner.ProximalGradient(loss, hg.prox.prox_lasso).solve(
        torch.zeros(2, dtype=F64), (None, 5.0)
    )
    assert info.converged and info.iterations == 0 and info.residual == 0.0


# ---------------------------------------------------------------------------------------------
# warm starts: the residual is a function of the returned point


def _lasso_problem(seed: int = 12):
    X, y = _lasso_data(seed=seed)
    f = lambda w, _: 0.5 * ((X @ w - y) ** 2).mean()  # noqa: E731
    L = float(torch.linalg.matrix_norm(X, ord=2) ** 2 / X.shape[0])
    return X, y, f, L


def test_fista_warm_start_from_the_solution_needs_no_step() -> None:
    X, y, f, L = _lasso_problem()
    P = hg.prox.prox_lasso
    zero = torch.zeros(X.shape[1], dtype=F64)
    for stepsize in (1 / L, None):
        w, cold = inner.ProximalGradient(f, P, stepsize=stepsize, tol=1e-13, maxiter=50000).solve(
            zero, (None, 0.1)
        )
        assert cold.converged and cold.extras["reference_point"] == "origin"
        w2, warm = inner.ProximalGradient(f, P, stepsize=stepsize, tol=1e-13, maxiter=50000).solve(
            w, (None, 0.1)
        )
        assert warm.converged and warm.iterations <= 1, warm
        assert warm.extras["reference_point"] == "origin"
        torch.testing.assert_close(w2, w, rtol=0, atol=1e-12)
        if stepsize is not None:  # the same s: the same reference and the same residual at w
            assert warm.iterations == 0 and warm.residual == pytest.approx(cold.residual)
            assert warm.extras["reference"] == pytest.approx(cold.extras["reference"])
    # a warm start from the solution at a nearby lambda (the outer loop's case) agrees with a
    # cold start, in fewer steps
    w_near, _ = inner.ProximalGradient(f, P, stepsize=1 / L, tol=1e-13, maxiter=50000).solve(
        zero, (None, 0.12)
    )
    w_cold, cold = inner.ProximalGradient(f, P, stepsize=1 / L, tol=1e-12, maxiter=50000).solve(
        zero, (None, 0.1)
    )
    w_warm, warm = inner.ProximalGradient(f, P, stepsize=1 / L, tol=1e-12, maxiter=50000).solve(
        w_near, (None, 0.1)
    )
    assert cold.converged and warm.converged and warm.iterations < cold.iterations
    torch.testing.assert_close(w_warm, w_cold, rtol=0, atol=1e-9)


def test_fista_residual_does_not_depend_on_the_start() -> None:
    """The residual reported at a point is ||G_s(x)|| / ||G_s(0)||, whatever x0 was; it is
    unchanged when f and g are multiplied by c and s divided by c."""
    X, y, f, L = _lasso_problem(seed=13)
    P = hg.prox.prox_lasso
    x0 = torch.linspace(-1, 1, X.shape[1], dtype=F64)
    zero = torch.zeros_like(x0)
    w, info = inner.ProximalGradient(f, P, stepsize=1 / L, maxiter=4, tol=1e-12).solve(
        x0, (None, 0.1)
    )
    expect = _prox_grad_residual(f, P, 0.1, w, 1 / L) / _prox_grad_residual(f, P, 0.1, zero, 1 / L)
    assert not info.converged and info.residual == pytest.approx(expect, rel=1e-10)
    # read the residual at w from a start at w (a tolerance every point meets: 0 steps)
    _, at_w = inner.ProximalGradient(f, P, stepsize=1 / L, tol=1e300).solve(w, (None, 0.1))
    assert at_w.iterations == 0 and at_w.residual == pytest.approx(info.residual, rel=1e-12)
    c = 1000.0
    fc = lambda v, _: c * f(v, None)  # noqa: E731
    _, scaled = inner.ProximalGradient(fc, P, stepsize=1 / (c * L), tol=1e300).solve(
        w, (None, 0.1 * c)
    )
    assert scaled.residual == pytest.approx(info.residual, rel=1e-9)
    # exactly 0 at an exact solution: the origin when lambda >= lambda_max
    lam_max = float((X.T @ y).abs().max() / X.shape[0])
    _, info = inner.ProximalGradient(f, P, tol=0.0).solve(zero, (None, 1.01 * lam_max))
    assert info.converged and info.iterations == 0 and info.residual == 0.0


def test_fista_reference_falls_back_to_the_start() -> None:
    X, y, f, L = _lasso_problem(seed=14)
    P = hg.prox.prox_lasso
    lam_max = float((X.T @ y).abs().max() / X.shape[0])
    # the origin is the minimiser: ||G_s(0)|| = 0 cannot scale anything; x0 is the reference
    x0 = torch.full((X.shape[1],), 0.3, dtype=F64)
    w, info = inner.ProximalGradient(f, P, stepsize=1 / L, tol=1e-12, maxiter=5000).solve(
        x0, (None, 2 * lam_max)
    )
    assert info.extras["reference_point"] == "x0" and info.converged
    G0 = _prox_grad_residual(f, P, 2 * lam_max, x0, 1 / L)
    assert info.extras["reference"] == pytest.approx(G0)
    assert bool((w == 0).all())
    # a smooth loss that is not finite at the origin
    loss = lambda v, _: (v - torch.log(v)).sum()  # noqa: E731  minimiser v = 1
    v, info = inner.ProximalGradient(
        loss, hg.prox.projection_non_negative, tol=1e-10, maxiter=5000
    ).solve(torch.full((3,), 2.0, dtype=F64), (None, None))
    assert info.converged and info.extras["reference_point"] == "x0"
    torch.testing.assert_close(v, torch.ones(3, dtype=F64))


@pytest.mark.parametrize("solver", ["newton", "lbfgs"])
def test_smooth_warm_start_and_start_independent_residual(solver: str) -> None:
    fn = inner.Newton if solver == "newton" else inner.LBFGS
    X, y = _logistic_data(seed=15)
    loss = _logistic_loss(X, y)
    zero = torch.zeros(X.shape[1], dtype=F64)
    w, cold = fn(loss, tol=1e-12).solve(zero, 0.05)
    assert cold.converged and cold.extras["reference_point"] == "origin"
    w2, warm = fn(loss, tol=1e-12).solve(w, 0.05)
    assert warm.converged and warm.iterations == 0
    assert warm.residual == pytest.approx(cold.residual, rel=1e-12)
    torch.testing.assert_close(w2, w)
    # a warm start from the solution at a nearby lambda agrees with the cold start
    w_near, _ = fn(loss, tol=1e-12).solve(zero, 0.06)
    w_warm, warm = fn(loss, tol=1e-11).solve(w_near, 0.05)
    assert warm.converged and warm.iterations < cold.iterations
    torch.testing.assert_close(w_warm, w, rtol=0, atol=1e-9)
    # the residual at a point is ||grad f(x)|| / ||grad f(0)||, whatever x0 was
    x0 = torch.linspace(-2, 2, X.shape[1], dtype=F64)
    x, info = fn(loss, maxiter=2, tol=1e-14).solve(x0, 0.05)
    gnorm = lambda v: float(torch.func.grad(loss)(v, 0.05).norm())  # noqa: E731
    assert info.residual == pytest.approx(gnorm(x) / gnorm(zero), rel=1e-10)
    _, at_x = fn(loss, tol=1e300).solve(x, 0.05)
    assert at_x.iterations == 0 and at_x.residual == pytest.approx(info.residual, rel=1e-12)
    # invariant to multiplying the loss by a constant
    _, scaled = fn(lambda v, h: 1e4 * loss(v, h), tol=1e300).solve(x, 0.05)
    assert scaled.residual == pytest.approx(info.residual, rel=1e-10)


def test_smooth_reference_falls_back_to_the_start() -> None:
    # the origin is stationary: its gradient cannot scale anything
    loss = lambda w, _: ((w**2).sum() - 1.0) ** 2  # noqa: E731  minima on the unit sphere
    x0 = torch.tensor([0.3, 0.4], dtype=F64)
    g0 = float(torch.func.grad(loss)(x0, None).norm())
    for fn in (inner.Newton, inner.LBFGS):
        x, info = fn(loss, tol=1e-10, maxiter=200).solve(x0, None)
        assert info.converged and info.extras["reference_point"] == "x0"
        assert info.extras["reference"] == pytest.approx(g0)
        assert float(x.norm()) == pytest.approx(1.0, abs=1e-8)
    # not finite at the origin
    loss = lambda w, _: (w - torch.log(w)).sum()  # noqa: E731
    for fn in (inner.Newton, inner.LBFGS):
        x, info = fn(loss, tol=1e-10).solve(torch.full((2,), 3.0, dtype=F64), None)
        assert info.converged and info.extras["reference_point"] == "x0"
        torch.testing.assert_close(x, torch.ones(2, dtype=F64))


def test_fixed_point_warm_start_from_the_solution_needs_no_step() -> None:
    W, b = _tanh_problem(seed=16)
    T = lambda x, h: torch.tanh(W @ x + h)  # noqa: E731
    x, cold = inner.FixedPoint(T, tol=1e-13, maxiter=500).solve(torch.zeros(20, dtype=F64), b)
    x2, warm = inner.FixedPoint(T, tol=1e-13).solve(x, b)
    assert cold.converged and warm.converged and warm.iterations == 0
    assert warm.residual == pytest.approx(cold.residual, rel=1e-12)
    torch.testing.assert_close(x2, x)


def test_bad_settings_are_refused() -> None:
    x0 = torch.zeros(2, dtype=F64)
    T = lambda x, _: 0.5 * x  # noqa: E731
    loss = lambda w, _: (w**2).sum()  # noqa: E731
    P = hg.prox.prox_lasso
    value_errors = [
        lambda: inner.FixedPoint(T, maxiter=0).solve(x0, None),
        lambda: inner.FixedPoint(T, tol=-1.0).solve(x0, None),
        lambda: inner.FixedPoint(T, tol=math.inf).solve(x0, None),
        lambda: inner.FixedPoint(T, memory=0).solve(x0, None),
        lambda: inner.FixedPoint(T, mixing=0.0).solve(x0, None),
        lambda: inner.FixedPoint(T, mixing=1.5).solve(x0, None),
        lambda: inner.FixedPoint(T, method="broyden").solve(x0, None),
        lambda: inner.FixedPoint(lambda x, _: x[:1]).solve(x0, None),
        lambda: inner.FixedPoint(lambda x, _: (x,)).solve(x0, None),
        lambda: inner.FixedPoint(T).solve(torch.tensor([math.nan, 0.0]), None),
        lambda: inner.ProximalGradient(loss, P, stepsize=0.0).solve(x0, (None, None)),
        lambda: inner.ProximalGradient(loss, P, stepsize=math.inf).solve(x0, (None, None)),
        lambda: inner.ProximalGradient(loss, P, maxiter=0).solve(x0, (None, None)),
        lambda: inner.Newton(loss, maxiter=0).solve(x0, None),
        lambda: inner.Newton(lambda w, _: w**2).solve(x0, None),
        lambda: inner.LBFGS(loss, history=0).solve(x0, None),
        lambda: inner.LBFGS(lambda w, _: (w**2).sum() / 0.0).solve(torch.ones(2, dtype=F64), None),
    ]
    for call in value_errors:
        with pytest.raises(hg.HypergradValueError):
            call()
    for call in [
        lambda: inner.FixedPoint(T).solve(torch.zeros(2, dtype=torch.int64), None),
        lambda: inner.FixedPoint(T).solve([1.0, 2.0], None),
        lambda: inner.Newton(loss, tol="small").solve(x0, None),
    ]:
        with pytest.raises(hg.HypergradTypeError):
            call()


def test_plain_iterations_do_not_track_gradients() -> None:
    lam = torch.tensor(0.1, dtype=F64, requires_grad=True)
    X, y = _lasso_data(seed=6)
    f = lambda w, _: 0.5 * ((X @ w - y) ** 2).mean()  # noqa: E731
    w, _ = inner.ProximalGradient(f, hg.prox.prox_lasso).solve(
        torch.zeros(X.shape[1], dtype=F64), (None, lam)
    )
    assert not w.requires_grad
    w, _ = inner.LBFGS(lambda w, h: ((w - h) ** 2).sum()).solve(torch.zeros(2, dtype=F64), lam)
    assert not w.requires_grad


# ---------------------------------------------------------------------------------------------
# differentiable wrappers


def test_lasso_hypergradient_matches_the_active_set_closed_form() -> None:
    """w*(λ) on the active set S with signs σ (scikit-learn's scaling, n samples):
    (1/n) X_Sᵀ(X_S w_S − y) + λ σ = 0  ⇒  w_S = (X_SᵀX_S)⁻¹(X_Sᵀy − n λ σ),
    dw_S/dλ = −n (X_SᵀX_S)⁻¹ σ, and 0 off S."""
    X, y = _lasso_data(seed=7)
    Xv, yv = _lasso_data(seed=8)
    n = X.shape[0]
    f = lambda w, _: 0.5 * ((X @ w - y) ** 2).mean()  # noqa: E731
    outer = lambda w: 0.5 * ((Xv @ w - yv) ** 2).mean()  # noqa: E731
    lasso = inner.ProximalGradient(f, hg.prox.prox_lasso, tol=1e-12, maxiter=20000)
    lam = torch.tensor(0.15, dtype=F64, requires_grad=True)
    w = lasso.run(torch.zeros(X.shape[1], dtype=F64), ((), lam))
    assert lasso.last_info is not None and lasso.last_info.converged
    outer(w).backward()
    wd = w.detach()
    S = wd != 0
    sigma = torch.sign(wd[S])
    XS = X[:, S]
    G = XS.T @ XS
    # the solution itself matches the closed form
    torch.testing.assert_close(wd[S], torch.linalg.solve(G, XS.T @ y - n * 0.15 * sigma))
    dw = torch.zeros_like(wd)
    dw[S] = -n * torch.linalg.solve(G, sigma)
    wr = wd.clone().requires_grad_(True)
    (gw,) = torch.autograd.grad(outer(wr), wr)
    torch.testing.assert_close(lam.grad, gw @ dw, rtol=1e-8, atol=1e-12)
    assert lasso.last_implicit_info is not None
    assert lasso.last_implicit_info.stationarity < 1e-8
    # per-coordinate strengths: the Jacobian by torch.func.jacrev, -n (X_S^T X_S)^-1 diag(σ)
    lam_vec = torch.full((X.shape[1],), 0.15, dtype=F64)
    J = torch.func.jacrev(lambda lv: lasso.run(torch.zeros(X.shape[1], dtype=F64), ((), lv)))(
        lam_vec
    )
    ref = torch.zeros(X.shape[1], X.shape[1], dtype=F64)
    idx = torch.nonzero(S).squeeze(1)
    ref[idx.unsqueeze(1), idx.unsqueeze(0)] = -n * torch.linalg.inv(G) * sigma.unsqueeze(0)
    torch.testing.assert_close(J, ref, rtol=1e-7, atol=1e-10)


def test_deq_fixed_point_gradient_matches_dense_implicit_formula() -> None:
    W, b = _tanh_problem(8, seed=9)
    T = lambda z, h: torch.tanh(W @ z + h)  # noqa: E731
    for method in ("anderson", "picard"):
        layer = inner.FixedPoint(T, method=method, tol=1e-13, maxiter=5000)
        h = b.clone().requires_grad_(True)
        z = layer.run(torch.zeros(8, dtype=F64), h)
        v = torch.linspace(-1, 1, 8, dtype=F64)
        (z @ v).backward()
        assert layer.last_info is not None and layer.last_info.converged
        # z = tanh(Wz + h): dz/dh = (I - D W)^-1 D, D = diag(1 - z^2)
        D = torch.diag(1 - z.detach() ** 2)
        J = torch.linalg.solve(torch.eye(8, dtype=F64) - D @ W, D)
        torch.testing.assert_close(h.grad, J.T @ v, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("cls", [inner.Newton, inner.LBFGS])
def test_smooth_wrappers_hypergradient_logistic(cls) -> None:
    """dw*/dλ = −H⁻¹ w* for loss(w) + λ/2 ||w||² (differentiate ∇loss(w*) + λ w* = 0)."""
    X, y = _logistic_data(seed=10)
    loss = _logistic_loss(X, y)
    solver = cls(loss, tol=1e-11)
    lam = torch.tensor(0.05, dtype=F64, requires_grad=True)
    w = solver.run(torch.zeros(X.shape[1], dtype=F64), lam)
    assert solver.last_info is not None and solver.last_info.converged
    c = torch.linspace(0.5, 1.5, X.shape[1], dtype=F64)
    (w @ c).backward()
    H = torch.func.jacrev(torch.func.grad(loss))(w.detach(), torch.tensor(0.05, dtype=F64))
    ref = -c @ torch.linalg.solve(H, w.detach())
    torch.testing.assert_close(lam.grad, ref, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(w.detach().numpy(), _logistic_scipy(X, y, 0.05), atol=1e-6)


def test_wrappers_refuse_bad_settings_at_construction() -> None:
    T = lambda x, _: 0.5 * x  # noqa: E731
    loss = lambda w, _: (w**2).sum()  # noqa: E731
    for make in [
        lambda: inner.FixedPoint(T, maxiter=0),
        lambda: inner.FixedPoint(T, method="nope"),
        lambda: inner.ProximalGradient(loss, hg.prox.prox_lasso, stepsize=-1.0),
        lambda: inner.Newton(loss, tol=-1.0),
        lambda: inner.LBFGS(loss, history=0),
    ]:
        with pytest.raises(hg.HypergradValueError):
            make()
    pg = inner.ProximalGradient(loss, hg.prox.prox_lasso)
    with pytest.raises(hg.HypergradTypeError, match="pair"):
        pg.run(torch.zeros(2, dtype=F64), torch.tensor(1.0, dtype=F64))


def test_wrapper_composes_with_vmap() -> None:
    X, y = _lasso_data(seed=11)
    f = lambda w, _: 0.5 * ((X @ w - y) ** 2).mean()  # noqa: E731
    lasso = inner.ProximalGradient(f, hg.prox.prox_lasso, tol=1e-12, maxiter=20000)
    x0 = torch.zeros(X.shape[1], dtype=F64)
    lams = torch.tensor([0.05, 0.1, 0.2], dtype=F64)
    W = torch.func.vmap(lambda lam: lasso.run(x0, ((), lam)))(lams)
    G = torch.func.vmap(torch.func.grad(lambda lam: lasso.run(x0, ((), lam)).sum()))(lams)
    for i, lam in enumerate(lams):
        torch.testing.assert_close(W[i], lasso.run(x0, ((), lam)))
        torch.testing.assert_close(
            G[i], torch.func.grad(lambda t: lasso.run(x0, ((), t)).sum())(lam)
        )
