"""MiniDigits: an embedded four-domain digit benchmark built from data that ships with packages.

Owns: the recipes of the four domains, the pure builder :func:`build_minidigits`, and the
on-disk cache behind :func:`load_minidigits` (one ``.npz`` per seed, written atomically, with
a content checksum; rebuilt if missing or corrupt).

Domains (10 classes, 32x32 RGB uint8), in this order:

- ``uci``: half of scikit-learn's UCI handwritten digits (8x8), upscaled to ~24 px, white on
  black, each base image rendered 3 times with a small random affine.
- ``uci_m``: the other half, rendered the same way and blended onto natural-photo patches the
  MNIST-M way (``|patch - digit|`` per channel).
- ``syn``: digits rendered from matplotlib's DejaVu fonts (SynDigits recipe).
- ``syn_m``: digits rendered from matplotlib's STIX and Computer Modern fonts on photo
  backgrounds with partial neighbouring digits (SVHN-like house-number crops).

Fonts and photos are split between domains (see :mod:`._render` and :mod:`._photos`), so no
target domain has a twin among its sources. The UCI halves and their train/test splits are
fixed by :data:`SPLIT_SEED`, independent of the generation ``seed``; the split is made on base
images before augmentation, so no test image shares a base digit with a training image.
See ``docs/minidigits.md`` for the sizes, the recipe and calibration numbers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

from bort2.data import _photos, _render
from bort2.data.base import ArrayDomain, Benchmark

#: Domain names, in benchmark order.
DOMAINS: tuple[str, ...] = ("uci", "uci_m", "syn", "syn_m")
#: Split names of every domain.
SPLITS: tuple[str, ...] = ("train", "test")
NUM_CLASSES = 10
IMAGE_SIZE = 32
#: Bumped whenever the recipe changes; part of the cache file name and of its metadata.
RECIPE_VERSION = 1
# Content checksums (:func:`fingerprint`) of the full-size builds, as published in
# docs/minidigits.md: a machine whose build differs gets a warning (its numbers are not
# comparable with the docs').
FINGERPRINTS = {0: "2019c59c6beba38e3dff2b6e8a618d3bf5fc39cc3f7215bcf552da53cec531dd"}
#: Fixed seed of the UCI half and train/test splits (independent of the generation seed).
SPLIT_SEED = 20220321
#: Augmented renders of every UCI base image.
UCI_COPIES = 3
#: Images per split of each synthetic domain (balanced over the 10 classes).
SYN_SIZES: dict[str, int] = {"train": 4000, "test": 2000}

_LUMA = np.array([0.299, 0.587, 0.114])
_S = IMAGE_SIZE

Tick = Callable[[int], None]


# --------------------------------------------------------------------------- UCI split


def _stratified_halves(
    labels: np.ndarray, index: np.ndarray, rng: np.random.Generator, flip: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Split ``index`` in two halves per class; odd counts alternate which half gets one more."""
    first, second = [], []
    for c in range(NUM_CLASSES):
        idx = rng.permutation(index[labels[index] == c])
        n = len(idx) // 2 + (len(idx) % 2) * int((c % 2 == 0) != flip)
        first.append(idx[:n])
        second.append(idx[n:])
    return np.sort(np.concatenate(first)), np.sort(np.concatenate(second))


def _subsample(labels: np.ndarray, index: np.ndarray, scale: float) -> np.ndarray:
    if scale >= 1.0:
        return index
    keep = [
        index[labels[index] == c][: max(1, math.ceil(scale * (labels[index] == c).sum()))]
        for c in range(NUM_CLASSES)
    ]
    return np.sort(np.concatenate(keep))


def uci_base_indices(scale: float = 1.0) -> dict[str, dict[str, np.ndarray]]:
    """Indices into ``sklearn.datasets.load_digits()`` of the UCI base images per domain/split.

    Fixed by :data:`SPLIT_SEED` (independent of the generation seed): the 1797 images are
    split in two class-stratified halves (``uci``, ``uci_m``), each half 50/50 into train and
    test, before any augmentation.

    Args:
        scale: keep only the first ``ceil(scale * n_c)`` base images of each class per split
            (for reduced test builds); 1.0 keeps all.

    Returns:
        ``{"uci": {"train": idx, "test": idx}, "uci_m": {...}}``, sorted int64 arrays.

    Example:
        >>> b = uci_base_indices()
        >>> len(set(b["uci"]["train"]) & set(b["uci"]["test"]))
        0
    """
    labels = _uci_labels()
    rng = np.random.default_rng(SPLIT_SEED)
    half_a, half_b = _stratified_halves(labels, np.arange(len(labels)), rng, flip=False)
    out: dict[str, dict[str, np.ndarray]] = {}
    for domain, half, flip in (("uci", half_a, False), ("uci_m", half_b, True)):
        train, test = _stratified_halves(labels, half, rng, flip=flip)
        out[domain] = {
            "train": _subsample(labels, train, scale).astype(np.int64),
            "test": _subsample(labels, test, scale).astype(np.int64),
        }
    return out


def base_indices(domain: str, split: str, scale: float = 1.0) -> np.ndarray:
    """UCI base-image index of every image of a ``uci``/``uci_m`` split, aligned with its arrays.

    Image ``i`` of the split is an augmented render of ``load_digits().images[result[i]]``.

    Args:
        domain: ``"uci"`` or ``"uci_m"``.
        split: ``"train"`` or ``"test"``.
        scale: as in :func:`build_minidigits`.

    Returns:
        int64 array of length ``UCI_COPIES * n_base``.
    """
    return np.repeat(uci_base_indices(scale)[domain][split], UCI_COPIES)


def _uci_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.float32) * (255.0 / 16.0), d.target.astype(np.int64)


def _uci_labels() -> np.ndarray:
    return _uci_digits()[1]


# --------------------------------------------------------------------------- renderers


def _render_uci_digit(img8: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """8x8 digit in [0, 255] -> 32x32 float32, ~24 px tall, random small affine, bilinear."""
    scale = 3.0 * rng.uniform(0.85, 1.1)  # 8 px -> ~24 px
    theta = np.deg2rad(rng.uniform(-10.0, 10.0))
    tx, ty = rng.uniform(-2.0, 2.0, size=2)
    cos, sin = math.cos(theta) / scale, math.sin(theta) / scale
    c_in, c_out = 4.0, _S / 2.0  # continuous centres (PIL samples pixel centres at +0.5)
    ox, oy = c_out + tx, c_out + ty
    # inverse map: input = c_in + R(-theta) (output - c_out - t) / scale
    coeffs = (cos, sin, c_in - cos * ox - sin * oy, -sin, cos, c_in + sin * ox - cos * oy)
    im = Image.fromarray(img8.astype(np.float32), mode="F")
    out = im.transform((_S, _S), Image.AFFINE, coeffs, resample=Image.BILINEAR)
    return np.clip(np.asarray(out, dtype=np.float32), 0.0, 255.0)


def _luma(c: np.ndarray) -> float:
    return float(np.asarray(c, dtype=np.float64) @ _LUMA)


def _contrasting(rng: np.random.Generator, ref_luma: float, min_diff: float) -> np.ndarray:
    """A random RGB colour whose luminance differs from ``ref_luma`` by at least ``min_diff``."""
    for _ in range(100):
        c = rng.uniform(0, 255, size=3)
        if abs(_luma(c) - ref_luma) >= min_diff:
            return c
    v = 255.0 if ref_luma < 128 else 0.0  # unreachable in practice: fall back to white/black
    return np.full(3, v)


def _scaled_glyph(
    font: Path, digit: int, angle: float, height: float, max_width: float
) -> Image.Image:
    g = _render.glyph(str(font), digit)
    if angle:
        g = g.rotate(angle, resample=Image.BICUBIC, expand=True)
        g = g.crop(g.getbbox())
    s = min(height / g.height, max_width / g.width)
    return g.resize((max(1, round(g.width * s)), max(1, round(g.height * s))), Image.LANCZOS)


def _finish(
    img: np.ndarray, rng: np.random.Generator, blur: tuple[float, float], noise: tuple[float, float]
) -> np.ndarray:
    """Gaussian blur + Gaussian noise, to uint8 (32, 32, 3)."""
    im = Image.fromarray(np.clip(np.round(img), 0, 255).astype(np.uint8))
    sigma = rng.uniform(*blur)
    if sigma > 0.05:
        im = im.filter(ImageFilter.GaussianBlur(sigma))
    out = np.asarray(im, dtype=np.float32)
    out = out + rng.normal(0.0, rng.uniform(*noise), size=out.shape)
    return np.clip(np.round(out), 0, 255).astype(np.uint8)


def _render_syn(digit: int, rng: np.random.Generator, fonts: list[Path]) -> np.ndarray:
    """SynDigits recipe: one digit, random font/size/position/rotation, gradient background."""
    font = fonts[int(rng.integers(len(fonts)))]
    g = _scaled_glyph(font, digit, rng.uniform(-15.0, 15.0), rng.uniform(16.0, 28.0), 28.0)
    x0 = int(np.clip(round(_S / 2 + rng.uniform(-3, 3) - g.width / 2), 0, _S - g.width))
    y0 = int(np.clip(round(_S / 2 + rng.uniform(-3, 3) - g.height / 2), 0, _S - g.height))
    canvas = Image.new("L", (_S, _S), 0)
    canvas.paste(g, (x0, y0))
    mask = np.asarray(canvas, dtype=np.float32)[:, :, None] / 255.0

    fg = rng.uniform(0, 255, size=3)
    bg1 = _contrasting(rng, _luma(fg), 80.0)
    bg2 = np.clip(bg1 + rng.normal(0.0, 40.0, size=3), 0, 255)
    if abs(_luma(bg2) - _luma(fg)) < 80.0:
        bg2 = bg1
    phi = rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:_S, 0:_S].astype(np.float32) - (_S - 1) / 2
    t = np.clip((xx * np.cos(phi) + yy * np.sin(phi)) / _S + 0.5, 0, 1)[:, :, None]
    bg = bg1 * (1 - t) + bg2 * t
    img = bg * (1 - mask) + fg * mask
    return _finish(img, rng, blur=(0.0, 1.0), noise=(0.0, 3.0))


def _render_syn_m(
    digit: int, rng: np.random.Generator, fonts: list[Path], photos: list[tuple[str, np.ndarray]]
) -> np.ndarray:
    """SVHN recipe: centred digit with partial neighbours, photo/plate background, clutter."""
    font = fonts[int(rng.integers(len(fonts)))]
    height = rng.uniform(15.0, 26.0)
    ref = _render.glyph(str(font), digit)
    s = height / ref.height
    gap = rng.uniform(0.05, 0.35) * height
    digits = [digit]
    left = int(rng.integers(10)) if rng.random() < 0.85 else None
    right = int(rng.integers(10)) if rng.random() < 0.85 else None
    glyphs = []
    for d in (left, digit, right):
        if d is None:
            glyphs.append(None)
            continue
        g = _render.glyph(str(font), d)
        glyphs.append(
            g.resize((max(1, round(g.width * s)), max(1, round(g.height * s))), Image.LANCZOS)
        )
        digits.append(d)
    centre = glyphs[1]
    pad = _S
    width = 2 * pad + centre.width + 2 * (28 + int(gap) + 1)
    strip = Image.new("L", (width, 2 * pad + centre.height), 0)
    cx = width // 2
    top = pad
    strip.paste(centre, (cx - centre.width // 2, top))
    if glyphs[0] is not None:
        g = glyphs[0]
        strip.paste(
            g, (cx - centre.width // 2 - int(round(gap)) - g.width, top + centre.height - g.height)
        )
    if glyphs[2] is not None:
        g = glyphs[2]
        strip.paste(
            g,
            (
                cx - centre.width // 2 + centre.width + int(round(gap)),
                top + centre.height - g.height,
            ),
        )
    cy = top + centre.height / 2
    strip = strip.rotate(rng.uniform(-8.0, 8.0), resample=Image.BILINEAR, center=(cx, cy))
    jx, jy = rng.uniform(-2.0, 2.0, size=2)
    x0, y0 = int(round(cx + jx - _S / 2)), int(round(cy + jy - _S / 2))
    mask = np.asarray(strip.crop((x0, y0, x0 + _S, y0 + _S)), dtype=np.float32)[:, :, None] / 255

    patch = _photos.random_patch(rng, photos).astype(np.float32)
    plate = rng.uniform(0, 255, size=3)
    a = rng.uniform(0.25, 0.75)
    bg_im = Image.fromarray(np.round((1 - a) * patch + a * plate).astype(np.uint8))
    draw = ImageDraw.Draw(bg_im)
    for _ in range(int(rng.integers(0, 4))):  # clutter: lines and box edges behind the digits
        x1, y1, x2, y2 = (float(v) for v in rng.uniform(-4, _S + 4, size=4))
        colour = tuple(int(v) for v in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            draw.line((x1, y1, x2, y2), fill=colour, width=int(rng.integers(1, 3)))
        else:
            draw.rectangle((min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)), outline=colour)
    bg = np.asarray(bg_im, dtype=np.float32)
    fg = _contrasting(rng, _luma(bg.reshape(-1, 3).mean(0)), 60.0)
    img = bg * (1 - mask) + fg * mask
    img = img * rng.uniform(0.75, 1.25, size=3)  # colour tint
    img = (img - 128.0) * rng.uniform(0.7, 1.1) + 128.0 + rng.uniform(-20.0, 20.0)
    if rng.random() < 0.3:  # low-resolution capture
        lo = int(rng.integers(16, 25))
        im = Image.fromarray(np.clip(np.round(img), 0, 255).astype(np.uint8))
        im = im.resize((lo, lo), Image.BILINEAR).resize((_S, _S), Image.BILINEAR)
        img = np.asarray(im, dtype=np.float32)
    return _finish(img, rng, blur=(0.3, 1.2), noise=(2.0, 8.0))


# --------------------------------------------------------------------------- domain builders


def _rng(seed: int, domain: str, split: str) -> np.random.Generator:
    key = [int(seed), DOMAINS.index(domain), SPLITS.index(split), RECIPE_VERSION]
    return np.random.default_rng(np.random.SeedSequence(key))


def _build_uci(
    domain: str, split: str, seed: int, scale: float, tick: Tick
) -> tuple[np.ndarray, np.ndarray]:
    images8, targets = _uci_digits()
    base = base_indices(domain, split, scale)
    rng = _rng(seed, domain, split)
    photos = _photos.domain_photos("uci_m") if domain == "uci_m" else None
    out = np.empty((len(base), 3, _S, _S), dtype=np.uint8)
    for i, b in enumerate(base):
        digit = _render_uci_digit(images8[b], rng)
        if photos is None:
            img = np.repeat(digit[None], 3, axis=0)
        else:  # MNIST-M blend: |patch - digit| per channel
            patch = _photos.random_patch(rng, photos).astype(np.float32)
            img = np.abs(patch - digit[:, :, None]).transpose(2, 0, 1)
        out[i] = np.clip(np.round(img), 0, 255).astype(np.uint8)
        if i % 100 == 99:
            tick(100)
    tick(len(base) % 100)
    return out, targets[base].copy()


def _syn_count(split: str, scale: float) -> int:
    per_class = max(1, int(round(SYN_SIZES[split] * scale / NUM_CLASSES)))
    return per_class * NUM_CLASSES


def _build_syn(
    domain: str, split: str, seed: int, scale: float, tick: Tick
) -> tuple[np.ndarray, np.ndarray]:
    n = _syn_count(split, scale)
    rng = _rng(seed, domain, split)
    labels = rng.permutation(np.repeat(np.arange(NUM_CLASSES, dtype=np.int64), n // NUM_CLASSES))
    fonts = _render.domain_fonts()[domain]
    photos = _photos.domain_photos("syn_m") if domain == "syn_m" else None
    out = np.empty((n, 3, _S, _S), dtype=np.uint8)
    for i, y in enumerate(labels):
        if photos is None:
            img = _render_syn(int(y), rng, fonts)
        else:
            img = _render_syn_m(int(y), rng, fonts, photos)
        out[i] = img.transpose(2, 0, 1)
        if i % 100 == 99:
            tick(100)
    tick(n % 100)
    return out, labels


def split_sizes(scale: float = 1.0) -> dict[str, dict[str, int]]:
    """Number of images of every domain/split for a given build ``scale``.

    Args:
        scale: as in :func:`build_minidigits`.

    Returns:
        ``{domain: {"train": n, "test": n}}``.

    Example:
        >>> split_sizes()["syn_m"]
        {'train': 4000, 'test': 2000}
    """
    base = uci_base_indices(scale)
    return {
        d: {s: UCI_COPIES * len(base[d][s]) if d in base else _syn_count(s, scale) for s in SPLITS}
        for d in DOMAINS
    }


def build_minidigits(
    seed: int = 0, scale: float = 1.0, progress: bool = False
) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Build all four MiniDigits domains in memory (pure: no disk access).

    Args:
        seed: generation seed (augmentation, fonts, colours, patches). The UCI halves and
            train/test splits do not depend on it (see :data:`SPLIT_SEED`).
        scale: size factor for reduced builds (tests); 1.0 gives the documented sizes.
        progress: show a tqdm progress bar.

    Returns:
        ``{domain: {"train": (images, labels), "test": (images, labels)}}`` with images uint8
        ``(N, 3, 32, 32)`` and labels int64 ``(N,)``, domains in :data:`DOMAINS` order.

    Example:
        >>> data = build_minidigits(seed=0, scale=0.02)
        >>> data["syn"]["train"][0].shape
        (80, 3, 32, 32)
    """
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    total = sum(n for sizes in split_sizes(scale).values() for n in sizes.values())
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="building MiniDigits", unit="img")

    def tick(n: int) -> None:
        if bar is not None and n:
            bar.update(n)

    out: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    try:
        for domain in DOMAINS:
            build = _build_uci if domain in ("uci", "uci_m") else _build_syn
            out[domain] = {split: build(domain, split, seed, scale, tick) for split in SPLITS}
    finally:
        if bar is not None:
            bar.close()
    return out


# --------------------------------------------------------------------------- cache


def default_root() -> Path:
    """Cache folder: ``$HYPERGRAD_DATA/minidigits``, else ``~/.cache/hypergrad/minidigits``."""
    base = os.environ.get("HYPERGRAD_DATA")
    root = Path(base) if base else Path.home() / ".cache" / "hypergrad"
    return root / "minidigits"


def cache_path(root: str | Path | None = None, seed: int = 0, scale: float = 1.0) -> Path:
    """Path of the cache file for ``seed`` (and ``scale``) under ``root``."""
    root = Path(root) if root is not None else default_root()
    suffix = "" if scale == 1.0 else f"-scale{scale:g}"
    return root / f"minidigits-v{RECIPE_VERSION}-seed{int(seed)}{suffix}.npz"


def _checksum(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for key in sorted(arrays):
        a = np.ascontiguousarray(arrays[key])
        h.update(f"{key}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def fingerprint(seed: int = 0, scale: float = 1.0) -> str:
    """The SHA-256 content checksum of a fresh build (the ``checksum`` its cache stores)."""
    return _checksum(_to_arrays(build_minidigits(seed, scale=scale), seed, scale))


def _check_fingerprint(arrays: dict[str, np.ndarray], seed: int, scale: float) -> None:
    expected = FINGERPRINTS.get(int(seed)) if scale == 1.0 else None
    got = _checksum(arrays)
    if expected is not None and got != expected:
        warnings.warn(
            f"this machine built a MiniDigits (seed {seed}) whose checksum {got[:12]}... differs "
            f"from the published {expected[:12]}...: the images differ (package versions?), so "
            "accuracies are not comparable with docs/bort2.md",
            stacklevel=3,
        )


def _meta(seed: int, scale: float) -> str:
    fonts = _render.domain_fonts()
    return json.dumps(
        {
            "name": "minidigits",
            "recipe_version": RECIPE_VERSION,
            "seed": int(seed),
            "scale": float(scale),
            "split_seed": SPLIT_SEED,
            "domains": list(DOMAINS),
            "fonts": {d: [p.name for p in fonts[d]] for d in fonts},
            "photos": {d: list(v) for d, v in _photos.PHOTO_SPLIT.items()},
        },
        sort_keys=True,
    )


def _to_arrays(
    data: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]], seed: int, scale: float
) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {"meta": np.array(_meta(seed, scale))}
    for domain, splits in data.items():
        for split, (x, y) in splits.items():
            arrays[f"{domain}/{split}/images"] = x
            arrays[f"{domain}/{split}/labels"] = y
            if domain in ("uci", "uci_m"):
                arrays[f"{domain}/{split}/base_index"] = base_indices(domain, split, scale)
    return arrays


def _write_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(arrays, checksum=np.array(_checksum(arrays)))
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is a shared, readable artefact
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_cache(path: str | Path, seed: int, scale: float = 1.0) -> dict[str, np.ndarray] | None:
    """Read and verify a cache file.

    Args:
        path: the ``.npz`` file.
        seed: expected generation seed.
        scale: expected scale.

    Returns:
        The stored arrays (without the checksum), or ``None`` if the file is missing,
        unreadable, truncated, fails its checksum, or was built by another recipe/seed/scale.
    """
    got = _read_cache(path, seed, scale)
    return None if got is None else got[0]


def _read_cache(
    path: str | Path, seed: int, scale: float
) -> tuple[dict[str, np.ndarray], str] | None:
    """:func:`read_cache` and the verified content checksum."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        stored = str(arrays.pop("checksum"))
        if stored != _checksum(arrays):
            raise ValueError("checksum mismatch")
        meta = json.loads(str(arrays["meta"]))
        if (
            meta.get("recipe_version") != RECIPE_VERSION
            or meta.get("seed") != int(seed)
            or meta.get("scale") != float(scale)
        ):
            raise ValueError("built by another recipe version, seed or scale")
        for d in DOMAINS:
            for s in SPLITS:
                x, y = arrays[f"{d}/{s}/images"], arrays[f"{d}/{s}/labels"]
                if x.dtype != np.uint8 or x.shape[1:] != (3, _S, _S) or y.shape != (len(x),):
                    raise ValueError(f"bad arrays for {d}/{s}")
    except Exception as exc:  # noqa: BLE001 - any failure means "rebuild"
        warnings.warn(f"MiniDigits cache {path} is invalid ({exc}); rebuilding it", stacklevel=3)
        return None
    return arrays, stored


def _check_cached_fingerprint(path: Path, checksum: str, seed: int, scale: float) -> None:
    """Warn when a cache that verifies against its own stored checksum is not the published
    build: its contents were changed and the checksum recomputed (or it was built elsewhere by
    other package versions), so accuracies on it are not comparable with the docs."""
    expected = FINGERPRINTS.get(int(seed)) if scale == 1.0 else None
    if expected is None or checksum == expected:
        return
    warnings.warn(
        f"MiniDigits cache {path} (seed {seed}) has the content checksum {checksum[:12]}..., "
        f"not the published {expected[:12]}... (docs/minidigits.md): its images or labels "
        "differ from the published build, so accuracies are not comparable with "
        f"docs/bort2.md. Delete {path} (or pass rebuild=True) to rebuild it",
        stacklevel=3,
    )


def load_minidigits(
    root: str | Path | None = None,
    seed: int = 0,
    rebuild: bool = False,
    progress: bool = True,
    *,
    scale: float = 1.0,
) -> Benchmark:
    """Load MiniDigits, building and caching it on first use.

    The benchmark is cached as one ``.npz`` per seed under ``root`` (written to a temporary
    file, then moved into place with :func:`os.replace`), with a SHA-256 checksum of its
    contents. A missing, truncated or otherwise corrupt file is rebuilt. A full-size cache
    whose contents are not the published build of its seed (:data:`FINGERPRINTS`; e.g. its
    labels were edited and its checksum recomputed) is used, with a warning naming the file.

    Args:
        root: cache folder; default ``$HYPERGRAD_DATA/minidigits`` or
            ``~/.cache/hypergrad/minidigits``.
        seed: generation seed.
        rebuild: rebuild even if a valid cache exists.
        progress: show a progress bar while building.
        scale: size factor for reduced builds (tests); 1.0 gives the documented sizes.

    Returns:
        A :class:`~bort2.data.base.Benchmark` named ``"minidigits"`` with 10 classes, image
        size 32 and domains ``uci, uci_m, syn, syn_m``, each with ``"train"`` and ``"test"``
        :class:`~bort2.data.base.ArrayDomain` splits.

    Example:
        >>> import tempfile
        >>> bench = load_minidigits(tempfile.mkdtemp(), scale=0.02, progress=False)
        >>> bench.domains
        ['uci', 'uci_m', 'syn', 'syn_m']
        >>> image, label = bench.split("syn_m", "test")[0]
        >>> tuple(image.shape), image.dtype
        ((3, 32, 32), torch.uint8)
    """
    path = cache_path(root, seed, scale)
    got = None if rebuild else _read_cache(path, seed, scale)
    arrays = None
    if got is not None:
        arrays, checksum = got
        _check_cached_fingerprint(path, checksum, seed, scale)
    if arrays is None:
        data = build_minidigits(seed, scale=scale, progress=progress)
        arrays = _to_arrays(data, seed, scale)
        _check_fingerprint(arrays, seed, scale)
        _write_atomic(path, arrays)
    splits = {
        d: {
            s: ArrayDomain(
                torch.from_numpy(np.ascontiguousarray(arrays[f"{d}/{s}/images"])),
                torch.from_numpy(arrays[f"{d}/{s}/labels"].astype(np.int64)),
            )
            for s in SPLITS
        }
        for d in DOMAINS
    }
    return Benchmark(
        name="minidigits", num_classes=NUM_CLASSES, image_size=IMAGE_SIZE, splits=splits
    )
