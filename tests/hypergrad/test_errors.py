"""Every bad input raises a hypergrad error subclass whose message says what is wrong."""

import warnings

import pytest
import torch
import torchopt
from torch import nn

import hypergrad as hg

F64 = torch.float64


def _problem():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(12, 3, generator=g, dtype=F64)
    y = torch.randn(12, generator=g, dtype=F64)
    w = torch.randn(3, generator=g, dtype=F64)
    lam = torch.tensor(0.5, dtype=F64)

    def inner(w, lam):
        return 0.5 * ((X @ w - y) ** 2).mean() + 0.5 * lam * (w**2).sum()

    def outer(w, lam):
        return 0.5 * ((X @ w) ** 2).mean()

    return inner, outer, w, lam


SOLVER = hg.CG(tol=1e-10)


# --------------------------------------------------------------------------- losses


def test_non_scalar_inner_loss():
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradValueError, match="inner_loss must return a scalar"):
        hg.implicit_grad(lambda w, l: w**2 * l, outer, w, lam, solver=SOLVER)


def test_non_scalar_outer_loss():
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradValueError, match="outer_loss must return a scalar"):
        hg.implicit_grad(inner, lambda w, l: w * 2, w, lam, solver=SOLVER)


def test_loss_returning_non_tensor():
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradTypeError, match="outer_loss must return a scalar tensor"):
        hg.implicit_grad(inner, lambda w, l: 1.0, w, lam, solver=SOLVER)


@pytest.mark.parametrize("which", ["inner", "outer"])
def test_non_callable_loss(which):
    inner, outer, w, lam = _problem()
    args = (3.0, outer) if which == "inner" else (inner, "loss")
    with pytest.raises(hg.HypergradTypeError, match=f"{which}_loss must be callable"):
        hg.implicit_grad(*args, w, lam, solver=SOLVER)
    with pytest.raises(hg.HypergradTypeError, match="callable"):
        hg.unrolled_grad(*args, w, lam, steps=2, optimizer=torchopt.sgd(lr=0.1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss(bad):
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradValueError, match="inner_loss is not finite"):
        hg.implicit_grad(lambda w, l: inner(w, l) * bad, outer, w, lam, solver=SOLVER)
    with pytest.raises(hg.HypergradValueError, match="outer_loss is not finite"):
        hg.implicit_grad(inner, lambda w, l: outer(w, l) + bad, w, lam, solver=SOLVER)


def test_unrolled_blow_up_is_reported_not_returned():
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradValueError, match="not finite"):
        hg.unrolled_grad(inner, outer, w, lam, steps=200, optimizer=torchopt.sgd(lr=1e6))


# --------------------------------------------------------------------------- tensors / structure


def test_x0_structure_mismatch():
    inner, outer, w, lam = _problem()

    def inner2(p, l):
        return inner(torch.cat([p["a"], p["b"]]), l)

    def outer2(p, l):
        return outer(torch.cat([p["a"], p["b"]]), l)

    params = {"a": w[:1].clone(), "b": w[1:].clone()}
    with pytest.raises(hg.HypergradValueError, match="x0 must have the structure"):
        hg.implicit_grad(inner2, outer2, params, lam, solver=SOLVER, x0=(w[:1], w[1:]))
    with pytest.raises(hg.HypergradValueError, match="x0 must have the structure"):
        hg.implicit_grad(inner2, outer2, params, lam, solver=SOLVER, x0={"a": w[:2], "b": w[2:]})
    with pytest.raises(hg.HypergradValueError, match="x0 must have the structure"):
        hg.implicit_grad(inner, outer, w, lam, solver=SOLVER, x0=torch.zeros(4, dtype=F64))


@pytest.mark.parametrize(
    "bad,kind", [(torch.tensor([1, 2, 3]), "integer"), (torch.tensor([True, False, True]), "bool")]
)
def test_integer_tensors(bad, kind):
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradTypeError, match=rf"params.*{kind}"):
        hg.implicit_grad(inner, outer, bad, lam, solver=SOLVER)
    with pytest.raises(hg.HypergradTypeError, match=kind):
        hg.implicit_grad(inner, outer, w, (lam, bad), solver=SOLVER)
    with pytest.raises(hg.HypergradTypeError, match=kind):
        hg.unrolled_grad(inner, outer, bad, lam, steps=2, optimizer=torchopt.sgd(lr=0.1))


def test_complex_tensors():
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradTypeError, match=r"hparams is a complex"):
        hg.implicit_grad(inner, outer, w, lam.to(torch.complex128), solver=SOLVER)
    with pytest.raises(hg.HypergradTypeError, match="complex"):
        hg.implicit_grad(inner, outer, w.to(torch.complex128), lam, solver=SOLVER)


def test_non_leaf_tensors():
    inner, outer, w, lam = _problem()
    base = lam.clone().requires_grad_(True)
    with pytest.raises(hg.HypergradTypeError, match=r"hparams is a non-leaf tensor"):
        hg.implicit_grad(inner, outer, w, base * 1.0, solver=SOLVER)
    wb = w.clone().requires_grad_(True)
    with pytest.raises(hg.HypergradTypeError, match=r"params\['w'\] is a non-leaf"):
        hg.implicit_grad(
            lambda p, l: inner(p["w"], l),
            lambda p, l: outer(p["w"], l),
            {"w": wb + 0.0},
            lam,
            solver=SOLVER,
        )
    with pytest.raises(hg.HypergradTypeError, match="non-leaf"):
        hg.unrolled_grad(inner, outer, w, base * 2.0, steps=2, optimizer=torchopt.sgd(lr=0.1))


def test_nan_inf_in_params_and_hparams():
    inner, outer, w, lam = _problem()
    w_nan = w.clone()
    w_nan[1] = float("nan")
    with pytest.raises(hg.HypergradValueError, match="params contains NaN or Inf"):
        hg.implicit_grad(inner, outer, w_nan, lam, solver=SOLVER)
    with pytest.raises(hg.HypergradValueError, match=r"hparams\[1\] contains NaN or Inf"):
        hg.implicit_grad(
            inner, outer, w, (lam, torch.tensor([float("inf")], dtype=F64)), solver=SOLVER
        )
    with pytest.raises(hg.HypergradValueError, match="NaN or Inf"):
        hg.unrolled_grad(inner, outer, w_nan, lam, steps=2, optimizer=torchopt.sgd(lr=0.1))


def test_non_tensor_leaf_and_empty_tree():
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradTypeError, match=r"hparams\[1\] must be a tensor"):
        hg.implicit_grad(inner, outer, w, (lam, 0.3), solver=SOLVER)
    with pytest.raises(hg.HypergradValueError, match="hparams is empty"):
        hg.implicit_grad(inner, outer, w, (), solver=SOLVER)


# --------------------------------------------------------------------------- dependence


def test_hparams_used_by_neither_loss_raise():
    inner, outer, w, lam = _problem()
    extra = torch.tensor([1.0, 2.0], dtype=F64)

    def inner2(w, h):
        return inner(w, h[0])

    with pytest.raises(hg.HypergradError, match=r"hparams\[1\].*silently zero"):
        hg.implicit_grad(inner2, outer, w, (lam, extra), solver=SOLVER)
    with pytest.raises(hg.HypergradError, match=r"hparams\[1\].*silently zero"):
        hg.unrolled_grad(inner2, outer, w, (lam, extra), steps=3, optimizer=torchopt.sgd(lr=0.1))


def test_hparam_detached_in_inner_loss_raises():
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradError, match="silently zero"):
        hg.implicit_grad(lambda w, l: inner(w, l.detach()), outer, w, lam, solver=SOLVER)


def test_hparam_only_in_constant_term_raises():
    # the inner loss "uses" lam, but only in a term that does not depend on params: it cannot
    # move the inner solution, and the outer loss does not use it either
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradError, match="silently zero"):
        hg.implicit_grad(lambda w, l: inner(w, 0.5) + l**2, outer, w, lam, solver=SOLVER)


def test_decorator_unused_hparam_raises():
    inner, outer, w, lam = _problem()

    @hg.implicit(lambda w, h: inner(w, h[0]), solver=SOLVER)
    def fit(h):
        return w.clone()

    h = (lam.clone().requires_grad_(True), torch.ones(2, dtype=F64, requires_grad=True))
    out = fit(h)
    with pytest.raises(hg.HypergradError, match=r"hparams\[1\].*silently zero"):
        (out**2).sum().backward()


def test_decorator_integer_hparams_and_outputs():
    inner, outer, w, lam = _problem()

    @hg.implicit(inner, solver=SOLVER)
    def fit(lam):
        return torch.zeros(3, dtype=torch.int64)

    with pytest.raises(hg.HypergradTypeError, match="floating"):
        fit(torch.tensor(1))
    with pytest.raises(hg.HypergradTypeError, match="floating point"):
        fit(lam)


def test_params_unused_by_inner_loss():
    inner, outer, w, lam = _problem()
    params = {"w": w, "unused": torch.zeros(2, dtype=F64)}
    with pytest.raises(hg.HypergradValueError, match=r"does not depend on params\['unused'\]"):
        hg.implicit_grad(
            lambda p, l: inner(p["w"], l),
            lambda p, l: outer(p["w"], l) + p["unused"].sum(),
            params,
            lam,
            solver=SOLVER,
        )


# --------------------------------------------------------------------------- solvers


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: hg.CG(tol=-1e-3), "CG tol must be >= 0"),
        (lambda: hg.MINRES(tol=-1.0), "MINRES tol must be >= 0"),
        (lambda: hg.CG(maxiter=-1), "CG maxiter must be a positive int"),
        (lambda: hg.MINRES(maxiter="10"), "MINRES maxiter"),
        (lambda: hg.Neumann(maxiter=1.5), "Neumann maxiter"),
        (lambda: hg.Neumann(alpha=-1.0), "Neumann alpha must be > 0"),
        (lambda: hg.Exact(damping=-1e-3), "Exact damping"),
        (lambda: hg.Nystrom(rank=0), "Nystrom rank must be a positive int"),
        (lambda: hg.Nystrom(rank=5, damping=-1.0), "Nystrom damping"),
    ],
)
def test_bad_solver_arguments(make, match):
    with pytest.raises(hg.HypergradValueError, match=match):
        make()


def test_solver_of_wrong_type():
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradTypeError, match="solver must be a hypergrad solver"):
        hg.implicit_grad(inner, outer, w, lam, solver="cg")


def test_bad_engine():
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradValueError, match="engine must be one of"):
        hg.implicit_grad(inner, outer, w, lam, solver=SOLVER, engine="fast")


def test_exact_on_singular_hessian():
    inner, outer, w, lam = _problem()

    def singular(w, lam):  # Hessian lam * [[1, 1], [1, 1]] (+ nothing): rank one
        return 0.5 * lam * (w[0] + w[1]) ** 2 - w[0]

    def out(w, lam):
        return (w**2).sum()

    # inconsistent (b = 2w has a component outside the range of [[1, 1], [1, 1]]): Exact falls
    # back to the pseudo-inverse, reports the system singular and warns; it never raises
    with pytest.warns(hg.SingularSystemWarning):
        w = torch.tensor([1.0, 0.0], dtype=F64)
        _, info = hg.implicit_grad(singular, out, w, lam, solver=hg.Exact())
    assert info.solve.failure == "singular" and not info.solve.converged


def test_neumann_alpha_none_on_negative_definite_operator():
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradValueError, match="not positive"):
        hg.implicit_grad(lambda w, l: -inner(w, l), outer, w, lam, solver=hg.Neumann(maxiter=3))


def test_divergent_neumann_warns_and_reports():
    inner, outer, w, lam = _problem()
    with pytest.warns(hg.SolverDivergedWarning):
        _, info = hg.implicit_grad(inner, outer, w, lam, solver=hg.Neumann(maxiter=50, alpha=100.0))
    assert info.solve.diverged and not info.solve.converged


def test_cg_on_concave_inner_warns():
    inner, outer, w, lam = _problem()
    with pytest.warns(hg.SolverDivergedWarning, match="MINRES"):
        _, info = hg.implicit_grad(lambda w, l: -inner(w, l), outer, w, lam, solver=SOLVER)
    assert info.solve.diverged


# --------------------------------------------------------------------------- unrolled


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"steps": 0}, "steps must be a positive int"),
        ({"steps": -2}, "steps must be a positive int"),
        ({"steps": 2.0}, "steps must be a positive int"),
        ({"steps": 5, "truncate": 0}, "truncate must be an int in"),
        ({"steps": 5, "truncate": 6}, "truncate must be an int in"),
        ({"steps": 5, "truncate": 2.5}, "truncate must be an int in"),
    ],
)
def test_unrolled_steps_truncate_out_of_range(kw, match):
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradValueError, match=match):
        hg.unrolled_grad(inner, outer, w, lam, optimizer=torchopt.sgd(lr=0.1), **kw)


def test_unrolled_bad_optimizer():
    inner, outer, w, lam = _problem()
    with pytest.raises(hg.HypergradTypeError, match="functional optimizer such as torchopt.sgd"):
        hg.unrolled_grad(inner, outer, w, lam, steps=3, optimizer=torch.optim.SGD)


# --------------------------------------------------------------------------- HyperStep


def _modules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double()
    labeler = nn.Linear(4, 3).double()
    x = torch.randn(8, 4, dtype=F64)

    def inner(m, b):
        return ((m(b) - labeler(b)) ** 2).mean() + 1e-2 * sum((p**2).sum() for p in m.parameters())

    def outer(m, b):
        return (m(b) ** 2).mean()

    return model, labeler, x, inner, outer


def test_hyperstep_bad_buffers():
    model, labeler, x, inner, outer = _modules()
    with pytest.raises(hg.HypergradValueError, match="buffers must be one of"):
        hg.HyperStep(model, labeler, inner, outer, buffers="keep")


def test_hyperstep_bad_engine():
    model, labeler, x, inner, outer = _modules()
    with pytest.raises(hg.HypergradValueError, match="engine must be one of"):
        step = hg.HyperStep(model, labeler, inner, outer, method=hg.Implicit(engine="fast"))
        step(x)
    for p in model.parameters():
        assert p.grad is None


def test_hyperstep_hyper_without_trainable_params():
    model, labeler, x, inner, outer = _modules()
    labeler.requires_grad_(False)
    with pytest.raises(hg.HypergradValueError, match="no parameters that require grad"):
        hg.HyperStep(model, labeler, inner, outer)
    with pytest.raises(hg.HypergradValueError, match="no parameters that require grad"):
        hg.HyperStep(model, nn.ReLU(), inner, outer)


def test_hyperstep_other_bad_arguments():
    model, labeler, x, inner, outer = _modules()
    with pytest.raises(hg.HypergradTypeError, match="inner must be an nn.Module"):
        hg.HyperStep(lambda b: b, labeler, inner, outer)
    with pytest.raises(hg.HypergradValueError, match="clip_norm must be > 0"):
        hg.HyperStep(model, labeler, inner, outer, clip_norm=0.0)
    with pytest.raises(hg.HypergradValueError, match="leaf tensor with requires_grad"):
        hg.HyperStep(model, [torch.ones(2, dtype=F64)], inner, outer)
    with pytest.raises(hg.HypergradValueError, match="disjoint"):
        hg.HyperStep(model, [model[0].weight], inner, outer)
    with pytest.raises(hg.HypergradTypeError, match="callables"):
        hg.HyperStep(model, labeler, None, outer)


def test_hyperstep_non_scalar_and_unused_hyper():
    model, labeler, x, inner, outer = _modules()
    step = hg.HyperStep(model, labeler, inner, lambda m, b: m(b), solver=SOLVER)
    with pytest.raises(hg.HypergradValueError, match="outer_loss must return a scalar"):
        step(x)
    other = nn.Linear(2, 2).double()
    step = hg.HyperStep(model, other, inner, outer, solver=hg.MINRES(tol=1e-10))
    with pytest.raises(hg.HypergradError, match="silently zero"):
        step(x)
    assert other.weight.grad is None


def test_no_warnings_on_valid_input():
    model, labeler, x, inner, outer = _modules()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hg.HyperStep(model, labeler, inner, outer, solver=hg.MINRES(tol=1e-10))(x)
