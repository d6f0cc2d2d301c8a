"""Results that are not hypergradients: one definition (``SolveInfo.failure`` plus NaN/Inf
entries), a warning for every one handed out, and ``HyperStep``'s ``on_diverged`` policy for
each reason, decided collectively under ``torch.distributed``.

Each reason is pinned twice: by a fake solver returning a crafted ``SolveInfo`` (independent of
any solver's internals) and, where a real problem produces it deterministically, by that problem.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import hypergrad as hg
from hypergrad.solvers.base import SolveInfo

F64 = torch.float64


class FakeSolver:
    """A duck-typed solver: returns ``x = scale * b`` and a copy of a crafted report."""

    def __init__(self, report: SolveInfo, scale: float = 1.0, ranks: tuple[int, ...] | None = None):
        self.report, self.scale, self.ranks = report, scale, ranks

    def solve(self, matvec, b, x0=None):
        fails = self.ranks is None or (dist.is_initialized() and dist.get_rank() in self.ranks)
        report = self.report if fails else GOOD
        info = SolveInfo(
            solver=report.solver,
            iterations=report.iterations,
            residual=report.residual,
            converged=report.converged,
            diverged=report.diverged,
            extras=dict(report.extras),
        )
        return tuple(self.scale * t for t in b), info


GOOD = SolveInfo("fake", iterations=3, residual=1e-12, converged=True)
#: failure -> (report, the words HyperStep's skip_reason uses, the warning category)
REPORTS = {
    "diverged": (
        SolveInfo("fake", iterations=3, residual=0.5, diverged=True),
        "the fake solve diverged",
        hg.SolverDivergedWarning,
    ),
    "singular": (
        SolveInfo("fake", iterations=3, residual=0.5, extras={"singular": True}),
        "the fake system is singular",
        hg.SingularSystemWarning,
    ),
    "stalled": (
        SolveInfo("fake", iterations=3, residual=0.5, extras={"stalled": True}),
        "the fake iteration stalled",
        hg.SolverStalledWarning,
    ),
    "non-finite residual": (
        SolveInfo("fake", iterations=3, residual=float("nan")),
        "relative residual is NaN/Inf",
        hg.HypergradWarning,
    ),
    "residual above 1": (
        SolveInfo("fake", iterations=3, residual=3.0),
        "relative residual 3 is above 1",
        hg.HypergradWarning,
    ),
}


def _problem(seed: int = 0, zero_feature: bool = False):
    """A linear inner model fitted to a linear labeler; outer batch separate."""
    torch.manual_seed(seed)
    model, hyper = nn.Linear(4, 2).to(F64), nn.Linear(4, 2).to(F64)
    x = torch.randn(16, 4, dtype=F64)
    xv = torch.randn(16, 4, dtype=F64)
    if zero_feature:
        x[:, 2] = 0.0  # the weight column of feature 2 has no curvature; xv still uses it
    inner = lambda m, b: ((m(b) - hyper(b)) ** 2).mean()  # noqa: E731
    outer = lambda m, b: (m(b) ** 2).mean()  # noqa: E731
    return model, hyper, x, xv, inner, outer


def _record(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, hg.HypergradWarning)]


# --------------------------------------------------------------------------- the definition


def test_failure_reasons_and_boundary():
    for failure, (report, _, _) in REPORTS.items():
        assert report.failure == failure
    assert GOOD.failure is None
    # truncated solves are approximate hypergradients, not failures: residual exactly 1 (x = 0)
    # and below it are accepted
    assert SolveInfo("fake", residual=1.0).failure is None
    assert SolveInfo("fake", residual=0.99, converged=False).failure is None
    assert SolveInfo("fake", residual=float("inf")).failure == "non-finite residual"


# --------------------------------------------------------------------- HyperStep, fake solves


@pytest.mark.parametrize("failure", list(REPORTS))
def test_skip_each_reason(failure):
    report, words, category = REPORTS[failure]
    model, hyper, x, xv, inner, outer = _problem()
    for p in hyper.parameters():
        p.grad = torch.ones_like(p)  # stale
    step = hg.HyperStep(model, hyper, inner, outer, solver=FakeSolver(report))
    info, caught = _record(lambda: step(x, xv))
    assert info.skipped and words in info.skip_reason
    assert info.solve.failure == failure
    assert all(p.grad is None for p in hyper.parameters())
    texts = [str(w.message) for w in caught]
    assert any("HyperStep skipped" in t for t in texts)
    # the fake solver did not warn: the entry point did, once, in the failure's category
    entry = [w for w in caught if str(w.message).startswith("FakeSolver.solve returned")]
    assert [w.category for w in entry] == [category], texts


@pytest.mark.parametrize("failure", list(REPORTS))
def test_write_each_reason(failure):
    report, _, category = REPORTS[failure]
    model, hyper, x, xv, inner, outer = _problem()
    step = hg.HyperStep(model, hyper, inner, outer, solver=FakeSolver(report), on_diverged="write")
    (expected, _), _ = _record(lambda: step.compute(x, xv))
    info, caught = _record(lambda: step(x, xv))
    assert not info.skipped and info.skip_reason is None and info.solve.failure == failure
    for p, h in zip(hyper.parameters(), expected):
        torch.testing.assert_close(p.grad, h, rtol=0, atol=0)
    assert [w.category for w in caught] == [category]  # warned once, by the entry point


@pytest.mark.parametrize("failure", list(REPORTS))
def test_raise_each_reason(failure):
    report, words, _ = REPORTS[failure]
    model, hyper, x, xv, inner, outer = _problem()
    step = hg.HyperStep(model, hyper, inner, outer, solver=FakeSolver(report), on_diverged="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hg.HypergradWarning)
        with pytest.raises(hg.HypergradError, match="on_diverged='raise'") as raised:
            step(x, xv)
    assert words in str(raised.value)
    assert all(p.grad is None for p in hyper.parameters())
    assert step.last_info.solve.failure == failure


def test_good_and_truncated_reports_are_written():
    """Residual below 1 but above tol (a truncated solve): an approximate hypergradient."""
    for report in (GOOD, SolveInfo("fake", iterations=2, residual=0.9, converged=False)):
        model, hyper, x, xv, inner, outer = _problem()
        step = hg.HyperStep(model, hyper, inner, outer, solver=FakeSolver(report))
        info, caught = _record(lambda step=step, x=x, xv=xv: step(x, xv))
        assert not info.skipped and caught == []
        assert all(p.grad is not None for p in hyper.parameters())


def _nan_direct_outer(hyper):
    """An outer loss whose direct derivative w.r.t. the hyper weight is NaN (sqrt'(0) * 0)."""

    def outer(m, b):
        return (m(b) ** 2).mean() + (hyper.weight - hyper.weight.detach()).abs().sum().sqrt()

    return outer


def test_nonfinite_hypergradient_from_a_clean_solve():
    """NaN/Inf entries with a solve that reported nothing: skipped (it used to raise from inside
    the implicit computation, past the policy), written with a warning, or raised."""
    model, hyper, x, xv, inner, _ = _problem()
    outer = _nan_direct_outer(hyper)
    step = hg.HyperStep(model, hyper, inner, outer, solver=hg.CG(tol=1e-10))
    info, caught = _record(lambda: step(x, xv))
    assert info.skipped and "NaN/Inf entries" in info.skip_reason and info.solve.failure is None
    assert all(p.grad is None for p in hyper.parameters())
    assert any("HyperStep skipped" in str(w.message) for w in caught)

    step = hg.HyperStep(model, hyper, inner, outer, solver=hg.CG(tol=1e-10), on_diverged="write")
    info, caught = _record(lambda: step(x, xv))
    assert not info.skipped and not torch.isfinite(hyper.weight.grad).all()
    assert any("HyperStep wrote a result that is not" in str(w.message) for w in caught)

    step = hg.HyperStep(model, hyper, inner, outer, solver=hg.CG(tol=1e-10), on_diverged="raise")
    with pytest.raises(hg.HypergradError, match="NaN/Inf entries"):
        step(x, xv)


def test_nonfinite_adjoint_from_a_clean_report_is_skipped():
    """A solver that hands back Inf with a clean report: the NaN/Inf entries rule catches it."""
    model, hyper, x, xv, inner, outer = _problem()
    step = hg.HyperStep(model, hyper, inner, outer, solver=FakeSolver(GOOD, scale=float("inf")))
    info, _ = _record(lambda: step(x, xv))
    assert info.skipped and "NaN/Inf entries" in info.skip_reason
    assert all(p.grad is None for p in hyper.parameters())
    # implicit_grad keeps raising on a NaN/Inf solve (its documented error)
    with pytest.raises(hg.HypergradValueError, match="produced NaN/Inf"):
        hg.implicit_grad(
            lambda w, h: ((w - h) ** 2).sum(),
            lambda w, h: (w**2).sum(),
            torch.ones(2, dtype=F64),
            torch.ones(2, dtype=F64),
            solver=FakeSolver(GOOD, scale=float("inf")),
        )


def test_unrolled_nan_is_written_with_a_warning():
    model, hyper, x, xv, inner, _ = _problem()
    outer = lambda m, b: ((m(b) - m(b).detach()).abs().sum()).sqrt()  # noqa: E731
    step = hg.HyperStep(
        model, hyper, inner, outer, method=hg.Unrolled(hg.optim.sgd(lr=0.1)),
        on_diverged="write",
    )  # fmt: skip
    info, caught = _record(lambda: step(x, xv))
    assert not info.skipped
    assert [str(w.message)[:40] for w in caught] == ["HyperStep wrote a result that is not a h"]


@pytest.mark.parametrize("failure", ["singular", "residual above 1", "non-finite residual"])
def test_warm_start_does_not_keep_a_failed_adjoint(failure):
    report = REPORTS[failure][0]
    model, hyper, x, xv, inner, outer = _problem()
    step = hg.HyperStep(
        model, hyper, inner, outer,
        method=hg.Implicit(solver=FakeSolver(GOOD), warm_start="previous"),
    )  # fmt: skip
    step(x, xv)
    assert step.adjoint is not None
    step.method = hg.Implicit(solver=FakeSolver(report), warm_start="previous")
    _record(lambda: step(x, xv))
    assert step.adjoint is None and step.warm is not None and step.warm.kept == 0


# --------------------------------------------------------------------- HyperStep, real solves


def _real(policy, solver, zero_feature=False):
    model, hyper, x, xv, inner, outer = _problem(zero_feature=zero_feature)
    step = hg.HyperStep(model, hyper, inner, outer, solver=solver, on_diverged=policy)
    if policy == "raise":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", hg.HypergradWarning)
            with pytest.raises(hg.HypergradError, match="on_diverged='raise'") as raised:
                step(x, xv)
        return step.last_info, [], str(raised.value), hyper
    info, caught = _record(lambda: step(x, xv))
    return info, caught, info.skip_reason, hyper


@pytest.mark.parametrize("policy", ["skip", "write", "raise"])
def test_real_diverged_neumann(policy):
    info, caught, reason, hyper = _real(policy, hg.Neumann(maxiter=30, alpha=50.0))
    assert info.solve.failure == "diverged"
    assert any(w.category is hg.SolverDivergedWarning for w in caught) or policy == "raise"
    if policy == "write":
        assert not info.skipped and hyper.weight.grad is not None
    else:
        assert "the neumann solve diverged" in reason and hyper.weight.grad is None


@pytest.mark.parametrize("policy", ["skip", "write", "raise"])
def test_real_stalled_neumann(policy):
    """The zero input feature leaves a direction of zero curvature that the outer batch uses:
    with alpha = 1/lambda_max the series terms stop shrinking (residual bound 0.51: stalled is a
    reason of its own, not the residual rule)."""
    info, caught, reason, hyper = _real(policy, hg.Neumann(maxiter=100), zero_feature=True)
    assert info.solve.failure == "stalled" and info.solve.residual < 1
    if policy == "write":
        assert not info.skipped and hyper.weight.grad is not None
        assert [w.category for w in caught] == [hg.SolverStalledWarning]
    else:
        assert "the neumann iteration stalled" in reason and hyper.weight.grad is None


@pytest.mark.parametrize("policy", ["skip", "write", "raise"])
def test_real_singular_cg(policy):
    """The issue's case: an all-zero input feature in the inner batch, nonzero in the outer one,
    default CG. Its .grad was |g| ~ 1e66, written silently under the default "skip"."""
    info, caught, reason, hyper = _real(policy, None, zero_feature=True)
    assert info.solve.failure in ("singular", "diverged", "residual above 1"), info.solve
    if policy == "write":
        assert not info.skipped and hyper.weight.grad is not None
    else:
        assert info.solve.solver in reason and hyper.weight.grad is None
        assert any(w in reason for w in ("singular", "diverged", "above 1"))
    if policy == "skip":
        assert info.skipped and any("HyperStep skipped" in str(w.message) for w in caught)


# ------------------------------------------------------------------- implicit_grad, @implicit


def _ridge():
    torch.manual_seed(1)
    X, y = torch.randn(20, 3, dtype=F64), torch.randn(20, dtype=F64)
    inner = lambda w, lam: 0.5 * ((X @ w - y) ** 2).sum() + 0.5 * lam * (w**2).sum()  # noqa: E731
    outer = lambda w, lam: 0.5 * ((X @ w - 1.0) ** 2).sum()  # noqa: E731
    lam = torch.tensor(0.5, dtype=F64)
    w = torch.linalg.solve(X.T @ X + lam * torch.eye(3, dtype=F64), X.T @ y)
    return X, y, inner, outer, lam, w


@pytest.mark.parametrize("failure", list(REPORTS))
def test_implicit_grad_warns_for_a_silent_solver(failure):
    report, _, category = REPORTS[failure]
    _, _, inner, outer, lam, w = _ridge()
    (g, info), caught = _record(
        lambda: hg.implicit_grad(inner, outer, w, lam, solver=FakeSolver(report))
    )
    assert info.solve.failure == failure and torch.isfinite(g).all()  # returned, not raised
    assert [w.category for w in caught] == [category]


def test_implicit_grad_clean_report_does_not_warn():
    _, _, inner, outer, lam, w = _ridge()
    _, caught = _record(lambda: hg.implicit_grad(inner, outer, w, lam, solver=FakeSolver(GOOD)))
    assert caught == []


@pytest.mark.parametrize("failure", list(REPORTS))
def test_implicit_decorator_warns_for_a_silent_solver(failure):
    report, _, category = REPORTS[failure]
    X, y, inner, _, lam, _ = _ridge()

    @hg.implicit(inner, solver=FakeSolver(report))
    def fit(lam):
        return torch.linalg.solve(X.T @ X + lam * torch.eye(3, dtype=F64), X.T @ y)

    lam = lam.clone().requires_grad_(True)
    _, caught = _record(lambda: (fit(lam) ** 2).sum().backward())
    assert fit.last_info.solve.failure == failure and lam.grad is not None
    assert [w.category for w in caught] == [category]


class WarningSolver(FakeSolver):
    """A duck-typed solver that warns about its own failure and records it (extras["warned"])."""

    def solve(self, matvec, b, x0=None):
        x, info = super().solve(matvec, b, x0)
        warnings.warn("custom solver: diverged", hg.SolverDivergedWarning, stacklevel=2)
        info.extras["warned"] = "SolverDivergedWarning"
        return x, info


def test_a_solver_that_warned_is_not_warned_about_again():
    _, _, inner, outer, lam, w = _ridge()
    solver = WarningSolver(REPORTS["diverged"][0])
    (_, info), caught = _record(lambda: hg.implicit_grad(inner, outer, w, lam, solver=solver))
    assert info.solve.failure == "diverged"
    assert [str(w.message) for w in caught] == ["custom solver: diverged"]


def test_builtin_solver_failure_warns_once():
    """hypergrad's own solvers warn themselves: the entry point adds no second warning."""
    _, _, inner, outer, lam, w = _ridge()
    (_, info), caught = _record(
        lambda: hg.implicit_grad(inner, outer, w, lam, solver=hg.Neumann(maxiter=30, alpha=50.0))
    )
    assert info.solve.failure == "diverged"
    assert [w.category for w in caught] == [hg.SolverDivergedWarning]


def test_implicit_grad_singular_linear_model_warns():
    """The issue's singular case through implicit_grad: returned, with a warning."""
    torch.manual_seed(0)
    x = torch.randn(16, 4, dtype=F64)
    x[:, 2] = 0.0
    xv = torch.randn(16, 4, dtype=F64)
    t = torch.randn(4, 2, dtype=F64)
    inner = lambda W, T: ((x @ W - x @ T) ** 2).mean()  # noqa: E731
    outer = lambda W, T: ((xv @ W) ** 2).mean()  # noqa: E731
    W = t.clone()
    (_, info), caught = _record(lambda: hg.implicit_grad(inner, outer, W, t))
    assert info.solve.failure is not None, info.solve
    assert caught, "a result that is not a hypergradient was returned without a warning"


# --------------------------------------------------------------------------- two gloo processes


def _dist_problem(rank: int, zero_feature_on: int | None = None):
    torch.manual_seed(0)
    model, hyper = nn.Linear(4, 2).to(F64), nn.Linear(4, 2).to(F64)
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(16, 4, generator=g, dtype=F64)
    xv = torch.randn(16, 4, generator=g, dtype=F64)
    if zero_feature_on == rank:
        x[:, 2] = 0.0
    inner = lambda m, b: ((m(b) - hyper(b)) ** 2).mean()  # noqa: E731
    outer = lambda m, b: (m(b) ** 2).mean()  # noqa: E731
    return model, hyper, x, xv, inner, outer


DIST_CASES = {
    # name: (distributed, solver factory, which rank gets the zero-feature batch)
    "local_fake": ("local", lambda: FakeSolver(REPORTS["diverged"][0], ranks=(1,)), None),
    "exact_fake": ("exact", lambda: FakeSolver(REPORTS["diverged"][0], ranks=(1,)), None),
    "local_data": ("local", lambda: hg.CG(), 1),
    # every rank fails (as under "exact" a real failure does): listed together, warned once each
    "exact_both": ("exact", lambda: FakeSolver(REPORTS["diverged"][0], ranks=(0, 1)), None),
}
ONE_RANK = [name for name in DIST_CASES if name != "exact_both"]


def _dist_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        for name, (mode, make_solver, zero_on) in DIST_CASES.items():
            for policy in ("skip", "write", "raise"):
                model, hyper, x, xv, inner, outer = _dist_problem(rank, zero_on)
                step = hg.HyperStep(
                    model, hyper, inner, outer, solver=make_solver(), distributed=mode,
                    on_diverged=policy,
                )  # fmt: skip
                for p in hyper.parameters():
                    p.grad = torch.full_like(p, 7.0)  # stale
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        info = step(x, xv)
                        raised = None
                    except hg.HypergradError as err:
                        info, raised = step.last_info, str(err)
                results[(name, policy)] = {
                    "raised": raised,
                    "skipped": info.skipped,
                    "skip_reason": info.skip_reason,
                    "failure": info.solve.failure,
                    "grads": [
                        None if p.grad is None else p.grad.clone() for p in hyper.parameters()
                    ],
                    "warnings": [str(w.message)[:40] for w in caught],
                }
        torch.save(results, os.path.join(out_dir, f"skip_{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("skip_dist")
    mp.spawn(_dist_worker, args=(2, str(out / "init"), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"skip_{r}.pt", weights_only=False) for r in range(2)]


pytestmark_dist = pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")


@pytestmark_dist
@pytest.mark.parametrize("name", ONE_RANK)
def test_two_ranks_skip_together(two_ranks, name):
    r0, r1 = two_ranks[0][(name, "skip")], two_ranks[1][(name, "skip")]
    assert r0["failure"] is None and r1["failure"] is not None  # only rank 1's solve failed
    for r in (r0, r1):
        assert r["skipped"] and r["raised"] is None
        assert r["skip_reason"].startswith("rank 1: the ")
        assert "rank 0" not in r["skip_reason"]
        assert r["grads"] == [None, None]
        assert any(w.startswith("HyperStep skipped") for w in r["warnings"])
    assert r0["skip_reason"] == r1["skip_reason"]
    if name != "local_data":
        assert r0["skip_reason"] == "rank 1: the fake solve diverged"


@pytestmark_dist
@pytest.mark.parametrize("name", ONE_RANK)
def test_two_ranks_raise_together(two_ranks, name):
    for rank in (0, 1):
        r = two_ranks[rank][(name, "raise")]
        assert r["raised"] is not None and "rank 1: the " in r["raised"]
        assert all(torch.equal(g, torch.full_like(g, 7.0)) for g in r["grads"])  # untouched


@pytestmark_dist
@pytest.mark.parametrize("name", ONE_RANK)
def test_two_ranks_write_the_same_value(two_ranks, name):
    r0, r1 = two_ranks[0][(name, "write")], two_ranks[1][(name, "write")]
    for r in (r0, r1):
        assert not r["skipped"] and r["raised"] is None
        assert all(
            g is not None and not torch.equal(g, torch.full_like(g, 7.0)) for g in r["grads"]
        )
    for g0, g1 in zip(r0["grads"], r1["grads"]):
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)
    # rank 0's own solve was fine: it is told that what it wrote is averaged with a failure
    assert any(w.startswith("HyperStep wrote a result that is not") for w in r0["warnings"])


@pytestmark_dist
def test_two_ranks_both_failing(two_ranks):
    for rank in (0, 1):
        skip, write = (
            two_ranks[rank][("exact_both", "skip")],
            two_ranks[rank][("exact_both", "write")],
        )
        assert skip["skipped"] and skip["skip_reason"] == "ranks 0, 1: the fake solve diverged"
        assert skip["grads"] == [None, None]
        # each rank's own failure was warned about once (by the entry point): no second warning
        assert write["warnings"] == ["FakeSolver.solve returned a report with "]
        raised = two_ranks[rank][("exact_both", "raise")]["raised"]
        assert "ranks 0, 1: the fake solve diverged" in raised
