"""The stage registry: bort2.stages_index.SPECS is the one source of names, order, inputs and
display; every validated method has a stage; the runner's order is derived from ``needs``."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from bort2 import engine, report, stages_index
from bort2.config import STEP1_METHODS, STEP2_METHODS, load_config
from bort2.stages_index import SPECS, StageSpec, plan
from bort2.trainer import STAGES, Stage, register_stage

PACKAGE = Path(stages_index.__file__).parent


def test_every_validated_method_has_a_spec_and_a_registered_stage():
    # config's validation lists (what step1.methods / step2.methods accept)
    for step, valid in (("step1", STEP1_METHODS), ("step2", STEP2_METHODS)):
        assert valid, step
        for method in valid:
            name = f"{step}/{method}"
            assert name in SPECS, f"{name} passes config validation but has no spec row"
            assert name in STAGES, f"{name} passes config validation but has no stage class"
            assert issubclass(STAGES[name], Stage) and STAGES[name].name == name


def test_every_spec_has_a_class_and_every_class_a_spec():
    assert set(SPECS) == set(engine.STAGES)
    assert stages_index.step1_methods() == tuple(STEP1_METHODS)
    assert stages_index.step2_methods() == tuple(STEP2_METHODS)


def test_register_stage_refuses_a_name_without_a_spec():
    with pytest.raises(ValueError, match="no row in bort2.stages_index.SPECS"):
        register_stage("step2/unlisted")(type("Unlisted", (Stage,), {}))
    assert "step2/unlisted" not in STAGES


def test_stages_index_imports_no_torch():
    code = "import sys, bort2.stages_index, bort2.config; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent
    )
    assert out.stdout.strip() == "False"


def test_report_display_and_order_come_from_specs():
    assert report.DISPLAY == {n: s.display for n, s in SPECS.items()}
    assert report.ORDER == list(SPECS)
    chain = sorted(
        (s for s in SPECS.values() if s.paper_order is not None), key=lambda s: s.paper_order
    )
    assert report.PAPER_ORDER == [s.name for s in chain]
    rows = [
        {"stage": n, "target": "t", "seed": 0, "acc": 0.5, "ci_low": 0.4, "ci_high": 0.6, "n": 10}
        for n in reversed(list(SPECS))
    ]
    table = report.markdown_table(rows, ["t"])
    shown = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]
    assert shown[1:] == [s.display for s in SPECS.values()]  # [0]: the header


def test_plan_is_topological_over_needs_and_follows_the_config():
    cfg = load_config(None, [])
    assert plan(cfg) == [f"step1/{m}" for m in cfg.step1.methods] + [
        f"step2/{m}" for m in ("naive", "robust", "bort2")
    ]
    # Stage C from Stage B: Stage B first, even when not asked for
    cfg = load_config(None, ["step2.methods=[bort2,naive]"])
    assert [n for n in plan(cfg) if n.startswith("step2/")] == [
        "step2/naive",
        "step2/robust",
        "step2/bort2",
    ]
    # Stage C from step 1 needs no Stage B
    cfg = load_config(None, ["step2.methods=[bort2]", "step2.bort2_init=step1"])
    assert plan(cfg)[-1:] == ["step2/bort2"] and "step2/robust" not in plan(cfg)
    assert SPECS["step2/bort2"].needs(cfg) == (f"step1/{cfg.step1.labeler}",)
    # with step1.checkpoint nothing of step 1 is trained
    cfg = load_config(None, ["step1.checkpoint=/x.pt"])
    assert all(n.startswith("step2/") for n in plan(cfg))


def test_a_new_step2_method_is_one_spec_row_and_one_class(monkeypatch):
    """A new row that needs Stage C is run after it; no other table needs editing."""
    row = StageSpec("step2/extra", "Extra", needs=lambda cfg: ("step2/bort2",), stochastic=True)
    monkeypatch.setitem(SPECS, row.name, row)
    assert "extra" in stages_index.step2_methods()
    cfg = load_config(None, [])
    cfg = replace(cfg, step2=replace(cfg.step2, methods=["extra", "naive"]))
    assert [n for n in plan(cfg) if n.startswith("step2/")] == [
        "step2/naive",
        "step2/robust",
        "step2/bort2",
        "step2/extra",
    ]
    assert stages_index.display("step2/extra") == "Extra"
    with pytest.raises(ValueError, match="need each other"):
        loop = replace(SPECS["step2/bort2"], needs=lambda cfg: ("step2/extra",))
        monkeypatch.setitem(SPECS, "step2/bort2", loop)
        plan(cfg)


# the files owned by the configuration and the command line (config fields, their defaults and
# the stages that read them; the t-SNE figure of Stage C) are checked by their own tests
_NOT_SCANNED = {"config/schema.py", "cli.py"}
EXAMPLE = PACKAGE.parent
#: the scripts and attribution.py take stage names and display labels from the registry too;
#: minidigits_calibration.py's "source_only" is a column of its own JSON (a source-only
#: classifier trained there), not a stage
_OUTSIDE = sorted(EXAMPLE.glob("scripts/*.py")) + [EXAMPLE / "attribution.py"]
_OUTSIDE_WORDS = {"scripts/minidigits_calibration.py": {"step1/source_only"}}


@pytest.mark.parametrize("name", list(SPECS))
def test_a_method_name_is_written_only_in_stages_index_and_its_own_class(name):
    step, method = name.split("/")
    pattern = re.compile(rf"[\"']({step}[/_])?{method}[\"'/]")
    found = {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if p.relative_to(PACKAGE).as_posix() not in _NOT_SCANNED and pattern.search(p.read_text())
    }
    own = {
        "step2": "step2/stages.py",
        "step1": f"step1/{'fixmatch' if 'fixmatch' in method else method}.py",
    }
    assert found <= {"stages_index.py", own[step]}, found
    outside = {
        p.relative_to(EXAMPLE).as_posix()
        for p in _OUTSIDE
        if pattern.search(p.read_text())
        and name not in _OUTSIDE_WORDS.get(p.relative_to(EXAMPLE).as_posix(), ())
    }
    assert not outside, f"{name} written in {outside}: take it from bort2.stages_index"


def test_scripts_take_display_labels_from_the_registry():
    for p in _OUTSIDE:
        text = p.read_text()
        for spec in SPECS.values():
            assert f'"{spec.display}"' not in text, (p.name, spec.display)


def test_every_read_by_names_a_registered_stage():
    """``read_by`` (beside each config key) names stages or patterns; each must match one."""
    from fnmatch import fnmatchcase

    from bort2.config import KEYS

    for key in KEYS.values():
        for pattern in key.read_by.patterns:
            assert any(fnmatchcase(n, pattern) for n in SPECS), (key.name, pattern)


def test_ignores_are_derived_from_read_by():
    from bort2.config import KEYS

    for name, spec in SPECS.items():
        assert set(spec.ignores) == {
            k for k, key in KEYS.items() if key.computed and name not in key.read_by
        }
    # what the stages have never read
    assert "step1.cm_variant" in SPECS["step1/source_only"].ignores
    assert not SPECS["step2/bort2"].ignores
    assert {"step2.labels", "step2.teacher_ema", "model.sigma_head"} <= set(
        SPECS["step2/naive"].ignores
    )
