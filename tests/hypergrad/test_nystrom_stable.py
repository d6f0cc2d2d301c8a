"""Nystrom stays accurate for every rho > 0 (no Woodbury 1/rho**2 cancellation).

At full rank the Nystrom approximation is the operator itself, so the solve must agree with a
dense solve of ``A + rho I`` for rho from 1e-10 to 1; the textbook Woodbury form (computed inline
below as the reference of the failure) loses ~eps * lambda / rho there. At lower rank it must
agree with an independently built dense Nystrom approximation ``C pinv(W) C^T``.
"""

import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from helpers import rel as _rel

import hypergrad as hg
from hypergrad.solvers import solve_nystrom

F64 = torch.float64
RHOS = [1e-10, 1e-8, 1e-6, 1e-4, 1e-2, 1.0]
SHAPES = [(4,), (2, 4)]  # 12 unknowns over two leaves
N = 12


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _from_eigs(eigs, seed):
    q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), generator=_gen(seed), dtype=F64))
    a = q @ torch.diag(torch.as_tensor(eigs, dtype=F64)) @ q.T
    return 0.5 * (a + a.T)


def _int_psd(n, r, seed):
    """An exactly rank-``r`` PSD matrix G G^T with small integer G: its null space is exact in
    float64 (a matrix built as Q diag Q^T in floating point has +-1e-16 "zero" eigenvalues, and
    then no float64 method can reproduce its solve at rho = 1e-10 to 1e-8)."""
    g = torch.randint(-3, 4, (n, r), generator=_gen(seed)).to(F64)
    return g @ g.T


MATRICES = {
    "spd": _from_eigs(torch.linspace(0.2, 20.0, N), 1),
    "ill_conditioned": _from_eigs(torch.logspace(0, -6, N), 2),  # condition number 1e6
}


def _unravel(v):
    out, i = [], 0
    for s in SHAPES:
        n = int(np.prod(s))
        out.append(v[i : i + n].reshape(s))
        i += n
    return tuple(out)


def _ravel(x):
    return torch.cat([t.reshape(-1) for t in x])


def _mv(a):
    return lambda v: _unravel(a.to(v[0].dtype) @ _ravel(v))


def _rhs(seed, n=N):
    return torch.randn(n, generator=_gen(seed), dtype=F64)


def _exact(a, b, rho):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Exact may warn about the conditioning at rho=1e-10
        x, _ = hg.Exact(damping=rho).solve(_mv(a), _unravel(b))
    return _ravel(x)


def _woodbury(a, b, rho, idx):
    """The previous implementation (Woodbury):
    (A_k + rho I)^{-1} b = b/rho - C (W + C^T C/rho)^+ C^T b / rho^2."""
    c = a[:, idx]
    w = c[idx]
    w = 0.5 * (w + w.T)
    coef = torch.linalg.lstsq(w + (c.T @ c) / rho, c.T @ b).solution
    return b / rho - (c @ coef) / rho**2


def _rational_solve(a, b, rho):
    """Exact solution of (a + rho I) x = b in rational arithmetic (a, b, rho taken as the exact
    binary values of their float64 entries), rounded to float64 at the end."""
    n = a.shape[0]
    m = [[Fraction(float(a[i, j])) for j in range(n)] + [Fraction(float(b[i]))] for i in range(n)]
    for i in range(n):
        m[i][i] += Fraction(rho)
    for col in range(n):
        piv = next(r for r in range(col, n) if m[r][col] != 0)
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for j in range(col, n + 1):
                    m[r][j] -= f * m[col][j]
    x = [Fraction(0)] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return torch.tensor([float(v) for v in x], dtype=F64)


# --------------------------------------------------------------------------- full rank


@pytest.mark.parametrize("rho", RHOS)
@pytest.mark.parametrize("name", sorted(MATRICES))
def test_full_rank_matches_exact_for_every_rho(name, rho):
    a = MATRICES[name]
    b = _rhs(10)
    x, info = hg.Nystrom(rank=N, damping=rho).solve(_mv(a), _unravel(b))
    ref = _exact(a, b, rho)
    assert _rel(_ravel(x), ref) < 1e-8
    assert info.extras["rank"] == N and info.extras["numerical_rank"] == N
    assert info.extras["residual_verified"] and not info.diverged
    # the reported residual is the true one of the returned x
    true_res = torch.linalg.norm((a + rho * torch.eye(N, dtype=F64)) @ _ravel(x) - b)
    assert info.residual == pytest.approx(float(true_res / torch.linalg.norm(b)), abs=1e-12)


@pytest.mark.parametrize("name", sorted(MATRICES))
def test_old_woodbury_form_fails_where_the_new_one_holds(name):
    # the reference of the failure: same sampled columns, Woodbury's 1/rho**2 cancellation
    a = MATRICES[name]
    b = _rhs(10)
    rho = 1e-10
    idx = torch.randperm(N, generator=_gen(0))  # the solver's sampling with seed=0
    ref = _exact(a, b, rho)
    assert _rel(_woodbury(a, b, rho, idx), ref) > 1e-6
    x, _ = solve_nystrom(_mv(a), _unravel(b), rank=N, damping=rho, seed=0)
    assert _rel(_ravel(x), ref) < 1e-8


@pytest.mark.parametrize("rho", RHOS)
def test_full_rank_rank_deficient_psd(rho):
    # exactly rank 6 of 12: W = A[S, S] is singular, its zero eigenvalues are dropped and the
    # null-space part of b is solved by 1/rho alone
    a = _int_psd(N, 6, 3)
    b = _rhs(11)
    x, info = hg.Nystrom(rank=N, damping=rho).solve(_mv(a), _unravel(b))
    ref = _rational_solve(a, b, rho)
    assert _rel(_ravel(x), ref) < 1e-8
    assert info.extras["numerical_rank"] == 6
    if rho >= 1e-4:
        # a dense LU of A + rho I errs by ~eps * ||A|| / rho on a singular A (measured against
        # the rational solution: 1e-5 at rho=1e-10, 3e-7 at 1e-8, 3e-9 at 1e-6, 2e-11 at 1e-4),
        # so hg.Exact is a safe 1e-8 reference here only from rho = 1e-4 on
        assert _rel(_ravel(x), _exact(a, b, rho)) < 1e-8


def test_rational_reference_agrees_with_exact_on_a_regular_matrix():
    # guards the rational reference itself
    a = MATRICES["spd"]
    b = _rhs(12)
    assert _rel(_rational_solve(a, b, 1e-2), _exact(a, b, 1e-2)) < 1e-13


def test_full_rank_indefinite_operator():
    # W's negative eigenvalues are kept with their sign: at full rank A_k = A for any symmetric A
    a = _from_eigs(torch.cat([torch.linspace(-3.0, -0.5, 4), torch.linspace(0.5, 5.0, 8)]), 4)
    b = _rhs(13)
    for rho in (1e-8, 0.1):
        x, info = hg.Nystrom(rank=N, damping=rho).solve(_mv(a), _unravel(b))
        assert _rel(_ravel(x), _exact(a, b, rho)) < 1e-10
        assert info.converged


def test_float32_leaves_full_rank():
    a = MATRICES["spd"]
    b = _rhs(14)
    x, info = hg.Nystrom(rank=N, damping=1e-6, tol=1e-5).solve(_mv(a), _unravel(b.float()))
    assert all(t.dtype == torch.float32 for t in x)
    assert _rel(_ravel(x).double(), _exact(a, b, 1e-6)) < 1e-5
    assert info.converged


def test_zero_operator_gives_b_over_rho():
    b = _rhs(15)
    x, info = hg.Nystrom(rank=5, damping=0.25).solve(lambda v: tuple(0 * t for t in v), _unravel(b))
    torch.testing.assert_close(_ravel(x), b / 0.25, rtol=0, atol=0)
    assert info.extras["numerical_rank"] == 0 and info.converged


# --------------------------------------------------------------------------- lower rank


def _dense_nystrom_solve(a, b, rho, k, seed):
    """Independent reference: A_k = C pinv(W) C^T built densely in numpy, then a dense solve."""
    idx = torch.randperm(a.shape[0], generator=_gen(seed))[:k].numpy()
    an = a.numpy()
    c = an[:, idx]
    w = c[idx]
    ak = c @ np.linalg.pinv(0.5 * (w + w.T), hermitian=True) @ c.T
    ak = 0.5 * (ak + ak.T)
    return torch.from_numpy(np.linalg.solve(ak + rho * np.eye(a.shape[0]), b.numpy()))


@pytest.mark.parametrize("rho", [1e-4, 1e-2, 1.0])
@pytest.mark.parametrize("k", [3, 6, 9])
@pytest.mark.parametrize("seed", [0, 5])
def test_lower_rank_matches_dense_nystrom_reference(k, rho, seed):
    n = 24
    a = _from_eigs(1.0 / torch.arange(1, n + 1, dtype=F64) ** 2, 20)  # decaying spectrum
    b = _rhs(21, n)
    mv = lambda v: (a @ v[0],)  # noqa: E731
    x, info = solve_nystrom(mv, (b,), rank=k, damping=rho, seed=seed)
    ref = _dense_nystrom_solve(a, b, rho, k, seed)
    assert _rel(x[0], ref) < 1e-8
    assert info.extras["rank"] == k and info.extras["numerical_rank"] == k
    # a rank-k approximation of a full-rank operator does not solve A + rho I; the report says so
    true_res = torch.linalg.norm((a + rho * torch.eye(n, dtype=F64)) @ x[0] - b)
    assert info.residual == pytest.approx(float(true_res / torch.linalg.norm(b)), rel=1e-10)
