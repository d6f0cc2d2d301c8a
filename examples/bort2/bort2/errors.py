"""The pipeline's own errors: each says what failed, where, and what to do, in one line.

``run.py`` prints them as ``error: ...`` (exit code 1) instead of a traceback.
"""

from __future__ import annotations


class PipelineError(RuntimeError):
    """Base class of the errors a run reports to its user in one line."""


class TrainingDiverged(PipelineError):
    """A stage produced a non-finite loss or hypergradient; nothing of it was written."""


class CheckpointError(PipelineError):
    """A checkpoint is missing, corrupt or cannot be written (the file is named)."""


class UnitFailed(PipelineError):
    """A (target, seed) unit failed in a worker process (the unit and the cause are named)."""
