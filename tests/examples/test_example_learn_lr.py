"""``examples/learn_lr.py``: learning SGD's and Adam's learning rate through ``hg.unrolled_grad``.

The example is imported and run in-process (tests/conftest.py puts ``examples/`` on the path).
References: central finite differences of the validation loss after T steps of
``torch.optim.SGD``/``torch.optim.Adam`` (float64), and a grid search over ln lr.
"""

from __future__ import annotations

import json
import math

import learn_lr
import pytest

T = learn_lr.parse_args([]).steps  # the example's default number of inner steps (20)

# Quick run (--quick: grid of 16 values of ln lr in [-7, 2], 100 outer Adam steps of lr 0.2).
# Measured "learned - grid best" validation cross-entropy on seeds 0, 1, 2 (one thread):
#   sgd (momentum 0.9):  -1.2e-4, -2.3e-4, -6.2e-4
#   adam:                -1.6e-3, -8.5e-4, -2.5e-4
#   sgd_mom (learned):   +3.5e-4, -2.2e-3, -1.5e-3   (grid: 16 x 6 values of ln lr x momentum)
# (negative: the learned value is better than the best grid point, which is not on the grid).
# The full default run (grid of 40, 300 outer steps) gives -7.8e-6 / -5.2e-5 / +5.5e-6 on seed 0.
TOL = 2e-3


@pytest.fixture(scope="module")
def prob():
    return learn_lr.make_problem(seed=0)


@pytest.mark.parametrize("kind", ["sgd", "adam", "sgd_mom"])
@pytest.mark.parametrize("where", ["start", "mid"])
def test_unrolled_hypergradient_matches_torch_optim_differences(prob, kind, where, one_thread):
    h = learn_lr.initial_hparams(kind) if where == "start" else learn_lr.check_point(kind)
    rows = learn_lr.finite_difference_check(prob, kind, h, T)
    assert [r["hparam"] for r in rows] == list(h)
    for r in rows:
        assert abs(r["finite_difference"]) > 1e-4, r  # a real slope, not a stationary point
        assert r["rel_err"] <= 1e-6, r


def test_check_sees_a_wrong_hypergradient(prob):
    """The reference is independent: dropping the momentum from the unrolled optimizer (a
    different procedure) fails the check."""
    h = learn_lr.initial_hparams("sgd")
    right = learn_lr.hypergradient(prob, "sgd", h, T)[0]["log_lr"]
    wrong = learn_lr.hypergradient(prob, "sgd", h, T, momentum=0.0)[0]["log_lr"]
    fd = learn_lr.finite_difference_check(prob, "sgd", h, T)[0]["finite_difference"]
    assert float(right) == pytest.approx(fd, rel=1e-6)
    assert abs(float(wrong) - fd) > 0.1 * abs(fd)


def test_torch_optim_reference_reproduces_the_unrolled_loss(prob):
    """The forward value of the unrolled run equals torch.optim's (same optimizer, float64)."""
    for kind in ("sgd", "adam", "sgd_mom"):
        h = learn_lr.check_point(kind)
        _, info = learn_lr.hypergradient(prob, kind, h, T)
        assert info.outer_loss == pytest.approx(learn_lr.val_loss_at(prob, kind, h, T), rel=1e-12)


def test_quick_run_reaches_the_grid_best(tmp_path):
    res = learn_lr.main(["--quick", "--no-progress", "--out", str(tmp_path)])
    for kind, r in res["optimizers"].items():
        g, lr_ = r["grid"], r["learned"]
        assert lr_["val_loss"] <= g["best_val_loss"] + TOL, (kind, lr_["val_loss"], g)
        # the outer loop moved far from the start (ln 1e-3) towards the optimum
        assert lr_["log_lr"] > math.log(1e-3) + 2.0, kind
        assert lr_["val_loss"] < 0.5 * lr_["trajectory"]["val_loss"][0], kind
        assert r["max_rel_err"] <= 1e-6, r["finite_difference_check"]
    mom = res["optimizers"]["sgd_mom"]["learned"]["momentum"]
    assert 0.0 < mom < 1.0
    saved = json.loads((tmp_path / "results.json").read_text())
    learned = res["optimizers"]["adam"]["learned"]
    assert saved["optimizers"]["adam"]["learned"]["log_lr"] == learned["log_lr"]
    assert (tmp_path / "learn_lr.png").is_file()
