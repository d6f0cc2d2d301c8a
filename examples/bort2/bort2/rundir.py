"""The run folder (``output_dir``): creating it, refusing to mix runs, resuming, overwriting.

Owns what a run folder is and what may be deleted in it:

* A run folder is marked by :data:`MARKER` (``.bort2-run``), written when the pipeline first
  writes the folder. The marker is also the folder's **manifest**: every file the pipeline
  writes there is recorded in it, one line ``<sha256>  <path relative to the folder>``, with
  the SHA-256 of the bytes it wrote, *before* the file takes its name (:func:`record`,
  :func:`write_recorded`; TensorBoard event files when they are flushed). Folders of runs from
  before the marker (or before format 2, which added the manifest) are recognised by their
  ``config.yaml`` or their finished stages (``<target>/seed<N>/step*/metrics.json``).
* ``overwrite=true`` deletes only files the pipeline can prove it wrote: a regular file whose
  path is in the manifest with the SHA-256 of its current bytes (then the folders this empties,
  and the marker last). Anything else — a file the manifest does not list (a user's
  ``notes.txt``, a PNG dropped into ``figures/``, another project's ``config.yaml``), a listed
  file whose bytes changed since the pipeline wrote it, a symbolic link, a folder the pipeline
  did not make — makes it refuse with one paragraph naming those paths, and nothing is
  deleted. A folder written by a version that recorded nothing (no marker, or a format-1
  marker) can prove nothing: its overwrite is refused and the message says to delete the
  folder by hand if nothing in it is the user's. A symbolic ``output_dir`` is followed, never
  removed.
* ``resume=true`` compares the saved ``config.yaml`` with the current settings, ignoring the
  keys that do not change what is computed (:data:`RESUMABLE_KEYS`): ``output_dir`` is where the
  run is, so a moved, copied or symlinked run, or a relative spelling of its path, resumes
  (the manifest's paths are relative). A saved ``config.yaml`` of an earlier config schema
  version (:mod:`bort2.config.migrate`: a renamed key such as ``step2.hyper_convention``, a key
  added since) is migrated before the comparison, so runs from before a rename resume; an old
  folder that is resumed gets a format-2 marker, and what the resumed run writes is recorded.
* Files the pipeline writes get the mode the user's umask gives a new file
  (:func:`user_file_mode`), not the 0600 of a temporary file.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from .config import (
    RESUMABLE_KEYS,
    STEP1_METHODS,
    STEP2_METHODS,
    VERSION_KEY,
    Config,
    ConfigError,
    flat_keys,
    normalize,
    to_yaml,
)

__all__ = [
    "MARKER",
    "RESUMABLE_KEYS",
    "config_differences",
    "file_sha256",
    "find_run_folder",
    "prepare_output",
    "record",
    "recorded",
    "unproven_entries",
    "user_file_mode",
    "write_recorded",
]

#: the file that marks a folder as written by this pipeline, and lists what it wrote there
MARKER = ".bort2-run"
#: its first line in this version (format 1, before the manifest, had no file lines)
MARKER_FORMAT = "bort2 run folder, format 2"
MARKER_TEXT = (
    f"{MARKER_FORMAT}\n"
    "Written by examples/bort2/run.py. Each line below is the SHA-256 and the path (relative "
    "to this folder) of a file the pipeline wrote here, added as it wrote it. overwrite=true "
    "deletes a file only when its path and current bytes are listed; anything else makes it "
    "refuse, deleting nothing.\n"
)
_ENTRY = re.compile(r"([0-9a-f]{64})  (.+)")

_SEED = re.compile(r"seed\d+")
_STAGES = frozenset([f"step1_{m}" for m in STEP1_METHODS] + [f"step2_{v}" for v in STEP2_METHODS])


def _domains() -> frozenset[str]:
    """Every domain name of every benchmark: the names of the run's per-target folders."""
    from .data.registry import BENCHMARKS, benchmark_domains

    return frozenset(d for b in BENCHMARKS for d in benchmark_domains(b))


def config_differences(saved_yaml: str, cfg: Config) -> list[str]:
    """``key: saved -> now`` for every setting that differs, but those a resume may change
    (:data:`bort2.config.RESUMABLE_KEYS`, declared ``resumable`` beside each key); the saved
    file is first migrated to the current schema version."""
    import yaml

    saved = normalize(
        yaml.safe_load(saved_yaml) or {}, "the saved config.yaml", complete=True, note=False
    )
    old = flat_keys(saved)
    new = flat_keys(yaml.safe_load(to_yaml(cfg)))
    new.pop(VERSION_KEY, None)
    keys = sorted((set(old) | set(new)) - set(RESUMABLE_KEYS))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def user_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file under the current umask (0644 under the
    usual 022): what a file written through ``tempfile.mkstemp`` (0600) should be ``fchmod``-ed
    to before it replaces the real name."""
    mask = os.umask(0o022)  # reading the umask means setting it; it is put back at once
    os.umask(mask)
    return 0o666 & ~mask


# ----------------------------------------------------------------------------- the manifest
def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def find_run_folder(path: Path) -> Path | None:
    """The nearest folder above ``path`` (a file about to be written) holding a :data:`MARKER`,
    by the path as spelled (symbolic links are not resolved, so the recorded paths are those
    under ``output_dir`` as the run sees it); None outside a run folder."""
    here = Path(os.path.abspath(path)).parent
    for folder in (here, *here.parents):
        if (folder / MARKER).is_file():
            return folder
    return None


def record(path: Path, digest: str | None = None) -> None:
    """Add ``path`` with ``digest`` (the SHA-256 of the bytes it holds or is about to hold;
    computed from the file when None) to the manifest of the run folder it is in.

    Outside a run folder nothing is recorded. A path may be recorded several times (a file the
    pipeline rewrites, such as ``results.md`` or ``state.pt``): every recorded digest of a path
    is one the pipeline wrote there. Appends are one ``write`` under an exclusive lock, so the
    worker processes of ``jobs>1`` may record into one manifest at the same time.
    """
    path = Path(path)
    folder = find_run_folder(path)
    if folder is None:
        return
    rel = Path(os.path.abspath(path)).relative_to(folder).as_posix()
    if "\n" in rel or rel == MARKER:
        return
    if digest is None:
        digest = file_sha256(path)
    line = f"{digest}  {rel}\n".encode()
    fd = os.open(folder / MARKER, os.O_WRONLY | os.O_APPEND)
    try:
        _lock(fd)
        os.write(fd, line)
    finally:
        os.close(fd)  # closing releases the lock


def _lock(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # no flock (Windows): O_APPEND writes of one line
        return
    fcntl.flock(fd, fcntl.LOCK_EX)


def recorded(out: Path) -> dict[str, set[str]]:
    """The manifest of run folder ``out``: every recorded path with the digests recorded for
    it (empty without a marker, or with a marker of format 1, which recorded nothing)."""
    marker = Path(out) / MARKER
    if not _plain_file(marker):
        return {}
    entries: dict[str, set[str]] = {}
    for line in marker.read_text(errors="replace").splitlines():
        m = _ENTRY.fullmatch(line)
        if m:
            entries.setdefault(m.group(2), set()).add(m.group(1))
    return entries


def write_recorded(data: bytes, path: Path, digest: str | None = None) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file in the same folder, ``fsync``,
    then ``os.replace``), recording it in its run folder's manifest before it takes its name.

    A crash at any point leaves ``path`` with bytes the manifest lists (the old or the new), or
    a ``<name>*.tmp`` that it does not list. ``digest``: the SHA-256 of ``data`` if the caller
    has it. Raises ``OSError`` as the file system does.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.fchmod(fd, user_file_mode())  # mkstemp makes 0600; results are the user's files
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        record(path, digest or hashlib.sha256(data).hexdigest())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ----------------------------------------------------------------------------- overwrite
def _plain_dir(p: Path) -> bool:
    return p.is_dir() and not p.is_symlink()


def _plain_file(p: Path) -> bool:
    return p.is_file() and not p.is_symlink()


def _layout_folder(rel: str) -> bool:
    """A folder name the pipeline gives its folders, at its place: ``figures``, ``<domain>``,
    ``<domain>/seed<N>``, a stage folder under it, and a stage's ``tb``."""
    parts = rel.split("/")
    if parts == ["figures"]:
        return True
    if parts[0] not in _domains() or len(parts) > 4:
        return False
    ok = [True, bool(_SEED.fullmatch(parts[1])) if len(parts) > 1 else True]
    ok.append(parts[2] in _STAGES if len(parts) > 2 else True)
    ok.append(parts[3] == "tb" if len(parts) > 3 else True)
    return all(ok)


def _judge(out: Path) -> tuple[list[Path], list[Path], list[str], list[str]]:
    """``(files, folders, unknown, changed)`` of run folder ``out``.

    ``files``: the regular files the manifest proves the pipeline wrote (listed with the SHA-256
    of their bytes now), the marker excluded; ``folders``: the folders that deleting them
    empties, deepest first, when the pipeline made them (they hold recorded paths, or are of the
    pipeline's layout); ``unknown``: paths (relative, folders ending in ``/``) the manifest
    does not prove: files it does not list, symbolic links, other non-regular files, folders
    left holding nothing that the pipeline did not make; ``changed``: listed files whose bytes
    differ from every digest recorded for them.
    """
    known = recorded(out)
    parents = {p.rsplit("/", 1)[0] for p in known if "/" in p}
    ancestors = {"/".join(p.split("/")[:i]) for p in parents for i in range(1, p.count("/") + 2)}
    files: list[Path] = []
    folders: list[Path] = []
    emptied: set[Path] = set()
    unknown: list[str] = []
    changed: list[str] = []
    for dirpath, dirnames, filenames in os.walk(out, topdown=False):
        here = Path(dirpath)
        keeps = False  # does this folder keep anything after the proven files are deleted
        for name in sorted(dirnames + filenames):
            p = here / name
            rel = p.relative_to(out).as_posix()
            if p.is_symlink():  # never followed, never deleted
                unknown.append(rel)
                keeps = True
            elif p.is_dir():
                if p not in emptied:
                    keeps = True
            elif rel == MARKER and here == out:
                continue
            elif not p.is_file():
                unknown.append(rel)
                keeps = True
            elif rel not in known:
                unknown.append(rel)
                keeps = True
            elif file_sha256(p) in known[rel]:
                files.append(p)
            else:
                changed.append(rel)
                keeps = True
        if here == out or keeps:
            continue
        rel = here.relative_to(out).as_posix()
        if rel in ancestors or _layout_folder(rel):
            folders.append(here)
            emptied.add(here)
        else:
            unknown.append(rel + "/")
    return files, folders, sorted(unknown), sorted(changed)


def _collapse(unknown: list[str], files: list[Path], changed: list[str], out: Path) -> list[str]:
    """``unknown`` with every folder whose entries are all unknown shown once as ``folder/``
    (for the message: an old run's stage folders, a user's ``src/``)."""
    kept = {p.relative_to(out).as_posix() for p in files} | set(changed)
    shown = set(unknown)
    prefixes = {p.rstrip("/").rsplit("/", 1)[0] for p in unknown if "/" in p.rstrip("/")}
    dirs = {"/".join(d.split("/")[:i]) for d in prefixes for i in range(1, d.count("/") + 2)}
    for d in sorted(dirs, key=len):  # the shallowest folder that can be shown whole wins
        if not any(k.startswith(d + "/") for k in kept) and (d + "/") not in shown:
            inside = {p for p in shown if p.startswith(d + "/")}
            if inside and not any(k.startswith(d + "/") for k in kept):
                shown = (shown - inside) | {d + "/"}
    return sorted(shown)


def unproven_entries(out: Path) -> list[str]:
    """Paths under ``out`` (relative; folders end in ``/``) that ``overwrite=true`` would keep:
    everything the manifest does not prove the pipeline wrote (see :func:`_judge`)."""
    _, _, unknown, changed = _judge(Path(out))
    return sorted(unknown + changed)


def _listing(paths: list[str], limit: int = 8) -> str:
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
    """Delete the files the manifest proves the pipeline wrote in ``out``, then the folders
    that empties and the marker; refuse, deleting nothing, if anything else is there."""
    files, folders, unknown, changed = _judge(out)
    unknown = _collapse(unknown, files, changed, out)
    if _older(out) and (unknown or changed):
        if not (out / MARKER).is_file():
            what = (
                "has no .bort2-run marker (a run folder of an older version of the pipeline, or "
                "another program's files)"
            )
        elif not recorded(out):
            what = "has a format-1 .bort2-run marker (a run of an older version of the pipeline)"
        else:
            what = "holds a run started by an older version of the pipeline and resumed by this one"
        raise ConfigError(
            f"overwrite=true refused: {shown} {what}. Files written without a record of their "
            "SHA-256 cannot be proven the pipeline's (another program's config.yaml, results.md "
            "or figures/ look the same), so nothing was deleted. Not proven: "
            f"{_listing(unknown + changed)}. If nothing in the folder is yours, delete it by "
            f"hand (rm -r {shown}) and rerun; or continue it with resume=true; or choose "
            "another output_dir=PATH"
        )
    if unknown or changed:
        parts = []
        if unknown:
            parts.append(
                "entries the pipeline did not write (not in its .bort2-run record): "
                + _listing(unknown)
            )
        if changed:
            parts.append(
                "files whose bytes changed since the pipeline wrote them: " + _listing(changed)
            )
        raise ConfigError(
            f"overwrite=true refused: {shown} holds " + "; and ".join(parts) + "; nothing was "
            "deleted (overwrite=true deletes only the files the pipeline recorded in "
            ".bort2-run with their SHA-256). Move those entries out of the folder, or choose "
            "another output_dir=PATH"
        )
    try:
        for f in files:
            f.unlink()
        for d in folders:
            d.rmdir()
        (out / MARKER).unlink(missing_ok=True)  # last: a deletion cut short stays marked
    except OSError as exc:
        raise ConfigError(
            f"overwrite=true could not delete in {shown}: {exc.strerror or exc} ({exc.filename})"
        ) from None


#: the line a marker gets when an older run folder is upgraded (its earlier files unrecorded)
UPGRADED = "upgraded from an older version: the files it wrote before this line are not recorded"


def _upgrade_marker(out: Path) -> None:
    """A format-2 marker in ``out``: created in a new folder; in a folder of an older version
    (no marker, or a format-1 one, which recorded nothing, so nothing is lost) written with the
    :data:`UPGRADED` line; an existing format-2 marker is kept as it is."""
    marker = out / MARKER
    if _plain_file(marker):
        first = marker.read_text(errors="replace").partition("\n")[0]
        if first == MARKER_FORMAT or recorded(out):  # ours, or a later format: kept
            return
    older = _holds_run(out)
    marker.write_text(MARKER_TEXT + (f"{UPGRADED}\n" if older else ""))


def _older(out: Path) -> bool:
    """``out`` holds files of a version that did not record them (see :func:`_upgrade_marker`)."""
    marker = out / MARKER
    if not _plain_file(marker):
        return True
    text = marker.read_text(errors="replace")
    return text.partition("\n")[0] != MARKER_FORMAT or f"\n{UPGRADED}\n" in text


def _saved_differences(config: Path, cfg: Config) -> list[str]:
    """:func:`config_differences` of a saved ``config.yaml``; one :class:`ConfigError` naming
    the file when it cannot be read as a configuration (not a traceback)."""
    import yaml

    from .config import yaml_problem

    try:
        return config_differences(config.read_text(), cfg)
    except yaml.YAMLError as exc:
        problem = yaml_problem(exc)
    except (UnicodeDecodeError, OSError, AttributeError, TypeError) as exc:
        problem = str(exc) or type(exc).__name__
    raise ConfigError(
        f"resume=true cannot read the saved {config} ({problem}): it is not a config.yaml this "
        "pipeline wrote; choose another output_dir=PATH"
    )


def prepare_output(cfg: Config) -> Path:
    """Create or reopen the run folder; refuse to mix with a previous run unless resume/overwrite.

    ``resume=true`` continues a run only with the settings that produced it (the differing keys
    are listed otherwise; ``output_dir`` itself may differ: a run may be moved). Finished stages
    are never reused without ``resume=true``. ``overwrite=true`` deletes only the files the
    marker's manifest proves the pipeline wrote, and refuses if anything else is there (see the
    module docstring). Returns the folder as given (a symbolic link stays one).
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
        diff = _saved_differences(config, cfg)
        if diff:
            raise ConfigError(
                f"resume=true with settings that differ from {config}: "
                + "; ".join(diff)
                + ". Resume with the saved settings, or choose another output_dir=PATH for the "
                "new ones (overwrite=true without resume would delete this run's results)"
            )
    try:
        out.mkdir(parents=True, exist_ok=True)
        _upgrade_marker(out)
        write_recorded(to_yaml(cfg).encode(), config)
    except OSError as exc:
        raise ConfigError(f"cannot write to output_dir={shown}: {exc.strerror or exc}") from None
    return out
