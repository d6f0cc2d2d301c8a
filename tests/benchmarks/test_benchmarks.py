"""The benchmark package itself: the timer, the memory probe, the report, and the command line
in ``--quick`` mode (peers and time-to-accuracy suites on the tiny ridge problem)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from benchmarks import kit, report
from benchmarks.kit import ROOT


def test_timer_interleaves_and_records_failures():
    calls = []

    def boom():
        raise ValueError("no")

    t = kit.timeit({"a": lambda: calls.append("a"), "b": lambda: calls.append("b"), "x": boom}, 3)
    assert len(t["a"]["times_s"]) == len(t["b"]["times_s"]) == 3 and not t["x"]["times_s"]
    assert t["x"]["errors"] == ["ValueError: no"]
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]  # warm-up, then alternating


def test_probe_measures_an_allocation_in_a_fresh_process():
    (res,) = kit.probe("benchmarks.kit:allocation", [{"mib": 64}])
    assert res["peak_mib"] == pytest.approx(64, abs=8), res


@pytest.mark.parametrize(
    ("suite", "name"),
    [
        ("overhead", "overhead"),
        ("overhead", "overhead_units"),
        ("hvp_cost", "hvp_cost"),
        ("memory", "memory"),
        ("solver_accuracy", "solver_accuracy"),
        ("time_to_accuracy", "time_to_accuracy"),
        ("first_call", "first_call"),
        ("first_call", "first_call_dense_max"),
    ],
)
def test_report_reproduces_the_committed_markdown(tmp_path, suite, name):
    shutil.copy(kit.RESULTS / f"{name}.json", tmp_path / f"{name}.json")
    md = report.render(suite, tmp_path, name)
    assert md.count("\n|") >= 2
    assert (tmp_path / f"{name}.md").read_text() == (kit.RESULTS / f"{name}.md").read_text()


def test_report_reproduces_the_committed_peer_tables(tmp_path):
    (tmp_path / "peers").mkdir()
    for path in (kit.RESULTS / "peers").glob("*.json"):
        if path.stem != "peers":
            shutil.copy(path, tmp_path / "peers" / path.name)
    md = report.render("peers", tmp_path, "peers")
    assert "| **hypergrad** | cg |" in md
    committed = (kit.RESULTS / "peers" / "peers.md").read_text()
    assert (tmp_path / "peers" / "peers.md").read_text() == committed


@pytest.mark.slow
def test_quick_command_line_end_to_end(tmp_path):
    pytest.importorskip("sklearn")
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "peers",
        "time_to_accuracy",
        "--quick",
        "--out",
        str(tmp_path),
        "--set",
        "problems=ridge_tiny",
        "libs=hypergrad,torchopt",
        "ks=5",
        "memory=false",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300)
    res = json.loads((tmp_path / "peers" / "ridge_tiny.json").read_text())
    ok = [r for r in res["records"] if r["status"] == "ok"]
    assert ok and all(r["rel_error"] < 1e-12 and r["median_s"] for r in ok if r["solver"] == "cg")
    assert "| **hypergrad** | cg |" in (tmp_path / "peers" / "peers.md").read_text()
    assert (tmp_path / "peers" / "ridge_tiny.png").exists()
    tta = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    assert set(tta["problems"][0]["best"]) == {"hypergrad", "torchopt"}
    assert (tmp_path / "time_to_accuracy.png").exists()


def test_suite_options_take_set_text_and_typed_run_variants():
    """``--set`` text is parsed by the option's type; a ``RUNS`` variant's values are already
    typed (the ``_chebyshev_n1000`` variant's list of methods once failed on ``.split``)."""
    import importlib

    from benchmarks.__main__ import options

    mod = importlib.import_module("benchmarks.suites.solver_accuracy")
    for tag, change in mod.RUNS:
        o = options(mod, False, change, 1)
        assert all(o[k] == v for k, v in change.items()), tag
    o = options(mod, False, {"n": "50", "kappas": "10,100"}, 1)
    assert o["n"] == 50 and o["kappas"] == [10.0, 100.0]


def test_renderers_are_named_in_one_table():
    """Every suite that ``render`` reaches has a row in ``report.RENDER`` or writes its own
    report (``OWN_REPORT``); a suite with results but no row is refused by name."""
    from benchmarks.__main__ import SUITES

    named = set(report.RENDER) | set(report.OWN_REPORT) | {"peers"}
    assert set(SUITES) <= named, set(SUITES) - named


def test_bort2_scripts_copy_of_machine_is_the_kits():
    """``examples/bort2/scripts/_bench.py`` copies ``kit.machine`` (the pipeline cannot import the
    repository's benchmarks package): the two functions must stay the same code."""
    import ast

    def body(path):
        fn = next(
            n for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.FunctionDef) and n.name == "machine"
        )  # fmt: skip
        stmts = fn.body[1:] if isinstance(fn.body[0], ast.Expr) else fn.body  # no docstring
        return [ast.dump(s) for s in stmts]

    copy = ROOT / "examples" / "bort2" / "scripts" / "_bench.py"
    assert body(copy) == body(ROOT / "benchmarks" / "kit.py")
