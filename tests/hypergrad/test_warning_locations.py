"""Every warning hypergrad raises points at the user's line: the line that called the library,
however many of hypergrad's (and torch's, in a backward pass) frames lie in between.

So ``record.filename`` is this file and ``record.lineno`` the line of the call, and Python's
default filter shows a warning once per user call site (not once per library line, nor once per
call). Each test puts the call that warns on the line right after ``line = _next_line()``.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import hypergrad as hg
import hypergrad.testing as hgt
from hypergrad.errors import caller_stacklevel, warn
from hypergrad.solvers import SolveInfo

F64 = torch.float64


def _next_line() -> int:
    """The line after the caller's: where the call that should warn is."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno + 1


def _hypergrad_warnings(records):
    return [
        r
        for r in records
        if issubclass(r.category, hg.HypergradWarning)
        or (issubclass(r.category, DeprecationWarning) and "deprecated" in str(r.message))
    ]


def _points_here(records, category, line):
    """Every hypergrad warning recorded points at ``line`` of this file; one is a ``category``."""
    ours = _hypergrad_warnings(records)
    where = [(r.category.__name__, r.filename, r.lineno) for r in ours]
    assert any(issubclass(r.category, category) for r in ours), where
    assert all(r.filename == __file__ and r.lineno == line for r in ours), (line, where)


class _Recording:
    """``catch_warnings(record=True)`` with every warning shown (``always``)."""

    def __enter__(self):
        self._cm = warnings.catch_warnings(record=True)
        records = self._cm.__enter__()
        warnings.simplefilter("always")
        return records

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def _ridge():
    """A small ridge problem (any float dtype: the data follow ``lam``'s)."""
    gen = torch.Generator().manual_seed(0)
    X64 = torch.randn(30, 4, generator=gen, dtype=F64)
    y64 = torch.randn(30, generator=gen, dtype=F64)
    lam = torch.tensor(0.5, dtype=F64)

    def inner(w, lam):
        X, y = X64.to(lam.dtype), y64.to(lam.dtype)
        return 0.5 * ((X @ w - y) ** 2).mean() + 0.5 * lam * (w**2).sum()

    def outer(w, lam):
        return 0.5 * (w**2).sum()

    def solution(lam):
        X, y = X64.to(lam.dtype), y64.to(lam.dtype)
        return torch.linalg.solve(X.T @ X / 30 + lam * torch.eye(4, dtype=lam.dtype), X.T @ y / 30)

    return inner, outer, lam, solution


def _diag(*d):
    t = torch.tensor(d, dtype=F64)
    return lambda v: (t * v[0],)


DIVERGING = hg.Neumann(maxiter=30, alpha=50.0)


def _diverging_solve():
    return DIVERGING.solve(_diag(1.0, 2.0, 3.0), (torch.ones(3, dtype=F64),))


# -- the solvers' failure warnings, through the public API ----------------------------------


def test_diverged_through_implicit_grad():
    inner, outer, lam, solution = _ridge()
    w = solution(lam)
    with _Recording() as rec:
        line = _next_line()
        _, info = hg.implicit_grad(inner, outer, w, lam, solver=DIVERGING)
    assert info.solve.diverged
    _points_here(rec, hg.SolverDivergedWarning, line)


def test_diverged_through_solve():
    with _Recording() as rec:
        line = _next_line()
        DIVERGING.solve(_diag(1.0, 2.0, 3.0), (torch.ones(3, dtype=F64),))
    _points_here(rec, hg.SolverDivergedWarning, line)


@pytest.mark.parametrize("solver", [hg.CG(), hg.MINRES(), hg.GMRES(), hg.BiCGStab(), hg.Exact()])
def test_singular_inconsistent_system(solver):
    b = (torch.ones(3, dtype=F64),)
    with _Recording() as rec:
        line = _next_line()
        _, info = solver.solve(_diag(1.0, 0.5, 0.0), b)
    assert info.failure == "singular"
    _points_here(rec, hg.SingularSystemWarning, line)


def test_stalled_neumann():
    solver, b = hg.Neumann(maxiter=20, alpha=0.5), (torch.ones(2, dtype=F64),)
    with _Recording() as rec:
        line = _next_line()
        _, info = solver.solve(_diag(1.0, 0.0), b)
    assert info.failure == "stalled"
    _points_here(rec, hg.SolverStalledWarning, line)


@pytest.mark.parametrize(
    ("solver", "category"),
    [
        (hg.CG(maxiter=1), hg.SolveFailedWarning),
        (hg.Neumann(maxiter=1, alpha=0.1), hg.SolveFailedWarning),
        (hg.GMRES(maxiter=1, restart=1), hg.HypergradWarning),
        (hg.BiCGStab(maxiter=1), hg.HypergradWarning),
    ],
)
def test_residual_above_one(solver, category):
    b, x0 = (torch.ones(2, dtype=F64),), (torch.full((2,), 100.0, dtype=F64),)
    with _Recording() as rec:
        line = _next_line()
        _, info = solver.solve(_diag(1.0, 2.0), b, x0)
    assert info.failure == "residual above 1"
    _points_here(rec, category, line)


def test_diverged_through_compile_implicit_grad():
    a = torch.diag(torch.tensor([1.0, -2.0, 3.0], dtype=F64))  # negative curvature: CG diverges

    def inner(w, h):
        return 0.5 * w @ a @ w - (h * w).sum()

    def outer(w, h):
        return (w**2).sum()

    w, h = torch.tensor([1.0, -0.5, 1 / 3], dtype=F64), torch.ones(3, dtype=F64)
    f = hg.compile_implicit_grad(inner, outer, solver=hg.CG(tol=1e-10), compile=False)
    with _Recording() as rec:
        line = _next_line()
        _, info = f(w, h)
    assert info.solve.diverged
    _points_here(rec, hg.SolverDivergedWarning, line)


class _SilentlyDiverging:
    """A duck-typed solver whose report says it diverged, without warning: the entry point
    warns for it."""

    def solve(self, matvec, b, x0=None):
        return tuple(torch.zeros_like(t) for t in b), SolveInfo(solver="silent", diverged=True)


def test_an_entry_point_warning_for_a_custom_solver():
    inner, outer, lam, solution = _ridge()
    w = solution(lam)
    with _Recording() as rec:
        line = _next_line()
        hg.implicit_grad(inner, outer, w, lam, solver=_SilentlyDiverging())
    _points_here(rec, hg.SolverDivergedWarning, line)


# -- NonStationaryWarning ----------------------------------------------------------------------


def test_nonstationary_through_implicit_grad():
    inner, outer, lam, solution = _ridge()
    w = solution(lam) + 0.1
    with _Recording() as rec:
        line = _next_line()
        hg.implicit_grad(inner, outer, w, lam, solver=hg.CG(tol=1e-12))
    _points_here(rec, hg.NonStationaryWarning, line)


def test_nonstationary_through_implicit_and_backward():
    inner, outer, lam, solution = _ridge()

    @hg.implicit(inner, solver=hg.CG(tol=1e-12))
    def loose(lam):
        return solution(lam) + 0.1

    h = lam.clone().requires_grad_(True)
    loss = outer(loose(h), h)
    with _Recording() as rec:
        line = _next_line()
        loss.backward()  # the warning is raised under torch's autograd frames
    _points_here(rec, hg.NonStationaryWarning, line)
    h = lam.clone().requires_grad_(True)
    with _Recording() as rec:
        line = _next_line()
        torch.autograd.grad(outer(loose(h), h), h)
    _points_here(rec, hg.NonStationaryWarning, line)


def test_nonstationary_through_custom_root():
    A = torch.tensor([[2.0, 1.0], [0.0, 4.0]], dtype=F64)

    def condition(x, th):
        return A @ x - th

    solve = hg.custom_root(condition, solver=hg.GMRES(tol=1e-12))(
        lambda th: torch.linalg.solve(A, th) + 0.05
    )
    th = torch.tensor([1.0, 2.0], dtype=F64, requires_grad=True)
    loss = solve(th).sum()
    with _Recording() as rec:
        line = _next_line()
        loss.backward()
    _points_here(rec, hg.NonStationaryWarning, line)
    with _Recording() as rec:
        line = _next_line()
        hg.root_vjp(condition, torch.ones(2, dtype=F64), th.detach(), torch.ones(2, dtype=F64))
    _points_here(rec, hg.NonStationaryWarning, line)
    with _Recording() as rec:  # forward mode, under torch.func's frames
        line = _next_line()
        torch.func.jvp(solve, (th.detach(),), (torch.ones(2, dtype=F64),))
    _points_here(rec, hg.NonStationaryWarning, line)


def test_warn_if_nonstationary_keeps_an_explicit_stacklevel():
    """None (the default) is automatic; an int means what it means to ``warnings.warn`` called
    in ``warn_if_nonstationary`` (2: the line calling it, 3: that line's caller)."""

    def library_like(level):
        hg.conditions.warn_if_nonstationary(0.2, "inner_loss", stacklevel=level)

    with _Recording() as rec:
        line = _next_line()
        hg.conditions.warn_if_nonstationary(0.2, "inner_loss")
    _points_here(rec, hg.NonStationaryWarning, line)
    with _Recording() as rec:
        library_like(2)
    _points_here(rec, hg.NonStationaryWarning, library_like.__code__.co_firstlineno + 1)
    with _Recording() as rec:
        line = _next_line()
        library_like(3)
    _points_here(rec, hg.NonStationaryWarning, line)
    with _Recording() as rec:
        hg.conditions.warn_if_nonstationary(0.2, "inner_loss", stacklevel=1)
    assert [r.filename for r in rec] == [hg.conditions.__file__]


# -- optimizer settings, deprecations, HyperStep, hypergrad.testing ---------------------------


def test_optimizer_setting_leaving_its_range():
    lr = torch.tensor(0.05, dtype=F64)
    opt = hg.optim.sgd(lr=lr)
    p = (torch.ones(2, dtype=F64),)
    state = opt.init(p)
    lr.fill_(-0.1)  # e.g. stepped below zero by an outer optimizer
    with _Recording() as rec:
        line = _next_line()
        opt.update((torch.ones(2, dtype=F64),), state, params=p)
    _points_here(rec, hg.optim.OptimizerSettingWarning, line)


def _hyperstep(on_diverged):
    torch.manual_seed(0)
    model, hyper = torch.nn.Linear(3, 2).to(F64), torch.nn.Linear(3, 2).to(F64)
    x = torch.randn(10, 3, dtype=F64)

    def inner(m, b):
        return ((m(b) - hyper(b)) ** 2).mean() + 1e-2 * (m.weight**2).sum()

    def outer(m, b):
        return (m(b) ** 2).mean()

    step = hg.HyperStep(model, hyper, inner, outer, solver=DIVERGING, on_diverged=on_diverged)
    return step, x


@pytest.mark.parametrize("on_diverged", ["skip", "write"])
def test_warnings_inside_a_hyperstep_call(on_diverged):
    step, x = _hyperstep(on_diverged)
    with _Recording() as rec:
        line = _next_line()
        info = step(x)
    assert info.solve.diverged
    _points_here(rec, hg.SolverDivergedWarning, line)
    if on_diverged == "skip":
        assert any("skipped" in str(r.message) for r in rec)


def test_low_precision_warning_of_hypergrad_testing():
    inner, outer, lam, solution = _ridge()
    with _Recording() as rec:
        line = _next_line()
        hgt.check_hypergrad(solution, inner, outer, lam.float())
    _points_here(rec, hg.HypergradWarning, line)
    assert any("float32" in str(r.message) for r in rec)


# -- the default filter: once per user call site ------------------------------------------------


def _diverged(records):
    return [r for r in records if issubclass(r.category, hg.SolverDivergedWarning)]


def test_default_filter_shows_one_warning_per_call_site():
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("default")
        for _ in range(3):
            DIVERGING.solve(_diag(1.0, 2.0, 3.0), (torch.ones(3, dtype=F64),))
    assert len(_diverged(rec)) == 1
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("default")
        for _ in range(3):
            DIVERGING.solve(_diag(1.0, 2.0, 3.0), (torch.ones(3, dtype=F64),))
            DIVERGING.solve(_diag(1.0, 2.0, 3.0), (torch.ones(3, dtype=F64),))
    assert len(_diverged(rec)) == 2
    assert len({r.lineno for r in _diverged(rec)}) == 2


def test_default_filter_through_implicit_grad_in_a_loop():
    inner, outer, lam, solution = _ridge()
    w = solution(lam)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("default")
        for _ in range(3):
            hg.implicit_grad(inner, outer, w, lam, solver=DIVERGING)
    assert len(_diverged(rec)) == 1
    # two call sites: two warnings (one library line inside would have given one)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("default")
        for _ in range(3):
            hg.implicit_grad(inner, outer, w, lam, solver=DIVERGING)
            hg.implicit_grad(inner, outer, w, lam, solver=DIVERGING)
    assert len(_diverged(rec)) == 2


def test_a_helper_function_of_the_user_is_the_call_site():
    """The user's own helper is user code: the warning points inside it, at its call."""
    with _Recording() as rec:
        _diverging_solve()
    _points_here(rec, hg.SolverDivergedWarning, _diverging_solve.__code__.co_firstlineno + 1)


# -- the helper itself ----------------------------------------------------------------------------


def test_warn_and_caller_stacklevel():
    with _Recording() as rec:
        line = _next_line()
        warn("from user code", hg.HypergradWarning)  # called here directly: this line
    _points_here(rec, hg.HypergradWarning, line)
    assert caller_stacklevel() == 1  # this test's own frame is the first outside hypergrad

    def explicit():
        warn("explicit", hg.HypergradWarning, stacklevel=2)

    with _Recording() as rec:
        line = _next_line()
        explicit()
    _points_here(rec, hg.HypergradWarning, line)


def test_the_fallback_when_no_frame_is_the_users():
    """A thread started from C whose only frames are hypergrad's (as a CUDA backward on
    autograd's device thread): stacklevel 2, the caller of the function that warns."""
    import _thread
    import os

    src = (
        "def warns():\n    return caller_stacklevel()\n"
        "def library_like():\n    return warns()\n"
    )  # warns (1) <- library_like (2) <- run (3): all hypergrad's, so not 3 but 2
    fake = os.path.join(os.path.dirname(hg.__file__), "_not_a_file.py")  # inside the package
    ns = {"caller_stacklevel": caller_stacklevel}
    exec(compile(src, fake, "exec"), ns)
    done, out = _thread.allocate_lock(), []
    done.acquire()

    def run():
        try:
            out.append(ns["library_like"]())
        finally:
            done.release()

    run.__code__ = run.__code__.replace(co_filename=fake)  # the thread's bottom frame too
    _thread.start_new_thread(run, ())
    assert done.acquire(timeout=10)
    assert out == [2]
