"""DomainNet loader: the public per-domain image folders and split files -> ``Benchmark``.

Owns parsing ``<domain>_{train,test}.txt`` (0-based labels, 345 classes), checking that every
class name maps to one label across all files read, optionally checking the files on disk, and
building :class:`~bort2.data.base.FileDomain` splits. Conventions: ``docs/datasets.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .base import Benchmark, FileDomain

__all__ = ["DOMAINNET_DOMAINS", "DOMAINNET_NUM_CLASSES", "load_domainnet"]

DOMAINNET_DOMAINS: tuple[str, ...] = (
    "clipart",
    "infograph",
    "painting",
    "quickdraw",
    "real",
    "sketch",
)
DOMAINNET_NUM_CLASSES = 345

LAYOUT = """\
<root>/
  clipart/ infograph/ painting/ quickdraw/ real/ sketch/
    <class>/<file>.jpg           345 class folders per domain (aircraft_carrier ... zigzag)
  <domain>_train.txt             one line per image: <domain>/<class>/<file>.jpg <label 0..344>
  <domain>_test.txt              (the split files may also sit in <root>/splits/)"""


def _layout_error(problem: str) -> str:
    return f"DomainNet: {problem}\nExpected layout:\n{LAYOUT}"


def _split_file(root: Path, domain: str, split: str) -> Path:
    name = f"{domain}_{split}.txt"
    for cand in (root / name, root / "splits" / name):
        if cand.is_file():
            return cand
    raise FileNotFoundError(_layout_error(f"missing split file {root / name}."))


def _read_split(
    path: Path,
    root: Path,
    domain: str,
    class_of_label: dict[int, str],
    verify_files: bool,
) -> list[tuple[Path, int]]:
    """Parse one split file into ``(image path, label)`` pairs, checking label consistency."""
    items: list[tuple[Path, int]] = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        where = f"{path}, line {lineno}: {line.strip()!r}"
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
            raise ValueError(
                _layout_error(
                    f"malformed line in {where}; expected "
                    "'<domain>/<class>/<file>.jpg <label 0..344>'."
                )
            )
        rel, label = parts[0], int(parts[1])
        if not 0 <= label < DOMAINNET_NUM_CLASSES:
            raise ValueError(_layout_error(f"label {label} outside 0..344 in {where}."))
        segs = rel.split("/")
        if len(segs) != 3 or segs[0] != domain:
            raise ValueError(
                _layout_error(f"path in {where} is not of the form '{domain}/<class>/<file>'.")
            )
        known = class_of_label.setdefault(label, segs[1])
        if known != segs[1]:
            raise ValueError(
                _layout_error(
                    f"label {label} names class {segs[1]!r} in {where}, but {known!r} elsewhere."
                )
            )
        file = root / rel
        if verify_files and not file.is_file():
            raise FileNotFoundError(_layout_error(f"missing image {file} (listed in {where})."))
        items.append((file, label))
    if not items:
        raise ValueError(_layout_error(f"split file {path} lists no images."))
    return items


def load_domainnet(
    root: str | Path,
    image_size: int = 224,
    domains: Sequence[str] | None = None,
    verify_files: bool = True,
) -> Benchmark:
    """Load DomainNet (6 domains, 345 classes) from its image folders and split files.

    The ``"train"`` and ``"test"`` splits of a domain are ``<domain>_train.txt`` and
    ``<domain>_test.txt`` with their 0-based labels as given. Every label must name the same
    class folder in all files read. Images are decoded lazily and resized to ``image_size``.

    Args:
        root: the DomainNet folder holding the domain folders and the split files.
        image_size: side ``S`` of the returned square images.
        domains: subset of :data:`DOMAINNET_DOMAINS` (default: all six).
        verify_files: check that every listed image exists (one stat per image, about
            600,000 for the whole benchmark).

    Returns:
        A :class:`Benchmark` named ``"domainnet"`` with 345 classes and FileDomain splits.

    Raises:
        FileNotFoundError: ``root``, a domain folder, a split file or an image is missing.
        ValueError: a split line is malformed, or its label or path is inconsistent.

    Example:
        >>> bench = load_domainnet("data/DomainNet", domains=["real"])  # doctest: +SKIP
        >>> bench.num_classes  # doctest: +SKIP
        345
    """
    domains = list(DOMAINNET_DOMAINS if domains is None else domains)
    unknown = [d for d in domains if d not in DOMAINNET_DOMAINS]
    if unknown:
        raise ValueError(f"unknown DomainNet domain(s) {unknown}; valid: {list(DOMAINNET_DOMAINS)}")
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(_layout_error(f"data root {root} does not exist."))
    bench = Benchmark(
        name="domainnet", num_classes=DOMAINNET_NUM_CLASSES, image_size=int(image_size)
    )
    class_of_label: dict[int, str] = {}
    for domain in domains:
        if not (root / domain).is_dir():
            raise FileNotFoundError(_layout_error(f"missing domain folder {root / domain}."))
        bench.splits[domain] = {}
        for split in ("train", "test"):
            path = _split_file(root, domain, split)
            items = _read_split(path, root, domain, class_of_label, verify_files)
            bench.splits[domain][split] = FileDomain(items, image_size)
    return bench
