"""hg.prox: every operator against an independent argmin (scipy, KKT conditions, a numpy
bisection and sorting reference for the simplex), Jacobians in x and hparams against their closed
forms on the active set, torch.func transforms, pytrees, and refusal of bad hyperparameters. The
properties every operator keeps (non-expansiveness, optimality, central finite differences away
from the kinks, float32, NaN and shape refusals) run over ALL_PROX in test_prox_contract.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar

import hypergrad as hg
from hypergrad import prox as P

F64 = torch.float64


def _x(n: int = 9, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, generator=g, dtype=F64)


def _argmin_1d(f, lo: float = -50.0, hi: float = 50.0) -> float:
    res = minimize_scalar(f, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12})
    return float(res.x)


# ---------------------------------------------------------------------------------------------
# values against independent argmins


@pytest.mark.parametrize("scaling", [1.0, 0.3])
def test_separable_proxes_match_scipy_argmin(scaling: float) -> None:
    x = _x(12, seed=1)
    lam = torch.rand(12, generator=torch.Generator().manual_seed(2), dtype=F64) * 1.5
    gam = 0.7
    lasso = P.prox_lasso(x, lam, scaling)
    enet = P.prox_elastic_net(x, (lam, gam), scaling)
    nn_lasso = P.prox_non_negative_lasso(x, lam, scaling)
    for i in range(12):
        xi, li = float(x[i]), float(lam[i])
        objectives = [
            (lasso, lambda y, xi=xi, li=li: 0.5 * (y - xi) ** 2 + scaling * li * abs(y), -50),
            (
                enet,
                lambda y, xi=xi, li=li: (
                    0.5 * (y - xi) ** 2 + scaling * li * (abs(y) + 0.5 * gam * y * y)
                ),
                -50,
            ),
            (nn_lasso, lambda y, xi=xi, li=li: 0.5 * (y - xi) ** 2 + scaling * li * y, 0),
        ]
        for ours, f, lo in objectives:
            ref = _argmin_1d(f, lo)
            # scipy's bounded Brent locates a smooth minimum to ~sqrt(eps); ours is no worse
            assert abs(float(ours[i]) - ref) < 1e-7
            assert f(float(ours[i])) <= f(ref) + 1e-15


def test_elastic_net_formula_and_lasso_special_case() -> None:
    x = _x(7, seed=3)
    lam, gam, s = 0.4, 2.0, 0.5
    y = P.prox_elastic_net(x, (lam, gam), s)
    soft = np.sign(x.numpy()) * np.maximum(np.abs(x.numpy()) - s * lam, 0)
    np.testing.assert_allclose(y.numpy(), soft / (1 + s * lam * gam), rtol=0, atol=1e-15)
    torch.testing.assert_close(P.prox_elastic_net(x, (lam, 0.0), s), P.prox_lasso(x, lam, s))


def _group_objective(y: np.ndarray, x: np.ndarray, t: float, axis) -> float:
    return 0.5 * float(((y - x) ** 2).sum()) + t * float(np.sqrt((y**2).sum(axis=axis)).sum())


@pytest.mark.parametrize("scale", [0.2, 3.0])  # below and above the threshold
def test_group_lasso_whole_input_is_optimal(scale: float) -> None:
    x = _x(6, seed=4, scale=scale)
    lam, s = 1.3, 0.8
    t = lam * s
    y = P.prox_group_lasso(x, lam, s).numpy()
    xn = x.numpy()
    if np.linalg.norm(xn) <= t:  # 0 is optimal iff ||x|| <= t (subgradient condition)
        assert np.abs(y).max() == 0.0
    else:  # stationarity: y - x + t y/||y|| = 0
        np.testing.assert_allclose(y - xn + t * y / np.linalg.norm(y), 0, atol=1e-12)
    # and no random perturbation does better
    rng = np.random.default_rng(0)
    f0 = _group_objective(y, xn, t, None)
    for _ in range(200):
        assert _group_objective(y + 1e-3 * rng.standard_normal(6), xn, t, None) >= f0 - 1e-14


def test_group_lasso_rows_and_columns_are_groups() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 3, generator=g, dtype=F64)
    x[1] *= 0.05  # a row below the threshold
    lam = torch.tensor([0.5, 0.5, 0.2, 1.0, 0.1], dtype=F64)
    y = P.prox_group_lasso(x, lam, 1.0, dim=1).numpy()
    for i in range(5):
        ref = P.prox_group_lasso(x[i], lam[i], 1.0).numpy()
        np.testing.assert_allclose(y[i], ref, atol=1e-15)
    assert np.abs(y[1]).max() == 0.0
    # columns: dim=0, strengths per column
    lam_c = torch.tensor([0.3, 0.6, 0.9], dtype=F64)
    yc = P.prox_group_lasso(x, lam_c, 0.5, dim=0)
    for j in range(3):
        torch.testing.assert_close(yc[:, j], P.prox_group_lasso(x[:, j], lam_c[j], 0.5))
    # 3-D input, groups over the last two dims
    x3 = torch.randn(4, 2, 3, generator=g, dtype=F64)
    y3 = P.prox_group_lasso(x3, 0.7, dim=(1, 2))
    for i in range(4):
        torch.testing.assert_close(y3[i], P.prox_group_lasso(x3[i], 0.7))


def _simplex_bisection(x: np.ndarray, value: float) -> np.ndarray:
    """Reference 1: the threshold tau solving sum(max(x - tau, 0)) = value, by bisection."""
    lo, hi = x.min() - value, x.max()
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if np.maximum(x - mid, 0).sum() > value:
            lo = mid
        else:
            hi = mid
    return np.maximum(x - 0.5 * (lo + hi), 0)


def _simplex_sorting(x: np.ndarray, value: float) -> np.ndarray:
    """Reference 2: add coordinates in decreasing order while they stay above the threshold."""
    order = sorted(x.tolist(), reverse=True)
    tau, total = 0.0, 0.0
    for k, u in enumerate(order, start=1):
        cand = (total + u - value) / k
        if u - cand <= 0:
            break
        total += u
        tau = cand
    return np.maximum(x - tau, 0)


@pytest.mark.parametrize("value", [1.0, 0.3, 4.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_projection_simplex_matches_references_and_kkt(value: float, seed: int) -> None:
    x = _x(10, seed=seed)
    y = P.projection_simplex(x, value).numpy()
    xn = x.numpy()
    np.testing.assert_allclose(y, _simplex_bisection(xn, value), atol=1e-12)
    np.testing.assert_allclose(y, _simplex_sorting(xn, value), atol=1e-12)
    # KKT: y >= 0, sum = value, x - y = tau on the support and <= tau off it
    assert y.min() >= 0 and abs(y.sum() - value) < 1e-12
    supp = y > 0
    tau = (xn - y)[supp]
    assert np.ptp(tau) < 1e-12 and (xn[~supp] <= tau[0] + 1e-12).all()


def test_projection_simplex_rows_and_per_row_values() -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(7), dtype=F64)
    vals = torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=F64)
    y = P.projection_simplex(x, vals)
    for i in range(4):
        np.testing.assert_allclose(
            y[i].numpy(), _simplex_sorting(x[i].numpy(), float(vals[i])), atol=1e-12
        )
    # a (1,)-shaped value acts as a scalar
    torch.testing.assert_close(
        P.projection_simplex(x[0], torch.tensor([2.0], dtype=F64)), P.projection_simplex(x[0], 2.0)
    )


def test_projection_box_and_non_negative_kkt() -> None:
    x = _x(10, seed=8)
    lo = torch.linspace(-1, 0, 10, dtype=F64)
    hi = lo + 1.5
    y = P.projection_box(x, (lo, hi))
    np.testing.assert_array_equal(y.numpy(), np.clip(x.numpy(), lo.numpy(), hi.numpy()))
    # one-sided boxes
    torch.testing.assert_close(P.projection_box(x, (0.0, None)), P.projection_non_negative(x))
    torch.testing.assert_close(P.projection_box(x, (None, 1.0)), x.clamp(max=1.0))
    # non-negative orthant KKT: y >= 0, y - x >= 0, y (y - x) = 0
    y = P.projection_non_negative(x).numpy()
    xn = x.numpy()
    assert y.min() >= 0 and (y - xn).min() >= 0 and np.abs(y * (y - xn)).max() == 0


@pytest.mark.parametrize("scale", [0.1, 3.0])
def test_projection_l2_ball_kkt(scale: float) -> None:
    x = _x(5, seed=9, scale=scale)
    r = 1.7
    y = P.projection_l2_ball(x, r).numpy()
    xn = x.numpy()
    if np.linalg.norm(xn) <= r:
        np.testing.assert_array_equal(y, xn)
    else:  # on the sphere, x - y = mu y with mu >= 0
        assert abs(np.linalg.norm(y) - r) < 1e-12
        mu = (xn - y) @ y / (y @ y)
        assert mu > 0
        np.testing.assert_allclose(xn - y, mu * y, atol=1e-12)


def test_scaling_is_ignored_by_projections() -> None:
    x = _x(6, seed=10)
    for proj, h in [
        (P.projection_non_negative, None),
        (P.projection_box, (-0.5, 0.5)),
        (P.projection_simplex, 2.0),
        (P.projection_l2_ball, 0.5),
    ]:
        torch.testing.assert_close(proj(x, h, 0.1), proj(x, h))


# ---------------------------------------------------------------------------------------------
# Jacobians: closed forms on the active set, central finite differences away from the kinks


def test_lasso_jacobians_closed_form() -> None:
    x = _x(10, seed=11)
    lam = torch.full((10,), 0.9, dtype=F64)
    s = 0.7
    jx = torch.func.jacrev(P.prox_lasso, argnums=0)(x, lam, s)
    jl = torch.func.jacrev(P.prox_lasso, argnums=1)(x, lam, s)
    active = (x.abs() > s * lam).to(F64)
    assert 0 < active.sum() < 10
    torch.testing.assert_close(jx, torch.diag(active), rtol=0, atol=0)
    torch.testing.assert_close(jl, torch.diag(-s * torch.sign(x) * active), rtol=0, atol=0)
    # scalar lambda: the column sums
    lam0 = torch.tensor(0.9, dtype=F64)
    jl0 = torch.func.jacrev(P.prox_lasso, argnums=1)(x, lam0, s)
    torch.testing.assert_close(jl0, -s * torch.sign(x) * active, rtol=0, atol=0)


def test_projection_jacobians_closed_form() -> None:
    x = _x(8, seed=12)
    # simplex: diag(1_S) - 1_S 1_S^T / |S|, d/dvalue = 1_S / |S|
    v = torch.tensor(1.5, dtype=F64)
    y = P.projection_simplex(x, v)
    S = (y > 0).to(F64)
    k = S.sum()
    jx = torch.func.jacrev(P.projection_simplex)(x, v)
    torch.testing.assert_close(jx, torch.diag(S) - torch.outer(S, S) / k, rtol=0, atol=1e-15)
    jv = torch.func.jacrev(P.projection_simplex, argnums=1)(x, v)
    torch.testing.assert_close(jv, S / k, rtol=0, atol=1e-15)
    # l2 ball outside: r/n (I - x x^T / n^2), d/dr = x / n
    r = torch.tensor(1.0, dtype=F64)
    n = x.norm()
    jx = torch.func.jacrev(P.projection_l2_ball)(x, r)
    ref = r / n * (torch.eye(8, dtype=F64) - torch.outer(x, x) / n**2)
    torch.testing.assert_close(jx, ref, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(torch.func.jacrev(P.projection_l2_ball, argnums=1)(x, r), x / n)
    # inside: identity, no dependence on r
    jx = torch.func.jacrev(P.projection_l2_ball)(x, 10 * n)
    torch.testing.assert_close(jx, torch.eye(8, dtype=F64))
    # group lasso, whole input above the threshold: (1 - t/n) I + t x x^T / n^3, d/dlam = -s x/n
    lam, s = torch.tensor(0.5, dtype=F64), 2.0
    t = s * lam
    jx = torch.func.jacrev(P.prox_group_lasso)(x, lam, s)
    ref = (1 - t / n) * torch.eye(8, dtype=F64) + t * torch.outer(x, x) / n**3
    torch.testing.assert_close(jx, ref, rtol=1e-13, atol=1e-14)
    jl = torch.func.jacrev(P.prox_group_lasso, argnums=1)(x, lam, s)
    torch.testing.assert_close(jl, -s * x / n)
    # box: 1 inside, bound derivatives where clipped
    lo, hi = torch.tensor(-1.0, dtype=F64), torch.tensor(1.0, dtype=F64)
    jx, (jlo, jhi) = torch.func.jacrev(lambda a, b: P.projection_box(a, b), argnums=(0, 1))(
        x, (lo, hi)
    )
    torch.testing.assert_close(jx, torch.diag((x.abs() < 1).to(F64)))
    torch.testing.assert_close(jlo, (x < -1).to(F64))
    torch.testing.assert_close(jhi, (x > 1).to(F64))


def test_zero_input_has_finite_derivatives() -> None:
    """Norm-based operators at x = 0 (the kink of the norm): finite, zero-or-identity Jacobian."""
    z = torch.zeros(4, dtype=F64)
    j = torch.func.jacrev(P.prox_group_lasso)(z, torch.tensor(0.5, dtype=F64))
    assert torch.isfinite(j).all() and j.abs().max() == 0
    j = torch.func.jacrev(P.projection_l2_ball)(z, torch.tensor(1.0, dtype=F64))
    torch.testing.assert_close(j, torch.eye(4, dtype=F64))
    j = torch.func.jacrev(lambda a, b: P.prox_group_lasso(a, b, dim=1), argnums=1)(
        torch.zeros(3, 2, dtype=F64), torch.ones(3, dtype=F64)
    )
    assert torch.isfinite(j).all()


# ---------------------------------------------------------------------------------------------
# torch.func, pytrees


def test_vmap_over_inputs_and_hparams() -> None:
    X = torch.randn(5, 7, generator=torch.Generator().manual_seed(15), dtype=F64)
    lams = torch.linspace(0.1, 1.0, 5, dtype=F64)
    ops = [
        lambda x, lam: P.prox_lasso(x, lam),
        lambda x, lam: P.prox_elastic_net(x, (lam, 2 * lam)),
        lambda x, lam: P.prox_non_negative_lasso(x, lam),
        lambda x, lam: P.prox_group_lasso(x, lam),
        lambda x, lam: P.projection_simplex(x, lam),
        lambda x, lam: P.projection_l2_ball(x, lam),
        lambda x, lam: P.projection_box(x, (-lam, lam)),
    ]
    for op in ops:
        batched = torch.func.vmap(op)(X, lams)
        looped = torch.stack([op(X[i], lams[i]) for i in range(5)])
        torch.testing.assert_close(batched, looped, rtol=1e-14, atol=1e-14)
        # Jacobians of a batch (vmap of jacrev)
        jac = torch.func.vmap(torch.func.jacrev(op, argnums=1))(X, lams)
        ref = torch.stack([torch.func.jacrev(op, argnums=1)(X[i], lams[i]) for i in range(5)])
        torch.testing.assert_close(jac, ref, rtol=1e-13, atol=1e-14)


def test_grad_flows_with_plain_autograd() -> None:
    lam = torch.tensor(0.3, dtype=F64, requires_grad=True)
    x = _x(8, seed=16)
    loss = (P.prox_lasso(x, lam) ** 2).sum()
    loss.backward()
    active = x.abs() > 0.3
    ref = (2 * (x - 0.3 * torch.sign(x)) * -torch.sign(x))[active].sum()
    torch.testing.assert_close(lam.grad, ref)


def test_pytrees_shared_and_per_leaf_hparams() -> None:
    a, b = _x(4, seed=17), _x(3, seed=18).reshape(3, 1)
    tree = {"w": a, "b": (b,)}
    out = P.prox_lasso(tree, 0.5, 0.5)
    assert set(out) == {"w", "b"} and isinstance(out["b"], tuple)
    torch.testing.assert_close(out["w"], P.prox_lasso(a, 0.25))
    torch.testing.assert_close(out["b"][0], P.prox_lasso(b, 0.25))
    per_leaf = P.prox_lasso(tree, {"w": 0.1, "b": (torch.full((3, 1), 2.0, dtype=F64),)})
    torch.testing.assert_close(per_leaf["w"], P.prox_lasso(a, 0.1))
    torch.testing.assert_close(per_leaf["b"][0], P.prox_lasso(b, 2.0))
    out = P.prox_elastic_net([a, b], ([0.1, 0.2], 1.0))
    torch.testing.assert_close(out[1], P.prox_elastic_net(b, (0.2, 1.0)))
    out = P.projection_box((a, b), ((-0.5, -1.0), 1.0))
    torch.testing.assert_close(out[0], a.clamp(-0.5, 1.0))
    torch.testing.assert_close(out[1], b.clamp(-1.0, 1.0))
    # norm-based operators take the norm of the whole pytree (as jaxopt does)
    flat = torch.cat([a, b.reshape(-1)])
    out = P.projection_l2_ball((a, b), 0.5)
    torch.testing.assert_close(
        torch.cat([out[0], out[1].reshape(-1)]), P.projection_l2_ball(flat, 0.5)
    )
    out = P.prox_group_lasso((a, b), 0.5)
    torch.testing.assert_close(
        torch.cat([out[0], out[1].reshape(-1)]), P.prox_group_lasso(flat, 0.5)
    )
    out = P.projection_simplex({"p": a, "q": b.reshape(-1)})
    torch.testing.assert_close(out["q"], P.projection_simplex(b.reshape(-1)))
    out = P.projection_non_negative([a, b])
    torch.testing.assert_close(out[1], b.relu())


# ---------------------------------------------------------------------------------------------
# bad hyperparameters


def test_bad_hparams_are_refused() -> None:
    x = _x(4)
    bad = [
        (lambda: P.prox_lasso(x, -0.1), "λ"),
        (lambda: P.prox_lasso(x, torch.tensor([0.1, -1.0, 0.0, 0.0], dtype=F64)), "λ"),
        (lambda: P.prox_lasso(x, float("nan")), "λ"),
        (lambda: P.prox_lasso(x, 0.1, -1.0), "scaling"),
        (lambda: P.prox_non_negative_lasso(x, -1.0), "λ"),
        (lambda: P.prox_elastic_net(x, (0.1, -0.5)), "γ"),
        (lambda: P.prox_elastic_net(x, (-0.1, 0.5)), "λ"),
        (lambda: P.prox_group_lasso(x, -1.0), "λ"),
        (lambda: P.prox_group_lasso(x, torch.ones(4, dtype=F64)), "dim=None"),
        (lambda: P.projection_box(x, (1.0, 0.0)), "lower > upper"),
        (lambda: P.projection_box(x, (torch.ones(4, dtype=F64), 0.5)), "lower > upper"),
        (lambda: P.projection_simplex(x, 0.0), "value"),
        (lambda: P.projection_simplex(x, -2.0), "value"),
        (lambda: P.projection_simplex(torch.tensor(1.0), 1.0), "at least 1"),
        (lambda: P.projection_l2_ball(x, 0.0), "radius"),
        (lambda: P.projection_l2_ball(x, torch.ones(2)), "scalar"),
        (lambda: P.prox_lasso({"a": x}, {"b": 1.0}), "structure"),
    ]
    for call, words in bad:
        with pytest.raises(hg.HypergradValueError, match=words):
            call()
    for call in [
        lambda: P.prox_lasso(torch.arange(3), 0.1),
        lambda: P.prox_lasso(x, "big"),
        lambda: P.prox_lasso(x, True),
        lambda: P.prox_elastic_net(x, 0.1),
        lambda: P.projection_box(x, None),
        lambda: P.projection_box(x, (0.0, 1.0, 2.0)),
    ]:
        with pytest.raises(hg.HypergradTypeError):
            call()


def test_namespace() -> None:
    # the operators are checked against ALL_PROX (test_prox_contract.py); these two are not ones
    assert hg.prox is P and {"kinks", "kink_mask"} <= set(P.__all__)


# torch's first forward-mode call scripts its jvp decompositions (a torch-internal warning)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_forward_mode_matches_reverse_mode() -> None:
    x = _x(6, seed=19)
    h = torch.tensor(0.8, dtype=F64)
    for op in (
        P.prox_lasso,
        P.prox_non_negative_lasso,
        P.prox_group_lasso,
        P.projection_simplex,
        P.projection_l2_ball,
        lambda a, b: P.prox_elastic_net(a, (b, 2 * b)),
        lambda a, b: P.projection_box(a, (-b, b)),
    ):
        for argnums in (0, 1):
            fwd = torch.func.jacfwd(op, argnums=argnums)(x, h)
            rev = torch.func.jacrev(op, argnums=argnums)(x, h)
            torch.testing.assert_close(fwd, rev, rtol=1e-13, atol=1e-15)
