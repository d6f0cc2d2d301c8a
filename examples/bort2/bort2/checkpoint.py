"""Atomic files, checkpoints and random-number state of the BORT2 stages.

Every stage (one step-1 method or one step-2 variant, for one target and seed) lives in its own
directory with ``state.pt`` (periodic, atomic: models, optimizers, loaders, every RNG) and, once
finished, ``final.pt`` + ``history.json`` + ``metrics.json``. A killed run restarted with
``resume=true`` continues from the last ``state.pt`` and, because every random stream is
restored, ends with the same numbers as an uninterrupted run (same machine and thread count).

Every file the pipeline writes says what it is. Each checkpoint holds an identity record
(:func:`stage_identity`: the format version, the kind of file, the stage, the unit's target and
seed, and a fingerprint of the resolved configuration) and has a SHA-256 sidecar; the JSON files
have sidecars too. Loading a stage's own files checks both, so a file copied from another stage,
seed or run is refused (naming the field that differs) rather than silently reused.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from .config import KEYS, flat_keys, spell
from .errors import CheckpointError
from .rundir import record, write_recorded
from .stages_index import SPECS

FORMAT_VERSION = 1
"""Version of the identity record; files of another version are refused on resume.

Its fingerprint hashes the keys a stage reads as config schema version 1 spells them
(:func:`config_fingerprint`), so a record of this format written by any version of the pipeline
matches the stage it was written for."""

IDENTITY_KEY = "identity"
"""The entry of a checkpoint (and of ``history.json``) that holds its :func:`stage_identity`."""

#: the config schema version whose key names the fingerprints of :data:`FORMAT_VERSION` records
#: hash (:func:`bort2.config.migrate.spell`)
FINGERPRINT_SCHEMA = 1


class CorruptCheckpoint(CheckpointError):
    """A file's bytes are damaged: its SHA-256 does not match, it is truncated or unreadable.

    The pipeline recovers from these (an older periodic state, or training the stage again);
    a file that is intact but *not this stage's* (:class:`CheckpointError`) is refused instead.
    ``path`` and ``reason`` hold the damaged file and what is wrong with it.
    """

    def __init__(self, message: str, path: Path, reason: str):
        super().__init__(message)
        self.path, self.reason = path, reason

    def __reduce__(self):  # picklable across the worker processes of jobs>1
        return (type(self), (str(self), self.path, self.reason))


def config_fingerprint(cfg: Any, stage: str) -> str:
    """SHA-256 (hex) of the resolved configuration restricted to the keys stage ``stage`` reads.

    A key is hashed when its declaration says the stage's results depend on it
    (``read_by``, ``computed``: :meth:`bort2.config.Key.reads`); where the run is, which units
    and stages it holds and how often it saves are not (the unit's target and seed are fields of
    the identity record itself). The keys are spelled as config schema version
    :data:`FINGERPRINT_SCHEMA` spells them (renamed keys under their names there, a key added
    since left out while it holds its migration's default), and the values are serialised as
    sorted JSON: the fingerprint depends neither on the order or spelling of the overrides nor on
    later renames.

    ``cfg``: a :class:`~bort2.config.Config`, or a mapping of its keys (nested or dotted).
    """
    import dataclasses

    tree = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)
    keep = {k: v for k, v in flat_keys(tree).items() if k in KEYS and KEYS[k].reads(stage)}
    text = json.dumps(spell(keep, FINGERPRINT_SCHEMA), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def stage_identity(cfg: Any, stage: str, target: str, seed: int, kind: str) -> dict[str, Any]:
    """What a checkpoint of ``stage`` for unit (``target``, ``seed``) records about itself.

    ``kind`` is ``"state"`` (``state.pt`` / ``state.prev.pt``), ``"final"`` (``final.pt``) or
    ``"labeler_final"``. ``stage`` may be a family such as ``"step1/*"`` when an expected
    identity accepts any step-1 method (step 2's labeler); the fingerprint is the family's.
    """
    return {
        "format": FORMAT_VERSION,
        "kind": kind,
        "stage": stage,
        "target": str(target),
        "seed": int(seed),
        "config": _family_fingerprints(cfg, stage[:-1])
        if stage.endswith("/*")
        else config_fingerprint(cfg, stage),
    }


def _family_fingerprints(cfg: Any, prefix: str) -> dict[str, str]:
    """Each member stage's fingerprint (stages of a family may ignore different keys)."""
    return {name: config_fingerprint(cfg, name) for name in SPECS if name.startswith(prefix)}


def _matches(field_: str, got: Any, want: Any) -> bool:
    if field_ == "stage" and isinstance(want, str) and want.endswith("/*"):
        return isinstance(got, str) and got.startswith(want[:-1])
    return got == want


def _resolve_family(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """``want`` with a family's per-stage fingerprints narrowed to the stage ``got`` names."""
    if isinstance(want.get("config"), dict):
        return {**want, "config": want["config"].get(got.get("stage"), "(no such stage)")}
    return want


def _short(field_: str, value: Any) -> str:
    if field_ == "config" and isinstance(value, str):
        return value[:12] + "…"
    return repr(value)


def identity_mismatch(path: Path, got: Any, want: dict[str, Any]) -> str | None:
    """One line saying which fields of ``got`` differ from ``want``, or None when all match."""
    if not isinstance(got, dict):
        return (
            f"{path} has no identity record (written by an older version of this pipeline or "
            "by another program), so it cannot be trusted as this stage's file"
        )
    want = _resolve_family(got, want)
    diffs = [
        f"{f} {_short(f, got.get(f))} (expected {_short(f, w)})"
        for f, w in want.items()
        if not _matches(f, got.get(f), w)
    ]
    if not diffs:
        return None
    hint = {
        "config": "written with other settings",
        "seed": "copied from another seed's run",
        "target": "copied from another target's run",
        "stage": "copied from another stage",
        "kind": "another kind of file",
        "format": "written by another version of this pipeline",
    }
    why = "; ".join(hint[f] for f in want if f in hint and not _matches(f, got.get(f), want[f]))
    return f"{path} is not this stage's file: " + ", ".join(diffs) + f" ({why})"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_bytes_atomic(data: bytes, path: Path, digest: str | None = None) -> None:
    """``data`` to ``path`` atomically, recorded in the run folder's manifest
    (:func:`bort2.rundir.write_recorded`)."""
    write_recorded(data, path, digest)


def _write_error(path: Path, exc: OSError) -> CheckpointError:
    if exc.errno == errno.ENOSPC:
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        return CheckpointError(
            f"the disk is full: no space left on the device of {path.parent} while writing "
            f"{path.name} ({free / 2**20:.1f} MiB free); free some space and rerun with "
            "resume=true (the last complete checkpoint is kept)"
        )
    return CheckpointError(f"cannot write {path}: {exc.strerror or exc}")


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file in the same folder, then ``os.replace``, with a SHA-256
    of the bytes in ``<path>.sha256`` that :func:`load_checkpoint` verifies."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    try:
        _write_bytes_atomic(data, path, digest)
        _write_bytes_atomic(digest.encode(), _sidecar(path))
    except OSError as exc:
        raise _write_error(path, exc) from None


def atomic_write_bytes(data: bytes, path: Path) -> None:
    """Write ``data`` to a temporary file next to ``path``, then ``os.replace`` it (recorded in
    the run folder's manifest, like every file written here)."""
    try:
        _write_bytes_atomic(data, path)
    except OSError as exc:
        raise _write_error(path, exc) from None


def atomic_write_text(text: str, path: Path, sidecar: bool = False) -> None:
    """Write ``text`` to a temporary file next to ``path``, then ``os.replace`` it (with a
    SHA-256 sidecar that :func:`read_json` verifies when ``sidecar``)."""
    data = text.encode()
    try:
        _write_bytes_atomic(data, path)
        if sidecar:
            _write_bytes_atomic(hashlib.sha256(data).hexdigest().encode(), _sidecar(path))
    except OSError as exc:
        raise _write_error(path, exc) from None


def _read_verified(path: Path, strict: bool, what: str) -> tuple[bytes, bool]:
    """The bytes of ``path`` checked against its sidecar; returns ``(bytes, had_sidecar)``.

    Raises:
        CheckpointError: ``path`` is missing, or (``strict``) its sidecar is.
        CorruptCheckpoint: the bytes do not match the sidecar.
    """
    if not path.is_file():
        raise CheckpointError(f"{what} {path} does not exist")
    data = path.read_bytes()
    sidecar = _sidecar(path)
    if not sidecar.is_file():
        if strict:
            raise CheckpointError(_missing_sidecar(path))
        return data, False
    if sidecar.read_text().strip() != hashlib.sha256(data).hexdigest():
        reason = "its SHA-256 does not match"
        raise CorruptCheckpoint(f"{what} {path} is corrupt ({reason})", path, reason)
    return data, True


def _missing_sidecar(path: Path) -> str:
    return (
        f"{path} has no SHA-256 sidecar ({_sidecar(path).name}), so it cannot be verified; "
        f"restore the sidecar, or delete {path.parent} to compute that stage again"
    )


def read_json(path: Path, strict: bool = True) -> Any:
    """A JSON file written by the pipeline, verified against its SHA-256 sidecar.

    Raises:
        CheckpointError: the file is missing or (``strict``) has no sidecar.
        CorruptCheckpoint: the file fails its checksum or does not parse (a truncated file);
            one line naming the file, never a ``JSONDecodeError`` traceback.
    """
    path = Path(path)
    data, _ = _read_verified(path, strict, "file")
    try:
        return json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = f"not valid JSON: {exc}"
        raise CorruptCheckpoint(f"file {path} is corrupt ({reason})", path, reason) from None


def load_checkpoint(
    path: Path, expect: dict[str, Any] | None = None, own: bool = False
) -> dict[str, Any]:
    """A checkpoint saved by this package (tensors and plain containers only).

    Args:
        path: the file.
        expect: the :func:`stage_identity` the file must have. A file that records an identity
            must then have its SHA-256 sidecar too, and every field must match; a file without
            an identity record (a model saved by another program, as ``step1.checkpoint`` may
            be) is accepted unless ``own``.
        own: the file is one the pipeline wrote for this very stage (``state.pt``,
            ``final.pt`` on resume): the sidecar and the identity record are required.

    Raises:
        CheckpointError: the file is missing, cannot be verified (a pipeline file without its
            sidecar) or is another stage's, seed's or run's file; the message names the file
            and the fields that differ.
        CorruptCheckpoint: the file fails its checksum or cannot be read.
    """
    path = Path(path)
    data, had_sidecar = _read_verified(path, own, "checkpoint")
    try:
        st = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, random bytes, foreign pickles
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = type(exc).__name__ + ("" if "weights_only" in first or not first else f": {first}")
        raise CorruptCheckpoint(
            f"checkpoint {path} cannot be read ({reason})", path, reason
        ) from None
    if expect is None:
        return st
    got = st.get(IDENTITY_KEY) if isinstance(st, dict) else None
    if got is None and not own:
        return st  # a foreign model file: accepted as it is
    if not had_sidecar:
        raise CheckpointError(_missing_sidecar(path))
    problem = identity_mismatch(path, got, expect)
    if problem:
        raise CheckpointError(problem + _REFUSED)
    return st


_REFUSED = (
    "; refused: delete the stage's folder to compute that stage again (overwrite=true would "
    "delete the whole run)"
)


def verified(path: Path, expect: dict[str, Any] | None = None) -> bool:
    """Whether ``path`` loads as a checkpoint (checksum, and identity when ``expect``)."""
    try:
        load_checkpoint(path, expect, own=expect is not None)
    except CheckpointError:
        return False
    return True


def rng_state() -> dict[str, Any]:
    """The global CPU (and, when initialised, CUDA) random states."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def finished_metrics(stage_dir: Path, identity: dict[str, Any] | None = None) -> dict | None:
    """The metrics of a finished stage whose files verify, else None.

    ``identity`` is the stage's :func:`stage_identity` (kind ``"final"``). A finished stage
    whose ``final.pt``, ``history.json`` or ``metrics.json`` is damaged (fails its SHA-256,
    truncated, unreadable, ``history.json`` missing) is reported and cleared so that it is
    trained again: its table row would otherwise stand for files that no longer hold it, and
    training it again gives the same numbers. A file that cannot be verified (its sidecar is
    missing) or that is intact but another stage's, seed's or run's is refused with a
    :class:`CheckpointError` instead: something other than this run put it there.
    """
    path, final, hist = (
        stage_dir / "metrics.json",
        stage_dir / "final.pt",
        stage_dir / "history.json",
    )
    if not (final.is_file() and path.is_file()):
        return None
    try:
        if identity is None:
            load_checkpoint(final)
            return read_json(path, strict=False)
        load_checkpoint(final, identity, own=True)
        if not hist.is_file():
            raise CorruptCheckpoint(f"file {hist} is missing", hist, "missing")
        history = read_json(hist)
        metrics = read_json(path)
    except CorruptCheckpoint as exc:
        warnings.warn(
            f"{exc.path} is corrupt: the stage is trained again ({exc.reason})", stacklevel=2
        )
        clear_stage(stage_dir)
        return None
    problem = (
        identity_mismatch(hist, history.get(IDENTITY_KEY), identity)
        if isinstance(history, dict)
        else f"{hist} is not a history file"
    )
    if problem is None:
        want = {k: identity[k] for k in ("stage", "target", "seed")}
        got = {k: metrics.get(k) for k in want} if isinstance(metrics, dict) else {}
        problem = identity_mismatch(path, got, want)
    if problem:
        raise CheckpointError(problem + _REFUSED)
    return metrics


def clear_stage(stage_dir: Path) -> None:
    """Remove a stage's result files (a stale or corrupt earlier attempt)."""
    for name in (
        "metrics.json",
        "history.json",
        "final.pt",
        "labeler_final.pt",
        "state.pt",
        "state.prev.pt",
    ):
        for p in (stage_dir / name, _sidecar(stage_dir / name)):
            if p.exists():
                p.unlink()


def write_final(
    stage_dir: Path,
    final: dict[str, Any],
    metrics: dict[str, Any],
    history: dict,
    identity: dict[str, Any] | None = None,
) -> None:
    """Write a finished stage's files (``metrics.json`` last: it marks the stage as done).

    With ``identity`` (the stage's :func:`stage_identity`, kind ``"final"``) ``final.pt`` and
    ``history.json`` record it; every file gets a SHA-256 sidecar.
    """
    if identity is not None:
        final = {**final, IDENTITY_KEY: identity}
    atomic_save(final, stage_dir / "final.pt")
    payload: dict[str, Any] = {"history": history}
    if identity is not None:
        payload[IDENTITY_KEY] = identity
    atomic_write_text(json.dumps(payload), stage_dir / "history.json", sidecar=True)
    atomic_write_text(json.dumps(metrics, indent=2), stage_dir / "metrics.json", sidecar=True)
    for name in ("state.pt", "state.prev.pt"):
        for p in (stage_dir / name, _sidecar(stage_dir / name)):
            if p.exists():
                p.unlink()


class StageCheckpoint:
    """The periodic ``state.pt`` of a stage: every stateful object it names, the global RNG, the
    logged history and the iteration, written atomically every ``every`` iterations.

    ``objects`` maps a key to anything with ``state_dict``/``load_state_dict`` (modules,
    optimizers, loaders, thresholds) or a ``torch.Generator``; ``None`` values are skipped.

    Args:
        path: the ``state.pt`` file.
        every: save every this many iterations.
        logger: the stage's :class:`~bort2.trainer.Logger` (its history is saved too).
        resume: restore from ``path`` when it exists.
        stop_after: tests: raise :class:`StageInterrupted` after this many saves (0 = never).
        write: whether this process writes the file (rank 0 under torchrun; every rank
            restores from it).
        identity: the stage's :func:`stage_identity` (kind ``"state"``): saved in the file and
            required of it on restore (None: neither, for callers outside the pipeline).
    """

    def __init__(
        self,
        path: Path,
        every: int,
        logger: Any,
        resume: bool,
        stop_after: int = 0,
        write: bool = True,
        identity: dict[str, Any] | None = None,
        **objects: Any,
    ):
        self.path, self.every, self.logger, self.write = path, every, logger, write
        self.identity = identity
        self.resume, self.stop_after = resume, stop_after
        self.objects = {k: v for k, v in objects.items() if v is not None}
        self.saved = 0

    @property
    def previous(self) -> Path:
        return self.path.with_name(self.path.stem + ".prev" + self.path.suffix)

    def restore(self) -> int:
        """Load the saved state when resuming; returns the iteration to start from.

        A corrupt ``state.pt`` (or one without its SHA-256 sidecar: a crash between writing the
        two) falls back to the previous periodic state (``state.prev.pt``) with a warning; when
        neither can be verified the stage starts again from iteration 0, with a warning naming
        both (the same numbers, computed again). A state that loads but is another stage's,
        seed's or run's (its identity record differs) is refused at once.
        """
        if not self.resume:
            return 0
        candidates = [p for p in (self.path, self.previous) if p.is_file()]
        if not candidates:
            return 0
        errors = []
        own = self.identity is not None
        for path in candidates:
            try:
                st = load_checkpoint(path, self.identity, own=own)
                break
            except CorruptCheckpoint as exc:
                errors.append(str(exc))
            except CheckpointError as exc:
                if own and not _sidecar(path).is_file():
                    errors.append(str(exc))  # unverifiable: try the older state
                    continue
                raise
        else:
            # nothing verifiable to resume from (a crash between writing a state and its
            # sidecar, or damaged bytes): the stage starts over, which recomputes the same
            # numbers; a state of another stage, seed or run was refused above
            warnings.warn(
                f"{'; '.join(errors)}; no periodic state of {self.path.parent} can be verified, "
                "so this stage starts again from iteration 0",
                stacklevel=2,
            )
            return 0
        if errors:
            warnings.warn(f"{errors[0]}; resuming from {path.name} instead", stacklevel=2)
        for key, obj in self.objects.items():
            if isinstance(obj, torch.Generator):
                obj.set_state(st[key])
            else:
                obj.load_state_dict(st[key])
        set_rng_state(st["rng"])
        self.logger.history = st["history"]
        return int(st["it"])

    def step(self, done: int, total: int) -> None:
        """After ``done`` iterations: save if due; stop on purpose if a test asked to.

        The previous periodic state is kept as ``state.prev.pt`` (a fallback if the newer one
        is ever found corrupt).
        """
        if done % self.every or done >= total:
            return
        if not self.write:
            self._count(done)
            return
        st = {
            k: o.get_state() if isinstance(o, torch.Generator) else o.state_dict()
            for k, o in self.objects.items()
        }
        st.update(rng=rng_state(), history=self.logger.history, it=done)
        if self.identity is not None:
            st[IDENTITY_KEY] = self.identity
        flush = getattr(self.logger, "flush", None)
        if flush is not None:  # TensorBoard events up to here, recorded in the manifest
            flush()
        if self.path.is_file():
            # the old fallback's sidecar goes first: a crash at any point leaves every state
            # file either with its own sidecar or with none (never with another file's); each
            # file is recorded under its new name (its bytes are ours) before it takes it
            _sidecar(self.previous).unlink(missing_ok=True)
            side = _sidecar(self.path)
            text = side.read_text().strip() if side.is_file() else ""
            # without a sidecar (a kill between the state and its sidecar) the digest is of the
            # bytes about to be renamed: the new name does not exist yet
            if len(text) != 64:
                text = hashlib.sha256(self.path.read_bytes()).hexdigest()
            record(self.previous, text)
            os.replace(self.path, self.previous)
            if side.is_file():
                record(_sidecar(self.previous), hashlib.sha256(side.read_bytes()).hexdigest())
                os.replace(side, _sidecar(self.previous))
        atomic_save(st, self.path)
        self._count(done)

    def _count(self, done: int) -> None:
        self.saved += 1
        if self.stop_after and self.saved >= self.stop_after:
            raise StageInterrupted(f"stopped after checkpoint at iteration {done}")


class StageInterrupted(RuntimeError):
    """Raised on purpose by ``stop_after`` (tests of resume)."""
