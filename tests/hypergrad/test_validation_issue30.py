"""Issue 30: silent wrong results found by the trust review, each checked against the value it
must have or the error it must raise.

* ``compile_outer_step``'s settings cannot change after construction (``step.tol = inf`` used
  to report ``converged=True`` with a zero hypergradient, and the compiled graph kept the old
  value while the eager path read the new one);
* ``hg.compiled_step.adam`` validates its settings, and an update that leaves NaN/Inf in theta
  is a reported failure (``betas=(1.0, 0.999)`` used to give all-NaN theta with
  ``converged=True``);
* ``hg.optim.sgd``: a tensor dampening (or momentum) is held to the same Nesterov rule as a
  number;
* ``hg.prox``: hyperparameters that would broadcast ``x`` to a larger shape, NaN and infinite
  hyperparameters, an empty simplex;
* ``hg.prox.kinks``: the number of input coordinates at a point where the operator is not
  differentiable, against hand counts.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from helpers import log_decay_ridge

import hypergrad as hg
from hypergrad import compiled_step
from hypergrad import prox as P

F64 = torch.float64
INF, NAN = math.inf, math.nan


def _ridge(d: int = 4, seed: int = 0):
    return log_decay_ridge(d, 30, 20, seed)


# ---------------------------------------------------------------------------------------------
# 1. compile_outer_step: frozen, validated settings


@pytest.mark.parametrize(
    ("name", "value"),
    [("tol", INF), ("tol", 1e-3), ("maxiter", 0), ("maxiter", 5), ("max_backtracks", 2),
     ("update", None), ("inner_loss", None), ("compiled", False)],
)  # fmt: skip
def test_outer_step_settings_cannot_be_assigned(name, value):
    inner, outer, theta, closed = _ridge()
    step = hg.compile_outer_step(inner, outer, tol=1e-12, compile=False)
    with pytest.raises(hg.FrozenSettingError, match=rf"{name} cannot be changed.*new step"):
        setattr(step, name, value)
    with pytest.raises(hg.FrozenSettingError):
        delattr(step, name)
    assert step.tol == 1e-12 and step.maxiter == 50
    # the step still computes the true hypergradient (tol = inf used to give converged=True
    # after zero Newton steps and a hypergradient of 0)
    r = step(torch.zeros(4, dtype=F64), theta)
    w_star, g_star = closed(theta)
    assert r.converged and r.iterations == 1
    torch.testing.assert_close(r.hypergrad, g_star, rtol=1e-9, atol=1e-12)
    assert g_star.abs().min() > 1e-4


def test_outer_step_replace_builds_a_validated_step():
    inner, outer, theta, _ = _ridge()
    step = hg.compile_outer_step(inner, outer, tol=1e-12, compile=False)
    loose = step.replace(tol=1e-3, maxiter=7)
    assert isinstance(loose, compiled_step.CompiledOuterStep) and loose is not step
    assert (loose.tol, loose.maxiter, step.tol, step.maxiter) == (1e-3, 7, 1e-12, 50)
    assert dataclasses.replace(step, max_backtracks=3).max_backtracks == 3
    # a new step compiles its own graphs (the old ones were traced with the old settings)
    r = step(torch.zeros(4, dtype=F64), theta)
    assert step._eager or step._graphs
    fresh = step.replace(tol=1e-10)
    assert not fresh._eager and not fresh._graphs
    torch.testing.assert_close(fresh(r.w, theta).hypergrad, r.hypergrad, rtol=1e-9, atol=1e-12)
    for bad in (dict(tol=INF), dict(tol=NAN), dict(maxiter=0), dict(maxiter=2.0),
                dict(max_backtracks=-1), dict(compiled="yes")):  # fmt: skip
        with pytest.raises(hg.HypergradValueError, match="compile_outer_step"):
            step.replace(**bad)
    with pytest.raises(hg.HypergradValueError, match=r"compile_outer_step tol must be"):
        hg.compile_outer_step(inner, outer, tol=INF)
    with pytest.raises(hg.HypergradValueError, match=r"maxiter must be"):
        hg.compile_outer_step(inner, outer, maxiter=True)
    with pytest.raises(hg.HypergradTypeError, match="must be callable"):
        compiled_step.CompiledOuterStep(inner, 3)


def test_outer_step_compile_after_stays_a_validated_schedule():
    """``compile_after`` only decides when ``compile="auto"`` compiles (the same numbers either
    way), so it may be changed, but only to a valid value."""
    inner, outer, _, _ = _ridge()
    step = hg.compile_outer_step(inner, outer, compile="auto", compile_after=5.0)
    step.compile_after = 0.0
    assert step.compile_after == 0.0
    for bad in (-1.0, NAN, "soon"):
        with pytest.raises(hg.HypergradValueError, match="compile_after"):
            step.compile_after = bad
    assert step.compile_after == 0.0
    with pytest.raises(hg.FrozenSettingError):
        step.brand_new_attribute = 1


# ---------------------------------------------------------------------------------------------
# 2. compiled_step.adam: validated settings; a non-finite update is a failure


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(lr=-0.1), "lr"), (dict(lr=0.0), "lr"), (dict(lr=NAN), "lr"), (dict(lr=INF), "lr"),
        (dict(betas=(1.0, 0.999)), "betas"), (dict(betas=(0.9, 1.0)), "betas"),
        (dict(betas=(-0.1, 0.999)), "betas"), (dict(betas=(NAN, 0.999)), "betas"),
        (dict(betas=(0.9, INF)), "betas"), (dict(eps=0.0), "eps"), (dict(eps=-1e-8), "eps"),
        (dict(eps=NAN), "eps"),
    ],
)  # fmt: skip
def test_compiled_adam_refuses_bad_settings(kwargs, words):
    with pytest.raises(hg.HypergradValueError, match=words):
        compiled_step.adam(**kwargs)
    with pytest.raises(hg.HypergradValueError, match=words):
        compiled_step.Adam(**kwargs)


def test_compiled_adam_types_and_frozen_settings():
    for bad in (dict(betas=0.9), dict(betas=(0.9,)), dict(lr="fast"), dict(lr=True)):
        with pytest.raises(hg.HypergradError):
            compiled_step.adam(**bad)
    opt = compiled_step.adam(lr=0.1, betas=[0.8, 0.99], eps=1e-6)
    assert (opt.lr, opt.betas, opt.eps) == (0.1, (0.8, 0.99), 1e-6)
    assert compiled_step.adam(lr=torch.tensor(0.1, dtype=F64)).lr == pytest.approx(0.1)
    with pytest.raises(hg.HypergradError, match="requires grad"):
        compiled_step.adam(lr=torch.tensor(0.1, requires_grad=True))
    with pytest.raises(hg.FrozenSettingError, match="lr cannot be changed"):
        opt.lr = -0.1
    assert opt.replace(lr=0.5).lr == 0.5
    with pytest.raises(hg.HypergradValueError, match="lr"):
        opt.replace(lr=-0.5)


def test_compiled_adam_steps_descend():
    """lr=-0.1 used to be accepted and climb the outer loss; a valid Adam descends it."""
    inner, outer, theta, _ = _ridge()
    opt = compiled_step.adam(lr=0.05)
    step = hg.compile_outer_step(inner, outer, update=opt, compile=False)
    w, th, state = torch.zeros(4, dtype=F64), theta, opt.init(theta)
    first = None
    for _ in range(10):
        r = step(w, th, state)
        w, th, state = r.w, r.theta, r.opt_state
        first = r.outer_loss if first is None else first
    assert r.converged and r.outer_loss < first


@pytest.mark.parametrize("how", ["nan_update", "overflow"])
def test_a_non_finite_update_is_a_reported_failure(how):
    """An update that leaves NaN/Inf in theta used to come back with converged=True and
    failure=None; now it is ``failure="update"`` with a warning, and theta and the state are
    left as they were (as for any failed step)."""
    inner, outer, theta, _ = _ridge()
    if how == "nan_update":
        opt = None

        def update(th, g, state):
            return th + g * NAN, {"k": state["k"] + 1}

        state = {"k": torch.zeros((), dtype=F64)}
        th, w = theta, torch.zeros(4, dtype=F64)
    else:  # a finite lr whose step overflows float32
        opt = compiled_step.adam(lr=1e39)
        update = opt
        th = theta.float()
        state = opt.init(th)
        f32 = lambda fn: lambda w, t: fn(w.double(), t.double()).float()  # noqa: E731
        inner, outer = f32(inner), f32(outer)
        w = torch.zeros(4)
    step = hg.compile_outer_step(inner, outer, update=update, tol=1e-5, compile=False)
    with pytest.warns(hg.SolverDivergedWarning, match="update"):
        r = step(w, th, state)
    assert r.failure == "update" and not r.converged
    assert torch.equal(r.theta, th)
    assert torch.isfinite(r.hypergrad).all()  # the hypergradient itself is fine
    if opt is None:
        assert float(r.opt_state["k"]) == 0.0
    else:
        assert float(r.opt_state["t"]) == 0.0


# ---------------------------------------------------------------------------------------------
# 3. hg.optim: tensors held to the rules of numbers


def test_nesterov_refuses_a_tensor_dampening_as_it_refuses_a_number():
    with pytest.raises(hg.HypergradValueError, match="Nesterov"):
        hg.optim.sgd(lr=0.1, momentum=0.9, dampening=0.5, nesterov=True)
    with pytest.raises(hg.HypergradValueError, match="Nesterov.*dampening"):
        hg.optim.sgd(lr=0.1, momentum=0.9, dampening=torch.tensor(0.5), nesterov=True)
    with pytest.raises(hg.HypergradValueError, match="Nesterov.*momentum"):
        hg.optim.sgd(lr=0.1, momentum=torch.tensor(0.0), nesterov=True)
    # zero tensors where zero is required, a positive tensor momentum: accepted
    hg.optim.sgd(lr=0.1, momentum=torch.tensor(0.9), dampening=torch.tensor(0.0), nesterov=True)


def test_nesterov_tensor_dampening_leaving_zero_warns():
    d = torch.tensor(0.0, dtype=F64)
    opt = hg.optim.sgd(lr=0.1, momentum=0.9, dampening=d, nesterov=True)
    p = (torch.ones(3, dtype=F64),)
    state = opt.init(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, state = opt.update((p[0].clone(),), state, params=p)
    d.fill_(0.5)
    with pytest.warns(hg.optim.OptimizerSettingWarning, match="dampening.*Nesterov"):
        opt.update((p[0].clone(),), state, params=p)


# ---------------------------------------------------------------------------------------------
# 4. hg.prox: shapes, non-finite hyperparameters, empty inputs

X3 = torch.tensor([-2.0, 0.5, 3.0], dtype=F64)


@pytest.mark.parametrize("shape", [(2, 3), (2, 1), (1, 3)])
def test_hparams_may_not_broadcast_x_to_a_larger_shape(shape):
    """x of shape (3,) with λ of shape (2, 3) or (2, 1) used to return a (2, 3) result."""
    h = torch.full(shape, 0.5, dtype=F64)
    calls = [
        lambda: P.prox_lasso(X3, h),
        lambda: P.prox_non_negative_lasso(X3, h),
        lambda: P.prox_elastic_net(X3, (h, 1.0)),
        lambda: P.prox_elastic_net(X3, (0.5, h)),
        lambda: P.projection_box(X3, (-h, 1.0)),
        lambda: P.projection_box(X3, (None, h)),
    ]
    for call in calls:
        with pytest.raises(hg.HypergradValueError, match=rf"{tuple(shape)}.*\(3,\)"):
            call()


def test_hparams_that_broadcast_to_x_still_work():
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    lam = torch.tensor([0.1, 0.2, 0.3], dtype=F64)
    ref = torch.sign(x) * torch.relu(x.abs() - lam)
    torch.testing.assert_close(P.prox_lasso(x, lam), ref, rtol=0, atol=0)
    torch.testing.assert_close(P.prox_lasso(x, lam.reshape(1, 3)), ref, rtol=0, atol=0)
    torch.testing.assert_close(
        P.prox_lasso(x, torch.tensor([0.2], dtype=F64)), P.prox_lasso(x, 0.2)
    )
    col = torch.tensor([[0.0], [0.5]], dtype=F64)
    torch.testing.assert_close(
        P.projection_box(x, (col, 1.0)), torch.maximum(x, col).clamp(max=1.0)
    )
    # numbers and None keep working
    torch.testing.assert_close(P.projection_box(x, (None, 1)), x.clamp(max=1.0))
    torch.testing.assert_close(P.projection_box(x, (0, None)), x.clamp(min=0.0))
    torch.testing.assert_close(P.projection_box(x, (None, None)), x)
    torch.testing.assert_close(P.prox_lasso(x, 1), P.prox_lasso(x, 1.0))


def test_group_lasso_and_simplex_per_group_shapes():
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    # dim=1: groups are rows, λ broadcasts to (2,); a (2, 1) or (3,) λ would not
    ok = P.prox_group_lasso(x, torch.tensor([0.1, 0.2], dtype=F64), dim=1)
    assert ok.shape == (2, 3)
    with pytest.raises(hg.HypergradValueError, match=r"\(2, 1\).*\(2,\)"):
        P.prox_group_lasso(x, torch.full((2, 1), 0.1, dtype=F64), dim=1)
    with pytest.raises(hg.HypergradValueError, match=r"\(3,\).*\(2,\)"):
        P.prox_group_lasso(x, torch.full((3,), 0.1, dtype=F64), dim=1)
    # simplex rows: value of shape x.shape[:-1] or a scalar
    assert P.projection_simplex(x, torch.tensor([1.0, 2.0], dtype=F64)).shape == (2, 3)
    with pytest.raises(hg.HypergradValueError, match=r"\(3,\).*\(2,\)"):
        P.projection_simplex(x, torch.ones(3, dtype=F64))
    with pytest.raises(hg.HypergradValueError, match=r"\(2,\).*\(\)"):
        P.projection_simplex(X3, torch.ones(2, dtype=F64))  # used to give a (2, 3) result
    with pytest.raises(hg.HypergradValueError, match=r"\(2, 1\).*\(2,\)"):
        P.projection_simplex(x, torch.ones(2, 1, dtype=F64))


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: P.projection_box(X3, (torch.tensor(NAN, dtype=F64), 1.0)), "lower.*NaN"),
        (lambda: P.projection_box(X3, (0.0, NAN)), "upper.*NaN"),
        (lambda: P.projection_box(X3, (INF, INF)), "lower.*\\+inf"),
        (lambda: P.projection_box(X3, (None, torch.tensor(-INF, dtype=F64))), "upper.*-inf"),
        (lambda: P.prox_lasso(X3, 0.0, INF), "scaling.*finite"),
        (lambda: P.prox_lasso(X3, 0.0, torch.tensor(INF)), "scaling.*finite"),
        (lambda: P.prox_lasso(X3, INF), "λ.*finite"),
        (lambda: P.prox_lasso(X3, torch.tensor([0.1, INF, 0.1], dtype=F64)), "λ.*finite"),
        (lambda: P.prox_elastic_net(X3, (INF, 0.0)), "λ.*finite"),
        (lambda: P.prox_elastic_net(X3, (1.0, torch.tensor(INF))), "γ.*finite"),
        (lambda: P.prox_non_negative_lasso(X3, NAN), "λ"),
        (lambda: P.prox_group_lasso(X3, INF), "λ.*finite"),
        (lambda: P.projection_simplex(X3, INF), "value.*finite"),
        (lambda: P.projection_l2_ball(X3, torch.tensor(NAN)), "radius"),
    ],
)
def test_non_finite_hparams_are_refused(call, words):
    """These used to return NaN without an error."""
    with pytest.raises(hg.HypergradValueError, match=words):
        call()


def test_infinite_bounds_and_radius_have_their_limits():
    """-inf / +inf box bounds are no bound; an infinite l2 radius is the identity (the ball is
    the whole space), as a tensor as well as a number (a tensor inf used to give NaN)."""
    x = X3.clone().requires_grad_()
    y = P.projection_box(x, (torch.tensor(-INF, dtype=F64), torch.tensor(INF, dtype=F64)))
    torch.testing.assert_close(y, X3, rtol=0, atol=0)
    y = P.projection_box(X3, (-INF, 1.0))
    torch.testing.assert_close(y, X3.clamp(max=1.0), rtol=0, atol=0)
    r = torch.tensor(INF, dtype=F64, requires_grad=True)
    y = P.projection_l2_ball(x, r)
    torch.testing.assert_close(y, X3, rtol=0, atol=0)
    (y * torch.tensor([1.0, 2.0, 3.0], dtype=F64)).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([1.0, 2.0, 3.0], dtype=F64))
    assert r.grad is not None and float(r.grad) == 0.0
    torch.testing.assert_close(P.projection_l2_ball(X3, INF), X3, rtol=0, atol=0)
    jac = torch.func.jacrev(P.projection_l2_ball)(X3, torch.tensor(INF, dtype=F64))
    torch.testing.assert_close(jac, torch.eye(3, dtype=F64))
    # a finite radius still projects
    torch.testing.assert_close(
        P.projection_l2_ball(torch.tensor([3.0, 4.0], dtype=F64), torch.tensor(1.0, dtype=F64)),
        torch.tensor([0.6, 0.8], dtype=F64),
    )


def test_projection_simplex_on_an_empty_last_dimension_is_refused():
    with pytest.raises(hg.HypergradValueError, match="empty"):
        P.projection_simplex(torch.zeros(0, dtype=F64))
    with pytest.raises(hg.HypergradValueError, match="empty"):
        P.projection_simplex(torch.zeros(3, 0, dtype=F64))
    assert P.projection_simplex(torch.zeros(0, 4, dtype=F64)).shape == (0, 4)  # no rows: fine


# ---------------------------------------------------------------------------------------------
# 5. kinks: the input coordinates where the operator is not differentiable


def test_kinks_of_the_coordinatewise_operators():
    x = torch.tensor([-1.0, 1.0, 0.5, 1.0 + 1e-9, 2.0, 0.0], dtype=F64)
    # lasso, λ·s = 1: |x_i| = 1 at 0, 1 exactly, at 3 within 1e-8
    assert P.kinks(P.prox_lasso, x, 1.0) == 2
    assert P.kinks(P.prox_lasso, x, 1.0, tol=1e-8) == 3
    assert P.kinks(P.prox_lasso, x, 2.0, 0.5) == 2  # λ·s = 1 again
    lam = torch.tensor([1.0, 0.5, 0.5, 0.0, 2.0, 0.0], dtype=F64)
    # |x| = λ at 0, 2, 4; coordinates 3 and 5 have λ = 0: the identity, no kink (x_5 = 0 too)
    assert P.kinks(P.prox_lasso, x, lam) == 3
    torch.testing.assert_close(
        P.kink_mask(P.prox_lasso, x, lam),
        torch.tensor([True, False, True, False, True, False]),
    )
    assert P.kinks(P.prox_elastic_net, x, (lam, 3.0)) == 3
    # non-negative lasso: x_i = λ_i·s (also at λ = 0: relu's kink): coordinates 2, 4, 5
    assert P.kinks(P.prox_non_negative_lasso, x, lam) == 3
    assert P.kinks(P.prox_non_negative_lasso, x, 1.0) == 1  # only x_1 = 1 (x_0 = -1 is not)
    # non-negative projection: x_i = 0
    assert P.kinks(P.projection_non_negative, x) == 1
    assert P.kinks(P.projection_non_negative, x, tol=0.5) == 2  # 0 and 0.5
    # box [-1, 1]: x_0, x_1 on a bound; x_3 within 1e-8; infinite bounds have none
    assert P.kinks(P.projection_box, x, (-1.0, 1.0)) == 2
    assert P.kinks(P.projection_box, x, (-1.0, 1.0), tol=1e-8) == 3
    assert P.kinks(P.projection_box, x, (None, 2.0)) == 1
    assert P.kinks(P.projection_box, x, (-INF, INF)) == 0
    # scaling is ignored by projections
    assert P.kinks(P.projection_box, x, (-1.0, 1.0), 0.1) == 2


def test_kinks_of_the_norm_operators():
    x = torch.tensor([3.0, 4.0], dtype=F64)  # norm 5
    assert P.kinks(P.projection_l2_ball, x, 5.0) == 2  # on the sphere: every coordinate
    assert P.kinks(P.projection_l2_ball, x, 4.0) == 0
    assert P.kinks(P.projection_l2_ball, x, 4.9, tol=0.2) == 2
    assert P.kinks(P.projection_l2_ball, x, torch.tensor(INF)) == 0
    assert P.kinks(P.prox_group_lasso, x, 2.5, 2.0) == 2  # ‖x‖ = λ·s
    assert P.kinks(P.prox_group_lasso, x, 1.0) == 0
    assert P.kinks(P.prox_group_lasso, (x, torch.zeros(3, dtype=F64)), 5.0) == 5  # one group
    rows = torch.tensor([[3.0, 4.0], [0.0, -1.0], [1.0, 0.0]], dtype=F64)  # row norms 5, 1, 1
    assert P.kinks(P.prox_group_lasso, rows, 1.0, dim=1) == 4  # rows 1 and 2
    lam = torch.tensor([5.0, 2.0, 1.0], dtype=F64)
    torch.testing.assert_close(
        P.kink_mask(P.prox_group_lasso, rows, lam, dim=1),
        torch.tensor([[True, True], [False, False], [True, True]]),
    )
    # λ = 0: the identity, no kink even at x = 0
    assert P.kinks(P.prox_group_lasso, torch.zeros(2, dtype=F64), 0.0) == 0
    # functools.partial carries dim
    import functools

    assert P.kinks(functools.partial(P.prox_group_lasso, dim=1), rows, 1.0) == 4


def test_kinks_of_the_simplex():
    x = torch.tensor([0.75, 0.5, 0.125], dtype=F64)  # value 1: tau = 0.125 (0.625 + 0.375)
    assert torch.equal(P.projection_simplex(x), torch.tensor([0.625, 0.375, 0.0], dtype=F64))
    assert P.kinks(P.projection_simplex, x) == 1  # x_2 = tau: entering the support
    torch.testing.assert_close(
        P.kink_mask(P.projection_simplex, x), torch.tensor([False, False, True])
    )
    assert P.kinks(P.projection_simplex, torch.tensor([0.75, 0.5, 0.0], dtype=F64)) == 0
    # row 2: tau = -0.125, distances |x_i - tau| = 0.625, 0.375, 0.875
    rows = torch.stack([x, torch.tensor([0.5, 0.25, -1.0], dtype=F64)])
    assert P.kinks(P.projection_simplex, rows) == 1
    assert P.kinks(P.projection_simplex, rows, tol=0.5) == 2 + 1
    assert P.kinks(P.projection_simplex, rows, 2.0, tol=1e-12) == 0  # value 2: other taus


def test_kinks_of_pytrees_and_unknown_operators():
    tree = {"a": torch.tensor([1.0, 0.5], dtype=F64), "b": (torch.tensor([-1.0], dtype=F64),)}
    assert P.kinks(P.prox_lasso, tree, 1.0) == 2
    mask = P.kink_mask(P.prox_lasso, tree, {"a": 0.5, "b": (1.0,)})
    assert mask["a"].tolist() == [False, True] and mask["b"][0].tolist() == [True]
    assert P.kinks(lambda x, h=None, s=1.0: x, tree) is None  # not an hg.prox operator
    with pytest.raises(hg.HypergradValueError, match="tol"):
        P.kinks(P.prox_lasso, tree, 1.0, tol=-1.0)
    with pytest.raises(hg.HypergradValueError, match="tol"):
        P.kinks(P.prox_lasso, tree, 1.0, tol=NAN)
