"""The advice a solver gives fits the system it was handed (issue 30 item 4): a Neumann series
that grows on a fixed point's (non-symmetric) adjoint system must not suggest alpha=None or
MINRES, which custom_fixed_point refuses; on a Hessian it still may."""

from __future__ import annotations

import warnings

import torch

import hypergrad as hg

DT = torch.float64


def _messages(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, hg.HypergradWarning)]


def test_growing_neumann_on_a_fixed_point_advises_gmres_not_minres() -> None:
    W = torch.tensor([[0.0, 0.9], [-0.2, 0.0]], dtype=DT)  # a non-symmetric contraction
    T = lambda z, x: torch.tanh(W @ z + x)  # noqa: E731

    @hg.custom_fixed_point(T, solver=hg.Neumann(alpha=3.0, maxiter=50))
    def layer(x: torch.Tensor) -> torch.Tensor:
        z = torch.zeros_like(x)
        for _ in range(200):
            z = T(z, x)
        return z

    x = torch.tensor([0.1, -0.2], dtype=DT, requires_grad=True)
    msgs = _messages(lambda: layer(x).sum().backward())
    assert layer.last_info.solve.failure == "diverged"
    grew = [m for m in msgs if "Neumann term grew" in m]
    assert grew and all("GMRES" in m and "MINRES do not apply" in m for m in grew)
    assert not any("use MINRES" in m or "alpha=None to" in m for m in grew)


def test_growing_neumann_on_a_hessian_keeps_the_symmetric_advice() -> None:
    X = torch.randn(20, 3, dtype=DT, generator=torch.Generator().manual_seed(0))
    w = torch.zeros(3, dtype=DT)
    lam = torch.tensor(0.1, dtype=DT, requires_grad=True)
    inner = lambda w, lam: 0.5 * ((X @ w - 1) ** 2).sum() + 0.5 * lam * (w**2).sum()  # noqa: E731
    outer = lambda w, lam: (w**2).sum()  # noqa: E731
    w = torch.linalg.solve(X.T @ X + 0.1 * torch.eye(3, dtype=DT), X.sum(0))
    msgs = _messages(
        lambda: hg.implicit_grad(inner, outer, w, lam, solver=hg.Neumann(alpha=1.0, maxiter=30))
    )
    grew = [m for m in msgs if "Neumann term grew" in m]
    assert grew and all("use MINRES" in m for m in grew)
