"""The API's seams: keyword-only settings, one name per knob (the names before 0.1.0 refused),
typed diagnostics, early validation, the shared solver start, and docstrings that point at files
that exist.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import warnings

import pytest
import torch
import torchopt
from helpers import ROOT
from torch import nn

import hypergrad as hg
from hypergrad.implicit.adjoint import hypergradient_core
from hypergrad.settings import check_number
from hypergrad.solvers import (
    dense_matrix,
    power_iteration,
    solve_cg,
    solve_exact,
    solve_minres,
    solve_neumann,
    solve_nystrom,
)

F64 = torch.float64
PACKAGE = ROOT / "hypergrad"


def _spd(n: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    return q @ torch.diag(torch.linspace(1.0, 4.0, n, dtype=F64)) @ q.T


A = _spd()
B = (torch.linspace(-1.0, 1.0, 6, dtype=F64),)


def _mv(v):
    return (A @ v[0],)


def _ridge():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(30, 4, generator=g, dtype=F64)
    y = torch.randn(30, generator=g, dtype=F64)

    def inner(w, lam):
        return 0.5 * ((x @ w - y) ** 2).mean() + 0.5 * (lam * w**2).sum()

    def outer(w, lam):
        return 0.5 * ((x @ w - 1.0) ** 2).mean()

    lam = torch.full((4,), 0.3, dtype=F64)
    w = torch.linalg.solve(x.T @ x / 30 + torch.diag(lam), x.T @ y / 30)
    return inner, outer, w, lam


def _modules():
    torch.manual_seed(0)
    model, hyper = nn.Linear(3, 2).double(), nn.Linear(3, 2).double()
    x = torch.randn(8, 3, dtype=F64)

    def inner(m, b):
        return ((m(b) - hyper(b)) ** 2).mean() + 1e-2 * (m.weight**2).sum()

    def outer(m, b):
        return (m(b) ** 2).mean()

    return model, hyper, inner, outer, x


# -- 1. settings are keyword-only: a positional setting is a TypeError, never a silent swap


def test_positional_entry_point_settings_raise_type_error():
    inner, outer, w, lam = _ridge()
    with pytest.raises(TypeError):
        hg.implicit_grad(inner, outer, w, lam, hg.CG())
    with pytest.raises(TypeError):
        hg.implicit(inner, hg.CG())
    with pytest.raises(TypeError):
        hg.unrolled_grad(inner, outer, w, lam, 3, torchopt.sgd(lr=0.1))
    model, hyper, m_inner, m_outer, _ = _modules()
    with pytest.raises(TypeError):
        hg.HyperStep(model, hyper, m_inner, m_outer, hg.CG())
    psi, theta = (w.clone().requires_grad_(True),), (lam.clone().requires_grad_(True),)
    with pytest.raises(TypeError):
        hypergradient_core(
            lambda p, h: inner(p[0], h[0]), lambda p, h: outer(p[0], h[0]), psi, theta,
            hg.CG(), "reuse",
        )  # fmt: skip


def test_keyword_settings_are_forwarded_by_name():
    """Each solver object gives exactly what its function gives with the same keywords."""
    pairs = [
        (hg.CG(maxiter=4, tol=0.0, damping=0.5), solve_cg, dict(maxiter=4, tol=0.0, damping=0.5)),
        (hg.MINRES(maxiter=4, tol=0.0), solve_minres, dict(maxiter=4, tol=0.0)),
        (
            hg.Neumann(maxiter=7, alpha=0.2, tol=1e-3, damping=0.1, exact_residual=True),
            solve_neumann,
            dict(maxiter=7, alpha=0.2, tol=1e-3, damping=0.1, exact_residual=True),
        ),
        (hg.Exact(damping=0.25), solve_exact, dict(damping=0.25)),
        (hg.Nystrom(rank=3, damping=0.5, seed=2), solve_nystrom, dict(rank=3, damping=0.5, seed=2)),
    ]
    for solver, fn, kw in pairs:
        x1, i1 = solver.solve(_mv, B)
        x2, i2 = fn(_mv, B, **kw)
        assert torch.equal(x1[0], x2[0]), type(solver).__name__
        assert (i1.iterations, i1.matvecs, i1.residual) == (i2.iterations, i2.matvecs, i2.residual)


# -- 2. one name per knob: the names of before 0.1.0 are refused (CHANGELOG.md)


@pytest.mark.parametrize(
    "call",
    [
        lambda: hg.Neumann(steps=3),
        lambda: solve_neumann(_mv, B, steps=3),
        lambda: hg.Nystrom(rho=0.1),
        lambda: solve_nystrom(_mv, B, rho=0.1),
    ],
    ids=["Neumann", "solve_neumann", "Nystrom", "solve_nystrom"],
)
def test_old_solver_names_are_refused(call):
    with pytest.raises(TypeError, match="steps|rho"):
        call()
    assert not hasattr(hg.Neumann(), "steps") and not hasattr(hg.Nystrom(), "rho")


def test_new_names_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        solver = hg.Neumann(maxiter=3, alpha=0.1)
        solver.solve(_mv, B)
        hg.Nystrom(rank=3, damping=0.1).solve(_mv, B)
        assert solver.maxiter == 3


def test_signatures_show_the_new_names_only():
    import inspect

    assert "maxiter" in inspect.signature(hg.Neumann).parameters
    assert "steps" not in inspect.signature(hg.Neumann).parameters
    assert "damping" in inspect.signature(solve_nystrom).parameters
    assert "rho" not in inspect.signature(solve_nystrom).parameters


# -- 3. typed diagnostics


def _implicit_fit():
    inner, outer, _, lam = _ridge()
    x = torch.linalg.solve  # the inner solution in closed form

    @hg.implicit(inner, solver=hg.CG(tol=1e-12))
    def fit(lam):
        g = torch.Generator().manual_seed(1)
        xs = torch.randn(30, 4, generator=g, dtype=F64)
        ys = torch.randn(30, generator=g, dtype=F64)
        return x(xs.T @ xs / 30 + torch.diag(lam), xs.T @ ys / 30)

    return fit, outer, lam


def test_implicit_last_info_is_a_hypergrad_info_set_by_backward():
    fit, outer, lam = _implicit_fit()
    assert fit.last_info is None
    lam = lam.clone().requires_grad_(True)
    w = fit(lam)
    assert fit.last_info is None  # forward alone: no adjoint solve yet
    outer(w, lam).backward()
    info = fit.last_info
    assert isinstance(info, hg.HypergradInfo) and isinstance(info.solve, hg.SolveInfo)
    assert info.solve.converged and info.solve.solver == "cg"
    assert info.hypergrad_norm == pytest.approx(float(lam.grad.norm()), rel=1e-12)
    assert info.extras["adjoint"].shape == w.shape


def test_hyperstep_last_info_is_set_by_each_call():
    model, hyper, inner, outer, x = _modules()
    step = hg.HyperStep(model, hyper, inner, outer, solver=hg.CG(tol=1e-10))
    assert step.last_info is None
    info = step(x)
    assert isinstance(info, hg.HypergradInfo) and step.last_info is info
    again = step(x)
    assert step.last_info is again and again is not info
    unrolled = hg.HyperStep(model, hyper, inner, outer, method=hg.Unrolled(hg.optim.sgd(lr=0.1)))
    assert isinstance(unrolled(x), hg.UnrolledInfo) and isinstance(
        unrolled.last_info, hg.UnrolledInfo
    )


# -- 4. early validation


@pytest.mark.parametrize("method", [hg.Implicit(), hg.Unrolled(hg.optim.sgd(lr=0.1))])
def test_hyperstep_refuses_unknown_distributed_at_construction(method):
    model, hyper, inner, outer, _ = _modules()
    with pytest.raises(hg.HypergradValueError, match="distributed must be None or one of"):
        hg.HyperStep(model, hyper, inner, outer, method=method, distributed="bogus")


def test_implicit_refuses_unknown_engine_at_decoration():
    inner, *_ = _ridge()
    with pytest.raises(hg.HypergradValueError, match="engine must be one of"):
        hg.implicit(inner, engine="fast")


def test_implicit_grad_refuses_unknown_distributed_before_any_work():
    calls = []

    def inner(w, lam):
        calls.append(1)
        return (w**2).sum() * lam

    with pytest.raises(hg.HypergradValueError, match="distributed must be"):
        hg.implicit_grad(inner, inner, torch.ones(2, dtype=F64), torch.ones((), dtype=F64),
                         distributed="exakt")  # fmt: skip
    assert not calls


def test_check_number_range():
    assert check_number("x", 0) == 0.0
    assert check_number("x", None, allow_none=True) is None
    with pytest.raises(hg.HypergradValueError, match=r"x must be > 0 and finite"):
        check_number("x", 0.0, strict=True)
    with pytest.raises(hg.HypergradValueError, match=r"x must be >= 1 and finite"):
        check_number("x", 0.5, minimum=1)
    for bad in (True, "1", float("nan"), float("inf"), -1e-300):
        with pytest.raises(hg.HypergradValueError):
            check_number("x", bad)


# -- 5. the distributed reduce goes through a local matvec, applied to every product


def test_reduce_is_applied_to_rhs_every_product_and_the_result():
    inner, outer, w, lam = _ridge()
    seen = []

    def reduce(tree):
        seen.append(tuple(t.shape for t in tree))
        return tree

    psi, theta = (w.clone().requires_grad_(True),), (lam.clone().requires_grad_(True),)
    hyper, info = hypergradient_core(
        lambda p, h: inner(p[0], h[0]),
        lambda p, h: outer(p[0], h[0]),
        psi,
        theta,
        hg.CG(tol=1e-12),
        reduce=reduce,
    )
    # right-hand side + every operator product + the direct and the mixed terms
    assert len(seen) == 1 + info.solve.matvecs + 2
    plain, _ = hg.implicit_grad(inner, outer, w, lam, solver=hg.CG(tol=1e-12))
    assert torch.allclose(hyper[0], plain, rtol=1e-12, atol=0)


# -- 6. the shared solver start and the shared column extraction


def test_dense_matrix_columns_and_nonfinite_column():
    full = dense_matrix(_mv, B)
    assert torch.allclose(full, A, atol=0, rtol=0)
    cols = dense_matrix(_mv, B, columns=[4, 1])
    assert torch.equal(cols, full[:, [4, 1]])

    def bad(v):
        out = A @ v[0]
        return (out / v[0][2] if bool(v[0][2] == 0) else out,)  # column 2 is finite, others not

    with pytest.raises(hg.HypergradValueError, match="column 0"):
        dense_matrix(bad, B, solver="Exact")


def test_power_iteration_counts_the_products_it_spent():
    calls = []

    def zero(v):
        calls.append(1)
        return tuple(torch.zeros_like(t) for t in v)

    lam, spent = power_iteration(zero, B, iters=20)
    assert (lam, spent, len(calls)) == (0.0, 1, 1)
    calls.clear()
    lam, spent = power_iteration(lambda v: (calls.append(1), _mv(v))[1], B, iters=7)
    assert spent == len(calls) == 7


# -- 7. internal seams: no private names cross module boundaries; module docs name real files


def _modules_of_package():
    names = ["hypergrad"]
    names += [m.name for m in pkgutil.walk_packages([str(PACKAGE)], prefix="hypergrad.")]
    return sorted(names)


@pytest.mark.parametrize(
    "name", ["implicit", "modules", "unrolled", "testing", "conditions", "inner"]
)
def test_entry_points_import_no_private_names(name):
    """An entry point (a module, or every file of a subpackage) imports no ``_private`` name
    from another module; a subpackage's own private modules (``from ._run import run_check``)
    are its business, a private *name* never is."""
    path = PACKAGE / f"{name}.py"
    files = [path] if path.exists() else sorted((PACKAGE / name).glob("*.py"))
    assert files, name
    crossing = [
        f"{f.name}: {alias.name}"
        for f in files
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and node.level >= 1
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert not crossing, f"hypergrad/{name} imports private names {crossing}"


# a path a docstring sends the reader to: docs/x.md, examples/x.py, a bare DESIGN.md, ...
_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:md|py|json|toml|ya?ml|png))(?![\w/])")


def _docstring_paths(text: str) -> list[str]:
    return [p for p in _PATH.findall(text) if "/" in p or p.endswith(".md")]


def test_docstring_path_pattern():
    text = "See docs/guide.md, DESIGN.md section 3, ``examples/quickstart.py`` and hypergrad.tree."
    assert _docstring_paths(text) == ["docs/guide.md", "DESIGN.md", "examples/quickstart.py"]


@pytest.mark.parametrize("name", _modules_of_package())
def test_module_docstrings_point_at_files_that_exist(name):
    doc = importlib.import_module(name).__doc__ or ""
    missing = [p for p in _docstring_paths(doc) if not (ROOT / p).exists()]
    assert not missing, f"{name}'s docstring names files that do not exist: {missing}"
