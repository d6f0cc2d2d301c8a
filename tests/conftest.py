"""Shared pytest configuration: float64 helpers and the BORT2 example on the import path."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BORT2 = os.path.join(ROOT, "examples", "bort2")
for path in (ROOT, BORT2, os.path.join(ROOT, "examples")):
    if path not in sys.path:
        sys.path.insert(0, path)

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
