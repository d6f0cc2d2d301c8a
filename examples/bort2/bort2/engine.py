"""Entry points of the BORT2 stages: train one step-1 method or one step-2 method.

The loop itself is :func:`bort2.trainer.run_stage`, shared by every registered stage
(:mod:`bort2.step1.stage`, :mod:`bort2.step2.stages`); checkpoints live in
:mod:`bort2.checkpoint` and evaluation in :mod:`bort2.evaluation`. This module imports the
stage modules (which registers them) and re-exports what callers of the pipeline use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .checkpoint import (
    StageInterrupted,
    atomic_save,
    atomic_write_text,
    load_checkpoint,
    rng_state,
    set_rng_state,
)
from .errors import CheckpointError, PipelineError, TrainingDiverged, UnitFailed
from .evaluation import accuracy_with_ci, evaluate, predict_dataset
from .stages_index import LABELER, STAGE_B
from .step1 import stage as _step1_stages  # noqa: F401  (registers step1/*)
from .step2 import stages as _step2_stages  # noqa: F401  (registers step2/*)
from .step2.stages import load_labeler
from .trainer import STAGES, StageContext, build_model, resolve_device, run_stage

__all__ = [
    "STAGES",
    "CheckpointError",
    "PipelineError",
    "TrainingDiverged",
    "UnitFailed",
    "StageContext",
    "StageInterrupted",
    "accuracy_with_ci",
    "atomic_save",
    "atomic_write_text",
    "build_model",
    "evaluate",
    "load_checkpoint",
    "load_labeler",
    "predict_dataset",
    "resolve_device",
    "rng_state",
    "set_rng_state",
    "train_step1",
    "train_step2",
]


def train_step1(ctx: StageContext, method_name: str) -> dict[str, Any]:
    """Train one step-1 method on the sources (+ unlabelled target); returns its metrics."""
    return run_stage(ctx, f"step1/{method_name}")


def train_step2(
    ctx: StageContext,
    variant: str,
    labeler_path: Path,
    robust_path: Path | None = None,
) -> dict[str, Any]:
    """Train one step-2 method (a ``step2/...`` row of :data:`bort2.stages_index.SPECS`).

    Args:
        ctx: the stage's context.
        variant: the method's name.
        labeler_path: the step-1 labeler's ``final.pt`` (the checkpoint alone defines the model).
        robust_path: Stage B's ``final.pt``; Stage C starts from it with its default
            ``step2.bort2_init``.
    """
    ctx.inputs = {LABELER: Path(labeler_path)}
    if robust_path is not None:
        ctx.inputs[STAGE_B] = Path(robust_path)
    return run_stage(ctx, f"step2/{variant}")
