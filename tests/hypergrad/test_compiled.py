"""``hg.compile_implicit_grad``: the torch.func hypergradient (compiled or not) against the eager
``hg.implicit_grad`` with the same solver, against the closed form of a ridge problem, and its
diagnostics (iterations, verified residual, divergence, errors); CG and Neumann both on the dense
Hessian (one graph with a loop, below ``compiled.DENSE_MAX`` unknowns) and on Hessian-vector
products in chunks (the ``path`` fixture); the options passed to ``torch.compile`` and
``compile="auto"``."""

from __future__ import annotations

from typing import NamedTuple
from unittest.mock import ANY

import pytest
import torch

import hypergrad as hg
from hypergrad import compiled
from hypergrad.solvers import functional

F64 = torch.float64


def _ridge(n_features: int = 6, seed: int = 0):
    """Ridge with an intercept (two parameter leaves) and one log decay per feature; the
    closed-form solution and hypergradient."""
    g = torch.Generator().manual_seed(seed)
    x, y = (
        torch.randn(50, n_features, generator=g, dtype=F64),
        torch.randn(50, generator=g, dtype=F64),
    )
    xv, yv = (
        torch.randn(40, n_features, generator=g, dtype=F64),
        torch.randn(40, generator=g, dtype=F64),
    )
    lam = {"lam": torch.randn(n_features, generator=g, dtype=F64)}

    def inner(p, h):
        return (
            0.5 * ((x @ p["w"] + p["b"] - y) ** 2).mean()
            + 0.5 * (h["lam"].exp() * p["w"] ** 2).sum()
        )

    def outer(p, h):
        return 0.5 * ((xv @ p["w"] + p["b"] - yv) ** 2).mean() + 0.1 * h["lam"].sum()

    x1, xv1 = (
        torch.cat([x, torch.ones(50, 1, dtype=F64)], 1),
        torch.cat([xv, torch.ones(40, 1, dtype=F64)], 1),
    )
    d = torch.cat([lam["lam"].exp(), torch.zeros(1, dtype=F64)])
    H = x1.T @ x1 / 50 + torch.diag(d)
    z = torch.linalg.solve(H, x1.T @ y / 50)
    params = {"w": z[:-1].clone(), "b": z[-1].clone()}
    adj = torch.linalg.solve(H, xv1.T @ (xv1 @ z - yv) / 40)  # H^-1 dL_out/dz
    closed = 0.1 - lam["lam"].exp() * z[:-1] * adj[:-1]  # direct - d/dlam (dL_in/dz) . adj
    return inner, outer, params, lam, closed


SOLVERS = [
    hg.CG(tol=1e-12),
    hg.CG(maxiter=3),
    hg.CG(tol=1e-12, damping=0.5),
    hg.Neumann(maxiter=40, alpha=0.05),
    hg.Neumann(maxiter=400, alpha=0.05, tol=1e-3),
    hg.Exact(),
    hg.Exact(damping=0.5),
]


@pytest.fixture(params=["dense", "hvp"])
def path(request, monkeypatch):
    """CG and Neumann on the dense Hessian (the default below ``DENSE_MAX`` unknowns) or on
    Hessian-vector products in chunks of ``CHUNK`` iterations (``DENSE_MAX = 0``)."""
    if request.param == "hvp":
        monkeypatch.setattr(compiled, "DENSE_MAX", 0)
    return request.param


@pytest.mark.parametrize("solver", SOLVERS, ids=repr)
def test_functional_path_equals_eager_implicit_grad(solver, path):
    inner, outer, params, lam, _ = _ridge()
    g_eager, i_eager = hg.implicit_grad(inner, outer, params, lam, solver=solver)
    f = hg.compile_implicit_grad(inner, outer, solver=solver, compile=False)
    g, info = f(params, lam)
    torch.testing.assert_close(g, g_eager, rtol=1e-12, atol=1e-14)
    s, se = info.solve, i_eager.solve
    assert (s.solver, s.iterations, s.converged, s.diverged) == (
        se.solver,
        se.iterations,
        se.converged,
        se.diverged,
    )
    assert s.extras["residual_verified"] and not s.extras["compiled"]
    # the residual is recomputed from x against a dense float64 solve of the same system
    assert info.extras["adjoint"]["w"].shape == params["w"].shape
    assert info.outer_loss == pytest.approx(i_eager.outer_loss, rel=1e-12)
    assert info.inner_loss == pytest.approx(i_eager.inner_loss, rel=1e-12)
    assert info.hypergrad_norm == pytest.approx(i_eager.hypergrad_norm, rel=1e-10)
    assert info.direct_norm == pytest.approx(i_eager.direct_norm, rel=1e-12)


@pytest.mark.parametrize("solver", SOLVERS, ids=repr)
def test_statistics_are_read_by_name_whatever_their_order(solver, monkeypatch):
    """The graphs return their scalars as one vector, stacked and read through one tuple of names
    (``compiled.Stats``): each diagnostic is the eager one, and reversing the order of the names
    changes nothing (a producer and a consumer that disagreed on positions would mislabel)."""
    inner, outer, params, lam, _ = _ridge()
    _, eager = hg.implicit_grad(inner, outer, params, lam, solver=solver)
    names = ("outer_loss", "inner_loss", "outer_grad_norm", "direct_norm", "indirect_norm")
    names += ("hypergrad_norm",)

    def report():
        _, info = hg.compile_implicit_grad(inner, outer, solver=solver, compile=False)(params, lam)
        for name in names:
            assert getattr(info, name) == pytest.approx(getattr(eager, name), rel=1e-10), name
        s = info.solve
        return [getattr(info, n) for n in names] + [s.iterations, s.residual, s.diverged, s.extras]

    shipped = report()
    backwards = NamedTuple("Stats", [(f, float) for f in reversed(compiled.Stats._fields)])
    monkeypatch.setattr(compiled, "Stats", backwards)
    assert report() == shipped


def test_converged_solves_match_the_closed_form():
    inner, outer, params, lam, closed = _ridge()
    for solver in (hg.CG(tol=1e-12), hg.Exact()):
        g, info = hg.compile_implicit_grad(inner, outer, solver=solver, compile=False)(params, lam)
        torch.testing.assert_close(g["lam"], closed, rtol=1e-9, atol=1e-12)
        assert info.solve.converged and info.solve.residual < 1e-10


def test_residual_is_recomputed_not_estimated(path):
    """CG stopped at maxiter: the reported residual is ||H x - b|| / ||b|| from a dense solve."""
    inner, outer, params, lam, _ = _ridge()
    g, info = hg.compile_implicit_grad(inner, outer, solver=hg.CG(maxiter=2), compile=False)(
        params, lam
    )
    x = torch.cat([info.extras["adjoint"]["w"], info.extras["adjoint"]["b"][None]])
    op = hg.InnerOperator(
        lambda ps, hs: inner({"w": ps[0], "b": ps[1]}, {"lam": hs[0]}),
        (params["w"].clone().requires_grad_(), params["b"].clone().requires_grad_()),
        (lam["lam"].clone().requires_grad_(),),
    )
    hx = torch.cat([t.reshape(-1) for t in op.hvp((x[:-1], x[-1]))])
    gw = torch.func.grad(lambda w, b: outer({"w": w, "b": b}, lam), argnums=(0, 1))(
        params["w"], params["b"]
    )
    b = torch.cat([gw[0], gw[1][None]])
    assert info.solve.residual == pytest.approx(float((hx - b).norm() / b.norm()), rel=1e-10)
    assert not info.solve.converged and info.solve.iterations == 2 and info.solve.matvecs == 3


def test_warm_start_changes_iterations_not_the_answer(path):
    inner, outer, params, lam, closed = _ridge()
    f = hg.compile_implicit_grad(inner, outer, solver=hg.CG(tol=1e-12), compile=False)
    g_cold, cold = f(params, lam)
    g_warm, warm = f(params, lam, x0=cold.extras["adjoint"])
    torch.testing.assert_close(g_warm, g_cold, rtol=1e-9, atol=1e-12)
    assert warm.solve.iterations == 0 and cold.solve.iterations > 3
    assert warm.solve.converged


def test_negative_curvature_is_reported(path):
    a = torch.diag(torch.tensor([1.0, -2.0, 3.0], dtype=F64))

    def inner(w, h):
        return 0.5 * w @ a @ w - (h * w).sum()

    def outer(w, h):
        return (w**2).sum()

    w, h = torch.tensor([1.0, -0.5, 1 / 3], dtype=F64), torch.ones(3, dtype=F64)
    f = hg.compile_implicit_grad(inner, outer, solver=hg.CG(tol=1e-10), compile=False)
    with pytest.warns(hg.SolverDivergedWarning):
        _, info = f(w, h)
    assert info.solve.diverged and info.solve.extras["negative_curvature"]
    assert not info.solve.converged


def test_neumann_growth_is_reported_like_the_eager_series(path):
    inner, outer, params, lam, _ = _ridge()
    solver = hg.Neumann(maxiter=40, alpha=0.3)  # too large for this Hessian
    with pytest.warns(hg.SolverDivergedWarning):
        g_eager, eager = hg.implicit_grad(inner, outer, params, lam, solver=solver)
    with pytest.warns(hg.SolverDivergedWarning):
        g, info = hg.compile_implicit_grad(inner, outer, solver=solver, compile=False)(params, lam)
    assert info.solve.diverged and not info.solve.converged
    assert info.solve.iterations == eager.solve.iterations
    torch.testing.assert_close(g, g_eager, rtol=1e-12, atol=1e-14)


def test_singular_exact_is_reported_as_eager():
    # a singular Hessian no longer raises: the call is answered by the eager Exact solve (the
    # minimum-norm least-squares solution), reported singular with a SingularSystemWarning
    def inner(w, h):
        return 0.5 * (w[0] - h[0]) ** 2  # w[1] has no curvature

    f = hg.compile_implicit_grad(inner, lambda w, h: (w**2).sum(), solver=hg.Exact(), compile=False)
    w, h = torch.tensor([1.0, 1.0], dtype=F64), torch.tensor([1.0], dtype=F64)
    with pytest.warns(hg.SingularSystemWarning):
        g, info = f(w, h)
    assert info.solve.failure == "singular" and info.solve.extras["compiled_fallback"]
    with pytest.warns(hg.SingularSystemWarning):
        g_eager, eager = hg.implicit_grad(inner, lambda w, h: (w**2).sum(), w, h, solver=hg.Exact())
    torch.testing.assert_close(g, g_eager)
    torch.testing.assert_close(info.extras["adjoint"], torch.tensor([2.0, 0.0], dtype=F64))


@pytest.mark.parametrize(
    "solver, match",
    [
        (hg.MINRES(), "supports hg.CG, hg.Neumann and hg.Exact"),
        (hg.Neumann(maxiter=5), "needs Neumann's alpha"),
        (hg.CG(preconditioner=lambda r: r), "preconditioners"),
    ],
)
def test_unsupported_settings_raise(solver, match):
    inner, outer, *_ = _ridge()
    with pytest.raises(hg.HypergradValueError, match=match):
        hg.compile_implicit_grad(inner, outer, solver=solver)


def test_first_call_applies_the_eager_input_checks():
    inner, outer, params, lam, _ = _ridge()
    f = hg.compile_implicit_grad(inner, outer, compile=False)
    bad = {"w": params["w"].clone(), "b": torch.tensor(float("nan"), dtype=F64)}
    with pytest.raises(hg.HypergradValueError, match="NaN"):
        f(bad, lam)
    with pytest.raises(hg.HypergradError, match="influence neither"):
        f(params, {"lam": lam["lam"], "unused": torch.ones(2, dtype=F64)})
    _, first = f(params, lam)
    _, again = f(params, lam)
    assert first.extras["first_call"] and not again.extras["first_call"]


def test_compiled_exact_equals_eager():
    """torch.compile traces the whole Exact path as one graph (fullgraph=True)."""
    inner, outer, params, lam, closed = _ridge()
    f = hg.compile_implicit_grad(inner, outer, solver=hg.Exact())
    g, info = f(params, lam)
    g2, info2 = f(params, lam)
    torch.testing.assert_close(g2["lam"], closed, rtol=1e-9, atol=1e-12)
    assert info2.solve.extras["compiled"] and info2.solve.converged
    assert info.extras["first_call"] and not info2.extras["first_call"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "solver", [hg.CG(maxiter=20, tol=1e-12), hg.Neumann(maxiter=30, alpha=0.05)], ids=repr
)
def test_compiled_iterative_solvers_equal_eager(solver, path):
    inner, outer, params, lam, _ = _ridge()
    g_eager, eager = hg.implicit_grad(inner, outer, params, lam, solver=solver)
    g, info = hg.compile_implicit_grad(inner, outer, solver=solver)(params, lam)
    torch.testing.assert_close(g, g_eager, rtol=1e-9, atol=1e-12)
    assert info.solve.iterations == eager.solve.iterations


def test_each_instance_compiles_its_own_code():
    """torch.compile caches per code object: instances sharing one would recompile into a shared
    cache and, past dynamo's recompile limit (8), silently run eagerly. Each instance's graphs are
    built on their own copy of the code (checked without compiling)."""
    inner, outer, *_ = _ridge()
    fs = [hg.compile_implicit_grad(inner, outer, solver=hg.CG(maxiter=k)) for k in (5, 10)]
    graphs = [compiled._IterativeGraphs(inner, outer, f.solver, f._wrap) for f in fs]
    codes = [g.whole._torchdynamo_orig_callable.__code__ for g in graphs]
    whole = compiled._IterativeGraphs._whole.__code__
    assert codes[0] is not codes[1]
    assert codes[0].co_code == codes[1].co_code == whole.co_code
    assert whole not in codes


@pytest.mark.parametrize("solver", [hg.CG(tol=1e-12), hg.Neumann(maxiter=40, alpha=0.05)], ids=repr)
def test_dense_hessian_is_used_up_to_dense_max_unknowns(solver, monkeypatch):
    """CG and Neumann build the dense Hessian (one ``jacrev``) when the parameters have at most
    ``DENSE_MAX`` elements (7 here), and iterate on Hessian-vector products above; both give the
    eager answer."""
    inner, outer, params, lam, _ = _ridge()
    built = []
    hessian = compiled._hessian
    monkeypatch.setattr(compiled, "_hessian", lambda *a: built.append(1) or hessian(*a))
    g_eager, eager = hg.implicit_grad(inner, outer, params, lam, solver=solver)
    for dense_max, dense in [(7, True), (6, False)]:
        monkeypatch.setattr(compiled, "DENSE_MAX", dense_max)
        built.clear()
        g, info = hg.compile_implicit_grad(inner, outer, solver=solver, compile=False)(params, lam)
        assert bool(built) is dense, dense_max
        torch.testing.assert_close(g, g_eager, rtol=1e-12, atol=1e-14)
        assert info.solve.iterations == eager.solve.iterations


def test_loop_traces_as_one_while_loop():
    """Under ``torch.compile`` the dense path's loop is one ``while_loop`` (traced by dynamo,
    without inductor here), whose body may not return an input as it is (the constant ``stop``:
    dynamo refuses the aliasing), and it gives the Python loop's answer. (That no tensor is
    carried twice, ``x0`` as the iterate and the best one, is inductor's check: the slow
    compiled tests.)"""

    class State(NamedTuple):
        x: tuple
        best: tuple
        stop: torch.Tensor
        k: torch.Tensor

    def run(x0, stop):
        state = State(x=(x0,), best=(x0,), stop=stop, k=torch.zeros((), dtype=torch.int64))
        return functional.loop(
            lambda st: st.k < 5,
            lambda st: st._replace(x=(st.x[0] * 0.5 + st.stop,), k=st.k + 1),
            state,
        )

    x0, stop = torch.ones(3, dtype=F64), torch.tensor(0.25, dtype=F64)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm

    out = torch.compile(run, backend=backend, fullgraph=True)(x0, stop)
    assert torch.ops.higher_order.while_loop in seen
    eager = run(x0, stop)
    torch.testing.assert_close(out.x[0], eager.x[0])
    assert int(out.k) == 5 and torch.equal(out.best[0], x0)


def test_compile_options_are_defaults_then_mode_then_the_users():
    cacheable = {"unsafe_marked_cacheable_functions": {"torch.ops.higher_order.while_loop": ANY}}
    assert compiled.compile_options(None, None) == {**cacheable, "cpp_wrapper": True}
    assert compiled.compile_options(None, None, "cuda") == cacheable  # cpp_wrapper: CPU only
    opts = compiled.compile_options("max-autotune-no-cudagraphs", {"cpp_wrapper": False})
    assert opts == {
        **cacheable,
        "cpp_wrapper": False,
        "max_autotune": True,
        "coordinate_descent_tuning": True,
    }


def test_options_reach_torch_compile(monkeypatch):
    """Every graph is compiled with ``fullgraph=True, dynamic=False`` and the options."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    inner, outer, params, lam, _ = _ridge()
    f = hg.compile_implicit_grad(
        inner, outer, solver=hg.CG(maxiter=5), options={"compile_threads": 1}
    )
    assert f.options == {**compiled.DEFAULT_OPTIONS, "cpp_wrapper": True, "compile_threads": 1}
    f(params, lam)
    assert seen and all(
        kw == {"fullgraph": True, "dynamic": False, "options": f.options} for kw in seen
    )


def test_auto_answers_eagerly_then_compiles(monkeypatch):
    """``compile="auto"``: the calls are ``implicit_grad``'s (the same numbers) until they have
    taken ``compile_after`` seconds; the next call compiles (here ``torch.compile`` is the
    identity, so nothing is compiled) and answers like the compiled path."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    inner, outer, params, lam, _ = _ridge()
    solver = hg.CG(maxiter=5)
    g_eager, eager = hg.implicit_grad(inner, outer, params, lam, solver=solver)
    f = hg.compile_implicit_grad(inner, outer, solver=solver, compile="auto", compile_after=1e-12)
    g1, i1 = f(params, lam)
    assert torch.equal(g1["lam"], g_eager["lam"]) and i1.solve.iterations == 5
    assert i1.extras["compile_pending"] and not i1.solve.extras["compiled"] and not f._graphs
    g2, i2 = f(params, lam)  # the eager call took more than 1e-12 s
    assert i2.extras["first_call"] and i2.solve.extras["compiled"] and f._graphs
    assert "compile_pending" not in i2.extras
    torch.testing.assert_close(g2, g_eager, rtol=1e-12, atol=1e-14)
    _, i3 = f(params, lam)
    assert not i3.extras["first_call"]
    # a generous budget keeps every call eager; the warm start reaches implicit_grad
    f = hg.compile_implicit_grad(inner, outer, solver=hg.CG(tol=1e-12), compile="auto")
    _, cold = f(params, lam)
    _, warm = f(params, lam, x0=cold.extras["adjoint"])
    assert warm.extras["compile_pending"] and warm.solve.iterations == 0 and not f._graphs


def test_compile_must_be_true_false_or_auto():
    inner, outer, *_ = _ridge()
    with pytest.raises(hg.HypergradValueError, match="'auto'"):
        hg.compile_implicit_grad(inner, outer, compile="yes")


_CACHE_PROBE = """
import json, torch, hypergrad as hg
from torch._dynamo.utils import counters
g, f64 = torch.Generator().manual_seed(0), torch.float64
X, y = torch.randn(40, 5, generator=g, dtype=f64), torch.randn(40, generator=g, dtype=f64)
inner = lambda w, lam: 0.5 * ((X @ w - y) ** 2).mean() + 0.5 * (lam.exp() * w**2).sum()
outer = lambda w, lam: 0.5 * ((X @ w - 1.0) ** 2).mean()
w, lam = torch.zeros(5, dtype=f64), torch.zeros(5, dtype=f64)
gr, info = hg.compile_implicit_grad(inner, outer, solver=hg.CG(maxiter=20, tol=1e-12))(w, lam)
print(json.dumps({"g": gr.tolist(), "its": info.solve.iterations,
                  "counters": {k: dict(v) for k, v in counters.items()}}))
"""


@pytest.mark.slow
def test_the_dense_graph_is_kept_by_the_on_disk_caches(tmp_path):
    """The dense path's graph (a ``while_loop``, which inductor's FX graph and AOTAutograd caches
    bypass by default) is saved by a first process and loaded by a second one with the same cache
    folder, which gets the same numbers."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    runs = []
    for _ in range(2):
        p = subprocess.run(
            [sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True,
            timeout=900, check=True,
        )  # fmt: skip
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    cold, warm = (r["counters"] for r in runs)
    assert cold["inductor"].get("fxgraph_cache_miss") == 1, cold
    assert warm["inductor"].get("fxgraph_cache_hit") == 1, warm
    assert warm["aot_autograd"].get("autograd_cache_hit") == 1, warm
    assert runs[0]["g"] == runs[1]["g"] and runs[0]["its"] == runs[1]["its"]
