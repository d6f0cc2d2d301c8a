"""Newton with a kept Hessian factor (``hg.inner.Newton(factor=...)``,
``hg.inner.Newton(reuse_hessian=True)``), the batched Hessian, and
``DensePreconditioner.adopt/apply/stale``: answers against fresh Newton, a dense float64
hypergradient and numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hypergrad as hg
from hypergrad.errors import HypergradTypeError, HypergradValueError
from hypergrad.inner.smooth import hessian

F64 = torch.float64


def _logreg(seed: int = 0, n: int = 80, d: int = 6):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=F64)
    y = (
        torch.rand(n, generator=g, dtype=F64)
        < torch.sigmoid(X @ torch.randn(d, generator=g, dtype=F64))
    ).to(F64)
    Xv = torch.randn(n, d, generator=g, dtype=F64)
    yv = (torch.rand(n, generator=g, dtype=F64) < 0.5).to(F64)

    def inner(w, th):
        z = X @ w
        return (F.softplus(z) - y * z).mean() + 0.5 * (th.exp() * w**2).sum()

    def outer(w):
        z = Xv @ w
        return (F.softplus(z) - yv * z).mean()

    return inner, outer, d


def _dense_hypergrad(inner, outer, w, th):
    """d outer(w*(th)) / d th from dense float64 Jacobians: -(d2L/dth dw)^T H^-1 grad outer."""
    H = torch.func.hessian(lambda v: inner(v, th))(w)
    cross = torch.func.jacrev(lambda t: torch.func.grad(lambda v: inner(v, t))(w))(th)
    gout = torch.func.grad(outer)(w)
    return -cross.T @ torch.linalg.solve(H, gout)


def test_hessian_matches_jacrev_on_a_pytree_free_loss():
    inner, _, d = _logreg()
    th = torch.linspace(-2, 0, d, dtype=F64)
    x = torch.randn(d, dtype=F64)
    f = lambda v: inner(v, th)  # noqa: E731
    ref = torch.func.jacrev(torch.func.grad(f))(x)
    torch.testing.assert_close(hessian(f, x), ref, rtol=1e-12, atol=1e-14)


def test_hessian_of_a_linear_loss_is_zero_and_the_fallback_agrees(monkeypatch):
    x = torch.randn(4, dtype=F64)
    assert torch.equal(hessian(lambda v: (v * 3.0).sum(), x), torch.zeros(4, 4, dtype=F64))
    f = lambda v: (v**3).sum() + v[0] * v[1]  # noqa: E731
    expected = torch.diag(6 * x)
    expected[0, 1] = expected[1, 0] = 1.0
    real_grad = torch.autograd.grad

    def no_batching(*args, **kwargs):  # an op without a batching rule
        if kwargs.get("is_grads_batched"):
            raise RuntimeError("Batching rule not implemented")
        return real_grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", no_batching)
    torch.testing.assert_close(hessian(f, x), expected, rtol=1e-12, atol=1e-14)


def test_newton_with_a_kept_factor_matches_fresh_newton_along_an_outer_path():
    inner, _, d = _logreg(seed=1)
    factor = hg.DensePreconditioner()
    x_fresh = x_kept = torch.zeros(d, dtype=F64)
    first_steps = 0
    for t in range(8):
        th = torch.full((d,), -3.0 + 0.2 * t, dtype=F64)
        x_fresh, info_f = hg.inner.Newton(inner, tol=1e-12).solve(x_fresh, th)
        x_kept, info_k = hg.inner.Newton(inner, tol=1e-12, factor=factor).solve(x_kept, th)
        assert info_f.converged and info_k.converged
        torch.testing.assert_close(x_kept, x_fresh, rtol=1e-10, atol=1e-12)
        first_steps += info_k.extras["factor_steps"]
        if t > 0:  # warm starts: the previous factor takes the first step
            assert info_k.extras["factor_steps"] == 1
    assert first_steps == 7
    assert factor.builds >= 8


def test_kept_factor_of_an_indefinite_hessian_still_descends():
    # f(x) = x^4/4 - x^2/2 + 0.1 x: the Hessian is negative near 0; the clipped factor must
    # give a descent direction and reach the minimum near x = -1.05
    f = lambda x, _: (x**4 / 4 - x**2 / 2 + 0.1 * x).sum()  # noqa: E731
    x, info = hg.inner.Newton(f, tol=1e-12, factor=hg.DensePreconditioner()).solve(
        torch.tensor([0.05], dtype=F64), None
    )
    assert info.converged and not info.diverged
    roots = np.roots([1.0, 0.0, -1.0, 0.1])
    minima = [r.real for r in roots if abs(r.imag) < 1e-12 and 3 * r.real**2 - 1 > 0]
    assert min(abs(float(x) - m) for m in minima) < 1e-10


def test_reuse_hessian_hypergradients_equal_the_dense_reference_and_cost_few_products():
    inner, outer, d = _logreg(seed=2)
    solver = hg.inner.Newton(inner, tol=1e-12, reuse_hessian=True)
    assert isinstance(solver.factor, hg.DensePreconditioner)
    th = torch.full((d,), -2.0, dtype=F64, requires_grad=True)
    opt = torch.optim.SGD([th], lr=0.5)
    w = torch.zeros(d, dtype=F64)
    cg_iterations = []
    for _ in range(6):
        opt.zero_grad()
        ws = solver.run(w, th)
        outer(ws).backward()
        ref = _dense_hypergrad(inner, outer, ws.detach(), th.detach())
        torch.testing.assert_close(th.grad, ref, rtol=1e-8, atol=1e-12)
        info = solver.last_implicit_info.solve
        assert info.converged and info.solver == "cg"
        assert info.extras["preconditioner"] == "dense"
        cg_iterations.append(info.iterations)
        opt.step()
        w = ws.detach()
    # the factor of the last Newton Hessian: a few iterations (unpreconditioned CG needs ~d)
    assert max(cg_iterations) <= 4, cg_iterations


def test_reuse_hessian_keeps_an_explicit_solver_and_refuses_bad_settings():
    inner, _, _ = _logreg()
    exact = hg.Exact()
    solver = hg.inner.Newton(inner, reuse_hessian=True, solver=exact)
    assert solver.factor is not None
    assert hg.inner.Newton(inner).factor is None
    with pytest.raises(HypergradTypeError, match="reuse_hessian"):
        hg.inner.Newton(inner, reuse_hessian=1)  # type: ignore[arg-type]
    with pytest.raises(HypergradTypeError, match="DensePreconditioner"):
        hg.inner.Newton(inner, factor=hg.CG()).solve(
            torch.zeros(6, dtype=F64), torch.zeros(6, dtype=F64)
        )  # type: ignore[arg-type]


def test_dense_preconditioner_adopt_apply_and_stale():
    A = torch.tensor([[4.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 2.0]], dtype=F64)
    like = (torch.zeros(3, dtype=F64),)
    pre = hg.DensePreconditioner(rebuild_after=2)
    assert pre.stale(like)
    with pytest.raises(HypergradValueError, match="no factor"):
        pre.apply(like)
    with pytest.raises(HypergradValueError, match="3 x 3"):
        pre.adopt(torch.eye(2, dtype=F64), like)
    pre.adopt(A, like)
    assert pre.builds == 1 and not pre.stale(like)
    r = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    np.testing.assert_allclose(
        pre.apply((r,))[0].numpy(), np.linalg.solve(A.numpy(), r.numpy()), rtol=1e-13
    )
    pre.apply((r,))
    assert pre.stale(like)  # two applications: the budget of rebuild_after=2 is spent
    assert pre.stale((torch.zeros(4, dtype=F64),))  # other shapes
