"""PACS loader: the public ``kfold`` images and split files -> on-disk ``Benchmark``.

Owns locating the image folder, parsing ``splits/<domain>_{train,crossval,test}_kfold.txt``
(1-based labels), checking every entry against the class list and the files on disk, and
building :class:`~bort2.data.base.FileDomain` splits. Conventions: ``docs/datasets.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .base import Benchmark, FileDomain

__all__ = ["PACS_CLASSES", "PACS_DOMAINS", "PACS_EXCLUDED", "load_pacs"]

PACS_DOMAINS: tuple[str, ...] = ("art_painting", "cartoon", "photo", "sketch")
PACS_CLASSES: tuple[str, ...] = (
    "dog",
    "elephant",
    "giraffe",
    "guitar",
    "horse",
    "house",
    "person",
)
#: Split-file entries dropped on load (Dassl ignores this sketch image as erroneous).
PACS_EXCLUDED: frozenset[str] = frozenset({"sketch/dog/n02103406_4068-1.png"})

LAYOUT = """\
<root>/
  images/kfold/                  (also accepted: <root>/kfold/ or <root>/images/)
    art_painting/ cartoon/ photo/ sketch/
      dog/ elephant/ giraffe/ guitar/ horse/ house/ person/
        <file>.jpg | <file>.png
  splits/
    <domain>_train_kfold.txt     one line per image: <domain>/<class>/<file> <label 1..7>
    <domain>_crossval_kfold.txt
    <domain>_test_kfold.txt"""


def _layout_error(problem: str) -> str:
    return f"PACS: {problem}\nExpected layout:\n{LAYOUT}"


def _image_dir(root: Path, domains: Sequence[str]) -> Path:
    cands = (root / "images" / "kfold", root / "kfold", root / "images")
    for cand in cands:
        if cand.is_dir() and any((cand / d).is_dir() for d in domains):
            return cand
    raise FileNotFoundError(
        _layout_error(
            f"no image folder with domain sub-folders under {root} (looked in "
            + ", ".join(str(c) for c in cands)
            + ")."
        )
    )


def _read_split(
    path: Path, image_dir: Path, domain: str, verify_files: bool = True
) -> list[tuple[Path, int]]:
    """Parse one PACS split file into ``(image path, 0-based label)`` pairs.

    Args:
        path: the split file, lines ``<domain>/<class>/<file> <label 1..7>``.
        image_dir: folder the relative image paths are resolved against.
        domain: the domain every line must belong to.
        verify_files: check that every listed image exists.

    Returns:
        The entries in file order, minus :data:`PACS_EXCLUDED`.

    Raises:
        FileNotFoundError: the split file or a listed image is missing.
        ValueError: a line is malformed, or its label, class or domain is inconsistent.
    """
    if not path.is_file():
        raise FileNotFoundError(_layout_error(f"missing split file {path}."))
    items: list[tuple[Path, int]] = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        where = f"{path}, line {lineno}: {line.strip()!r}"
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
            raise ValueError(
                _layout_error(
                    f"malformed line in {where}; expected '<domain>/<class>/<file> <label 1..7>'."
                )
            )
        rel, label = parts[0], int(parts[1])
        if not 1 <= label <= len(PACS_CLASSES):
            raise ValueError(_layout_error(f"label {label} outside 1..7 in {where}."))
        segs = rel.split("/")
        if len(segs) != 3 or segs[0] != domain:
            raise ValueError(
                _layout_error(f"path in {where} is not of the form '{domain}/<class>/<file>'.")
            )
        if segs[1] != PACS_CLASSES[label - 1]:
            raise ValueError(
                _layout_error(
                    f"class folder {segs[1]!r} does not match label {label} "
                    f"({PACS_CLASSES[label - 1]!r}) in {where}."
                )
            )
        if rel in PACS_EXCLUDED:
            continue
        file = image_dir / rel
        if verify_files and not file.is_file():
            raise FileNotFoundError(_layout_error(f"missing image {file} (listed in {where})."))
        items.append((file, label - 1))
    if not items:
        raise ValueError(_layout_error(f"split file {path} lists no images."))
    return items


def load_pacs(
    root: str | Path,
    image_size: int = 224,
    domains: Sequence[str] | None = None,
    include_crossval: bool = False,
    verify_files: bool = True,
) -> Benchmark:
    """Load PACS (art_painting, cartoon, photo, sketch; 7 classes) from its kfold split files.

    The ``"train"`` split of a domain is ``<domain>_train_kfold.txt`` (plus
    ``<domain>_crossval_kfold.txt`` when ``include_crossval``); ``"test"`` is
    ``<domain>_test_kfold.txt``. Labels in the files are 1-based and become 0-based, in the
    order of :data:`PACS_CLASSES`. Images are decoded lazily and resized to ``image_size``.

    Args:
        root: the PACS folder holding ``images/kfold/`` and ``splits/``.
        image_size: side ``S`` of the returned square images.
        domains: subset of :data:`PACS_DOMAINS` (default: all four).
        include_crossval: append the crossval split to the training split.
        verify_files: check that every listed image exists (a stat per image).

    Returns:
        A :class:`Benchmark` named ``"pacs"`` with 7 classes and FileDomain splits.

    Raises:
        FileNotFoundError: ``root``, the image folder, a split file or an image is missing.
        ValueError: a split line is malformed or inconsistent with the class list.

    Example:
        >>> bench = load_pacs("data/PACS", domains=["photo", "sketch"])  # doctest: +SKIP
        >>> len(bench.split("photo", "test")) > 0  # doctest: +SKIP
        True
    """
    domains = list(PACS_DOMAINS if domains is None else domains)
    unknown = [d for d in domains if d not in PACS_DOMAINS]
    if unknown:
        raise ValueError(f"unknown PACS domain(s) {unknown}; valid: {list(PACS_DOMAINS)}")
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(_layout_error(f"data root {root} does not exist."))
    image_dir = _image_dir(root, domains)
    split_dir = root / "splits"
    bench = Benchmark(name="pacs", num_classes=len(PACS_CLASSES), image_size=int(image_size))
    for domain in domains:
        if not (image_dir / domain).is_dir():
            raise FileNotFoundError(_layout_error(f"missing domain folder {image_dir / domain}."))
        parts = ["train", "crossval"] if include_crossval else ["train"]
        train: list[tuple[Path, int]] = []
        for part in parts:
            train += _read_split(
                split_dir / f"{domain}_{part}_kfold.txt", image_dir, domain, verify_files
            )
        test = _read_split(split_dir / f"{domain}_test_kfold.txt", image_dir, domain, verify_files)
        bench.splits[domain] = {
            "train": FileDomain(train, image_size),
            "test": FileDomain(test, image_size),
        }
    return bench
