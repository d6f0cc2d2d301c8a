"""Unrolled hypergradients against the analytic derivative of T gradient-descent steps on ridge
regression (full and truncated), and against central finite differences for Adam."""

import pytest
import torch
import torchopt
from helpers import rel as _rel
from sklearn.datasets import load_diabetes

import hypergrad as hg

F64 = torch.float64


class Ridge:
    """inner = 1/2 ||Xw - y||^2/n + 1/2 sum lam_j w_j^2 (lam scalar or per feature)."""

    def __init__(self, per_feature, n_tr=250):
        X, y = load_diabetes(return_X_y=True)
        X, y = torch.tensor(X, dtype=F64), torch.tensor(y, dtype=F64)
        perm = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(0))
        X, y = X[perm], y[perm]
        X = (X - X[:n_tr].mean(0)) / X[:n_tr].std(0)
        y = (y - y[:n_tr].mean()) / y[:n_tr].std()
        self.X, self.y, self.Xv, self.yv = X[:n_tr], y[:n_tr], X[n_tr:], y[n_tr:]
        self.n, self.d = self.X.shape
        self.per_feature = per_feature
        g = torch.Generator().manual_seed(5)
        self.lam = (
            0.1 + 0.5 * torch.rand(self.d, generator=g, dtype=F64)
            if per_feature
            else torch.tensor(0.3, dtype=F64)
        )
        self.w0 = 0.3 * torch.randn(self.d, generator=g, dtype=F64)
        self.S = self.X.T @ self.X / self.n
        self.c = self.X.T @ self.y / self.n

    def lam_vec(self, lam=None):
        lam = self.lam if lam is None else lam
        return lam if self.per_feature else lam * torch.ones(self.d, dtype=F64)

    def A(self, lam=None):
        return self.S + torch.diag(self.lam_vec(lam))

    def inner(self, w, lam):
        return 0.5 * ((self.X @ w - self.y) ** 2).sum() / self.n + 0.5 * (lam * w**2).sum()

    def outer(self, w, lam):
        return 0.5 * ((self.Xv @ w - self.yv) ** 2).sum() / self.Xv.shape[0]

    def outer_grad_w(self, w):
        return self.Xv.T @ (self.Xv @ w - self.yv) / self.Xv.shape[0]

    def gd_reference(self, eta, T, K):
        """Iterates of w_{t+1} = w_t - eta (A w_t - c) and the analytic derivative of w_T.

        The derivative recursion dW_{t+1} = (I - eta A) dW_t - eta d(A w_t)/dlam starts at zero
        at step T - K (truncation treats w_{T-K} as a constant).
        """
        A = self.A()
        I = torch.eye(self.d, dtype=F64)
        w = self.w0.clone()
        ws = [w]
        m = self.d if self.per_feature else 1
        D = torch.zeros(self.d, m, dtype=F64)
        for t in range(T):
            if t >= T - K:
                dA = torch.diag(w) if self.per_feature else w[:, None]
                D = (I - eta * A) @ D - eta * dA
            w = w - eta * (A @ w - self.c)
            ws.append(w)
        hyper = D.T @ self.outer_grad_w(w)
        return ws, (hyper if self.per_feature else hyper.reshape(()))


@pytest.mark.parametrize("per_feature", [False, True])
@pytest.mark.parametrize("T,K", [(30, None), (30, 30), (30, 10), (30, 1), (5, 3)])
def test_sgd_matches_analytic_unrolled_derivative(per_feature, T, K):
    r = Ridge(per_feature)
    eta = 1.0 / float(torch.linalg.eigvalsh(r.A()).max())
    g, info = hg.unrolled_grad(
        r.inner, r.outer, r.w0, r.lam, steps=T, optimizer=torchopt.sgd(lr=eta), truncate=K
    )
    ws, ref = r.gd_reference(eta, T, T if K is None else K)
    assert g.shape == r.lam.shape
    assert _rel(g, ref) <= 1e-10
    assert info.steps == T and info.truncate == (T if K is None else K)
    torch.testing.assert_close(info.params, ws[-1], rtol=1e-12, atol=1e-14)
    assert len(info.inner_losses) == T
    for t in (0, T - 1):
        assert info.inner_losses[t] == pytest.approx(float(r.inner(ws[t], r.lam)), rel=1e-12)
    assert info.outer_loss == pytest.approx(float(r.outer(ws[-1], None)), rel=1e-12)


def test_truncation_changes_the_answer():
    r = Ridge(True)
    eta = 1.0 / float(torch.linalg.eigvalsh(r.A()).max())
    opt = torchopt.sgd(lr=eta)
    full, _ = hg.unrolled_grad(r.inner, r.outer, r.w0, r.lam, steps=20, optimizer=opt)
    trunc, _ = hg.unrolled_grad(r.inner, r.outer, r.w0, r.lam, steps=20, optimizer=opt, truncate=2)
    assert _rel(trunc, full) > 1e-2


def test_long_unroll_approaches_implicit_hypergradient():
    r = Ridge(False)
    A = r.A()
    ev = torch.linalg.eigvalsh(A)
    eta = 1.0 / float(ev.max())
    T = int(30 * float(ev.max() / ev.min()))
    g, _ = hg.unrolled_grad(r.inner, r.outer, r.w0, r.lam, steps=T, optimizer=torchopt.sgd(lr=eta))
    w_star = torch.linalg.solve(A, r.c)
    implicit = -(w_star @ torch.linalg.solve(A, r.outer_grad_w(w_star)))
    assert _rel(g, implicit) <= 1e-6


def test_multileaf_params_and_hparams():
    r = Ridge(True)
    eta = 1.0 / float(torch.linalg.eigvalsh(r.A()).max())
    k = 3

    def inner(p, h):
        return r.inner(torch.cat([p["a"], p["b"].reshape(-1)]), torch.cat([h[0], h[1]]))

    def outer(p, h):
        return r.outer(torch.cat([p["a"], p["b"].reshape(-1)]), None)

    params0 = {"a": r.w0[:k].clone(), "b": r.w0[k:].reshape(-1, 1).clone()}
    hparams = (r.lam[:k].clone(), r.lam[k:].clone())
    g, info = hg.unrolled_grad(
        inner, outer, params0, hparams, steps=12, optimizer=torchopt.sgd(lr=eta), truncate=7
    )
    _, ref = r.gd_reference(eta, 12, 7)
    assert isinstance(g, tuple) and g[0].shape == (k,) and g[1].shape == (r.d - k,)
    assert _rel(torch.cat(g), ref) <= 1e-10
    assert info.params["b"].shape == (r.d - k, 1)


def test_direct_outer_dependence_is_added():
    r = Ridge(True)
    eta = 1.0 / float(torch.linalg.eigvalsh(r.A()).max())

    def outer(w, lam):
        return r.outer(w, lam) + 0.5 * (lam**2).sum()

    g, _ = hg.unrolled_grad(r.inner, outer, r.w0, r.lam, steps=10, optimizer=torchopt.sgd(lr=eta))
    _, ref = r.gd_reference(eta, 10, 10)
    assert _rel(g, ref + r.lam) <= 1e-10


# --------------------------------------------------------------------------- Adam vs FD


def _adam_run(r, lam, T, lr, b1=0.9, b2=0.999, eps=1e-8):
    """Independent float64 Adam on the ridge inner loss (analytic gradient).

    torchopt 0.7 computes the bias corrections ``1 - b**count`` with an int64 ``count`` tensor,
    which PyTorch evaluates in the default dtype (float32): ``1 - 0.999 ** t`` then carries a
    relative rounding error of ~1e-5. The reference reproduces that rounding so that the
    comparison tests hypergrad's differentiation, not torchopt's choice of precision.
    """
    A = r.S + torch.diag(r.lam_vec(lam))
    w = r.w0.clone()
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for t in range(1, T + 1):
        g = A @ w - r.c
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        c1 = float(1 - torch.pow(b1, torch.tensor(t)))  # float32, as in torchopt
        c2 = float(1 - torch.pow(b2, torch.tensor(t)))
        assert abs(c2 - (1 - b2**t)) < 1e-6  # only float32 rounding separates it from 1 - b^t
        mh = m / c1
        vh = v / c2
        w = w - lr * mh / (vh.sqrt() + eps)
    return w


@pytest.mark.parametrize("per_feature", [False, True])
def test_adam_matches_central_finite_differences(per_feature):
    r = Ridge(per_feature)
    T, lr = 15, 0.05
    g, info = hg.unrolled_grad(
        r.inner, r.outer, r.w0, r.lam, steps=T, optimizer=torchopt.adam(lr=lr)
    )
    # the forward pass is the textbook Adam
    w_T = _adam_run(r, r.lam, T, lr)
    torch.testing.assert_close(info.params, w_T, rtol=1e-10, atol=1e-12)
    h = 1e-6
    lam_flat = r.lam.reshape(-1)
    fd = torch.zeros_like(lam_flat)
    for j in range(lam_flat.numel()):
        e = torch.zeros_like(lam_flat)
        e[j] = h
        lp = r.outer(_adam_run(r, (lam_flat + e).reshape(r.lam.shape), T, lr), None)
        lm = r.outer(_adam_run(r, (lam_flat - e).reshape(r.lam.shape), T, lr), None)
        fd[j] = (lp - lm) / (2 * h)
    assert _rel(g.reshape(-1), fd) <= 1e-6


def test_adam_truncated_runs_and_differs_from_full():
    r = Ridge(True)
    full, _ = hg.unrolled_grad(
        r.inner, r.outer, r.w0, r.lam, steps=10, optimizer=torchopt.adam(lr=0.05)
    )
    trunc, info = hg.unrolled_grad(
        r.inner, r.outer, r.w0, r.lam, steps=10, optimizer=torchopt.adam(lr=0.05), truncate=3
    )
    assert info.truncate == 3 and torch.isfinite(trunc).all()
    assert _rel(trunc, full) > 1e-3
    # the iterate itself does not depend on truncation
    torch.testing.assert_close(info.params, _adam_run(r, r.lam, 10, 0.05), rtol=1e-10, atol=1e-12)
