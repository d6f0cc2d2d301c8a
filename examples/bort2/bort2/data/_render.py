"""Digit glyphs from the fonts matplotlib ships, and the shape check that validates them.

Owns: locating matplotlib's bundled TrueType fonts, rendering one digit as an anti-aliased
mask, deciding which fonts really draw the ten digits (:func:`valid_digit_fonts`), and the
fixed split of the valid fonts between the two synthetic MiniDigits domains
(:func:`domain_fonts`).

Several bundled fonts draw nothing, boxes or symbols where a digit should be (the DejaVu
"Display" fonts, STIXNonUni*, STIXSiz*, LastResortHE, cmex10, cmsy10) or old-style numerals
(cmmi10). Bounding boxes cannot tell these apart, so a font is accepted only if its ten renders
are non-empty, pairwise clearly different, and recognised by a nearest-template matcher against
templates from the reference font DejaVuSans. The known-bad fonts are also excluded by name.
"""

from __future__ import annotations

import fnmatch
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

#: Font used to build the recognition templates.
REFERENCE_FONT = "DejaVuSans.ttf"

#: Bundled fonts known to draw empty glyphs, boxes, symbols or old-style numerals for digits.
KNOWN_BAD_FONTS: tuple[str, ...] = (
    "DejaVuSansDisplay.ttf",
    "DejaVuSerifDisplay.ttf",
    "STIXNonUni*.ttf",
    "STIXSiz*.ttf",
    "LastResortHE*.ttf",
    "cmex10.ttf",
    "cmsy10.ttf",
    "cmmi10.ttf",
)

#: Font families per synthetic domain (file-name patterns); disjoint by construction.
FONT_FAMILIES: dict[str, tuple[str, ...]] = {
    "syn": ("DejaVu*.ttf",),
    "syn_m": ("STIX*.ttf", "cm*.ttf"),
}

_RENDER_SIZE = 64  # font size (px) of the cached high-resolution glyphs
_DESC_SIZE = 32  # side of the shape descriptor
_DESC_INNER = 30  # longest side of the glyph inside the descriptor
_MIN_INK_PIXELS = 20  # a render with fewer pixels above 0.5 counts as empty
_MAX_SELF_CORR = 0.93  # two renders of one font correlating above this are "the same shape"
_MIN_RECOGNISED = 9  # digits (out of 10) the template matcher must recognise


def font_dir() -> Path:
    """Return the folder of TrueType fonts that matplotlib ships.

    Returns:
        ``matplotlib.get_data_path()/fonts/ttf``.

    Example:
        >>> (font_dir() / "DejaVuSans.ttf").exists()
        True
    """
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


def is_known_bad(name: str) -> bool:
    """Return whether a font file name matches the known-bad list :data:`KNOWN_BAD_FONTS`."""
    return any(fnmatch.fnmatchcase(name, pat) for pat in KNOWN_BAD_FONTS)


@functools.cache
def _truetype(path: str, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(path, size)


@functools.cache
def glyph(path: str | os.PathLike, digit: int) -> Image.Image:
    """Render one digit as a tight, anti-aliased ``"L"`` mask at a fixed large size.

    Args:
        path: TrueType font file.
        digit: 0..9.

    Returns:
        A PIL ``"L"`` image cropped to the ink (a 1x1 black image if the font draws nothing).
        Cached; callers must not modify it.
    """
    size = _RENDER_SIZE
    font = _truetype(str(path), size)
    canvas = Image.new("L", (3 * size, 3 * size), 0)
    ImageDraw.Draw(canvas).text(
        (1.5 * size, 1.5 * size), str(digit), fill=255, font=font, anchor="mm"
    )
    box = canvas.getbbox()
    if box is None:
        return Image.new("L", (1, 1), 0)
    return canvas.crop(box)


def _deskew(mask: np.ndarray) -> np.ndarray:
    """Shear a mask so that its second-moment slant is zero (italic -> upright)."""
    ys, xs = np.nonzero(mask > 0.2)
    w = mask[ys, xs]
    cy = float((w * ys).sum() / w.sum())
    cx = float((w * xs).sum() / w.sum())
    var_y = float((w * (ys - cy) ** 2).sum() / w.sum())
    if var_y <= 1e-6:
        return mask
    alpha = float((w * (ys - cy) * (xs - cx)).sum() / w.sum()) / var_y
    h, wd = mask.shape
    pad = int(abs(alpha) * h) + 1
    im = Image.fromarray(np.pad(mask, ((0, 0), (pad, pad))).astype(np.float32))
    # output (x, y) samples input (x + alpha * (y - cy), y): removes the slant
    im = im.transform(
        (wd + 2 * pad, h),
        Image.AFFINE,
        (1.0, alpha, -alpha * cy, 0.0, 1.0, 0.0),
        resample=Image.BILINEAR,
    )
    return np.asarray(im, dtype=np.float32)


def shape_descriptor(mask: np.ndarray) -> np.ndarray | None:
    """Stroke-width and slant invariant descriptor of a glyph mask, for template matching.

    Deskews, crops to the ink, scales the longest side to a fixed size (aspect kept), centres,
    skeletonises, re-thickens the skeleton to a fixed width, blurs, and normalises to zero mean
    and unit norm, so that normalised correlation is a dot product.

    Args:
        mask: float array in [0, 1], ink = 1.

    Returns:
        A flat float64 vector, or ``None`` if the mask is (nearly) empty.
    """
    from scipy.ndimage import binary_dilation, gaussian_filter
    from skimage.morphology import skeletonize

    if (mask > 0.5).sum() < _MIN_INK_PIXELS:
        return None
    mask = _deskew(mask)
    ys, xs = np.nonzero(mask > 0.5)
    if len(ys) < _MIN_INK_PIXELS:
        return None
    crop = mask[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    h, w = crop.shape
    s = _DESC_INNER / max(h, w)
    nw, nh = max(1, round(w * s)), max(1, round(h * s))
    small = Image.fromarray(np.clip(crop * 255, 0, 255).astype(np.uint8)).resize(
        (nw, nh), Image.BILINEAR
    )
    canvas = Image.new("L", (_DESC_SIZE, _DESC_SIZE), 0)
    canvas.paste(small, ((_DESC_SIZE - nw) // 2, (_DESC_SIZE - nh) // 2))
    binary = np.asarray(canvas) > 127
    skel = skeletonize(binary)
    thick = binary_dilation(skel, structure=np.array([[0, 1, 0], [1, 1, 1], [0, 1, 0]], bool))
    v = gaussian_filter(thick.astype(np.float64), 1.5).ravel()
    v -= v.mean()
    n = np.linalg.norm(v)
    return v / n if n > 0 else None


@functools.lru_cache(maxsize=1)
def _templates() -> np.ndarray:
    ref = font_dir() / REFERENCE_FONT
    descs = [shape_descriptor(np.asarray(glyph(str(ref), k), np.float32) / 255) for k in range(10)]
    if any(d is None for d in descs):
        raise RuntimeError(f"reference font {ref} does not render the ten digits")
    return np.stack(descs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class FontCheck:
    """Outcome of the shape check of one font.

    Attributes:
        name: font file name.
        nonempty: all ten renders have ink.
        max_self_corr: largest normalised correlation between two different digits of the font
            (near 1: the font draws the same box or symbol for several digits).
        recognised: digits whose nearest DejaVuSans template is the right one (0..10).
        ok: the font passes (non-empty, distinct, recognised >= 9).
    """

    name: str
    nonempty: bool
    max_self_corr: float
    recognised: int
    ok: bool


def check_digit_font(path: str | os.PathLike) -> FontCheck:
    """Check by rendered shapes whether a font draws the ten digits (no name-based exclusion).

    Args:
        path: TrueType font file.

    Returns:
        A :class:`FontCheck`.

    Example:
        >>> check_digit_font(font_dir() / "DejaVuSans.ttf").ok
        True
        >>> check_digit_font(font_dir() / "LastResortHE-Regular.ttf").ok
        False
    """
    name = Path(path).name
    descs = [shape_descriptor(np.asarray(glyph(str(path), k), np.float32) / 255) for k in range(10)]
    if any(d is None for d in descs):
        return FontCheck(name, False, float("nan"), 0, False)
    mat = np.stack(descs)  # type: ignore[arg-type]
    self_corr = mat @ mat.T
    np.fill_diagonal(self_corr, -1.0)
    max_self = float(self_corr.max())
    recognised = int(((mat @ _templates().T).argmax(axis=1) == np.arange(10)).sum())
    ok = max_self < _MAX_SELF_CORR and recognised >= _MIN_RECOGNISED
    return FontCheck(name, True, max_self, recognised, ok)


@functools.lru_cache(maxsize=4)
def _valid_digit_fonts(folder: str) -> tuple[Path, ...]:
    paths = sorted(Path(folder).glob("*.ttf"))
    return tuple(p for p in paths if not is_known_bad(p.name) and check_digit_font(p).ok)


def valid_digit_fonts(folder: str | os.PathLike | None = None) -> list[Path]:
    """Return the fonts in ``folder`` that render the ten digits as recognisable digits.

    A font is kept if it is not on the known-bad list and passes :func:`check_digit_font`.

    Args:
        folder: font folder; default :func:`font_dir`.

    Returns:
        Sorted font paths.

    Example:
        >>> names = [p.name for p in valid_digit_fonts()]
        >>> "DejaVuSans.ttf" in names, "cmmi10.ttf" in names
        (True, False)
    """
    return list(_valid_digit_fonts(str(folder if folder is not None else font_dir())))


def domain_fonts() -> dict[str, list[Path]]:
    """Split the valid fonts between the synthetic domains by family (see :data:`FONT_FAMILIES`).

    Returns:
        ``{"syn": [...], "syn_m": [...]}``, disjoint lists of font paths.

    Raises:
        RuntimeError: if a domain gets no valid font.
    """
    valid = valid_digit_fonts()
    out: dict[str, list[Path]] = {}
    for domain, patterns in FONT_FAMILIES.items():
        fonts = [p for p in valid if any(fnmatch.fnmatchcase(p.name, pat) for pat in patterns)]
        if not fonts:
            raise RuntimeError(
                f"no valid digit font for MiniDigits domain {domain!r} (patterns {patterns}) in "
                f"{font_dir()}; is matplotlib installed with its bundled fonts?"
            )
        out[domain] = fonts
    return out
