"""Tests of the embedded MiniDigits benchmark: determinism, sizes, leakage, cache, fonts, splits."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from bort2.data import _photos, _render
from bort2.data.base import ArrayDomain, Benchmark
from bort2.data.minidigits import (
    DOMAINS,
    SPLITS,
    base_indices,
    build_minidigits,
    cache_path,
    default_root,
    load_minidigits,
    split_sizes,
    uci_base_indices,
)

SCALE = 0.05  # reduced build: ~1000 images, about a second


@pytest.fixture(scope="module")
def small() -> dict:
    return build_minidigits(seed=0, scale=SCALE)


def _uci_targets() -> np.ndarray:
    from sklearn.datasets import load_digits

    return load_digits().target


# ------------------------------------------------------------------ determinism


def test_same_seed_gives_identical_arrays(small):
    again = build_minidigits(seed=0, scale=SCALE)
    for d in DOMAINS:
        for s in SPLITS:
            assert np.array_equal(small[d][s][0], again[d][s][0]), (d, s)
            assert np.array_equal(small[d][s][1], again[d][s][1]), (d, s)


def test_different_seed_gives_different_images(small):
    other = build_minidigits(seed=1, scale=SCALE)
    for d in DOMAINS:
        for s in SPLITS:
            assert small[d][s][0].shape == other[d][s][0].shape
            assert not np.array_equal(small[d][s][0], other[d][s][0]), (d, s)
    # the UCI splits are fixed by the split seed, not by the generation seed
    for d in ("uci", "uci_m"):
        for s in SPLITS:
            assert np.array_equal(small[d][s][1], other[d][s][1])


# ------------------------------------------------------------------ sizes, dtypes, balance


def test_documented_sizes():
    assert split_sizes() == {
        "uci": {"train": 1350, "test": 1347},
        "uci_m": {"train": 1347, "test": 1347},
        "syn": {"train": 4000, "test": 2000},
        "syn_m": {"train": 4000, "test": 2000},
    }


def test_shapes_dtypes_and_reduced_sizes(small):
    assert list(small) == list(DOMAINS)
    sizes = split_sizes(SCALE)
    for d in DOMAINS:
        assert list(small[d]) == ["train", "test"]
        for s in SPLITS:
            x, y = small[d][s]
            assert x.dtype == np.uint8 and x.shape == (sizes[d][s], 3, 32, 32)
            assert y.dtype == np.int64 and y.shape == (sizes[d][s],)
            assert set(np.unique(y)) == set(range(10)), (d, s)
            assert x.std() > 20, f"{d}/{s} images look flat"


def test_full_size_labels_balanced():
    targets = _uci_targets()
    for d in ("uci", "uci_m"):
        for s in SPLITS:
            counts = np.bincount(targets[base_indices(d, s)], minlength=10)
            assert counts.sum() == split_sizes()[d][s]
            mean = counts.mean()
            assert counts.min() >= 0.9 * mean and counts.max() <= 1.1 * mean, (d, s, counts)


def test_synthetic_labels_exactly_balanced(small):
    for d in ("syn", "syn_m"):
        for s in SPLITS:
            counts = np.bincount(small[d][s][1], minlength=10)
            assert (counts == counts[0]).all(), (d, s, counts)


def test_domain_looks(small):
    uci = small["uci"]["train"][0]
    assert (uci[:, 0] == uci[:, 1]).all() and (uci[:, 0] == uci[:, 2]).all()  # grey as RGB
    assert uci[:, :, :2, :].mean() < 8 and uci[:, :, 12:20, 12:20].max() == 255  # centred
    for d in ("uci_m", "syn", "syn_m"):
        x = small[d]["train"][0].astype(np.int16)
        assert np.abs(x[:, 0] - x[:, 1]).mean() > 5, f"{d} should be in colour"


# ------------------------------------------------------------------ leakage


def test_no_base_digit_leakage():
    base = uci_base_indices()
    for d in ("uci", "uci_m"):
        assert not set(base[d]["train"]) & set(base[d]["test"]), d
    uci = set(base["uci"]["train"]) | set(base["uci"]["test"])
    uci_m = set(base["uci_m"]["train"]) | set(base["uci_m"]["test"])
    assert not uci & uci_m
    assert len(uci | uci_m) == 1797


def test_recorded_base_indices_match_labels(small):
    targets = _uci_targets()
    for d in ("uci", "uci_m"):
        for s in SPLITS:
            idx = base_indices(d, s, SCALE)
            assert np.array_equal(small[d][s][1], targets[idx])


# ------------------------------------------------------------------ cache


def _arrays(bench: Benchmark) -> dict:
    return {
        (d, s): (bench.split(d, s).images, bench.split(d, s).labels)
        for d in DOMAINS
        for s in SPLITS
    }


def _assert_same(a: dict, b: dict) -> None:
    for key in a:
        assert torch.equal(a[key][0], b[key][0]) and torch.equal(a[key][1], b[key][1]), key


def test_benchmark_interface(tmp_path, small):
    bench = load_minidigits(tmp_path, seed=0, progress=False, scale=SCALE)
    assert bench.name == "minidigits" and bench.num_classes == 10 and bench.image_size == 32
    assert bench.domains == ["uci", "uci_m", "syn", "syn_m"]
    for d in DOMAINS:
        for s in SPLITS:
            ds = bench.split(d, s)
            assert isinstance(ds, ArrayDomain)
            assert np.array_equal(ds.images.numpy(), small[d][s][0])
            image, label = ds[0]
            assert image.dtype == torch.uint8 and image.shape == (3, 32, 32)
            assert isinstance(label, int)


def test_cache_round_trip_and_corruption(tmp_path):
    first = _arrays(load_minidigits(tmp_path, seed=3, progress=False, scale=SCALE))
    path = cache_path(tmp_path, seed=3, scale=SCALE)
    assert path.is_file()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind
    mtime = path.stat().st_mtime_ns
    second = _arrays(load_minidigits(tmp_path, seed=3, progress=False, scale=SCALE))
    _assert_same(first, second)
    assert path.stat().st_mtime_ns == mtime  # served from the cache, not rebuilt

    size = path.stat().st_size
    with open(path, "r+b") as f:  # truncate
        f.truncate(size // 2)
    with pytest.warns(UserWarning, match="invalid"):
        third = _arrays(load_minidigits(tmp_path, seed=3, progress=False, scale=SCALE))
    _assert_same(first, third)
    assert path.stat().st_size == size

    with open(path, "r+b") as f:  # flip bytes in the middle of the image data
        f.seek(size // 2)
        chunk = f.read(64)
        f.seek(size // 2)
        f.write(bytes(255 - b for b in chunk))
    with pytest.warns(UserWarning, match="invalid"):
        fourth = _arrays(load_minidigits(tmp_path, seed=3, progress=False, scale=SCALE))
    _assert_same(first, fourth)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a healthy cache loads silently
        _assert_same(first, _arrays(load_minidigits(tmp_path, seed=3, progress=False, scale=SCALE)))


def test_default_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HYPERGRAD_DATA", str(tmp_path))
    assert default_root() == tmp_path / "minidigits"
    monkeypatch.delenv("HYPERGRAD_DATA")
    assert default_root().parts[-3:] == (".cache", "hypergrad", "minidigits")


# ------------------------------------------------------------------ fonts and photos


@pytest.mark.parametrize(
    "name",
    [
        "DejaVuSansDisplay.ttf",
        "DejaVuSerifDisplay.ttf",
        "STIXNonUni.ttf",
        "STIXNonUniBolIta.ttf",
        "STIXSizOneSymReg.ttf",
        "STIXSizFiveSymReg.ttf",
        "LastResortHE-Regular.ttf",
        "cmex10.ttf",
        "cmsy10.ttf",
    ],
)
def test_bad_fonts_rejected_by_shape(name):
    path = _render.font_dir() / name
    if not path.exists():
        pytest.skip(f"{name} not shipped by this matplotlib")
    assert not _render.check_digit_font(path).ok


def test_font_validation():
    ref = _render.check_digit_font(_render.font_dir() / "DejaVuSans.ttf")
    assert ref.ok and ref.recognised == 10
    names = {p.name for p in _render.valid_digit_fonts()}
    assert "DejaVuSans.ttf" in names
    for bad in (
        "DejaVuSansDisplay.ttf",
        "STIXNonUni.ttf",
        "STIXSizOneSymReg.ttf",
        "LastResortHE-Regular.ttf",
        "cmex10.ttf",
        "cmsy10.ttf",
        "cmmi10.ttf",
    ):
        assert bad not in names
        assert _render.is_known_bad(bad)
    assert {"DejaVuSerif.ttf", "STIXGeneral.ttf", "cmr10.ttf"} <= names


def test_font_split_disjoint():
    fonts = _render.domain_fonts()
    syn, syn_m = {p.name for p in fonts["syn"]}, {p.name for p in fonts["syn_m"]}
    assert syn and syn_m and not syn & syn_m
    assert all(n.startswith("DejaVu") for n in syn)
    assert all(n.startswith(("STIX", "cm")) for n in syn_m)


def test_photo_split_disjoint():
    split = _photos.PHOTO_SPLIT
    assert not set(split["uci_m"]) & set(split["syn_m"])
    for d in ("uci_m", "syn_m"):
        photos = _photos.domain_photos(d)
        assert len(photos) >= _photos.MIN_PHOTOS_PER_DOMAIN
        for _, img in photos:
            assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3


def test_patch_sampler_is_textured():
    rng = np.random.default_rng(0)
    photos = _photos.domain_photos("uci_m")
    patches = np.stack([_photos.random_patch(rng, photos) for _ in range(50)])
    assert patches.shape == (50, 32, 32, 3) and patches.dtype == np.uint8
    assert np.median(patches.reshape(50, -1).std(1)) > 15


def test_fresh_build_matches_the_published_fingerprint():
    """The full-size seed-0 build is byte-identical to the one the docs' numbers come from."""
    from bort2.data.minidigits import FINGERPRINTS, fingerprint

    assert fingerprint(0) == FINGERPRINTS[0]


def test_tampered_cache_with_recomputed_checksum_is_warned_about(data_root, tmp_path):
    """A seed-0 cache whose uci_m test labels were all changed and whose stored checksum was
    recomputed verifies against itself; it must still not pass for the published build."""
    from bort2.data.minidigits import FINGERPRINTS, _checksum, _write_atomic

    load_minidigits(data_root, seed=0, progress=False)  # the full-size seed-0 cache (built once)
    with np.load(cache_path(data_root, seed=0), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != "checksum"}
    assert _checksum(arrays) == FINGERPRINTS[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the published build loads silently
        load_minidigits(data_root, seed=0, progress=False)
    y = arrays["uci_m/test/labels"]
    arrays["uci_m/test/labels"] = ((y.astype(np.int64) + 1) % 10).astype(y.dtype)
    path = cache_path(tmp_path, seed=0)
    _write_atomic(path, arrays)  # stores the recomputed checksum: the file verifies
    with pytest.warns(UserWarning) as rec:
        bench = load_minidigits(tmp_path, seed=0, progress=False)
    msg = " ".join(str(w.message) for w in rec)
    assert str(path) in msg and "not the published 2019c59c6beb" in msg and "Delete" in msg
    assert "invalid" not in msg  # it was not rebuilt: the file is intact, its content is not
    assert torch.equal(bench.split("uci_m", "test").labels, torch.from_numpy((y + 1) % 10).long())
