"""The BORT² command line (``bort2/cli.py``, ``run.py``, the ``bort2`` console script) and the
configuration's declarations: help lines and constraints next to the fields, the schema
version's migrations (renamed keys), the CLI's messages, progress lines off a terminal and the
mode of written files."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import tomllib
import yaml
from bort2 import cli
from bort2.config import (
    KEYS,
    SCHEMA_VERSION,
    ConfigError,
    RenamedKeyWarning,
    flat_keys,
    load_config,
    nest,
    spell,
    to_yaml,
)
from bort2.config.migrate import renamed
from bort2.progress import LineBar, make_bar
from bort2.rundir import MARKER, config_differences, prepare_output, user_file_mode
from helpers import ROOT, RUN_PY

BORT2 = ROOT / "examples" / "bort2"


def _old_layout_yaml(cfg) -> str:
    """``cfg`` as a ``config.yaml`` written before ``step2.hyper`` existed (schema version 1:
    flat old keys, no keys added since)."""
    import dataclasses

    return yaml.safe_dump(nest(spell(flat_keys(dataclasses.asdict(cfg)), 1)))


# ----------------------------------------------------------------------------- entry points
def test_run_py_is_a_shim_of_bort2_cli():
    text = RUN_PY.read_text()
    assert "from bort2.cli import main" in text and "raise SystemExit(main())" in text
    assert len([line for line in text.splitlines() if line and not line.startswith("#")]) < 12
    scripts = tomllib.loads((BORT2 / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"bort2": "bort2.cli:main"}


def test_run_py_help_runs_as_a_script():
    done = subprocess.run(
        [sys.executable, str(RUN_PY), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "step2.hyper.convention=official" in done.stdout and "threads=1" in done.stdout


def test_console_script_when_installed():
    script = Path(sys.executable).parent / "bort2"
    if not script.exists():
        pytest.skip("the bort2 console script is not installed in this environment")
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: bort2"), done.stderr


# ----------------------------------------------------------------------------- --help
def test_help_shows_every_key_with_default_valid_values_and_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for key in KEYS:
        mine = [line for line in lines if line.startswith(f"  {key}=")]
        assert len(mine) == 1, key
        assert KEYS[key].help in mine[0], key
    line = next(x for x in lines if x.strip().startswith("step2.threshold="))
    assert "step2.threshold=adaptive" in line and "{fixed,adaptive,per_class}" in line
    line = next(x for x in lines if x.strip().startswith("step2.hyper.lr="))
    assert "(0, inf)" in line and "float" in line
    # the thread count behind the published timings is discoverable
    assert "threads=N" in out and "published timings" in out
    threads = next(x for x in lines if x.startswith("  threads="))
    assert "threads=1" in threads and "torch threads" in threads
    assert "step2.hyper_convention -> step2.hyper.convention" in out  # renamed keys listed


def test_every_field_has_a_help_line_and_a_checked_type():
    """A new field without a help line or a constraint fails here (bools need no constraint;
    a free-form string names who checks it)."""
    for key, k in KEYS.items():
        assert k.help.strip() and "\n" not in k.help, key
        assert k.base in (bool, int, float, str, list), (key, k.type)
        if k.base in (int, float):
            assert k.range is not None, f"{key}: a number needs a range"
        elif k.base is list:
            assert k.choices, f"{key}: a list needs the valid names of its elements"
        elif k.base is str:
            assert k.choices or k.field.metadata.get("check"), f"{key}: choices or check"
        if k.choices is not None and k.base is str and k.default is not None:
            assert k.default in k.choices, key
        if k.range is not None and k.default is not None:
            lo, hi = k.range[:2]
            assert lo <= k.default <= hi, key


def test_method_names_come_from_the_stage_index():
    from bort2.stages_index import step1_methods, step2_methods

    assert KEYS["step1.methods"].choices == step1_methods()
    assert KEYS["step1.labeler"].choices == step1_methods()
    assert KEYS["step2.methods"].choices == step2_methods()


# ----------------------------------------------------------------------------- messages
def test_misspelled_key_suggests_the_closest_in_one_short_line(capsys, tmp_path):
    assert cli.main(["step1.iter=5", f"output_dir={tmp_path / 'o'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and len(err) < 200, err
    assert "step1.iter" in err and "did you mean step1.iters?" in err
    for wrong, right in (
        ("step2.hyper.conventon", "step2.hyper.convention"),
        ("stpe2.methods", "step2.methods"),
        ("thread", "threads"),
        ("step2.hyper_lrr", "step2.hyper.lr"),  # an old name misspelled: the new name
    ):
        with pytest.raises(ConfigError, match=f"did you mean {right}\\?"):
            load_config(None, [f"{wrong}=1"])
    with pytest.raises(ConfigError, match="valid keys of model: model.arch"):
        load_config(None, ["model.depth=3"])
    with pytest.raises(ConfigError, match=r"valid keys: preset, .*, data\.\*, model\.\*"):
        load_config(None, ["foo.bar=3"])


def test_a_list_key_takes_one_name_or_a_comma_list(tmp_path):
    assert load_config(None, ["step2.methods=bort2"]).step2.methods == ["bort2"]
    assert load_config(None, ["step2.methods=naive,bort2"]).step2.methods == ["naive", "bort2"]
    assert load_config(None, ["step2.methods=[robust]"]).step2.methods == ["robust"]
    assert load_config(None, ["step1.methods=fixmatch_cm"]).step1.methods == ["fixmatch_cm"]
    path = tmp_path / "one.yaml"
    path.write_text("step2:\n  methods: robust\n")
    assert load_config(path).step2.methods == ["robust"]
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["step2.methods=bort3"])
    msg = str(exc.value)
    assert "bort3" in msg and "naive, robust, bort2" in msg and "ListConfig" not in msg


def test_a_value_of_the_wrong_type_names_the_expected_type():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["step2.iters=many"])
    assert "step2.iters" in str(exc.value) and "int [1, inf)" in str(exc.value)


# ----------------------------------------------------------------------------- renamed keys
@pytest.mark.parametrize("old", sorted(renamed()))
def test_every_old_key_is_read_under_its_new_name_with_a_note(old):
    new, negate = renamed()[old]
    k = KEYS[new]
    value = {bool: "true", int: "7", float: "0.25", str: k.choices[-1] if k.choices else ""}[k.base]
    with pytest.warns(RenamedKeyWarning, match=f"{old} .* is now {new}"):
        cfg = load_config(None, [f"{old}={value}"])
    got = k.get(cfg)
    expected = {"true": True, "7": 7, "0.25": 0.25}.get(value, value)
    assert got == ((not expected) if negate else expected)
    # the old name exists only in the migration: the configuration has one name per key
    assert not hasattr(cfg.step2, old.split(".")[1])


def test_hyper_convention_has_one_name():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name: no note
        cfg = load_config(None, ["step2.hyper.convention=library"])
    assert cfg.step2.hyper.convention == "library"
    assert "hyper_convention" not in to_yaml(cfg) and "convention: library" in to_yaml(cfg)
    with pytest.raises(ConfigError, match="both step2.hyper_convention and its new name"):
        load_config(None, ["step2.hyper_convention=library", "step2.hyper.convention=official"])
    with pytest.raises(ConfigError, match="step2.hyper.convention='auxilearn' is not valid"):
        with pytest.warns(RenamedKeyWarning):
            load_config(None, ["step2.hyper_convention=auxilearn"])


def test_cli_prints_each_renamed_key_as_one_note(capsys, tmp_path):
    cfg = cli.load_with_notes(None, ["step2.hyper_convention=library", "step2.hyper_lr=0.1"])
    assert (cfg.step2.hyper.convention, cfg.step2.hyper.lr) == ("library", 0.1)
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 2 and all(n.startswith("note: config key step2.") for n in notes)
    assert any(
        "step2.hyper_convention in the command line is now step2.hyper.convention" in n
        for n in notes
    )


def test_an_old_config_file_still_loads(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("step2:\n  hyper_convention: library\n  zero_hypergradient: true\n")
    with pytest.warns(RenamedKeyWarning):
        cfg = load_config(path)
    assert cfg.step2.hyper.convention == "library" and cfg.step2.hyper.apply is False


def test_saved_config_yaml_with_old_keys_resumes(tmp_path):
    """A run folder whose config.yaml predates ``step2.hyper`` resumes with the same settings
    (given under either name), and a real difference is still refused, under the new name."""
    cfg = load_config(None, ["step2.hyper.convention=library", f"output_dir={tmp_path / 'r'}"])
    saved = _old_layout_yaml(cfg)
    assert "hyper_convention: library" in saved and "zero_hypergradient: false" in saved
    assert config_differences(saved, cfg) == []
    changed = load_config(None, ["step2.hyper.convention=official"])
    assert config_differences(saved, changed) == ["step2.hyper.convention: 'library' -> 'official'"]
    out = tmp_path / "r"
    out.mkdir()
    (out / MARKER).write_text("bort2 run folder, format 1\n")
    (out / "config.yaml").write_text(saved)
    with pytest.warns(RenamedKeyWarning):
        resumed = load_config(None, ["step2.hyper_convention=library", f"output_dir={out}"])
    resumed.resume = True
    assert prepare_output(resumed) == out
    assert "convention: library" in (out / "config.yaml").read_text()  # rewritten, new names
    stale = load_config(None, [f"output_dir={out}", "resume=true"])
    (out / "config.yaml").write_text(saved)
    with pytest.raises(ConfigError, match="step2.hyper.convention: 'library' -> 'official'"):
        prepare_output(stale)


def test_spell_gives_the_version_1_layout_checkpoint_fingerprints_hash():
    import dataclasses

    cfg = load_config(None, ["step2.hyper.apply=false", "step2.hyper.lr=0.5"])
    s2 = nest(spell(flat_keys(dataclasses.asdict(cfg)), 1))["step2"]
    assert "hyper" not in s2
    assert (s2["zero_hypergradient"], s2["hyper_lr"], s2["hyper_convention"]) == (
        True,
        0.5,
        "official",
    )
    assert {old.split(".")[1] for old in renamed()} <= set(s2)
    # keys added since version 1 are left out at the default that reproduces version 1
    assert "hinge_reduction" not in s2 and "bort2_labels" not in s2


def test_config_yaml_says_its_schema_version_and_holds_every_key():
    text = to_yaml(load_config())
    assert text.splitlines()[0] == f"schema_version: {SCHEMA_VERSION}"
    saved = flat_keys(yaml.safe_load(text))
    assert set(saved) == set(KEYS) | {"schema_version"}


def test_a_config_of_a_newer_schema_version_is_refused(tmp_path):
    path = tmp_path / "new.yaml"
    path.write_text(f"schema_version: {SCHEMA_VERSION + 1}\nstep2:\n  iters: 3\n")
    with pytest.raises(ConfigError, match=f"schema version {SCHEMA_VERSION + 1}"):
        load_config(path)
    path.write_text(f"schema_version: {SCHEMA_VERSION}\nstep2:\n  iters: 3\n")
    assert load_config(path).step2.iters == 3


def test_the_config_yaml_of_a_run_of_eb03db6_resumes_without_differences():
    """The ``config.yaml`` that ``preset=smoke`` wrote at eb03db6 (before the schema version:
    current names, the keys added since version 1 left out at their defaults)."""
    saved = (Path(__file__).parent / "golden" / "config_eb03db6_smoke.yaml").read_text()
    assert "schema_version" not in saved and "hinge_reduction" not in saved
    out = yaml.safe_load(saved)["output_dir"]
    cfg = load_config(None, ["preset=smoke", f"output_dir={out}"])
    assert config_differences(saved, cfg) == []
    paper = load_config(None, ["preset=smoke", f"output_dir={out}", "step2.hinge_reduction=sum"])
    assert config_differences(saved, paper) == ["step2.hinge_reduction: 'mean' -> 'sum'"]


# ----------------------------------------------------------------------------- resume line
def test_resume_command_names_the_way_the_run_was_started(monkeypatch):
    argv = ["preset=smoke", "overwrite=true"]
    monkeypatch.setattr(sys, "argv", ["/venv/bin/bort2", *argv])
    assert cli.resume_command(argv) == "bort2 preset=smoke resume=true"
    monkeypatch.setattr(sys, "argv", [str(RUN_PY), *argv])
    line = cli.resume_command(argv)
    assert line.startswith("python ") and line.endswith("run.py preset=smoke resume=true")
    monkeypatch.setattr(sys, "argv", ["pytest"])  # main(argv) from Python: the script's path
    assert cli.resume_command(argv).split()[1].endswith(os.path.join("bort2", "run.py"))


# ----------------------------------------------------------------------------- progress
def test_progress_off_a_terminal_is_one_line_per_tenth():
    out = io.StringIO()
    bar = make_bar(200, "step2/bort2 [uci_m s0]", True, file=out)
    assert isinstance(bar, LineBar)
    for i in range(200):
        bar.update(1)
        if i == 50:
            bar.set_postfix(loss="0.412")
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 10, lines  # 10%, ..., 90%, and 100% at the end
    assert lines[0].startswith("step2/bort2 [uci_m s0]: 10% (20/200)")
    assert lines[-1].startswith("step2/bort2 [uci_m s0]: 100% (200/200)")
    assert "loss=0.412" in lines[2]


def test_progress_resumed_and_disabled():
    out = io.StringIO()
    bar = make_bar(100, "s", True, initial=55, file=out)
    for _ in range(45):
        bar.update(1)
    bar.close()
    pcts = [line.split()[1] for line in out.getvalue().splitlines()]
    assert pcts == ["60%", "70%", "80%", "90%", "100%"]
    quiet = io.StringIO()
    bar = make_bar(100, "s", False, file=quiet)
    bar.update(100)
    bar.set_postfix(loss=1)
    bar.close()
    assert quiet.getvalue() == ""


# ----------------------------------------------------------------------------- file modes
def test_user_file_mode_follows_the_umask():
    old = os.umask(0o027)
    try:
        assert user_file_mode() == 0o640
        os.umask(0o002)
        assert user_file_mode() == 0o664
    finally:
        os.umask(old)


# ----------------------------------------------------------------------------- bad files
def _one_paragraph(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


def test_a_config_file_with_a_python_tag_or_bad_yaml_is_one_paragraph(tmp_path):
    """Issue 30: a --config file with a !!python/object tag, or malformed YAML, printed a full
    traceback (exit 1). Now: one line naming the file, the line and what is wrong, exit 2,
    nothing executed and nothing written."""
    touched = tmp_path / "executed"
    cases = {
        "tag.yaml": (
            f'seed: !!python/object/apply:os.system ["touch {touched}"]\n',
            ["line 1, column 7", "the tag !!python/object/apply:os.system is not allowed"],
        ),
        "bracket.yaml": (
            "step1:\n  iters: [1,\n  lr: 3\n",
            ["line 4, column 1", "did not find expected ',' or ']'", "starts at line 2, column 10"],
        ),
    }
    for name, (text, words) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        out = tmp_path / f"out_{name}"
        done = subprocess.run(
            [sys.executable, str(RUN_PY), "--config", str(path), f"output_dir={out}"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr[-3000:]
        line = _one_paragraph(done.stderr)
        assert f"config file {path} is not valid YAML" in line, line
        for w in words:
            assert w in line, (w, line)
        assert not out.exists()
    assert not touched.exists()  # the tag was never constructed


@pytest.mark.parametrize(
    "text, words",
    [
        ("seed: 1\n\tstep1: 2\n", ["line 2, column 1", "tab character"]),
        ("seed: 1\nseed: 2\n", ["line 2, column 1", "duplicate key seed"]),
        ("step1:\n  iters: !!python/name:os.system\n", ["line 2, column 10", "!!python/name"]),
        ("seed: ${nope}\n", ["seed=${nope}", "interpolations"]),
        (b"\x7fELF\x02\x01\x01\x00\xd0\xff", ["is not a text file", "not UTF-8"]),
    ],
    ids=["tab", "duplicate", "python-name", "interpolation", "binary"],
)
def test_every_unreadable_config_file_is_one_line(tmp_path, capsys, text, words):
    path = tmp_path / "cfg.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "out"
    assert cli.main(["--config", str(path), f"output_dir={out}"]) == 2
    line = _one_paragraph(capsys.readouterr().err)
    assert str(path) in line and all(w in line for w in words), line
    assert not out.exists()


def test_an_override_that_is_not_yaml_is_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    for item, words in (
        ("step1.iters=[1,", ["step1.iters", "not valid YAML"]),
        ("seed=!!python/object/apply:os.system [x]", ["seed", "is not allowed"]),
    ):
        assert cli.main([item, f"output_dir={out}"]) == 2
        line = _one_paragraph(capsys.readouterr().err)
        assert all(w in line for w in words), line
    assert not out.exists()


def test_weights_path_that_is_not_a_weights_file_is_one_line(tmp_path, capsys):
    """Issue 30: model.weights_path=/etc/passwd gave an IndexError traceback (from inside
    torch's unpickler, after the run folder was written). Now refused first, in one line."""
    text = Path("/etc/passwd") if Path("/etc/passwd").is_file() else tmp_path / "passwd"
    if not text.is_file():
        text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(RUN_PY), "preset=smoke", "model.arch=resnet18",
         f"model.weights_path={text}", f"output_dir={out}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    line = _one_paragraph(done.stderr)
    assert f"model.weights_path={text}" in line and "is not a PyTorch weights file" in line
    assert not out.exists()
    # another network's weights, and a file of something other than tensors: the same way
    import torch
    import torchvision

    torch.save(torchvision.models.resnet34().state_dict(), tmp_path / "r34.pth")
    torch.save({"epoch": 3, "note": "not weights"}, tmp_path / "meta.pth")
    for name, words in (("r34.pth", "is not a resnet18 state dict"), ("meta.pth", "tensors")):
        argv = ["model.arch=resnet18", f"model.weights_path={tmp_path / name}", f"output_dir={out}"]
        assert cli.main(argv) == 2
        line = _one_paragraph(capsys.readouterr().err)
        assert words in line and name in line, line
    assert not out.exists()
