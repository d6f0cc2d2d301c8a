"""hg.stochastic on a quadratic bilevel family with closed forms.

G(z, x) = mean_i ½ zᵀA_i z − zᵀ(B_i x + c_i) (A_i SPD), F(z, x) = mean_j ½||z − t_j||² + ½μ||x||².
With means Ā, B̄, c̄, t̄: z*(x) = Ā⁻¹(B̄x + c̄), M = Ā⁻¹B̄,
∇h(x) = Mᵀ(z*(x) − t̄) + μx, x* = −(MᵀM + μI)⁻¹ Mᵀ(Ā⁻¹c̄ − t̄), v*(x) = −Ā⁻¹(z*(x) − t̄).
z is a dict pytree {"a": 2, "b": 1}, x a tuple (p,). Every closed form is checked against a
dense float64 solve differentiated by autograd (test_closed_forms).
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import ROOT

import hypergrad as hg

S = hg.stochastic
F64 = torch.float64
D, P, N_IN, N_OUT, MU = 3, 2, 6, 5, 0.1


@dataclass
class Quad:
    A: torch.Tensor
    B: torch.Tensor
    c: torch.Tensor
    t: torch.Tensor

    @property
    def Abar(self) -> torch.Tensor:
        return self.A.mean(0)

    def zstar(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.solve(self.Abar, self.B.mean(0) @ x + self.c.mean(0))

    def hypergrad(self, x: torch.Tensor) -> torch.Tensor:
        M = torch.linalg.solve(self.Abar, self.B.mean(0))
        return M.T @ (self.zstar(x) - self.t.mean(0)) + MU * x

    def xstar(self) -> torch.Tensor:
        M = torch.linalg.solve(self.Abar, self.B.mean(0))
        r = torch.linalg.solve(self.Abar, self.c.mean(0)) - self.t.mean(0)
        return -torch.linalg.solve(M.T @ M + MU * torch.eye(P, dtype=F64), M.T @ r)

    def vstar(self, x: torch.Tensor) -> torch.Tensor:
        return -torch.linalg.solve(self.Abar, self.zstar(x) - self.t.mean(0))

    def x_lambda(self, lam: float) -> torch.Tensor:
        """F²SA's fixed point: μx − λB̄ᵀ(y_λ(x) − z*(x)) = 0, (I + λĀ) y_λ = t̄ + λ(B̄x + c̄)."""
        Ab, Bb, cb, tb = self.Abar, self.B.mean(0), self.c.mean(0), self.t.mean(0)
        Pm = torch.linalg.inv(torch.eye(D, dtype=F64) + lam * Ab)
        Ai = torch.linalg.inv(Ab)
        lin = MU * torch.eye(P, dtype=F64) - lam * Bb.T @ (lam * Pm - Ai) @ Bb
        const = -lam * Bb.T @ (Pm @ (tb + lam * cb) - Ai @ cb)
        return torch.linalg.solve(lin, -const)


def make_quad(seed: int = 0) -> Quad:
    g = torch.Generator().manual_seed(seed)
    Q = torch.randn(N_IN, D, D, generator=g, dtype=F64) / math.sqrt(D)
    A = Q @ Q.transpose(1, 2) + 0.5 * torch.eye(D, dtype=F64)
    A = A / torch.linalg.eigvalsh(A.mean(0)).max()  # mean inner Hessian's L = 1
    B = torch.randn(N_IN, D, P, generator=g, dtype=F64)
    c = torch.randn(N_IN, D, generator=g, dtype=F64)
    t = torch.randn(N_OUT, D, generator=g, dtype=F64) + 1.0
    return Quad(A, B, c, t)


def zvec(z: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([z["a"], z["b"]])


def ztree(v: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"a": v[:2].clone(), "b": v[2:].clone()}


def problem(q: Quad, bs_in: int | None = None, bs_out: int | None = None, seed: int = 0):
    def inner(z, x, i):
        zz, xx = zvec(z), x[0]
        Az = torch.einsum("bij,j->bi", q.A[i], zz)
        rhs = torch.einsum("bij,j->bi", q.B[i], xx) + q.c[i]
        return (0.5 * (Az * zz).sum(1) - (rhs * zz).sum(1)).mean()

    def outer(z, x, j):
        return 0.5 * ((zvec(z) - q.t[j]) ** 2).sum(1).mean() + 0.5 * MU * (x[0] ** 2).sum()

    return S.Bilevel(
        inner,
        outer,
        S.IndexSampler(N_IN, bs_in, seed=seed),
        S.IndexSampler(N_OUT, bs_out, seed=seed + 1000),
    )


Z0 = torch.tensor([0.3, -0.2, 0.1], dtype=F64)
X0 = torch.tensor([1.0, -1.0], dtype=F64)


def start(solver, z0=Z0, x0=X0):
    return solver.init(ztree(z0), (x0.clone(),))


def flat(t) -> torch.Tensor:
    return torch.cat([a.reshape(-1) for a in t]) if t else torch.zeros(0, dtype=F64)


# ---------------------------------------------------------------------------------------------
# closed forms and oracles


def test_closed_forms_match_a_dense_float64_solve() -> None:
    q = make_quad()
    x = torch.tensor([0.4, -0.7], dtype=F64, requires_grad=True)
    z = torch.linalg.solve(q.Abar, q.B.mean(0) @ x + q.c.mean(0))  # the dense inner solve
    h = 0.5 * ((z[None] - q.t) ** 2).sum(1).mean() + 0.5 * MU * (x**2).sum()
    (g,) = torch.autograd.grad(h, x)
    xd = x.detach()
    assert torch.allclose(q.hypergrad(xd), g, atol=1e-13, rtol=0)
    assert q.hypergrad(q.xstar()).norm() < 1e-13
    # v* solves Ā v = −∇_z F and gives ∇h = ∇_x F + ∇²_xz G v* = μx − B̄ᵀv*
    assert torch.allclose(MU * xd - q.B.mean(0).T @ q.vstar(xd), g, atol=1e-13, rtol=0)


def test_one_batch_oracles_equal_the_closed_forms() -> None:
    q = make_quad()
    pb = problem(q)
    g = torch.Generator().manual_seed(3)
    z, x, v = (torch.randn(D, generator=g, dtype=F64) for _ in range(3))
    x = x[:P]
    idx = torch.tensor([0, 2, 2, 5])
    st = start(S.SOBA(), z, x)
    lin = S.Linearization(pb, st.specs, st.z, st.x, idx)
    A_b, B_b, c_b = q.A[idx].mean(0), q.B[idx].mean(0), q.c[idx].mean(0)
    assert torch.allclose(flat(lin.grad), A_b @ z - B_b @ x - c_b, atol=1e-12, rtol=0)
    hv, cross = lin.products(tuple(ztree(v).values()), retain=True)
    assert torch.allclose(flat(hv), A_b @ v, atol=1e-12, rtol=0)
    assert torch.allclose(flat(cross), -B_b.T @ v, atol=1e-12, rtol=0)
    assert torch.allclose(flat(lin.hvp(tuple(ztree(v).values()))), A_b @ v, atol=1e-12, rtol=0)
    j = torch.tensor([1, 4])
    fz, fx = S.gradients(pb.outer_loss, "outer_loss", st.specs, st.z, st.x, j)
    assert torch.allclose(flat(fz), z - q.t[j].mean(0), atol=1e-12, rtol=0)
    assert torch.allclose(flat(fx), MU * x, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------
# unbiased estimators


def _mean_se(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.stack(samples)
    return s.mean(0), s.std(0) / math.sqrt(len(samples))


def _assert_unbiased(samples: list[torch.Tensor], full: torch.Tensor, k: float = 4.5) -> None:
    mean, se = _mean_se(samples)
    assert (se > 0).all()
    z = ((mean - full) / se).abs()
    assert float(z.max()) < k, (mean, full, se)


def test_soba_directions_are_unbiased() -> None:
    q = make_quad()
    solver = S.SOBA()
    st = start(solver)
    st.v = tuple(ztree(torch.tensor([0.5, -0.1, 0.2], dtype=F64)).values())
    pb = problem(q, 2, 2)
    full = [
        flat(d) for d in solver.directions(st, problem(q), torch.arange(N_IN), torch.arange(N_OUT))
    ]
    draws: list[list[torch.Tensor]] = [[], [], []]
    for k in range(1500):
        d = solver.directions(st, pb, pb.inner_sampler(k), pb.outer_sampler(k))
        for acc, di in zip(draws, d):
            acc.append(flat(di))
    for acc, f in zip(draws, full):
        _assert_unbiased(acc, f)


def test_stocbio_neumann_adjoint_is_unbiased_for_the_truncated_series() -> None:
    q = make_quad()
    solver = S.StocBiO(neumann_steps=4, neumann_step=0.5)
    st = start(solver)
    pb = problem(q, 2, 2)
    fz = st.z  # any right-hand side
    Ab = q.Abar
    r, acc = flat(fz), flat(fz)
    for _ in range(4):
        r = r - 0.5 * Ab @ r
        acc = acc + r
    full = -0.5 * acc
    samples = []
    for _ in range(1500):
        samples.append(flat(solver.adjoint_estimate(st, pb, fz)))  # draws advance st's counter
    _assert_unbiased(samples, full)


def test_saba_directions_are_unbiased_and_have_less_variance() -> None:
    q = make_quad()
    pb = problem(q, 2, 1)  # 3 inner blocks, 5 outer blocks
    saba, soba = S.SABA(step_inner=0.5, step_outer=0.1), S.SOBA(step_inner=0.5, step_outer=0.1)
    st = start(saba)
    for _ in range(400):  # near the solution, the memory filled with recent values
        st = saba.step(st, pb)
    full = [
        flat(d) for d in soba.directions(st, problem(q), torch.arange(N_IN), torch.arange(N_OUT))
    ]
    vr: list[list[torch.Tensor]] = [[], [], []]
    plain: list[list[torch.Tensor]] = [[], [], []]
    for k in range(800):
        s = st.copy()
        s.inner_draws, s.outer_draws = 10_000 + k, 10_000 + k
        for acc, di in zip(vr, saba.directions(s, pb)):
            acc.append(flat(di))
        bi, bo = pb.inner_sampler.block(10_000 + k)[1], pb.outer_sampler.block(10_000 + k)[1]
        for acc, di in zip(plain, soba.directions(st, pb, bi, bo)):
            acc.append(flat(di))
    for acc, f in zip(vr, full):
        _assert_unbiased(acc, f)
    # variance reduction: near the solution SAGA's estimator varies far less than SOBA's
    for a, b in zip(vr, plain):
        ratio = float(torch.stack(a).var(0).sum() / torch.stack(b).var(0).sum())
        assert ratio < 0.05, ratio


# ---------------------------------------------------------------------------------------------
# convergence: the full-batch iteration is affine in its carried variables, so its rate is
# ||M^k|| for the probed matrix M, and its fixed point is (I − M)⁻¹ b


CARRIED = {
    "soba": ("z", "v", "x"),
    "amigo": ("z", "v", "x"),
    "stocbio": ("z", "x"),
    "f2sa": ("z", "y", "x"),
}


def _vector(st, names) -> torch.Tensor:
    return torch.cat([flat(getattr(st, n)) for n in names])


def _set(st, names, w: torch.Tensor):
    s = st.copy()
    i = 0
    for n in names:
        leaves = []
        for t in getattr(st, n):
            leaves.append(w[i : i + t.numel()].reshape(t.shape).clone())
            i += t.numel()
        setattr(s, n, tuple(leaves))
    return s


def affine_map(solver, pb, st) -> tuple[torch.Tensor, torch.Tensor]:
    names = CARRIED[solver.name]
    w0 = torch.zeros_like(_vector(st, names))
    b = _vector(solver.step(_set(st, names, w0), pb), names)
    cols = []
    for i in range(len(w0)):
        e = w0.clone()
        e[i] = 1.0
        cols.append(_vector(solver.step(_set(st, names, e), pb), names) - b)
    return torch.stack(cols, 1), b


DETERMINISTIC = [
    S.SOBA(step_inner=0.5, step_outer=0.2),
    S.AmIGO(step_inner=0.5, inner_steps=2, step_adjoint=0.5, adjoint_steps=2, step_outer=0.3),
    S.StocBiO(step_inner=0.5, inner_steps=2, neumann_steps=25, neumann_step=1.0, step_outer=1.0),
    S.F2SA(step_inner=0.5, inner_steps=3, step_outer=0.5, lambda0=20.0),
]


@pytest.mark.parametrize("solver", DETERMINISTIC, ids=lambda s: s.name)
def test_full_batch_iterates_converge_at_the_probed_rate(solver) -> None:
    """The full-batch step is affine in the carried variables w: w_{k+1} = M w_k + b, M probed
    column by column. Its fixed point is checked against the closed forms, then the run's error
    against the rate: ||x_k − x*|| ≤ ||M^k|| ||w_0 − w_fp|| + ||x_fp − x*||, with k the number of
    iterations the rate needs to bring the first term below 1e-9."""
    q = make_quad()
    pb = problem(q)
    st0 = start(solver)
    names = CARRIED[solver.name]
    M, b = affine_map(solver, pb, st0)
    rho = float(torch.linalg.eigvals(M).abs().max())
    assert rho < 1.0
    w_fp = torch.linalg.solve(torch.eye(len(b), dtype=F64) - M, b)
    xs = q.xstar()
    bias = float((w_fp[-P:] - xs).norm())
    if solver.name in ("soba", "amigo"):
        # the fixed point is the bilevel solution itself, with the exact adjoint
        assert bias < 1e-10
        assert torch.allclose(w_fp[D : 2 * D], q.vstar(xs), atol=1e-10, rtol=0)
    elif solver.name == "stocbio":
        # a truncated Neumann series: the adjoint's relative bias is ||(I − ηĀ)^{Q+1}||
        eta, Qn = solver.neumann_step, solver.neumann_steps
        eye = torch.eye(D, dtype=F64)
        trunc = torch.linalg.matrix_power(eye - eta * q.Abar, Qn + 1)
        bias_rel = float(torch.linalg.matrix_norm(trunc, 2))
        assert bias_rel < 1e-6 and 0 < bias < 100 * bias_rel * float(xs.norm() + 1)
    else:
        assert torch.allclose(w_fp[-P:], q.x_lambda(solver.lambda0), atol=1e-10, rtol=0)
    assert torch.allclose(w_fp[:D], q.zstar(w_fp[-P:]), atol=1e-10, rtol=0)
    e0 = _vector(st0, names) - w_fp
    iters, Mk = 0, torch.eye(len(b), dtype=F64)
    while float(torch.linalg.matrix_norm(Mk, 2)) * float(e0.norm()) > 1e-9:
        iters, Mk = iters + 1, M @ Mk
        assert iters < 4000
    st = st0
    for _ in range(iters):
        st = solver.step(st, pb)
    w = _vector(st, names)
    # w_k − w_fp = M^k (w_0 − w_fp) exactly for an affine iteration
    assert torch.allclose(w - w_fp, Mk @ e0, atol=1e-10, rtol=0)
    err = float((w[-P:] - xs).norm())
    assert err <= 1e-9 + bias + 1e-12


def test_f2sa_fixed_points_approach_x_star_as_lambda_grows() -> None:
    q = make_quad()
    xs = q.xstar()
    errs = [float((q.x_lambda(lam) - xs).norm()) for lam in (10.0, 100.0, 1000.0, 10000.0)]
    for a, b in zip(errs, errs[1:]):
        assert b < 0.15 * a  # O(1/λ) (Kwon et al., Lemma 3.1)
    # and the run with a growing penalty λ_k = 1 + 2k follows them to x*
    solver = S.F2SA(step_inner=0.5, inner_steps=3, step_outer=0.05, lambda0=1.0, lambda_step=2.0)
    x, report = S.run(solver, problem(q), ztree(Z0), (X0.clone(),), iterations=1500)
    lam = report.state.multiplier
    err = float((x[0] - xs).norm())
    assert lam == 1.0 + 2.0 * 1499
    assert err < 0.2 * float((X0 - xs).norm()) and err < 0.02
    # the penalty's adjoint estimate λ(y − z) approaches v*
    v_est = flat(solver.adjoint(report.state))
    assert float((v_est - q.vstar(x[0])).norm()) < 0.05 * float(q.vstar(x[0]).norm()) + 0.02


def test_bome_reaches_a_neighbourhood_of_the_stationary_point() -> None:
    """BOME's constraint q(z, x) = G(z, x) − G(θ_T, x) ≤ 0 has ∇q = 0 on its feasible set, so
    its guarantee is on a KKT residual, not on ∇h: with constant steps it plateaus near x*
    (measured on this problem: ||x − x*|| ≈ 0.54, ||∇h|| ≈ 0.12 from 4.6 and 3.3, reached by
    iteration 500 and unchanged to 3000; a smaller step moves the plateau only to ≈ 0.30)."""
    q = make_quad()
    xs = q.xstar()
    solver = S.BOME(step_size=0.1, inner_steps=10, step_inner=0.5)
    x, report = S.run(solver, problem(q), ztree(Z0), (X0.clone(),), iterations=800)
    e0 = float((X0 - xs).norm())
    err = float((x[0] - xs).norm())
    assert not report.diverged
    assert err < 0.15 * e0, err
    assert float(q.hypergrad(x[0]).norm()) < 0.05 * float(q.hypergrad(X0).norm())
    assert math.isfinite(report.state.multiplier) and report.state.multiplier > 0


# ---------------------------------------------------------------------------------------------
# checkpoint / resume, divergence, settings


ALL = [
    S.SOBA(step_inner=0.5, step_outer=0.1),
    S.SABA(step_inner=0.5, step_outer=0.1),
    S.StocBiO(step_inner=0.5, inner_steps=2, neumann_steps=3, neumann_step=0.5),
    S.AmIGO(step_inner=0.5, inner_steps=2, adjoint_steps=2, step_adjoint=0.5),
    S.F2SA(step_inner=0.5, inner_steps=2, lambda0=2.0, lambda_step=1.0),
    S.BOME(step_size=0.05, inner_steps=3),
    S.SRBA(step_inner=0.5, step_outer=0.1, period=3),  # resumes mid-period
]


@pytest.mark.parametrize("solver", ALL, ids=lambda s: s.name)
def test_checkpoint_resume_is_bitwise(solver) -> None:
    pb = problem(make_quad(), 2, 1)
    n = 7
    _, straight = S.run(solver, pb, ztree(Z0), (X0.clone(),), iterations=2 * n)
    _, half = S.run(solver, pb, ztree(Z0), (X0.clone(),), iterations=n)
    buf = io.BytesIO()
    torch.save(half.state.state_dict(), buf)
    buf.seek(0)
    fresh = solver.init(ztree(Z0), (X0.clone(),))
    fresh.load_state_dict(torch.load(buf))
    _, resumed = S.run(solver, pb, iterations=n, state=fresh)
    a, b = straight.state, resumed.state
    for name in ("x", "z", "v", "y"):
        for u, w in zip(getattr(a, name), getattr(b, name), strict=True):
            assert torch.equal(u, w), name
    assert a.memory.keys() == b.memory.keys()
    if solver.name == "srba":
        assert len(a.memory) == 6
    for k in a.memory:
        assert all(torch.equal(u, w) for u, w in zip(a.memory[k], b.memory[k], strict=True))
    assert (a.iteration, a.inner_draws, a.outer_draws, a.inner_calls, a.outer_calls) == (
        b.iteration,
        b.inner_draws,
        b.outer_draws,
        b.inner_calls,
        b.outer_calls,
    )


@pytest.mark.parametrize("solver", ALL, ids=lambda s: s.name)
def test_a_far_too_large_step_is_reported_diverged(solver) -> None:
    big = {
        "soba": {"step_inner": 50.0},
        "saba": {"step_inner": 50.0},
        "stocbio": {"step_inner": 50.0},
        "amigo": {"step_inner": 50.0},
        "f2sa": {"step_inner": 50.0},
        "bome": {"step_size": 50.0},
        "srba": {"step_inner": 50.0},
    }[solver.name]
    with pytest.warns(hg.SolverDivergedWarning, match=f"{solver.name}: diverged"):
        _, report = S.run(
            solver.replace(**big),
            problem(make_quad(), 2, 1),
            ztree(Z0),
            (X0.clone(),),
            iterations=300,
        )
    assert report.diverged and report.iterations < 300


def test_settings_are_validated_and_frozen() -> None:
    for bad in (
        {"step_inner": 0.0},
        {"step_inner": -1.0},
        {"step_outer": float("nan")},
        {"decay": 1},
    ):
        with pytest.raises(hg.HypergradError):
            S.SOBA(**bad)
    with pytest.raises(hg.HypergradError):
        S.StocBiO(inner_steps=0)
    with pytest.raises(hg.HypergradError):
        S.F2SA(lambda0=10.0, lambda_max=1.0)
    with pytest.raises(hg.HypergradError):
        S.BOME(eta=0.0)
    s = S.SOBA()
    with pytest.raises(hg.FrozenSettingError):
        s.step_inner = 1.0  # type: ignore[misc]
    assert s.replace(step_inner=0.3).step_inner == 0.3
    with pytest.raises(hg.HypergradError):
        S.run(s, problem(make_quad()), iterations=3)  # no start
    with pytest.raises(hg.HypergradError):
        S.SABA().step(
            start(S.SABA()),
            S.Bilevel(
                problem(make_quad()).inner_loss,
                problem(make_quad()).outer_loss,
                lambda k: torch.arange(N_IN),
                lambda k: torch.arange(N_OUT),
            ),
        )


def test_run_reports_diagnostics_and_callback_stops() -> None:
    q = make_quad()
    seen = []
    x, report = S.run(
        S.SOBA(step_inner=0.5, step_outer=0.2),
        problem(q),
        ztree(Z0),
        (X0.clone(),),
        iterations=400,
        eval_every=100,
        callback=lambda st: seen.append(st.iteration) or st.iteration < 300,
    )
    assert report.reason == "callback" and report.iterations == 300 and seen[-1] == 300
    assert [d.iteration for d in report.history] == [100, 200, 300]
    last = report.history[-1]
    assert last.inner_grad_norm < 1e-4 and last.adjoint_residual < 1e-4
    assert abs(last.outer_grad_norm - float(q.hypergrad(x[0]).norm())) < 1e-4
    assert report.inner_calls == 3 * 300 and report.outer_calls == 2 * 300


def test_docs_example_runs() -> None:
    text = Path(ROOT / "docs" / "stochastic.md").read_text(encoding="utf-8")
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", hg.HypergradWarning)
        exec(compile(block, "docs/stochastic.md", "exec"), {})


def test_stochastic_iterates_average_to_the_full_batch_ones_and_saba_removes_the_floor() -> None:
    """Every batch matrix multiplies iterates built from earlier, independent draws, so
    E[w_k] follows the full-batch iteration exactly (the directions are unbiased given the
    past); what is left is the spread around it, SOBA's noise floor of size O(step). SABA's
    directions lose their variance as the iterates converge, so its spread collapses."""
    q = make_quad()
    xs = q.xstar()
    k_iters, seeds = 200, 16
    spreads = {}
    for solver in (S.SOBA(step_inner=0.3, step_outer=0.1), S.SABA(step_inner=0.3, step_outer=0.1)):
        det = start(solver)
        for _ in range(k_iters):
            det = solver.step(det, problem(q))
        finals = []
        for seed in range(seeds):
            x, report = S.run(
                solver, problem(q, 2, 1, seed=seed), ztree(Z0), (X0.clone(),), iterations=k_iters
            )
            finals.append(x[0])
        if solver.name == "soba":
            _assert_unbiased(finals, det.x[0])
        spread = torch.stack(finals) - xs
        spreads[solver.name] = float((spread**2).sum(1).mean().sqrt())
    assert float((det.x[0] - xs).norm()) < 0.1 * float((X0 - xs).norm())
    assert spreads["soba"] < 0.5 * float((X0 - xs).norm())  # a floor, far below the start
    assert spreads["saba"] < 0.2 * spreads["soba"], spreads


# ---------------------------------------------------------------------------------------------
# SRBA: recursive (SARAH/SPIDER) variance reduction with a periodic full-batch refresh

CARRIED["srba"] = ("z", "v", "x")


def test_srba_with_a_refresh_every_iteration_is_full_batch_soba() -> None:
    """period=1: every direction is the full-batch one, whatever the samplers' minibatches, so
    each step equals full-batch SOBA's bit for bit and draws no batch; its fixed point (probed
    as an affine map) is the closed-form (z*, v*, x*)."""
    q = make_quad()
    srba = S.SRBA(step_inner=0.5, step_outer=0.2, period=1)
    soba = S.SOBA(step_inner=0.5, step_outer=0.2)
    pb = problem(q, 2, 1)  # minibatch samplers: unused by a refresh
    a, b = start(srba), start(soba)
    for _ in range(40):
        a, b = srba.step(a, pb), soba.step(b, problem(q))
        for name in ("z", "v", "x"):
            assert all(torch.equal(u, w) for u, w in zip(getattr(a, name), getattr(b, name)))
    assert (a.inner_draws, a.outer_draws, a.inner_calls, a.outer_calls) == (0, 0, 3 * 40, 2 * 40)
    M, c = affine_map(srba, pb, start(srba))
    assert float(torch.linalg.eigvals(M).abs().max()) < 1.0
    w_fp = torch.linalg.solve(torch.eye(len(c), dtype=F64) - M, c)
    xs = q.xstar()
    assert torch.allclose(w_fp[-P:], xs, atol=1e-10, rtol=0)
    assert torch.allclose(w_fp[D : 2 * D], q.vstar(xs), atol=1e-10, rtol=0)
    assert torch.allclose(w_fp[:D], q.zstar(xs), atol=1e-10, rtol=0)


def test_srba_converges_to_x_star_on_minibatches_where_soba_stops_at_a_floor() -> None:
    """Minibatches of 2 inner and 1 outer samples, a refresh every 6 iterations. Between
    refreshes the estimator's error is a sum of (J_b − J)(w_t − w_{t−1}) (the batch and full
    Jacobians of the affine directions times the iterates' moves), so it shrinks with the moves
    and SRBA follows the full-batch iteration's linear rate to x* itself: the bound below is 10x
    the full-batch iteration's own error after the same iterations (≈ 1e-6, checked). SOBA at the
    same steps keeps an O(step) noise floor (measured here: spread ≈ 6, SRBA's ≈ 1e-6)."""
    q = make_quad()
    xs = q.xstar()
    iters, seeds, steps = 600, 6, {"step_inner": 0.4, "step_outer": 0.15}
    det = start(S.SOBA(**steps))
    for _ in range(iters):
        det = S.SOBA(**steps).step(det, problem(q))
    det_err = float((det.x[0] - xs).norm())
    assert det_err < 2e-6
    spreads, worst = {}, 0.0
    for solver in (S.SRBA(period=6, **steps), S.SOBA(**steps)):
        finals = []
        for seed in range(seeds):
            x, report = S.run(
                solver, problem(q, 2, 1, seed=seed), ztree(Z0), (X0.clone(),), iterations=iters
            )
            assert not report.diverged
            finals.append(x[0])
            if solver.name == "srba":
                worst = max(worst, float((x[0] - xs).norm()))
                # 100 refreshes (3, 2) and 500 recursive iterations (6, 4)
                assert (report.inner_calls, report.outer_calls) == (3300, 2200)
                assert report.state.inner_draws == 500
        spreads[solver.name] = float((torch.stack(finals) - xs).pow(2).sum(1).mean().sqrt())
    assert worst < 10 * det_err, worst
    assert spreads["srba"] < 1e-4 * spreads["soba"], spreads


def test_srba_settings_are_validated_and_frozen() -> None:
    for bad in (
        {"step_inner": 0.0},
        {"step_outer": -1.0},
        {"step_outer": float("inf")},
        {"period": 0},
        {"period": 2.5},
        {"adjoint_radius": 0.0},
        {"adjoint_radius": float("nan")},
    ):
        with pytest.raises(hg.HypergradError):
            S.SRBA(**bad)
    s = S.SRBA()
    with pytest.raises(hg.FrozenSettingError):
        s.period = 3  # type: ignore[misc]
    assert s.replace(period=4).period == 4 and s.period == 10
    pb = problem(make_quad())
    with pytest.raises(hg.HypergradError, match="full"):  # the refresh needs the full batch
        s.step(
            start(s),
            S.Bilevel(pb.inner_loss, pb.outer_loss, pb.inner_sampler, lambda k: torch.arange(2)),
        )
    # the optional projection of v onto a ball
    r = S.SRBA(step_inner=0.5, step_outer=0.1, period=2, adjoint_radius=0.05)
    _, report = S.run(r, problem(make_quad(), 2, 1), ztree(Z0), (X0.clone(),), iterations=20)
    assert float(flat(report.state.v).norm()) <= 0.05 * (1 + 1e-12)


def test_choosing_page_example_runs() -> None:
    """docs/choosing.md's hyper-cleaning example on Fashion-MNIST (Debian's
    dataset-fashion-mnist): its own asserts check that both methods give the corrupted samples
    smaller weights and a lower test error than the unweighted model; no hypergrad warning."""
    if not Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").is_file():
        pytest.skip("Fashion-MNIST is not installed: apt-get install dataset-fashion-mnist")
    text = Path(ROOT / "docs" / "choosing.md").read_text(encoding="utf-8")
    blocks = text.split("```python\n")[1:]
    assert len(blocks) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", hg.HypergradWarning)
        exec(compile(blocks[0].split("```", 1)[0], "docs/choosing.md", "exec"), {})
