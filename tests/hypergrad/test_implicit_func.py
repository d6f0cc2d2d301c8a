"""``@hg.implicit`` under ``torch.func`` transforms, against ridge-regression closed forms.

inner ``L(w, lam) = 1/2 ||Xw - y||^2 / n + 1/2 sum_j lam_j w_j^2`` has the solution
``w*(lam) = A^{-1} X^T y / n`` with ``A = X^T X / n + diag(lam)``, the Jacobian
``dw*/dlam = -A^{-1} diag(w*)`` and, for ``outer = 1/2 ||Xv w - yv||^2 / nv``, the hypergradient
``-diag(w*) A^{-1} Xv^T (Xv w* - yv) / nv``.
"""

import pytest
import torch
from torch.func import grad, jacrev, vjp, vmap

import hypergrad as hg

F64 = torch.float64
TOL = {"rtol": 1e-8, "atol": 1e-10}
SOLVERS = [hg.Exact(), hg.CG(tol=1e-12, maxiter=500)]
IDS = ["exact", "cg"]

_g = torch.Generator().manual_seed(0)
N, NV, D = 40, 30, 5
X = torch.randn(N, D, generator=_g, dtype=F64)
Y = X @ torch.randn(D, generator=_g, dtype=F64) + 0.1 * torch.randn(N, generator=_g, dtype=F64)
XV = torch.randn(NV, D, generator=_g, dtype=F64)
YV = torch.randn(NV, generator=_g, dtype=F64)
LAM = 0.1 + torch.rand(D, generator=_g, dtype=F64)
LAMS = 0.1 + torch.rand(3, D, generator=_g, dtype=F64)


def inner(w, lam):
    return 0.5 * ((X @ w - Y) ** 2).sum() / N + 0.5 * (lam * w**2).sum()


def outer(w):
    return 0.5 * ((XV @ w - YV) ** 2).sum() / NV


def a_matrix(lam):
    return X.T @ X / N + torch.diag(lam)


def w_star(lam):
    return torch.linalg.solve(a_matrix(lam), X.T @ Y / N)


def jac_closed(lam):
    return -torch.linalg.solve(a_matrix(lam), torch.diag(w_star(lam)))


def hypergrad_closed(lam):
    w = w_star(lam)
    return -w * torch.linalg.solve(a_matrix(lam), XV.T @ (XV @ w - YV) / NV)


def make_fit(solver):
    @hg.implicit(inner, solver=solver)
    def fit(lam, iters=3):
        # a few Newton steps from zero (exact after one: the inner loss is quadratic)
        w = torch.zeros(D, dtype=lam.dtype)
        for _ in range(iters):
            w = w - torch.linalg.solve(a_matrix(lam), a_matrix(lam) @ w - X.T @ Y / N)
        return w

    return fit


@pytest.mark.parametrize("solver", SOLVERS, ids=IDS)
def test_jacrev_of_solution_map_equals_closed_form(solver):
    fit = make_fit(solver)
    torch.testing.assert_close(fit(LAM), w_star(LAM), **TOL)
    torch.testing.assert_close(jacrev(fit)(LAM), jac_closed(LAM), **TOL)


@pytest.mark.parametrize("solver", SOLVERS, ids=IDS)
def test_grad_of_validation_loss_equals_closed_form(solver):
    fit = make_fit(solver)
    g = grad(lambda lam: outer(fit(lam)))(LAM)
    torch.testing.assert_close(g, hypergrad_closed(LAM), **TOL)
    assert fit.last_info.solve.converged


def test_grad_with_direct_term_and_vjp_match_autograd():
    fit = make_fit(hg.Exact())

    def loss(lam):
        return outer(fit(lam)) + 0.3 * (lam**2).sum()

    g = grad(loss)(LAM)
    torch.testing.assert_close(g, hypergrad_closed(LAM) + 0.6 * LAM, **TOL)
    lam = LAM.clone().requires_grad_(True)
    loss(lam).backward()
    torch.testing.assert_close(lam.grad, g, rtol=1e-12, atol=1e-14)
    v = torch.arange(1.0, D + 1, dtype=F64)
    _, vjp_fn = vjp(fit, LAM)
    torch.testing.assert_close(vjp_fn(v)[0], jac_closed(LAM).T @ v, **TOL)


@pytest.mark.parametrize("solver", SOLVERS, ids=IDS)
def test_vmap_over_batch_of_hparams_equals_loop(solver):
    fit = make_fit(solver)
    ws = vmap(fit)(LAMS)
    torch.testing.assert_close(ws, torch.stack([w_star(lam) for lam in LAMS]), **TOL)
    gs = vmap(grad(lambda lam: outer(fit(lam))))(LAMS)
    torch.testing.assert_close(gs, torch.stack([hypergrad_closed(lam) for lam in LAMS]), **TOL)
    js = vmap(jacrev(fit))(LAMS)
    torch.testing.assert_close(js, torch.stack([jac_closed(lam) for lam in LAMS]), **TOL)


def test_vmap_with_unbatched_constant_argument_and_in_dims():
    fit = make_fit(hg.Exact())
    ws = vmap(fit, in_dims=(1, None))(LAMS.T.contiguous(), 2)
    torch.testing.assert_close(ws, torch.stack([w_star(lam) for lam in LAMS]), **TOL)


@pytest.mark.parametrize("solver", SOLVERS, ids=IDS)
def test_keyword_hparams_equal_positional(solver):
    fit = make_fit(solver)
    torch.testing.assert_close(fit(lam=LAM), fit(LAM), rtol=0, atol=0)
    torch.testing.assert_close(fit(lam=LAM, iters=2), fit(LAM, 2), rtol=0, atol=0)
    torch.testing.assert_close(fit(hparams=LAM), fit(LAM), rtol=0, atol=0)
    g_kw = grad(lambda lam: outer(fit(lam=lam)))(LAM)
    torch.testing.assert_close(g_kw, hypergrad_closed(LAM), **TOL)
    torch.testing.assert_close(jacrev(lambda lam: fit(lam=lam))(LAM), jac_closed(LAM), **TOL)
    lam = LAM.clone().requires_grad_(True)
    outer(fit(lam=lam, iters=2)).backward()
    torch.testing.assert_close(lam.grad, hypergrad_closed(LAM), **TOL)


def test_pytree_hparams_under_grad():
    @hg.implicit(lambda w, h: inner(w, torch.cat([h["a"], h["b"]])), solver=hg.Exact())
    def fit(h):
        return w_star(torch.cat([h["a"], h["b"]]))

    h = {"a": LAM[:2], "b": LAM[2:]}
    g = grad(lambda h: outer(fit(h)))(h)
    torch.testing.assert_close(torch.cat([g["a"], g["b"]]), hypergrad_closed(LAM), **TOL)


def test_missing_hparams_and_second_order_raise():
    fit = make_fit(hg.Exact())
    with pytest.raises(hg.HypergradError, match="hyperparameters"):
        fit(iters=2)
    with pytest.raises(hg.HypergradError, match="first-order"):
        jacrev(jacrev(fit))(LAM)
