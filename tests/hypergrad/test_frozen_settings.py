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


def _quad(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((x - h) ** 2).sum()


INNER = [
    ("FixedPoint", lambda: hg.inner.FixedPoint(lambda z, h: 0.5 * z + h, tol=1e-10), "tol"),
    ("ProximalGradient", lambda: hg.inner.ProximalGradient(_quad, hg.prox.prox_lasso), "maxiter"),
    ("Newton", lambda: hg.inner.Newton(_quad, reuse_hessian=True), "tol"),
    ("LBFGS", lambda: hg.inner.LBFGS(_quad), "history"),
]


@pytest.mark.parametrize(("name", "make", "key"), INNER, ids=[r[0] for r in INNER])
def test_inner_solver_settings_are_frozen(name, make, key) -> None:
    solver = make()
    before = getattr(solver, key)
    with pytest.raises(hg.FrozenSettingError, match="build a new"):
        setattr(solver, key, float("inf"))
    with pytest.raises(hg.FrozenSettingError, match=f"hg.inner.{name}"):
        delattr(solver, key)
    with pytest.raises(hg.FrozenSettingError):
        solver.solver = hg.CG()
    assert getattr(solver, key) == before
    # replace() builds a validated copy, and refuses what the constructor refuses
    copy = solver.replace(**{key: 7 if key in ("maxiter", "history") else 1e-7})
    assert getattr(copy, key) != before and getattr(solver, key) == before
    with pytest.raises(hg.HypergradValueError):
        solver.replace(**{key: -1})
    # a run still works and records its report (state, not settings)
    h = torch.tensor([0.3, -0.2], dtype=torch.float64)
    x = solver.run(
        torch.zeros(2, dtype=torch.float64), (h, 0.1) if name == "ProximalGradient" else h
    )
    assert solver.last_info is not None and x.shape == (2,)


def test_every_settings_object_refuses_assignment() -> None:
    """One row per kind of settings object in the library."""
    cases = [
        (hg.CG(), "tol"),
        (hg.Neumann(alpha=0.5), "alpha"),
        (hg.Implicit(), "solver"),
        (hg.Unrolled(steps=3, optimizer=hg.optim.sgd(lr=0.1)), "steps"),
        (hg.WarmStart(), "kind"),
        (hg.compile_outer_step(_quad, _quad, compile=False), "tol"),
        (hg.compiled_step.adam(lr=0.1), "lr"),
    ]
    for obj, attr in cases:
        with pytest.raises(AttributeError):  # FrozenSettingError or dataclasses' own
            setattr(obj, attr, 123)
