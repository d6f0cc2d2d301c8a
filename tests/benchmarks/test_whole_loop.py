"""The ``whole_loop`` benchmark suite (the whole outer loop against jaxopt and a torch user loop,
docs/benchmarks.md "The whole outer loop"): a short run of the torch implementations on the three
problems, whose validation-loss trajectories must agree (a wrong hypergradient would move one of
them off within a few Adam steps), one fresh-process run (the suite's plumbing), jaxopt against
hypergrad when jax is installed, and the committed results re-rendered."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from benchmarks import kit, report
from benchmarks.peers import whole_loop as W
from benchmarks.suites import whole_loop

pytest.importorskip("sklearn")

TORCH = [i for i in whole_loop.ALL_IMPLS if i != "jaxopt"]
AGREE = 1e-6  # relative agreement of the trajectories (observed: below 1e-7)


def _options(**kw) -> dict:
    o = {**whole_loop.OPTIONS, **whole_loop.QUICK, "quick": True, "threads": 1}
    return {**o, "steps": 5, "fresh_process": False, **kw}


def test_problems_are_as_documented():
    lr, ridge, lasso = (W.problem(k) for k in W.PROBLEMS)
    assert lr.X.shape == (284, 31) and np.all(lr.X[:, -1] == 1) and lr.index[-1] == -1
    assert list(lr.index[:30]) == [j % 10 for j in range(30)] and lr.theta0.shape == (10,)
    assert ridge.X.shape == (284, 30) and ridge.theta0.shape == (30,)
    assert lasso.X.shape == (221, 10) and lasso.theta0.shape == (10,)
    lam0 = np.exp(lasso.theta0[0])  # neither all-zero nor unpenalised at θ0
    assert 0.01 < lam0 < 0.1 * lasso.facts["lambda_max"]


def test_torch_implementations_agree_and_report(tmp_path):
    o = _options(impls=TORCH)
    whole_loop.measure(o, tmp_path, "whole_loop")
    d = json.loads((tmp_path / "whole_loop.json").read_text())
    assert [p["problem"] for p in d["problems"]] == list(W.PROBLEMS)
    for p in d["problems"]:
        recs = p["records"]
        assert all(r["status"] == "ok" for r in recs.values()), recs
        ref = np.array(recs["torch_user"]["loss"])
        assert len(ref) == 5 and ref[-1] < ref[0]  # Adam lowers the validation loss
        for impl in p["accurate"]:
            r = recs[impl]
            dev = np.max(np.abs(np.array(r["loss"]) - ref) / ref)
            assert dev < AGREE, (p["problem"], impl, dev)
            assert r["max_residual"] < 1e-6, (p["problem"], impl)  # the common tolerance, met
            assert r["steps_to_target"] is not None and r["to_target_cpu_s"] > 0
            assert r["to_target_first_cpu_s"] > 0 and len(r["cpu_s"]) == 5
        assert p["target"] == pytest.approx(max(recs[i]["final_loss"] for i in p["accurate"])
                                            * (1 + o["rel_target"]))  # fmt: skip
        assert "torch_user_defaults" not in p["accurate"]
    md = report.render("whole_loop", tmp_path, "whole_loop")
    assert "hypergrad inner.Newton + Exact" in md and (tmp_path / "whole_loop.png").exists()


@pytest.mark.slow  # a fresh process imports torch, sklearn and hypergrad (about 8 s of CPU)
def test_fresh_process_run_matches_the_same_run_in_process():
    o = _options(steps=3)
    spec = {"problem": "logreg_groups", "impl": "hypergrad_newton"}
    spec["o"] = {k: o[k] for k in whole_loop.SPEC_KEYS}
    fresh, here = whole_loop.run_fresh(spec, 1), whole_loop.child(spec)
    assert fresh["status"] == "ok", fresh
    assert fresh["loss"] == pytest.approx(here["loss"], rel=1e-12) and len(fresh["loss"]) == 3
    assert fresh["first_cpu_s"] > 0 and len(fresh["cpu_s"]) == 3


@pytest.mark.slow  # jax compiles the whole step (about 10 s per problem)
@pytest.mark.parametrize("key", W.PROBLEMS)
def test_jaxopt_agrees_with_hypergrad(key):
    why = W.missing("jaxopt")
    if why:
        pytest.skip(f"jaxopt rows need jax and jaxopt (the [bench] extra): {why}")
    o = _options()
    hg_impl = "hypergrad_fista" if key.startswith("lasso") else "hypergrad_newton"
    j, h = (whole_loop.run_impl(key, i, o) for i in ("jaxopt", hg_impl))
    assert j["compiles"] == 1  # float64 arrays from the first call on: no recompilation
    dev = np.max(np.abs(np.array(j["loss"]) - h["loss"]) / np.array(h["loss"]))
    assert dev < AGREE


def test_report_reproduces_the_committed_markdown(tmp_path):
    if not (kit.RESULTS / "whole_loop.json").exists():
        pytest.skip("no committed whole_loop results")
    shutil.copy(kit.RESULTS / "whole_loop.json", tmp_path / "whole_loop.json")
    report.render("whole_loop", tmp_path, "whole_loop")
    assert (tmp_path / "whole_loop.md").read_text() == (kit.RESULTS / "whole_loop.md").read_text()


def test_merge_replaces_one_problem_and_keeps_the_others(tmp_path):
    if not (kit.RESULTS / "whole_loop.json").exists():
        pytest.skip("no committed whole_loop results")
    base = json.loads((kit.RESULTS / "whole_loop.json").read_text())
    part = json.loads(json.dumps(base))  # a separate run of the lasso only
    part["problems"] = [json.loads(json.dumps(p)) for p in base["problems"]
                        if p["problem"] == "lasso_penalties"]  # fmt: skip
    part["problems"][0]["target"] = 123.0
    part["problems"][0].pop("run", None)
    part["created"], part["meta"]["rounds"] = "2030-01-01 00:00:00", 7
    part["meta"]["impls"] = ["jaxopt", "hypergrad_fista_new_row"]
    into, new = tmp_path / "whole_loop.json", tmp_path / "whole_loop_lasso.json"
    into.write_text(json.dumps(base))
    new.write_text(json.dumps(part))
    whole_loop.merge(new, into, note="snapshot of abc1234")
    merged = json.loads(into.read_text())
    keys = [p["problem"] for p in merged["problems"]]
    assert keys == [p["problem"] for p in base["problems"]]  # the order kept, none lost
    for p, b in zip(merged["problems"], base["problems"]):
        if p["problem"] == "lasso_penalties":
            assert p["target"] == 123.0 and p["run"]["rounds"] == 7
            assert p["run"]["created"] == "2030-01-01 00:00:00"
        else:
            assert p == b  # untouched
    assert merged["meta"]["impls"][-1] == "hypergrad_fista_new_row"
    assert merged["created"] == base["created"]
    md = report.render("whole_loop", tmp_path, "whole_loop")
    assert "This problem was run separately** (whole_loop_lasso.json, merged): 2030-01-01" in md
    assert "7 round(s)" in md and "snapshot of abc1234" in md
