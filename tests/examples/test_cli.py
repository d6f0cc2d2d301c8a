"""The examples' shared command-line pieces (``examples/_cli.py``)."""

from __future__ import annotations

import argparse

import pytest
from _cli import add_adjoint_options, adjoint_starts

import hypergrad as hg


def test_adjoint_starts_is_the_library_rule():
    """--warm-start KIND gives hg.WarmStart(KIND) (the rule itself is tested in
    tests/hypergrad/test_hyperstep_methods.py); no flag, no warm start."""
    assert adjoint_starts(None) is None
    for kind in ("previous", "extrapolate"):
        starts = adjoint_starts(kind)
        assert isinstance(starts, hg.WarmStart) and starts.kind == kind and starts.x0() is None


@pytest.mark.parametrize(
    "argv, mode",
    [([], None), (["--warm-start"], "previous"), (["--warm-start", "extrapolate"], "extrapolate")],
)
def test_warm_start_option(argv, mode):
    ap = argparse.ArgumentParser()
    add_adjoint_options(ap)
    assert ap.parse_args(argv).warm_start == mode


def test_precond_option_and_its_preconditioner():
    from _cli import preconditioner

    ap = argparse.ArgumentParser()
    add_adjoint_options(ap)
    assert ap.parse_args([]).precond == "none"
    assert ap.parse_args(["--precond", "dense"]).precond == "dense"
    assert preconditioner("none") is None
    assert preconditioner("hutchinson") == "hutchinson"
    pre = preconditioner("dense")
    assert isinstance(pre, hg.DensePreconditioner) and pre.builds == 0
    assert preconditioner("dense") is not pre  # one per run: it holds a factor
