"""Tests of the BORT² pipeline (examples/bort2): configuration, the end-to-end ``preset=smoke``
run, exact resume of killed stages, and that target ground truth never reaches training."""

import dataclasses
import importlib.util
import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from bort2 import cli as run
from bort2 import engine
from bort2.config import CONFIG_DIR, VALID_KEYS, Config, ConfigError, load_config
from bort2.data.base import ArrayDomain, Benchmark
from bort2.data.minidigits import load_minidigits
from bort2.data.transforms import normalize, to_float
from helpers import ROOT, RUN_PY
from omegaconf import OmegaConf

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- config
def test_unknown_key_suggests_the_closest_one():
    """A misspelled key names the closest key, not all of them."""
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["step2.iterz=5"])
    msg = str(exc.value)
    assert "step2.iterz" in msg and "did you mean step2.iters?" in msg
    assert "step1.methods" not in msg and "--help" in msg
    assert set(VALID_KEYS) >= {"step2.threshold", "step2.hyper.lr", "resume", "model.width"}


def test_unknown_key_in_a_config_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  depth: 3\n")
    with pytest.raises(ConfigError, match="valid keys of model: model.arch, model.width"):
        load_config(path)


@pytest.mark.parametrize(
    "override,choices",
    [
        ("step2.threshold=foo", ["fixed", "adaptive", "per_class"]),
        ("step2.outer=test", ["train", "val"]),
        ("step1.labeler=nope", ["source_only", "fixmatch", "fixmatch_cm", "dann", "m3sda"]),
        ("data.benchmark=mnist", ["minidigits", "digit5", "pacs", "domainnet"]),
        ("data.views=paper", ["official", "legacy"]),
        ("model.sigma_head=conv", ["official", "linear"]),
        ("step1.cm_variant=plain", ["official", "mixed"]),
        ("step2.labels=soft", ["argmax", "gumbel"]),
        ("step2.bort2_init=scratch", ["robust", "step1"]),
        ("step2.hyper.convention=auxilearn", ["official", "library"]),
        ("step2.hyper.labeler_mode=frozen", ["train", "eval"]),
    ],
)
def test_bad_choice_lists_choices(override, choices):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    msg = str(exc.value)
    assert override.split("=")[0] in msg
    assert all(c in msg for c in choices)


def test_bad_method_name_and_bad_types():
    with pytest.raises(ConfigError, match="naive, robust, bort2"):
        load_config(None, ["step2.methods=[naive,bort3]"])
    with pytest.raises(ConfigError):
        load_config(None, ["step2.iters=many"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["step2.iters"])
    with pytest.raises(ConfigError, match="checkpoint_every"):
        load_config(None, ["checkpoint_every=0"])


def _leaves(node, prefix=""):
    """Dotted ``key -> value`` of every leaf of a YAML mapping."""
    out = {}
    for k, v in node.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _get(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _yaml(path):
    return _leaves(OmegaConf.to_container(OmegaConf.load(path)))


def test_presets_and_override_precedence(tmp_path):
    schema = Config()
    default_file = _yaml(CONFIG_DIR / "minidigits.yaml")
    smoke_file = _yaml(CONFIG_DIR / "presets" / "smoke.yaml")
    base = load_config()
    for key, value in default_file.items():  # the embedded default file applies
        assert _get(base, key) == value, key
    assert base.step1.iters == schema.step1.iters and base.preset is None
    smoke = load_config(None, ["preset=smoke"])
    assert smoke.preset == "smoke"
    assert len(smoke_file) >= 5
    for key, value in smoke_file.items():  # every key of the preset applies
        assert _get(smoke, key) == value, key
    for key, value in default_file.items():  # keys the preset does not set keep the file's
        if key not in smoke_file:
            assert _get(smoke, key) == value, key
    # the command line beats the preset, whatever their order on the command line
    for argv in (["preset=smoke", "step2.iters=7"], ["step2.iters=7", "preset=smoke"]):
        cfg = load_config(None, argv)
        assert cfg.step2.iters == 7 and cfg.step1.iters == smoke_file["step1.iters"]
    # schema < config file < preset < command line; a preset named inside the file applies too
    path = tmp_path / "mine.yaml"
    path.write_text("target: syn\nstep2:\n  iters: 11\n  warmup: 3\nmodel:\n  width: 0.5\n")
    cfg = load_config(path)
    assert (cfg.target, cfg.step2.iters, cfg.step2.warmup, cfg.model.width) == ("syn", 11, 3, 0.5)
    assert cfg.step1.iters == schema.step1.iters and cfg.step2.lr == schema.step2.lr
    cfg = load_config(path, ["preset=smoke"])
    assert cfg.target == "syn"  # not in the preset
    assert (cfg.step2.iters, cfg.step2.hyper.every, cfg.step2.warmup) == (
        smoke_file["step2.iters"],
        smoke_file["step2.hyper.every"],
        3,  # the preset does not set it: the file's value stays
    )
    assert cfg.model.width == smoke_file["model.width"]
    cfg = load_config(path, ["preset=smoke", "model.width=0.75", "target=syn_m"])
    assert (cfg.model.width, cfg.target) == (0.75, "syn_m")
    path.write_text("preset: smoke\nstep2:\n  iters: 11\n")
    assert load_config(path).step2.iters == smoke_file["step2.iters"]
    assert load_config(path, ["step2.iters=5"]).step2.iters == 5


@pytest.mark.parametrize(
    "override,words",
    [
        ("step2.teacher_ema=1.0", ["step2.teacher_ema", "[0, 1)"]),
        ("step2.teacher_ema=-0.1", ["step2.teacher_ema", "[0, 1)"]),
        ("step2.lr=0", ["step2.lr", "(0, inf)"]),
        ("step2.hyper.lr=-1", ["step2.hyper.lr", "(0, inf)"]),
        ("step2.hyper.alpha=inf", ["step2.hyper.alpha", "finite"]),
        ("step2.warmup=-3", ["step2.warmup", "[0, inf)"]),
        ("step2.hyper.steps=-1", ["step2.hyper.steps", "[0, inf)"]),
        ("step1.iters=-5", ["step1.iters", "[1, inf)"]),
        ("step2.iters=0", ["step2.iters", "[1, inf)"]),
        ("step1.lr=nan", ["step1.lr", "finite"]),
        ("model.mixstyle_p=1.5", ["model.mixstyle_p", "[0, 1]"]),
        ("step1.threshold=2", ["step1.threshold", "[0, 1]"]),
        ("data.max_test=-1", ["data.max_test"]),
        ("step2.hyper.official_sign=maybe", ["official_sign"]),
        ("step2.hyper.outer_relu=sometimes", ["outer_relu", "bool"]),
    ],
)
def test_bad_numbers_and_flags_are_refused(override, words):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    assert all(w in str(exc.value) for w in words), str(exc.value)


def test_authors_defaults_and_derived_settings():
    from bort2.config import first_hyper_step, step2_lr
    from bort2.runner import step2_order

    cfg = load_config(None, [])
    s2 = cfg.step2
    assert (s2.labels, s2.teacher_ema, s2.bort2_init, s2.hyper.convention) == (
        "argmax",
        0.999,
        "robust",
        "official",
    )
    assert (s2.hyper.official_sign, s2.hyper.outer_relu, s2.hyper.labeler_mode, s2.nesterov) == (
        False,
        True,
        "train",
        False,
    )
    assert (cfg.model.sigma_head, cfg.step1.cm_variant, cfg.data.views) == ("official",) * 3
    # stage lengths in the authors' digits ratio A 30 : B 20 : C 20 epochs
    assert cfg.step1.iters * 20 == s2.iters * 30
    assert step2_lr(cfg) == pytest.approx(0.1 * cfg.step1.lr)  # lr_mult = 0.1
    assert step2_lr(load_config(None, ["step2.lr=0.02"])) == 0.02
    assert first_hyper_step(cfg) == 0  # hyper steps from the start of Stage C
    assert first_hyper_step(load_config(None, ["step2.bort2_init=step1"])) == s2.iters // 4
    assert first_hyper_step(load_config(None, ["step2.warmup=7"])) == 7
    # BORT2 from Stage B trains Stage B first even when it is not asked for
    assert step2_order(load_config(None, ["step2.methods=[bort2,naive]"])) == [
        "naive",
        "robust",
        "bort2",
    ]
    assert step2_order(load_config(None, ["step2.methods=[bort2]", "step2.bort2_init=step1"])) == [
        "bort2"
    ]


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["preset=nope"])
    msg = str(exc.value)
    presets = sorted(p.stem for p in (CONFIG_DIR / "presets").glob("*.yaml"))
    assert "nope" in msg and {"smoke", "full"} <= set(presets)
    assert all(p in msg for p in presets)


def test_main_reports_config_errors_with_exit_code_2(tmp_path, capsys):
    rc = run.main([f"output_dir={tmp_path / 'o'}", "step2.threshold=foo"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "fixed, adaptive, per_class" in err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- data + smoke
def smoke_args(data_root, out, *extra):
    return [
        "preset=smoke",
        "step1.iters=12",
        "step2.iters=12",
        "checkpoint_every=4",
        "eval_every=4",
        "step2.warmup=2",
        "step2.hyper.every=4",
        "data.max_test=64",
        "progress=false",
        "threads=1",
        f"data.root={data_root}",
        f"output_dir={out}",
        *extra,
    ]


@pytest.fixture(scope="module")
def smoke_run(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "run"
    torch.set_num_threads(1)
    rc = run.main(smoke_args(data_root, out))
    return rc, out


@pytest.fixture(scope="module")
def bench(data_root, smoke_run):
    return load_minidigits(data_root, seed=0, progress=False)


STAGES = ["step1/source_only", "step1/fixmatch_cm", "step2/naive", "step2/robust", "step2/bort2"]


def test_smoke_end_to_end_writes_results_and_figures(smoke_run, bench):
    rc, out = smoke_run
    assert rc == 0
    payload = json.loads((out / "results.json").read_text())
    rows = payload["results"]
    assert sorted(r["stage"] for r in rows) == sorted(STAGES)  # one row per method
    for r in rows:
        assert r["target"] == "uci_m" and r["seed"] == 0 and r["n"] == 64
        assert 0.0 <= r["acc"] <= 1.0
        assert 0.0 <= r["ci_low"] <= r["acc"] <= r["ci_high"] <= 1.0
        assert r["acc"] * 64 == pytest.approx(round(r["acc"] * 64), abs=1e-9)  # k / n
        assert payload["summary"][r["stage"]]["uci_m"]["mean"] == pytest.approx(100 * r["acc"])
        if r["stage"].startswith("step2"):
            assert 0.0 <= r["labeler_acc"] <= 1.0
    md = (out / "results.md").read_text()
    for name in ["Source-only", "FixMatch-CM", "Naive two-step", "BORT² w/o bi-level", "BORT²"]:
        assert sum(line.startswith(f"| {name} |") for line in md.splitlines()) == 1
    fig = out / "figures" / "mechanism_uci_m_s0.png"
    assert fig.is_file() and fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    seed_dir = out / "uci_m" / "seed0"
    for stage in STAGES:
        d = seed_dir / stage.replace("/", "_")
        assert (d / "final.pt").is_file() and (d / "metrics.json").is_file()
        assert not (d / "state.pt").exists()
    # hyper steps at iterations 2, 6, 10 (warm-up 2, every 4) of BORT² only
    by_stage = {r["stage"]: r for r in rows}
    assert by_stage["step2/bort2"]["hyper_steps"] == 3
    assert by_stage["step2/robust"]["hyper_steps"] == 0
    hist = json.loads((seed_dir / "step2_bort2" / "history.json").read_text())["history"]
    assert [s for s, _ in hist["hypergrad_norm"]] == [2, 6, 10]
    assert (seed_dir / "step2_bort2" / "labeler_final.pt").is_file()
    # the reported accuracy is the eval-mode accuracy of final.pt on the first 64 test images
    cfg = load_config(None, smoke_args("x", out))
    model = engine.load_labeler(cfg, seed_dir / "step1_source_only" / "final.pt", 10, "source_only")
    model.eval()
    test = bench.split("uci_m", "test")
    x = normalize(to_float(test.images[:64]), (0.5,) * 3, (0.5,) * 3)
    with torch.no_grad():
        correct = int((model(x).argmax(1) == test.labels[:64]).sum())
    assert by_stage["step1/source_only"]["acc"] == correct / 64


def test_mechanism_summary_matches_the_logged_history(smoke_run):
    _, out = smoke_run
    rows = {r["variant"]: r for r in json.loads((out / "mechanism.json").read_text())}
    assert set(rows) == {"robust", "bort2"}
    hist = json.loads((out / "uci_m" / "seed0" / "step2_bort2" / "history.json").read_text())
    h = hist["history"]
    for key in ("sigma_correct", "sigma_wrong"):
        vals = [v for _, v in h[key]]
        tail = vals[-max(1, round(0.25 * len(vals))) :]
        assert rows["bort2"][key] == pytest.approx(sum(tail) / len(tail), rel=1e-12)
    norms = sorted(v for _, v in h["hypergrad_norm"])
    assert rows["bort2"]["hypergrad_norm_median"] == pytest.approx(norms[len(norms) // 2])
    assert rows["bort2"]["hyper_steps"] == 3 and rows["robust"]["hypergrad_norm_median"] is None
    md = (out / "mechanism.md").read_text()
    assert "| uci_m | 0 | bort2 |" in md and "wrong > correct in" in md


@pytest.mark.slow
def test_parallel_jobs_equal_the_serial_run(smoke_run, data_root, tmp_path):
    """jobs=2 trains the four leave-one-out units in worker processes; each unit's numbers are
    those of the same unit run serially (the uci_m unit of the smoke run)."""
    out = tmp_path / "par"
    assert run.main(smoke_args(data_root, out, "target=all", "jobs=2", "tsne=false")) == 0
    rows = json.loads((out / "results.json").read_text())["results"]
    assert [r["target"] for r in rows] == [
        t for t in ("uci", "uci_m", "syn", "syn_m") for _ in STAGES
    ]
    serial = json.loads((smoke_run[1] / "results.json").read_text())["results"]
    par = {r["stage"]: r for r in rows if r["target"] == "uci_m"}
    for r in serial:
        assert par[r["stage"]]["acc"] == r["acc"], r["stage"]
        if r["stage"] == "step2/bort2":
            assert par[r["stage"]]["labeler_acc"] == r["labeler_acc"]
    md = (out / "results.md").read_text()
    assert "| method | uci | uci_m | syn | syn_m | avg |" in md


def test_existing_output_dir_needs_resume_or_overwrite(smoke_run, data_root, capsys):
    rc, out = smoke_run
    before = (out / "results.json").read_bytes()
    assert run.main(smoke_args(data_root, out)) == 2
    err = capsys.readouterr().err
    assert "resume=true" in err and str(out) in err
    assert (out / "results.json").read_bytes() == before


def test_overwrite_deletes_the_previous_run(tmp_path):
    out = tmp_path / "o"
    cfg = load_config(None, [f"output_dir={out}"])
    run.prepare_output(cfg)
    stage = out / "uci_m" / "seed0" / "step1_source_only"
    engine.atomic_write_text("{}", stage / "metrics.json", sidecar=True)  # recorded, as written
    (out / "junk.txt").write_text("old")
    with pytest.raises(ConfigError, match="resume=true"):
        run.prepare_output(cfg)
    run.prepare_output(dataclasses.replace(cfg, resume=True))
    assert (out / "junk.txt").exists()  # resume keeps the folder
    # overwrite deletes only what the pipeline wrote: a file it did not write is refused
    with pytest.raises(ConfigError, match="junk.txt"):
        run.prepare_output(dataclasses.replace(cfg, overwrite=True))
    assert (out / "junk.txt").exists() and (stage / "metrics.json").exists()
    (out / "junk.txt").unlink()
    (stage / "notes.json").write_text("{}")  # a file of a pipeline-like name, not recorded
    with pytest.raises(ConfigError, match="notes.json"):
        run.prepare_output(dataclasses.replace(cfg, overwrite=True))
    (stage / "notes.json").unlink()
    run.prepare_output(dataclasses.replace(cfg, overwrite=True))
    assert not (out / "uci_m").exists() and (out / "config.yaml").is_file()


# ----------------------------------------------------------------------------- resume
def _assert_same_state(path_a, path_b):
    a = engine.load_checkpoint(path_a)["model"]
    b = engine.load_checkpoint(path_b)["model"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _history(stage_dir):
    hist = json.loads((stage_dir / "history.json").read_text())["history"]
    return {k: v for k, v in hist.items() if "time" not in k}


def _stage(cfg, bench, stage_dir, stop=0):
    return engine.StageContext(
        cfg, bench, "uci_m", 0, torch.device("cpu"), stage_dir, stop_after_checkpoints=stop
    )


def _run_interrupted(fn, cfg, bench, stage_dir, stops, *args):
    """Run a stage, interrupting it after each number of checkpoints in ``stops``."""
    for i, stop in enumerate(stops):
        c = cfg if i == 0 else dataclasses.replace(cfg, resume=True)
        with pytest.raises(engine.StageInterrupted):
            fn(_stage(c, bench, stage_dir, stop), *args)
        assert (stage_dir / "state.pt").is_file() and not (stage_dir / "final.pt").exists()
    return fn(_stage(dataclasses.replace(cfg, resume=True), bench, stage_dir), *args)


@pytest.mark.parametrize("variant", ["naive", "robust", "bort2"])
def test_step2_resume_equals_uninterrupted(smoke_run, data_root, bench, tmp_path, variant):
    """Every step-2 stage (naive, Stage B with its EMA labeler, Stage C started from Stage B)
    killed twice and resumed ends with the uninterrupted stage's weights and history."""
    _, out = smoke_run
    cfg = load_config(None, smoke_args(data_root, tmp_path))
    seed_dir = out / "uci_m" / "seed0"
    labeler = seed_dir / "step1_fixmatch_cm" / "final.pt"
    robust = seed_dir / "step2_robust" / "final.pt"
    ref_dir, res_dir = tmp_path / "ref", tmp_path / "resumed"
    args = (variant, labeler, robust)
    ref = engine.train_step2(_stage(cfg, bench, ref_dir), *args)
    # interrupted after the checkpoint at iteration 4 (one hyper step done), then at 8
    got = _run_interrupted(engine.train_step2, cfg, bench, res_dir, [1, 1], *args)
    assert not (res_dir / "state.pt").exists()
    for key in ("acc", "best_acc", "labeler_acc", "n", "ci_low", "ci_high", "iters"):
        assert got[key] == ref[key], key
    _assert_same_state(res_dir / "final.pt", ref_dir / "final.pt")
    assert _history(res_dir) == _history(ref_dir)
    # and the whole in-process pipeline ran the same stage to the same weights
    _assert_same_state(ref_dir / "final.pt", seed_dir / f"step2_{variant}" / "final.pt")
    if variant == "naive":
        return
    # the labeler moved: Stage B's EMA of M_psi, Stage C's hyper steps (here the outer loss is
    # zero under the ReLU, but F_theta's train-mode hyper-step passes re-estimate its BatchNorm)
    final = engine.load_checkpoint(ref_dir / "final.pt")
    a = final["labeler"]
    b = engine.load_checkpoint(labeler if variant == "robust" else robust)
    b = b["model"] if variant == "robust" else b["classifier"]
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], b[k]) for k in a)
    if variant == "bort2":
        _assert_same_state(res_dir / "labeler_final.pt", ref_dir / "labeler_final.pt")


def test_step2_resume_reports_all_hyper_steps(smoke_run, data_root, bench, tmp_path):
    """metrics.json of a resumed stage must describe the whole stage, like ``iters`` does."""
    _, out = smoke_run
    cfg = load_config(None, smoke_args(data_root, tmp_path))
    seed_dir = out / "uci_m" / "seed0"
    args = (
        "bort2",
        seed_dir / "step1_fixmatch_cm" / "final.pt",
        seed_dir / "step2_robust" / "final.pt",
    )
    got = _run_interrupted(engine.train_step2, cfg, bench, tmp_path / "s", [2], *args)
    assert got["iters"] == 12
    assert got["hyper_steps"] == 3  # iterations 2, 6 and 10
    assert 0 <= got["hyper_zero_outer_steps"] <= 3


def test_step1_resume_equals_uninterrupted(smoke_run, data_root, bench, tmp_path):
    _, out = smoke_run
    cfg = load_config(None, smoke_args(data_root, tmp_path))
    res_dir = tmp_path / "resumed"
    got = _run_interrupted(engine.train_step1, cfg, bench, res_dir, [1], "fixmatch_cm")
    ref_dir = out / "uci_m" / "seed0" / "step1_fixmatch_cm"  # the uninterrupted smoke stage
    ref = json.loads((ref_dir / "metrics.json").read_text())
    for key in ("acc", "n", "ci_low", "ci_high", "iters"):
        assert got[key] == ref[key], key
    _assert_same_state(res_dir / "final.pt", ref_dir / "final.pt")
    assert _history(res_dir) == _history(ref_dir)


def test_resume_false_restarts_a_stage_from_scratch(smoke_run, data_root, bench, tmp_path):
    """Without resume=true a leftover state.pt is ignored: same result as a fresh run."""
    _, out = smoke_run
    cfg = load_config(None, smoke_args(data_root, tmp_path))
    d = tmp_path / "s"
    with pytest.raises(engine.StageInterrupted):
        engine.train_step1(_stage(cfg, bench, d, 2), "source_only")
    engine.train_step1(_stage(cfg, bench, d), "source_only")
    _assert_same_state(d / "final.pt", out / "uci_m" / "seed0" / "step1_source_only" / "final.pt")


def test_subprocess_killed_and_resumed_equals_uninterrupted(smoke_run, data_root, tmp_path):
    """``run.py`` SIGKILLed inside the BORT² stage, rerun with resume=true: same table and
    weights as the uninterrupted in-process smoke run (same thread count)."""
    _, ref_out = smoke_run
    out = tmp_path / "killed"
    args = [sys.executable, str(RUN_PY), *smoke_args(data_root, out)]
    state = out / "uci_m" / "seed0" / "step2_bort2" / "state.pt"
    log = tmp_path / "first.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT)
        seen = False
        deadline = time.monotonic() + 300
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if state.exists():
                    proc.send_signal(signal.SIGKILL)
                    seen = True
                    break
                time.sleep(0.01)
        finally:
            if proc.poll() is None and not seen:
                proc.kill()
            proc.wait()
    assert seen, f"no {state} was seen; output:\n{log.read_text()[-2000:]}"
    assert proc.returncode == -signal.SIGKILL
    bort2_dir = state.parent
    assert not (bort2_dir / "final.pt").exists()
    assert (out / "uci_m" / "seed0" / "step2_robust" / "final.pt").is_file()
    done = subprocess.run([*args, "resume=true"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads((out / "results.json").read_text())["results"]
    ref = json.loads((ref_out / "results.json").read_text())["results"]
    assert [(r["stage"], r["acc"], r["n"]) for r in got] == [
        (r["stage"], r["acc"], r["n"]) for r in ref
    ]
    for name in ("final.pt", "labeler_final.pt"):
        _assert_same_state(bort2_dir / name, ref_out / "uci_m" / "seed0" / "step2_bort2" / name)
    assert _history(bort2_dir) == _history(ref_out / "uci_m" / "seed0" / "step2_bort2")
    assert (out / "figures" / "mechanism_uci_m_s0.png").is_file()


# ----------------------------------------------------------------------------- ground truth
COLORS = torch.tensor([[220, 40, 40], [40, 220, 40], [40, 40, 220], [200, 200, 60]])


def _synthetic_bench(seed=0, n_train=48, n_test=16, size=16, k=4, images=None, labels=None):
    """Three domains of noisy class-coloured squares (domain ``t`` darker), 4 classes."""
    g = torch.Generator().manual_seed(seed)
    splits = {}
    for di, d in enumerate(("a", "b", "t")):
        splits[d] = {}
        for split, n in (("train", n_train), ("test", n_test)):
            y = torch.randint(0, k, (n,), generator=g)
            noise = torch.randint(-60, 60, (n, 3, size, size), generator=g)
            x = (COLORS[y].view(n, 3, 1, 1) * (1.0 - 0.2 * di) + noise).clamp(0, 255)
            x = x.to(torch.uint8)
            if d == "t" and split == "train":
                x = x if images is None else images
                y = y if labels is None else labels
            splits[d][split] = ArrayDomain(x, y)
    return Benchmark("synthetic", k, size, splits)


@pytest.fixture(scope="module")
def synthetic_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("synthetic")
    cfg = load_config(
        None,
        [
            "model.width=0.125",
            "data.image_size=16",
            "step1.iters=15",
            "step1.batch_per_domain=16",
            "step1.target_batch=16",
            "step2.iters=10",  # the analysis logs come every 10 iterations
            "step2.batch_size=16",
            "step2.warmup=2",
            "step2.hyper.every=3",
            "step2.hyper.lr=0.5",  # big enough that the labeler really moves
            "checkpoint_every=100",
            "eval_every=4",
            "progress=false",
            "tensorboard=false",
            f"output_dir={tmp}",
        ],
    )
    # a step-1 labeler trained on the labelled sources only
    ctx = engine.StageContext(cfg, _synthetic_bench(), "t", 0, torch.device("cpu"), tmp / "s1")
    engine.train_step1(ctx, "source_only")
    return cfg, tmp / "s1" / "final.pt", tmp


def _step2_on(cfg, bench, run_dir, labeler):
    """Stage B (EMA labeler) then Stage C started from it; returns Stage C's metrics."""
    cpu = torch.device("cpu")
    ctx = engine.StageContext(cfg, bench, "t", 0, cpu, run_dir / "robust")
    engine.train_step2(ctx, "robust", labeler)
    ctx = engine.StageContext(cfg, bench, "t", 0, cpu, run_dir / "bort2")
    return engine.train_step2(ctx, "bort2", labeler, run_dir / "robust" / "final.pt")


@pytest.mark.parametrize("outer", ["train", "val"])
def test_target_ground_truth_is_never_used_for_training(synthetic_setup, outer):
    cfg, labeler, tmp = synthetic_setup
    cfg = dataclasses.replace(cfg, step2=dataclasses.replace(cfg.step2, outer=outer))
    bench = _synthetic_bench()
    y = bench.split("t", "train").labels
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))
    shift = torch.randint(1, 4, y.shape, generator=torch.Generator().manual_seed(2))
    y_perm = (y[perm] + shift) % 4  # shuffled, then shifted so that every label changes
    y_perm = torch.where(y_perm == y, (y + 1) % 4, y_perm)
    assert (y_perm != y).all()
    permuted = _synthetic_bench(labels=y_perm)
    a = _step2_on(cfg, bench, tmp / f"orig_{outer}", labeler)
    b = _step2_on(cfg, permuted, tmp / f"perm_{outer}", labeler)
    assert a["hyper_steps"] == b["hyper_steps"] > 0
    for name in ("robust/final.pt", "bort2/final.pt", "bort2/labeler_final.pt"):
        _assert_same_state(tmp / f"orig_{outer}" / name, tmp / f"perm_{outer}" / name)
    assert a["acc"] == b["acc"] and a["labeler_acc"] == b["labeler_acc"]
    # the labels did reach the analysis logs (so the permutation was seen) ...
    for stage in ("robust", "bort2"):
        ha = _history(tmp / f"orig_{outer}" / stage)
        hb = _history(tmp / f"perm_{outer}" / stage)
        assert ha["pseudo_acc"] != hb["pseudo_acc"]
        assert ha["loss"] == hb["loss"]
    # ... and the training does depend on the target images (the comparison can fail)
    other_images = bench.split("t", "train").images.flip(0)
    c_dir = tmp / f"images_{outer}"
    _step2_on(cfg, _synthetic_bench(images=other_images), c_dir, labeler)
    sa = engine.load_checkpoint(tmp / f"orig_{outer}" / "bort2" / "final.pt")["model"]
    sc = engine.load_checkpoint(c_dir / "bort2" / "final.pt")["model"]
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_attribution_flips_one_switch_and_reuses_the_rest(smoke_run, data_root, tmp_path):
    """examples/bort2/attribution.py: unaffected stages are the faithful run's (copied), the
    affected stage is retrained with the flipped switch, and the summary is their difference."""
    spec = importlib.util.spec_from_file_location(
        "bort2_attribution", ROOT / "examples" / "bort2" / "attribution.py"
    )
    attribution = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(attribution)
    _, faithful = smoke_run
    settings = [a for a in smoke_args(data_root, "x") if not a.startswith(("output_dir", "preset"))]
    out = tmp_path / "attr"
    argv = ["--faithful", str(faithful), "--out", str(out), "--targets", "uci_m", "--seeds", "0"]
    argv += ["--jobs", "1", "--preset", "smoke", "--only", "outer_relu", "--set", *settings]
    assert attribution.main(argv) == 0
    run_dir, ref_dir = out / "outer_relu" / "uci_m" / "seed0", faithful / "uci_m" / "seed0"
    for stage in ("step1_fixmatch_cm", "step2_robust"):  # reused as they were
        _assert_same_state(run_dir / stage / "final.pt", ref_dir / stage / "final.pt")
    assert "outer_relu: false" in (out / "outer_relu" / "config.yaml").read_text()
    m = json.loads((run_dir / "step2_bort2" / "metrics.json").read_text())
    ref = json.loads((ref_dir / "step2_bort2" / "metrics.json").read_text())
    assert m["hyper_zero_outer_steps"] == 0 < ref["hyper_zero_outer_steps"]
    summary = json.loads((out / "attribution.json").read_text())
    row = summary["outer_relu"]["rows"]["step2/bort2"]
    assert row["diffs"] == [pytest.approx(100 * (m["acc"] - ref["acc"]))]
    assert "`outer_relu`" in (out / "attribution.md").read_text()


def test_paired_differences_by_hand():
    from bort2.report import paired_differences, paired_markdown

    acc = {  # (stage, target, seed) -> accuracy
        ("step2/robust", "a", 0): 0.50,
        ("step2/robust", "a", 1): 0.60,
        ("step2/robust", "b", 0): 0.70,
        ("step2/bort2", "a", 0): 0.53,
        ("step2/bort2", "a", 1): 0.58,
        ("step2/bort2", "b", 0): 0.70,
        ("step2/bort2", "c", 0): 0.90,  # unpaired: ignored
    }
    rows = [{"stage": k[0], "target": k[1], "seed": k[2], "acc": v} for k, v in acc.items()]
    (r,) = paired_differences(rows)
    d = [3.0, -2.0, 0.0]
    mean = sum(d) / 3
    std = (sum((x - mean) ** 2 for x in d) / 2) ** 0.5
    assert r["comparison"] == "BORT² − BORT² w/o bi-level"
    assert r["mean"] == pytest.approx(mean) and r["std"] == pytest.approx(std)
    assert (r["helped"], r["ties"], r["n"]) == (1, 1, 3)
    assert (r["min"], r["max"]) == (pytest.approx(-2.0), pytest.approx(3.0))
    assert "| 1 / 3 (1 tie) |" in paired_markdown([r])
