"""The BORT² run folder (``output_dir``, ``bort2/rundir.py`` and ``run.py``): ``overwrite=true``
deletes only what the pipeline wrote, a moved / symlinked / relatively spelled run resumes,
mistakes are refused before anything is written, and Ctrl-C prints one line with the command
that continues the run (each case reproduces a user's report first, then checks the fix)."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from bort2 import cli as run
from bort2.config import CONFIG_DIR, load_config
from bort2.rundir import MARKER
from helpers import RUN_PY

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(data_root, out, *extra):
    return [
        "preset=smoke",
        "step1.iters=6",
        "step2.iters=6",
        "checkpoint_every=2",
        "eval_every=3",
        "step2.hyper.every=3",
        "data.max_test=32",
        "progress=false",
        "threads=1",
        "tsne=false",
        f"data.root={data_root}",
        f"output_dir={out}",
        *extra,
    ]


@pytest.fixture(scope="module")
def finished(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("rundir") / "run"
    assert run.main(tiny(data_root, out)) == 0
    return out


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (links not followed) with the bytes of its files."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            key = p.relative_to(root).as_posix()
            out[key] = p.read_bytes() if p.is_file() and not p.is_symlink() else None
    return out


def one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def rows(out: Path) -> list[tuple]:
    payload = json.loads((out / "results.json").read_text())["results"]
    return [(r["target"], r["seed"], r["stage"], r["acc"], r["n"]) for r in payload]


def unfinish(stage: Path) -> None:
    """Make a finished stage unfinished (as a run killed inside it leaves it, minus states)."""
    for name in ("final.pt", "metrics.json", "history.json", "labeler_final.pt"):
        for p in (stage / name, stage / f"{name}.sha256"):
            p.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- overwrite
def test_overwrite_never_deletes_files_the_pipeline_did_not_write(
    finished, data_root, tmp_path, capsys
):
    """The report: a user's notes.txt and src/ were deleted with the run by overwrite=true."""
    out = tmp_path / "mine"
    shutil.copytree(finished, out)
    assert (out / MARKER).is_file()  # the pipeline marks the folders it writes
    (out / "notes.txt").write_text("my notes")
    (out / "src").mkdir()
    (out / "src" / "main.py").write_text("print(1)")
    (out / "uci_m" / "seed0" / "notes.md").write_text("about this seed")
    (out / "figures" / "draft.txt").write_text("caption")
    before = snapshot(out)
    assert run.main(tiny(data_root, out, "overwrite=true")) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("error: overwrite=true refused")
    for name in ("notes.txt", "src/", "uci_m/seed0/notes.md", "figures/draft.txt"):
        assert name in line
    assert "nothing was deleted" in line
    assert snapshot(out) == before
    # without the foreign entries, overwrite deletes the run's entries (and only those)
    for p in ("notes.txt", "uci_m/seed0/notes.md", "figures/draft.txt"):
        (out / p).unlink()
    shutil.rmtree(out / "src")
    cfg = load_config(None, tiny(data_root, out, "overwrite=true"))
    run.prepare_output(cfg)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "config.yaml"]


#: the marker the pipeline wrote before it recorded its files (format 1), byte for byte
FORMAT1_MARKER = (
    "bort2 run folder, format 1\n"
    "Written by examples/bort2/run.py. overwrite=true deletes only the entries the pipeline "
    "writes here (config.yaml, results.*, mechanism.*, figures/, <domain>/seed<N>/step*/).\n"
)


def test_overwrite_keeps_a_file_in_a_stage_folder_and_a_png_in_figures(
    finished, data_root, tmp_path, capsys
):
    """Issue 30: overwrite=true deleted a user's file inside a stage folder (stage folders went
    whole) and a PNG in figures/ (any plot-like name went), without a word."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    mine = {
        "uci_m/seed0/step2_bort2/my_analysis.ipynb": b'{"cells": []}',
        "figures/fig1.png": b"\x89PNG\r\n\x1a\n my figure",
        "uci_m/seed0/step1_source_only/tb/events.out.tfevents.mine": b"my events",
    }
    for rel, data in mine.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    before = snapshot(out)
    assert run.main(tiny(data_root, out, "overwrite=true")) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("error: overwrite=true refused") and "nothing was deleted" in line
    # named (a folder holding nothing else of the pipeline's is named once, as tb/)
    for rel in ("uci_m/seed0/step2_bort2/my_analysis.ipynb", "figures/fig1.png"):
        assert rel in line, rel
    assert "uci_m/seed0/step1_source_only/tb/" in line
    assert snapshot(out) == before
    for rel, data in mine.items():
        assert (out / rel).read_bytes() == data


def test_overwrite_keeps_a_pipeline_file_whose_bytes_changed(finished, data_root, tmp_path, capsys):
    """A file of the pipeline's name that the user edited (or replaced) after the run wrote it
    is no longer the pipeline's: kept, named, nothing deleted."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    with open(out / "results.md", "a") as fh:
        fh.write("\nMy reading of these numbers.\n")
    final = out / "uci_m" / "seed0" / "step2_naive" / "final.pt"
    final.write_bytes(b"my own model")
    before = snapshot(out)
    assert run.main(tiny(data_root, out, "overwrite=true")) == 2
    line = one_line(capsys.readouterr().err)
    assert "changed since the pipeline wrote them" in line
    assert "results.md" in line and "uci_m/seed0/step2_naive/final.pt" in line
    assert "nothing was deleted" in line
    assert snapshot(out) == before


def test_a_folder_of_files_with_pipeline_names_is_never_deleted(data_root, tmp_path, capsys):
    """Issue 30: another project's config.yaml, a hand-written results.md and figures/fig1.png
    were refused as 'a run', then deleted by overwrite=true ('every entry is one the pipeline
    writes')."""
    out = tmp_path / "project"
    mine = {
        "config.yaml": b"model: transformer\nlr: 3e-4\n",
        "results.md": b"# My results\n\nhand-written\n",
        "figures/fig1.png": b"\x89PNG\r\n\x1a\n mine",
    }
    for rel, data in mine.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    before = snapshot(out)
    assert run.main(tiny(data_root, out)) == 2
    assert "already holds a run" in one_line(capsys.readouterr().err)
    assert run.main(tiny(data_root, out, "overwrite=true")) == 2
    line = one_line(capsys.readouterr().err)
    assert "no .bort2-run marker" in line and "nothing was deleted" in line
    assert f"rm -r {out}" in line  # how to proceed when nothing in it is the user's
    for rel in ("config.yaml", "results.md", "figures/"):
        assert rel in line, rel
    assert snapshot(out) == before


def test_rerun_with_overwrite_deletes_what_the_pipeline_wrote_after_a_kill_and_resume(
    data_root, tmp_path, capsys, monkeypatch
):
    """A run the pipeline wrote (TensorBoard files, periodic states of a run killed inside Stage
    B, then resumed) is overwritten by the same command with overwrite=true: every file it
    wrote is proven by the manifest and deleted, and the new run writes the same numbers."""
    from bort2 import checkpoint, trainer
    from bort2.rundir import recorded, unproven_entries

    out = tmp_path / "run"
    args = tiny(data_root, out, "tensorboard=true")

    class Killed(checkpoint.StageCheckpoint):
        """Ctrl-C after Stage B's second periodic checkpoint (state.pt and state.prev.pt)."""

        def step(self, done, total):
            if "step2_robust" in str(self.path) and done == 5:
                raise KeyboardInterrupt
            super().step(done, total)

    monkeypatch.setattr(trainer, "StageCheckpoint", Killed)
    assert run.main(args) == 130
    monkeypatch.undo()
    stage_b = out / "uci_m" / "seed0" / "step2_robust"
    assert (stage_b / "state.prev.pt").is_file() and (stage_b / "tb").is_dir()
    assert unproven_entries(out) == []  # what a killed run leaves is proven too
    capsys.readouterr()
    assert run.main([*args, "resume=true"]) == 0, capsys.readouterr().err
    ref = rows(out)
    events = sorted(out.glob("uci_m/seed0/*/tb/*"))
    assert len(events) == 6  # one per stage, two for the resumed Stage B
    manifest = recorded(out)
    for path in [out / "config.yaml", out / "results.md", *events]:
        assert path.relative_to(out).as_posix() in manifest, path
    assert unproven_entries(out) == []
    capsys.readouterr()
    assert run.main([*args, "overwrite=true"]) == 0, capsys.readouterr().err
    assert rows(out) == ref  # the same numbers, and nothing of the first run is left
    assert len(sorted(out.glob("uci_m/seed0/*/tb/*"))) == 5
    assert not list(out.glob("**/state*.pt"))
    assert unproven_entries(out) == []


def test_a_run_folder_from_before_the_manifest_resumes_and_is_never_overwritten(
    finished, data_root, tmp_path, capsys
):
    """A run folder written by the previous version (a format-1 marker that records no file)
    resumes with the same numbers; overwrite=true cannot prove any of its files the pipeline's,
    so it deletes nothing and says how to proceed. The same for a folder without a marker."""
    from bort2.rundir import recorded

    ref = rows(finished)
    out = tmp_path / "old"
    shutil.copytree(finished, out)
    (out / MARKER).write_text(FORMAT1_MARKER)
    unfinish(out / "uci_m" / "seed0" / "step2_bort2")
    assert run.main(tiny(data_root, out, "resume=true")) == 0, capsys.readouterr().err
    assert rows(out) == ref
    manifest = recorded(out)  # the resumed part is recorded, the old files are not
    assert "uci_m/seed0/step2_bort2/final.pt" in manifest
    assert "uci_m/seed0/step2_naive/final.pt" not in manifest
    capsys.readouterr()
    before = snapshot(out)
    assert run.main(tiny(data_root, out, "overwrite=true")) == 2
    line = one_line(capsys.readouterr().err)
    assert "older version" in line and f"rm -r {out}" in line and "nothing was deleted" in line
    assert "uci_m/seed0/step2_naive/" in line and "results.md" in line
    assert snapshot(out) == before
    # format 1 as the previous version left it, and no marker at all: refused the same way
    for marker in (FORMAT1_MARKER, None):
        legacy = tmp_path / f"legacy{marker is None}"
        shutil.copytree(finished, legacy)
        if marker is None:
            (legacy / MARKER).unlink()
        else:
            (legacy / MARKER).write_text(marker)
        before = snapshot(legacy)
        assert run.main(tiny(data_root, legacy, "overwrite=true")) == 2
        line = one_line(capsys.readouterr().err)
        assert "older version" in line and f"rm -r {legacy}" in line, line
        assert snapshot(legacy) == before


def test_overwrite_through_a_symlinked_output_dir(finished, data_root, tmp_path, capsys):
    """The report: overwrite=true on a symlinked output_dir was an OSError traceback."""
    real, link = tmp_path / "disk" / "run", tmp_path / "link"
    shutil.copytree(finished, real)
    link.symlink_to(real, target_is_directory=True)
    (real / "notes.txt").write_text("mine")
    before = snapshot(real)
    assert run.main(tiny(data_root, link, "overwrite=true")) == 2
    assert "notes.txt" in one_line(capsys.readouterr().err)
    assert snapshot(real) == before and link.is_symlink()
    (real / "notes.txt").unlink()
    run.prepare_output(load_config(None, tiny(data_root, link, "overwrite=true")))
    assert link.is_symlink() and link.resolve() == real.resolve()  # the link is kept
    assert sorted(p.name for p in real.iterdir()) == [MARKER, "config.yaml"]
    # a link whose target is gone: one line, nothing created
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone", target_is_directory=True)
    assert run.main(tiny(data_root, dangling)) == 2
    assert "does not exist" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "gone").exists()


def test_a_new_run_in_a_folder_of_other_files_is_never_deleted_later(data_root, tmp_path):
    out = tmp_path / "project"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    cfg = load_config(None, tiny(data_root, out))
    run.prepare_output(cfg)  # a run may start in a folder of other files...
    with pytest.raises(Exception, match="notes.txt"):  # ...which overwrite then refuses
        run.prepare_output(load_config(None, tiny(data_root, out, "overwrite=true")))
    assert (out / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- resume
def test_a_moved_run_resumes_from_any_spelling_of_its_folder(
    finished, data_root, tmp_path, capsys, monkeypatch
):
    """The report: a moved run, a symlink's target and a relative path were refused on
    output_dir, with a suggestion (overwrite=true) that would have deleted the run."""
    ref = rows(finished)
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    shutil.copytree(finished, a)
    bort2 = Path("uci_m") / "seed0" / "step2_bort2"
    unfinish(a / bort2)  # Stage C must be trained again after the move
    b.parent.mkdir()
    shutil.move(a, b)  # the natural recovery from a full disk
    assert run.main(tiny(data_root, b, "resume=true")) == 0, capsys.readouterr().err
    assert rows(b) == ref
    assert (b / bort2 / "final.pt").is_file()
    # through a symbolic link to the folder
    link = tmp_path / "link"
    link.symlink_to(b, target_is_directory=True)
    unfinish(b / bort2)
    assert run.main(tiny(data_root, link, "resume=true")) == 0, capsys.readouterr().err
    assert rows(b) == ref
    # a relative spelling of the folder
    unfinish(b / bort2)
    monkeypatch.chdir(b.parent)
    assert run.main(tiny(data_root, "run", "resume=true")) == 0, capsys.readouterr().err
    assert rows(b) == ref
    capsys.readouterr()
    # a real difference is still refused, and overwrite=true is named as deleting the run
    assert run.main(tiny(data_root, b, "resume=true", "step2.iters=5")) == 2
    line = one_line(capsys.readouterr().err)
    assert "step2.iters: 6 -> 5" in line and "output_dir" not in line.split(":")[0]
    assert "overwrite=true" in line and "delete" in line


# ----------------------------------------------------------------------------- checked first
def test_mistakes_are_refused_before_the_folder_is_written(data_root, tmp_path, capsys):
    """The report: device=cuda without CUDA and a missing or wrong data.root wrote
    config.yaml, so the corrected command was refused as 'already holds a run'."""
    cases = []
    if not torch.cuda.is_available():
        cases.append((["device=cuda"], "device=cuda"))
    digit5 = ["--config", str(CONFIG_DIR / "digit5.yaml")]
    pacs = ["--config", str(CONFIG_DIR / "pacs.yaml")]
    empty = tmp_path / "empty_pacs"
    empty.mkdir()
    cases += [
        (digit5, "data.root=DIR"),  # no data.root (the message named a key root= that is not)
        ([*digit5, f"data.root={tmp_path / 'nowhere'}"], "nowhere"),
        ([*pacs, f"data.root={empty}"], "expected layouts: docs/datasets.md"),
    ]
    for i, (extra, words) in enumerate(cases):
        out = tmp_path / f"out{i}"
        argv = [*extra, f"output_dir={out}", "progress=false"]
        assert run.main(argv) == 2, extra
        line = one_line(capsys.readouterr().err)
        assert line.startswith("error: ") and words in line, line
        assert "needs root=" not in line
        assert not out.exists(), extra


# ----------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_prints_one_line_with_the_command_that_continues_the_run(data_root, tmp_path):
    """The report: Ctrl-C printed a 40-line traceback."""
    out = tmp_path / "int"
    args = tiny(data_root, out, "step1.iters=100", "checkpoint_every=30", "step2.iters=8")
    cmd = [sys.executable, str(RUN_PY), *args]
    # the periodic state's checksum is its last file: the signal comes between checkpoints
    state = out / "uci_m" / "seed0" / "step1_source_only" / "state.pt.sha256"
    # a shell's background job (`cmd &` without job control) starts with SIGINT ignored, and
    # Python keeps an inherited SIG_IGN: the child gets the default disposition back, so that
    # the test checks the pipeline rather than how pytest was launched
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 300
    try:
        while proc.poll() is None and time.monotonic() < deadline and not state.exists():
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    line = one_line(err)
    assert line.startswith("interrupted in stage step1/source_only (target uci_m, seed 0)")
    assert "resume=true" in line and not (out / "results.json").exists()
    printed = shlex.split(line.split("Continue with: ", 1)[1])
    assert printed[0] == "python" and printed[-1] == "resume=true"
    done = subprocess.run(
        [sys.executable, *printed[1:]], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(rows(out)) == 5  # every stage finished
