"""What several test files share: the repository root, float64, the relative error every
numerical comparison uses, the BORT² entry point, and a tiny deterministic classifier."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent  # the repository
F64 = torch.float64
RUN_PY = ROOT / "examples" / "bort2" / "run.py"


def rel(x, ref) -> float:
    """``||x - ref|| / ||ref||`` over all entries (tensors, or what ``torch.as_tensor`` takes)."""
    x, ref = torch.as_tensor(x), torch.as_tensor(ref)
    return float(torch.linalg.norm((x - ref).reshape(-1)) / torch.linalg.norm(ref.reshape(-1)))


def run_module(name: str = "bort2_run") -> ModuleType:
    """``examples/bort2/run.py`` loaded as a module (its ``main(argv)`` is the command line)."""
    spec = importlib.util.spec_from_file_location(name, RUN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LinTanh(nn.Module):
    """Deterministic tiny classifier (no BatchNorm, no dropout): ``head(tanh(body(x)))``."""

    def __init__(self, in_dim: int = 12, d: int = 5, k: int = 3):
        super().__init__()
        self.body = nn.Linear(in_dim, d)
        self.head = nn.Linear(d, k)
        self.feature_dim = d

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(x.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
