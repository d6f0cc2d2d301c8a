"""The run folder (``output_dir``): creating it, refusing to mix runs, resuming, overwriting.

Owns what a run folder is and what may be deleted in it:

* A run folder is marked by :data:`MARKER` (``.bort2-run``), written when the pipeline first
  writes the folder. Folders of runs from before the marker existed are recognised by their
  ``config.yaml`` or their finished stages (``<target>/seed<N>/step*/metrics.json``).
* ``overwrite=true`` deletes only the entries this pipeline writes (:func:`run_entries`):
  ``config.yaml``, the marker, ``results.md/json``, ``mechanism.md/json``, ``figures/`` with
  its plots, and ``<domain>/seed<N>/step1_<method>|step2_<variant>/`` stage folders. Any other
  file or folder (a user's ``notes.txt``, ``src/``, a symbolic link) makes it refuse, naming
  them, and nothing is deleted. A symbolic ``output_dir`` is followed, never removed.
* ``resume=true`` compares the saved ``config.yaml`` with the current settings, ignoring the
  keys that do not change what is computed (:data:`RESUMABLE_KEYS`): ``output_dir`` is where the
  run is, so a moved, copied or symlinked run, or a relative spelling of its path, resumes.
  A saved ``config.yaml`` that spells a key by its old name (:data:`bort2.config.ALIASES`,
  e.g. ``step2.hyper_convention``) is read under the new one, so runs from before a rename
  resume.
* Files the pipeline writes get the mode the user's umask gives a new file
  (:func:`user_file_mode`), not the 0600 of a temporary file.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from .config import (
    STEP1_METHODS,
    STEP2_METHODS,
    Config,
    ConfigError,
    flat_keys,
    to_yaml,
    upgrade,
)

__all__ = [
    "MARKER",
    "RESUMABLE_KEYS",
    "config_differences",
    "foreign_entries",
    "prepare_output",
    "run_entries",
    "user_file_mode",
]

#: the file that marks a folder as written by this pipeline (its first line names the format)
MARKER = ".bort2-run"
MARKER_TEXT = (
    "bort2 run folder, format 1\n"
    "Written by examples/bort2/run.py. overwrite=true deletes only the entries the pipeline "
    "writes here (config.yaml, results.*, mechanism.*, figures/, <domain>/seed<N>/step*/).\n"
)

#: keys that may change when a run is resumed: they do not change what is computed
#: (``output_dir`` is where the run is, not a setting of it)
RESUMABLE_KEYS = (
    "resume",
    "overwrite",
    "progress",
    "jobs",
    "tensorboard",
    "tsne",
    "data.check",
    "output_dir",
)

#: top-level files the pipeline writes, with their SHA-256 sidecars (``<name>*.tmp``: an atomic
#: write cut short)
_FILES = tuple(
    name + ext
    for name in ("config.yaml", "results.md", "results.json", "mechanism.md", "mechanism.json")
    for ext in ("", ".sha256")
)
_FIGURE_SUFFIXES = (".png", ".pdf", ".svg")
_SEED = re.compile(r"seed\d+")
_STAGES = frozenset([f"step1_{m}" for m in STEP1_METHODS] + [f"step2_{v}" for v in STEP2_METHODS])


def _domains() -> frozenset[str]:
    """Every domain name of every benchmark: the names of the run's per-target folders."""
    from .data.registry import BENCHMARKS, benchmark_domains

    return frozenset(d for b in BENCHMARKS for d in benchmark_domains(b))


def config_differences(saved_yaml: str, cfg: Config) -> list[str]:
    """``key: saved -> now`` for every setting (but :data:`RESUMABLE_KEYS`) that differs."""
    import yaml

    old = flat_keys(upgrade(yaml.safe_load(saved_yaml) or {}, "the saved config.yaml", note=False))
    new = flat_keys(yaml.safe_load(to_yaml(cfg)))
    keys = sorted((set(old) | set(new)) - set(RESUMABLE_KEYS))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def user_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file under the current umask (0644 under the
    usual 022): what a file written through ``tempfile.mkstemp`` (0600) should be ``fchmod``-ed
    to before it replaces the real name."""
    mask = os.umask(0o022)  # reading the umask means setting it; it is put back at once
    os.umask(mask)
    return 0o666 & ~mask


def _is_tmp_of(name: str, names: tuple[str, ...]) -> bool:
    return name.endswith(".tmp") and name.startswith(names)


def _plain_dir(p: Path) -> bool:
    return p.is_dir() and not p.is_symlink()


def _plain_file(p: Path) -> bool:
    return p.is_file() and not p.is_symlink()


def _classify(out: Path) -> tuple[list[Path], list[str]]:
    """(entries of ``out`` the pipeline wrote, paths relative to ``out`` of everything else).

    A stage folder counts as a whole; every folder above a stage (``<domain>/``, ``seed<N>/``)
    and ``figures/`` must hold nothing but what the pipeline puts there. The pipeline never
    writes symbolic links, so a link is foreign wherever it is (and is never followed).
    """
    domains = _domains()
    ours: list[Path] = []
    foreign: list[str] = []

    def rel(p: Path) -> str:
        return p.relative_to(out).as_posix() + ("/" if _plain_dir(p) else "")

    for entry in sorted(out.iterdir()):
        name = entry.name
        if _plain_file(entry) and (name in _FILES or name == MARKER or _is_tmp_of(name, _FILES)):
            ours.append(entry)
        elif name == "figures" and _plain_dir(entry):
            bad = [
                rel(f)
                for f in sorted(entry.iterdir())
                if not (
                    _plain_file(f) and (f.suffix in _FIGURE_SUFFIXES or f.name.endswith(".tmp"))
                )
            ]
            foreign.extend(bad)
            if not bad:
                ours.append(entry)
        elif name in domains and _plain_dir(entry):
            bad = []
            for seed in sorted(entry.iterdir()):
                if not (_SEED.fullmatch(seed.name) and _plain_dir(seed)):
                    bad.append(rel(seed))
                    continue
                bad.extend(
                    rel(stage)
                    for stage in sorted(seed.iterdir())
                    if not (stage.name in _STAGES and _plain_dir(stage))
                )
            foreign.extend(bad)
            if not bad:
                ours.append(entry)
        else:
            foreign.append(rel(entry))
    return ours, foreign


def run_entries(out: Path) -> list[Path]:
    """The top-level entries of ``out`` that this pipeline wrote (what overwrite may delete)."""
    return _classify(Path(out))[0]


def foreign_entries(out: Path) -> list[str]:
    """Paths (relative to ``out``, folders ending in ``/``) this pipeline did not write."""
    return _classify(Path(out))[1]


def _listing(paths: list[str], limit: int = 6) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _holds_run(out: Path) -> bool:
    return out.is_dir() and (
        (out / MARKER).exists()
        or (out / "config.yaml").exists()
        or any(out.glob("*/seed*/step*/metrics.json"))
    )


def _describe(out: Path) -> str:
    if (out / "config.yaml").exists():
        return "a run"
    return "stages of an earlier run (no config.yaml)"


def _overwrite(out: Path, shown: str) -> None:
    """Delete what the pipeline wrote in ``out``; refuse, deleting nothing, if anything else is
    there. The marker goes last, so a deletion cut short leaves a folder still marked."""
    ours, foreign = _classify(out)
    legacy = not (out / MARKER).is_file()
    if foreign:
        what = (
            "a run folder without the .bort2-run marker (a run from an older version)"
            if (legacy)
            else "a run folder"
        )
        raise ConfigError(
            f"overwrite=true refused: {shown} is {what} that also holds entries this pipeline "
            f"did not write: {_listing(foreign)}; nothing was deleted. Move them out of the "
            "folder, or choose another output_dir=PATH"
        )
    if legacy:
        print(
            f"note: {shown} has no .bort2-run marker (written by an older version); every "
            "entry in it is one the pipeline writes, so overwrite=true deletes them",
            file=sys.stderr,
        )
    ours.sort(key=lambda p: p.name == MARKER)
    for entry in ours:
        try:
            if _plain_dir(entry):
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError as exc:
            raise ConfigError(
                f"overwrite=true could not delete {entry}: {exc.strerror or exc}"
            ) from None


def prepare_output(cfg: Config) -> Path:
    """Create or reopen the run folder; refuse to mix with a previous run unless resume/overwrite.

    ``resume=true`` continues a run only with the settings that produced it (the differing keys
    are listed otherwise; ``output_dir`` itself may differ: a run may be moved). Finished stages
    are never reused without ``resume=true``. ``overwrite=true`` deletes only what the pipeline
    wrote (see the module docstring). Returns the folder as given (a symbolic link stays one).
    """
    out = Path(cfg.output_dir)
    shown = str(out)
    if out.is_symlink() and not out.exists():
        raise ConfigError(
            f"output_dir={shown} is a symbolic link to {out.readlink()}, which does not exist; "
            "create that folder or choose another output_dir=PATH"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"cannot write to output_dir={shown}: it is a file, not a folder")
    config = out / "config.yaml"
    if _holds_run(out) and not cfg.resume:
        if not cfg.overwrite:
            raise ConfigError(
                f"{shown} already holds {_describe(out)}. Pass resume=true to continue it, "
                "overwrite=true to delete it (only the files the pipeline wrote), or choose "
                "another output_dir=PATH"
            )
        _overwrite(out, shown)
    if config.exists():
        diff = config_differences(config.read_text(), cfg)
        if diff:
            raise ConfigError(
                f"resume=true with settings that differ from {config}: "
                + "; ".join(diff)
                + ". Resume with the saved settings, or choose another output_dir=PATH for the "
                "new ones (overwrite=true without resume would delete this run's results)"
            )
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not (out / MARKER).is_file():
            (out / MARKER).write_text(MARKER_TEXT)
        config.write_text(to_yaml(cfg))
    except OSError as exc:
        raise ConfigError(f"cannot write to output_dir={shown}: {exc.strerror or exc}") from None
    return out
