"""hg.stochastic.run's stop reasons: the stall test (held-out estimates without progress while
the iterates keep moving), the tolerance, and that neither changes the iterates.

Problems and exact predictions from test_stochastic.py (the quadratic family) and
test_stochastic_rates.py (the exact second-moment helper)."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from test_stochastic import X0, Z0, flat, make_quad, problem, ztree
from test_stochastic_rates import F64, D, X, soba_kron, stationary, trajectory, x_mse

import hypergrad as hg

S = hg.stochastic


def _same(a: S.StochasticState, b: S.StochasticState) -> bool:
    tensors = all(
        torch.equal(u, w)
        for name in ("x", "z", "v", "y")
        for u, w in zip(getattr(a, name), getattr(b, name), strict=True)
    )
    memory = a.memory.keys() == b.memory.keys() and all(
        torch.equal(u, w) for k in a.memory for u, w in zip(a.memory[k], b.memory[k], strict=True)
    )
    return tensors and memory and a.iteration == b.iteration


def test_soba_at_its_noise_floor_stalls_once_the_expected_error_has_reached_it() -> None:
    """SOBA, constant ρ = 0.3, γ = 0.1 on batches of 2 inner / 1 outer samples: its exact floor
    E||x − x*||² is 5.67 (test_stochastic_rates' helper). With the held-out estimates every 20
    iterations and the default window of 10 evaluations, the run must stop "stalled" before its
    budget, with one SolverStalledWarning, and honestly: at the stop the exact expected error is
    within 5% of the floor (more iterations cannot lower it in expectation). The iterates up to
    the stop equal bit for bit those of the same run with the test off, which runs the whole
    budget ("maxiter", no warning)."""
    q = make_quad()
    xs = q.xstar()
    solver, pb = S.SOBA(step_inner=0.3, step_outer=0.1), problem(q, 2, 1)
    with pytest.warns(hg.SolverStalledWarning, match="soba: stalled") as caught:
        _, report = S.run(solver, pb, ztree(Z0), (X0.clone(),), iterations=3000, eval_every=20)
    assert len([w for w in caught if issubclass(w.category, hg.HypergradWarning)]) == 1
    assert report.reason == "stalled" and not report.diverged
    assert report.iterations < 3000 and report.iterations % 20 == 0
    assert "no held-out estimate improved" in report.detail
    K = soba_kron(q, 0.3, 0.1, 2, 1)
    floor = x_mse(stationary(K), xs, X)
    exact = trajectory(K, torch.cat([Z0, torch.zeros(D, dtype=F64), X0]), xs, X, 3000)
    assert abs(exact[report.iterations] - floor) < 0.05 * floor
    with warnings.catch_warnings():
        warnings.simplefilter("error", hg.HypergradWarning)
        _, off = S.run(
            solver,
            pb,
            ztree(Z0),
            (X0.clone(),),
            iterations=report.iterations,
            eval_every=20,
            stall_window=None,
        )
    assert off.reason == "maxiter" and _same(off.state, report.state)


def test_saba_on_a_plateau_of_minibatch_held_out_estimates_does_not_stall() -> None:
    """SABA at the same steps and batches converges linearly to x* (test_stochastic_rates), but
    its held-out estimates, on minibatches, level off at the batches' own values at x*: the
    first half of the test holds. The iterates' moves shrink geometrically, so the second half
    fails and the run goes on to its budget, with no warning and x at x* to 1e-4."""
    q = make_quad()
    xs = q.xstar()
    with warnings.catch_warnings():
        warnings.simplefilter("error", hg.HypergradWarning)
        x, report = S.run(
            S.SABA(step_inner=0.3, step_outer=0.1),
            problem(q, 2, 1),
            ztree(Z0),
            (X0.clone(),),
            iterations=1000,
            eval_every=20,
        )
    assert report.reason == "maxiter" and report.iterations == 1000 and report.detail == ""
    assert float((x[0] - xs).norm()) < 1e-4
    # the held-out hypergradient estimate did plateau: its last 10 values' best is not 10% below
    # the best before them (the first half of the stall test), far from zero
    h = [d.outer_grad_norm for d in report.history]
    assert min(h[-11:-1]) > 0.9 * min(h[:-11]) and min(h) > 1e-3


@pytest.mark.parametrize(
    "solver",
    [S.SABA(step_inner=0.3, step_outer=0.1), S.SOBA(step_inner=0.3, step_outer=0.1)],
    ids=lambda s: s.name,
)
def test_resume_is_bitwise_with_the_stall_test_on(solver) -> None:
    """The checks read the iterates, never write them: a run of 2n iterations with evaluations
    and the stall test (the default window) equals n, a save and a load, and n more (neither
    stalls this early)."""
    pb = problem(make_quad(), 2, 1)
    n, kw = 60, {"eval_every": 10}
    _, straight = S.run(solver, pb, ztree(Z0), (X0.clone(),), iterations=2 * n, **kw)
    _, half = S.run(solver, pb, ztree(Z0), (X0.clone(),), iterations=n, **kw)
    buf = io.BytesIO()
    torch.save(half.state.state_dict(), buf)
    buf.seek(0)
    fresh = solver.init(ztree(Z0), (X0.clone(),))
    fresh.load_state_dict(torch.load(buf))
    _, resumed = S.run(solver, pb, iterations=n, state=fresh, **kw)
    assert straight.reason == half.reason == resumed.reason == "maxiter"
    assert _same(straight.state, resumed.state)


def test_tol_stops_converged_or_warns_at_the_budget() -> None:
    """Full batches (held-out = all samples, so the estimates are exact): with tol = 1e-8,
    SOBA at ρ = 0.5, γ = 0.2 stops "converged" at the first evaluation whose three estimates
    are within tol, and the closed-form hypergradient there is small too; with a budget too
    short, "maxiter" and one SolverStalledWarning naming the numbers."""
    q = make_quad()
    solver = S.SOBA(step_inner=0.5, step_outer=0.2)
    x, report = S.run(
        solver, problem(q), ztree(Z0), (X0.clone(),), iterations=2000, eval_every=10, tol=1e-8
    )
    last = report.history[-1]
    assert report.reason == "converged" and report.iterations < 2000
    assert max(last.inner_grad_norm, last.adjoint_residual, last.outer_grad_norm) <= 1e-8
    assert (
        max(
            report.history[-2].inner_grad_norm,
            report.history[-2].adjoint_residual,
            report.history[-2].outer_grad_norm,
        )
        > 1e-8
    )
    assert float(q.hypergrad(x[0]).norm()) < 1e-7
    with pytest.warns(hg.SolverStalledWarning, match="soba: stopped at the iteration budget"):
        _, short = S.run(
            solver, problem(q), ztree(Z0), (X0.clone(),), iterations=30, eval_every=10, tol=1e-8
        )
    assert short.reason == "maxiter" and "above tol" in short.detail


def test_run_refuses_bad_stop_settings() -> None:
    pb = problem(make_quad())
    for bad in ({"stall_window": 1}, {"stall_window": 2.5}, {"tol": -1.0}, {"tol": float("nan")}):
        with pytest.raises(hg.HypergradError):
            S.run(S.SOBA(), pb, ztree(Z0), (X0.clone(),), iterations=3, **bad)
    assert hg.stochastic.base.REASONS == ("converged", "maxiter", "stalled", "diverged", "callback")
    _, report = S.run(S.SOBA(), pb, ztree(Z0), (X0.clone(),), iterations=3)
    assert report.reason == "maxiter" and flat(report.state.x).shape == (2,)
