"""Every settings object of the library refuses assignment after construction (issue 30): a
setting changed on a live object would bypass its validation (``step.tol = inf`` once made
``compile_outer_step`` report converged with a zero hypergradient)."""

from __future__ import annotations

import pytest
import torch

import hypergrad as hg
from hypergrad.testing._settings import CheckSettings


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
        (hg.FirstOrder(alpha=0.1), "terms"),
        (hg.SingleLoop(step=0.1), "step"),
        (hg.WarmStart(), "kind"),
        (hg.compile_outer_step(_quad, _quad, compile=False), "tol"),
        (hg.compiled_step.adam(lr=0.1), "lr"),
        (CheckSettings(), "eps"),  # the options of every hypergrad.testing check
    ]
    for obj, attr in cases:
        # every one is on the one settings system now (methods too: issue 31); the error is
        # also an AttributeError and a dataclasses.FrozenInstanceError
        with pytest.raises(hg.FrozenSettingError):
            setattr(obj, attr, 123)


SETTINGS = [
    ("Implicit", lambda: hg.Implicit(solver=hg.CG(maxiter=5)), "engine", "recompute", "fast"),
    ("Unrolled", lambda: hg.Unrolled(hg.optim.sgd(lr=0.1), steps=3), "steps", 4, 0),
    ("FirstOrder", lambda: hg.FirstOrder(alpha=0.1), "terms", 2, -1),
    ("SingleLoop", lambda: hg.SingleLoop(step=0.1), "step", 0.2, 0.0),
    ("CheckSettings", CheckSettings, "eps", 1e-3, 0.0),
]


@pytest.mark.parametrize(
    ("name", "make", "key", "good", "bad"), SETTINGS, ids=[r[0] for r in SETTINGS]
)
def test_methods_and_check_settings_are_frozen_settings(name, make, key, good, bad) -> None:
    """hg.Implicit, hg.Unrolled and the testing checks' options (issue 31): declared fields,
    validated once, frozen, replace() validated like a new object."""
    obj = make()
    before = getattr(obj, key)
    with pytest.raises(hg.FrozenSettingError, match=rf"{name}\.{key} cannot be changed"):
        setattr(obj, key, good)
    with pytest.raises(hg.FrozenSettingError, match=r"\.replace\("):
        delattr(obj, key)
    assert getattr(obj, key) == before
    copy = obj.replace(**{key: good})
    assert getattr(copy, key) == good and copy != obj and getattr(obj, key) == before
    with pytest.raises(hg.HypergradValueError, match=key):
        obj.replace(**{key: bad})
    obj._note = 1  # private attributes stay writable


def test_check_settings_fields_are_checked_by_the_shared_helpers() -> None:
    assert CheckSettings(eps=1, seed=np_int(3)).eps == 1.0
    with pytest.raises(hg.HypergradValueError, match="eps must be > 0 and finite"):
        CheckSettings(eps=float("nan"))
    with pytest.raises(hg.HypergradTypeError, match="seed must be an int"):
        CheckSettings(seed=1.5)
    with pytest.raises(hg.HypergradValueError, match="check_unrolled"):
        CheckSettings(inner_tol=float("inf"))
    assert hash(CheckSettings()) == hash(CheckSettings()) and CheckSettings() == CheckSettings()


def np_int(v: int):
    import numpy as np

    return np.int64(v)


def test_shared_checks_choice_and_range() -> None:
    """The checks added for issue 31: a choice among strings, and a bounded range (optim's)."""
    from hypergrad.settings import check_choice, check_number

    assert check_choice("X engine", "reuse", ("reuse", "recompute")) == "reuse"
    with pytest.raises(hg.HypergradValueError, match=r"X engine must be one of \('reuse',"):
        check_choice("X engine", "fast", ("reuse", "recompute"))
    assert check_number("m", 1.0, maximum=1.0) == 1.0
    with pytest.raises(hg.HypergradValueError, match=r"m must be in \[0, 1\) and finite"):
        check_number("m", 1.0, maximum=1.0, closed=False)
    with pytest.raises(hg.HypergradValueError, match=r"momentum must be in \[0, 1\) and finite"):
        hg.optim.sgd(lr=0.1, momentum=torch.tensor(1.0))  # optim shares the scalar check
    with pytest.raises(hg.HypergradValueError, match="Implicit engine must be one of"):
        hg.Implicit(engine="fast")


@pytest.mark.parametrize(
    "make",
    [lambda: hg.optim.sgd(lr=0.1, momentum=0.9), lambda: hg.optim.adam(lr=0.1)],
    ids=["sgd", "adam"],
)
def test_optimizer_settings_cannot_be_reassigned(make) -> None:
    """A number setting assigned after construction would never be checked (lr = -1 would
    climb the loss): refused; a learned setting is a tensor, changed in place."""
    opt = make()
    with pytest.raises(hg.FrozenSettingError, match="build a new optimizer"):
        opt.lr = -1.0
    assert opt.lr == 0.1
    lr = torch.tensor(0.1, requires_grad=True)
    learned = hg.optim.sgd(lr=lr)
    with torch.no_grad():
        lr.mul_(0.5)  # the tensor itself moves: what an outer optimizer does
    assert float(learned.lr) == pytest.approx(0.05)
