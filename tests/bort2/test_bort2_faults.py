"""The BORT² pipeline under faults and bad settings: never a garbage number in a results table,
never a lost configuration, never a raw traceback for a bad input (each case reproduces a report
of a user's session first, then checks the fix)."""

import dataclasses
import errno
import json
import os
import shutil

import pytest
import torch
from bort2 import checkpoint, engine
from bort2 import cli as run
from bort2.config import load_config
from bort2.data.minidigits import load_minidigits

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
        f"data.root={data_root}",
        f"output_dir={out}",
        *extra,
    ]


@pytest.fixture(scope="module")
def finished(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "run"
    assert run.main(tiny(data_root, out)) == 0
    return out


# ----------------------------------------------------------------------------- settings
def test_bad_target_and_missing_checkpoint_touch_nothing(data_root, tmp_path, capsys):
    out = tmp_path / "o"
    assert run.main(tiny(data_root, out, "target=mnist")) == 2
    assert "target='mnist' is not a domain of minidigits" in capsys.readouterr().err
    assert not out.exists()  # so the corrected command is not refused as "already holds a run"
    assert run.main(tiny(data_root, out, "step1.checkpoint=/nope/final.pt")) == 2
    assert "step1.checkpoint=/nope/final.pt does not exist" in capsys.readouterr().err
    assert not out.exists()
    assert run.main(tiny(data_root, out, "step1.iters=-5")) == 2
    assert "step1.iters must be" in capsys.readouterr().err and not out.exists()


def test_read_only_output_dir_is_one_line(data_root, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores the mode bits: make the path a file instead
            ro.chmod(0o700)
            ro.rmdir()
            ro.write_text("")
        assert run.main(tiny(data_root, ro / "run")) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cannot write to output_dir=") and err.count("\n") == 1
    finally:
        if ro.is_dir():
            ro.chmod(0o700)


def test_non_finite_training_stops_the_stage_and_writes_no_row(data_root, tmp_path, capsys):
    out = tmp_path / "nan"
    assert run.main(tiny(data_root, out, "step1.lr=1e12")) == 1
    err = capsys.readouterr().err
    assert "step1/source_only [target uci_m, seed 0]: the loss is not finite at iteration" in err
    assert "step1.lr=1e+12" in err
    stage = out / "uci_m" / "seed0" / "step1_source_only"
    assert not (stage / "final.pt").exists() and not (stage / "metrics.json").exists()
    assert not (out / "results.md").exists()  # no stage finished: no table at all


# ----------------------------------------------------------------------------- provenance
def test_resume_with_other_settings_is_refused_and_keeps_the_config(finished, data_root, capsys):
    saved = (finished / "config.yaml").read_text()
    assert run.main(tiny(data_root, finished, "resume=true", "step2.iters=5")) == 2
    err = capsys.readouterr().err
    assert "step2.iters: 6 -> 5" in err and "overwrite=true" in err
    assert (finished / "config.yaml").read_text() == saved
    # the same settings resume (every stage reused), and so does a change of progress/jobs
    assert run.main(tiny(data_root, finished, "resume=true", "jobs=1", "tsne=false")) == 0


def test_stages_are_never_reused_without_resume(finished, data_root, tmp_path, capsys):
    out = tmp_path / "copy"
    import shutil

    shutil.copytree(finished, out)
    (out / "config.yaml").unlink()
    assert run.main(tiny(data_root, out)) == 2
    assert "stages of an earlier run" in capsys.readouterr().err
    # and a stage folder with leftovers is cleared, not reused, when a stage runs fresh
    stage = out / "uci_m" / "seed0" / "step1_source_only"
    cfg = load_config(None, tiny(data_root, out))
    bench = load_minidigits(data_root, progress=False)
    before = json.loads((stage / "metrics.json").read_text())
    (stage / "metrics.json").write_text(json.dumps({**before, "acc": 0.123}))
    ctx = engine.StageContext(cfg, bench, "uci_m", 0, torch.device("cpu"), stage)
    got = engine.train_step1(ctx, "source_only")
    assert got["acc"] == before["acc"] != 0.123


# ----------------------------------------------------------------------------- checkpoints
def test_corrupt_checkpoints_name_the_file_and_never_mention_weights_only(tmp_path):
    path = tmp_path / "final.pt"
    checkpoint.atomic_save({"model": {"w": torch.ones(3)}}, path)
    assert torch.equal(checkpoint.load_checkpoint(path)["model"]["w"], torch.ones(3))
    data = path.read_bytes()
    cases = {
        "truncated": data[: len(data) // 2],
        "random": os.urandom(len(data)),
        "flipped": data[:100] + bytes([data[100] ^ 1]) + data[101:],
    }
    for name, bad in cases.items():
        path.write_bytes(bad)
        with pytest.raises(checkpoint.CheckpointError) as exc:
            checkpoint.load_checkpoint(path)
        msg = str(exc.value)
        assert str(path) in msg and "weights_only" not in msg, name
    # without a checksum file the loader still names the file (user-supplied checkpoints)
    checkpoint._sidecar(path).unlink()
    path.write_bytes(cases["random"])
    with pytest.raises(checkpoint.CheckpointError, match="cannot be read") as exc:
        checkpoint.load_checkpoint(path)
    assert "weights_only" not in str(exc.value)
    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        checkpoint.load_checkpoint(tmp_path / "missing.pt")


def _interrupted_stage(data_root, tmp_path, stops):
    cfg = load_config(None, tiny(data_root, tmp_path))
    bench = load_minidigits(data_root, progress=False)
    d = tmp_path / "s"
    for i, stop in enumerate(stops):
        c = cfg if i == 0 else dataclasses.replace(cfg, resume=True)
        ctx = engine.StageContext(c, bench, "uci_m", 0, torch.device("cpu"), d, stop)
        with pytest.raises(engine.StageInterrupted):
            engine.train_step1(ctx, "source_only")
    return dataclasses.replace(cfg, resume=True), bench, d


def test_corrupt_state_falls_back_to_the_previous_one_with_the_same_result(
    finished, data_root, tmp_path
):
    cfg, bench, d = _interrupted_stage(data_root, tmp_path, [2])  # state.pt at 4, prev at 2
    assert (d / "state.pt").is_file() and (d / "state.prev.pt").is_file()
    (d / "state.pt").write_bytes(b"garbage")
    ctx = engine.StageContext(cfg, bench, "uci_m", 0, torch.device("cpu"), d)
    with pytest.warns(UserWarning, match="resuming from state.prev.pt"):
        got = engine.train_step1(ctx, "source_only")
    ref = json.loads((finished / "uci_m/seed0/step1_source_only/metrics.json").read_text())
    assert got["acc"] == ref["acc"]
    a = engine.load_checkpoint(d / "final.pt")["model"]
    b = engine.load_checkpoint(finished / "uci_m/seed0/step1_source_only/final.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    # both periodic states corrupt: nothing to resume from, so the stage starts over (a warning
    # naming both files) and computes the same numbers
    cfg, bench, d = _interrupted_stage(data_root, tmp_path / "two", [2])
    (d / "state.pt").write_bytes(b"garbage")
    (d / "state.prev.pt").write_bytes(b"")
    ctx = engine.StageContext(cfg, bench, "uci_m", 0, torch.device("cpu"), d)
    with pytest.warns(UserWarning, match="starts again from iteration 0") as rec:
        got = engine.train_step1(ctx, "source_only")
    msg = " ".join(str(w.message) for w in rec)
    assert "state.pt" in msg and "state.prev.pt" in msg
    assert got["acc"] == ref["acc"]


def test_corrupt_final_checkpoint_of_a_finished_stage_is_trained_again(finished, data_root):
    stage = finished / "uci_m" / "seed0" / "step2_naive"
    ref = json.loads((stage / "metrics.json").read_text())
    good = (stage / "final.pt").read_bytes()
    (stage / "final.pt").write_bytes(good[:-10])
    cfg = load_config(None, tiny(data_root, finished, "resume=true"))
    bench = load_minidigits(data_root, progress=False)
    ctx = engine.StageContext(cfg, bench, "uci_m", 0, torch.device("cpu"), stage)
    labeler = finished / "uci_m" / "seed0" / "step1_fixmatch_cm" / "final.pt"
    with pytest.warns(UserWarning, match="is corrupt: the stage is trained again"):
        got = engine.train_step2(ctx, "naive", labeler)
    assert got["acc"] == ref["acc"]
    assert (stage / "final.pt").read_bytes() == good


def test_disk_full_says_so_and_where(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "fsync", full)
    with pytest.raises(checkpoint.CheckpointError) as exc:
        checkpoint.atomic_save({"x": torch.ones(2)}, tmp_path / "a" / "state.pt")
    msg = str(exc.value)
    assert msg.startswith("the disk is full") and str(tmp_path / "a") in msg
    assert not list((tmp_path / "a").glob("*.tmp"))  # no half-written file left behind


# ----------------------------------------------------------------------------- parallel units
def test_failing_unit_names_itself_and_the_finished_units_keep_their_rows(
    data_root, tmp_path, capsys
):
    out = tmp_path / "par"
    args = tiny(data_root, out, "target=all", "jobs=2", "tsne=false")
    assert run.main(args) == 0
    # break one unit: a stage that must resume from a periodic state that is another file
    # (uci's final model with its sidecar, planted as syn's state.pt): refused
    bad = out / "syn" / "seed0" / "step2_bort2"
    for name in ("metrics.json", "final.pt"):
        (bad / name).unlink()
    other = out / "uci" / "seed0" / "step2_bort2"
    shutil.copy(other / "final.pt", bad / "state.pt")
    shutil.copy(other / "final.pt.sha256", bad / "state.pt.sha256")
    (out / "results.md").unlink()
    assert run.main([*args, "resume=true"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unit target=syn seed=0 failed: CheckpointError")
    assert str(bad / "state.pt") in err and err.count("\n") == 1
    rows = json.loads((out / "results.json").read_text())["results"]
    assert {r["target"] for r in rows} <= {"uci", "uci_m", "syn_m"} and rows


def test_checkpoint_of_another_network_is_one_line(finished, data_root, tmp_path, capsys):
    ck = finished / "uci_m" / "seed0" / "step1_fixmatch_cm" / "final.pt"
    args = tiny(data_root, tmp_path / "w", f"step1.checkpoint={ck}", "model.width=0.25")
    assert run.main([*args, "tsne=false"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {ck} does not fit model.arch=digit_cnn width=0.25")
    assert err.count("\n") == 1
