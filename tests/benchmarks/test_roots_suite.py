"""The ``roots`` benchmark suite (lasso and DEQ hypergradients against jaxopt, torchopt, torchdeq):
its references, and a ``--quick`` run of the hypergrad side only (no peer, so no jax), rendered
by the report."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from benchmarks import kit, report
from benchmarks.suites import roots

pytest.importorskip("sklearn")


def test_lasso_reference_is_the_closed_form_and_matches_finite_differences():
    P = roots.problem("lasso_features")
    f = P.facts
    assert f["support"] < f["features"] and f["margin"] > 0.1 and f["signs_consistent"]
    assert f["fista_gap"] < 1e-10  # the tight FISTA solve agrees with the closed form
    import hypergrad as hg

    def val(lam):  # the validation loss at a tight re-solve
        w, _ = hg.inner.ProximalGradient(
            P.smooth, hg.prox.prox_lasso, stepsize=P.step, maxiter=100000, tol=1e-15
        ).solve(torch.zeros(10, dtype=torch.float64), (None, lam))
        return float(P.outer(w))

    j, h = int(np.argmax(np.abs(P.reference))), 1e-6
    e = torch.zeros(10, dtype=torch.float64)
    e[j] = h
    fd = (val(P.lam + e) - val(P.lam - e)) / (2 * h)
    assert fd == pytest.approx(P.reference[j], rel=1e-5)


def test_deq_reference_matches_a_hypergrad_exact_solve():
    P = roots.problem("deq", 8, 4)
    assert P.facts["residual"] < 1e-14 and P.facts["spectral_radius_max"] < 1
    g = roots.build("hypergrad", P, "anderson+gmres", 200, 200, 1e-14, 1e-13)()
    assert P.rel_error(g) < 1e-9


@pytest.mark.filterwarnings("ignore::hypergrad.errors.NonStationaryWarning")  # K = 5: by design
def test_quick_run_of_the_hypergrad_side_and_its_report(tmp_path):
    o = {**roots.OPTIONS, **roots.QUICK, "quick": True, "threads": 1, "libs": ["hypergrad"]}
    o.update(problems=["lasso", "deq"], ks=[5, 200], deq_ks=[5, 50], tols=[1e-3, 1e-9])
    roots.measure(o, tmp_path, "roots")
    d = json.loads((tmp_path / "roots.json").read_text())
    for p in d["problems"]:
        ours = [r for r in p["records"] if r["library"] == "hypergrad"]
        assert ours and all(r["status"] == "ok" for r in ours), ours
        big = [r for r in ours if r["mode"] == "equal" and r["K"] >= 50]
        assert min(r["rel_error"] for r in big) < 1e-6  # converged: the reference agrees
        assert "hypergrad" in p["best"]["1e-06"] and "hypergrad" in p["best"]["0.001"]
        assert all(r["median_s"] for r in p["best"]["1e-06"].values())
    md = report.render("roots", tmp_path, "roots")
    assert "| 1e-06 | **hypergrad** |" in md and (tmp_path / "roots.png").exists()


def test_report_reproduces_the_committed_markdown(tmp_path):
    if not (kit.RESULTS / "roots.json").exists():
        pytest.skip("no committed roots results")
    shutil.copy(kit.RESULTS / "roots.json", tmp_path / "roots.json")
    report.render("roots", tmp_path, "roots")
    assert (tmp_path / "roots.md").read_text() == (kit.RESULTS / "roots.md").read_text()
