"""Every file a BORT² stage writes says what it is, and a file that is not what the run expects is
never used (issue 21, item 7): a step-1 model copied over another stage's, a ``state.pt`` of
another seed's run, a ``final.pt`` without its SHA-256 sidecar, a flipped byte in a tensor record,
truncated ``metrics.json`` / ``history.json``. Each case reproduces the report first."""

import dataclasses
import io
import json
import shutil
import subprocess
import sys

import pytest
import torch
from bort2 import checkpoint, engine
from bort2 import cli as run
from bort2.config import load_config
from bort2.data.minidigits import load_minidigits
from helpers import RUN_PY
from test_bort2_faults import tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def finished(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("identity") / "run"
    assert run.main(tiny(data_root, out, "tsne=false")) == 0
    return out


def _copy(finished, tmp_path, name="copy"):
    out = tmp_path / name
    shutil.copytree(finished, out)
    return out


def _rows(out):
    rows = json.loads((out / "results.json").read_text())["results"]
    return {r["stage"]: r["acc"] for r in rows}


def _resume(data_root, out, capsys):
    rc = run.main(tiny(data_root, out, "tsne=false", "resume=true"))
    return rc, capsys.readouterr().err


# ----------------------------------------------------------------------------- the record
def test_fingerprint_keeps_what_changes_a_stage_and_drops_where_it_runs(data_root, tmp_path):
    base = load_config(None, tiny(data_root, tmp_path / "a"))
    same = load_config(
        None,
        tiny(data_root, tmp_path / "b", "resume=true", "jobs=2", "tensorboard=false", "seeds=3"),
    )
    fp = checkpoint.config_fingerprint
    for stage in ("step1/fixmatch_cm", "step2/bort2"):
        assert fp(base, stage) == fp(same, stage)
        assert fp(base, stage) != fp(dataclasses.replace(base, eval_every=2), stage)
    lr = load_config(None, tiny(data_root, tmp_path / "a", "step1.lr=0.01"))
    assert fp(base, "step1/source_only") != fp(lr, "step1/source_only")
    assert fp(base, "step2/naive") != fp(lr, "step2/naive")  # step 2 starts from step 1
    # a step-1 stage does not depend on step 2's settings; step 2 does
    s2 = load_config(None, tiny(data_root, tmp_path / "a", "step2.iters=7"))
    assert fp(base, "step1/source_only") == fp(s2, "step1/source_only")
    assert fp(base, "step2/robust") != fp(s2, "step2/robust")
    # the hyper step's settings change Stage C only (only it takes hyper steps): Stages B and
    # naive copied from a run that differs there are still theirs (attribution.py relies on it)
    hyper = load_config(None, tiny(data_root, tmp_path / "a", "step2.hyper.lr=0.1"))
    assert fp(base, "step2/robust") == fp(hyper, "step2/robust")
    assert fp(base, "step2/naive") == fp(hyper, "step2/naive")
    assert fp(base, "step2/bort2") != fp(hyper, "step2/bort2")
    # Gumbel labels change Stages B and C, never the naive stage (argmax labels)
    gumbel = load_config(None, tiny(data_root, tmp_path / "a", "step2.labels=gumbel"))
    assert fp(base, "step2/naive") == fp(gumbel, "step2/naive")
    assert fp(base, "step2/robust") != fp(gumbel, "step2/robust")


def test_fingerprints_equal_those_the_pipeline_wrote_at_eb03db6():
    """Checkpoints of run folders written before the config schema version still match their
    stage: for the default configuration, every preset and one changed value of every key, each
    stage's fingerprint (now hashing the keys its ``read_by`` declarations name) equals the one
    eb03db6 computed (``golden/fingerprints_eb03db6.json``, its first 16 hex digits)."""
    from pathlib import Path

    golden = json.loads(
        (Path(__file__).parent / "golden" / "fingerprints_eb03db6.json").read_text()
    )
    assert len(golden) > 80
    for case, entry in golden.items():
        cfg = load_config(None, entry["overrides"])
        got = {s: checkpoint.config_fingerprint(cfg, s)[:16] for s in entry["fingerprints"]}
        assert got == entry["fingerprints"], case


def test_an_old_name_on_the_command_line_gives_the_same_identity():
    with pytest.warns(FutureWarning):
        old = load_config(None, ["step2.zero_hypergradient=true", "step2.neumann_steps=5"])
    new = load_config(None, ["step2.hyper.apply=false", "step2.hyper.steps=5"])
    for stage in ("step2/robust", "step2/bort2"):
        assert checkpoint.config_fingerprint(old, stage) == checkpoint.config_fingerprint(
            new, stage
        )


def test_every_checkpoint_and_history_records_its_identity(finished):
    seed_dir = finished / "uci_m" / "seed0"
    for stage in ("step1_source_only", "step1_fixmatch_cm", "step2_naive", "step2_robust"):
        name = stage.replace("_", "/", 1)
        st = checkpoint.load_checkpoint(seed_dir / stage / "final.pt")
        ident = st[checkpoint.IDENTITY_KEY]
        assert ident["stage"] == name and ident["kind"] == "final"
        assert ident["target"] == "uci_m" and ident["seed"] == 0
        hist = json.loads((seed_dir / stage / "history.json").read_text())
        assert hist[checkpoint.IDENTITY_KEY] == ident
        for f in ("final.pt", "history.json", "metrics.json"):
            assert (seed_dir / stage / f"{f}.sha256").is_file(), (stage, f)
    lab = checkpoint.load_checkpoint(seed_dir / "step2_bort2" / "labeler_final.pt")
    assert lab[checkpoint.IDENTITY_KEY]["kind"] == "labeler_final"


# ----------------------------------------------------------------------------- (a) another stage
def test_step1_model_copied_over_another_stage_is_refused(finished, data_root, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    s1 = out / "uci_m" / "seed0"
    for name in ("final.pt", "final.pt.sha256"):  # with its sidecar: the checksum still holds
        shutil.copyfile(s1 / "step1_source_only" / name, s1 / "step1_fixmatch_cm" / name)
    rc, err = _resume(data_root, out, capsys)
    assert rc == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: {s1 / 'step1_fixmatch_cm' / 'final.pt'} is not this stage's")
    assert "stage 'step1/source_only' (expected 'step1/fixmatch_cm')" in err
    # Stage B's target model over Stage C's, likewise
    out = _copy(finished, tmp_path, "copy2")
    s2 = out / "uci_m" / "seed0"
    for name in ("final.pt", "final.pt.sha256"):
        shutil.copyfile(s2 / "step2_robust" / name, s2 / "step2_bort2" / name)
    rc, err = _resume(data_root, out, capsys)
    assert rc == 1 and "stage 'step2/robust' (expected 'step2/bort2')" in err, err


def test_step2_inputs_must_be_this_units_step1_and_stage_b_models(finished, data_root):
    cfg = load_config(None, tiny(data_root, finished, "resume=true"))
    bench = load_minidigits(data_root, progress=False)
    seed_dir = finished / "uci_m" / "seed0"
    labeler = seed_dir / "step1_fixmatch_cm" / "final.pt"
    robust = seed_dir / "step2_robust" / "final.pt"
    cpu = torch.device("cpu")
    # seed 1 must not start from seed 0's models
    ctx = engine.StageContext(cfg, bench, "uci_m", 1, cpu, seed_dir.parent / "x" / "naive")
    with pytest.raises(engine.CheckpointError, match=r"seed 0 \(expected 1\)"):
        engine.train_step2(ctx, "naive", labeler)
    # Stage B's model is not a step-1 labeler, and a step-1 model is not Stage B's
    ctx = engine.StageContext(cfg, bench, "uci_m", 0, cpu, seed_dir.parent / "x" / "naive")
    with pytest.raises(engine.CheckpointError, match=r"'step2/robust' \(expected 'step1/\*'\)"):
        engine.train_step2(ctx, "naive", robust)
    ctx = engine.StageContext(cfg, bench, "uci_m", 0, cpu, seed_dir.parent / "x" / "bort2")
    with pytest.raises(engine.CheckpointError, match=r"expected 'step2/robust'"):
        engine.train_step2(ctx, "bort2", labeler, labeler)
    # another run's settings (the labeler was trained with step1.lr=0.05, not 0.01)
    other = load_config(None, tiny(data_root, finished, "resume=true", "step1.lr=0.01"))
    ctx = engine.StageContext(other, bench, "uci_m", 0, cpu, seed_dir.parent / "x" / "naive")
    with pytest.raises(engine.CheckpointError, match="written with other settings"):
        engine.train_step2(ctx, "naive", labeler)


# ----------------------------------------------------------------------------- (b) another seed
def _killed_state(data_root, tmp_path, seed, *extra):
    """A step-1 FixMatch-CM stage of ``seed`` killed after its first periodic state."""
    cfg = load_config(None, tiny(data_root, tmp_path / "other", *extra))
    bench = load_minidigits(data_root, progress=False)
    d = tmp_path / f"killed_s{seed}"
    ctx = engine.StageContext(cfg, bench, "uci_m", seed, torch.device("cpu"), d, 1)
    with pytest.raises(engine.StageInterrupted):
        engine.train_step1(ctx, "fixmatch_cm")
    return d


def _plant_state(out, killed):
    stage = out / "uci_m" / "seed0" / "step1_fixmatch_cm"
    for name in ("final.pt", "metrics.json", "history.json"):  # the stage was killed...
        (stage / name).unlink()
        (stage / f"{name}.sha256").unlink(missing_ok=True)
    for name in ("state.pt", "state.pt.sha256"):  # ... and another run's state put there
        shutil.copyfile(killed / name, stage / name)
    return stage


def test_state_of_another_seeds_run_is_refused(finished, data_root, tmp_path, capsys):
    ref = _rows(finished)
    out = _plant_state(_copy(finished, tmp_path), _killed_state(data_root, tmp_path, 1)).parents[2]
    rc, err = _resume(data_root, out, capsys)
    assert rc == 1 and err.count("\n") == 1, err
    assert "state.pt is not this stage's file: seed 1 (expected 0)" in err
    # another run's settings, same seed: refused too
    out = _copy(finished, tmp_path, "copy2")
    _plant_state(out, _killed_state(data_root, tmp_path / "lr", 0, "step1.lr=0.01"))
    rc, err = _resume(data_root, out, capsys)
    assert rc == 1 and "written with other settings" in err, err
    # the same seed and settings in another folder is the same computation: it resumes
    out = _copy(finished, tmp_path, "copy3")
    _plant_state(out, _killed_state(data_root, tmp_path / "same", 0))
    rc, err = _resume(data_root, out, capsys)
    assert rc == 0, err
    assert _rows(out) == ref


def test_a_state_without_sidecar_is_not_trusted(data_root, tmp_path):
    """A crash between ``state.pt`` and its sidecar leaves it unverifiable: never loaded (the
    older ``state.prev.pt`` would be used; here there is none, so the stage starts over with a
    warning naming the file: a resume point lost, never a wrong one used)."""
    d = _killed_state(data_root, tmp_path, 0)
    cfg = load_config(None, tiny(data_root, tmp_path / "other", "resume=true"))
    bench = load_minidigits(data_root, progress=False)
    (d / "state.pt.sha256").unlink()
    ctx = engine.StageContext(cfg, bench, "uci_m", 0, torch.device("cpu"), d)
    with pytest.warns(UserWarning, match="has no SHA-256 sidecar.*starts again from iteration 0"):
        engine.train_step1(ctx, "fixmatch_cm")  # no state.prev.pt to fall back to


# ----------------------------------------------------------------------------- (c), (d) final.pt
def _flip_in_tensor(path):
    """Flip one byte inside the largest tensor record of a checkpoint; returns the new bytes."""
    data = path.read_bytes()
    st = torch.load(io.BytesIO(data), weights_only=True)
    w = max(st["model"].values(), key=lambda t: t.numel())
    raw = w.contiguous().numpy().tobytes()
    at = data.index(raw) + len(raw) // 2
    bad = data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]
    # torch itself loads it without complaint: only the sidecar can tell
    st2 = torch.load(io.BytesIO(bad), weights_only=True)
    assert any(not torch.equal(st["model"][k], st2["model"][k]) for k in st["model"])
    return bad


def test_final_without_sidecar_is_an_error(finished, data_root, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    final = out / "uci_m" / "seed0" / "step2_bort2" / "final.pt"
    final.write_bytes(_flip_in_tensor(final))
    (out / "uci_m" / "seed0" / "step2_bort2" / "final.pt.sha256").unlink()
    rc, err = _resume(data_root, out, capsys)
    assert rc == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: {final} has no SHA-256 sidecar (final.pt.sha256)")


def test_flipped_byte_in_a_tensor_record_is_caught(finished, data_root, tmp_path, capsys):
    ref = _rows(finished)
    out = _copy(finished, tmp_path)
    final = out / "uci_m" / "seed0" / "step2_bort2" / "final.pt"
    good = final.read_bytes()
    final.write_bytes(_flip_in_tensor(final))
    with pytest.raises(engine.CheckpointError, match="SHA-256 does not match"):
        checkpoint.load_checkpoint(final)
    with pytest.warns(UserWarning, match="final.pt is corrupt: the stage is trained again"):
        rc, err = _resume(data_root, out, capsys)
    assert rc == 0, err
    assert _rows(out) == ref and final.read_bytes() == good


# ----------------------------------------------------------------------------- (e) JSON files
def test_truncated_metrics_and_history_are_trained_again_without_a_traceback(
    finished, data_root, tmp_path
):
    ref = _rows(finished)
    out = _copy(finished, tmp_path)
    seed_dir = out / "uci_m" / "seed0"
    for stage, name in (("step2_naive", "metrics.json"), ("step2_robust", "history.json")):
        p = seed_dir / stage / name
        p.write_bytes(p.read_bytes()[:40])
    args = [a for a in tiny(data_root, out, "tsne=false", "resume=true")]
    proc = subprocess.run(
        [sys.executable, str(RUN_PY), *args], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "JSONDecodeError" not in proc.stderr
    for stage, name in (("step2_naive", "metrics.json"), ("step2_robust", "history.json")):
        msg = f"{seed_dir / stage / name} is corrupt: the stage is trained again"
        assert msg in proc.stderr, proc.stderr
    assert _rows(out) == ref


def test_json_files_are_verified_with_one_line_errors(tmp_path):
    p = tmp_path / "metrics.json"
    checkpoint.atomic_write_text(json.dumps({"acc": 0.5}), p, sidecar=True)
    assert checkpoint.read_json(p) == {"acc": 0.5}
    p.write_text('{"acc": 0.')
    with pytest.raises(checkpoint.CorruptCheckpoint, match="SHA-256 does not match"):
        checkpoint.read_json(p)
    checkpoint._sidecar(p).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="has no SHA-256 sidecar"):
        checkpoint.read_json(p)
    with pytest.raises(checkpoint.CorruptCheckpoint, match="not valid JSON") as exc:
        checkpoint.read_json(p, strict=False)
    assert "\n" not in str(exc.value)
