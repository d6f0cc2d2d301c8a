"""The paired statistics of the BORT² report (95% t intervals, sign counts, per-target means,
the effect detectable at 80% power), checked against independent references (scipy's t
quantiles and ``ttest_rel``, the noncentral t, a simulation), and the committed results tables
regenerated from their committed JSON."""

import importlib.util
import json
import math
import shutil

import numpy as np
import pytest
from bort2.report import main as report_main
from bort2.report import (
    minimal_detectable_effect,
    paired_differences,
    paired_markdown,
    paired_stats,
    rewrite_results,
    t_interval,
)
from helpers import ROOT
from scipy import stats

RESULTS = ROOT / "examples" / "bort2" / "results"


def _rows(acc: dict) -> list[dict]:
    return [
        {"stage": k[0], "target": k[1], "seed": k[2], "acc": v, "n": 100} for k, v in acc.items()
    ]


def test_t_interval_by_hand():
    d = np.array([1.0, 2.5, -0.5, 3.0])
    mean, sd, n = d.mean(), d.std(ddof=1), 4
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)  # 3.1824 · √2.5 / 2 = 2.5159
    lo, hi = t_interval(d)
    assert (lo, hi) == (pytest.approx(mean - half), pytest.approx(mean + half))
    assert (lo, hi) == (pytest.approx(-1.0159, abs=1e-4), pytest.approx(4.0159, abs=1e-4))
    assert t_interval(np.array([2.0])) is None


def test_t_interval_equals_scipy_ttest_rel():
    rng = np.random.default_rng(0)
    a, b = rng.normal(60, 5, 12), rng.normal(58, 5, 12)
    ref = stats.ttest_rel(a, b).confidence_interval(0.95)
    lo, hi = t_interval(a - b)
    assert (lo, hi) == (pytest.approx(ref.low), pytest.approx(ref.high))


@pytest.mark.parametrize("n", [3, 6, 12])
def test_mde_has_80_percent_power(n):
    """Noncentral t, written here independently of report.paired_t_power: the power at the MDE
    is 0.8; the usual approximation (t_.975 + t_.8)·sd/√n is a little below the exact value."""
    sd = 1.7
    mde = minimal_detectable_effect(sd, n)
    df, tc, nc = n - 1, stats.t.ppf(0.975, n - 1), mde * math.sqrt(n) / sd
    power = 1 - stats.nct.cdf(tc, df, nc) + stats.nct.cdf(-tc, df, nc)
    assert power == pytest.approx(0.8, abs=1e-6)
    approx = (stats.t.ppf(0.975, df) + stats.t.ppf(0.8, df)) * sd / math.sqrt(n)
    assert approx < mde < 1.1 * approx
    assert minimal_detectable_effect(sd, 1) is None
    assert minimal_detectable_effect(0.0, n) == 0.0


def test_mde_power_by_simulation():
    """Paired samples with the MDE as true mean: the t-test rejects in ~80% of 40,000 draws."""
    n, sd = 12, 1.77
    mde = minimal_detectable_effect(sd, n)
    assert mde == pytest.approx(1.57, abs=0.01)  # BORT² − Stage B in the full table
    draws = np.random.default_rng(1).normal(mde, sd, size=(40_000, n))
    rejected = stats.ttest_1samp(draws, 0.0, axis=1).pvalue < 0.05
    assert rejected.mean() == pytest.approx(0.8, abs=0.01)  # binomial s.e. 0.002


def test_paired_stats_counts_signs_and_ties():
    r = paired_stats(np.array([1.0, 0.0, -2.0, 3.0, 0.0]))
    assert (r["helped"], r["ties"], r["hurt"], r["n"]) == (2, 2, 1, 5)
    one = paired_stats(np.array([1.5]))
    assert one["ci_low"] is None and one["mde80"] is None and math.isnan(one["std"])


def test_paired_differences_per_target_and_markdown():
    acc = {}
    d_by_target = {"b": [2.0, 3.0, 4.0], "a": [-1.0, 0.0, 1.0]}  # "b" listed first in the runs
    for t, ds in d_by_target.items():
        for seed, x in enumerate(ds):
            acc[("step2/robust", t, seed)] = 0.5
            acc[("step2/bort2", t, seed)] = 0.5 + x / 100
    (r,) = paired_differences(_rows(acc))
    d = np.array(d_by_target["b"] + d_by_target["a"])
    ref = stats.ttest_rel(d + 50.0, np.full(6, 50.0)).confidence_interval(0.95)
    assert r["mean"] == pytest.approx(1.5)
    assert (r["ci_low"], r["ci_high"]) == (pytest.approx(ref.low), pytest.approx(ref.high))
    assert (r["helped"], r["ties"], r["hurt"]) == (4, 1, 1)
    assert list(r["per_target"]) == ["b", "a"]
    assert r["per_target"]["b"]["mean"] == pytest.approx(3.0)
    assert r["per_target"]["a"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert r["per_target"]["b"]["ci_low"] == pytest.approx(3.0 - stats.t.ppf(0.975, 2) / 3**0.5)
    md = paired_markdown([r])
    assert f"| +1.5 | [{ref.low:+.1f}, {ref.high:+.1f}] |" in md
    assert "| 4 / 6 (1 tie) |" in md and "b +3.0, a +0.0" in md
    assert f"true mean difference of {r['mde80']:.1f} points" in md
    assert "± 0" not in md


def test_single_target_has_no_per_target_column():
    acc = {("step2/robust", "a", s): 0.5 for s in range(3)}
    acc.update({("step2/bort2", "a", s): 0.5 + 0.01 * s for s in range(3)})
    (r,) = paired_differences(_rows(acc))
    assert "per_target" not in r
    assert "per target" not in paired_markdown([r])


def test_committed_faithful_table_is_regenerated_from_its_json(tmp_path):
    """The committed results.md files are what the report writes from the committed JSON, and
    the faithful table's numbers are the ones docs/bort2.md quotes."""
    for name in ("minidigits_faithful", "minidigits_full"):
        src = RESULTS / name
        dst = tmp_path / name
        dst.mkdir()
        shutil.copy(src / "results.json", dst / "results.json")
        md = rewrite_results(dst)
        assert md == (src / "results.md").read_text(), name
        old, new = (json.loads((d / "results.json").read_text()) for d in (src, dst))
        assert new == old  # the committed JSON already carries the new keys
    paired = json.loads((RESULTS / "minidigits_faithful" / "results.json").read_text())["paired"]
    fm, naive, b, c = paired
    assert (round(fm["ci_low"], 1), round(fm["ci_high"], 1)) == (-3.1, 4.2)
    assert (round(c["ci_low"], 1), round(c["ci_high"], 1), c["helped"]) == (0.6, 2.9, 10)
    assert {t: round(v["mean"], 1) for t, v in c["per_target"].items()} == {
        "uci": 3.2,
        "uci_m": 3.5,
        "syn": -0.0,
        "syn_m": 0.3,
    }
    assert [round(r["mde80"], 1) for r in paired] == [5.1, 1.9, 1.0, 1.6]


def test_rewrite_keeps_old_keys_and_the_mode_line(tmp_path, capsys):
    acc = {("step1/source_only", "a", s): 0.5 + 0.01 * s for s in range(2)}
    acc.update({("step1/fixmatch_cm", "a", s): 0.6 - 0.2 * s for s in range(2)})  # +10, -11
    payload = {"results": _rows(acc), "summary": {"kept": 1}, "environment": {"x": 1}}
    (tmp_path / "results.json").write_text(json.dumps(payload))
    (tmp_path / "results.md").write_text("# old\n\nMode: reproducible=false (...)\n")
    assert report_main([str(tmp_path)]) == 0
    assert "rewrote" in capsys.readouterr().out
    new = json.loads((tmp_path / "results.json").read_text())
    assert new["summary"] == {"kept": 1} and new["environment"] == {"x": 1}
    (r,) = new["paired"]
    assert (r["n"], r["helped"], r["hurt"]) == (2, 1, 1)
    md = (tmp_path / "results.md").read_text()
    assert md.endswith("Mode: reproducible=false (...)\n")
    assert "Arithmetic:" not in md  # the JSON records no machine: none is invented
    assert "`best_acc`" not in md  # nor a best_acc it does not hold


def test_attribution_from_json_reproduces_the_committed_table(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bort2_attribution", ROOT / "examples" / "bort2" / "attribution.py"
    )
    attribution = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(attribution)
    src = RESULTS / "attribution"
    shutil.copy(src / "attribution.json", tmp_path / "attribution.json")
    assert attribution.main(["--from-json", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "attribution.md").read_text()
    assert md == (src / "attribution.md").read_text()
    summary = json.loads((tmp_path / "attribution.json").read_text())
    row = summary["labeler_mode"]["rows"]["step2/bort2"]
    lo, hi = t_interval(np.array(row["diffs"]))
    assert (round(lo, 1), round(hi, 1), row["helped"], row["n"]) == (-3.5, -1.3, 0, 6)
    assert "| -2.4 [-3.5, -1.3], 0 / 6 |" in md
    assert "+0.0 [+0.0, +0.0], 0 / 6 (6 ties)" in md  # identical runs: an interval of width 0
    one = attribution._cell(attribution._row([1.25]))
    assert one == "+1.2 no CI (n = 1), 1 / 1" and "±" not in one
