"""hg.stochastic's solvers against exact mean-square predictions on the quadratic family of
test_stochastic.py (same closed forms).

On that family every solver's iteration is an *affine recursion with random coefficients*: with
the carried variables ``w`` (and a constant 1 appended), one iteration is ``w̃_{k+1} = Ã_k w̃_k``
where ``Ã_k`` depends only on the batches drawn in iteration ``k``, independent of the past. So
the second moment ``Σ_k = E[w̃_k w̃_kᵀ]`` (which holds the mean too, in its last column) follows
the *deterministic* linear recursion ``vec Σ_{k+1} = E[Ã ⊗ Ã] vec Σ_k``, and every quantity
below, ``E||x_k − x*||²`` at each ``k``, the stationary mean and floor, the mean-square rate, is
computed exactly in float64 from the closed forms (``A_i, B_i, c_i, t_j``), by this file's
helper, which shares no code with the library. Batches are uniform with replacement
(``IndexSampler``), so a batch's map is the mean of ``bs`` independent per-sample maps and
``E[Ã_b ⊗ Ã_b] = Ā ⊗ Ā + E[δ_i ⊗ δ_i] / bs`` (``δ_i = Ã_i − Ā``; inner and outer fluctuations
are independent, so their terms add). Maps that share one outer batch over several steps
(AmIGO's and StocBiO's adjoint phase) are averaged over the outer batch after composing the
inner steps' expectations given it.

The tests then run the library and compare. To make many independent chains cheap, the
library runs ``R`` independent replicas of the problem in one state (``z`` of shape ``(R, 3)``,
``x`` of ``(R, 2)``, a loss that is the sum of the replicas' losses, each replica's batch its
own row of an ``IndexSampler`` draw): the replicas' gradients, products and updates separate
exactly, so each replica is one chain of the solver, independent of the others — they are the
"seeds". SABA's memory is one table per block drawn, shared by all replicas, so SABA runs one
chain per seed instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import product

import torch
from test_stochastic import MU, N_IN, N_OUT, X0, Z0, D, P, Quad, make_quad, problem, ztree

import hypergrad as hg

S = hg.stochastic
F64 = torch.float64
Map = Callable[..., torch.Tensor]  # batch coefficients -> augmented (n, n) map


# ---------------------------------------------------------------------------------------------
# the exact second-moment helper (closed forms only)


def _kron(a: torch.Tensor) -> torch.Tensor:
    return torch.kron(a, a)


def _fluct(d: torch.Tensor, bs: int) -> torch.Tensor:
    """``E[δ_b ⊗ δ_b]`` of a batch mean of ``bs`` draws with replacement of the rows ``d``."""
    n = d.shape[1]
    return torch.einsum("sij,skl->ikjl", d, d).reshape(n * n, n * n) / (bs * d.shape[0])


def inner_kron(q: Quad, f: Map, bs: int, **fixed: torch.Tensor) -> torch.Tensor:
    """``E[Ã ⊗ Ã]`` of a map ``f(A, B, c, **fixed)`` affine in one inner batch's means."""
    maps = torch.stack([f(q.A[i], q.B[i], q.c[i], **fixed) for i in range(N_IN)])
    mean = f(q.A.mean(0), q.B.mean(0), q.c.mean(0), **fixed)
    return _kron(mean) + _fluct(maps - mean, bs)


def outer_means(q: Quad, bs: int) -> list[torch.Tensor]:
    """Every ordered outer batch of ``bs`` draws (equally likely): its mean target."""
    return [q.t[list(j)].mean(0) for j in product(range(N_OUT), repeat=bs)]


def stationary(K: torch.Tensor) -> torch.Tensor:
    """The stationary augmented second moment: ``Σ = K Σ`` with ``Σ[-1, -1] = 1``."""
    n2 = K.shape[0]
    lhs = K - torch.eye(n2, dtype=F64)
    lhs[-1] = 0.0
    lhs[-1, -1] = 1.0
    rhs = torch.zeros(n2, dtype=F64)
    rhs[-1] = 1.0
    n = math.isqrt(n2)
    return torch.linalg.solve(lhs, rhs).reshape(n, n)


def x_mse(sigma: torch.Tensor, xs: torch.Tensor, at: slice) -> float:
    """``E||x − x*||²`` from an augmented second moment (``x`` at rows ``at``)."""
    return float(sigma[at, at].trace() - 2 * xs @ sigma[at, -1] + xs @ xs)


def trajectory(K: torch.Tensor, w0: torch.Tensor, xs: torch.Tensor, at: slice, k: int) -> list:
    """Exact ``E||x_j − x*||²`` for ``j = 0..k`` from the deterministic start ``w0``."""
    w = torch.cat([w0, torch.ones(1, dtype=F64)])
    sig, n = _kron(w[:, None]).reshape(-1), len(w)
    out = []
    for _ in range(k + 1):
        out.append(x_mse(sig.reshape(n, n), xs, at))
        sig = K @ sig
    return out


def mean_square_rate(K: torch.Tensor) -> float:
    """The second-largest modulus of ``K``'s eigenvalues (the largest, 1, is the constant's):
    ``E||w_k − w_∞||²``-type transients decay as its ``k``-th power."""
    ev = torch.linalg.eigvals(K).abs().sort(descending=True).values
    assert abs(float(ev[0]) - 1.0) < 1e-9
    return float(ev[1])


# SOBA: w = (z, v, x, 1)
Z, V, X, ONE = slice(0, D), slice(D, 2 * D), slice(2 * D, 2 * D + P), 2 * D + P


def soba_map(A, B, c, t, rho: float, gam: float) -> torch.Tensor:
    """One SOBA step at batch means (A, B, c, t): z −= ρ(Az − Bx − c), v −= ρ(Av + z − t),
    x −= γ(μx − Bᵀv), all directions at the old point."""
    M = torch.eye(2 * D + P + 1, dtype=F64)
    M[Z, Z] -= rho * A
    M[Z, X] += rho * B
    M[Z, ONE] += rho * c
    M[V, V] -= rho * A
    M[V, Z] -= rho * torch.eye(D, dtype=F64)
    M[V, ONE] += rho * t
    M[X, X] -= gam * MU * torch.eye(P, dtype=F64)
    M[X, V] += gam * B.T
    return M


def soba_kron(q: Quad, rho: float, gam: float, bs_in: int, bs_out: int) -> torch.Tensor:
    Ab, Bb, cb, tb = q.Abar, q.B.mean(0), q.c.mean(0), q.t.mean(0)
    mean = soba_map(Ab, Bb, cb, tb, rho, gam)
    d_in = torch.stack([soba_map(q.A[i], q.B[i], q.c[i], tb, rho, gam) for i in range(N_IN)])
    d_out = torch.stack([soba_map(Ab, Bb, cb, q.t[j], rho, gam) for j in range(N_OUT)])
    return _kron(mean) + _fluct(d_in - mean, bs_in) + _fluct(d_out - mean, bs_out)


def soba_floor_lyapunov(q: Quad, rho: float, gam: float, bs_in: int, bs_out: int):
    """The documented form (docs/stochastic.md, "The noise floor of constant steps"): with
    ``w_{k+1} = M_k w_k + r_k``, the stationary mean is the full-batch fixed point
    ``m = (I − M̄)⁻¹ r̄`` and the stationary covariance solves the Lyapunov-type equation
    ``C = M̄ C M̄ᵀ + E[ΔM C ΔMᵀ] + E[ξ ξᵀ]``, ``ΔM = M − M̄``, ``ξ = ΔM m + Δr``, whose
    fluctuation terms are ``1/bs`` times the per-sample ones. Returns ``(m, C)``."""
    n = 2 * D + P
    Ab, Bb, cb, tb = q.Abar, q.B.mean(0), q.c.mean(0), q.t.mean(0)
    mean = soba_map(Ab, Bb, cb, tb, rho, gam)
    Mb, rb = mean[:n, :n], mean[:n, n]
    m = torch.linalg.solve(torch.eye(n, dtype=F64) - Mb, rb)
    T = _kron(Mb)
    Q = torch.zeros(n, n, dtype=F64)
    for maps, bs in (
        ([soba_map(q.A[i], q.B[i], q.c[i], tb, rho, gam) for i in range(N_IN)], bs_in),
        ([soba_map(Ab, Bb, cb, q.t[j], rho, gam) for j in range(N_OUT)], bs_out),
    ):
        for a in maps:
            dM, dr = a[:n, :n] - Mb, a[:n, n] - rb
            xi = dM @ m + dr
            T = T + _kron(dM) / (bs * len(maps))
            Q = Q + torch.outer(xi, xi) / (bs * len(maps))
    C = torch.linalg.solve(torch.eye(n * n, dtype=F64) - T, Q.reshape(-1)).reshape(n, n)
    return m, C


def _sgd(A, B, c, alpha: float, n: int, z: slice, x: slice) -> torch.Tensor:
    M = torch.eye(n, dtype=F64)
    M[z, z] -= alpha * A
    M[z, x] += alpha * B
    M[z, n - 1] += alpha * c
    return M


def amigo_kron(q: Quad, s: S.AmIGO, bs_in: int, bs_out: int) -> torch.Tensor:
    """AmIGO on w = (z, v, x, 1): T SGD steps of z; one outer batch t; M adjoint steps
    v −= η(A_m v + z − t); x −= β(μx − B_0ᵀ v); a fresh inner batch for every step."""
    n = 2 * D + P + 1

    def adj(A, B, c, t):
        M = torch.eye(n, dtype=F64)
        M[V, V] -= s.step_adjoint * A
        M[V, Z] -= s.step_adjoint * torch.eye(D, dtype=F64)
        M[V, ONE] += s.step_adjoint * t
        return M

    def out(A, B, c):
        M = torch.eye(n, dtype=F64)
        M[X, X] -= s.step_outer * MU * torch.eye(P, dtype=F64)
        M[X, V] += s.step_outer * B.T
        return M

    sgd = inner_kron(q, lambda A, B, c: _sgd(A, B, c, s.step_inner, n, Z, X), bs_in)
    k_out = inner_kron(q, out, bs_in)
    ts = outer_means(q, bs_out)
    given_t = [
        k_out @ torch.linalg.matrix_power(inner_kron(q, adj, bs_in, t=t), s.adjoint_steps)
        for t in ts
    ]
    return (sum(given_t) / len(ts)) @ torch.linalg.matrix_power(sgd, s.inner_steps)


# StocBiO: w = (z, x, r, acc, 1); r and acc are the Neumann series' scratch, reset each step
SZ, SX, SR, SA = slice(0, D), slice(D, D + P), slice(D + P, 2 * D + P), slice(2 * D + P, 3 * D + P)
S_N = 3 * D + P + 1


def stocbio_kron(q: Quad, s: S.StocBiO, bs_in: int, bs_out: int) -> torch.Tensor:
    """StocBiO: T SGD steps of z; one outer batch t: r = acc = z − t; Q steps
    r −= η A_q r, acc += r; v = −η acc; x −= β(μx − B_0ᵀ v)."""
    n, eta = S_N, s.neumann_step

    def neumann(A, B, c):
        M = torch.eye(n, dtype=F64)
        M[SR, SR] -= eta * A
        M[SA] += M[SR]
        return M

    def out(A, B, c):
        M = torch.eye(n, dtype=F64)
        M[SX, SX] -= s.step_outer * MU * torch.eye(P, dtype=F64)
        M[SX, SA] -= s.step_outer * eta * B.T
        return M

    sgd = inner_kron(q, lambda A, B, c: _sgd(A, B, c, s.step_inner, n, SZ, SX), bs_in)
    chain = inner_kron(q, out, bs_in) @ torch.linalg.matrix_power(
        inner_kron(q, neumann, bs_in), s.neumann_steps
    )
    given_t = []
    for t in outer_means(q, bs_out):
        start = torch.eye(n, dtype=F64)
        start[SR] = 0.0
        start[SR, SZ] = torch.eye(D, dtype=F64)
        start[SR, n - 1] = -t
        start[SA] = start[SR]
        given_t.append(chain @ _kron(start))
    return (sum(given_t) / len(given_t)) @ torch.linalg.matrix_power(sgd, s.inner_steps)


# ---------------------------------------------------------------------------------------------
# the library on R independent replicas


def replicas(q: Quad, R: int, bs_in: int, bs_out: int, seed: int = 0) -> S.Bilevel:
    """R independent copies of the quadratic problem in one Bilevel: z (R, D), x (R, P); the
    k-th draw gives replica r the r-th row of IndexSampler(n, R·bs, seed)(k), i.i.d. uniform
    with replacement like IndexSampler(n, bs)."""
    si = S.IndexSampler(N_IN, R * bs_in, seed=seed)
    so = S.IndexSampler(N_OUT, R * bs_out, seed=seed + 1000)

    def inner(z, x, i):
        Az = torch.einsum("rbij,rj->rbi", q.A[i], z)
        rhs = torch.einsum("rbij,rj->rbi", q.B[i], x) + q.c[i]
        return (0.5 * (Az * z[:, None]).sum(2) - (rhs * z[:, None]).sum(2)).mean(1).sum()

    def outer(z, x, j):
        fit = 0.5 * ((z[:, None] - q.t[j]) ** 2).sum(2).mean(1)
        return (fit + 0.5 * MU * (x**2).sum(1)).sum()

    return S.Bilevel(
        inner,
        outer,
        lambda k: si(k).reshape(R, bs_in),
        lambda k: so(k).reshape(R, bs_out),
        heldout_inner=torch.arange(N_IN).repeat(R, 1),
        heldout_outer=torch.arange(N_OUT).repeat(R, 1),
    )


def run_replicas(solver, pb: S.Bilevel, R: int, iters: int) -> torch.Tensor:
    """The library's x at every iteration 1..iters: (iters, R, P)."""
    xs: list[torch.Tensor] = []
    _, report = S.run(
        solver,
        pb,
        Z0.repeat(R, 1),
        X0.repeat(R, 1),
        iterations=iters,
        callback=lambda st: xs.append(st.x[0].clone()) and None,
    )
    assert not report.diverged
    return torch.stack(xs)


def window_check(errs: torch.Tensor, exact: list, lo: int, hi: int) -> tuple[float, float, float]:
    """Per-replica means of ||x_k − x*||² over k in [lo, hi) (independent across replicas), their
    mean and standard error, and the exact expected value of that mean."""
    per = errs[lo - 1 : hi - 1].mean(0)  # errs[k - 1] is iteration k
    emp, se = float(per.mean()), float(per.std() / math.sqrt(len(per)))
    return emp, se, sum(exact[lo:hi]) / (hi - lo)


# ---------------------------------------------------------------------------------------------
# item 2: SOBA's noise floor in closed form


def test_soba_noise_floor_matches_the_exact_stationary_second_moment() -> None:
    """SOBA with constant ρ = 0.3, γ = 0.1, inner batches of 4, outer of 2. Exact (helper):
    the stationary mean of (z, v, x) is the full-batch fixed point (z*, v*, x*) (asserted against
    the closed forms), the floor E||x − x*||² = tr C_xx of the stationary covariance C of the
    Lyapunov-type equation (docs/stochastic.md) is 1.583, equal to the augmented second moment's
    fixed point; the mean-square rate is 0.983 per iteration, so after a burn-in of 300
    iterations the expected error is within 1% of the floor (asserted from the exact
    trajectory). The library's 128 replicas over iterations 300..1000: their mean of
    ||x_k − x*||² must match the exact expected mean over the same window within 4 standard
    errors (the SE of the 128 independent per-replica means), the SE itself must be under 10%
    of the floor (so the test resolves the floor to ±40%), and the replicas' mean x must equal
    x* within 4 SE per coordinate."""
    q = make_quad()
    xs = q.xstar()
    rho, gam, bs_in, bs_out, R, burn, iters = 0.3, 0.1, 4, 2, 128, 300, 1000
    m, C = soba_floor_lyapunov(q, rho, gam, bs_in, bs_out)
    assert torch.allclose(m, torch.cat([q.zstar(xs), q.vstar(xs), xs]), atol=1e-10, rtol=0)
    floor = float(C[X, X].trace())
    K = soba_kron(q, rho, gam, bs_in, bs_out)
    assert abs(x_mse(stationary(K), xs, X) - floor) < 1e-9 * floor
    rate = mean_square_rate(K)
    assert rate < 1.0
    exact = trajectory(K, torch.cat([Z0, torch.zeros(D, dtype=F64), X0]), xs, X, iters)
    assert all(abs(e - floor) < 0.01 * floor for e in exact[burn:])
    solver = S.SOBA(step_inner=rho, step_outer=gam)
    x = run_replicas(solver, replicas(q, R, bs_in, bs_out), R, iters)
    emp, se, expected = window_check((x - xs).pow(2).sum(2), exact, burn, iters + 1)
    assert se < 0.1 * floor, (se, floor)
    assert abs(emp - expected) < 4 * se, (emp, expected, se, floor)
    per_replica = x[burn - 1 :].mean(0)  # the stationary mean is x*, the full-batch fixed point
    mean_se = per_replica.std(0) / math.sqrt(R)
    assert ((per_replica.mean(0) - xs).abs() < 4 * mean_se).all(), (per_replica.mean(0), xs)


# ---------------------------------------------------------------------------------------------
# item 1: convergence of AmIGO, StocBiO (to their floors) and SABA (to x*, linearly)


def _floor_test(
    solver,
    kron: torch.Tensor,
    at: slice,
    w0: torch.Tensor,
    bs: tuple[int, int],
    burn: int,
    iters: int,
    R: int = 64,
) -> tuple[float, float, float, float]:
    """The shared check of a solver with an O(step) floor: the exact expected error reaches
    the stationary one to 5% by ``burn`` (a consequence of the exact mean-square rate, asserted),
    and the library's replicas' mean error over ``[burn, iters]`` matches the exact expected
    mean over that window within 4 standard errors (SE under 10% of the floor)."""
    q = make_quad()
    xs = q.xstar()
    floor = x_mse(stationary(kron), xs, at)
    exact = trajectory(kron, w0, xs, at, iters)
    assert all(abs(e - floor) < 0.05 * floor for e in exact[burn:])
    x = run_replicas(solver, replicas(q, R, *bs), R, iters)
    emp, se, expected = window_check((x - xs).pow(2).sum(2), exact, burn, iters + 1)
    assert se < 0.1 * floor, (se, floor)
    assert abs(emp - expected) < 4 * se, (emp, expected, se, floor)
    return floor, expected, emp, se


def test_amigo_converges_to_its_o_step_floor_at_the_exact_rate() -> None:
    """AmIGO, constant steps α = η = 0.5, T = M = 2, β = 0.2; inner batches of 8, outer of 2.
    Arbel and Mairal (Theorem 1) prove, for constant steps under strong convexity, linear
    convergence to an O(β) neighbourhood of x* (the warm starts make the adjoint's error
    contract). On the quadratic that statement is exact: the iteration's mean follows the
    full-batch one, whose fixed point is (z*, v*, x*) (asserted: the stationary mean equals x*
    to 1e-10, no bias), the transient decays at the mean-square rate ρ_ms (the second eigenvalue
    of E[Ã⊗Ã], 0.969 here: 300 iterations bring it within 5% of the floor), and the
    neighbourhood is the stationary E||x − x*||² = 1.78 (a floor proportional to β: halving β
    must bring it to 0.35-0.65 of itself, the O(β) of the theorem to first order). The run's
    tolerance is that exact value ± 4 SE over 64 independent replicas."""
    q = make_quad()
    xs = q.xstar()
    s = S.AmIGO(step_inner=0.5, inner_steps=2, step_adjoint=0.5, adjoint_steps=2, step_outer=0.2)
    K = amigo_kron(q, s, 8, 2)
    assert torch.allclose(stationary(K)[X, -1], xs, atol=1e-10, rtol=0)
    assert mean_square_rate(K) < 1.0
    half = x_mse(stationary(amigo_kron(q, s.replace(step_outer=0.1), 8, 2)), xs, X)
    assert 0.35 < half / x_mse(stationary(K), xs, X) < 0.65
    w0 = torch.cat([Z0, torch.zeros(D, dtype=F64), X0])
    floor, _, emp, _ = _floor_test(s, K, X, w0, (8, 2), burn=300, iters=600)
    assert floor < 0.1 * float((X0 - xs).norm() ** 2)  # a neighbourhood, far below the start


def stocbio_x_q(q: Quad, eta: float, Q: int) -> torch.Tensor:
    """Full-batch StocBiO's fixed point: v = −N(z*(x) − t̄), N = η Σ_{q≤Q} (I − ηĀ)^q, and
    μx − B̄ᵀv = 0, i.e. (μI + B̄ᵀNĀ⁻¹B̄) x = −B̄ᵀN(Ā⁻¹c̄ − t̄)."""
    Ab, Bb, cb, tb = q.Abar, q.B.mean(0), q.c.mean(0), q.t.mean(0)
    step = torch.eye(D, dtype=F64) - eta * Ab
    N = eta * sum(torch.linalg.matrix_power(step, k) for k in range(Q + 1))
    lhs = MU * torch.eye(P, dtype=F64) + Bb.T @ N @ torch.linalg.solve(Ab, Bb)
    return torch.linalg.solve(lhs, -Bb.T @ N @ (torch.linalg.solve(Ab, cb) - tb))


def test_stocbio_converges_to_its_floor_around_the_truncated_series_point() -> None:
    """StocBiO, constant α = η = 0.5, T = 2, Q = 10, β = 0.2; inner batches of 8, outer of 2.
    Ji, Yang and Liang (Theorem 3, constant steps) bound the error by a transient, a bias of
    the truncated Neumann series ((1 − ημ_G)^Q) and variance terms in 1/batch. Exactly here: the
    products of independent batch Hessians average to (I − ηĀ)^q, so the mean follows the
    full-batch iteration, whose fixed point x_Q (closed form: stocbio_x_q) is the helper's
    stationary mean to 1e-10, biased from x* by the series' remainder, which decays like
    ||(I − ηĀ)^{Q+1}|| (asserted: the bias is nonzero, below 0.2 ||x*||, and shrinks at least
    tenfold from Q = 10 to Q = 20, where that factor shrinks 11-fold); the floor is
    E||x − x*||² = ||x_Q − x*||² + tr Cov = 2.02, reached to 5% by iteration 300 (ρ_ms 0.970),
    and the library's replicas must match the exact expected error over iterations 300..600
    within 4 SE."""
    q = make_quad()
    xs = q.xstar()
    s = S.StocBiO(step_inner=0.5, inner_steps=2, neumann_step=0.5, neumann_steps=10, step_outer=0.2)
    K = stocbio_kron(q, s, 8, 2)
    xq = stocbio_x_q(q, 0.5, 10)
    assert torch.allclose(stationary(K)[SX, -1], xq, atol=1e-10, rtol=0)
    bias = float((xq - xs).norm())
    assert 0 < bias < 0.2 * float(xs.norm())
    assert float((stocbio_x_q(q, 0.5, 20) - xs).norm()) < 0.1 * bias
    assert mean_square_rate(K) < 1.0
    w0 = torch.cat([Z0, X0, torch.zeros(2 * D, dtype=F64)])
    floor, _, _, _ = _floor_test(s, K, SX, w0, (8, 2), burn=300, iters=600)
    assert bias**2 < floor < 0.1 * float((X0 - xs).norm() ** 2)


class Blocks:
    """A block sampler (what SABA needs: ``num_blocks``, ``block(k)``): the fixed partition
    ``[0, s), [s, 2s), ...`` and a block drawn uniformly at each counter, from a generator
    seeded by ``(seed, k)``."""

    def __init__(self, n: int, size: int, seed: int):
        self.n, self.size, self.seed = n, size, seed
        self.num_blocks = n // size

    def block(self, k: int) -> tuple[int, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        b = int(torch.randint(self.num_blocks, (1,), generator=g))
        return b, torch.arange(b * self.size, (b + 1) * self.size)

    def __call__(self, k: int) -> torch.Tensor:
        return self.block(k)[1]

    def heldout(self) -> torch.Tensor:
        return torch.arange(self.n)


def saba_maps(q: Quad, size_in: int, size_out: int, rho: float, gam: float):
    """SABA's step for every pair of blocks (equally likely), as augmented maps on
    w = (z, v, x, the five SAGA tables, 1): each of ∇_zG, ∇²_zzG v, ∇²_xzG v (per inner block)
    and ∇_zF, ∇_xF (per outer block) is estimated by new − table[b] + mean(table), then the
    tables' rows b take the new values (computed at the old iterate); tables start at zero.
    Returns the maps and the slices of the layout."""
    nbi, nbo = N_IN // size_in, N_OUT // size_out
    width = {"gz": D, "hv": D, "cr": P, "fz": D, "fx": P}
    count = {"gz": nbi, "hv": nbi, "cr": nbi, "fz": nbo, "fx": nbo}
    at, o = {}, 0
    for name, n in (("z", D), ("v", D), ("x", P), *((k, width[k] * count[k]) for k in width)):
        at[name], o = slice(o, o + n), o + n
    E = torch.eye(o + 1, dtype=F64)
    z, v, x, one = E[at["z"]], E[at["v"]], E[at["x"]], E[o]

    def row(k: str, b: int) -> slice:
        return slice(at[k].start + b * width[k], at[k].start + (b + 1) * width[k])

    maps = []
    for b, c in product(range(nbi), range(nbo)):
        bi, cj = slice(b * size_in, (b + 1) * size_in), slice(c * size_out, (c + 1) * size_out)
        A, B, cc, t = q.A[bi].mean(0), q.B[bi].mean(0), q.c[bi].mean(0), q.t[cj].mean(0)
        new = {
            "gz": A @ z - B @ x - cc[:, None] * one,
            "hv": A @ v,
            "cr": -B.T @ v,
            "fz": z - t[:, None] * one,
            "fx": MU * x,
        }
        blk = {"gz": b, "hv": b, "cr": b, "fz": c, "fx": c}
        est = {
            k: new[k] - E[row(k, blk[k])] + sum(E[row(k, j)] for j in range(count[k])) / count[k]
            for k in new
        }
        M = E.clone()
        M[at["z"]] = z - rho * est["gz"]
        M[at["v"]] = v - rho * (est["hv"] + est["fz"])
        M[at["x"]] = x - gam * (est["cr"] + est["fx"])
        for k in new:
            M[row(k, blk[k])] = new[k]
        maps.append(M)
    return torch.stack(maps), at


def test_saba_converges_linearly_to_x_star_at_the_exact_mean_square_rate() -> None:
    """SABA, constant ρ = 0.3, γ = 0.1, inner blocks of 2 (3 blocks), outer blocks of 1 (5).
    Dagréou et al. 2022 (Theorem 3) prove linear convergence with constant steps under strong
    convexity / PL: on a finite sum SAGA's estimator has no noise floor. Exactly here: the point
    w* = (z*, v*, x*, every table at its value at (z*, v*, x*)) is a fixed point of *every*
    block pair's map (asserted), so the error e = w − w* follows e_{k+1} = L_k e_k and
    E[e eᵀ] the linear recursion Σ ← mean_b L_b Σ L_bᵀ, iterated exactly from the start. Its
    decay per iteration (the mean-square rate, measured over the last 100 exact iterations) is
    below 1: linear convergence to x* itself. k is the first iteration where the exact
    E||x_k − x*||² is 1e-10 of ||x_0 − x*||², and the tolerance is Markov's inequality on the
    mean of the 3 seeds' squared errors: above E_k / 1e-3 with probability ≤ 1e-3 — set before
    any run. (SOBA's floor at the same steps and batches is 5.7 by the exact formula, 1e9 times
    the tolerance.)"""
    q = make_quad()
    xs = q.xstar()
    rho, gam = 0.3, 0.1
    maps, at = saba_maps(q, 2, 1, rho, gam)
    zs, vs = q.zstar(xs), q.vstar(xs)
    w_star = torch.zeros(maps.shape[1], dtype=F64)
    w_star[at["z"]], w_star[at["v"]], w_star[at["x"]], w_star[-1] = zs, vs, xs, 1.0
    for b in range(3):  # the tables at the optimum
        A, B, c = (m[2 * b : 2 * b + 2].mean(0) for m in (q.A, q.B, q.c))
        w_star[at["gz"]][3 * b : 3 * b + 3] = A @ zs - B @ xs - c
        w_star[at["hv"]][3 * b : 3 * b + 3] = A @ vs
        w_star[at["cr"]][2 * b : 2 * b + 2] = -B.T @ vs
    for j in range(5):
        w_star[at["fz"]][3 * j : 3 * j + 3] = zs - q.t[j]
        w_star[at["fx"]][2 * j : 2 * j + 2] = MU * xs
    assert float((maps @ w_star - w_star).abs().max()) < 1e-12
    L = maps[:, :-1, :-1]
    e0 = -w_star[:-1].clone()  # the start: tables at zero, v at zero, (z0, x0)
    e0[at["z"]] += Z0
    e0[at["x"]] += X0
    sig = torch.outer(e0, e0)
    exact = [float(sig[at["x"], at["x"]].trace())]
    while exact[-1] > 1e-10 * exact[0]:
        sig = (L @ sig @ L.transpose(1, 2)).mean(0)
        exact.append(float(sig[at["x"], at["x"]].trace()))
        assert len(exact) < 3000
    k = len(exact) - 1
    rate = (exact[-1] / exact[-101]) ** (1 / 100)
    assert rate < 0.99, rate
    soba_floor = float(soba_floor_lyapunov(q, rho, gam, 2, 1)[1][X, X].trace())
    tol = exact[-1] / 1e-3
    assert tol < 1e-6 * soba_floor
    errs = []
    for seed in range(3):
        losses = problem(q)
        pb = S.Bilevel(
            losses.inner_loss, losses.outer_loss, Blocks(N_IN, 2, seed), Blocks(N_OUT, 1, seed + 7)
        )
        x, report = S.run(
            S.SABA(step_inner=rho, step_outer=gam), pb, ztree(Z0), (X0.clone(),), iterations=k
        )
        assert not report.diverged
        errs.append(float((x[0] - xs).pow(2).sum()))
    assert sum(errs) / len(errs) <= tol, (errs, exact[-1], tol)
