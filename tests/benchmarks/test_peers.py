"""The peer adapters of ``benchmarks/peers`` against exact references.

On the synthetic ``ridge_tiny`` problem (float64, 5 unknowns, condition number ~2) every installed
library's implicit solvers (K = 200) and unrolled mode (150 SGD steps from 0 at lr 1/lambda_max)
must return the closed-form hypergradient to 1e-6 relative; a library that is not installed is
skipped with its adapter's reason. Two peer bugs are pinned as strict xfails. On the peer
suite's problems 1-2 (scikit-learn data), hypergrad matches the references, jaxopt and torchopt.
The full suite is ``python -m benchmarks peers`` (docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks import problems
from benchmarks.peers import LIBS, build, missing, module, solvers

TINY = problems.get("ridge_tiny")
KNOWN_WRONG = {
    ("betty", "cg"): "betty-ml 0.1.1 updates the CG direction with the old residual",
    ("hypertorch", "cg"): "hypertorch's CG returns the previous iterate once it has converged",
}
IMPLICIT = [(lib, s) for lib in LIBS for s in solvers(lib, TINY)]
UNROLLED = [lib for lib in LIBS if hasattr(module(lib), "unrolled")]


def _require(lib: str) -> None:
    reason = missing(lib)
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize(("lib", "solver"), IMPLICIT, ids=[f"{a}-{b}" for a, b in IMPLICIT])
def test_implicit_adapter_matches_exact(lib, solver, request):
    _require(lib)
    if (lib, solver) in KNOWN_WRONG:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_WRONG[lib, solver], strict=True))
    assert TINY.rel_error(build(lib, "implicit", TINY, solver, 200)()) <= 1e-6


@pytest.mark.parametrize("lib", UNROLLED)
def test_unrolled_adapter_matches_exact(lib):
    _require(lib)
    start = {n: torch.zeros_like(p) for n, p in TINY.params.items()}
    assert TINY.rel_error(build(lib, "unrolled", TINY, 150, TINY.alpha, start)()) <= 1e-6


@pytest.fixture(scope="module")
def sklearn_problems():
    pytest.importorskip("sklearn", reason="scikit-learn provides the data sets")
    keys = ["ridge_breast_cancer", "ridge_diabetes", "logreg_breast_cancer"]
    return {k: problems.get(k) for k in keys}


@pytest.mark.parametrize("key", ["ridge_breast_cancer", "ridge_diabetes", "logreg_breast_cancer"])
@pytest.mark.parametrize("peer", [None, "jaxopt", "torchopt"])
def test_hypergrad_matches_reference_and_peers(sklearn_problems, key, peer):
    P = sklearn_problems[key]
    ours = build("hypergrad", "implicit", P, "cg", 200)()
    if peer is None:
        assert P.rel_error(ours) <= 1e-6
        return
    _require(peer)
    theirs = build(peer, "implicit", P, "cg", 200)()
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) <= 1e-6
