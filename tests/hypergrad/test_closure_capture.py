"""Tensors that a map, condition or inner loss reaches by closure get their gradients (issue 30).

A DEQ written the usual way, ``T = lambda z, x: tanh(lin(z) + x)`` with ``lin``'s parameters
closed over, used to leave ``lin.weight.grad`` at None without a word. The decorators now find
such tensors in the autograd graph of one evaluation at the solution and differentiate them like
the hyperparameters. References: autograd through a fully converged unrolled iteration (a
contraction: its derivative converges to the implicit one) and central finite differences of
re-solved float64 problems.
"""

from __future__ import annotations

import pytest
import torch

import hypergrad as hg

DT = torch.float64


def _deq(seed: int = 0) -> tuple[torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(4, 4).to(DT)
    with torch.no_grad():
        lin.weight.mul_(0.3)  # a contraction: tanh is 1-Lipschitz, ||0.3 W|| < 1
    x = torch.randn(4, dtype=DT, requires_grad=True)
    return lin, x


def _unrolled_grads(lin: torch.nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """d(sum z*)/d(W, b, x) by autograd through 300 iterations of the contraction."""
    w = lin.weight.detach().clone().requires_grad_(True)
    b = lin.bias.detach().clone().requires_grad_(True)
    xx = x.detach().clone().requires_grad_(True)
    z = torch.zeros(4, dtype=DT)
    for _ in range(300):
        z = torch.tanh(z @ w.T + b + xx)
    return torch.autograd.grad(z.sum(), (w, b, xx))


def test_custom_fixed_point_differentiates_closed_over_module_parameters() -> None:
    lin, x = _deq()
    T = lambda z, x: torch.tanh(lin(z) + x)  # noqa: E731  (the usual way to write a DEQ)

    @hg.custom_fixed_point(T, solver=hg.GMRES(tol=1e-12))
    def layer(x: torch.Tensor) -> torch.Tensor:
        z = torch.zeros_like(x)
        for _ in range(300):
            z = T(z, x)
        return z

    layer(x).sum().backward()
    gw, gb, gx = _unrolled_grads(lin, x)
    assert lin.weight.grad is not None and lin.bias.grad is not None
    torch.testing.assert_close(lin.weight.grad, gw, rtol=0, atol=1e-12)
    torch.testing.assert_close(lin.bias.grad, gb, rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, gx, rtol=0, atol=1e-12)


def test_inner_fixed_point_and_autograd_grad_reach_closed_over_parameters() -> None:
    lin, x = _deq(1)
    fp = hg.inner.FixedPoint(lambda z, x: torch.tanh(lin(z) + x), tol=1e-13, maxiter=1000)
    z = fp.run(torch.zeros(4, dtype=DT), x)
    # torch.autograd.grad (not only .backward) sees them as inputs of the graph
    gw, gx = torch.autograd.grad(z.sum(), (lin.weight, x))
    rw, _, rx = _unrolled_grads(lin, x)
    torch.testing.assert_close(gw, rw, rtol=0, atol=1e-11)
    torch.testing.assert_close(gx, rx, rtol=0, atol=1e-11)


def _newton(lam: torch.Tensor, mu: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """argmin_w 0.5||Xw − y||² + 0.5 λ||w||² + 0.5 μ Σ w⁴ by Newton's method (float64)."""
    w = torch.zeros(X.shape[1], dtype=DT)
    eye = torch.eye(X.shape[1], dtype=DT)
    for _ in range(60):
        g = X.T @ (X @ w - y) + lam * w + 2 * mu * w**3
        H = X.T @ X + lam * eye + torch.diag(6 * mu * w**2)
        w = w - torch.linalg.solve(H, g)
    return w


def test_implicit_differentiates_a_closed_over_hyperparameter_against_fd() -> None:
    torch.manual_seed(0)
    X, y = torch.randn(20, 3, dtype=DT), torch.randn(20, dtype=DT)
    mu = torch.tensor(0.7, dtype=DT, requires_grad=True)  # closed over by the inner loss

    def inner(w: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((X @ w - y) ** 2).sum() + 0.5 * lam * (w**2).sum() + 0.5 * mu * (w**4).sum()

    @hg.implicit(inner, solver=hg.CG(tol=1e-13))
    def fit(lam: torch.Tensor) -> torch.Tensor:
        return _newton(lam, mu.detach(), X, y)

    lam = torch.tensor(0.5, dtype=DT, requires_grad=True)
    (fit(lam) ** 2).sum().backward()

    def outer(a: float, b: float) -> float:
        return float(
            (_newton(torch.tensor(a, dtype=DT), torch.tensor(b, dtype=DT), X, y) ** 2).sum()
        )

    e = 1e-6
    fd_lam = (outer(0.5 + e, 0.7) - outer(0.5 - e, 0.7)) / (2 * e)
    fd_mu = (outer(0.5, 0.7 + e) - outer(0.5, 0.7 - e)) / (2 * e)
    assert mu.grad is not None
    assert abs(float(lam.grad) - fd_lam) < 1e-8
    assert abs(float(mu.grad) - fd_mu) < 1e-8
    assert abs(fd_mu) > 1e-3  # the closed-over term matters


def test_custom_root_closed_over_intermediate_reaches_its_leaf() -> None:
    """``A = 2 * P`` computed outside and closed over: the gradient flows on to the leaf P."""
    P = torch.tensor([[1.5, 0.5], [-0.5, 1.0]], dtype=DT, requires_grad=True)
    A = 2 * P
    b = torch.tensor([1.0, 1.0], dtype=DT)
    F = lambda x, th: A @ x + th * x**3 - b  # noqa: E731

    def newton(th: torch.Tensor, A_: torch.Tensor) -> torch.Tensor:
        x = torch.zeros(2, dtype=DT)
        for _ in range(50):
            x = x - torch.linalg.solve(A_ + torch.diag(3 * th * x**2), A_ @ x + th * x**3 - b)
        return x

    @hg.custom_root(F, solver=hg.Exact())
    def solve(th: torch.Tensor) -> torch.Tensor:
        return newton(th, A.detach())

    th = torch.tensor([0.5, 0.2], dtype=DT, requires_grad=True)
    solve(th)[0].backward()
    assert P.grad is not None
    e = 1e-6
    fd = torch.zeros(2, 2, dtype=DT)
    for i in range(2):
        for j in range(2):
            Pp, Pm = P.detach().clone(), P.detach().clone()
            Pp[i, j] += e
            Pm[i, j] -= e
            fd[i, j] = (newton(th.detach(), 2 * Pp)[0] - newton(th.detach(), 2 * Pm)[0]) / (2 * e)
    torch.testing.assert_close(P.grad, fd, rtol=0, atol=1e-8)


def test_a_tensor_both_closed_over_and_passed_gets_its_total_derivative() -> None:
    """θ used through the argument and through the closure: the two paths add up."""
    th0 = torch.tensor(0.8, dtype=DT, requires_grad=True)
    T = lambda z, th: 0.5 * torch.tanh(th * z) + th0 * 0.3  # noqa: E731

    def picard(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        z = torch.zeros((), dtype=DT)
        for _ in range(200):
            z = 0.5 * torch.tanh(a * z) + c * 0.3
        return z

    @hg.custom_fixed_point(T, solver=hg.Exact())
    def layer(th: torch.Tensor) -> torch.Tensor:
        return picard(th.detach(), th0.detach())

    layer(th0).backward()
    e = 1e-6
    fd = picard(th0.detach() + e, th0.detach() + e) - picard(th0.detach() - e, th0.detach() - e)
    assert abs(float(th0.grad) - float(fd) / (2 * e)) < 1e-9


def test_inside_torch_func_closed_over_tensors_are_constants() -> None:
    """torch.func differentiates its arguments only: the hyperparameters' gradient is the same
    as with .backward(), and nothing is written into the closed-over tensor's .grad."""
    lin, x = _deq(2)
    T = lambda z, x: torch.tanh(lin(z) + x)  # noqa: E731

    @hg.custom_fixed_point(T, solver=hg.GMRES(tol=1e-12))
    def layer(x: torch.Tensor) -> torch.Tensor:
        z = torch.zeros_like(x)
        for _ in range(300):
            z = T(z, x)
        return z

    g = torch.func.grad(lambda x: layer(x).sum())(x.detach())
    assert lin.weight.grad is None
    layer(x).sum().backward()
    torch.testing.assert_close(g, x.grad, rtol=0, atol=1e-13)


def test_no_grad_call_looks_for_nothing() -> None:
    lin, x = _deq(3)
    calls = []

    def T(z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        return torch.tanh(lin(z) + x)

    @hg.custom_fixed_point(T)
    def layer(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z = torch.zeros_like(x)
            for _ in range(5):
                z = torch.tanh(lin(z) + x)
        return z

    with torch.no_grad():
        layer(x)
    assert calls == []  # no evaluation of the map: no search under no_grad


def test_numbers_and_none_in_hparams_are_constants() -> None:
    """projection_box's docs allow (0.0, None): the decorators accept numbers and None in
    hparams as constants (they used to refuse: "must be a tensor ... got float")."""
    torch.manual_seed(0)
    X, y = torch.randn(30, 4, dtype=DT), torch.randn(30, dtype=DT)
    lam = torch.tensor(0.3, dtype=DT, requires_grad=True)
    f = lambda w, lam: 0.5 * ((X @ w - y) ** 2).sum() + 0.5 * lam * (w**2).sum()  # noqa: E731
    solver = hg.inner.ProximalGradient(f, hg.prox.projection_box, tol=1e-13, maxiter=20000)
    w = solver.run(torch.zeros(4, dtype=DT), (lam, (0.0, None)))
    w.sum().backward()

    def solve(a: float) -> torch.Tensor:
        ww, _ = hg.inner.ProximalGradient(
            f, hg.prox.projection_box, tol=1e-14, maxiter=20000
        ).solve(torch.zeros(4, dtype=DT), (torch.tensor(a, dtype=DT), (0.0, None)))
        return ww

    assert bool((w.detach() >= 0).all()) and bool((w.detach() == 0).any())  # a bound is active
    e = 1e-6
    fd = float((solve(0.3 + e).sum() - solve(0.3 - e).sum()) / (2 * e))
    assert abs(float(lam.grad) - fd) < 1e-7


def test_a_string_in_hparams_is_refused_with_what_is_allowed() -> None:
    @hg.custom_fixed_point(lambda z, h: 0.5 * z + h[0])
    def layer(h: tuple[torch.Tensor, str]) -> torch.Tensor:
        return 2 * h[0].detach()

    with pytest.raises(hg.HypergradTypeError, match=r"a tensor, a number, None"):
        layer((torch.tensor(1.0, requires_grad=True), "bad"))


def test_guide_closure_section_runs_and_prints_what_it_shows() -> None:
    import contextlib
    import io
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "guide.md").read_text()
    section = page[page.index("### Tensors reached by closure") :]
    code, shown = re.findall(r"```(?:python|text)\n(.*?)```", section, re.S)[:2]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/guide.md closure block", "exec"), {})
    assert out.getvalue().split() == shown.split() == ["True", "True"]
