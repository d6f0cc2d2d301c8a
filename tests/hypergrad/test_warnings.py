"""Warnings that help: stable texts (shown once per place by Python's default filter), advice
fitted to the settings, and HyperStep's policy for results that are not hypergradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import hypergrad as hg

F64 = torch.float64


def _diag_matvec(d):
    return lambda v: (d * v[0],)


def _diverging_solves(alphas):
    b = (torch.ones(3, dtype=F64),)
    for alpha in alphas:
        hg.Neumann(maxiter=40, alpha=alpha).solve(
            _diag_matvec(torch.tensor([1.0, 2.0, 3.0], dtype=F64)), b
        )


def test_divergence_warning_is_shown_once_by_the_default_filter():
    """Five divergences with different growth and alpha: one message text, shown once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        _diverging_solves([1.0, 2.0, 5.0, 10.0, 100.0])
    diverged = [w for w in caught if issubclass(w.category, hg.SolverDivergedWarning)]
    assert len(diverged) == 1, [str(w.message) for w in diverged]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _diverging_solves([1.0, 100.0])
    texts = {str(w.message) for w in caught if issubclass(w.category, hg.SolverDivergedWarning)}
    assert len(texts) == 1


def test_divergence_advice_fits_how_alpha_was_chosen():
    b = (torch.ones(2, dtype=F64),)
    with pytest.warns(hg.SolverDivergedWarning) as given:
        hg.Neumann(maxiter=40, alpha=10.0).solve(
            _diag_matvec(torch.tensor([1.0, 2.0], dtype=F64)), b
        )
    assert "alpha=None" in str(given[0].message)
    # an indefinite operator: alpha = 1/lambda_max from the power iteration, and the negative
    # eigenvalue makes the series grow; telling this user "use alpha=None" would not help
    with pytest.warns(hg.SolverDivergedWarning) as estimated:
        _, info = hg.Neumann(maxiter=60, alpha=None).solve(
            _diag_matvec(torch.tensor([4.0, -1.0], dtype=F64)), b
        )
    assert info.diverged
    text = str(estimated[0].message)
    assert "alpha=None" not in text and "MINRES" in text and "power_iters" in text


def _problem(solver):
    torch.manual_seed(0)
    model, hyper = nn.Linear(3, 2).to(F64), nn.Linear(3, 2).to(F64)
    x = torch.randn(10, 3, dtype=F64)
    inner = lambda m, b: ((m(b) - hyper(b)) ** 2).mean() + 1e-2 * (m.weight**2).sum()  # noqa: E731
    outer = lambda m, b: (m(b) ** 2).mean()  # noqa: E731
    return model, hyper, x, inner, outer


DIVERGING = hg.Neumann(maxiter=30, alpha=50.0)


def test_skip_is_the_default_and_leaves_grad_unwritten():
    model, hyper, x, inner, outer = _problem(DIVERGING)
    for p in hyper.parameters():
        p.grad = torch.ones_like(p)  # a stale gradient from an earlier step
    step = hg.HyperStep(model, hyper, inner, outer, solver=DIVERGING)
    with pytest.warns(hg.HypergradWarning, match="skipped"):
        info = step(x)
    assert info.skipped and "diverged" in info.skip_reason
    assert all(p.grad is None for p in hyper.parameters())  # an optimizer step moves nothing
    opt = torch.optim.SGD(hyper.parameters(), lr=1.0)
    before = [p.detach().clone() for p in hyper.parameters()]
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(hyper.parameters(), before))


def test_skip_with_accumulate_keeps_what_was_accumulated():
    model, hyper, x, inner, outer = _problem(DIVERGING)
    for p in hyper.parameters():
        p.grad = torch.full_like(p, 0.5)
    step = hg.HyperStep(model, hyper, inner, outer, solver=DIVERGING, accumulate=True)
    with pytest.warns(hg.HypergradWarning):
        assert step(x).skipped
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in hyper.parameters())


def test_write_and_raise_policies():
    model, hyper, x, inner, outer = _problem(DIVERGING)
    step = hg.HyperStep(model, hyper, inner, outer, solver=DIVERGING, on_diverged="write")
    with pytest.warns(hg.SolverDivergedWarning):
        hyper_ref, info_ref = step.compute(x)
    with pytest.warns(hg.SolverDivergedWarning):
        info = step(x)
    assert not info.skipped and info.solve.diverged
    for p, h in zip(hyper.parameters(), hyper_ref):
        torch.testing.assert_close(p.grad, h)
    step = hg.HyperStep(model, hyper, inner, outer, solver=DIVERGING, on_diverged="raise")
    with pytest.warns(hg.SolverDivergedWarning), pytest.raises(hg.HypergradError, match="diverged"):
        step(x)
    with pytest.raises(hg.HypergradValueError, match="on_diverged"):
        hg.HyperStep(model, hyper, inner, outer, on_diverged="ignore")


def test_converged_solve_is_written():
    model, hyper, x, inner, outer = _problem(None)
    info = hg.HyperStep(model, hyper, inner, outer, solver=hg.CG(tol=1e-10))(x)
    assert info.solve.converged and not info.skipped
    assert all(p.grad is not None for p in hyper.parameters())


def test_unrolled_nan_hypergradient_is_skipped():
    """Finite losses whose derivative is NaN (sqrt at 0 times 0): skipped, not written."""
    model, hyper, x, inner, _ = _problem(None)
    outer = lambda m, b: ((m(b) - m(b).detach()).abs().sum()).sqrt()  # noqa: E731
    step = hg.HyperStep(model, hyper, inner, outer, method=hg.Unrolled(hg.optim.sgd(lr=0.1)))
    with pytest.warns(hg.HypergradWarning, match="skipped"):
        info = step(x)
    assert info.skipped and "NaN/Inf" in info.skip_reason
    assert all(p.grad is None for p in hyper.parameters())
