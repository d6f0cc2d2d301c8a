"""``data.check=true``: validate a benchmark folder with the real loaders and count its images.

Owns the dry run of ``run.py ... data.check=true``: it loads the benchmark exactly as a training
run does (:func:`bort2.data.registry.load_from_config`, hence the loaders of
``bort2/data/*.py`` with their layout and split-file checks; PACS and DomainNet also check that
every listed image exists), decodes a few images of every split (first, middle and last) to
catch unreadable files, and prints images and classes per domain and split, plus the authors'
epoch length for each target.
Nothing is trained and nothing is written to ``output_dir``.

A missing or malformed folder, file or split line gives exit status 2 and one line on stderr
naming it (the loaders' messages; the expected trees are in ``docs/datasets.md``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import Config
from .base import Benchmark
from .registry import load_from_config

__all__ = [
    "CheckReport",
    "DataCheckError",
    "SplitCount",
    "check_data",
    "format_report",
    "run_check",
]

#: images decoded per split (first, middle, last): readable files of the right shape
DECODE_PER_SPLIT = 3

#: Dassl repeats the USPS training set 3 times when it is a source, so that epochs over the
#: sources have similar lengths (Zhongying-Deng/BORT2 dassl/data/datasets/da/digit5.py:61)
AUTHORS_REPEAT: dict[tuple[str, str], int] = {("digit5", "usps"): 3}


class DataCheckError(ValueError):
    """A dataset folder that cannot be used; the message is one line naming what is wrong."""


@dataclass
class SplitCount:
    """Images and distinct labels of one (domain, split)."""

    domain: str
    split: str
    images: int
    classes: int


@dataclass
class CheckReport:
    """What :func:`check_data` found."""

    benchmark: str
    root: str | None
    image_size: int
    num_classes: int
    counts: list[SplitCount] = field(default_factory=list)
    decoded: int = 0

    def count(self, domain: str, split: str) -> int:
        for c in self.counts:
            if (c.domain, c.split) == (domain, split):
                return c.images
        raise KeyError((domain, split))

    @property
    def domains(self) -> list[str]:
        return list(dict.fromkeys(c.domain for c in self.counts))


def _one_line(exc: BaseException) -> str:
    """The first line of a loader's message (the problem; the expected tree follows it)."""
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, KeyError) and text.startswith(("'", '"')):
        text = text[1:-1]
    return text.splitlines()[0].strip()


def _sample(n: int, k: int = DECODE_PER_SPLIT) -> list[int]:
    """Up to ``k`` indices spread over ``range(n)``: first, middle, last."""
    if n <= 0:
        return []
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _describe_item(ds, i: int) -> str:
    items = getattr(ds, "items", None)
    if items is not None:
        return str(items[i][0])
    return f"item {i}"


def _check_split(bench: Benchmark, domain: str, split: str) -> tuple[SplitCount, int]:
    ds = bench.split(domain, split)
    n = len(ds)
    if n == 0:
        raise DataCheckError(f"{bench.name}: the {split} split of domain {domain!r} is empty")
    labels = getattr(ds, "labels", None)
    if labels is None:
        labels = torch.tensor([int(ds[i][1]) for i in range(n)])
    labels = torch.as_tensor(labels)
    if int(labels.min()) < 0 or int(labels.max()) >= bench.num_classes:
        raise DataCheckError(
            f"{bench.name}: domain {domain!r} {split} has labels outside 0..{bench.num_classes - 1}"
        )
    size = bench.image_size
    decoded = 0
    for i in _sample(n):
        try:
            image, _ = ds[i]
        except (OSError, ValueError, RuntimeError) as exc:  # PIL: UnidentifiedImageError etc.
            raise DataCheckError(
                f"{bench.name}: cannot decode {_describe_item(ds, i)} ({domain} {split}): "
                f"{_one_line(exc)}"
            ) from None
        if image.dtype != torch.uint8 or tuple(image.shape) != (3, size, size):
            raise DataCheckError(
                f"{bench.name}: {_describe_item(ds, i)} ({domain} {split}) gave "
                f"{image.dtype} {tuple(image.shape)}, expected uint8 (3, {size}, {size})"
            )
        decoded += 1
    return SplitCount(domain, split, n, int(torch.unique(labels).numel())), decoded


def check_data(cfg: Config) -> CheckReport:
    """Load ``cfg.data`` as a training run would and count images per domain and split.

    Args:
        cfg: the run configuration (``data.benchmark``, ``data.root``, ``data.image_size``).

    Returns:
        A :class:`CheckReport`.

    Raises:
        DataCheckError: one line naming the missing or malformed folder, file, line or image.
    """
    try:
        bench = load_from_config(cfg)
    except (FileNotFoundError, ValueError, KeyError, OSError) as exc:
        raise DataCheckError(_one_line(exc)) from None
    report = CheckReport(
        benchmark=bench.name,
        root=None if cfg.data.root is None else str(Path(cfg.data.root).expanduser()),
        image_size=bench.image_size,
        num_classes=bench.num_classes,
    )
    for domain in bench.domains:
        for split in ("train", "test"):
            count, decoded = _check_split(bench, domain, split)
            report.counts.append(count)
            report.decoded += decoded
    return report


def _epoch_lines(report: CheckReport, cfg: Config, targets: list[str]) -> list[str]:
    """Per target: the authors' epoch (Dassl's RandomDomainSampler ends an epoch when the
    smallest source domain runs out) and this config's budgets in those epochs."""
    k = cfg.step1.batch_per_domain
    lines = []
    for target in targets:
        sources = [d for d in report.domains if d != target]
        if not sources:
            continue
        sizes = {
            d: report.count(d, "train") * AUTHORS_REPEAT.get((report.benchmark, d), 1)
            for d in sources
        }
        smallest = min(sizes, key=sizes.__getitem__)
        per_epoch = sizes[smallest] // k
        rep = AUTHORS_REPEAT.get((report.benchmark, smallest), 1)
        what = f"{sizes[smallest] // rep:,} x {rep}" if rep > 1 else f"{sizes[smallest]:,}"
        line = (
            f"target {target}: smallest source train split {smallest} ({what}) / "
            f"{k} per domain = {per_epoch:,} iterations per epoch"
        )
        if per_epoch > 0:
            line += (
                f"; step1.iters {cfg.step1.iters:,} = {cfg.step1.iters / per_epoch:.1f} epochs, "
                f"step2.iters {cfg.step2.iters:,} = {cfg.step2.iters / per_epoch:.1f} epochs"
            )
        lines.append(line)
    return lines


def format_report(report: CheckReport, cfg: Config | None = None, targets=None) -> str:
    """The report as a plain-text table (and, with ``cfg``, the epoch lengths per target)."""
    where = report.root if report.root is not None else "(default cache)"
    head = (
        f"{report.benchmark} at {where}: {len(report.domains)} domains, "
        f"{report.num_classes} classes, images resized to {report.image_size}x{report.image_size}"
    )
    rows = [("domain", "train", "test", "classes (train)", "classes (test)")]
    tot = {"train": 0, "test": 0}
    for d in report.domains:
        c = {s: next(x for x in report.counts if x.domain == d and x.split == s) for s in tot}
        for s in tot:
            tot[s] += c[s].images
        rows.append(
            (
                d,
                f"{c['train'].images:,}",
                f"{c['test'].images:,}",
                f"{c['train'].classes}/{report.num_classes}",
                f"{c['test'].classes}/{report.num_classes}",
            )
        )
    rows.append(("total", f"{tot['train']:,}", f"{tot['test']:,}", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head, ""]
    for j, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [r[i].rjust(widths[i]) for i in range(1, len(r))]
        lines.append("  ".join(cells).rstrip())
        if j == 0 or j == len(rows) - 2:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    if cfg is not None and targets:
        lines.extend(_epoch_lines(report, cfg, list(targets)))
    lines.append(
        f"OK: every split loaded ({report.decoded} images decoded); nothing was trained or written."
    )
    return "\n".join(lines)


def run_check(cfg: Config, targets: list[str] | None = None) -> int:
    """``run.py ... data.check=true``: print the report (exit status 0) or one error line (2)."""
    try:
        report = check_data(cfg)
    except DataCheckError as exc:
        print(
            f"error: data.check: {exc} (expected layouts: docs/datasets.md)",
            file=sys.stderr,
        )
        return 2
    print(format_report(report, cfg, targets))
    return 0
