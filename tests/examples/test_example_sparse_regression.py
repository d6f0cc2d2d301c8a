"""``examples/sparse_regression.py``: learned per-group lasso / elastic-net penalties.

The example is imported and run in-process (tests/conftest.py puts ``examples/`` on the path).
References: scikit-learn's ``Lasso``/``ElasticNet`` at the same penalty (the inner solution),
central differences of re-solved lasso problems and the closed form on the active set (the
hypergradient), the all-zero model (a short run).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import sparse_regression as sr
import torch
from sklearn.linear_model import ElasticNet, Lasso

DTYPE = torch.float64


@pytest.fixture(scope="module")
def prob():
    return sr.make_problem(seed=0)


@pytest.fixture(scope="module")
def small():
    """The first 120 training rows of seed 1's split (the hypergradient checks)."""
    return sr.make_problem(seed=1, train_rows=120)


def _group_eta(p, centre: float) -> torch.Tensor:
    """Distinct log-penalties per group around ``centre`` (a fixed, non-special point)."""
    return centre + torch.linspace(-0.6, 0.6, p.n_groups, dtype=DTYPE).roll(3)


def test_features_and_groups(prob):
    assert prob.features == 64 and "sex^2" not in prob.names
    assert prob.n_groups == 9 and sorted(set(prob.groups.tolist())) == list(range(9))
    assert prob.xtr.shape == (221, 64) and prob.xva.shape[0] == 110 and prob.xte.shape[0] == 111
    # standardised on the training split
    assert torch.allclose(prob.xtr.mean(0), torch.zeros(64, dtype=DTYPE), atol=1e-12)
    assert (
        abs(float(prob.ytr.mean())) < 1e-12 and abs(float(prob.ytr.std(correction=0)) - 1) < 1e-12
    )


@pytest.mark.parametrize("alpha", [0.01, 0.05])
def test_fista_matches_sklearn_lasso(prob, alpha):
    """The inner solve against sklearn's Lasso at the same alpha: both minimise
    1/(2n)||Xw - y||^2 + alpha ||w||_1 (the data are centred, so no intercept)."""
    w = sr.solve(prob, "lasso_single", {"eta": torch.tensor(math.log(alpha), dtype=DTYPE)},
                 tol=1e-13)  # fmt: skip
    ref = Lasso(alpha=alpha, fit_intercept=False, tol=1e-14, max_iter=1_000_000)
    ref.fit(prob.np("xtr"), prob.np("ytr"))
    assert np.abs(w.numpy() - ref.coef_).max() <= 1e-6
    assert ((w != 0).numpy() == (ref.coef_ != 0)).all()


def test_fista_matches_sklearn_elastic_net(prob):
    """ElasticNet(alpha, l1_ratio) is lambda = alpha l1_ratio, gamma = (1 - l1_ratio) / l1_ratio."""
    alpha, r = 0.05, 0.5
    h = {
        "eta": torch.full((prob.n_groups,), math.log(alpha * r), dtype=DTYPE),
        "zeta": torch.tensor(math.log((1 - r) / r), dtype=DTYPE),
    }
    w = sr.solve(prob, "enet_group", h, tol=1e-13)
    ref = ElasticNet(alpha=alpha, l1_ratio=r, fit_intercept=False, tol=1e-14, max_iter=1_000_000)
    ref.fit(prob.np("xtr"), prob.np("ytr"))
    assert np.abs(w.numpy() - ref.coef_).max() <= 1e-6


def test_group_hypergradient_matches_finite_differences(small):
    """d val MSE / d eta_g (9 groups) against central differences of lasso problems re-solved
    to a relative residual of 1e-13 (hypergrad.testing.check_hypergrad, every coordinate)."""
    report, g, w = sr.check_group_hypergradient(small, _group_eta(small, math.log(0.03)))
    assert report.passed, str(report)
    assert len(report.rows) == small.n_groups
    live = [r for r in report.rows if abs(r.fd) > 1e-4]
    assert len(live) >= 5, str(report)  # most groups have a support and a real slope
    assert all(r.rel_err <= 1e-5 for r in live), str(report)
    # a group without support has an exactly zero hypergradient (the solution does not move)
    dead = [k for k in range(small.n_groups) if not bool((w[small.groups == k] != 0).any())]
    assert all(float(g[k]) == 0.0 for k in dead)


@pytest.mark.parametrize("centre", [0.01, 0.05])
def test_group_hypergradient_matches_active_set_closed_form(small, centre):
    """On the support S: w_S = (X_S^T X_S / n)^(-1) (X_S^T y / n - lambda_S sign(w_S)), whose
    derivative in eta (lambda = exp(eta)[groups]) is the per-group hypergradient."""
    eta = _group_eta(small, math.log(centre))
    _, g, w = sr.hypergradient(small, "lasso_group", {"eta": eta}, tol=1e-13)
    S = w != 0
    n = small.xtr.shape[0]
    xs = small.xtr[:, S]
    lam = eta.exp()[small.groups][S]
    ws = torch.linalg.solve(xs.T @ xs / n, xs.T @ small.ytr / n - lam * w[S].sign())
    assert torch.allclose(ws, w[S], rtol=0, atol=1e-9)
    assert (ws.sign() == w[S].sign()).all()
    closed = sr.active_set_hypergradient(small, eta, w)
    assert torch.allclose(g["eta"], closed, rtol=1e-7, atol=1e-12), (g["eta"], closed)


def test_elastic_net_hypergradient_matches_finite_differences(small):
    """The elastic net's hypergradient in one group's eta and in zeta (gamma = exp(zeta))."""
    h = {"eta": _group_eta(small, math.log(0.03)), "zeta": torch.tensor(-0.5, dtype=DTYPE)}
    _, g, _ = sr.hypergradient(small, "enet_group", h, tol=1e-13)
    k = int(g["eta"].abs().argmax())
    eps = 1e-4
    for name, idx in (("eta", k), ("zeta", None)):

        def val(sign, name=name, idx=idx):
            hh = {key: v.clone() for key, v in h.items()}
            if idx is None:
                hh[name] += sign * eps
            else:
                hh[name][idx] += sign * eps
            return float(sr.mse(small, sr.solve(small, "enet_group", hh, tol=1e-13), "val"))

        fd = (val(1) - val(-1)) / (2 * eps)
        an = float(g[name] if idx is None else g[name][idx])
        assert abs(fd) > 1e-4
        assert abs(an - fd) <= 1e-5 * abs(fd), (name, an, fd)


def test_short_run_beats_zero_model(tmp_path):
    """A few outer steps of every model: the fields, the files, the check, and every learned
    model better than the all-zero model on validation."""
    res = sr.main(["--quick", "--steps", "4", "--out", str(tmp_path), "--no-progress"])
    table = res["table"]
    assert set(table) == {"zero", "lasso_cv", "enet_cv", "lasso_val", "enet_val", *sr.MODELS}
    for row in table.values():
        assert {"method", "val_mse", "test_mse", "nonzeros", "wall_s"} <= set(row)
    for m in sr.MODELS:
        assert table[m]["val_mse"] < 0.8 * table["zero"]["val_mse"], m
        assert table[m]["max_inner_residual"] <= 1e-9 and table[m]["max_gmres_residual"] <= 1e-9
    assert len(table["lasso_group"]["log_lambda"]) == 9 and table["enet_group"]["gamma"] > 0
    # the validation-scored path is the best single alpha on validation, up to the path's grid
    assert table["lasso_val"]["val_mse"] <= table["lasso_cv"]["val_mse"] + 1e-9
    assert res["check"]["passed"] and res["check"]["max_rel_err"] <= 1e-5
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["table"]["lasso_group"]["val_mse"] == table["lasso_group"]["val_mse"]
    hist = json.loads((tmp_path / "history.json").read_text())["0"]
    assert [len(hist[m]) for m in sr.MODELS] == [5, 5, 5]
    assert (tmp_path / "sparse_regression.png").is_file()
