"""Every settings object of the library refuses assignment after construction (issue 30): a
setting changed on a live object would bypass its validation (``step.tol = inf`` once made
``compile_outer_step`` report converged with a zero hypergradient)."""

from __future__ import annotations

import pytest
import torch

import hypergrad as hg


def test_warm_start_kind_is_fixed() -> None:
    starts = hg.WarmStart("extrapolate")
    with pytest.raises(hg.FrozenSettingError, match="build a new"):
        starts.kind = "previous"
    assert starts.kind == "extrapolate"
    # its state still moves: a kept adjoint is extrapolated as before
    starts.last, starts.previous = torch.tensor([2.0]), torch.tensor([1.0])
    assert torch.equal(starts.x0(), torch.tensor([3.0]))
