"""``hg.inner.ProximalGradient`` with ``smooth_grad=`` (a closed-form gradient
of the smooth part, docs/inner.md): the same iterates and solution as the autograd path, the
solution of a dense float64 coordinate-descent reference, no autograd in the iterations, the
implicit hypergradient of the active-set closed form, and clear errors for a bad gradient."""

from __future__ import annotations

import math

import pytest
import torch

import hypergrad as hg
from hypergrad import inner

F64 = torch.float64


def _data(seed: int = 0, n: int = 80, d: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=F64)
    X[:, 1] += 0.8 * X[:, 0]  # correlated features (about 70 FISTA steps to 1e-13)
    w_true = torch.zeros(d, dtype=F64)
    w_true[:4] = torch.tensor([2.0, -1.5, 1.0, 0.5], dtype=F64)
    y = X @ w_true + 0.3 * torch.randn(n, generator=g, dtype=F64)
    return X, y


def _coordinate_descent(
    X: torch.Tensor, y: torch.Tensor, lam: float, ridge: float = 0.0
) -> torch.Tensor:
    """``argmin ½‖Xw − y‖²/n + λ‖w‖₁ + ½ ridge ‖w‖²`` by cyclic coordinate descent, to a
    largest coordinate change of 1e-15 (the dense float64 reference)."""
    n, d = X.shape
    a = (X * X).sum(0) / n
    w = torch.zeros(d, dtype=F64)
    r = y.clone()
    for _ in range(100000):
        change = 0.0
        for j in range(d):
            rho = float(X[:, j] @ r) / n + float(a[j]) * float(w[j])
            new = math.copysign(max(abs(rho) - lam, 0.0), rho) / (float(a[j]) + ridge)
            delta = new - float(w[j])
            if delta != 0.0:
                r -= delta * X[:, j]
                w[j] = new
                change = max(change, abs(delta))
        if change <= 1e-15:
            return w
    raise AssertionError("coordinate descent did not converge")


def _problem(kind: str):
    """``(smooth_loss, closed-form gradient, prox, hparams_prox, reference, L)``."""
    X, y = _data()
    n = X.shape[0]
    f = lambda w, _: 0.5 * ((X @ w - y) ** 2).sum() / n  # noqa: E731
    XtX, Xty = X.T @ X / n, X.T @ y / n
    grad = lambda w, _: XtX @ w - Xty  # noqa: E731
    L = float(torch.linalg.eigvalsh(XtX).max())
    if kind == "lasso":
        lam = 0.05
        return f, grad, hg.prox.prox_lasso, lam, _coordinate_descent(X, y, lam), L
    lam, gamma = 0.05, 2.0  # elastic net: λ(‖w‖₁ + γ/2 ‖w‖²)
    ref = _coordinate_descent(X, y, lam, ridge=lam * gamma)
    return f, grad, hg.prox.prox_elastic_net, (lam, gamma), ref, L


@pytest.mark.parametrize("kind", ["lasso", "elastic_net"])
@pytest.mark.parametrize("line_search", [False, True])
def test_closed_form_gradient_gives_the_autograd_iterates_and_the_reference(
    kind: str, line_search: bool
) -> None:
    f, grad, prox, hp, ref, L = _problem(kind)
    assert int((ref != 0).sum()) not in (0, ref.numel())  # a real support: not 0, not dense
    x0 = torch.zeros(ref.numel(), dtype=F64)
    kw: dict = dict(stepsize=None if line_search else 1.0 / L)
    # the same iterates after k steps (tol=0: no stop before maxiter)
    for k in (1, 7, 60):
        a, ia = inner.ProximalGradient(f, prox, tol=0.0, maxiter=k, **kw).solve(x0, (None, hp))
        b, ib = inner.ProximalGradient(f, prox, tol=0.0, maxiter=k, smooth_grad=grad, **kw).solve(
            x0, (None, hp)
        )
        assert ia.iterations == ib.iterations == k
        assert torch.allclose(a, b, rtol=0.0, atol=1e-12), (k, float((a - b).abs().max()))
        assert ia.stepsize == ib.stepsize and ia.extras["restarts"] == ib.extras["restarts"]
    # the same solution, which is the coordinate-descent reference's
    a, ia = inner.ProximalGradient(f, prox, tol=1e-13, maxiter=50000, **kw).solve(x0, (None, hp))
    b, ib = inner.ProximalGradient(f, prox, tol=1e-13, maxiter=50000, smooth_grad=grad, **kw).solve(
        x0, (None, hp)
    )
    assert ia.converged and ib.converged
    assert torch.allclose(a, b, rtol=0.0, atol=1e-12)
    assert torch.allclose(b, ref, rtol=0.0, atol=1e-11), float((b - ref).abs().max())
    assert torch.equal(b == 0, ref == 0)  # the same support, exactly
    assert ib.extras["smooth_grad_error"] < 1e-13  # the check at the returned point passed
    assert ib.extras["smooth_grad_calls"] >= ib.iterations


def test_iterations_never_call_autograd() -> None:
    f, grad, prox, hp, ref, L = _problem("lasso")
    calls = {"grad_enabled": 0, "plain": 0}

    def counted(w: torch.Tensor, h: object) -> torch.Tensor:
        calls["grad_enabled" if torch.is_grad_enabled() else "plain"] += 1
        return f(w, h)

    x0 = torch.ones(ref.numel(), dtype=F64)  # not the origin: one more gradient there
    w, info = inner.ProximalGradient(
        counted, prox, stepsize=1 / L, tol=1e-12, maxiter=50000, smooth_grad=grad
    ).solve(x0, (None, hp))
    assert info.converged and info.iterations > 50
    # a fixed step needs no loss value: smooth_loss runs once, for the check at the end
    assert calls == {"grad_enabled": 1, "plain": 0}
    assert info.evaluations == info.extras["smooth_grad_calls"] + 1
    calls.update(grad_enabled=0, plain=0)
    w, info = inner.ProximalGradient(
        counted, prox, tol=1e-12, maxiter=50000, smooth_grad=grad
    ).solve(x0, (None, hp))
    assert info.converged and calls["grad_enabled"] == 1  # the line search: values only
    assert calls["plain"] >= info.iterations
    assert torch.allclose(w, ref, rtol=0.0, atol=1e-10)


def test_pytree_unknowns() -> None:
    X, y = _data()
    n = X.shape[0]
    cat = lambda p: torch.cat([p["a"], p["b"].reshape(-1)])  # noqa: E731
    f = lambda p, _: 0.5 * ((X @ cat(p) - y) ** 2).sum() / n  # noqa: E731

    def grad(p: dict, _: object) -> dict:
        g = X.T @ (X @ cat(p) - y) / n
        return {"a": g[:4], "b": g[4:].reshape(2, 4)}

    x0 = {"a": torch.zeros(4, dtype=F64), "b": torch.zeros(2, 4, dtype=F64)}
    a, _ = inner.ProximalGradient(f, hg.prox.prox_lasso, tol=1e-13, maxiter=50000).solve(
        x0, (None, 0.05)
    )
    b, info = inner.ProximalGradient(
        f, hg.prox.prox_lasso, tol=1e-13, maxiter=50000, smooth_grad=grad
    ).solve(x0, (None, 0.05))
    assert info.converged and set(b) == {"a", "b"} and b["b"].shape == (2, 4)
    assert torch.allclose(cat(a), cat(b), rtol=0.0, atol=1e-12)
    assert torch.allclose(cat(b), _coordinate_descent(X, y, 0.05), rtol=0.0, atol=1e-11)


def test_hypergradient_with_closed_form_gradient_matches_the_active_set_formula() -> None:
    X, y = _data()
    n = X.shape[0]
    f = lambda w, _: 0.5 * ((X @ w - y) ** 2).sum() / n  # noqa: E731
    XtX, Xty = X.T @ X / n, X.T @ y / n
    lasso = inner.ProximalGradient(f, hg.prox.prox_lasso, tol=1e-13, maxiter=50000,
                                   smooth_grad=lambda w, _: XtX @ w - Xty)  # fmt: skip
    lam = torch.tensor(0.05, dtype=F64, requires_grad=True)
    w = lasso.run(torch.zeros(X.shape[1], dtype=F64), ((), lam))
    w.sum().backward()
    assert lasso.last_info is not None and lasso.last_info.converged
    assert lasso.last_info.extras["smooth_grad_calls"] > 0
    ref = _coordinate_descent(X, y, 0.05)
    assert torch.allclose(w.detach(), ref, rtol=0.0, atol=1e-11)
    # w_S = (X_SᵀX_S)⁻¹(X_Sᵀy − nλσ): d(Σ w)/dλ = −n 1ᵀ(X_SᵀX_S)⁻¹σ
    S = ref != 0
    XS = X[:, S]
    expected = -n * torch.linalg.solve(XS.T @ XS, torch.sign(ref[S])).sum()
    assert lam.grad is not None
    assert float(lam.grad) == pytest.approx(float(expected), rel=1e-9)


def test_bad_gradients_raise() -> None:
    X, y = _data()
    n = X.shape[0]
    f = lambda w, _: 0.5 * ((X @ w - y) ** 2).sum() / n  # noqa: E731
    XtX, Xty = X.T @ X / n, X.T @ y / n
    x0 = torch.zeros(X.shape[1], dtype=F64)
    P = hg.prox.prox_lasso

    def run(g: object, x: object = x0) -> None:
        inner.ProximalGradient(f, P, tol=1e-10, maxiter=5000, smooth_grad=g).solve(x, (None, 0.05))  # type: ignore[arg-type]

    with pytest.raises(hg.HypergradTypeError, match="smooth_grad must be None or a callable"):
        run(XtX)
    with pytest.raises(hg.HypergradTypeError, match="smooth_grad must be None or a callable"):
        inner.ProximalGradient(f, P, smooth_grad=3.0)  # type: ignore[arg-type]
    with pytest.raises(hg.HypergradValueError, match=r"shaped like x0's: \(11,\) vs \(12,\)"):
        run(lambda w, _: (XtX @ w - Xty)[:-1])
    with pytest.raises(hg.HypergradValueError, match="structure of x0"):
        run(lambda w, _: (XtX @ w - Xty,))
    with pytest.raises(hg.HypergradTypeError, match="must be a tensor"):
        run(lambda w, _: (XtX @ w - Xty).numpy())
    with pytest.raises(hg.HypergradTypeError, match="x0's dtype torch.float64, got torch.float32"):
        run(lambda w, _: (XtX @ w - Xty).float())
    with pytest.raises(hg.HypergradValueError, match="not finite at x0"):
        run(lambda w, _: XtX @ w - Xty + float("nan"))
    # wrong formulas: the 1/n of the mean forgotten; right at the origin but not elsewhere
    with pytest.raises(hg.HypergradValueError, match="does not match the gradient of smooth_loss"):
        run(lambda w, _: n * (XtX @ w - Xty))
    with pytest.raises(hg.HypergradValueError, match="does not match the gradient of smooth_loss"):
        run(lambda w, _: 0.5 * XtX @ w - Xty)
    # the differentiable wrapper raises the same, from run
    pg = inner.ProximalGradient(f, P, tol=1e-10, smooth_grad=lambda w, _: 0.5 * XtX @ w - Xty)
    lam = torch.tensor(0.05, dtype=F64, requires_grad=True)
    with pytest.raises(hg.HypergradValueError, match="does not match"):
        pg.run(x0, ((), lam))
    # pytree: a leaf of another dtype is named
    xt = {"a": torch.zeros(6, dtype=F64), "b": torch.zeros(6, dtype=F64)}
    ft = lambda p, _: f(torch.cat([p["a"], p["b"]]), None)  # noqa: E731

    def gt(p: dict, _: object) -> dict:
        g = XtX @ torch.cat([p["a"], p["b"]]) - Xty
        return {"a": g[:6], "b": g[6:].float()}

    with pytest.raises(hg.HypergradTypeError, match="float32"):
        inner.ProximalGradient(ft, P, smooth_grad=gt).solve(xt, (None, 0.05))


def test_wrapper_with_closed_form_gradient_composes_with_vmap() -> None:
    X, y = _data(seed=3)
    n = X.shape[0]
    f = lambda w, _: 0.5 * ((X @ w - y) ** 2).sum() / n  # noqa: E731
    XtX, Xty = X.T @ X / n, X.T @ y / n
    fast = inner.ProximalGradient(f, hg.prox.prox_lasso, tol=1e-13, maxiter=50000,
                                  smooth_grad=lambda w, _: XtX @ w - Xty)  # fmt: skip
    plain = inner.ProximalGradient(f, hg.prox.prox_lasso, tol=1e-13, maxiter=50000)
    x0 = torch.zeros(X.shape[1], dtype=F64)
    lams = torch.tensor([0.02, 0.05, 0.1], dtype=F64)

    def hypergrads(solver: inner.ProximalGradient) -> torch.Tensor:
        return torch.func.vmap(torch.func.grad(lambda lam: solver.run(x0, ((), lam)).sum()))(lams)

    G_fast, G = hypergrads(fast), hypergrads(plain)
    assert torch.allclose(G_fast, G, rtol=1e-9, atol=0.0)
    for lam, g in zip(lams, G_fast):
        ref = _coordinate_descent(X, y, float(lam))
        XS = X[:, ref != 0]
        expected = -n * torch.linalg.solve(XS.T @ XS, torch.sign(ref[ref != 0])).sum()
        assert float(g) == pytest.approx(float(expected), rel=1e-9)
