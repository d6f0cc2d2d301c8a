"""Implicit hypergradients against closed forms, dense solves and finite differences.

* ridge regression (scalar and per-feature decay) on scikit-learn's diabetes and breast-cancer
  data: closed form ``-diag(w) A^{-1} grad L_out`` / ``-w^T A^{-1} grad L_out``;
* logistic regression with per-feature decay: central finite differences of a Newton solve;
* property tests: pytree splits of params / hparams, float32 inputs, damping;
* the ``@hg.implicit`` decorator against ``implicit_grad`` and the closed form.
"""

import warnings

import pytest
import torch
from helpers import rel as _rel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_breast_cancer, load_diabetes

import hypergrad as hg

F64 = torch.float64
HYP = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# --------------------------------------------------------------------------- data

_CACHE = {}


def _dataset(name):
    """Standardised (with train statistics) train/validation split, float64."""
    if name not in _CACHE:
        loader = {"diabetes": load_diabetes, "breast_cancer": load_breast_cancer}[name]
        X, y = loader(return_X_y=True)
        X, y = torch.tensor(X, dtype=F64), torch.tensor(y, dtype=F64)
        perm = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(0))
        X, y = X[perm], y[perm]
        n_tr = int(0.6 * X.shape[0])
        mu, sd = X[:n_tr].mean(0), X[:n_tr].std(0)
        ym, ys = y[:n_tr].mean(), y[:n_tr].std()
        X = (X - mu) / sd
        y = (y - ym) / ys
        _CACHE[name] = (X[:n_tr], y[:n_tr], X[n_tr:], y[n_tr:])
    return _CACHE[name]


class Ridge:
    """inner = 1/2 ||Xw - y||^2 / n + 1/2 sum_j lam_j w_j^2; outer = 1/2 ||Xv w - yv||^2 / nv."""

    def __init__(self, name, per_feature, seed=0):
        self.X, self.y, self.Xv, self.yv = _dataset(name)
        self.n, self.d = self.X.shape
        g = torch.Generator().manual_seed(seed)
        if per_feature:
            self.lam = 0.1 + 0.9 * torch.rand(self.d, generator=g, dtype=F64)
        else:
            self.lam = torch.tensor(0.3, dtype=F64)
        self.per_feature = per_feature

    def inner(self, w, lam):
        return 0.5 * ((self.X @ w - self.y) ** 2).sum() / self.n + 0.5 * (lam * w**2).sum()

    def outer(self, w, lam):
        return 0.5 * ((self.Xv @ w - self.yv) ** 2).sum() / self.Xv.shape[0]

    def A(self, damping=0.0):
        lam = self.lam if self.per_feature else self.lam * torch.ones(self.d, dtype=F64)
        return self.X.T @ self.X / self.n + torch.diag(lam) + damping * torch.eye(self.d, dtype=F64)

    def w_star(self):
        return torch.linalg.solve(self.A(), self.X.T @ self.y / self.n)

    def closed_form(self, w, damping=0.0):
        g_out = self.Xv.T @ (self.Xv @ w - self.yv) / self.Xv.shape[0]
        z = torch.linalg.solve(self.A(damping), g_out)
        return -(w * z) if self.per_feature else -(w @ z)


DATASETS = ["diabetes", "breast_cancer"]


@pytest.mark.parametrize("per_feature", [False, True])
@pytest.mark.parametrize("name", DATASETS)
@pytest.mark.parametrize(
    "solver",
    [
        hg.CG(maxiter=1000, tol=1e-13),
        hg.MINRES(maxiter=1000, tol=1e-13),
        hg.Exact(),
    ],
    ids=["cg", "minres", "exact"],
)
def test_ridge_closed_form(name, per_feature, solver):
    r = Ridge(name, per_feature)
    w = r.w_star()
    g, info = hg.implicit_grad(r.inner, r.outer, w, r.lam, solver=solver)
    ref = r.closed_form(w)
    assert g.shape == r.lam.shape and g.dtype == F64
    assert _rel(g, ref) <= 1e-8
    assert info.solve.converged
    assert info.outer_loss == pytest.approx(float(r.outer(w, r.lam)), rel=1e-12)
    assert info.inner_loss == pytest.approx(float(r.inner(w, r.lam)), rel=1e-12)
    assert info.hypergrad_norm == pytest.approx(float(torch.linalg.norm(ref)), rel=1e-7)
    assert info.direct_norm == 0.0


@pytest.mark.parametrize("per_feature", [False, True])
@pytest.mark.parametrize("name", DATASETS)
def test_ridge_neumann_alpha_none(name, per_feature):
    r = Ridge(name, per_feature)
    w = r.w_star()
    ev = torch.linalg.eigvalsh(r.A())
    steps = int(18.5 / (float(ev.min() / ev.max()))) + 10  # (1 - 1/kappa)^K < 1e-8
    g, info = hg.implicit_grad(r.inner, r.outer, w, r.lam, solver=hg.Neumann(maxiter=steps))
    assert info.solve.alpha == pytest.approx(1.0 / float(ev.max()), rel=1e-2)
    assert _rel(g, r.closed_form(w)) <= 1e-4


@pytest.mark.parametrize("per_feature", [False, True])
@pytest.mark.parametrize("name", DATASETS)
def test_ridge_nystrom_full_rank_equals_damped_closed_form(name, per_feature):
    r = Ridge(name, per_feature)
    w = r.w_star()
    rho = 1e-3
    g, _ = hg.implicit_grad(r.inner, r.outer, w, r.lam, solver=hg.Nystrom(rank=r.d, damping=rho))
    assert _rel(g, r.closed_form(w, damping=rho)) <= 1e-6
    # and it is measurably different from the undamped answer only at the rho level
    assert _rel(g, r.closed_form(w)) < 1e-1


@pytest.mark.parametrize("damping", [0.05, 1.0])
@pytest.mark.parametrize("name", DATASETS)
def test_ridge_damping_equals_damped_closed_form(name, damping):
    r = Ridge(name, True)
    w = r.w_star()
    ref = r.closed_form(w, damping=damping)
    for solver in (hg.CG(maxiter=1000, tol=1e-13, damping=damping), hg.Exact(damping=damping)):
        g, _ = hg.implicit_grad(r.inner, r.outer, w, r.lam, solver=solver)
        assert _rel(g, ref) <= 1e-8
    assert _rel(ref, r.closed_form(w)) > 1e-3  # damping matters at this size


def test_ridge_engines_and_warm_start_agree():
    r = Ridge("diabetes", True)
    w = r.w_star()
    ref = r.closed_form(w)
    g1, i1 = hg.implicit_grad(r.inner, r.outer, w, r.lam, solver=hg.CG(tol=1e-13, maxiter=500))
    g2, _ = hg.implicit_grad(
        r.inner, r.outer, w, r.lam, solver=hg.CG(tol=1e-13, maxiter=500), engine="recompute"
    )
    assert _rel(g1, ref) <= 1e-8 and _rel(g2, ref) <= 1e-8
    # warm start at the adjoint solution: CG stops at once and gives the same answer
    g_out = r.Xv.T @ (r.Xv @ w - r.yv) / r.Xv.shape[0]
    x0 = torch.linalg.solve(r.A(), g_out)
    g3, i3 = hg.implicit_grad(
        r.inner, r.outer, w, r.lam, solver=hg.CG(tol=1e-10, maxiter=500), x0=x0
    )
    assert i3.solve.iterations <= 1 < i1.solve.iterations
    assert _rel(g3, ref) <= 1e-8


def test_outer_direct_dependence_added():
    r = Ridge("diabetes", True)
    w = r.w_star()

    def outer(w, lam):
        return r.outer(w, lam) + 0.5 * (lam**3).sum() + (w * lam).sum()

    g, info = hg.implicit_grad(r.inner, outer, w, r.lam, solver=hg.Exact())
    g_out = r.Xv.T @ (r.Xv @ w - r.yv) / r.Xv.shape[0] + r.lam
    z = torch.linalg.solve(r.A(), g_out)
    ref = 1.5 * r.lam**2 + w - w * z
    assert _rel(g, ref) <= 1e-10
    assert info.direct_norm == pytest.approx(float(torch.linalg.norm(1.5 * r.lam**2 + w)))


# ------------------------------------------------------------------ coupled multi-leaf Exact


def _coupled_problem(seed=0, n=11):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    A = q @ torch.diag(torch.linspace(0.5, 6.0, n, dtype=F64)) @ q.T
    A = 0.5 * (A + A.T)
    B = torch.randn(n, 3, generator=g, dtype=F64)
    t = torch.randn(n, generator=g, dtype=F64)
    w = torch.randn(n, generator=g, dtype=F64)
    h = torch.randn(3, generator=g, dtype=F64)
    return A, B, t, w, h


@pytest.mark.filterwarnings("ignore::hypergrad.NonStationaryWarning")  # the formula off the optimum
@pytest.mark.parametrize("container", ["dict", "tuple"])
def test_exact_multileaf_coupled_blocks(container):
    A, B, t, w, h = _coupled_problem()
    assert float(A[:4, 4:].abs().max()) > 0.1  # leaves are coupled

    def flat(p):
        if container == "dict":
            return torch.cat([p["a"].reshape(-1), p["b"].reshape(-1)])
        return torch.cat([p[0].reshape(-1), p[1].reshape(-1)])

    def inner(p, hp):
        v = flat(p)
        return 0.5 * v @ A @ v - v @ (B @ hp)

    def outer(p, hp):
        return 0.5 * ((flat(p) - t) ** 2).sum()

    a, b = w[:4].reshape(2, 2).clone(), w[4:].clone()
    params = {"a": a, "b": b} if container == "dict" else (a, b)
    g, info = hg.implicit_grad(inner, outer, params, h, solver=hg.Exact())
    ref = B.T @ torch.linalg.solve(A, w - t)  # mixed = -B, so hyper = +B^T A^{-1} g_out
    assert _rel(g, ref) <= 1e-12
    # the per-leaf block-diagonal approximation is wrong here
    blk = torch.block_diag(A[:4, :4], A[4:, 4:])
    assert _rel(B.T @ torch.linalg.solve(blk, w - t), ref) > 1e-2


# --------------------------------------------------------------------------- property tests


class Quadratic:
    """inner = 1/2 w^T (A + diag(D h)) w - w^T B h, outer = 1/2 ||w - t||^2 + 0.1 ||h||^2."""

    def __init__(self, n, m, seed, dtype=F64):
        g = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
        self.A = q @ torch.diag(1.0 + 2.0 * torch.rand(n, generator=g, dtype=F64)) @ q.T
        self.A = 0.5 * (self.A + self.A.T)
        self.D = 0.5 * torch.rand(n, m, generator=g, dtype=F64)
        self.B = torch.randn(n, m, generator=g, dtype=F64)
        self.t = torch.randn(n, generator=g, dtype=F64)
        self.w = torch.randn(n, generator=g, dtype=F64)
        self.h = 0.1 + torch.rand(m, generator=g, dtype=F64)
        self.n, self.m = n, m
        self.cast(dtype)

    def cast(self, dtype):
        self.dtype = dtype
        self.Ac, self.Dc, self.Bc, self.tc = (x.to(dtype) for x in (self.A, self.D, self.B, self.t))

    def inner_flat(self, w, h):
        return 0.5 * w @ (self.Ac @ w) + 0.5 * (self.Dc @ h * w * w).sum() - w @ (self.Bc @ h)

    def outer_flat(self, w, h):
        return 0.5 * ((w - self.tc) ** 2).sum() + 0.1 * (h**2).sum()

    def closed_form(self, damping=0.0, parts=False):
        H = self.A + torch.diag(self.D @ self.h) + damping * torch.eye(self.n, dtype=F64)
        M = self.D * self.w[:, None] - self.B  # d/dh of grad_w inner
        direct, indirect = 0.2 * self.h, M.T @ torch.linalg.solve(H, self.w - self.t)
        return (direct, indirect) if parts else direct - indirect


def _split(vec, cuts, shapes_kind, container):
    pieces, start = [], 0
    for i, c in enumerate(list(cuts) + [vec.numel()]):
        seg = vec[start:c].clone()
        kind = shapes_kind[i % len(shapes_kind)]
        if kind == 1:
            seg = seg.reshape(1, -1)
        elif kind == 2:
            seg = seg.reshape(-1, 1)
        pieces.append(seg)
        start = c
    if container == "dict":
        return {f"k{i}": p for i, p in enumerate(pieces)}
    if container == "nested":
        return (pieces[0], {"rest": list(pieces[1:])})
    return tuple(pieces)


def _join(tree):
    leaves, _ = hg.tree.tree_flatten(tree)
    return torch.cat([t.reshape(-1) for t in leaves])


@st.composite
def split_case(draw):
    n = draw(st.integers(2, 9))
    m = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 10_000))
    p_cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=min(3, n - 1))))
    h_cuts = sorted(draw(st.sets(st.integers(1, m - 1), max_size=m - 1))) if m > 1 else []
    kinds = draw(st.lists(st.integers(0, 2), min_size=1, max_size=4))
    pc = draw(st.sampled_from(["dict", "tuple", "nested"]))
    hc = draw(st.sampled_from(["dict", "tuple", "scalar"]))
    return n, m, seed, p_cuts, h_cuts, kinds, pc, hc


@pytest.mark.filterwarnings("ignore::hypergrad.NonStationaryWarning")  # the formula off the optimum
@HYP
@given(case=split_case(), use_exact=st.booleans())
def test_property_pytree_splits_match_flat(case, use_exact):
    n, m, seed, p_cuts, h_cuts, kinds, pc, hc = case
    if hc == "scalar":
        m, h_cuts = 1, []
    q = Quadratic(n, m, seed)
    params = _split(q.w, p_cuts, kinds, pc)
    if hc == "scalar":
        hparams = q.h.reshape(())
    else:
        hparams = _split(q.h, h_cuts, kinds[::-1], hc)

    def inner(p, h):
        return q.inner_flat(_join(p), _join(h))

    def outer(p, h):
        return q.outer_flat(_join(p), _join(h))

    solver = hg.Exact() if use_exact else hg.CG(tol=1e-13, maxiter=200)
    g_tree, _ = hg.implicit_grad(inner, outer, params, hparams, solver=solver)
    g_flat, _ = hg.implicit_grad(q.inner_flat, q.outer_flat, q.w, q.h, solver=solver)
    # same structure and shapes as hparams
    h_leaves, h_spec = hg.tree.tree_flatten(hparams)
    g_leaves, g_spec = hg.tree.tree_flatten(g_tree)
    assert g_spec == h_spec
    assert [a.shape for a in g_leaves] == [b.shape for b in h_leaves]
    ref = q.closed_form()
    assert _rel(_join(g_tree), g_flat) <= 1e-10
    assert _rel(g_flat, ref) <= 1e-9


@pytest.mark.filterwarnings("ignore::hypergrad.NonStationaryWarning")  # the formula off the optimum
@HYP
@given(n=st.integers(2, 10), m=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_property_float32_inputs_give_float64_answer(n, m, seed):
    q = Quadratic(n, m, seed, dtype=torch.float32)
    direct, indirect = q.closed_form(parts=True)
    ref = direct - indirect
    # float32 rounding is relative to the size of the two terms, which may nearly cancel
    scale = float(direct.norm() + indirect.norm())
    for solver in (hg.Exact(), hg.CG(tol=1e-7, maxiter=100)):
        g, info = hg.implicit_grad(
            q.inner_flat, q.outer_flat, q.w.float(), q.h.float(), solver=solver
        )
        assert g.dtype == torch.float32
        assert float((g.double() - ref).norm()) <= 1e-4 * scale


@pytest.mark.filterwarnings("ignore::hypergrad.NonStationaryWarning")  # the formula off the optimum
@HYP
@given(
    n=st.integers(2, 8),
    m=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    damping=st.floats(0.0, 10.0),
)
def test_property_damping(n, m, seed, damping):
    q = Quadratic(n, m, seed)
    ref = q.closed_form(damping)
    for solver in (
        hg.Exact(damping=damping),
        hg.CG(tol=1e-13, maxiter=200, damping=damping),
        hg.MINRES(tol=1e-13, maxiter=200, damping=damping),
    ):
        g, _ = hg.implicit_grad(q.inner_flat, q.outer_flat, q.w, q.h, solver=solver)
        assert _rel(g, ref) <= 1e-9


# --------------------------------------------------------------------------- logistic + FD


class Logistic:
    """Logistic regression (no bias) on a breast-cancer subset with per-feature decay."""

    def __init__(self, d=8, n_tr=200, n_val=150):
        X, y = load_breast_cancer(return_X_y=True)
        X, y = torch.tensor(X, dtype=F64), torch.tensor(y, dtype=F64) * 2 - 1
        perm = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(1))
        X, y = X[perm][:, :d], y[perm]
        X = (X - X[:n_tr].mean(0)) / X[:n_tr].std(0)
        self.X, self.y = X[:n_tr], y[:n_tr]
        self.Xv, self.yv = X[n_tr : n_tr + n_val], y[n_tr : n_tr + n_val]
        self.lam = torch.linspace(0.01, 0.2, d, dtype=F64)
        self.d = d

    def inner(self, w, lam):
        return (
            torch.nn.functional.softplus(-self.y * (self.X @ w)).mean() + 0.5 * (lam * w**2).sum()
        )

    def outer(self, w, lam):
        return torch.nn.functional.softplus(-self.yv * (self.Xv @ w)).mean()

    def newton(self, lam, w0=None):
        w = torch.zeros(self.d, dtype=F64) if w0 is None else w0.clone()
        n = self.X.shape[0]
        extra = 0
        for _ in range(100):
            z = self.y * (self.X @ w)
            s = torch.sigmoid(-z)
            grad = -(self.X.T @ (self.y * s)) / n + lam * w
            if float(grad.norm()) < 1e-12:
                extra += 1
                if extra > 2:
                    break
            p = s * (1 - s)
            H = self.X.T @ (p[:, None] * self.X) / n + torch.diag(lam)
            w = w - torch.linalg.solve(H, grad)
        assert float(grad.norm()) < 1e-12
        return w


def test_logistic_per_feature_decay_matches_finite_differences():
    lg = Logistic()
    w = lg.newton(lg.lam)
    h = 1e-5
    fd = torch.zeros(lg.d, dtype=F64)
    for j in range(lg.d):
        e = torch.zeros(lg.d, dtype=F64)
        e[j] = h
        lp = lg.outer(lg.newton(lg.lam + e, w), None)
        lm = lg.outer(lg.newton(lg.lam - e, w), None)
        fd[j] = (lp - lm) / (2 * h)
    for solver in (hg.CG(tol=1e-14, maxiter=200), hg.Exact()):
        g, info = hg.implicit_grad(lg.inner, lg.outer, w, lg.lam, solver=solver)
        assert _rel(g, fd) <= 1e-6


# --------------------------------------------------------------------------- @hg.implicit


@pytest.mark.parametrize("solver", [hg.CG(tol=1e-13, maxiter=500), hg.Exact()], ids=["cg", "exact"])
def test_decorator_matches_implicit_grad_with_direct_term(solver):
    r = Ridge("diabetes", True)

    @hg.implicit(r.inner, solver=solver)
    def fit(lam):
        A = r.X.T @ r.X / r.n + torch.diag(lam)
        return torch.linalg.solve(A, r.X.T @ r.y / r.n)

    def outer(w, lam):
        return r.outer(w, lam) + 0.3 * (lam**2).sum()

    lam = r.lam.clone().requires_grad_(True)
    w = fit(lam)
    assert w.requires_grad and w.grad_fn is not None
    outer(w, lam).backward()
    w_star = r.w_star()
    torch.testing.assert_close(w.detach(), w_star, rtol=1e-12, atol=1e-14)
    ref_lib, _ = hg.implicit_grad(r.inner, outer, w_star, r.lam, solver=solver)
    ref = r.closed_form(w_star) + 0.6 * r.lam
    assert _rel(lam.grad, ref_lib) <= 1e-10
    assert _rel(lam.grad, ref) <= 1e-8
    assert fit.last_info.solve.converged


def test_decorator_pytree_outputs_and_nonleaf_hparams():
    r = Ridge("diabetes", True)
    k = 4

    def inner(p, hp):
        w = torch.cat([p["head"], p["tail"][0]])
        lam = torch.cat([hp[0], hp[1]])
        return r.inner(w, lam)

    @hg.implicit(inner, solver=hg.Exact())
    def fit(hp, scale):
        lam = torch.cat([hp[0], hp[1]])
        A = r.X.T @ r.X / r.n + torch.diag(lam)
        w = torch.linalg.solve(A, scale * r.X.T @ r.y / r.n)
        return {"head": w[:k], "tail": (w[k:],)}

    log_lam = r.lam.log().clone().requires_grad_(True)
    lam = log_lam.exp()  # non-leaf hyperparameters: the chain rule must flow to log_lam
    out = fit((lam[:k], lam[k:]), 1.0)
    assert isinstance(out, dict) and isinstance(out["tail"], tuple)
    w = torch.cat([out["head"], out["tail"][0]])
    loss = r.outer(w, None) + 0.1 * (lam[:k] ** 2).sum()
    loss.backward()
    direct = torch.zeros(r.d, dtype=F64)
    direct[:k] = 0.2 * r.lam[:k]
    ref = (r.closed_form(r.w_star()) + direct) * r.lam  # d/dlog_lam = lam * d/dlam
    assert _rel(log_lam.grad, ref) <= 1e-9


def test_decorator_single_tensor_output_scalar_hparam():
    r = Ridge("breast_cancer", False)

    @hg.implicit(r.inner, solver=hg.CG(tol=1e-13, maxiter=500))
    def fit(lam):
        A = r.X.T @ r.X / r.n + lam * torch.eye(r.d, dtype=F64)
        return torch.linalg.solve(A, r.X.T @ r.y / r.n)

    lam = r.lam.clone().requires_grad_(True)
    w = fit(lam)
    assert isinstance(w, torch.Tensor) and w.shape == (r.d,)
    r.outer(w, lam).backward()
    assert _rel(lam.grad, r.closed_form(r.w_star())) <= 1e-8


def test_no_warning_on_well_posed_problem():
    r = Ridge("diabetes", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hg.implicit_grad(r.inner, r.outer, r.w_star(), r.lam, solver=hg.CG(tol=1e-10))


def test_adjoint_is_returned_and_warm_start_saves_iterations():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(60, 8, generator=g, dtype=torch.float64)
    y = torch.randn(60, generator=g, dtype=torch.float64)
    lam = torch.full((8,), 0.1, dtype=torch.float64)

    def inner(w, lam):
        return 0.5 * ((x @ w - y) ** 2).mean() + 0.5 * (lam * w**2).sum()

    def outer(w, lam):
        return 0.5 * ((x @ w - 1.0) ** 2).mean()

    a = x.T @ x / 60 + torch.diag(lam)
    w = torch.linalg.solve(a, x.T @ y / 60)
    _, info = hg.implicit_grad(inner, outer, w, lam, solver=hg.CG(tol=1e-12))
    expected = torch.linalg.solve(a, x.T @ (x @ w - 1.0) / 60)
    torch.testing.assert_close(info.extras["adjoint"], expected, rtol=1e-9, atol=1e-12)
    _, info2 = hg.implicit_grad(
        inner, outer, w, lam, solver=hg.CG(tol=1e-10), x0=info.extras["adjoint"]
    )
    assert info2.solve.iterations == 0 and info2.solve.converged
