"""The BORT² measuring scripts of ``examples/bort2/scripts/``: their tables are rendered from the
JSON they write (the committed bilevel-cost result is reproduced)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS, RESULTS = ROOT / "examples" / "bort2" / "scripts", ROOT / "examples" / "bort2" / "results"


def _report(script: str, out: Path) -> str:
    cmd = [sys.executable, str(SCRIPTS / script), "--report", "--out", str(out)]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120).stdout


def test_bilevel_cost_report_reproduces_the_committed_table(tmp_path):
    shutil.copy(RESULTS / "bilevel_cost.json", tmp_path / "bilevel_cost.json")
    assert "**1.28×**" in _report("bilevel_cost.py", tmp_path)
    committed = (RESULTS / "bilevel_cost.md").read_text()
    assert (tmp_path / "bilevel_cost.md").read_text() == committed


def test_minidigits_calibration_report_renders_its_rows(tmp_path):
    rows = [{"target": "uci", "source_only": 74.49, "oracle": 99.04, "n_test": 1347}]
    (tmp_path / "minidigits_calibration.json").write_text(json.dumps({"rows": rows}))
    assert "| uci | 74.5 | 99.0 | 1347 |" in _report("minidigits_calibration.py", tmp_path)
    assert (tmp_path / "minidigits_calibration.md").read_text().startswith("<!-- generated from")
