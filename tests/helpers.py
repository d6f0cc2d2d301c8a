"""What several test files share: the repository root, float64, the relative error every
numerical comparison uses, the BORT² entry point, a tiny deterministic classifier, the one
list of every linear solver (:data:`ALL_SOLVERS`) with the checks of a solve's report, and the
one list of every proximal operator (:data:`ALL_PROX`)."""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import hypergrad as hg
from hypergrad.solvers.base import FAILURE_WARNINGS

ROOT = Path(__file__).resolve().parent.parent  # the repository
F64 = torch.float64
RUN_PY = ROOT / "examples" / "bort2" / "run.py"


def rel(x, ref) -> float:
    """``||x - ref|| / ||ref||`` over all entries (tensors, or what ``torch.as_tensor`` takes)."""
    x, ref = torch.as_tensor(x), torch.as_tensor(ref)
    return float(torch.linalg.norm((x - ref).reshape(-1)) / torch.linalg.norm(ref.reshape(-1)))


def run_module(name: str = "bort2_run") -> ModuleType:
    """``examples/bort2/run.py`` loaded as a module (its ``main(argv)`` is the command line)."""
    spec = importlib.util.spec_from_file_location(name, RUN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LinTanh(nn.Module):
    """Deterministic tiny classifier (no BatchNorm, no dropout): ``head(tanh(body(x)))``."""

    def __init__(self, in_dim: int = 12, d: int = 5, k: int = 3):
        super().__init__()
        self.body = nn.Linear(in_dim, d)
        self.head = nn.Linear(d, k)
        self.feature_dim = d

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(x.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


# ------------------------------------------------------------------ every linear solver

#: Tags of a row of :data:`ALL_SOLVERS` (as lineax's ``solvers_tags_pseudoinverse``): what the
#: solver needs of the operator and how it works.
SYMMETRIC = "symmetric"  # needs a symmetric operator (CG, MINRES, Neumann, Nystrom)
PSD = "psd"  # needs a positive-definite operator (CG, Neumann)
DIRECT = "direct"  # builds dense columns: ignores x0, costs one product per column or more
NEEDS_DAMPING = "needs damping"  # refuses damping = 0 (Nystrom)


def _row(make, *tags, id):
    return pytest.param(make, frozenset(tags), id=id)


#: Every solver of ``hypergrad.solvers`` (and each preconditioner of CG), as a factory (a
#: ``DensePreconditioner`` keeps state, so every test builds its own) and its tags. A new solver
#: is one row here; ``tests/hypergrad/test_solver_contract.py`` runs every property over it.
ALL_SOLVERS = [
    _row(lambda: hg.CG(tol=1e-10), SYMMETRIC, PSD, id="cg"),
    _row(lambda: hg.CG(tol=1e-10, preconditioner="hutchinson"), SYMMETRIC, PSD, id="cg-hutchinson"),
    _row(
        lambda: hg.CG(tol=1e-10, preconditioner=hg.DensePreconditioner()),
        SYMMETRIC,
        PSD,
        id="cg-dense-precond",
    ),
    _row(lambda: hg.MINRES(tol=1e-10), SYMMETRIC, id="minres"),
    _row(lambda: hg.Neumann(maxiter=3000, alpha=0.9, tol=1e-10), SYMMETRIC, PSD, id="neumann"),
    _row(lambda: hg.Neumann(maxiter=3000, tol=1e-10), SYMMETRIC, PSD, id="neumann-auto"),
    _row(lambda: hg.Exact(), DIRECT, id="exact"),
    _row(
        lambda: hg.Nystrom(rank=10_000, damping=1e-2),
        SYMMETRIC,
        DIRECT,
        NEEDS_DAMPING,
        id="nystrom",
    ),
    _row(lambda: hg.GMRES(tol=1e-10), id="gmres"),
    _row(lambda: hg.BiCGStab(tol=1e-10), id="bicgstab"),
]


def solver_tol(solver) -> float:
    """The tolerance ``converged`` is judged against (``Exact``'s fixed 1e-6 when it has none)."""
    tol = getattr(solver, "tol", None)
    return 1e-6 if tol is None else float(tol)


def check_report(info, x, a_damped, b, tol, categories) -> float:
    """The properties every solve's report keeps; returns the true relative residual of ``x``.

    ``info.failure`` is set exactly when a failure warning (one of ``FAILURE_WARNINGS``, among
    the warning ``categories`` recorded) was emitted, and ``extras["warned"]`` names it;
    ``converged`` only with a dense float64 residual within ``tol``; a verified
    ``info.residual`` is the true relative residual of ``x``.
    """
    failed = [c for c in categories if issubclass(c, FAILURE_WARNINGS)]
    assert (info.failure is not None) == bool(failed), (info.failure, categories, info)
    if failed:
        assert info.extras["warned"] in {c.__name__ for c in failed}
    true = float(torch.linalg.norm(a_damped @ x - b) / torch.linalg.norm(b))
    if info.converged:
        assert info.failure is None
        # a verified residual is the true one, so converged means within tol itself (up to the
        # rounding of the dense check); an unverified report gets a factor of 10 of slack
        slack = 1.0 + 1e-6 if info.extras.get("residual_verified") else 10.0
        assert true <= slack * tol + 1e-12, (true, info)
    if info.extras.get("residual_verified") and math.isfinite(true):
        assert info.residual == pytest.approx(true, rel=1e-6, abs=1e-12), (info.residual, true)
    return true


def min_norm(a, b):
    """The minimum-norm least-squares solution of ``a x = b`` (``numpy.linalg.lstsq``)."""
    return torch.from_numpy(np.linalg.lstsq(a.numpy(), b.numpy(), rcond=None)[0])


def psd(seed, rank, lo=0.1, n=12):
    """A random symmetric PSD ``n x n`` matrix of exact rank ``rank`` (eigenvalues in
    ``[lo, 1]``), with orthonormal bases of its range and null space."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64))
    s = torch.cat([torch.linspace(lo, 1.0, rank, dtype=F64), torch.zeros(n - rank, dtype=F64)])
    a = q @ torch.diag(s) @ q.T
    return 0.5 * (a + a.T), q[:, :rank], q[:, rank:]


# ------------------------------------------------------------------ every proximal operator


@dataclass(frozen=True)
class ProxCase:
    """One operator of ``hg.prox`` as ``tests/hypergrad/test_prox_contract.py`` sees it.

    ``x`` has shape :data:`PROX_X_SHAPE` (3 rows of 4 entries). The hyperparameters are
    tensors (what the derivative check differentiates): ``shapes`` are their shapes for that
    ``x``, ``make(u)`` turns uniform draws ``u`` in ``[0, 1)`` of those shapes into valid values
    (of any shape: ``make`` is applied to scalars too), and ``pack(ts)`` is the ``hparams``
    argument built from them. Exactly one of ``penalty`` (``g(y, hparams)``:
    the operator is ``argmin_y ½‖y − x‖² + scaling · g(y)``, ``inf`` outside its domain) and
    ``member`` (``(y, hparams, tol) -> bool``: the operator is the projection onto that convex
    set) is set.
    """

    op: Callable[..., Any]
    shapes: tuple[tuple[int, ...], ...]
    make: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]
    pack: Callable[[tuple[torch.Tensor, ...]], Any]
    penalty: Callable[[torch.Tensor, Any], torch.Tensor] | None = None
    member: Callable[[torch.Tensor, Any, float], bool] | None = None


#: The shape of ``x`` in :data:`ALL_PROX`'s checks: 3 rows (groups, simplices) of 4 entries.
PROX_X_SHAPE = (3, 4)


def _inf_unless(ok: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return value if bool(ok) else torch.full_like(value, math.inf)


def _row_norms(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).sum(-1).sqrt()


def _prox(case, id):
    return pytest.param(case, id=id)


#: Every operator of ``hg.prox`` (an operator with a keyword, such as ``prox_group_lasso``'s
#: ``dim``, once per setting that changes what it computes), with its hyperparameters and the
#: penalty or set it is the prox of. A new operator is one row here;
#: ``tests/hypergrad/test_prox_contract.py`` runs every property over it.
ALL_PROX = [
    _prox(
        ProxCase(
            hg.prox.prox_lasso,
            shapes=((4,),),  # per-coordinate strengths, broadcast over the rows
            make=lambda u: (0.2 + u[0],),
            pack=lambda t: t[0],
            penalty=lambda y, lam: (lam * y.abs()).sum(),
        ),
        id="lasso",
    ),
    _prox(
        ProxCase(
            hg.prox.prox_non_negative_lasso,
            shapes=((3, 4),),
            make=lambda u: (0.2 + u[0],),
            pack=lambda t: t[0],
            penalty=lambda y, lam: _inf_unless((y >= 0).all(), (lam * y).sum()),
        ),
        id="non_negative_lasso",
    ),
    _prox(
        ProxCase(
            hg.prox.prox_elastic_net,
            shapes=((4,), ()),
            make=lambda u: (0.2 + u[0], 0.3 + u[1]),
            pack=lambda t: (t[0], t[1]),
            penalty=lambda y, h: (h[0] * (y.abs() + 0.5 * h[1] * y * y)).sum(),
        ),
        id="elastic_net",
    ),
    _prox(
        ProxCase(
            hg.prox.prox_group_lasso,  # dim=None: the whole input is one group
            shapes=((),),
            make=lambda u: (0.5 + 2 * u[0],),
            pack=lambda t: t[0],
            penalty=lambda y, lam: lam * y.pow(2).sum().sqrt(),
        ),
        id="group_lasso",
    ),
    _prox(
        ProxCase(
            functools.partial(hg.prox.prox_group_lasso, dim=-1),  # each row a group
            shapes=((3,),),
            make=lambda u: (0.3 + u[0],),
            pack=lambda t: t[0],
            penalty=lambda y, lam: (lam * _row_norms(y)).sum(),
        ),
        id="group_lasso_rows",
    ),
    _prox(
        ProxCase(
            hg.prox.projection_non_negative,
            shapes=(),
            make=lambda u: (),
            pack=lambda t: None,
            member=lambda y, h, tol: bool((y >= -tol).all()),
        ),
        id="projection_non_negative",
    ),
    _prox(
        ProxCase(
            hg.prox.projection_box,
            shapes=((4,), (4,)),
            make=lambda u: (-0.2 - u[0], 0.2 + u[1]),
            pack=lambda t: (t[0], t[1]),
            member=lambda y, h, tol: bool(((y >= h[0] - tol) & (y <= h[1] + tol)).all()),
        ),
        id="projection_box",
    ),
    _prox(
        ProxCase(
            hg.prox.projection_simplex,
            shapes=((3,),),  # one value per row
            make=lambda u: (0.5 + u[0],),
            pack=lambda t: t[0],
            member=lambda y, v, tol: bool(
                (y >= -tol).all() and ((y.sum(-1) - v).abs() <= tol * (1 + v.abs())).all()
            ),
        ),
        id="projection_simplex",
    ),
    _prox(
        ProxCase(
            hg.prox.projection_l2_ball,
            shapes=((),),
            make=lambda u: (1.0 + 3 * u[0],),
            pack=lambda t: t[0],
            member=lambda y, r, tol: bool(y.pow(2).sum().sqrt() <= r * (1 + tol)),
        ),
        id="projection_l2_ball",
    ),
]


# --- inner solvers (hg.inner) --------------------------------------------------------------


class InnerCase:
    """One row of :data:`ALL_INNER`: a solver on a small float64 problem whose solution depends
    smoothly on ``theta`` (a tensor), and an independent measure of its residual.

    ``make()`` builds the solver (a ``DensePreconditioner`` keeps state, so every test builds
    its own); ``hparams(theta)`` is what ``solve``/``run`` take; ``residual(x, theta, info)``
    recomputes the solver's relative residual at ``x`` from the problem alone (the step size of
    a proximal-gradient report is read from ``info``)."""

    def __init__(self, make, x0, theta, hparams, residual):
        self.make, self.x0, self.theta = make, x0, theta
        self.hparams, self.residual = hparams, residual


def _inner_problems():
    gen = torch.Generator().manual_seed(31)
    W = torch.randn(4, 4, generator=gen, dtype=F64)
    W = 0.5 * W / torch.linalg.matrix_norm(W, 2)  # a contraction: tanh is 1-Lipschitz
    T = lambda z, h: torch.tanh(W @ z + h)  # noqa: E731
    A = torch.randn(12, 4, generator=gen, dtype=F64) + 2.0 * torch.eye(12, 4, dtype=F64)
    b = A @ torch.tensor([1.0, -2.0, 0.05, 3.0], dtype=F64)
    f = lambda w, _: 0.5 * ((A @ w - b) ** 2).sum()  # noqa: E731
    X = torch.randn(40, 4, generator=gen, dtype=F64)
    y = (X @ torch.tensor([1.0, -1.0, 0.5, 0.0], dtype=F64) > 0).to(F64)
    logreg = lambda w, lam: (  # noqa: E731
        torch.nn.functional.binary_cross_entropy_with_logits(X @ w, y) + 0.5 * lam * (w**2).sum()
    )

    def fp_residual(x, h, info):
        z0 = torch.zeros(4, dtype=F64)
        ref = float(torch.linalg.norm(T(z0, h) - z0))
        return float(torch.linalg.norm(T(x, h) - x)) / max(float(torch.linalg.norm(x)), ref)

    def mapping(v, lam, s):
        g = torch.func.grad(f)(v, None)
        return torch.linalg.norm(v - hg.prox.prox_lasso(v - s * g, lam, s)) / s

    def pg_residual(x, lam, info):
        s = info.stepsize
        return float(mapping(x, lam, s) / mapping(torch.zeros(4, dtype=F64), lam, s))

    def smooth_residual(x, lam, info):
        g = torch.func.grad(logreg)
        return float(torch.linalg.norm(g(x, lam)) / torch.linalg.norm(g(0 * x, lam)))

    z0 = torch.zeros(4, dtype=F64)
    h = torch.tensor([0.3, -0.2, 0.5, 0.1], dtype=F64)
    lam, ridge = torch.tensor(0.5, dtype=F64), torch.tensor(0.05, dtype=F64)
    I = hg.inner  # noqa: E741
    fp = dict(x0=z0, theta=h, hparams=lambda t: t, residual=fp_residual)
    pg = dict(x0=z0, theta=lam, hparams=lambda t: ((), t), residual=pg_residual)
    sm = dict(x0=z0, theta=ridge, hparams=lambda t: t, residual=smooth_residual)
    prox = hg.prox.prox_lasso
    return [
        ("fixed-point-anderson", InnerCase(lambda: I.FixedPoint(T, tol=1e-12), **fp)),
        (
            "fixed-point-picard",
            InnerCase(lambda: I.FixedPoint(T, method="picard", tol=1e-12), **fp),
        ),
        ("fista", InnerCase(lambda: I.ProximalGradient(f, prox, tol=1e-12, maxiter=5000), **pg)),
        (
            "ista-fixed-step",
            InnerCase(
                lambda: I.ProximalGradient(
                    f, prox, stepsize=0.01, accelerated=False, tol=1e-12, maxiter=20000
                ),
                **pg,
            ),
        ),
        ("newton", InnerCase(lambda: I.Newton(logreg, tol=1e-12), **sm)),
        (
            "newton-reuse-hessian",
            InnerCase(lambda: I.Newton(logreg, tol=1e-12, reuse_hessian=True), **sm),
        ),
        ("lbfgs", InnerCase(lambda: I.LBFGS(logreg, tol=1e-10), **sm)),
    ]


#: Every inner solver of ``hg.inner`` (and its variants) on a small problem. A new inner solver
#: is one row here; ``tests/hypergrad/test_inner_contract.py`` runs every property over it.
ALL_INNER = [pytest.param(case, id=name) for name, case in _inner_problems()]


def log_decay_ridge(d: int, n: int, n_val: int, seed: int = 0):
    """Ridge regression with one log-decay per feature: ``(inner, outer, theta, closed)`` where
    ``closed(θ)`` returns ``w*(θ) = (XᵀX/n + diag(e^θ))⁻¹ Xᵀy/n`` and the hypergradient
    ``d outer/dθ = −e^θ ⊙ w* ⊙ H⁻¹ ∂_w outer`` in closed form (dense float64 solves)."""
    g = torch.Generator().manual_seed(seed)
    X, Xv = torch.randn(n, d, generator=g, dtype=F64), torch.randn(n_val, d, generator=g, dtype=F64)
    y, yv = torch.randn(n, generator=g, dtype=F64), torch.randn(n_val, generator=g, dtype=F64)
    theta = 0.5 * torch.randn(d, generator=g, dtype=F64)

    def inner(w, th):
        return 0.5 * ((X @ w - y) ** 2).mean() + 0.5 * (th.exp() * w**2).sum()

    def outer(w, th):
        return 0.5 * ((Xv @ w - yv) ** 2).mean()

    def closed(th):
        H = X.T @ X / n + torch.diag(th.exp())
        w = torch.linalg.solve(H, X.T @ y / n)
        adj = torch.linalg.solve(H, Xv.T @ (Xv @ w - yv) / n_val)
        return w, -th.exp() * w * adj

    return inner, outer, theta, closed
