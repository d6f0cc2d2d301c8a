"""Fast checks of the two real-data examples: data hyper-cleaning and per-feature weight decay.

Both examples are imported and run in-process (tests/conftest.py puts ``examples/`` on the path).
The hyper-cleaning tests need Debian's ``dataset-fashion-mnist`` and skip without it.
"""

from __future__ import annotations

import copy
import json
import os

import _fashion_mnist as fm
import hyper_cleaning
import pytest
import torch
import weight_decay

from hypergrad.testing import check_hypergrad

HAVE_FMNIST = fm.available(fm.DEFAULT_DIR)
needs_fmnist = pytest.mark.skipif(
    not HAVE_FMNIST,
    reason=f"Fashion-MNIST not in {fm.DEFAULT_DIR}: apt-get install dataset-fashion-mnist",
)

# Small hyper-cleaning run: 1000 train (500 corrupted) / 1000 val / 2000 test, 5 Adam steps
# (lr 0.5), loose tolerances. Measured with exactly these arguments on seeds 0, 1, 2:
# baseline 0.697 / 0.693 / 0.696, cleaner 0.764 / 0.771 / 0.778 (margin >= 0.067), flag F1
# 0.83 / 0.82 / 0.82 (flag-everything F1 is 0.667), 10-13 CPU-s per run.
QUICK_ARGS = (
    "--quick --steps 5 --lr 0.5 --inner-tol 1e-4 --cg-tol 1e-3 --eval-tol 1e-4 "
    "--no-pixel-check --unrolled 5:5 --no-progress"
).split()
MARGIN = 0.03


@pytest.fixture(scope="module")
def cleaning_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hyper_cleaning")
    res = hyper_cleaning.main(QUICK_ARGS + ["--seed", "0", "--out", str(out)])
    return res, out


@needs_fmnist
def test_hyper_cleaning_beats_baseline(cleaning_run):
    res, out = cleaning_run
    acc = res["test_accuracy"]
    assert acc["cleaner"] > acc["baseline"] + MARGIN, acc
    # the learned weights separate the two groups
    assert res["mean_gamma_corrupted"] < 0.5 < res["mean_gamma_clean"]
    assert res["final_val_loss"] < res["initial_val_loss"]
    assert os.path.isfile(out / "results.json") and os.path.isfile(out / "history.json")
    assert os.path.isfile(out / "hyper_cleaning_weights.png")
    saved = json.loads((out / "results.json").read_text())
    assert saved["test_accuracy"] == acc


@needs_fmnist
def test_hyper_cleaning_flags_above_chance(cleaning_run):
    res, _ = cleaning_run
    f = res["flags"]
    n, bad = res["config"]["sizes"]["train"], res["config"]["corrupted"]
    rho, q = bad / n, f["flagged"] / n
    flag_all = 2 * rho / (rho + 1)  # F1 of flagging every example (recall 1, precision rho)
    random_same_count = 2 * rho * q / (rho + q)  # expected F1 of flagging f["flagged"] at random
    assert f["f1"] > max(flag_all, random_same_count) + 0.05, f
    assert f["precision"] > rho + 0.1


@needs_fmnist
def test_hyper_cleaning_solver_diagnostics(cleaning_run):
    res, _ = cleaning_run
    im = res["implicit"]
    assert im["all_cg_converged"] and im["max_cg_residual"] <= 1e-3
    assert im["max_inner_grad_norm"] <= 1e-4
    (row,) = res["unrolled"].values()
    assert all(c > 0.5 for c in row["cosines"])  # same direction as the implicit hypergradient


def test_hyper_cleaning_missing_data_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        hyper_cleaning.main(["--quick", "--data-dir", str(tmp_path), "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "apt-get install dataset-fashion-mnist" in capsys.readouterr().err


@pytest.fixture(scope="module")
def decay_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("weight_decay")
    (res,) = weight_decay.main(
        ["--quick", "--datasets", "breast_cancer", "--feature-steps", "5", "--out", str(out)]
    )
    return res, out


def test_weight_decay_gradient_matches_grid(decay_run):
    res, out = decay_run
    gap = abs(res["scalar"]["log_lambda"] - res["grid"]["best_log_lambda"])
    assert gap <= weight_decay.HOAG_TOL, (
        res["scalar"]["log_lambda"],
        res["grid"]["best_log_lambda"],
    )
    assert res["scalar"]["val_loss"] <= res["grid"]["best_val_loss"] + 1e-6
    # per-feature decays start at the scalar optimum and can only lower the validation loss
    assert res["per_feature"]["val_loss"] <= res["scalar"]["val_loss"] + 1e-12
    assert os.path.isfile(out / "results.json") and os.path.isfile(out / "weight_decay_grid.png")


def test_weight_decay_hypergradient_matches_finite_difference(decay_run):
    res, _ = decay_run
    fd = res["finite_difference_check"]
    assert fd["rel_error"] <= 1e-5, fd


def _check_example(task, theta, **kw):
    """hypergrad.testing.check_hypergrad on the example's own pieces: Newton re-solves (warm
    started from the solution at theta) and the hypergradient the example computes."""
    p, _, _ = weight_decay.newton(task, theta, tol=1e-13)
    g, _ = weight_decay.hypergradient(task, theta, p)

    def solve_inner(th):
        return weight_decay.newton(task, th, p, tol=1e-13)[0]

    return check_hypergrad(solve_inner, task.inner, task.outer, theta, g, **kw)


def test_weight_decay_check_hypergrad_scalar():
    """The point of finite_difference_check (breast_cancer, ln lambda = -2), checked again by
    hypergrad.testing."""
    task = weight_decay.make_task("breast_cancer", seed=0)
    report = _check_example(task, torch.tensor(-2.0, dtype=torch.float64), rtol=1e-5)
    assert report.passed, str(report)


def test_weight_decay_finite_difference_multinomial():
    task = weight_decay.make_task("digits", seed=0)
    fd = weight_decay.finite_difference_check(task, log_lam=-3.0)
    assert fd["rel_error"] <= 1e-5, fd
    report = _check_example(task, torch.tensor(-3.0, dtype=torch.float64), rtol=1e-5)
    assert report.passed, str(report)


def test_weight_decay_per_feature_hypergradient_finite_difference():
    """One coordinate of the per-feature hypergradient against a central difference."""
    task = weight_decay.make_task("breast_cancer", seed=1)
    theta = torch.linspace(-4.0, -1.0, task.features, dtype=torch.float64)
    p, _, _ = weight_decay.newton(task, theta, tol=1e-13)
    g, _ = weight_decay.hypergradient(task, theta, p)
    j, eps = int(g.abs().argmax()), 1e-4
    e = torch.zeros_like(theta)
    e[j] = eps
    lp, _ = weight_decay.val_loss_at(task, theta + e, p, tol=1e-13)
    lm, _ = weight_decay.val_loss_at(task, theta - e, p, tol=1e-13)
    fd = (lp - lm) / (2 * eps)
    assert abs(float(g[j]) - fd) <= 1e-5 * abs(fd)
    # all 30 decays along 8 random unit directions, by hypergrad.testing
    report = _check_example(task, theta, rtol=1e-5)
    assert report.passed and report.directions == "random" and len(report.rows) == 8, str(report)


# -- plots: under --out only, docs/img only with --update-docs-figures (full runs)


def _full_run_without_work(module, monkeypatch, tmp_path, name, result):
    """Point the module's docs/img at a temporary folder and replace its computation by a
    previous result, so that a full run's argument handling and file writing run in a second."""
    docs_img = tmp_path / "docs_img"
    monkeypatch.setattr(module, "DOCS_IMG", str(docs_img))
    monkeypatch.setattr(module, name, lambda *a, **k: copy.deepcopy(result))
    return docs_img


def test_weight_decay_full_run_writes_plots_under_out_only(decay_run, tmp_path, monkeypatch):
    res, _ = decay_run
    docs_img = _full_run_without_work(weight_decay, monkeypatch, tmp_path, "run_dataset", res)
    out = tmp_path / "run"
    weight_decay.main(["--datasets", "breast_cancer", "--out", str(out)])  # no --quick
    names = ["weight_decay_grid.png", "weight_decay_per_feature.png"]
    assert all((out / n).is_file() for n in names)
    assert not docs_img.exists()
    weight_decay.main(["--datasets", "breast_cancer", "--out", str(out), "--update-docs-figures"])
    assert sorted(p.name for p in docs_img.iterdir()) == names


@needs_fmnist
def test_hyper_cleaning_full_run_writes_plots_under_out_only(cleaning_run, tmp_path, monkeypatch):
    res, _ = cleaning_run
    docs_img = _full_run_without_work(hyper_cleaning, monkeypatch, tmp_path, "run", res)
    out = tmp_path / "run"
    hyper_cleaning.main(["--out", str(out), "--no-progress"])  # no --quick
    names = ["hyper_cleaning_curves.png", "hyper_cleaning_weights.png"]
    assert all((out / n).is_file() for n in names)
    assert not docs_img.exists()
    hyper_cleaning.main(["--out", str(out), "--no-progress", "--update-docs-figures"])
    assert sorted(p.name for p in docs_img.iterdir()) == names


@pytest.mark.parametrize("module", [weight_decay, hyper_cleaning], ids=lambda m: m.__name__)
def test_update_docs_figures_refuses_quick_runs(module, capsys):
    with pytest.raises(SystemExit) as exc:
        module.parse_args(["--quick", "--update-docs-figures"])
    assert exc.value.code == 2
    assert "--update-docs-figures needs a full run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "solver", ["exact", pytest.param("compiled-exact", marks=pytest.mark.slow)]
)
def test_weight_decay_solver_options_give_the_cg_hypergradient(solver):
    """``--solver exact`` / ``compiled-exact`` return the default CG path's hypergradient (digits,
    per-feature decays at a point where CG converges)."""
    task = weight_decay.make_task("digits", seed=0)
    theta = torch.full((task.features,), -3.0, dtype=torch.float64)
    p, _, _ = weight_decay.newton(task, theta, tol=1e-13)
    g_cg, info_cg = weight_decay.hypergradient(task, theta, p)
    g, info = weight_decay.hypergradient(task, theta, p, solver=solver)
    torch.testing.assert_close(g, g_cg, rtol=1e-8, atol=1e-12)
    assert info.solve.solver == "exact" and info.solve.converged
    assert "fallback" not in info_cg.extras  # the reference is CG's own


def test_weight_decay_dense_preconditioner_reused_along_an_outer_path():
    """``--precond dense``: one ``hg.DensePreconditioner`` kept across outer steps gives the dense
    ``Exact`` hypergradient at every step (digits, per-feature decays drifting from a point where
    plain CG needs many iterations), built once and reused at far fewer iterations than plain
    CG."""
    task = weight_decay.make_task("digits", seed=0)
    pre = weight_decay.preconditioner("dense")
    gen = torch.Generator().manual_seed(0)
    theta = torch.full((task.features,), -7.0, dtype=torch.float64)
    p = None
    for step in range(3):
        p, _, _ = weight_decay.newton(task, theta, p, tol=1e-12)
        g_ref, _ = weight_decay.hypergradient(task, theta, p, solver="exact")
        g, info = weight_decay.hypergradient(task, theta, p, precond=pre)
        _, plain = weight_decay.hypergradient(task, theta, p)
        assert "fallback" not in info.extras and info.solve.converged
        torch.testing.assert_close(g, g_ref, rtol=1e-7, atol=1e-12)
        assert info.solve.extras["preconditioner_rebuilt"] == (step == 0)
        if step:
            cg_its = plain.extras.get("fallback", {}).get("cg_iterations", plain.solve.iterations)
            assert info.solve.iterations < cg_its / 5, (info.solve.iterations, cg_its)
        theta = theta + 0.05 * torch.randn(task.features, generator=gen, dtype=torch.float64)
    assert pre.builds == 1
