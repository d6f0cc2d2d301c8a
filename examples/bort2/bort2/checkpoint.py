"""Atomic files, checkpoints and random-number state of the BORT2 stages.

Every stage (one step-1 method or one step-2 variant, for one target and seed) lives in its own
directory with ``state.pt`` (periodic, atomic: models, optimizers, loaders, every RNG) and, once
finished, ``final.pt`` + ``history.json`` + ``metrics.json``. A killed run restarted with
``resume=true`` continues from the last ``state.pt`` and, because every random stream is
restored, ends with the same numbers as an uninterrupted run (same machine and thread count).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_bytes_atomic(data: bytes, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


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
    try:
        _write_bytes_atomic(data, path)
        _write_bytes_atomic(hashlib.sha256(data).hexdigest().encode(), _sidecar(path))
    except OSError as exc:
        raise _write_error(path, exc) from None


def atomic_write_text(text: str, path: Path) -> None:
    """Write ``text`` to a temporary file next to ``path``, then ``os.replace`` it."""
    try:
        _write_bytes_atomic(text.encode(), path)
    except OSError as exc:
        raise _write_error(path, exc) from None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint saved by this package (tensors and plain containers only).

    Raises:
        CheckpointError: the file is missing, fails its checksum (when it has one) or cannot
            be read; the message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    data = path.read_bytes()
    sidecar = _sidecar(path)
    if sidecar.is_file() and sidecar.read_text().strip() != hashlib.sha256(data).hexdigest():
        raise CheckpointError(f"checkpoint {path} is corrupt (its SHA-256 does not match)")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, random bytes, foreign pickles
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = type(exc).__name__ + ("" if "weights_only" in first or not first else f": {first}")
        raise CheckpointError(f"checkpoint {path} cannot be read ({reason})") from None


def verified(path: Path) -> bool:
    """Whether ``path`` loads as a checkpoint (checksum included)."""
    try:
        load_checkpoint(path)
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


def finished_metrics(stage_dir: Path) -> dict[str, Any] | None:
    """The metrics of a finished stage whose ``final.pt`` verifies, else None.

    A finished stage with a corrupt ``final.pt`` is reported and cleared so that it is trained
    again (its table row would otherwise stand for weights that no longer exist).
    """
    path, final = stage_dir / "metrics.json", stage_dir / "final.pt"
    if not (final.is_file() and path.is_file()):
        return None
    if not verified(final):
        warnings.warn(f"{final} is corrupt: the stage is trained again", stacklevel=2)
        clear_stage(stage_dir)
        return None
    return json.loads(path.read_text())


def clear_stage(stage_dir: Path) -> None:
    """Remove a stage's result files (a stale or corrupt earlier attempt)."""
    for name in ("metrics.json", "history.json", "final.pt", "state.pt", "state.prev.pt"):
        for p in (stage_dir / name, _sidecar(stage_dir / name)):
            if p.exists():
                p.unlink()


def write_final(
    stage_dir: Path, final: dict[str, Any], metrics: dict[str, Any], history: dict
) -> None:
    """Write a finished stage's files (``metrics.json`` last: it marks the stage as done)."""
    atomic_save(final, stage_dir / "final.pt")
    atomic_write_text(json.dumps({"history": history}), stage_dir / "history.json")
    atomic_write_text(json.dumps(metrics, indent=2), stage_dir / "metrics.json")
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
    """

    def __init__(
        self,
        path: Path,
        every: int,
        logger: Any,
        resume: bool,
        stop_after: int = 0,
        write: bool = True,
        **objects: Any,
    ):
        self.path, self.every, self.logger, self.write = path, every, logger, write
        self.resume, self.stop_after = resume, stop_after
        self.objects = {k: v for k, v in objects.items() if v is not None}
        self.saved = 0

    @property
    def previous(self) -> Path:
        return self.path.with_name(self.path.stem + ".prev" + self.path.suffix)

    def restore(self) -> int:
        """Load the saved state when resuming; returns the iteration to start from.

        A corrupt ``state.pt`` falls back to the previous periodic state (``state.prev.pt``)
        with a warning; when neither loads, the error names both files.
        """
        if not self.resume:
            return 0
        candidates = [p for p in (self.path, self.previous) if p.is_file()]
        if not candidates:
            return 0
        errors = []
        for path in candidates:
            try:
                st = load_checkpoint(path)
                break
            except CheckpointError as exc:
                errors.append(str(exc))
        else:
            raise CheckpointError(
                "; ".join(errors) + ". Delete the file to restart this stage, or rerun with "
                "overwrite=true"
            )
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
        if self.path.is_file():
            os.replace(self.path, self.previous)
            if _sidecar(self.path).is_file():
                os.replace(_sidecar(self.path), _sidecar(self.previous))
        atomic_save(st, self.path)
        self._count(done)

    def _count(self, done: int) -> None:
        self.saved += 1
        if self.stop_after and self.saved >= self.stop_after:
            raise StageInterrupted(f"stopped after checkpoint at iteration {done}")


class StageInterrupted(RuntimeError):
    """Raised on purpose by ``stop_after`` (tests of resume)."""
