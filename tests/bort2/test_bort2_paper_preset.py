"""``preset=paper``: BORT² as the paper's equations write it (docs/bort2.md, "preset=paper").

Every switch the preset sets resolves to the paper's reading and is a row of the departures
table; the hinge and the outer loss under both reductions against hand computations; the outer
loss without its ReLU is live where the authors' ReLU zeroes it; the default configuration keeps
the authors' code's behaviour (the new keys at their defaults compute what the code did)."""

import math
from pathlib import Path

import pytest
import torch
from bort2.config import HyperConfig, Step2Config, load_config
from bort2.models import DigitCNN, entropy_hinge
from bort2.stages_index import SPECS
from bort2.step2 import (
    BilevelLabelUpdater,
    build_student,
    build_threshold,
    outer_log_sigma,
)
from bort2.step2.hyper import LOG_EPS
from bort2.step2.losses import hinge
from bort2.step2.stages import Bort2Stage, RobustStage

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]

#: every key preset=paper sets -> (the paper's reading, the authors' code = the default)
PAPER = {
    "step2.hinge_reduction": ("sum", "mean"),  # Eq. 5
    "step2.labels": ("argmax", "argmax"),  # Eqs. 3-5 (Stage B)
    "step2.bort2_labels": ("gumbel", None),  # Sec. 3.3.2, Alg. 1 (Stage C)
    "step2.teacher_ema": (0.0, 0.999),  # Sec. 3.2
    "step2.bort2_init": ("step1", "robust"),  # Sec. 3.2, Supp., Alg. 1
    "step2.warmup": (0, None),  # Alg. 1
    "step2.outer": ("train", "train"),  # Sec. 3.3.2: T_val = T_trn
    "step2.hyper.outer_relu": (False, True),  # Eq. 7
    "step2.hyper.outer_reduction": ("sum", "mean"),  # Eq. 7
    "step2.hyper.convention": ("library", "official"),  # Eq. 8
    "step2.hyper.official_sign": (False, False),  # Eq. 5's L_ce
}


def _get(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_paper_preset_resolves_every_switch_as_documented():
    import yaml

    paper, default = load_config(overrides=["preset=paper"]), load_config()
    preset = _flat(yaml.safe_load((ROOT / "examples/bort2/configs/presets/paper.yaml").read_text()))
    assert set(preset) == set(PAPER)  # the preset sets exactly the documented switches
    for key, (want, authors) in PAPER.items():
        assert _get(paper, key) == want, key
        assert _get(default, key) == authors, key
    # everything else is the default run's (step 1 and the stage lengths included)
    import dataclasses

    flat_p = _flat(dataclasses.asdict(paper))
    flat_d = _flat(dataclasses.asdict(default))
    assert {k for k in flat_p if flat_p[k] != flat_d[k]} == {
        k for k, (want, authors) in PAPER.items() if want != authors
    } | {"preset"}
    # each switch the preset flips is a row of docs/bort2.md's departures table, and every key
    # it sets is a row of the preset's own section, with the paper's value
    doc = (ROOT / "docs/bort2.md").read_text()
    table = doc.split("## Departures from the authors' code", 1)[1].split("\n## ", 1)[0]
    section = doc.split("## `preset=paper`", 1)[1].split("\n## ", 1)[0]
    for key, (want, authors) in PAPER.items():
        if want != authors:
            assert f"`{key}`" in table, key
        shown = (
            str(want).lower()
            if isinstance(want, bool)
            else f"{want:g}"
            if isinstance(want, float)
            else str(want)
        )
        assert f"| `{key}` | `{shown}`" in section, key


def test_mean_and_sum_hinge_against_hand_computation():
    sigma = torch.tensor([[1.0, math.e, math.e**2], [math.e**-1, 1.0, 1.0]], dtype=torch.float64)
    # log sigma rows: [0, 1, 2] and [-1, 0, 0]; m = 4
    mean_rows = [4 - 1.0, 4 - (-1 / 3)]  # (m - mean_d log sigma)+
    sum_rows = [4 - 3.0, 4 - (-1.0)]  # (m - sum_d log sigma)+
    assert float(hinge(sigma, 4.0, reduction="mean")) == pytest.approx(sum(mean_rows) / 2)
    assert float(hinge(sigma, 4.0, reduction="sum")) == pytest.approx(sum(sum_rows) / 2)
    # the ReLU of the hinge: a row with sum_d log sigma >= m contributes nothing
    big = torch.full((1, 3), math.e**2, dtype=torch.float64)  # sum = 6 > 4, mean = 2 < 4
    assert float(hinge(big, 4.0, reduction="sum")) == 0.0
    assert float(hinge(big, 4.0, reduction="mean")) == pytest.approx(2.0)
    # "mean" is the authors' entropy_hinge bit for bit; eps is added inside the log
    x = torch.rand(5, 7) + 0.5
    assert torch.equal(hinge(x, 4.0, LOG_EPS, "mean"), entropy_hinge(x, 4.0, eps=LOG_EPS))
    want = torch.relu(4.0 - torch.log(x + LOG_EPS).sum(1)).mean()
    assert torch.equal(hinge(x, 4.0, LOG_EPS, "sum"), want)
    with pytest.raises(ValueError, match="reduction"):
        hinge(x, reduction="max")


def test_outer_loss_reductions_against_hand_computation():
    sigma = torch.tensor([[1.0, math.e, math.e**2], [math.e**-4, 1.0, 1.0]], dtype=torch.float64)
    eps = LOG_EPS
    logs = torch.log(sigma + eps)
    # the authors': relu(mean over all entries); the paper's Eq. 7: 1/N sum_i sum_d, no ReLU
    assert float(outer_log_sigma(sigma, relu=False)) == pytest.approx(float(logs.mean()))
    assert float(outer_log_sigma(sigma, False, "sum")) == pytest.approx(float(logs.sum() / 2))
    # log rows [0, 1, 2] and [-4, 0, 0] (eps shifts -4 by 5e-6): sum rows 3 and -4, mean (3-4)/6
    assert float(outer_log_sigma(sigma, False, "sum")) == pytest.approx((3 - 4) / 2, abs=1e-4)
    assert float(outer_log_sigma(sigma, False, "mean")) == pytest.approx((3 - 4) / 6, abs=1e-4)
    assert float(outer_log_sigma(sigma, True, "sum")) == 0.0  # negative: the ReLU zeroes it


def _tiny(sigma_bias):
    torch.manual_seed(0)
    labeler = DigitCNN(num_classes=3, width=1 / 32, image_size=8).double()
    x = torch.randn(8, 3, 8, 8, dtype=torch.float64)
    labeler.train()
    for _ in range(3):
        labeler(x + torch.randn_like(x))
    labeler.eval()
    student = build_student(labeler, "bort2", 3, sigma_head="official")
    with torch.no_grad():  # the sigma branch's BN shift sets where mean log sigma sits
        student.sigma_branch[1].bias.fill_(sigma_bias)
    student.train()
    return labeler, student, build_threshold("fixed", 0.0, 0.999, 3), x, x + 0.05 * x


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_outer_loss_without_relu_is_live_where_the_relu_zeroes_it(reduction):
    """On a tiny batch with mean log sigma < 0 (the authors' sigma branch as it sits in their
    runs): relu(...) gives exactly zero and a zero hypergradient; the paper's Eq. 7 is live."""
    norms = {}
    for relu in (True, False):
        labeler, student, threshold, x, x_weak = _tiny(sigma_bias=-0.5)
        settings = Step2Config(hinge_reduction=reduction, hyper=HyperConfig(
            labeler_mode="eval", outer_relu=relu, outer_reduction=reduction,
        ))  # fmt: skip
        theta0 = [p.detach().clone() for p in labeler.parameters()]
        up = BilevelLabelUpdater(student, labeler, threshold, settings)
        info = up(x, x_weak, torch.Generator().manual_seed(3))
        assert up.last_mean_log_sigma < 0
        moved = any(not torch.equal(p, t) for p, t in zip(labeler.parameters(), theta0))
        norms[relu] = info.hypergrad_norm
        if relu:
            assert info.outer_loss == 0.0 and info.hypergrad_norm == 0.0 and not moved
        else:
            assert info.outer_loss < 0 and info.hypergrad_norm > 0 and moved
    assert norms[True] == 0.0 < norms[False]


def test_sum_outer_loss_is_d_times_the_mean_and_so_is_its_hypergradient():
    out = {}
    for reduction in ("mean", "sum"):
        labeler, student, threshold, x, x_weak = _tiny(sigma_bias=-0.5)
        settings = Step2Config(hyper=HyperConfig(
            labeler_mode="eval", outer_relu=False, outer_reduction=reduction, apply=False,
            convention="library",
        ))  # fmt: skip
        up = BilevelLabelUpdater(student, labeler, threshold, settings)
        out[reduction] = up(x, x_weak, torch.Generator().manual_seed(3))
    d = student.net.head.in_features if hasattr(student.net, "head") else None
    ratio = out["sum"].outer_loss / out["mean"].outer_loss
    assert ratio == pytest.approx(round(ratio)) and ratio > 1
    if d is not None:
        assert round(ratio) == d
    assert out["sum"].hypergrad_norm == pytest.approx(ratio * out["mean"].hypergrad_norm)


def test_default_config_is_the_authors_code():
    cfg = load_config()
    s = cfg.step2.hyper  # what BilevelLabelUpdater reads, as it is
    assert (s.outer_relu, s.outer_reduction, cfg.step2.hinge_reduction) == (True, "mean", "mean")
    assert (s.convention, s.official_sign, s.labeler_mode) == ("official", False, "train")
    assert cfg.step2.bort2_labels is None and cfg.step2.labels == "argmax"
    # Stage C's labels follow step2.labels unless step2.bort2_labels is set; Stage B's never
    # read it
    stage = Bort2Stage.__new__(Bort2Stage)
    stage.s2 = cfg.step2
    assert stage.label_mode == "argmax"
    stage.s2 = load_config(overrides=["step2.bort2_labels=gumbel"]).step2
    assert stage.label_mode == "gumbel"
    robust = RobustStage.__new__(RobustStage)
    robust.s2 = stage.s2
    assert robust.label_mode == "argmax"


def test_stages_ignore_the_keys_they_never_read():
    b, c, naive = SPECS["step2/robust"], SPECS["step2/bort2"], SPECS["step2/naive"]
    for key in ("step2.bort2_labels", "step2.hyper.outer_reduction"):
        assert key in b.ignores and key in naive.ignores and key not in c.ignores
    assert "step2.hinge_reduction" in naive.ignores
    assert "step2.hinge_reduction" not in b.ignores + c.ignores


def test_new_keys_at_their_defaults_leave_old_fingerprints_alone():
    import dataclasses

    from bort2.config import MIGRATIONS, flat_keys, nest, spell
    from bort2.config.migrate import Added

    def version_1(cfg):  # what checkpoint fingerprints hash (their schema version)
        return _flat(nest(spell(flat_keys(dataclasses.asdict(cfg)), 1)))

    default, paper = version_1(load_config()), version_1(load_config(overrides=["preset=paper"]))
    added = ("step2.hinge_reduction", "step2.bort2_labels", "step2.hyper.outer_reduction")
    migrated = {c.key for m in MIGRATIONS for c in m.changes if isinstance(c, Added)}
    assert set(added) <= migrated and set(added) <= set(PAPER)
    for key in added:
        assert key not in default  # what a checkpoint written before the key hashed
        assert key in paper  # a changed value changes the fingerprint


def test_paper_preset_report_reproduces_the_committed_table(tmp_path):
    import shutil
    import subprocess
    import sys

    results = ROOT / "examples" / "bort2" / "results"
    shutil.copy(results / "paper_preset.json", tmp_path / "paper_preset.json")
    script = ROOT / "examples" / "bort2" / "scripts" / "paper_preset.py"
    cmd = [sys.executable, str(script), "--report", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    assert (tmp_path / "paper_preset.md").read_text() == (results / "paper_preset.md").read_text()


def _script():
    import importlib
    import sys

    scripts = str(ROOT / "examples" / "bort2" / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module("paper_preset")


def test_flip_reuses_step1_and_naive_only_when_naive_ignores_the_keys():
    pp = _script()
    step1 = ["step1_source_only", "step1_fixmatch_cm"]
    assert pp.reused_stages(["step2.hinge_reduction=sum"]) == [*step1, "step2_naive"]
    assert pp.reused_stages(["step2.lr=0.01"]) == step1  # the naive stage reads the lr
    assert pp.reused_stages(["step2.hinge_reduction=sum", "step2.lr=0.01"]) == step1
    with pytest.raises(SystemExit, match="step-2 keys only"):
        pp.reused_stages(["step1.iters=10"])


def test_flip_report_names_its_arm_and_the_load(tmp_path):
    import json

    pp = _script()
    res = json.loads((ROOT / "examples/bort2/results/paper_preset.json").read_text())
    res["arms"]["hinge_sum"] = res["arms"].pop("paper")
    res.update(
        compare="hinge_sum",
        compare_overrides=["step2.hinge_reduction=sum"],
        reused=pp.reused_stages(["step2.hinge_reduction=sum"]),
        load_avg=[0.25, 1.5],
    )
    text = pp.render(res)
    assert text.startswith("<!-- generated from hinge_sum.json")
    assert "against `step2.hinge_reduction=sum` alone" in text
    assert "| method | default (authors' code) | `step2.hinge_reduction=sum` |" in text
    assert "load average 0.25 at the start, 1.50 at the end" in text
    assert "| C | hinge_sum |" in text and "| paper |" not in text
    # --report renders the same from the JSON on disk
    (tmp_path / "hinge_sum.json").write_text(json.dumps(res))
    pp.main(["--report", "--flip", "step2.hinge_reduction=sum", "--name", "hinge_sum",
             "--out", str(tmp_path)])  # fmt: skip
    assert (tmp_path / "hinge_sum.md").read_text() == text
