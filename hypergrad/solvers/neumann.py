"""Truncated Neumann series ``x = alpha * sum_{k=0}^{K} (I - alpha A)^k b`` for SPD systems."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..errors import HypergradValueError, SolverStalledWarning
from ..settings import count, flag, number
from ..tree import Tensors, tree_add, tree_axpy, tree_norm, tree_scale, tree_zeros_like
from .arguments import symmetric_hint
from .base import (
    MatVec,
    SolveInfo,
    Solver,
    as_float,
    check_product,
    damped,
    emit,
    functional_form,
    report_failure,
    warn_diverged,
)
from .functional import IterativeKernel, Op, Stats, axpy, dot, select
from .krylov import recomputed_residual, start

#: Relative growth of a term over the smallest earlier term that counts as divergence. For SPD
#: ``A`` and ``0 < alpha <= 2 / lambda_max`` the term norms never increase, so any growth beyond
#: rounding means ``alpha`` is too large or ``A`` is indefinite: the series diverges eventually.
GROWTH_TOL = 1e-6


def growth_tol(dtype: torch.dtype) -> float:
    """The growth tolerance in ``dtype``: :data:`GROWTH_TOL`, or 100 rounding units if larger.

    A term larger than ``1 + growth_tol(dtype)`` times the smallest earlier one means divergence;
    a ratio of term norms at or above ``1 - growth_tol(dtype)`` means the series stalled.
    """
    return max(GROWTH_TOL, 100 * torch.finfo(dtype).eps)


def stall_floor(dtype: torch.dtype) -> float:
    """Residual bound below which terms that stopped shrinking are rounding, not a stall."""
    root: float = torch.finfo(dtype).eps ** 0.5
    return root


def power_iteration(
    matvec: MatVec, like: Tensors, iters: int = 20, solver: str = "power_iteration"
) -> tuple[float, int]:
    """Estimate the largest-magnitude eigenvalue of a symmetric operator.

    The start vector comes from a private generator (seed 0), so the global RNG stream of the
    caller is not consumed. Returns ``(eigenvalue estimate, products spent)``; an exactly zero
    product stops early with the estimate 0.

    Raises:
        HypergradValueError: a product returned NaN/Inf (``solver`` names the caller in the
            message, with the power iteration that produced it).

    Example:
        >>> A = torch.diag(torch.tensor([1.0, 5.0], dtype=torch.float64))
        >>> like = (torch.zeros(2, dtype=torch.float64),)
        >>> round(power_iteration(lambda v: (A @ v[0],), like)[0], 6)
        5.0
    """
    gen = torch.Generator().manual_seed(0)
    v = tuple(torch.randn(a.shape, generator=gen, dtype=torch.float64).to(a) for a in like)
    v = tree_scale(1.0 / as_float(tree_norm(v)), v)
    lam = 0.0
    for i in range(iters):
        av = matvec(v)
        nrm = as_float(tree_norm(av))
        if not math.isfinite(nrm):
            check_product(solver, f"power iteration {i + 1} of {iters}", v, av)
            return nrm, i + 1
        if nrm == 0.0:
            return 0.0, i + 1
        lam = as_float(sum(torch.sum(a.double() * b.double()) for a, b in zip(v, av)))
        v = tree_scale(1.0 / nrm, av)
    return lam, iters


def growth_hint(estimated: bool, symmetric: bool | None = True) -> str:
    """Advice for a Neumann series that grew, fitted to how alpha was chosen and to what is known
    of the operator's symmetry (fixed text: one of six).

    Args:
        estimated: alpha came from the power iteration (``alpha=None``) rather than the caller.
        symmetric: True for a symmetric operator (a Hessian: ``alpha=None`` and MINRES are
            remedies), False for one not known to be symmetric (the Jacobian of a root or
            fixed-point condition, where both are refused: a smaller explicit alpha, GMRES or
            BiCGStab are the remedies), None when nothing is known (both kinds are named). The
            caller says which through its matvec's ``symmetric`` attribute
            (:mod:`hypergrad.solvers.arguments`).
    """
    if estimated:
        if symmetric is False:
            return (
                "A Neumann term grew although alpha = 1/lambda_max came from the power iteration, "
                "which assumes a symmetric operator, and this one is not known to be symmetric: "
                "pass a smaller explicit alpha (the series needs every eigenvalue of "
                "I - alpha A inside the unit circle), add damping, or use GMRES or BiCGStab."
            )
        if symmetric is None:
            return (
                "A Neumann term grew although alpha = 1/lambda_max came from the power iteration: "
                "the operator is indefinite, not symmetric (the power iteration assumes it is), "
                "or the estimate was too low; add damping or raise power_iters, pass a smaller "
                "explicit alpha, or use MINRES (symmetric operators) or GMRES/BiCGStab (any)."
            )
        return (
            "A Neumann term grew although alpha = 1/lambda_max came from the power iteration: the "
            "operator is indefinite (a non-convex inner problem, e.g. away from a minimum) or the "
            "estimate was too low; use MINRES, add damping, or raise power_iters."
        )
    if symmetric is False:
        return (
            "A Neumann term grew: the given alpha is too large for this operator (the series "
            "needs every eigenvalue of I - alpha A inside the unit circle) or no alpha makes it "
            "contract; lower alpha, add damping, or use GMRES or BiCGStab (the operator is not "
            "known to be symmetric, so alpha=None and MINRES do not apply)."
        )
    if symmetric is None:
        return (
            "A Neumann term grew: the given alpha is too large for this operator (the series "
            "needs every eigenvalue of I - alpha A inside the unit circle) or no alpha makes it "
            "contract; lower alpha, add damping, or use GMRES or BiCGStab (any operator); for a "
            "symmetric one, alpha=None estimates alpha and MINRES handles indefinite ones."
        )
    return (
        "A Neumann term grew: the given alpha is too large for this operator (it needs "
        "alpha < 2 / lambda_max) or the operator is indefinite; lower alpha, pass alpha=None to "
        "estimate it, add damping, or use MINRES."
    )


def stall_hint(symmetric: bool | None = True) -> str:
    """The stalled-series warning, its remedies fitted to the operator (see :func:`growth_hint`)."""
    if symmetric is False:
        remedy = "add damping, raise alpha, or use GMRES (which reports singular systems)."
    elif symmetric is None:
        remedy = (
            "add damping, raise alpha, or use GMRES (any operator) or MINRES (symmetric ones), "
            "which report singular systems."
        )
    else:
        remedy = "add damping, raise alpha, or use MINRES (which reports singular systems)."
    return (
        "neumann: the series terms stopped shrinking (the last ratio ||v_k|| / "
        "||v_k-1|| is SolveInfo.extras['contraction']): I - alpha H does not contract what "
        "is left of b, so the partial sums grow with every step instead of converging and "
        "x is not a hypergradient. The Hessian is zero or singular in that direction, or "
        f"alpha is far too small; {remedy}"
    )


@dataclass(kw_only=True)
class Neumann(Solver):
    """Truncated Neumann series: cheap, no inner products, but kappa-proportional iterations.

    Terms that stop shrinking (zero or singular Hessian, alpha far too small) are reported in
    ``info.extras["stalled"]`` with a :class:`~hypergrad.SolverStalledWarning` (below).

    With ``v_0 = b`` and ``v_k = (I - alpha A) v_{k-1}``, returns
    ``x = alpha * sum_{k=0}^{K} v_k`` after ``K = maxiter`` products, which equals
    ``A^{-1} (I - (I - alpha A)^{K+1}) b`` in closed form. It converges when
    ``0 < alpha < 2 / lambda_max`` and ``A`` is SPD, at a rate set by
    ``1 - alpha * lambda_min``: iterations grow like the condition number.

    Diagnostics: ``residual`` is ``||v_K|| / ||b||``, an upper bound on the true relative
    residual ``||v_{K+1}|| / ||b||`` whenever the series converges; ``exact_residual=True``
    spends one more product to report the residual recomputed from ``x``, and so does a run
    whose bound met ``tol`` (``converged`` is only set when the recomputed residual meets
    ``tol``).

    * A term whose norm exceeds the smallest earlier term norm (beyond rounding) sets
      ``diverged`` (alpha too large or ``A`` indefinite: the series diverges, even if slowly),
      stops, and warns (:class:`~hypergrad.SolverDivergedWarning`).
    * A last ratio ``||v_K|| / ||v_{K-1}|| >= 1 - 1e-6`` (the tolerance of the growth test:
      ``max(1e-6, 100 eps)`` of the dtype) with the residual bound above ``tol`` and above
      ``sqrt(eps)`` (below it the terms are rounding noise that a consistent singular system
      leaves in the null space, and the partial sums grow by less than ``alpha K sqrt(eps)
      ||b||``) means the terms stopped shrinking: the ratios never decrease along the series,
      so what is left of ``b`` lies where ``alpha A`` is (numerically) zero and the partial
      sums grow linearly instead of converging (a zero Hessian gives ``x = alpha (K+1) b``).
      This sets ``extras["stalled"]`` and warns (:class:`~hypergrad.SolverStalledWarning`);
      ``x`` is still the truncated series. ``extras["contraction"]`` holds that last ratio.
    * A Hessian-vector product that returns NaN/Inf raises, naming the step.

    The warnings' advice depends on what the caller knows of the operator, told by
    ``matvec.symmetric`` (:mod:`~hypergrad.solvers.arguments`): True (a Hessian) suggests
    ``alpha=None`` and MINRES; False (e.g. the Jacobian of a root or fixed-point condition,
    where both are refused) a smaller explicit ``alpha``, GMRES or BiCGStab; None or absent
    names both kinds.

    ``maxiter=0`` is allowed and returns the first term ``alpha * b`` (a scaled gradient, the
    crudest approximation), with no product and nothing verified.

    Args:
        maxiter: number of Hessian-vector products K (the series has K + 1 terms); 0 returns the
            first term ``alpha * b`` only.
        alpha: step size, finite and > 0 (must be < 2 / lambda_max); None estimates
            ``1 / lambda_max`` by power iteration (``power_iters`` extra products per solve).
        tol: optional early stop when the residual bound ``||v_k|| / ||b||`` reaches it;
            convergence is then verified with one recomputed residual. None (the default) runs
            all ``maxiter`` products and never claims ``converged``: the series is a fixed-budget
            approximation by design. Unlike CG and MINRES, whose steps are built from inner
            products of the residual (so a residual and its tolerance come with the method), the
            series needs no inner products, and nothing in it depends on a tolerance.
        damping: added to the diagonal.
        power_iters: power iterations for ``alpha=None``.
        exact_residual: spend one product more to report the exact residual.

    Example:
        >>> A = torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64))
        >>> x, info = Neumann(maxiter=100).solve(lambda v: (A @ v[0],),
        ...                                      (torch.ones(2, dtype=torch.float64),))
        >>> round(info.alpha, 4), [round(float(t), 4) for t in x[0]]
        (0.25, [1.0, 0.25])
    """

    name = "neumann"
    display = "Neumann"

    def assumes_symmetric(self) -> str | None:
        """``alpha=None`` estimates the step by a symmetric power iteration: it assumes a
        symmetric operator; an explicit ``alpha`` only needs ``I − alpha A`` to contract."""
        return "Neumann(alpha=None)" if self.alpha is None else None

    maxiter: int = count(10, allow_none=False)
    alpha: float | None = number(None, strict=True, allow_none=True)
    tol: float | None = number(None, allow_none=True)
    damping: float = number(0.0)
    power_iters: int = count(20, allow_none=False)
    exact_residual: bool = flag(False)

    def check(self) -> None:
        if self.alpha is None and self.power_iters < 1:
            raise HypergradValueError("Neumann power_iters must be >= 1 when alpha is None")

    def solve(
        self, matvec: MatVec, b: Tensors, x0: Tensors | None = None
    ) -> tuple[Tensors, SolveInfo]:
        """Approximate ``(A + damping I)^{-1} b`` by the truncated Neumann series (the series,
        its diagnostics and warnings are the class docstring's).

        Returns:
            ``(x, info)``.

        Raises:
            HypergradValueError: a product returned NaN/Inf, or ``alpha=None`` on an operator whose
                estimated largest eigenvalue is not positive (zero included).
        """
        op = damped(matvec, self.damping)
        symmetric = symmetric_hint(matvec)  # what the caller knows: only the advice depends on it
        info = SolveInfo(solver=self.name)
        alpha, tol = self.alpha, self.tol
        started = start(op, b, x0, info, self.display)
        if started is None:
            return tree_zeros_like(b), info
        x_start, v, b_norm = started
        if x0 is not None and tol is not None and info.residual <= tol:  # verified by start
            info.converged = True
            info.extras.update(residual_verified=True, residual_is_bound=False)
            return x_start, info
        estimated = alpha is None
        if alpha is None:
            alpha = self._estimated_alpha(op, b, info, symmetric)
        info.alpha = float(alpha)
        acc, ratio = self._series(op, v, b_norm, alpha, info, estimated, symmetric)
        x = tree_scale(alpha, acc)
        if x0 is not None:
            x = tree_add(x0, x)
        self._report(op, b, x, b_norm, ratio, info, symmetric)
        return x, info

    def _estimated_alpha(
        self, op: MatVec, b: Tensors, info: SolveInfo, symmetric: bool | None
    ) -> float:
        """``alpha=None``: ``1 / lambda_max`` by power iteration, refused unless positive."""
        lam, spent = power_iteration(op, b, self.power_iters, solver=f"{self.display} (alpha=None)")
        info.matvecs += spent
        info.extras["lambda_max"] = lam
        if lam == 0.0:
            raise HypergradValueError(
                "Neumann: the Hessian-vector product is exactly zero (estimated largest "
                "eigenvalue 0): the inner loss has no curvature in the parameters, so there is "
                "no step size and no solution; add damping or check the inner loss"
            )
        if not lam > 0.0 or not math.isfinite(lam):
            remedy = {
                True: "use MINRES or add damping",
                False: "add damping, or use GMRES or BiCGStab (the operator is not known to "
                "be symmetric)",
                None: "add damping, or use MINRES (symmetric operators) or GMRES (any)",
            }[symmetric]
            raise HypergradValueError(
                f"Neumann: estimated largest eigenvalue is {lam:.3g} (not positive): the "
                f"operator is not positive definite; {remedy}"
            )
        return 1.0 / lam

    def _series(
        self,
        op: MatVec,
        v: Tensors,
        b_norm: float,
        alpha: float,
        info: SolveInfo,
        estimated: bool,
        symmetric: bool | None,
    ) -> tuple[Tensors, float | None]:
        """Sum the terms from ``v = v_0`` until ``maxiter``, ``tol`` or growth: the sum and the
        last ratio ``||v_K|| / ||v_{K-1}||`` (None without a product)."""
        tol = self.tol
        norm_min = info.residual * b_norm
        acc = v
        limit = 1.0 + growth_tol(v[0].dtype)
        prev_norm, ratio = norm_min, None
        for _ in range(self.maxiter):
            if tol is not None and info.residual <= tol:
                break
            av = op(v)
            info.matvecs += 1
            info.iterations += 1
            v_next = tree_axpy(-alpha, av, v)
            norm = as_float(tree_norm(v_next))
            if not math.isfinite(norm):
                check_product(self.display, f"iteration {info.iterations}", v, av)
            if not math.isfinite(norm) or norm > limit * norm_min:
                growth = norm / norm_min if norm_min > 0 else math.inf
                info.diverged = True
                info.residual = norm / b_norm
                info.extras["growth"] = growth
                warn_diverged(info, growth_hint(estimated, symmetric))
                break
            v = v_next
            ratio = norm / prev_norm if prev_norm > 0 else 0.0
            prev_norm = norm
            acc = tree_add(acc, v)
            norm_min = min(norm_min, norm)
            info.residual = norm / b_norm
            info.residuals.append(info.residual)
        return acc, ratio

    def _report(
        self,
        op: MatVec,
        b: Tensors,
        x: Tensors,
        b_norm: float,
        ratio: float | None,
        info: SolveInfo,
        symmetric: bool | None,
    ) -> None:
        """The stall test, the verified residual (``exact_residual`` or a bound that met
        ``tol``), ``converged``, and the warnings."""
        tol = self.tol
        gtol = growth_tol(b[0].dtype)
        info.extras["contraction"] = ratio
        # ||v_k|| / ||v_{k-1}|| never decreases along the series (||M^k b||^2 is log-convex in k for
        # symmetric M = I - alpha A), so a last ratio within rounding of 1 means the terms have
        # stopped shrinking for good: the partial sums grow instead of converging
        stalled = (
            not info.diverged
            and ratio is not None
            and ratio >= 1.0 - gtol
            and info.residual > max(tol or 0.0, stall_floor(b[0].dtype))
        )
        info.extras["stalled"] = stalled
        claimed = tol is not None and info.residual <= tol and not info.diverged
        verified = False
        if (self.exact_residual or claimed) and not info.diverged:
            _, info.residual = recomputed_residual(
                op, b, x, b_norm, info, self.display, "the residual check"
            )
            verified = True
        info.extras["residual_is_bound"] = not verified
        info.extras["residual_verified"] = verified
        info.converged = claimed and info.residual <= tol  # type: ignore[operator]
        if stalled:
            emit(info, stall_hint(symmetric), SolverStalledWarning)
        report_failure(info, symmetric=symmetric)

    def kernel(self) -> NeumannKernel:
        """:meth:`solve`'s series as a masked kernel (:class:`NeumannKernel`), for
        :func:`~hypergrad.compile_implicit_grad`.

        Raises:
            HypergradValueError: ``alpha=None`` (the kernel has no power iteration).
        """
        if self.alpha is None:
            raise HypergradValueError(
                "compile_implicit_grad needs Neumann's alpha (no power iteration in the compiled "
                "path): pass Neumann(alpha=...), e.g. 1 / info.solve.extras['lambda_max'] of an "
                "eager implicit_grad call with alpha=None"
            )
        return NeumannKernel(self)


@functional_form(Neumann)
def solve_neumann(
    matvec: MatVec, b: Tensors, x0: Tensors | None = None, **settings: Any
) -> tuple[Tensors, SolveInfo]:
    """``Neumann(**settings).solve(matvec, b, x0)``: the truncated Neumann series as a function
    (the settings are :class:`Neumann`'s, keyword-only and validated the same way).

    Example:
        >>> A = torch.diag(torch.tensor([1.0, 2.0], dtype=torch.float64))
        >>> x, info = solve_neumann(lambda v: (A @ v[0],), (torch.ones(2, dtype=torch.float64),),
        ...                         maxiter=60, alpha=0.5)
        >>> x[0]
        tensor([1.0000, 0.5000], dtype=torch.float64)
    """
    return Neumann(**settings).solve(matvec, b, x0)


class NeumannState(NamedTuple):
    """What the Neumann kernel carries from one step to the next."""

    acc: Tensors  # the sum of the terms so far
    v: Tensors  # the last term
    norm_min: torch.Tensor  # the smallest term norm so far (the growth test's reference)
    stop: torch.Tensor  # tol ||b||, or -||r0|| without tol (never stops early)
    done: torch.Tensor  # bool: no further iteration runs
    grew: torch.Tensor  # bool: a term grew (divergence)
    last: torch.Tensor  # the last term's norm
    ratio: torch.Tensor  # its ratio to the one before, -1 before the first step (the stall test)
    iterations: torch.Tensor


class NeumannKernel(IterativeKernel[Neumann, NeumannState]):
    """:meth:`Neumann.solve` with a given ``alpha``, masked
    (:mod:`~hypergrad.solvers.functional`): the same growth and stall tests on tensors."""

    vectors = ("acc", "v")
    fields = ("last_term", "ratio")

    def init(self, b: Tensors, r: Tensors, x0: Tensors) -> NeumannState:
        false, zero = torch.zeros((), dtype=torch.bool), torch.zeros((), dtype=torch.int64)
        tol = self.solver.tol
        norm0 = dot(r, r).sqrt()
        stop = -norm0 if tol is None else tol * dot(b, b).sqrt()
        return NeumannState(
            acc=r, v=r, norm_min=norm0, stop=stop, done=norm0 <= stop, grew=false, last=norm0,
            ratio=-torch.ones_like(norm0), iterations=zero,
        )  # fmt: skip

    def _alpha(self) -> float:
        alpha = self.solver.alpha
        assert alpha is not None  # Neumann.kernel refuses alpha=None
        return alpha

    def step(self, op: Op, state: NeumannState, active: torch.Tensor) -> NeumannState:
        acc, v, norm_min, stop, done = state.acc, state.v, state.norm_min, state.stop, state.done
        grew, last, ratio, its = state.grew, state.last, state.ratio, state.iterations
        alpha, limit = self._alpha(), 1.0 + growth_tol(v[0].dtype)
        v_next = axpy(-alpha, op(v), v)
        norm = dot(v_next, v_next).sqrt()
        bad = active & ~(norm <= limit * norm_min)  # grew, or NaN/Inf
        grew, active = grew | bad, active & ~bad
        v = select(active, v_next, v)
        acc = tuple(torch.where(active, a + b, a) for a, b in zip(acc, v))
        norm_min = torch.where(active, torch.minimum(norm_min, norm), norm_min)
        step = torch.where(last > 0, norm / last, torch.zeros_like(norm))
        ratio = torch.where(active, step, ratio)
        last = torch.where(active, norm, last)
        its = its + (active | bad).long()  # the step that grew counts, as in the eager series
        done = done | bad | (active & (norm <= stop))
        return NeumannState(
            acc=acc, v=v, norm_min=norm_min, stop=stop, done=done, grew=grew, last=last,
            ratio=ratio, iterations=its,
        )  # fmt: skip

    def answer(self, state: NeumannState, x0: Tensors) -> tuple[Tensors, dict[str, torch.Tensor]]:
        x = axpy(self._alpha(), state.acc, x0)
        return x, {"diverged": state.grew, "last_term": state.last, "ratio": state.ratio}

    def diagnose(
        self, info: SolveInfo, st: Stats, own: dict[str, float], dtype: torch.dtype
    ) -> None:
        info.alpha = self._alpha()
        if info.diverged:
            warn_diverged(info, growth_hint(False))
        # the eager series' stall test on the last ratio of term norms and its bound
        bound = own["last_term"] / st.b_norm if st.b_norm > 0 else 0.0
        ratio = own["ratio"]
        info.extras["contraction"] = ratio if ratio >= 0 else None
        info.extras["stalled"] = (
            not info.diverged
            and ratio >= 1.0 - growth_tol(dtype)
            and bound > max(self.solver.tol or 0.0, stall_floor(dtype))
        )
        if info.extras["stalled"]:
            info.converged = False
