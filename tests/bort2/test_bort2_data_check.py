"""``run.py --config configs/<benchmark>.yaml data.root=DIR data.check=true`` (bort2/data/check.py)
on tiny fake data sets in each real on-disk layout, malformed folders (exit status 2, one line
naming what is wrong), the authors' settings in configs/{digit5,pacs,domainnet}.yaml, and
MixStyle after ResNet layer1 and layer2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from bort2 import cli as run
from bort2.config import CONFIG_DIR, ConfigError, load_config
from bort2.data.check import check_data, format_report
from bort2.data.domainnet import DOMAINNET_DOMAINS
from bort2.data.pacs import PACS_CLASSES, PACS_DOMAINS
from bort2.models import MixStyle, ResNetClassifier
from PIL import Image
from scipy.io import savemat


def _check(capsys, tmp_path: Path, benchmark: str, root: Path, *extra: str):
    """``run.main`` with data.check=true: (exit status, stdout, stderr); asserts no output_dir."""
    out = tmp_path / "out"
    argv = [
        "--config",
        str(CONFIG_DIR / f"{benchmark}.yaml"),
        f"data.root={root}",
        "data.check=true",
        f"output_dir={out}",
        *extra,
    ]
    rc = run.main(argv)
    captured = capsys.readouterr()
    assert not out.exists(), "data.check must not create output_dir"
    return rc, captured.out, captured.err


def _image(path: Path, size=(10, 7), colour=(200, 30, 40)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


# ----------------------------------------------------------------------------- fake data sets
@pytest.fixture()
def pacs_root(tmp_path: Path) -> Path:
    """PACS kfold layout: per domain and class 2 train + 1 crossval images; test lists all 3."""
    root = tmp_path / "PACS"
    (root / "splits").mkdir(parents=True)
    for d, domain in enumerate(PACS_DOMAINS):
        ext = "png" if domain == "sketch" else "jpg"
        lines: dict[str, list[str]] = {"train": [], "crossval": [], "test": []}
        for label, cls in enumerate(PACS_CLASSES, start=1):
            n_train = 2 + (d == 2)  # photo: 3 training images per class
            for i in range(n_train + 1):
                rel = f"{domain}/{cls}/{i}.{ext}"
                _image(root / "images" / "kfold" / rel, colour=(40 * d, 20 * label, 9))
                lines["train" if i < n_train else "crossval"].append(f"{rel} {label}")
                lines["test"].append(f"{rel} {label}")
        for part, ls in lines.items():
            (root / "splits" / f"{domain}_{part}_kfold.txt").write_text("\n".join(ls) + "\n")
    return root


DOMAINNET_CLASSES = {0: "aircraft_carrier", 7: "apple", 344: "zigzag"}


@pytest.fixture()
def domainnet_root(tmp_path: Path) -> Path:
    """DomainNet layout: <domain>/<class>/<file>.jpg and <domain>_{train,test}.txt in the root."""
    root = tmp_path / "domainnet"
    for d, domain in enumerate(DOMAINNET_DOMAINS):
        for split, n in (("train", 2 + d % 2), ("test", 1)):
            lines = []
            for label, cls in DOMAINNET_CLASSES.items():
                for i in range(n):
                    rel = f"{domain}/{cls}/{domain}_{split}_{i}.jpg"
                    _image(root / rel, size=(16, 12), colour=(30 * d, 9, label % 256))
                    lines.append(f"{rel} {label}")
            (root / f"{domain}_{split}.txt").write_text("\n".join(lines) + "\n")
    return root


def _onehot(y) -> np.ndarray:
    out = np.zeros((len(y), 10), dtype=np.uint8)
    out[np.arange(len(y)), y] = 1
    return out


def _rgb(n: int, side: int) -> np.ndarray:
    return np.random.default_rng(n * side).integers(0, 256, (n, side, side, 3), dtype=np.uint8)


@pytest.fixture()
def digit5_root(tmp_path: Path) -> Path:
    """The M3SDA Digit-Five .mat files with the variable names the loader reads."""
    root = tmp_path / "Digit-Five"
    root.mkdir()
    rng = np.random.default_rng(0)
    savemat(
        root / "mnist_data.mat",
        {
            "train_32": rng.integers(0, 256, (8, 32, 32), dtype=np.uint8),
            "label_train": _onehot([0, 1, 2, 3, 4, 5, 6, 7]),
            "test_32": rng.integers(0, 256, (4, 32, 32), dtype=np.uint8),
            "label_test": _onehot([6, 7, 8, 9]),
        },
    )
    savemat(
        root / "mnistm_with_label.mat",
        {
            "train": _rgb(5, 28),
            "label_train": _onehot([1, 2, 3, 4, 5]),
            "test": _rgb(3, 28),
            "label_test": _onehot([7, 8, 9]),
        },
    )
    for split, n in (("train", 7), ("test", 2)):  # X (32, 32, 3, N), y (N, 1), 10 = digit 0
        x = np.ascontiguousarray(_rgb(n, 32).transpose(1, 2, 3, 0))
        y = (np.arange(n) % 10 + 1).reshape(-1, 1).astype(np.uint8)
        savemat(root / f"svhn_{split}_32x32.mat", {"X": x, "y": y})
    savemat(
        root / "syn_number.mat",
        {
            "train_data": _rgb(8, 32),
            "train_label": np.arange(8).reshape(-1, 1),
            "test_data": _rgb(2, 32),
            "test_label": np.array([[3], [4]]),
        },
    )
    cell = np.empty((2, 2), dtype=object)  # usps_28x28.mat: dataset = [[x, y], [x, y]]
    cell[0, 0] = rng.random((2, 1, 28, 28))
    cell[0, 1] = np.array([[1], [2]], dtype=np.float64)
    cell[1, 0] = rng.random((2, 1, 28, 28))
    cell[1, 1] = np.array([[7], [8]], dtype=np.float64)
    savemat(root / "usps_28x28.mat", {"dataset": cell})
    return root


# ----------------------------------------------------------------------------- valid folders
def _row(stdout: str, domain: str) -> list[str]:
    for line in stdout.splitlines():
        if line.split()[:1] == [domain]:
            return line.split()
    raise AssertionError(f"no row for {domain} in:\n{stdout}")


def test_pacs_check_prints_images_per_domain_and_split(pacs_root, tmp_path, capsys):
    rc, out, err = _check(capsys, tmp_path, "pacs", pacs_root, "step1.batch_per_domain=2")
    assert rc == 0, err
    assert err == ""
    assert _row(out, "art_painting") == ["art_painting", "14", "21", "7/7", "7/7"]
    assert _row(out, "photo") == ["photo", "21", "28", "7/7", "7/7"]
    assert _row(out, "total") == ["total", "63", "91"]
    assert "images resized to 224x224" in out
    # target sketch: sources art_painting 14, cartoon 14, photo 21 -> 14 // 2 = 7 per epoch
    assert "target sketch: smallest source train split art_painting (14) / 2 per domain = 7" in out
    assert "step1.iters 9,300 = 1328.6 epochs" in out
    assert "OK: every split loaded (24 images decoded)" in out


def test_domainnet_check_prints_all_six_domains(domainnet_root, tmp_path, capsys):
    rc, out, err = _check(capsys, tmp_path, "domainnet", domainnet_root, "target=clipart")
    assert rc == 0, err
    assert _row(out, "clipart") == ["clipart", "6", "3", "3/345", "3/345"]
    assert _row(out, "infograph") == ["infograph", "9", "3", "3/345", "3/345"]
    assert _row(out, "total") == ["total", "45", "18"]
    assert "target clipart: smallest source train split painting (6) / 6 per domain = 1" in out


def test_digit5_check_reads_the_mat_layout(digit5_root, tmp_path, capsys):
    # the folder itself or its parent (holding Digit-Five/) both work
    rc, out, err = _check(capsys, tmp_path, "digit5", digit5_root.parent, "target=svhn")
    assert rc == 0, err
    expected = {
        "mnist": ["8", "4"],
        "mnistm": ["5", "3"],
        "svhn": ["7", "2"],
        "syn": ["8", "2"],
        "usps": ["2", "2"],
    }
    for domain, counts in expected.items():
        assert _row(out, domain)[1:3] == counts, domain
    assert "images resized to 32x32" in out
    # sources of svhn: mnist 8, mnistm 5, syn 8, usps 2 x 3 = 6 (Dassl repeats USPS 3 times)
    assert "smallest source train split mnistm (5) / 64 per domain = 0" in out
    rc, out, _ = _check(capsys, tmp_path, "digit5", digit5_root, "step1.batch_per_domain=1")
    assert rc == 0  # target mnistm: mnist 8, svhn 7, syn 8, usps 6
    assert "smallest source train split usps (2 x 3) / 1 per domain = 6 iterations" in out


def test_check_report_api(pacs_root):
    cfg = load_config(CONFIG_DIR / "pacs.yaml", [f"data.root={pacs_root}", "data.image_size=16"])
    report = check_data(cfg)
    assert report.benchmark == "pacs" and report.num_classes == 7 and report.image_size == 16
    assert report.domains == list(PACS_DOMAINS)
    assert report.count("sketch", "train") == 14 and report.count("sketch", "test") == 21
    text = format_report(report)
    assert "pacs at" in text and "16x16" in text and "target" not in text


# ----------------------------------------------------------------------------- malformed folders
def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: data.check: ")
    return lines[0]


def test_missing_pacs_domain_folder(pacs_root, tmp_path, capsys):
    import shutil

    shutil.rmtree(pacs_root / "images" / "kfold" / "cartoon")
    rc, out, err = _check(capsys, tmp_path, "pacs", pacs_root)
    assert rc == 2 and out == ""
    line = _one_error_line(err)
    assert "missing domain folder" in line and "cartoon" in line


def test_missing_pacs_split_file(pacs_root, tmp_path, capsys):
    (pacs_root / "splits" / "photo_test_kfold.txt").unlink()
    rc, _, err = _check(capsys, tmp_path, "pacs", pacs_root)
    assert rc == 2
    line = _one_error_line(err)
    assert "missing split file" in line and "photo_test_kfold.txt" in line


def test_malformed_pacs_split_line(pacs_root, tmp_path, capsys):
    path = pacs_root / "splits" / "art_painting_train_kfold.txt"
    lines = path.read_text().splitlines()
    lines[3] = lines[3].rsplit(" ", 1)[0] + " 9"  # label outside 1..7
    path.write_text("\n".join(lines) + "\n")
    rc, _, err = _check(capsys, tmp_path, "pacs", pacs_root)
    assert rc == 2
    line = _one_error_line(err)
    assert "label 9 outside 1..7" in line and "art_painting_train_kfold.txt, line 4" in line


def test_missing_domainnet_split_file_and_domain(domainnet_root, tmp_path, capsys):
    (domainnet_root / "quickdraw_test.txt").unlink()
    rc, _, err = _check(capsys, tmp_path, "domainnet", domainnet_root)
    assert rc == 2
    line = _one_error_line(err)
    assert "missing split file" in line and "quickdraw_test.txt" in line
    import shutil

    shutil.rmtree(domainnet_root / "clipart")
    rc, _, err = _check(capsys, tmp_path, "domainnet", domainnet_root)
    assert rc == 2
    line = _one_error_line(err)
    assert "missing domain folder" in line and "clipart" in line


def test_missing_listed_image_and_unreadable_image(domainnet_root, tmp_path, capsys):
    first = domainnet_root / "real" / "aircraft_carrier" / "real_train_0.jpg"
    first.write_bytes(b"not a jpeg")  # listed first: decoded by the check
    rc, _, err = _check(capsys, tmp_path, "domainnet", domainnet_root)
    assert rc == 2
    line = _one_error_line(err)
    assert "cannot decode" in line and "real_train_0.jpg" in line
    first.unlink()
    rc, _, err = _check(capsys, tmp_path, "domainnet", domainnet_root)
    assert rc == 2
    line = _one_error_line(err)
    assert "missing image" in line and "real_train_0.jpg" in line


def test_digit5_missing_file_and_missing_variable(digit5_root, tmp_path, capsys):
    (digit5_root / "svhn_test_32x32.mat").unlink()
    rc, _, err = _check(capsys, tmp_path, "digit5", digit5_root)
    assert rc == 2
    line = _one_error_line(err)
    assert "missing file" in line and "svhn_test_32x32.mat" in line
    savemat(digit5_root / "svhn_test_32x32.mat", {"X": _rgb(2, 32).transpose(1, 2, 3, 0)})
    rc, _, err = _check(capsys, tmp_path, "digit5", digit5_root)
    assert rc == 2
    line = _one_error_line(err)
    assert "svhn_test_32x32.mat lacks key(s) ['y']" in line


def test_missing_root_and_bad_flag(tmp_path, capsys):
    rc = run.main(["--config", str(CONFIG_DIR / "pacs.yaml"), "data.check=true"])
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "needs root=" in line
    rc, _, err = _check(capsys, tmp_path, "pacs", tmp_path / "nowhere")
    assert rc == 2
    assert "data root" in _one_error_line(err) and "nowhere" in err
    with pytest.raises(ConfigError, match="check"):
        load_config(None, ["data.check=maybe"])
    assert load_config(None, []).data.check is False


# ----------------------------------------------------------------------------- authors' settings
def test_real_benchmark_configs_carry_the_authors_settings():
    d5 = load_config(CONFIG_DIR / "digit5.yaml")
    pacs = load_config(CONFIG_DIR / "pacs.yaml")
    dn = load_config(CONFIG_DIR / "domainnet.yaml")
    # networks, image sizes, MixStyle
    assert (d5.model.arch, d5.model.width, d5.data.image_size) == ("digit_cnn", 1.0, 32)
    assert (pacs.model.arch, pacs.data.image_size) == ("resnet18", 224)
    assert (dn.model.arch, dn.data.image_size) == ("resnet101", 224)
    for cfg in (d5, pacs, dn):
        assert (cfg.model.mixstyle_p, cfg.model.mixstyle_alpha) == (0.5, 0.1)
        assert cfg.step1.methods == ["fixmatch_cm"] and cfg.step2.methods == ["robust", "bort2"]
        s2 = cfg.step2
        assert (s2.hyper.every, s2.hyper.lr, s2.hyper.alpha, s2.hyper.steps) == (
            30,
            5e-5,
            5e-5,
            3,
        )
        assert (s2.hyper.clip, s2.hinge_margin, s2.threshold, s2.ema_alpha) == (
            50.0,
            4.0,
            "adaptive",
            0.999,
        )
        assert s2.lr is None and s2.bort2_init == "robust"  # lr_mult 0.1 of step 1's lr
    # per-domain (source) and target batches; step-2 batch = the target batch
    assert (d5.step1.batch_per_domain, d5.step1.target_batch, d5.step2.batch_size) == (64,) * 3
    assert (pacs.step1.batch_per_domain, pacs.step1.target_batch, pacs.step2.batch_size) == (
        (16,) * 3
    )
    assert (dn.step1.batch_per_domain, dn.step1.target_batch, dn.step2.batch_size) == (6,) * 3
    # learning rates and the entropy-hinge weight (0.001 on DomainNet)
    assert (d5.step1.lr, dn.step1.lr) == (0.05, 0.002)
    assert (d5.step2.hinge_lambda, pacs.step2.hinge_lambda, dn.step2.hinge_lambda) == (
        0.1,
        0.1,
        0.001,
    )
    # epochs x iterations per epoch (smallest source // per-domain batch), as the comments show
    assert (d5.step1.iters, d5.step2.iters, d5.eval_every) == (30 * 348, 20 * 348, 348)
    assert 22314 // 64 == 348  # USPS 7,438 x 3
    assert (pacs.step1.iters, pacs.step2.iters, pacs.eval_every) == (100 * 93, 50 * 93, 93)
    assert 1499 // 16 == 93  # photo, the smallest source of target sketch
    assert (dn.step1.iters, dn.step2.iters, dn.eval_every) == (40 * 5587, 15 * 5587, 5587)
    assert 33525 // 6 == 5587  # clipart, the smallest source of target sketch
    for name in ("digit5", "pacs", "domainnet"):  # every setting names its source
        text = (CONFIG_DIR / f"{name}.yaml").read_text()
        assert "Zhongying-Deng/BORT2" in text and "d3a0022" in text


def _mixstyle_calls(model: ResNetClassifier, x: torch.Tensor) -> list[int]:
    """Channel counts of the feature maps MixStyle is applied to in one forward pass."""
    calls: list[int] = []
    handle = model.mixstyle.register_forward_hook(
        lambda m, args, out: calls.append(args[0].shape[1])
    )
    try:
        model(x)
    finally:
        handle.remove()
    return calls


def test_resnet_mixstyle_after_layer1_and_layer2():
    x = torch.rand(4, 3, 32, 32)
    model = ResNetClassifier("resnet18", num_classes=3, mixstyle={"p": 1.0}).train()
    assert isinstance(model.mixstyle, MixStyle)
    assert model.mixstyle_layers == ("layer1", "layer2")
    assert _mixstyle_calls(model, x) == [64, 128]  # after layer1 (64 ch) and layer2 (128 ch)
    one = ResNetClassifier("resnet18", num_classes=3, mixstyle=True, mixstyle_layers=["layer1"])
    assert _mixstyle_calls(one, x) == [64]
    with pytest.raises(ValueError, match="mixstyle_layers"):
        ResNetClassifier("resnet18", num_classes=3, mixstyle=True, mixstyle_layers=["layer5"])
    # MixStyle is the identity in eval mode; on (p=1) it changes the training-mode features
    plain = ResNetClassifier("resnet18", num_classes=3)
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model.eval().features(x), plain.eval().features(x))
    mixed = model.train().features(x)
    assert not torch.allclose(mixed, plain.train().features(x))
