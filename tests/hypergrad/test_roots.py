"""``custom_root``, ``custom_fixed_point``, ``root_vjp``, ``root_jvp`` and ``hg.conditions``.

Independent references (float64 throughout):

* ridge regression ``w*(lam) = (X^T X / n + diag(lam))^{-1} X^T y / n``, whose Jacobian is
  ``dw*/dlam = -A^{-1} diag(w*)`` (the spirit of jaxopt's implicit_diff tests);
* a non-symmetric root ``F(x, th) = A x + th * x^3 - b`` (``A`` not symmetric), solved by Newton:
  ``dx*/dth = -(A + diag(3 th x^2))^{-1} diag(x^3)``;
* a DEQ-like fixed point ``z* = tanh(W z* + U x)``: central finite differences of the fixed
  point solved to 1e-15 by iteration;
* the lasso solved by proximal gradient: on the support ``S``,
  ``dw_S/dlam = -(X_S^T X_S / n)^{-1} sign(w_S)``, zero elsewhere;
* the adjoint identity ``<vjp(v), t> = <v, jvp(t)>``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, jacfwd, jacrev, jvp, vmap

import hypergrad as hg
from hypergrad import HypergradInfo
from hypergrad.conditions import STATIONARITY_THRESHOLD, relative_residual
from hypergrad.testing import check_hypergrad

F64 = torch.float64
TOL = {"rtol": 1e-8, "atol": 1e-10}

_g = torch.Generator().manual_seed(0)
N, D = 30, 4
X = torch.randn(N, D, generator=_g, dtype=F64)
Y = X @ torch.randn(D, generator=_g, dtype=F64) + 0.1 * torch.randn(N, generator=_g, dtype=F64)
LAM = 0.1 + torch.rand(D, generator=_g, dtype=F64)

# non-symmetric root
A_NS = torch.randn(D, D, generator=_g, dtype=F64) + 4 * torch.eye(D, dtype=F64)
B_NS = torch.randn(D, generator=_g, dtype=F64)
TH = 0.2 + torch.rand(D, generator=_g, dtype=F64)


def ridge_loss(w, lam):
    return 0.5 * ((X @ w - Y) ** 2).mean() + 0.5 * (lam * w**2).sum()


def ridge_grad(w, lam):  # the optimality condition, written by hand (a plain callable)
    return X.T @ (X @ w - Y) / N + lam * w


def ridge_matrix(lam):
    return X.T @ X / N + torch.diag(lam)


def ridge_solve(lam):
    return torch.linalg.solve(ridge_matrix(lam), X.T @ Y / N)


def ridge_jacobian(lam):
    return -torch.linalg.solve(ridge_matrix(lam), torch.diag(ridge_solve(lam)))


def ns_condition(x, th):
    return A_NS @ x + th * x**3 - B_NS


def ns_newton(th):
    x = torch.zeros(D, dtype=F64)
    for _ in range(60):
        x = x - torch.linalg.solve(A_NS + torch.diag(3 * th * x**2), ns_condition(x, th))
    return x


def ns_jacobian(th):
    x = ns_newton(th)
    return -torch.linalg.solve(A_NS + torch.diag(3 * th * x**2), torch.diag(x**3))


@pytest.fixture(autouse=True)
def _stationary_points_are_quiet():
    """Every test point is a tight solution unless the test says otherwise: a
    NonStationaryWarning anywhere else is a failure."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", hg.NonStationaryWarning)
        yield


# -- ridge: custom_root, custom_fixed_point, the stationary condition ---------------------------


@pytest.mark.parametrize(
    "solver", [None, hg.GMRES(tol=1e-12), hg.BiCGStab(tol=1e-12), hg.Exact()], ids=str
)
def test_custom_root_ridge_jacobian_matches_closed_form(solver):
    solve = hg.custom_root(ridge_grad, solver=solver)(ridge_solve)
    assert solve.last_info is None
    jac = jacrev(solve)(LAM)
    torch.testing.assert_close(jac, ridge_jacobian(LAM), **TOL)
    info = solve.last_info
    assert isinstance(info, HypergradInfo) and info.solve.converged
    assert info.stationarity < 1e-12
    if solver is None:
        assert info.solve.solver == "gmres"  # the default for a plain (non-symmetric) condition
    torch.testing.assert_close(jacfwd(solve)(LAM), ridge_jacobian(LAM), **TOL)


def test_custom_root_scalar_hparam_ridge_like_jaxopt():
    """jaxopt's test: w*(l) = (X^T X + l I)^{-1} X^T y, dw*/dl = -(X^T X + l I)^{-1} w*."""

    def F(w, lam):
        return X.T @ (X @ w - Y) + lam * w

    def solve(lam):
        return torch.linalg.solve(X.T @ X + lam * torch.eye(D, dtype=F64), X.T @ Y)

    lam = torch.tensor(3.0, dtype=F64)
    fit = hg.custom_root(F)(solve)
    expected = -torch.linalg.solve(X.T @ X + lam * torch.eye(D, dtype=F64), solve(lam))
    torch.testing.assert_close(jacrev(fit)(lam), expected, **TOL)
    torch.testing.assert_close(jacfwd(fit)(lam), expected, **TOL)


def test_custom_fixed_point_ridge_gradient_step():
    eta = 0.5 / float(torch.linalg.eigvalsh(ridge_matrix(LAM)).max())

    def T(w, lam):
        return w - eta * ridge_grad(w, lam)

    @hg.custom_fixed_point(T)
    def solve(lam):  # gradient descent to a tight fixed point
        w = torch.zeros(D, dtype=F64)
        for _ in range(20000):
            w_new = T(w, lam)
            if float((w_new - w).norm()) < 1e-15:
                break
            w = w_new
        return w

    jac = jacrev(solve)(LAM)
    torch.testing.assert_close(jac, ridge_jacobian(LAM), rtol=1e-7, atol=1e-9)
    info = solve.last_info
    assert info.solve.solver == "gmres" and info.solve.converged
    w = solve(LAM)
    expected = float((T(w, LAM) - w).norm() / w.norm())
    assert info.stationarity == pytest.approx(expected, rel=1e-12, abs=1e-300)


def test_stationary_condition_matches_implicit_and_uses_cg():
    F = hg.conditions.stationary(ridge_loss)
    assert F.symmetric and F.kind == "stationary"
    torch.testing.assert_close(F(ridge_solve(LAM), LAM), ridge_grad(ridge_solve(LAM), LAM))
    root = hg.custom_root(F)(ridge_solve)
    imp = hg.implicit(ridge_loss, solver=hg.CG(tol=1e-12))(ridge_solve)

    def outer(w):
        return ((X @ w - 1.0) ** 2).mean()

    g_root = grad(lambda lam: outer(root(lam)))(LAM)
    g_imp = grad(lambda lam: outer(imp(lam)))(LAM)
    torch.testing.assert_close(g_root, g_imp, **TOL)
    info = root.last_info
    assert info.solve.solver == "cg"  # a symmetric condition keeps @implicit's default
    assert "asymmetry" not in info.extras  # known symmetric: no probe


# -- root_vjp / root_jvp ----------------------------------------------------------------------


def _fd_solution(solve, th, t, eps=1e-6):
    return (solve(th + eps * t) - solve(th - eps * t)) / (2 * eps)


def test_root_vjp_and_jvp_against_closed_form_fd_and_each_other():
    x = ns_newton(TH)
    v = torch.randn(D, generator=torch.Generator().manual_seed(1), dtype=F64)
    t = torch.randn(D, generator=torch.Generator().manual_seed(2), dtype=F64)
    J = ns_jacobian(TH)
    vjp_, info_r = hg.root_vjp(ns_condition, x, TH, v)
    jvp_, info_f = hg.root_jvp(ns_condition, x, TH, t)
    torch.testing.assert_close(vjp_, J.T @ v, **TOL)
    torch.testing.assert_close(jvp_, J @ t, **TOL)
    torch.testing.assert_close(jvp_, _fd_solution(ns_newton, TH, t), rtol=1e-6, atol=1e-9)
    fd_vjp = torch.stack([v @ _fd_solution(ns_newton, TH, e) for e in torch.eye(D, dtype=F64)])
    torch.testing.assert_close(vjp_, fd_vjp, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(vjp_ @ t, v @ jvp_, **TOL)  # adjoint identity
    for info in (info_r, info_f):
        assert info.solve.converged and info.stationarity < 1e-12
        assert info.extras["condition_products"] <= 1  # J x for the scale (none when F = 0)
    assert info_r.extras["adjoint"].shape == x.shape
    assert info_f.extras["tangent"] is jvp_


def test_root_vjp_pytrees():
    """Dict params and tuple hparams: the result has the structure of hparams."""

    def F(p, h):
        lam, shift = h
        return {"w": ridge_grad(p["w"], lam) + shift * p["b"], "b": p["b"] - shift**2}

    lam, shift = LAM, torch.tensor(0.3, dtype=F64)
    b = shift**2
    w = torch.linalg.solve(ridge_matrix(lam), X.T @ Y / N - shift * b)
    cot = {"w": torch.ones(D, dtype=F64), "b": torch.tensor(2.0, dtype=F64)}
    (g_lam, g_shift), info = hg.root_vjp(F, {"w": w, "b": b}, (lam, shift), cot)

    def solution(lam, shift):
        b = shift**2
        return torch.linalg.solve(ridge_matrix(lam), X.T @ Y / N - shift * b).sum() + 2 * b

    e_lam, e_shift = torch.func.grad(solution, argnums=(0, 1))(lam, shift)
    torch.testing.assert_close(g_lam, e_lam, **TOL)
    torch.testing.assert_close(g_shift, e_shift, **TOL)
    assert set(info.extras["adjoint"]) == {"w", "b"}
    tan, _ = hg.root_jvp(F, {"w": w, "b": b}, (lam, shift), (torch.zeros(D, dtype=F64), shift))
    assert set(tan) == {"w", "b"}


# -- non-symmetric root through torch.func --------------------------------------------------


def test_nonsymmetric_root_composes_with_torch_func():
    solve = hg.custom_root(ns_condition, solver=hg.GMRES(tol=1e-12))(ns_newton)
    J = ns_jacobian(TH)
    torch.testing.assert_close(jacrev(solve)(TH), J, **TOL)
    torch.testing.assert_close(jacfwd(solve)(TH), J, **TOL)
    t = torch.linspace(-1, 1, D, dtype=F64)
    primal, tangent = jvp(solve, (TH,), (t,))
    torch.testing.assert_close(primal, ns_newton(TH))
    torch.testing.assert_close(tangent, J @ t, **TOL)
    torch.testing.assert_close(grad(lambda th: solve(th).sum())(TH), J.sum(0), **TOL)
    ths = TH + 0.1 * torch.rand(3, D, generator=torch.Generator().manual_seed(3), dtype=F64)
    torch.testing.assert_close(vmap(solve)(ths), torch.stack([ns_newton(h) for h in ths]))
    per_sample = vmap(grad(lambda th: solve(th).sum()))(ths)
    torch.testing.assert_close(per_sample, torch.stack([ns_jacobian(h).sum(0) for h in ths]), **TOL)
    with fwAD.dual_level():
        out = solve(fwAD.make_dual(TH, t))
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent, J @ t, **TOL)
    th = TH.clone().requires_grad_(True)
    (solve(th) ** 2).sum().backward()
    torch.testing.assert_close(th.grad, J.T @ (2 * ns_newton(TH)), **TOL)


def test_hparams_by_keyword_and_constant_args():
    def newton(th, x0, iters=60):
        x = x0
        for _ in range(iters):
            x = x - torch.linalg.solve(A_NS + torch.diag(3 * th * x**2), ns_condition(x, th))
        return x

    solve = hg.custom_root(ns_condition, solver=hg.Exact())(newton)
    x0 = torch.zeros(D, dtype=F64)
    torch.testing.assert_close(jacrev(lambda th: solve(th=th, x0=x0))(TH), ns_jacobian(TH), **TOL)


def test_second_order_is_refused():
    solve = hg.custom_root(ns_condition, solver=hg.Exact())(ns_newton)
    with pytest.raises(hg.HypergradError, match="first-order"):
        jacrev(jacrev(solve))(TH)


# -- DEQ fixed point --------------------------------------------------------------------------


def test_deq_fixed_point_gradients_match_finite_differences():
    g = torch.Generator().manual_seed(4)
    n, m = 5, 3
    h0 = {
        "W": 0.4 * torch.randn(n, n, generator=g, dtype=F64) / n**0.5,
        "U": torch.randn(n, m, generator=g, dtype=F64),
        "x": torch.randn(m, generator=g, dtype=F64),
    }
    c = torch.randn(n, generator=g, dtype=F64)

    def T(z, h):
        return torch.tanh(h["W"] @ z + h["U"] @ h["x"])

    def iterate(h):
        z = torch.zeros(n, dtype=F64)
        for _ in range(500):
            z_new = T(z, h)
            if float((z_new - z).abs().max()) < 1e-15:
                return z_new
            z = z_new
        return z

    layer = hg.custom_fixed_point(T)(iterate)

    def outer(h):
        return (c * layer(h)).sum() + 0.5 * (layer(h) ** 2).sum()

    grads = grad(outer)(h0)
    info = layer.last_info
    assert info.solve.converged and info.stationarity < 1e-13

    def outer_ref(h):
        z = iterate(h)
        return float((c * z).sum() + 0.5 * (z**2).sum())

    eps = 1e-6
    for name in h0:
        dirs = torch.randn(3, *h0[name].shape, generator=g, dtype=F64)
        for d in dirs:
            plus = {**h0, name: h0[name] + eps * d}
            minus = {**h0, name: h0[name] - eps * d}
            fd = (outer_ref(plus) - outer_ref(minus)) / (2 * eps)
            assert float((grads[name] * d).sum()) == pytest.approx(fd, rel=1e-6, abs=1e-9)
    # the adjoint fixed-point iteration (Neumann with alpha=1) agrees on a contraction
    neumann = hg.custom_fixed_point(T, solver=hg.Neumann(alpha=1.0, maxiter=200, tol=1e-13))
    layer_n = neumann(iterate)
    grads_n = grad(lambda h: (c * layer_n(h)).sum())(h0)
    grads_g = grad(lambda h: (c * layer(h)).sum())(h0)
    for name in h0:
        torch.testing.assert_close(grads_n[name], grads_g[name], rtol=1e-9, atol=1e-12)


# -- check_hypergrad --------------------------------------------------------------------------


def test_check_hypergrad_accepts_custom_root_gradient():
    solve = hg.custom_root(ridge_grad, solver=hg.GMRES(tol=1e-12))(ridge_solve)

    def outer(w, lam):
        return 0.5 * ((X @ w - 1.0) ** 2).mean() + 0.1 * (lam**2).sum()

    g = grad(lambda lam: outer(solve(lam), lam))(LAM)
    report = check_hypergrad(ridge_solve, ridge_loss, outer, LAM, grad=g)
    assert report.passed, str(report)


# -- symmetric-only solvers on a non-symmetric condition ---------------------------------------


@pytest.mark.parametrize(
    "solver",
    [hg.CG(tol=1e-10), hg.MINRES(tol=1e-10), hg.Nystrom(rank=2), hg.Neumann(maxiter=20)],
    ids=["cg", "minres", "nystrom", "neumann-alpha-none"],
)
def test_symmetric_only_solver_refused_on_nonsymmetric_condition(solver):
    x = ns_newton(TH)
    with pytest.raises(hg.HypergradValueError, match="GMRES"):
        hg.root_vjp(ns_condition, x, TH, torch.ones(D, dtype=F64), solver=solver)
    with pytest.raises(hg.HypergradValueError, match="not symmetric"):
        hg.root_jvp(ns_condition, x, TH, torch.ones(D, dtype=F64), solver=solver)
    solve = hg.custom_root(ns_condition, solver=solver)(ns_newton)
    th = TH.clone().requires_grad_(True)
    with pytest.raises(hg.HypergradValueError, match="symmetric"):
        solve(th).sum().backward()


def test_symmetric_plain_condition_passes_the_probe():
    """A hand-written gradient is a plain callable: CG runs after the probe (two products)."""
    w = ridge_solve(LAM)
    g, info = hg.root_vjp(ridge_grad, w, LAM, torch.ones(D, dtype=F64), solver=hg.CG(tol=1e-12))
    torch.testing.assert_close(g, ridge_jacobian(LAM).T @ torch.ones(D, dtype=F64), **TOL)
    assert info.extras["asymmetry"] < 1e-12
    assert info.extras["condition_products"] in (2, 3)  # (J x,) A r and A^T r of the probe


def test_neumann_with_alpha_is_accepted_for_a_contraction():
    W = 0.3 * torch.randn(D, D, generator=torch.Generator().manual_seed(5), dtype=F64)
    F = hg.conditions.fixed_point(lambda z, x: 0.5 * torch.tanh(W @ z) + x)
    xin = torch.randn(D, generator=torch.Generator().manual_seed(6), dtype=F64)
    z = torch.zeros(D, dtype=F64)
    for _ in range(200):
        z = 0.5 * torch.tanh(W @ z) + xin
    v = torch.ones(D, dtype=F64)
    g_n, info = hg.root_vjp(F, z, xin, v, solver=hg.Neumann(alpha=1.0, maxiter=100, tol=1e-13))
    g_e, _ = hg.root_vjp(F, z, xin, v, solver=hg.Exact())
    torch.testing.assert_close(g_n, g_e, rtol=1e-10, atol=1e-12)
    assert "asymmetry" not in info.extras


# -- stationarity ----------------------------------------------------------------------------


def test_stationarity_definition_for_a_linear_condition():
    """For F = A x - b the stationarity is the relative residual ||Ax - b|| / max(||Ax||, ||b||)."""
    x = torch.linalg.solve(A_NS, B_NS) + 0.01
    th = torch.zeros(D, dtype=F64)
    with pytest.warns(hg.NonStationaryWarning, match="stationarity"):
        _, info = hg.root_vjp(ns_condition, x, th, torch.ones(D, dtype=F64))
    r = A_NS @ x - B_NS
    expected = float(r.norm() / max(float((A_NS @ x).norm()), float(B_NS.norm())))
    assert info.stationarity == pytest.approx(expected, rel=1e-12)
    assert info.extras["stationarity"] == info.stationarity
    assert relative_residual((r,), (A_NS @ x,), (B_NS,)) == pytest.approx(expected, rel=1e-12)
    assert relative_residual((torch.zeros(2),), (torch.zeros(2),)) == 0.0


def test_no_warning_at_tight_solutions():
    # the autouse fixture turns NonStationaryWarning into errors
    x = ns_newton(TH)
    _, info = hg.root_vjp(ns_condition, x, TH, torch.ones(D, dtype=F64))
    assert info.stationarity < 1e-12
    _, info = hg.root_jvp(ns_condition, x, TH, torch.ones(D, dtype=F64))
    assert info.stationarity < 1e-12


def test_warning_and_large_stationarity_off_the_root():
    def sloppy(th):
        return ns_newton(th) + 0.05

    solve = hg.custom_root(ns_condition, solver=hg.GMRES(tol=1e-12))(sloppy)
    th = TH.clone().requires_grad_(True)
    with pytest.warns(hg.NonStationaryWarning):
        solve(th).sum().backward()
    assert solve.last_info.stationarity > 10 * STATIONARITY_THRESHOLD
    with pytest.warns(hg.NonStationaryWarning):
        jvp(solve, (TH,), (torch.ones(D, dtype=F64),))
    assert solve.last_info.stationarity > 10 * STATIONARITY_THRESHOLD

    def T(z, x):
        return torch.tanh(0.5 * z + x)

    layer = hg.custom_fixed_point(T)(lambda x: torch.zeros_like(x) + 1.0)  # not a fixed point
    x = torch.full((3,), 0.2, dtype=F64, requires_grad=True)
    with pytest.warns(hg.NonStationaryWarning):
        layer(x).sum().backward()
    one = torch.ones(3, dtype=F64)
    assert layer.last_info.stationarity == pytest.approx(
        float((T(one, x.detach()) - one).norm() / one.norm()), rel=1e-12
    )


# -- validation -----------------------------------------------------------------------------


def test_condition_output_unlike_params_is_refused():
    x = ns_newton(TH)
    with pytest.raises(hg.HypergradValueError, match="structure and shapes of params"):
        hg.root_vjp(lambda x, th: (ns_condition(x, th),), x, TH, torch.ones(D, dtype=F64))
    with pytest.raises(hg.HypergradValueError, match="structure and shapes of params"):
        hg.root_vjp(lambda x, th: ns_condition(x, th)[:2], x, TH, torch.ones(D, dtype=F64))
    with pytest.raises(hg.HypergradTypeError, match="dtype"):
        hg.root_vjp(lambda x, th: ns_condition(x, th).float(), x, TH, torch.ones(D, dtype=F64))
    with pytest.raises(hg.HypergradValueError, match="cotangent"):
        hg.root_vjp(ns_condition, x, TH, torch.ones(D + 1, dtype=F64))
    with pytest.raises(hg.HypergradValueError, match="tangents"):
        hg.root_jvp(ns_condition, x, TH, (torch.ones(D, dtype=F64),))


def test_nan_and_inf_are_refused():
    x = ns_newton(TH)
    bad = x.clone()
    bad[0] = float("nan")
    with pytest.raises(hg.HypergradValueError, match="NaN"):
        hg.root_vjp(ns_condition, bad, TH, torch.ones(D, dtype=F64))
    with pytest.raises(hg.HypergradValueError, match="not finite"):
        hg.root_vjp(lambda x, th: ns_condition(x, th) / 0.0, x, TH, torch.ones(D, dtype=F64))
    cot = torch.ones(D, dtype=F64)
    cot[1] = float("inf")
    with pytest.raises(hg.HypergradValueError, match="NaN or Inf"):
        hg.root_vjp(ns_condition, x, TH, cot)
    solve = hg.custom_root(ns_condition)(lambda th: torch.full((D,), float("nan"), dtype=F64))
    with pytest.raises(hg.HypergradValueError, match="NaN"):
        jacrev(solve)(TH)


def test_unused_hparams_and_params_raise():
    x = ns_newton(TH)
    extra = torch.tensor(1.0, dtype=F64)

    def F(x, h):
        return ns_condition(x, h[0])

    with pytest.raises(hg.HypergradError, match=r"does not depend on hparams\[1\]"):
        hg.root_vjp(F, x, (TH, extra), torch.ones(D, dtype=F64))
    with pytest.raises(hg.HypergradError, match=r"does not depend on hparams\[1\]"):
        hg.root_jvp(F, x, (TH, extra), (TH, extra))
    solve = hg.custom_root(F)(lambda h: ns_newton(h[0]))
    with pytest.raises(hg.HypergradError, match=r"hparams\[1\]"):
        grad(lambda h: solve(h).sum())((TH, extra))
    # a hyperparameter that does not need a gradient is fine
    th = TH.clone().requires_grad_(True)
    solve((th, extra)).sum().backward()
    assert th.grad is not None

    def G(p, th):
        return {"a": ns_condition(p["a"], th), "b": p["a"][:1] * 0 + th[:1]}

    p = {"a": x, "b": torch.zeros(1, dtype=F64)}
    cot = {"a": torch.ones(D, dtype=F64), "b": torch.ones(1, dtype=F64)}
    with pytest.raises(hg.HypergradValueError, match=r"does not depend on params\['b'\]"):
        hg.root_vjp(G, p, TH, cot, solver=hg.Exact())


def test_bad_arguments():
    with pytest.raises(hg.HypergradTypeError):
        hg.custom_root(3)  # type: ignore[arg-type]
    with pytest.raises(hg.HypergradTypeError):
        hg.custom_root(ns_condition, solver="gmres")  # type: ignore[arg-type]
    with pytest.raises(hg.HypergradTypeError):
        hg.custom_fixed_point(hg.conditions.fixed_point(lambda x, h: x))
    solve = hg.custom_root(ns_condition)(ns_newton)
    with pytest.raises(hg.HypergradTypeError, match="floating"):
        solve(torch.ones(D, dtype=torch.int64))
    with pytest.raises(hg.HypergradTypeError, match="non-leaf"):
        hg.root_vjp(ns_condition, ns_newton(TH), TH * torch.ones(1, requires_grad=True), TH)


# -- hg.conditions: proximal and projected gradient --------------------------------------------


def soft_threshold(x, lam, scaling=1.0):
    return torch.sign(x) * torch.relu(x.abs() - scaling * lam)


def test_proximal_gradient_lasso_jacobian():
    def f(w, _):
        return 0.5 * ((X @ w - Y) ** 2).mean()

    H = X.T @ X / N
    step = 1.0 / float(torch.linalg.eigvalsh(H).max())
    T = hg.conditions.proximal_gradient(f, soft_threshold, step)

    @hg.custom_fixed_point(T)
    def lasso(h):  # ISTA to a tight fixed point
        w = torch.zeros(D, dtype=F64)
        for _ in range(100000):
            w_new = T(w, h)
            if float((w_new - w).abs().max()) < 1e-16:
                break
            w = w_new
        return w

    lam = torch.tensor(0.05, dtype=F64)
    w = lasso(((), lam))
    support = w != 0
    assert 0 < int(support.sum()) < D or int(support.sum()) == D
    jac = jacrev(lambda lam: lasso(((), lam)))(lam)
    s = support.nonzero().squeeze(1)
    expected = torch.zeros(D, dtype=F64)
    expected[s] = -torch.linalg.solve(H[s][:, s], torch.sign(w[s]))
    torch.testing.assert_close(jac, expected, rtol=1e-7, atol=1e-9)
    assert lasso.last_info.solve.converged
    # per-coordinate penalties and the library's prox agree with the local soft threshold
    lam_vec = torch.full((D,), 0.05, dtype=F64)
    T2 = hg.conditions.proximal_gradient(f, hg.prox.prox_lasso, step)
    _, info = hg.root_vjp(hg.conditions.fixed_point(T2), w, ((), lam_vec), torch.ones(D, dtype=F64))
    assert info.stationarity < 1e-10
    torch.testing.assert_close(T2(w, ((), lam_vec)), T(w, ((), lam)))


def test_projected_gradient_nonnegative_quadratic():
    def loss(w, c):
        return 0.5 * ((w - c) ** 2).sum()

    T = hg.conditions.projected_gradient(loss, lambda x, _: x.clamp(min=0.0), 0.5)
    c = torch.tensor([1.0, -2.0, 0.5, -0.1], dtype=F64)

    @hg.custom_fixed_point(T)
    def solve(h):
        w = torch.zeros(D, dtype=F64)
        for _ in range(200):
            w = T(w, h)
        return w

    jac = jacrev(lambda c: solve((c, ())))(c)
    torch.testing.assert_close(jac, torch.diag((c > 0).to(F64)), **TOL)


def test_composite_maps_check_their_arguments():
    T = hg.conditions.proximal_gradient(lambda w, _: (w**2).sum(), soft_threshold, 0.1)
    with pytest.raises(hg.HypergradTypeError, match="pair"):
        T(torch.ones(2), torch.tensor(1.0))
    with pytest.raises(hg.HypergradValueError, match="stepsize"):
        hg.conditions.proximal_gradient(lambda w, _: (w**2).sum(), soft_threshold, -1.0)
    with pytest.raises(hg.HypergradTypeError, match="stepsize"):
        hg.conditions.projected_gradient(lambda w, _: (w**2).sum(), soft_threshold, "big")
    with pytest.raises(hg.HypergradTypeError, match="callable"):
        hg.conditions.stationary(None)  # type: ignore[arg-type]


def test_exact_builds_columns_in_batches_in_both_modes():
    """16 unknowns: Exact's dense columns come (partly) from batched vjps (reverse) and batched
    vjps of the vjp (forward); both must equal the closed form."""
    g = torch.Generator().manual_seed(7)
    n = 16
    A = torch.randn(n, n, generator=g, dtype=F64) + 6 * torch.eye(n, dtype=F64)
    b = torch.randn(n, generator=g, dtype=F64)
    th = 0.2 + torch.rand(n, generator=g, dtype=F64)

    def F(x, th):
        return A @ x + th * x**3 - b

    def newton(th):
        x = torch.zeros(n, dtype=F64)
        for _ in range(60):
            x = x - torch.linalg.solve(A + torch.diag(3 * th * x**2), F(x, th))
        return x

    x = newton(th)
    expected = -torch.linalg.solve(A + torch.diag(3 * th * x**2), torch.diag(x**3))
    solve = hg.custom_root(F, solver=hg.Exact())(newton)
    torch.testing.assert_close(jacrev(solve)(th), expected, **TOL)
    torch.testing.assert_close(jacfwd(solve)(th), expected, **TOL)
    v = torch.ones(n, dtype=F64)
    g_r, info = hg.root_vjp(F, x, th, v, solver=hg.Exact())
    torch.testing.assert_close(g_r, expected.T @ v, **TOL)
    assert info.solve.matvecs == n


def test_projected_gradient_box_differentiates_both_parts_of_the_pair():
    """hparams = (c, (lower, upper)) with hg.prox.projection_box: w* = clamp(c, lower, upper)."""

    def loss(w, c):
        return 0.5 * ((w - c) ** 2).sum()

    T = hg.conditions.projected_gradient(loss, hg.prox.projection_box, 0.7)
    c = torch.tensor([1.5, -2.0, 0.5, 0.2], dtype=F64)
    lower = torch.tensor([0.0, -1.0, 0.0, 0.3], dtype=F64)
    upper = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=F64)

    @hg.custom_fixed_point(T)
    def solve(h):
        w = torch.zeros(D, dtype=F64)
        for _ in range(200):
            w = T(w, h)
        return w

    w = solve((c, (lower, upper)))
    torch.testing.assert_close(w, torch.clamp(c, lower, upper))
    v = torch.arange(1.0, D + 1, dtype=F64)
    (g_c, (g_lo, g_up)), info = hg.root_vjp(hg.conditions.fixed_point(T), w, (c, (lower, upper)), v)
    torch.testing.assert_close(g_c, v * ((c > lower) & (c < upper)), **TOL)
    torch.testing.assert_close(g_lo, v * (c < lower), **TOL)
    torch.testing.assert_close(g_up, v * (c > upper), **TOL)
    assert info.stationarity == 0.0
