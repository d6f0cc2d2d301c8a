"""New users' rough edges (issue 23): each misuse gives a clear error, never a silent None or a
raw torch message."""

from __future__ import annotations

import pytest
import torch
from helpers import F64
from torch import nn

import hypergrad as hg


def _ridge(dtype_w=F64, dtype_lam=F64):
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(20, 3, generator=g, dtype=F64), torch.randn(20, generator=g, dtype=F64)
    X, y = X.to(dtype_w), y.to(dtype_w)
    lam = torch.tensor(0.5, dtype=dtype_lam)
    w = torch.linalg.solve(X.T @ X + 0.5 * torch.eye(3, dtype=dtype_w), X.T @ y)

    def inner(w, lam):
        return 0.5 * ((X @ w - y) ** 2).sum() + 0.5 * lam * (w**2).sum()

    def outer(w, lam):
        return 0.5 * ((X @ w - 1.0) ** 2).sum()

    return X, y, w, lam, inner, outer


# ---- one place for the adjoint ----------------------------------------------------------------


def test_the_adjoint_is_info_adjoint():
    _, _, w, lam, inner, outer = _ridge()
    _, info = hg.implicit_grad(inner, outer, w, lam, solver=hg.CG(tol=1e-12))
    assert info.adjoint is info.extras["adjoint"] and info.adjoint.shape == w.shape
    # the solver's report holds the solver's own details only (a plain dict)
    assert type(info.solve.extras) is dict and "adjoint" not in info.solve.extras
    assert info.solve.extras.get("b_norm") is not None


def test_implicit_decorator_and_hyperstep_report_info_adjoint():
    X, y, w, _, inner, outer = _ridge()

    @hg.implicit(inner, solver=hg.CG(tol=1e-12))
    def fit(lam):
        return torch.linalg.solve(X.T @ X + lam * torch.eye(3, dtype=F64), X.T @ y)

    lam = torch.tensor(0.5, dtype=F64, requires_grad=True)
    fit(lam).sum().backward()
    assert fit.last_info.adjoint.shape == w.shape

    model = nn.Linear(3, 1).to(F64)
    step = hg.HyperStep(
        model, [lam], lambda m, b: ((m(X) - 1) ** 2).mean() + lam * (m.weight**2).sum(),
        lambda m, b: (m(X) ** 2).mean(), solver=hg.CG(maxiter=5),
    )  # fmt: skip
    info = step(None)
    assert [a.shape for a in info.adjoint] == [p.shape for p in model.parameters()]


# ---- @hg.implicit: only the hyperparameters are differentiated --------------------------------


def test_implicit_refuses_a_constant_argument_that_requires_grad():
    X, y, _, _, inner, _ = _ridge()

    @hg.implicit(inner, solver=hg.CG(tol=1e-12))
    def fit(lam, design, target):
        return torch.linalg.solve(
            design.T @ design + lam * torch.eye(3, dtype=F64), design.T @ target
        )

    lam = torch.tensor(0.5, dtype=F64, requires_grad=True)
    Xg = X.clone().requires_grad_(True)
    with pytest.raises(hg.HypergradError, match=r"argument design of @hg.implicit .*fit"):
        fit(lam, Xg, y)
    with pytest.raises(hg.HypergradError, match="argument target of"):
        fit(lam, X, target=y.clone().requires_grad_(True))  # by keyword too
    # detached (the documented way for a constant or a warm start) it runs; no_grad too
    out = fit(lam, Xg.detach(), y)
    out.sum().backward()
    assert lam.grad is not None
    with torch.no_grad():
        fit(lam, Xg, y)


def test_implicit_names_a_nested_constant():
    X, y, _, _, inner, _ = _ridge()

    @hg.implicit(inner, solver=hg.CG(tol=1e-12))
    def fit(lam, data):
        Xd, yd = data["X"], data["y"]
        return torch.linalg.solve(Xd.T @ Xd + lam * torch.eye(3, dtype=F64), Xd.T @ yd)

    lam = torch.tensor(0.5, dtype=F64, requires_grad=True)
    with pytest.raises(hg.HypergradError, match=r"argument data\['X'\]"):
        fit(lam, {"X": X.clone().requires_grad_(True), "y": y})


# ---- mixed dtypes: a HypergradTypeError naming both -------------------------------------------


def _matmul_problem():
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(20, 3, generator=g), torch.randn(20, generator=g)  # float32
    w = torch.zeros(3)
    A = torch.eye(3, dtype=F64)  # float64 hyperparameter

    def inner(w, A):
        return 0.5 * ((X @ w - y) ** 2).sum() + 0.5 * (w @ A @ w)  # matmul: no promotion

    def outer(w, A):
        return ((X @ w) ** 2).sum()

    return w, A, inner, outer


@pytest.mark.parametrize("entry", ["implicit_grad", "unrolled_grad"])
def test_mixed_dtypes_raise_a_type_error_naming_both(entry):
    w, A, inner, outer = _matmul_problem()
    with pytest.raises(hg.HypergradTypeError, match=r"params.* is torch.float32 but hparams.* is "
                       r"torch.float64") as err:  # fmt: skip
        if entry == "implicit_grad":
            hg.implicit_grad(inner, outer, w, A)
        else:
            hg.unrolled_grad(inner, outer, w, A, steps=2, optimizer=hg.optim.sgd(lr=0.1))
    assert isinstance(err.value.__cause__, RuntimeError)  # torch's message, chained


def test_mixed_dtypes_in_the_implicit_backward_and_hyperstep():
    w, A, inner, outer = _matmul_problem()

    @hg.implicit(inner)
    def fit(A):
        return torch.zeros(3)  # float32 result, float64 hyperparameter

    A = A.clone().requires_grad_(True)
    with pytest.raises(hg.HypergradTypeError, match=r"result.* is torch.float32 but hparams"):
        fit(A).sum().backward()

    model = nn.Linear(3, 1, bias=False)  # float32
    M = torch.eye(3, dtype=F64, requires_grad=True)
    X = torch.randn(8, 3)

    def hinner(m, b):
        return ((m(X) - 1) ** 2).mean() + (m.weight @ M @ m.weight.T).sum()

    for method in (hg.Implicit(), hg.Unrolled(hg.optim.sgd(lr=0.1))):
        step = hg.HyperStep(model, [M], hinner, lambda m, b: (m(X) ** 2).mean(), method=method)
        with pytest.raises(hg.HypergradTypeError, match=r"inner.weight is torch.float32 but "
                           r"hyper\[0\] is torch.float64"):  # fmt: skip
            step(None)


def test_mixed_dtypes_that_promote_still_work():
    """float64 lam times a float32 loss promotes: a working mix is not refused up front."""
    _, _, w, lam, inner, outer = _ridge(dtype_w=torch.float32, dtype_lam=F64)
    g, info = hg.implicit_grad(inner, outer, w, lam)
    assert g.dtype == F64 and torch.isfinite(g)


def test_other_runtime_errors_are_not_rewritten():
    _, _, w, lam, inner, outer = _ridge(dtype_w=torch.float32, dtype_lam=F64)

    def bad_inner(w, lam):
        raise RuntimeError("shape mismatch somewhere")

    with pytest.raises(RuntimeError, match="shape mismatch somewhere"):
        hg.implicit_grad(bad_inner, outer, w, lam)


@pytest.mark.parametrize("kind", ["root", "fixed_point"])
def test_custom_root_refuses_a_constant_argument_that_requires_grad(kind):
    """The same rule as @hg.implicit: only the hyperparameters are differentiated, so a
    grad-requiring constant would silently get no gradient; it is refused, naming it."""
    A = torch.tensor([[3.0, 1.0], [0.5, 2.0]], dtype=F64)  # non-symmetric

    if kind == "root":
        deco = hg.custom_root(lambda x, b: A @ x - b, solver=hg.Exact())
    else:
        deco = hg.custom_fixed_point(lambda x, b: x - 0.2 * (A @ x - b), solver=hg.Exact())

    @deco
    def solve(b, scale):
        return torch.linalg.solve(A, b)

    b = torch.ones(2, dtype=F64, requires_grad=True)
    scale = torch.tensor(2.0, dtype=F64, requires_grad=True)
    with pytest.raises(hg.HypergradError, match="argument scale of @hg.custom_"):
        solve(b, scale)
    x = solve(b, scale.detach())  # detached: fine, and the gradient is the closed form
    x.sum().backward()
    torch.testing.assert_close(b.grad, torch.linalg.solve(A.T, torch.ones(2, dtype=F64)))
