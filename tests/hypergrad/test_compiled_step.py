"""``hg.compile_outer_step``: one outer step (Newton on the dense Hessian, the Cholesky adjoint,
the hypergradient, an optional in-graph update) against a closed form (ridge with per-feature
decays), central finite differences (logistic regression), the eager library
(``hg.inner.Newton`` + ``hg.implicit_grad``) and a hand-written Adam; its failure reports
(``maxiter``, ``line_search``, ``indefinite``) and input errors; the traced graph (one
``while_loop``, checked with dynamo's ``aot_eager`` backend in the fast suite) and the inductor
graph (slow)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import log_decay_ridge

import hypergrad as hg
from hypergrad import compiled_step

F64 = torch.float64


def _ridge(d: int = 6, seed: int = 0):
    return log_decay_ridge(d, 50, 40, seed)


def _logreg(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X, Xv = torch.randn(60, 4, generator=g, dtype=F64), torch.randn(50, 4, generator=g, dtype=F64)
    w_true = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=F64)
    y = (torch.rand(60, generator=g, dtype=F64) < torch.sigmoid(X @ w_true)).to(F64)
    yv = (torch.rand(50, generator=g, dtype=F64) < torch.sigmoid(Xv @ w_true)).to(F64)

    def inner(p, th):  # weights and an unpenalised bias: two leaves
        z = X @ p[0] + p[1]
        return (torch.nn.functional.softplus(z) - y * z).mean() + 0.5 * (
            th["decay"].exp() * p[0] ** 2
        ).sum()

    def outer(p, th):
        z = Xv @ p[0] + p[1]
        return (torch.nn.functional.softplus(z) - yv * z).mean()

    theta = {"decay": torch.tensor([-1.0, -2.0, 0.0, -0.5], dtype=F64)}
    w0 = (torch.zeros(4, dtype=F64), torch.zeros((), dtype=F64))
    return inner, outer, theta, w0


def test_ridge_matches_the_closed_form():
    inner, outer, theta, closed = _ridge()
    step = hg.compile_outer_step(inner, outer, tol=1e-12, compile=False)
    r = step(torch.zeros(6, dtype=F64), theta)
    w_star, g_star = closed(theta)
    torch.testing.assert_close(r.w, w_star, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(r.hypergrad, g_star, rtol=1e-9, atol=1e-12)
    assert r.converged and r.failure is None and r.residual <= 1e-12
    assert r.iterations == 1  # a quadratic: one Newton step
    assert r.adjoint_residual < 1e-12
    assert r.outer_loss == pytest.approx(float(outer(w_star, theta)), rel=1e-12)
    assert torch.equal(r.theta, theta) and r.opt_state is None
    # warm-started at the solution: no Newton step, the same hypergradient
    r2 = step(r.w, theta)
    assert r2.iterations == 0
    torch.testing.assert_close(r2.hypergrad, g_star, rtol=1e-9, atol=1e-12)


def test_logistic_regression_matches_central_finite_differences():
    inner, outer, theta, w0 = _logreg()
    step = hg.compile_outer_step(inner, outer, tol=1e-13, compile=False)
    r = step(w0, theta)
    assert r.converged and 2 <= r.iterations <= 20
    assert isinstance(r.w, tuple) and r.w[1].shape == () and set(r.hypergrad) == {"decay"}

    def val(th):
        w, info = hg.inner.Newton(inner, tol=1e-14, maxiter=100).solve(w0, {"decay": th})
        return float(outer(w, None))

    h, d = 1e-5, theta["decay"]
    fd = torch.stack([
        torch.tensor((val(d + h * e) - val(d - h * e)) / (2 * h), dtype=F64)
        for e in torch.eye(4, dtype=F64)
    ])  # fmt: skip
    torch.testing.assert_close(r.hypergrad["decay"], fd, rtol=1e-6, atol=1e-9)


def test_agrees_with_the_eager_library():
    """The same solution and hypergradient as ``hg.inner.Newton`` + ``hg.implicit_grad(Exact)``,
    and the same relative-gradient residual (the reference is ``||∇f(0)||``)."""
    inner, outer, theta, w0 = _logreg(seed=1)
    r = hg.compile_outer_step(inner, outer, tol=1e-10, compile=False)(w0, theta)
    w, info = hg.inner.Newton(inner, tol=1e-10).solve(w0, theta)
    assert r.iterations == info.iterations
    assert r.residual == pytest.approx(info.residual, rel=1e-6, abs=1e-15)
    torch.testing.assert_close(r.w, w, rtol=1e-12, atol=1e-14)
    g, _ = hg.implicit_grad(inner, outer, w, theta, solver=hg.Exact())
    torch.testing.assert_close(r.hypergrad, g, rtol=1e-9, atol=1e-12)


def test_adam_in_the_graph_is_the_hand_written_adam():
    inner, outer, theta, _ = _ridge()
    opt = compiled_step.adam(lr=0.1)
    with_update = hg.compile_outer_step(inner, outer, update=opt, compile=False)
    plain = hg.compile_outer_step(inner, outer, compile=False)
    w = w2 = torch.zeros(6, dtype=F64)
    th, state = theta.clone(), opt.init(theta)
    th2, m, v = theta.clone(), torch.zeros(6, dtype=F64), torch.zeros(6, dtype=F64)
    for t in range(1, 6):
        r = with_update(w, th, state)
        w, th, state = r.w, r.theta, r.opt_state
        r2 = plain(w2, th2)
        w2, g = r2.w, r2.hypergrad
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        th2 = th2 - 0.1 * (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8)
        torch.testing.assert_close(th, th2, rtol=1e-12, atol=1e-14)
    assert float(state["t"]) == 5.0


def test_a_budget_too_small_is_reported():
    inner, outer, theta, w0 = _logreg()
    step = hg.compile_outer_step(inner, outer, maxiter=1, tol=1e-12, compile=False)
    with pytest.warns(hg.SolverStalledWarning, match="did not reach tol"):
        r = step(w0, theta)
    assert not r.converged and r.failure == "maxiter" and r.iterations == 1
    assert r.residual > 1e-12
    assert torch.isfinite(r.hypergrad["decay"]).all()  # approximate, but a number


def test_an_indefinite_hessian_is_reported_and_theta_is_kept():
    """At the local maximum w = 0 of ``(w² − θ)²`` the gradient is zero (``tol`` is met at once)
    but the Hessian ``−4θ`` is negative: no implicit derivative. The hypergradient is NaN and the
    update is not applied."""
    inner = lambda w, th: ((w**2 - th) ** 2).sum()  # noqa: E731
    outer = lambda w, th: (w**2).sum() + th.sum()  # noqa: E731
    theta = torch.ones(2, dtype=F64)
    opt = compiled_step.adam(lr=0.1)
    step = hg.compile_outer_step(inner, outer, update=opt, compile=False)
    with pytest.warns(hg.SolverDivergedWarning, match="not positive definite"):
        r = step(torch.zeros(2, dtype=F64), theta, opt.init(theta))
    assert r.failure == "indefinite" and not r.converged and r.iterations == 0
    assert torch.isnan(r.hypergrad).all()
    assert torch.equal(r.theta, theta) and float(r.opt_state["t"]) == 0.0
    # started off the maximum, Newton (shifted where H is indefinite) finds the minimum w = ±1
    r = step(torch.full((2,), 0.3, dtype=F64), theta, opt.init(theta))
    assert r.converged, r
    torch.testing.assert_close(r.w, torch.ones(2, dtype=F64), rtol=1e-8, atol=1e-10)


def test_a_failed_line_search_is_reported():
    """A loss that is infinite everywhere but at the start: no step decreases it."""
    inner = lambda w, th: (  # noqa: E731
        ((w - th) ** 2).sum() + torch.where(w.abs().sum() > 0, torch.inf, 0.0)
    )
    outer = lambda w, th: (w**2).sum()  # noqa: E731
    step = hg.compile_outer_step(inner, outer, compile=False)
    with pytest.warns(hg.SolverStalledWarning, match="line search"):
        r = step(torch.zeros(2, dtype=F64), torch.ones(2, dtype=F64))
    assert r.failure == "line_search" and not r.converged
    assert torch.equal(r.w, torch.zeros(2, dtype=F64))


def test_bad_inputs_raise_clear_errors():
    inner, outer, theta, _ = _ridge()
    step = hg.compile_outer_step(inner, outer, compile=False)
    n = compiled_step.DENSE_MAX + 1
    big = lambda w, th: 0.5 * (w**2).sum() + th * w.sum()  # noqa: E731
    with pytest.raises(hg.HypergradValueError, match="at most DENSE_MAX = 256 unknowns, got 257"):
        hg.compile_outer_step(big, big, compile=False)(torch.zeros(n, dtype=F64), torch.ones(()))
    vec = lambda w, th: w * th  # noqa: E731
    with pytest.raises(hg.HypergradValueError, match="inner_loss must return a scalar"):
        hg.compile_outer_step(vec, outer, compile=False)(torch.zeros(6, dtype=F64), theta)
    with pytest.raises(hg.HypergradValueError, match="outer_loss must return a scalar"):
        hg.compile_outer_step(inner, vec, compile=False)(torch.zeros(6, dtype=F64), theta)
    unused = lambda w, th: 0.5 * (w**2).sum()  # noqa: E731 - theta influences nothing
    with pytest.raises(hg.HypergradError):
        hg.compile_outer_step(unused, outer, compile=False)(torch.zeros(6, dtype=F64), theta)
    with pytest.raises(hg.HypergradValueError, match="needs opt_state"):
        hg.compile_outer_step(inner, outer, update=compiled_step.adam(), compile=False)(
            torch.zeros(6, dtype=F64), theta
        )
    for bad in (dict(maxiter=0), dict(tol=-1.0), dict(tol=float("nan")), dict(max_backtracks=-1),
                dict(compile="yes")):  # fmt: skip
        with pytest.raises(hg.HypergradValueError):
            hg.compile_outer_step(inner, outer, **bad)
    with pytest.raises(hg.HypergradTypeError):
        hg.compile_outer_step(inner, outer, update=3)
    with pytest.raises(hg.HypergradTypeError):
        hg.compile_outer_step(inner, None)
    # the checks pass: the step runs
    assert step(torch.zeros(6, dtype=F64), theta).converged


def _aot_eager(monkeypatch):
    """``torch.compile`` with dynamo's ``aot_eager`` backend (the full trace, no inductor)."""
    seen = []
    real = torch.compile

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    def fake(fn, *, fullgraph, dynamic, options):
        assert fullgraph and options["cpp_wrapper"]
        return real(fn, backend=backend, fullgraph=True, dynamic=dynamic)

    monkeypatch.setattr(torch, "compile", fake)
    return seen


def test_the_step_traces_as_one_graph_with_a_while_loop(monkeypatch):
    inner, outer, theta, w0 = _logreg()
    seen = _aot_eager(monkeypatch)
    opt = compiled_step.adam(lr=0.1)
    eager = hg.compile_outer_step(inner, outer, update=opt, compile=False)
    traced = hg.compile_outer_step(inner, outer, update=opt)
    a = eager(w0, theta, opt.init(theta))
    b = traced(w0, theta, opt.init(theta))
    assert torch.ops.higher_order.while_loop in seen
    assert b.first_call and b.iterations == a.iterations
    torch.testing.assert_close(b.hypergrad, a.hypergrad, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(b.theta, a.theta, rtol=1e-12, atol=1e-14)
    c = traced(b.w, b.theta, b.opt_state)
    assert not c.first_call


@pytest.mark.slow
def test_inductor_graph_equals_the_eager_step():
    """The real compiled graph (inductor, cpp_wrapper): the eager numbers over a few outer
    steps with Adam in the graph, and no recompilation after the first call."""
    inner, outer, theta, w0 = _logreg()
    opt = compiled_step.adam(lr=0.1)
    eager = hg.compile_outer_step(inner, outer, update=opt, compile=False)
    fast = hg.compile_outer_step(inner, outer, update=opt)
    sa = sb = opt.init(theta)
    wa = wb = w0
    ta = tb = theta
    with warnings.catch_warnings():
        warnings.simplefilter("error", hg.HypergradWarning)  # no failure reports on the way
        for _ in range(4):
            a, b = eager(wa, ta, sa), fast(wb, tb, sb)
            assert a.iterations == b.iterations
            torch.testing.assert_close(b.hypergrad, a.hypergrad, rtol=1e-9, atol=1e-12)
            wa, ta, sa, wb, tb, sb = a.w, a.theta, a.opt_state, b.w, b.theta, b.opt_state
    torch.testing.assert_close(tb, ta, rtol=1e-10, atol=1e-12)
    assert len(fast._graphs) == 1


def test_float32_parameters_stay_float32_and_an_unreachable_tol_is_reported():
    inner, outer, theta, closed = _ridge()
    w_star, g_star = closed(theta)
    f32 = lambda fn: lambda w, th: fn(w.double(), th.double()).float()  # noqa: E731
    step = hg.compile_outer_step(f32(inner), f32(outer), tol=1e-5, compile=False)
    r = step(torch.zeros(6), theta.float())
    assert r.converged and r.w.dtype == r.hypergrad.dtype == torch.float32
    torch.testing.assert_close(r.hypergrad, g_star.float(), rtol=1e-4, atol=1e-6)
    tight = hg.compile_outer_step(f32(inner), f32(outer), tol=1e-12, maxiter=5, compile=False)
    with pytest.warns(hg.SolverStalledWarning):
        assert tight(torch.zeros(6), theta.float()).failure in ("maxiter", "line_search")


def test_auto_runs_eagerly_then_compiles(monkeypatch):
    """``compile="auto"``: eager calls (the same numbers) until they have taken
    ``compile_after`` seconds for the signature, then one compilation."""
    inner, outer, theta, _ = _ridge()
    seen = _aot_eager(monkeypatch)
    step = hg.compile_outer_step(inner, outer, compile="auto", compile_after=3600.0)
    w = torch.zeros(6, dtype=F64)
    a, b = step(w, theta), step(w, theta)
    assert not a.compiled and not b.compiled and a.first_call and not b.first_call and not seen
    step.compile_after = 0.0  # the eager calls have now taken longer than that
    c, d = step(w, theta), step(w, theta)
    assert c.compiled and c.first_call and d.compiled and not d.first_call and seen
    torch.testing.assert_close(c.hypergrad, a.hypergrad, rtol=1e-12, atol=1e-14)
    assert hg.compile_outer_step(inner, outer, compile=False)(w, theta).compiled is False
    with pytest.raises(hg.HypergradValueError, match="compile_after"):
        hg.compile_outer_step(inner, outer, compile="auto", compile_after=-1.0)


def test_a_numerically_singular_hessian_is_reported():
    """A positive definite Hessian of condition ~4e14: Cholesky succeeds but the adjoint solve
    misses ``ADJOINT_TOL`` (relative residual ~1e-2), reported rather than called converged."""
    A = torch.tensor([[1.0, 1.0], [1.0, 1.0 + 1e-14]], dtype=F64)
    inner = lambda w, th: 0.5 * w @ A @ w - th @ w  # noqa: E731
    outer = lambda w, th: (w**2).sum()  # noqa: E731
    step = hg.compile_outer_step(inner, outer, compile=False)
    with pytest.warns(hg.SingularSystemWarning, match="numerically singular"):
        r = step(torch.zeros(2, dtype=F64), torch.tensor([1.0, -1.0], dtype=F64))
    assert r.failure == "adjoint" and not r.converged
    assert r.adjoint_residual > compiled_step.ADJOINT_TOL


def test_a_non_finite_update_is_reported_by_the_traced_graph_too(monkeypatch):
    """The update's finiteness is computed inside the graph: the traced step reports
    ``failure="update"`` and keeps theta and the state, as the eager step does (issue 30)."""
    inner, outer, theta, _ = _ridge()
    _aot_eager(monkeypatch)

    def update(th, g, state):
        return th + g * float("nan"), {"k": state["k"] + 1}

    state = {"k": torch.zeros((), dtype=F64)}
    for compile in (False, True):
        step = hg.compile_outer_step(inner, outer, update=update, compile=compile)
        with pytest.warns(hg.SolverDivergedWarning, match="update returned NaN/Inf"):
            r = step(torch.zeros(6, dtype=F64), theta, state)
        assert r.failure == "update" and not r.converged and r.compiled is compile
        assert torch.equal(r.theta, theta) and float(r.opt_state["k"]) == 0.0
        assert torch.isfinite(r.hypergrad).all()
