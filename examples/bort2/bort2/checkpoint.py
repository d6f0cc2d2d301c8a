"""Atomic files, checkpoints and random-number state of the BORT2 stages.

Every stage (one step-1 method or one step-2 variant, for one target and seed) lives in its own
directory with ``state.pt`` (periodic, atomic: models, optimizers, loaders, every RNG) and, once
finished, ``final.pt`` + ``history.json`` + ``metrics.json``. A killed run restarted with
``resume=true`` continues from the last ``state.pt`` and, because every random stream is
restored, ends with the same numbers as an uninterrupted run (same machine and thread count).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file in the same folder, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_text(text: str, path: Path) -> None:
    """Write ``text`` to a temporary file next to ``path``, then ``os.replace`` it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint saved by this package (tensors and plain containers only)."""
    return torch.load(path, map_location="cpu", weights_only=True)


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
    """The metrics of a finished stage (``final.pt`` and ``metrics.json`` exist), else None."""
    path = stage_dir / "metrics.json"
    if (stage_dir / "final.pt").is_file() and path.is_file():
        return json.loads(path.read_text())
    return None


def write_final(
    stage_dir: Path, final: dict[str, Any], metrics: dict[str, Any], history: dict
) -> None:
    """Write a finished stage's files (``metrics.json`` last: it marks the stage as done)."""
    atomic_save(final, stage_dir / "final.pt")
    atomic_write_text(json.dumps({"history": history}), stage_dir / "history.json")
    atomic_write_text(json.dumps(metrics, indent=2), stage_dir / "metrics.json")
    state = stage_dir / "state.pt"
    if state.exists():
        state.unlink()


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
    """

    def __init__(
        self,
        path: Path,
        every: int,
        logger: Any,
        resume: bool,
        stop_after: int = 0,
        **objects: Any,
    ):
        self.path, self.every, self.logger = path, every, logger
        self.resume, self.stop_after = resume, stop_after
        self.objects = {k: v for k, v in objects.items() if v is not None}
        self.saved = 0

    def restore(self) -> int:
        """Load the saved state when resuming; returns the iteration to start from."""
        if not (self.resume and self.path.is_file()):
            return 0
        st = load_checkpoint(self.path)
        for key, obj in self.objects.items():
            if isinstance(obj, torch.Generator):
                obj.set_state(st[key])
            else:
                obj.load_state_dict(st[key])
        set_rng_state(st["rng"])
        self.logger.history = st["history"]
        return int(st["it"])

    def step(self, done: int, total: int) -> None:
        """After ``done`` iterations: save if due; stop on purpose if a test asked to."""
        if done % self.every or done >= total:
            return
        st = {
            k: o.get_state() if isinstance(o, torch.Generator) else o.state_dict()
            for k, o in self.objects.items()
        }
        st.update(rng=rng_state(), history=self.logger.history, it=done)
        atomic_save(st, self.path)
        self.saved += 1
        if self.stop_after and self.saved >= self.stop_after:
            raise StageInterrupted(f"stopped after checkpoint at iteration {done}")


class StageInterrupted(RuntimeError):
    """Raised on purpose by ``stop_after`` (tests of resume)."""
