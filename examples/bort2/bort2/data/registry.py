"""Benchmark registry: one name -> one loader, imported lazily.

Owns the mapping from the benchmark names used in configs and on the command line
(``minidigits``, ``digit5``, ``pacs``, ``domainnet``) to their loader functions, and
:func:`load_from_config`, the one way a run (and ``--check-data``) loads its benchmark.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # names for annotations only: importing this module loads no torch, so the
    # command line (bort2.cli, through bort2.runner) answers --help and config errors quickly
    from ..config import Config
    from .base import Benchmark

__all__ = ["BENCHMARKS", "benchmark_domains", "load_benchmark", "load_from_config"]

#: name -> (module relative to this package, loader function, whether a data root is required)
_LOADERS: dict[str, tuple[str, str, bool]] = {
    "minidigits": (".minidigits", "load_minidigits", False),
    "digit5": (".digit5", "load_digit5", True),
    "pacs": (".pacs", "load_pacs", True),
    "domainnet": (".domainnet", "load_domainnet", True),
}
_ALIASES = {"digitfive": "digit5", "digits5": "digit5", "minidigit": "minidigits"}

BENCHMARKS: tuple[str, ...] = tuple(_LOADERS)


#: name -> (module, constant holding the benchmark's domain names)
_DOMAINS: dict[str, tuple[str, str]] = {
    "minidigits": (".minidigits", "DOMAINS"),
    "digit5": (".digit5", "DIGIT5_DOMAINS"),
    "pacs": (".pacs", "PACS_DOMAINS"),
    "domainnet": (".domainnet", "DOMAINNET_DOMAINS"),
}


def benchmark_domains(name: str) -> tuple[str, ...]:
    """The domain names of a benchmark, known without loading any data."""
    key = _canonical(name)
    if key not in _DOMAINS:
        raise ValueError(f"unknown benchmark {name!r}; valid names: {', '.join(BENCHMARKS)}")
    module, const = _DOMAINS[key]
    return tuple(getattr(importlib.import_module(module, __package__), const))


def _canonical(name: str) -> str:
    key = str(name).strip().lower().replace("-", "").replace("_", "")
    return _ALIASES.get(key, key)


def load_benchmark(name: str, root: str | Path | None = None, **kw: Any) -> Benchmark:
    """Load a benchmark by name.

    Args:
        name: one of :data:`BENCHMARKS` (case, ``-`` and ``_`` are ignored, so ``"Digit-5"``
            and ``"digit_five"`` also work).
        root: data folder. Optional for ``"minidigits"`` (its cache default is used), required
            for the real benchmarks (see ``docs/datasets.md`` for their layouts).
        **kw: passed on to the loader, e.g. ``image_size``, ``domains``, ``seed``.

    Returns:
        The loader's :class:`Benchmark`.

    Raises:
        ValueError: unknown ``name`` (the message lists the valid names), or ``root`` missing
            for a benchmark that needs one.

    Example:
        >>> bench = load_benchmark("pacs", root="data/PACS", image_size=224)  # doctest: +SKIP
        >>> bench.domains  # doctest: +SKIP
        ['art_painting', 'cartoon', 'photo', 'sketch']
    """
    key = _canonical(name)
    if key not in _LOADERS:
        raise ValueError(f"unknown benchmark {name!r}; valid names: {', '.join(BENCHMARKS)}")
    module, func, needs_root = _LOADERS[key]
    if needs_root and root is None:
        raise ValueError(
            f"benchmark {key!r} needs root= pointing at its data folder; "
            "see docs/datasets.md for the expected layout"
        )
    loader = getattr(importlib.import_module(module, __package__), func)
    if root is None:
        return loader(**kw)
    return loader(root=root, **kw)


def load_from_config(cfg: Config) -> Benchmark:
    """The benchmark named by ``cfg.data``, loaded as a training run loads it.

    MiniDigits is built and cached on first use (``data.seed``, with a progress bar when
    ``progress``); the real benchmarks read ``data.root`` at ``data.image_size``.
    """
    kw: dict[str, Any]
    if cfg.data.benchmark == "minidigits":
        kw = {"seed": cfg.data.seed, "progress": cfg.progress}
    else:
        kw = {"image_size": cfg.data.image_size}
    return load_benchmark(cfg.data.benchmark, cfg.data.root, **kw)
