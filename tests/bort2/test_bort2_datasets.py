"""Real-benchmark loaders (Digit-Five, PACS, DomainNet), registry and domain samplers.

Each loader reads tiny fake data sets written in tmp_path in the public on-disk layout.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from bort2.data.base import ArrayDomain, FileDomain
from bort2.data.digit5 import load_digit5
from bort2.data.domainnet import load_domainnet
from bort2.data.pacs import PACS_CLASSES, load_pacs
from bort2.data.registry import BENCHMARKS, load_benchmark
from bort2.data.samplers import DomainBalancedSampler, InfiniteLoader
from PIL import Image
from scipy.io import savemat
from torch.utils.data import Dataset

# --------------------------------------------------------------------------- Digit-Five


def _onehot(y: np.ndarray) -> np.ndarray:
    out = np.zeros((len(y), 10), dtype=np.uint8)
    out[np.arange(len(y)), y] = 1
    return out


def _grey(n: int, side: int, start: int) -> np.ndarray:
    """Greyscale images whose pixels all equal ``start + 3 * i`` (an id readable after resize)."""
    vals = (start + 3 * np.arange(n)).astype(np.uint8)
    return np.broadcast_to(vals[:, None, None], (n, side, side)).copy()


def _rgb_nhwc(n: int, side: int, start: int) -> np.ndarray:
    """RGB images: channel c of image i is constant ``start + 3 * i + c``."""
    vals = (start + 3 * np.arange(n)[:, None] + np.arange(3)[None]).astype(np.uint8)
    return np.broadcast_to(vals[:, None, None, :], (n, side, side, 3)).copy()


@pytest.fixture()
def digit5_root(tmp_path: Path) -> Path:
    root = tmp_path / "Digit-Five"
    root.mkdir()
    # MNIST: train (N, 32, 32) with one-hot labels, test (N, 32, 32, 1) with one-hot labels.
    y_tr, y_te = np.array([0, 1, 2, 3, 4, 5, 6]), np.array([9, 8, 7, 6, 5])
    savemat(
        root / "mnist_data.mat",
        {
            "train_32": _grey(7, 32, 10),
            "label_train": _onehot(y_tr),
            "test_32": _grey(5, 32, 100)[..., None],
            "label_test": _onehot(y_te),
        },
    )
    # MNIST-M: RGB 28x28, labels as integer vectors (savemat stores them as (1, N) rows).
    savemat(
        root / "mnistm_with_label.mat",
        {
            "train": _rgb_nhwc(6, 28, 20),
            "label_train": np.array([1, 2, 3, 4, 5, 6]),
            "test": _rgb_nhwc(3, 28, 50),
            "label_test": _onehot(np.array([7, 8, 9])),
        },
    )
    # SVHN: X (H, W, 3, N), y (N, 1) with 10 meaning digit 0.
    svhn = (("train", 6, 30, [9, 10, 1, 9, 10, 1]), ("test", 4, 60, [10, 1, 2, 3]))
    for split, n, start, y in svhn:
        x = np.ascontiguousarray(_rgb_nhwc(n, 32, start).transpose(1, 2, 3, 0))
        y = np.array(y, dtype=np.uint8).reshape(-1, 1)
        savemat(root / f"svhn_{split}_32x32.mat", {"X": x, "y": y})
    # SynDigits: RGB 32x32 (N, H, W, 3), labels (N, 1).
    savemat(
        root / "syn_number.mat",
        {
            "train_data": _rgb_nhwc(5, 32, 40),
            "train_label": np.arange(5).reshape(-1, 1),
            "test_data": _rgb_nhwc(2, 32, 70),
            "test_label": np.array([[3], [4]]),
        },
    )
    # USPS: dataset cell array, images (N, 1, 28, 28) floats in [0, 1], labels (N, 1).
    cell = np.empty((2, 2), dtype=object)
    cell[0, 0] = np.broadcast_to((np.arange(8) * 0.1)[:, None, None, None], (8, 1, 28, 28)).copy()
    cell[0, 1] = (np.arange(8) % 10).reshape(-1, 1).astype(np.float64)
    cell[1, 0] = np.full((3, 1, 28, 28), 0.2)
    cell[1, 1] = np.array([[7], [8], [9]], dtype=np.float64)
    savemat(root / "usps_28x28.mat", {"dataset": cell})
    return root


def test_digit5_shapes_labels_pixels(digit5_root: Path):
    bench = load_digit5(digit5_root.parent)  # the parent of Digit-Five/ is accepted too
    assert bench.name == "digit5" and bench.num_classes == 10 and bench.image_size == 32
    assert bench.domains == ["mnist", "mnistm", "svhn", "syn", "usps"]
    sizes = {d: (len(bench.split(d, "train")), len(bench.split(d, "test"))) for d in bench.domains}
    assert sizes == {
        "mnist": (7, 5),
        "mnistm": (6, 3),
        "svhn": (6, 4),
        "syn": (5, 2),
        "usps": (8, 3),
    }
    for d in bench.domains:
        for s in ("train", "test"):
            ds = bench.split(d, s)
            assert isinstance(ds, ArrayDomain)
            assert ds.images.dtype == torch.uint8 and ds.images.shape[1:] == (3, 32, 32)
            assert ds.labels.dtype == torch.int64
    mnist = bench.split("mnist", "train")
    assert mnist.labels.tolist() == [0, 1, 2, 3, 4, 5, 6]  # one-hot -> int
    # grey -> RGB: all three channels equal the grey value, exactly (no resize at 32).
    expect = torch.tensor(10 + 3 * np.arange(7), dtype=torch.uint8)
    assert torch.equal(mnist.images, expect[:, None, None, None].expand(7, 3, 32, 32))
    assert bench.split("mnist", "test").labels.tolist() == [9, 8, 7, 6, 5]
    assert int(bench.split("mnist", "test").images[4, 2, 31, 0]) == 112
    # MNIST-M: integer-vector and one-hot labels; 28 -> 32 resize keeps constant channels.
    assert bench.split("mnistm", "train").labels.tolist() == [1, 2, 3, 4, 5, 6]
    assert bench.split("mnistm", "test").labels.tolist() == [7, 8, 9]
    img, label = bench.split("mnistm", "train")[2]
    assert label == 3 and torch.equal(
        img, torch.tensor([26, 27, 28], dtype=torch.uint8)[:, None, None].expand(3, 32, 32)
    )
    # SVHN: (H, W, 3, N) layout and 10 -> 0.
    assert bench.split("svhn", "train").labels.tolist() == [9, 0, 1, 9, 0, 1]
    assert bench.split("svhn", "test").labels.tolist() == [0, 1, 2, 3]
    assert bench.split("svhn", "test")[1][0][:, 5, 7].tolist() == [63, 64, 65]
    assert bench.split("syn", "train").labels.tolist() == [0, 1, 2, 3, 4]
    assert bench.split("syn", "test").labels.tolist() == [3, 4]
    # USPS: floats in [0, 1] -> round(255 x), grey -> RGB, 28 -> 32.
    usps = bench.split("usps", "train")
    assert usps.labels.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    vals = np.rint(np.arange(8) * 0.1 * 255).astype(np.uint8)
    assert torch.equal(
        usps.images, torch.from_numpy(vals)[:, None, None, None].expand(8, 3, 32, 32)
    )
    assert bench.split("usps", "test").images.unique().tolist() == [51]


def test_digit5_caps_resize_and_domains(digit5_root: Path):
    bench = load_digit5(digit5_root, image_size=16, max_train=4, max_test=2, seed=3)
    assert {d: len(bench.split(d, "train")) for d in bench.domains} == {
        "mnist": 4,
        "mnistm": 4,
        "svhn": 4,
        "syn": 4,
        "usps": 8,
    }  # USPS is never capped
    assert {d: len(bench.split(d, "test")) for d in bench.domains} == {
        "mnist": 2,
        "mnistm": 2,
        "svhn": 2,
        "syn": 2,
        "usps": 3,
    }
    mnist = bench.split("mnist", "train")
    assert mnist.images.shape == (4, 3, 16, 16)
    # the subset keeps images and labels together: pixel value 10 + 3 * label
    assert torch.equal(mnist.images[:, 0, 0, 0].long(), 10 + 3 * mnist.labels)
    # the subset depends on the seed and the domain only, not on the other domains loaded
    alone = load_digit5(
        digit5_root, image_size=16, max_train=4, max_test=2, seed=3, domains=["mnist"]
    )
    assert alone.domains == ["mnist"]
    assert torch.equal(alone.split("mnist", "train").labels, mnist.labels)
    with pytest.raises(ValueError, match="unknown Digit-Five domain"):
        load_digit5(digit5_root, domains=["mnist", "emnist"])


def test_digit5_errors(digit5_root: Path, tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"(?s)does not exist.*Expected layout.*mnist_data"):
        load_digit5(tmp_path / "nowhere")
    (digit5_root / "usps_28x28.mat").unlink()
    with pytest.raises(FileNotFoundError, match=r"(?s)missing file .*usps_28x28\.mat.*Expected"):
        load_digit5(digit5_root)
    savemat(digit5_root / "syn_number.mat", {"train_data": np.zeros((2, 32, 32, 3))})
    with pytest.raises(ValueError, match=r"syn_number\.mat lacks key\(s\) \['train_label'"):
        load_digit5(digit5_root, domains=["syn"])


# --------------------------------------------------------------------------- PACS

_PACS_COLOURS = {
    "art_painting": (200, 10, 10),
    "cartoon": (10, 200, 10),
    "photo": (10, 10, 200),
    "sketch": (250, 250, 250),
}


def _save_image(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (12, 9)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


@pytest.fixture()
def pacs_root(tmp_path: Path) -> Path:
    root = tmp_path / "PACS"
    (root / "splits").mkdir(parents=True)
    for domain, colour in _PACS_COLOURS.items():
        ext = "png" if domain == "sketch" else "jpg"
        lines: dict[str, list[str]] = {"train": [], "crossval": [], "test": []}
        for label, cls in enumerate(PACS_CLASSES, start=1):
            for part, count in (("train", 2), ("crossval", 1), ("test", 1)):
                for i in range(count):
                    rel = f"{domain}/{cls}/{part}_{i}.{ext}"
                    _save_image(root / "images" / "kfold" / rel, colour)
                    lines[part].append(f"{rel} {label}")
        for part, ls in lines.items():
            (root / "splits" / f"{domain}_{part}_kfold.txt").write_text("\n".join(ls) + "\n")
    return root


def test_pacs_loads_layout(pacs_root: Path):
    bench = load_pacs(pacs_root, image_size=8)
    assert bench.name == "pacs" and bench.num_classes == 7 and bench.image_size == 8
    assert bench.domains == ["art_painting", "cartoon", "photo", "sketch"]
    for d in bench.domains:
        train, test = bench.split(d, "train"), bench.split(d, "test")
        assert isinstance(train, FileDomain) and (len(train), len(test)) == (14, 7)
        assert train.labels.tolist() == [c for c in range(7) for _ in range(2)]  # 1..7 -> 0..6
        assert test.labels.tolist() == list(range(7))
        assert train.items[2][0] == pacs_root / "images/kfold" / d / "elephant" / (
            "train_0." + ("png" if d == "sketch" else "jpg")
        )
    img, label = bench.split("sketch", "test")[6]
    assert label == 6 and img.dtype == torch.uint8 and img.shape == (3, 8, 8)
    assert img.unique().tolist() == [250]  # png: exact colour
    img, _ = bench.split("photo", "train")[0]
    assert (img.float() - torch.tensor([10.0, 10.0, 200.0])[:, None, None]).abs().max() <= 8
    withval = load_pacs(pacs_root, domains=["cartoon"], include_crossval=True)
    assert withval.domains == ["cartoon"] and len(withval.split("cartoon", "train")) == 21


def test_pacs_errors(pacs_root: Path, tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"(?s)PACS: data root .*nowhere.*images/kfold"):
        load_pacs(tmp_path / "nowhere")
    split = pacs_root / "splits" / "photo_test_kfold.txt"
    good = split.read_text()
    split.write_text(good + "photo/dog/extra.jpg\n")
    with pytest.raises(ValueError, match=r"(?s)malformed line in .*photo_test_kfold\.txt, line 8"):
        load_pacs(pacs_root, domains=["photo"])
    split.write_text(good + "photo/dog/train_0.jpg 8\n")
    with pytest.raises(ValueError, match=r"label 8 outside 1\.\.7"):
        load_pacs(pacs_root, domains=["photo"])
    split.write_text(good + "photo/dog/train_0.jpg 2\n")
    with pytest.raises(ValueError, match=r"class folder 'dog' does not match label 2"):
        load_pacs(pacs_root, domains=["photo"])
    split.write_text(good + "photo/dog/gone.jpg 1\n")
    with pytest.raises(FileNotFoundError, match=r"(?s)missing image .*gone\.jpg.*splits/"):
        load_pacs(pacs_root, domains=["photo"])
    assert (
        len(load_pacs(pacs_root, domains=["photo"], verify_files=False).split("photo", "test")) == 8
    )
    split.unlink()
    with pytest.raises(
        FileNotFoundError,
        match=r"(?s)missing split file .*photo_test_kfold.*"
        r"Expected layout",
    ):
        load_pacs(pacs_root, domains=["photo"])
    import shutil

    shutil.rmtree(pacs_root / "images" / "kfold" / "cartoon")
    with pytest.raises(FileNotFoundError, match=r"missing domain folder .*cartoon"):
        load_pacs(pacs_root, domains=["art_painting", "cartoon"])


# --------------------------------------------------------------------------- DomainNet


@pytest.fixture()
def domainnet_root(tmp_path: Path) -> Path:
    root = tmp_path / "domainnet"
    classes = {0: "aircraft_carrier", 7: "apple", 344: "zigzag"}
    for d, colour in (("clipart", (0, 255, 0)), ("sketch", (255, 255, 255)), ("real", (9, 9, 9))):
        for split, n in (("train", 2), ("test", 1)):
            lines = []
            for label, cls in classes.items():
                for i in range(n):
                    rel = f"{d}/{cls}/{d}_{split}_{i}.jpg"
                    _save_image(root / rel, colour, size=(20, 14))
                    lines.append(f"{rel} {label}")
            (root / f"{d}_{split}.txt").write_text("\n".join(lines) + "\n")
    return root


def test_domainnet_loads_layout(domainnet_root: Path):
    bench = load_domainnet(domainnet_root, image_size=6, domains=["sketch", "clipart"])
    assert bench.name == "domainnet" and bench.num_classes == 345
    assert bench.domains == ["sketch", "clipart"]
    train = bench.split("sketch", "train")
    assert isinstance(train, FileDomain) and len(train) == 6
    assert train.labels.tolist() == [0, 0, 7, 7, 344, 344]
    assert bench.split("clipart", "test").labels.tolist() == [0, 7, 344]
    img, label = bench.split("clipart", "test")[2]
    assert label == 344 and img.shape == (3, 6, 6) and img.dtype == torch.uint8
    assert (img.float() - torch.tensor([0.0, 255.0, 0.0])[:, None, None]).abs().max() <= 8
    assert train.items[0][0] == domainnet_root / "sketch/aircraft_carrier/sketch_train_0.jpg"


def test_domainnet_errors(domainnet_root: Path, tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"(?s)DomainNet: data root.*<domain>_train\.txt"):
        load_domainnet(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"(?s)missing domain folder .*infograph.*Expected"):
        load_domainnet(domainnet_root, domains=["real", "infograph"])
    split = domainnet_root / "real_test.txt"
    good = split.read_text()
    split.write_text(good + "real/apple/real_test_0.jpg seven\n")
    with pytest.raises(ValueError, match=r"malformed line in .*real_test\.txt, line 4"):
        load_domainnet(domainnet_root, domains=["real"])
    split.write_text(good + "real/zigzag/real_test_0.jpg 345\n")
    with pytest.raises(ValueError, match=r"label 345 outside 0\.\.344"):
        load_domainnet(domainnet_root, domains=["real"])
    split.write_text(good + "real/zigzag/real_test_0.jpg 7\n")
    with pytest.raises(ValueError, match=r"label 7 names class 'zigzag' .* but 'apple' elsewhere"):
        load_domainnet(domainnet_root, domains=["real"])
    split.write_text(good + "clipart/apple/clipart_test_0.jpg 7\n")
    with pytest.raises(ValueError, match=r"not of the form 'real/<class>/<file>'"):
        load_domainnet(domainnet_root, domains=["real"])
    split.unlink()
    with pytest.raises(FileNotFoundError, match=r"missing split file .*real_test\.txt"):
        load_domainnet(domainnet_root, domains=["real"])


# --------------------------------------------------------------------------- registry


def test_registry_dispatch_and_errors(pacs_root: Path, monkeypatch: pytest.MonkeyPatch):
    assert BENCHMARKS == ("minidigits", "digit5", "pacs", "domainnet")
    with pytest.raises(
        ValueError,
        match="unknown benchmark 'office31'; valid names: minidigits, digit5, pacs, domainnet",
    ):
        load_benchmark("office31")
    with pytest.raises(ValueError, match="'domainnet' needs root="):
        load_benchmark("DomainNet")
    bench = load_benchmark("PACS", root=pacs_root, image_size=4, domains=["photo"])
    assert bench.name == "pacs" and bench.image_size == 4 and bench.domains == ["photo"]
    calls = []
    fake = types.ModuleType("bort2.data.minidigits")
    fake.load_minidigits = lambda root=None, seed=0, rebuild=False, progress=True: (
        calls.append((root, seed, progress)) or "mini"
    )
    monkeypatch.setitem(sys.modules, "bort2.data.minidigits", fake)
    assert load_benchmark("minidigits", seed=4, progress=False) == "mini"
    assert load_benchmark("mini-digits", root="/tmp/x") == "mini"
    assert calls == [(None, 4, False), ("/tmp/x", 0, True)]


# --------------------------------------------------------------------------- samplers


def test_sampler_balanced_passes_and_determinism():
    sizes, k = [7, 3, 12], 4
    sampler = DomainBalancedSampler(sizes, k, generator=torch.Generator().manual_seed(5))
    batches = [next(sampler) for _ in range(21)]  # 84 draws per domain
    offsets = [0, 7, 10]
    per_domain: list[list[int]] = [[], [], []]
    for b in batches:
        assert b.dtype == torch.int64 and b.shape == (12,)
        for d in range(3):
            part = b[d * k : (d + 1) * k]
            assert bool(((part >= offsets[d]) & (part < offsets[d] + sizes[d])).all())
            per_domain[d] += (part - offsets[d]).tolist()
    for d, n in enumerate(sizes):  # every aligned pass over a domain is a permutation
        stream = per_domain[d]
        for s in range(0, len(stream) - n + 1, n):
            assert sorted(stream[s : s + n]) == list(range(n))
    # passes are reshuffled: the 28 passes over domain 1 are not all the same order
    assert len({tuple(per_domain[1][s : s + 3]) for s in range(0, 84, 3)}) > 1
    again = DomainBalancedSampler(sizes, k, generator=5)
    assert all(torch.equal(b, next(again)) for b in batches)
    other = DomainBalancedSampler(sizes, k, generator=6)
    assert not all(torch.equal(b, next(other)) for b in batches)
    assert sampler.domain_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4


def test_sampler_state_dict_round_trip(tmp_path: Path):
    sampler = DomainBalancedSampler([5, 9], 3, generator=11)
    for _ in range(4):
        next(sampler)
    torch.save(sampler.state_dict(), tmp_path / "s.pt")
    expected = [next(sampler) for _ in range(10)]
    fresh = DomainBalancedSampler([5, 9], 3, generator=999)
    fresh.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert all(torch.equal(e, next(fresh)) for e in expected)
    with pytest.raises(ValueError, match="sampler state is for domain_sizes=\\[5, 9\\]"):
        DomainBalancedSampler([5, 8], 3).load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match="must be positive"):
        DomainBalancedSampler([5, 0], 3)


def _array_domains() -> list[ArrayDomain]:
    out = []
    for d, n in enumerate((6, 4, 9)):
        images = torch.arange(n, dtype=torch.uint8)[:, None, None, None].expand(n, 3, 2, 2) + 50 * d
        out.append(ArrayDomain(images.contiguous(), torch.arange(n) + 100 * d))
    return out


class _Tagged(Dataset):
    """A dataset without in-memory tensors: item i is (image filled with base + i, label)."""

    def __init__(self, n: int, base: int):
        self.n, self.base = n, base

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 2, 2), self.base + i, dtype=torch.uint8), 100 + self.base + i


def _check_batch(images, labels, domains, k, ndom):
    assert images.dtype == torch.uint8 and images.shape == (k * ndom, 3, 2, 2)
    assert labels.dtype == torch.int64 and domains.dtype == torch.int64
    assert domains.tolist() == [d for d in range(ndom) for _ in range(k)]
    # image content and label come from the same item of the right domain:
    # item i of domain d has pixels i + 50 d and label i + 100 d
    assert torch.equal(labels, images[:, 0, 0, 0].long() + 50 * domains)


def test_infinite_loader_in_memory_matches_sampler_and_resumes():
    domains = _array_domains()
    loader = InfiniteLoader(domains, batch_size_per_domain=2, generator=7)
    assert loader.in_memory and loader.batch_size == 6
    ref = DomainBalancedSampler([6, 4, 9], 2, generator=7)
    for _ in range(8):
        images, labels, dom = next(loader)
        _check_batch(images, labels, dom, 2, 3)
        idx = next(ref)
        expect = torch.cat(
            [domains[d].labels[idx[2 * d : 2 * d + 2] - o] for d, o in enumerate([0, 6, 10])]
        )
        assert torch.equal(labels, expect)
    state = loader.state_dict()
    expected = [next(loader) for _ in range(5)]
    resumed = InfiniteLoader(_array_domains(), 2, generator=0)
    resumed.load_state_dict(state)
    for e in expected:
        assert all(torch.equal(a, b) for a, b in zip(e, next(resumed)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_infinite_loader_dataloader_path_resumes_despite_prefetch(num_workers: int):
    def make(seed):
        data = [_Tagged(5, 0), _Tagged(3, 50)]
        return InfiniteLoader(data, 2, generator=seed, num_workers=num_workers)

    loader = make(3)
    assert not loader.in_memory
    ref = InfiniteLoader(_array_like_tagged(), 2, generator=3)  # same stream, in memory
    for _ in range(4):
        got, want = next(loader), next(ref)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    state = loader.state_dict()  # workers have prefetched past this point
    expected = [next(loader) for _ in range(6)]
    loader.close()
    resumed = make(12345)
    resumed.load_state_dict(state)
    for e in expected:
        assert all(torch.equal(a, b) for a, b in zip(e, next(resumed)))
    resumed.close()


def _array_like_tagged() -> list[ArrayDomain]:
    out = []
    for n, base in ((5, 0), (3, 50)):
        vals = torch.arange(n, dtype=torch.uint8) + base
        out.append(
            ArrayDomain(
                vals[:, None, None, None].expand(n, 3, 2, 2).contiguous(), 100 + vals.long()
            )
        )
    return out


def test_infinite_loader_reads_file_domains(pacs_root: Path):
    bench = load_pacs(pacs_root, image_size=4, domains=["cartoon", "sketch"])
    loader = InfiniteLoader([bench.split(d, "train") for d in bench.domains], 3, generator=1)
    images, labels, dom = next(loader)
    assert images.shape == (6, 3, 4, 4) and images.dtype == torch.uint8
    assert dom.tolist() == [0, 0, 0, 1, 1, 1] and labels.min() >= 0 and labels.max() <= 6
    assert images[3:].unique().tolist() == [250]  # sketch png colour
