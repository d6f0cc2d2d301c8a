"""hypergrad against the peer libraries (jaxopt, torchopt) on the benchmark's problems 1 and 2.

Float64 ridge regression (breast_cancer, diabetes) and logistic regression (breast_cancer) with
one weight decay per feature: hypergrad's converged CG hypergradient must match jaxopt's and
torchopt's ``custom_root`` + ``solve_cg`` (and the closed-form / dense reference) to 1e-6 relative.
Skipped, with the reason, when a peer or scikit-learn is not installed
(``pip install -e ".[bench]"``). The full benchmark is ``benchmarks/peers/run_all.py``.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip(
    "sklearn", reason="scikit-learn provides the data sets (pip install -e '.[bench]')"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, "benchmarks", "peers")
if PEERS not in sys.path:
    sys.path.insert(0, PEERS)

PROBLEMS = ["ridge_breast_cancer", "ridge_diabetes", "logreg_breast_cancer"]
K = 200  # CG iterations; every problem converges (relative residual 1e-10) well before


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def problems():
    import problems as pr

    return {k: pr.get(k) for k in PROBLEMS}


@pytest.mark.parametrize("key", PROBLEMS)
def test_hypergrad_matches_reference(problems, key):
    import adapters as ad

    P = problems[key]
    g = ad.make("hypergrad", "cg", P, K)()
    assert P.rel_error(g) <= 1e-6


@pytest.mark.parametrize("key", PROBLEMS)
def test_hypergrad_matches_jaxopt(problems, key):
    pytest.importorskip("jax", reason="jax not installed (pip install -e '.[bench]')")
    pytest.importorskip("jaxopt", reason="jaxopt not installed (pip install -e '.[bench]')")
    import adapters as ad

    P = problems[key]
    ours = ad.make("hypergrad", "cg", P, K)()
    theirs = ad.make("jaxopt", "cg", P, K)()
    assert _rel(ours, theirs) <= 1e-6


@pytest.mark.parametrize("key", PROBLEMS)
def test_hypergrad_matches_torchopt(problems, key):
    pytest.importorskip("torchopt", reason="torchopt not installed")
    import adapters as ad

    P = problems[key]
    ours = ad.make("hypergrad", "cg", P, K)()
    theirs = ad.make("torchopt", "cg", P, K)()
    assert _rel(ours, theirs) <= 1e-6
