"""A solver made compilable in its own file: the example of docs/solvers.md ("Writing a solver"),
Richardson's iteration with its kernel, read from the page and run by ``compile_implicit_grad``
on both of its paths (the dense Hessian, Hessian-vector products in chunks), against its own
eager solve and the closed form; a solver without a kernel is refused with the rule named."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import hypergrad as hg
from hypergrad import compiled
from hypergrad.solvers.base import Solver

ROOT = Path(__file__).resolve().parents[2]
F64 = torch.float64


def _documented() -> dict:
    page = (ROOT / "docs" / "solvers.md").read_text(encoding="utf-8")
    section = page.split("## Writing a solver", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    module = types.ModuleType("compilable_solver_example")  # a user's file
    sys.modules[module.__name__] = module
    exec(compile(code, "docs/solvers.md", "exec", dont_inherit=True), module.__dict__)
    return module.__dict__


DOC = _documented()


def _ridge(n: int = 6):
    g = torch.Generator().manual_seed(3)
    X, Xv = torch.randn(40, n, generator=g, dtype=F64), torch.randn(30, n, generator=g, dtype=F64)
    y, yv = torch.randn(40, generator=g, dtype=F64), torch.randn(30, generator=g, dtype=F64)

    def inner(w, lam):
        return 0.5 * ((X @ w - y) ** 2).mean() + 0.5 * lam.exp() * (w**2).sum()

    def outer(w, lam):
        return 0.5 * ((Xv @ w - yv) ** 2).mean()

    lam = torch.tensor(-1.0, dtype=F64)
    H = X.T @ X / 40 + lam.exp() * torch.eye(n, dtype=F64)
    w = torch.linalg.solve(H, X.T @ y / 40)
    adjoint = torch.linalg.solve(H, Xv.T @ (Xv @ w - yv) / 30)
    closed = -lam.exp() * (w @ adjoint)  # d outer / d lam = -(d^2 inner / d lam dw)^T H^-1 b
    omega = float(1.0 / torch.linalg.eigvalsh(H).max())
    return inner, outer, w, lam, closed, omega


@pytest.mark.parametrize("dense", [True, False], ids=["dense-hessian", "hvp-chunks"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_documented_solver_compiles_with_its_kernel(dense, warm, monkeypatch):
    inner, outer, w, lam, closed, omega = _ridge()
    solver = DOC["Richardson"](omega=omega, tol=1e-10, maxiter=2000)
    monkeypatch.setattr(compiled, "DENSE_MAX", 256 if dense else 0)
    x0 = torch.full_like(w, 0.1) if warm else None
    g_eager, eager = hg.implicit_grad(inner, outer, w, lam, solver=solver, x0=x0)
    f = hg.compile_implicit_grad(inner, outer, solver=solver, compile=False)
    g, info = f(w, lam, x0=x0)
    torch.testing.assert_close(g, closed, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(g, g_eager, rtol=1e-9, atol=1e-13)
    s = info.solve
    assert s.solver == "richardson" and s.converged and s.residual <= 1e-10
    assert s.extras["compiled"] is False and s.extras["residual_verified"]
    assert s.iterations == eager.solve.iterations > 10  # the iteration count of the eager solve
    assert s.matvecs == s.iterations + int(warm) + 1  # and the recomputed residual's product


def test_documented_solver_at_maxiter_is_reported_not_converged():
    inner, outer, w, lam, _, omega = _ridge()
    solver = DOC["Richardson"](omega=omega, tol=1e-10, maxiter=3)
    _, eager = hg.implicit_grad(inner, outer, w, lam, solver=solver)
    _, info = hg.compile_implicit_grad(inner, outer, solver=solver, compile=False)(w, lam)
    assert info.solve.iterations == eager.solve.iterations == 3
    assert not info.solve.converged and not eager.solve.converged
    assert info.solve.residual == pytest.approx(eager.solve.residual, rel=1e-10)


def test_a_solver_without_a_kernel_is_refused():
    @dataclass(kw_only=True)
    class NoKernel(Solver):
        name = "no_kernel"

        def solve(self, matvec, b, x0=None):  # pragma: no cover - never called
            raise AssertionError

    inner, outer, *_ = _ridge()
    with pytest.raises(hg.HypergradValueError, match="declare a kernel.*NoKernel"):
        hg.compile_implicit_grad(inner, outer, solver=NoKernel())
    assert NoKernel().kernel() is None


@pytest.mark.slow
def test_documented_solver_under_torch_compile():
    """The kernel traces: under inductor the dense path's iterations are one ``while_loop``."""
    inner, outer, w, lam, closed, omega = _ridge()
    solver = DOC["Richardson"](omega=omega, tol=1e-10, maxiter=2000)
    g_eager, eager = hg.implicit_grad(inner, outer, w, lam, solver=solver)
    g, info = hg.compile_implicit_grad(inner, outer, solver=solver)(w, lam)
    torch.testing.assert_close(g, g_eager, rtol=1e-9, atol=1e-13)
    assert info.solve.extras["compiled"] and info.solve.converged
    assert info.solve.iterations == eager.solve.iterations
