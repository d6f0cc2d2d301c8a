"""The examples' shared command-line pieces (``examples/_cli.py``)."""

from __future__ import annotations

import argparse

import pytest
import torch
from _cli import AdjointStarts, add_adjoint_options


def test_adjoint_starts_previous_and_extrapolated():
    a0 = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(0.5)}
    a1 = {"w": torch.tensor([1.5, 2.5]), "b": torch.tensor(1.0)}
    off, prev, extra = AdjointStarts(None), AdjointStarts("previous"), AdjointStarts("extrapolate")
    for s in (off, prev, extra):
        assert s.x0() is None  # nothing kept yet
        s.update(a0)
    assert off.x0() is None
    assert prev.x0() is a0 and extra.x0() is a0  # one kept: the previous adjoint
    for s in (prev, extra):
        s.update(a1)
    assert prev.x0() is a1
    x0 = extra.x0()  # 2 a1 - a0
    torch.testing.assert_close(x0["w"], torch.tensor([2.0, 3.0]))
    torch.testing.assert_close(x0["b"], torch.tensor(1.5))
    extra.update(None)  # an unconverged solve: forget both
    assert extra.x0() is None


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

    import hypergrad as hg

    ap = argparse.ArgumentParser()
    add_adjoint_options(ap)
    assert ap.parse_args([]).precond == "none"
    assert ap.parse_args(["--precond", "dense"]).precond == "dense"
    assert preconditioner("none") is None
    assert preconditioner("hutchinson") == "hutchinson"
    pre = preconditioner("dense")
    assert isinstance(pre, hg.DensePreconditioner) and pre.builds == 0
    assert preconditioner("dense") is not pre  # one per run: it holds a factor
