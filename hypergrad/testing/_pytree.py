"""The checks on pytrees: :func:`check_hypergrad` (re-solved inner problems) and
:func:`check_unrolled` (re-run unrolled procedures), and their ``assert_*`` forms."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import HypergradTypeError, HypergradValueError
from ..implicit import implicit_grad
from ..report import Loss, check_leaves
from ..solvers import MINRES
from ..tree import PyTree, Tensors, leaf_paths, tree_flatten, tree_unflatten
from ._directions import flatten_like
from ._report import HypergradCheckReport
from ._run import Point, Problem, quietly, run_check
from ._settings import CheckSettings, grads, scalar, seeded, warn_low_precision, zeros_for_none
from ._verdict import PROCEDURE, SOLVE


def _callable(fn: Any, name: str) -> None:
    if not callable(fn):
        raise HypergradTypeError(f"{name} must be callable, got {type(fn).__name__}")


def raise_if_failed(report: HypergradCheckReport) -> HypergradCheckReport:
    if not report.passed:
        raise AssertionError(str(report))
    return report


class _Trees:
    """``hparams`` and the ``params`` that ``fn(hparams)`` returns, flattened once; ``fn`` runs
    seeded, and must return the same structure at every point."""

    def __init__(
        self, fn: Callable[[PyTree], PyTree], fn_name: str, hparams: PyTree, eps: float, seed: int
    ):
        self.fn, self.fn_name, self.seed = fn, fn_name, seed
        h_leaves, self.h_spec = tree_flatten(hparams, "hparams")
        self.names = leaf_paths(self.h_spec, "hparams")
        self.theta0 = [t.detach().clone() for t in h_leaves]
        check_leaves(self.theta0, self.names, "hparams")
        warn_low_precision(self.theta0, "hparams", eps)
        self.p0, self.p_spec = self._run(self.theta0)
        check_leaves(self.p0, leaf_paths(self.p_spec, "params"), f"{fn_name}(hparams)")
        warn_low_precision(self.p0, f"the params returned by {fn_name}", eps)

    def _run(self, theta: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        with seeded(self.seed):
            out = self.fn(self.H([t.clone() for t in theta]))
        leaves, spec = tree_flatten(out, f"{self.fn_name}(hparams)")
        return [p.detach() for p in leaves], spec

    def params_at(self, theta: list[torch.Tensor]) -> list[torch.Tensor]:
        params, spec = self._run(theta)
        if spec != self.p_spec or any(a.shape != b.shape for a, b in zip(params, self.p0)):
            raise HypergradValueError(
                f"{self.fn_name} returned {spec!r} with shapes {[tuple(a.shape) for a in params]} "
                f"at a perturbed point but {self.p_spec!r} with shapes "
                f"{[tuple(a.shape) for a in self.p0]} at hparams: it must return the same "
                "structure everywhere"
            )
        return params

    def H(self, leaves: Sequence[torch.Tensor]) -> PyTree:
        return tree_unflatten(self.h_spec, list(leaves))

    def P(self, leaves: Sequence[torch.Tensor]) -> PyTree:
        return tree_unflatten(self.p_spec, list(leaves))

    def like_hparams(self, tree: Any, what: str) -> list[torch.Tensor]:
        return flatten_like(tree, self.theta0, self.h_spec, what, lambda t: tree_flatten(t, what))

    def given(self, d: Any, k: int) -> list[torch.Tensor]:
        return self.like_hparams(d, f"directions[{k}]")

    def direct(self, outer_loss: Loss) -> Tensors:
        """``dL_out/dtheta`` at ``(fn(hparams), hparams)``: the outer loss's own dependence."""
        ths = [t.detach().requires_grad_(True) for t in self.theta0]
        with torch.enable_grad():
            lo = scalar(outer_loss(self.P(self.p0), self.H(ths)), "outer_loss")
            return zeros_for_none(grads(lo, ths), ths)

    def problem(self, **kw: Any) -> Problem:
        dtypes = [p.dtype for p in self.p0]
        return Problem(self.theta0, self.names, flatten_given=self.given, param_dtypes=dtypes, **kw)


def _solve_point(trees: _Trees, inner_loss: Loss, outer_loss: Loss) -> Callable[..., Point]:
    def point(theta: list[torch.Tensor], params: list[torch.Tensor]) -> Point:
        lo = scalar(outer_loss(trees.P(params), trees.H(theta)), "outer_loss")
        ps = [p.detach().requires_grad_(True) for p in params]
        with torch.enable_grad():
            li = scalar(inner_loss(trees.P(ps), trees.H(theta)), "inner_loss")
            g = zeros_for_none(grads(li, ps), ps)
        return Point(float(lo.detach()), float(li.detach()), g, lo.dtype)

    return point


def _solve_problem(
    trees: _Trees, inner_loss: Loss, outer_loss: Loss, grad: PyTree | None
) -> Problem:
    """The problem of :func:`check_hypergrad`: re-solves, the adjoint, the checked gradient."""
    point = _solve_point(trees, inner_loss, outer_loss)
    at = (trees.P(trees.p0), trees.H(trees.theta0))

    def implicit(solver: Any = None) -> tuple[Tensors, Tensors]:
        g, info = implicit_grad(inner_loss, outer_loss, *at, solver=solver)
        leaves = tuple(t.detach() for t in tree_flatten(g, "grad")[0])
        return leaves, tuple(tree_flatten(info.extras["adjoint"])[0])

    found: tuple[Tensors, ...] | None
    if grad is None:
        found = implicit()
        grad_leaves = list(found[0])
    else:
        grad_leaves = trees.like_hparams(grad, "grad")
        found = quietly(lambda: implicit(MINRES()))
    return trees.problem(
        evaluate=lambda theta: point(theta, trees.params_at(theta)),
        center=point(trees.theta0, trees.p0),
        grad=grad_leaves,
        adjoint=None if found is None else found[1],
        direct=trees.direct(outer_loss),
        source=SOLVE,
        implicit=None if found is None else found[0],
    )


def check_hypergrad(
    solve_inner: Callable[[PyTree], PyTree],
    inner_loss: Loss,
    outer_loss: Loss,
    hparams: PyTree,
    grad: PyTree | None = None,
    *,
    directions: int | str | Sequence[PyTree] | None = None,
    eps: float = 1e-4,
    rtol: float = 1e-4,
    atol: float = 1e-8,
    seed: int = 0,
    inner_tol: float | None = None,
) -> HypergradCheckReport:
    """Check a hypergradient against central finite differences of the re-solved problem.

    Args:
        solve_inner: ``hparams -> params``, solving the inner problem (approximately) from
            scratch: the same procedure, deterministic, at any ``hparams`` (it runs with the RNG
            seeded to ``seed`` every time, your RNG stream untouched). ``params`` is a pytree
            like :func:`~hypergrad.implicit_grad`'s. A fixed number of optimizer steps whose
            result is not a minimiser is an unrolled procedure: use :func:`check_unrolled`.
        inner_loss: ``(params, hparams) -> scalar``, as in :func:`~hypergrad.implicit_grad`.
        outer_loss: ``(params, hparams) -> scalar``; its direct dependence on ``hparams`` is part
            of the finite differences.
        hparams: where to check, a pytree (tensor / tuple / list / dict) of float tensors.
        grad: the hypergradient to check, a pytree like ``hparams``; None computes it with
            ``hg.implicit_grad(inner_loss, outer_loss, solve_inner(hparams), hparams)`` and its
            default solver.
        directions: None: every coordinate when ``hparams`` has at most 16 elements, else 8
            random unit directions; ``"all"``: every coordinate; an int: that many random unit
            directions (drawn with ``seed``); a sequence of pytrees like ``hparams``: those
            directions, used as given (not normalised).
        eps: finite-difference step along each direction.
        rtol: relative tolerance of the comparison.
        atol: absolute tolerance of the comparison.
        seed: seed of the random directions and of the RNG around each ``solve_inner`` call.
        inner_tol: None (default) judges each inner solve by its estimated effect on the finite
            differences, ``|<x, dL_in/dpsi>| / eps`` with ``x`` the adjoint, against half the
            tolerance; a number instead requires ``||dL_in/dpsi|| <= inner_tol`` at every point.

    Returns:
        A :class:`HypergradCheckReport`; ``print(report)`` shows the table and the verdict.

    Raises:
        HypergradError: bad arguments, or ``solve_inner`` returning a structure that changes.

    Warns:
        HypergradWarning: ``hparams`` or ``params`` are not float64 (finite differences in
            float32 are unreliable).

    Example:
        >>> import hypergrad.testing as hgt
        >>> X, y = torch.randn(40, 3, dtype=torch.float64), torch.randn(40, dtype=torch.float64)
        >>> def solve(lam):  # closed-form ridge regression
        ...     return torch.linalg.solve(X.T @ X / 40 + torch.diag(lam), X.T @ y / 40)
        >>> inner = lambda w, lam: 0.5 * ((X @ w - y) ** 2).mean() + 0.5 * (lam * w**2).sum()
        >>> outer = lambda w, lam: ((X @ w - 1) ** 2).mean() + 0.1 * (lam**2).sum()
        >>> report = hgt.check_hypergrad(solve, inner, outer, torch.full((3,), 0.5).double())
        >>> report.passed, report.inner_ok, [r.direction for r in report.rows]
        (True, True, ['hparams[0]', 'hparams[1]', 'hparams[2]'])
    """
    _callable(solve_inner, "solve_inner")
    _callable(inner_loss, "inner_loss")
    _callable(outer_loss, "outer_loss")
    settings = CheckSettings(
        directions=directions, eps=eps, rtol=rtol, atol=atol, seed=seed, inner_tol=inner_tol
    )
    trees = _Trees(solve_inner, "solve_inner", hparams, eps, seed)
    problem = _solve_problem(trees, inner_loss, outer_loss, grad)
    return run_check(problem=problem, settings=settings)


def assert_hypergrad_close(
    solve_inner: Callable[[PyTree], PyTree],
    inner_loss: Loss,
    outer_loss: Loss,
    hparams: PyTree,
    grad: PyTree | None = None,
    *,
    directions: int | str | Sequence[PyTree] | None = None,
    eps: float = 1e-4,
    rtol: float = 1e-4,
    atol: float = 1e-8,
    seed: int = 0,
    inner_tol: float | None = None,
) -> HypergradCheckReport:
    """:func:`check_hypergrad`, raising ``AssertionError`` (message: the table) on failure.

    Args:
        solve_inner: as in :func:`check_hypergrad`.
        inner_loss: as in :func:`check_hypergrad`.
        outer_loss: as in :func:`check_hypergrad`.
        hparams: as in :func:`check_hypergrad`.
        grad: as in :func:`check_hypergrad`.
        directions: as in :func:`check_hypergrad`.
        eps: as in :func:`check_hypergrad`.
        rtol: as in :func:`check_hypergrad`.
        atol: as in :func:`check_hypergrad`.
        seed: as in :func:`check_hypergrad`.
        inner_tol: as in :func:`check_hypergrad`.

    Returns:
        The :class:`HypergradCheckReport` when the check passed.

    Raises:
        AssertionError: the check failed; the message is ``str(report)``.

    Example:
        >>> import hypergrad.testing as hgt
        >>> X = torch.randn(30, 2, dtype=torch.float64)
        >>> solve = lambda lam: torch.linalg.solve(X.T @ X + lam * torch.eye(2).double(), X.sum(0))
        >>> inner = lambda w, lam: 0.5 * w @ (X.T @ X) @ w - w @ X.sum(0) + 0.5 * lam * w @ w
        >>> outer = lambda w, lam: (w ** 2).sum()
        >>> lam = torch.tensor(1.0, dtype=torch.float64)
        >>> _ = hgt.assert_hypergrad_close(solve, inner, outer, lam)  # passes silently
        >>> hgt.assert_hypergrad_close(solve, inner, outer, lam, grad=torch.zeros_like(lam))
        Traceback (most recent call last):
        ...
        AssertionError: hypergradient check: 1 coordinate direction, ...
    """
    report = check_hypergrad(
        solve_inner,
        inner_loss,
        outer_loss,
        hparams,
        grad,
        directions=directions,
        eps=eps,
        rtol=rtol,
        atol=atol,
        seed=seed,
        inner_tol=inner_tol,
    )
    return raise_if_failed(report)


def _procedure_problem(trees: _Trees, outer_loss: Loss, grad: PyTree) -> Problem:
    """The problem of :func:`check_unrolled`: the procedure re-run, the outer loss only."""

    def point(theta: list[torch.Tensor], params: list[torch.Tensor]) -> Point:
        lo = scalar(outer_loss(trees.P(params), trees.H(theta)), "outer_loss")
        return Point(float(lo.detach()), float("nan"), (), lo.dtype)

    return trees.problem(
        evaluate=lambda theta: point(theta, trees.params_at(theta)),
        center=point(trees.theta0, trees.p0),
        grad=trees.like_hparams(grad, "grad"),
        adjoint=None,
        direct=trees.direct(outer_loss),
        source=PROCEDURE,
    )


def check_unrolled(
    procedure: Callable[[PyTree], PyTree],
    outer_loss: Loss,
    hparams: PyTree,
    grad: PyTree,
    *,
    directions: int | str | Sequence[PyTree] | None = None,
    eps: float = 1e-4,
    rtol: float = 1e-4,
    atol: float = 1e-8,
    seed: int = 0,
) -> HypergradCheckReport:
    """Check an unrolled hypergradient against central differences of the re-run procedure.

    An unrolled hypergradient (:func:`~hypergrad.unrolled_grad`, or your own backpropagation
    through T optimizer steps) is the derivative of ``outer_loss(procedure(hparams), hparams)``
    for the procedure *as it is*: its result is T steps from a fixed start, not a minimiser of
    the inner loss. So the finite differences re-run the same procedure at ``hparams +- eps d``,
    and no stationarity check applies (unlike :func:`check_hypergrad`, which would report every
    such procedure as an unconverged inner solve).

    Args:
        procedure: ``hparams -> params``: the unrolled steps from a fixed start (the same number
            of steps, optimizer and settings as the hypergradient differentiates through),
            deterministic; it runs with the RNG seeded to ``seed`` every time.
        outer_loss: ``(params, hparams) -> scalar``; its direct dependence on ``hparams`` is part
            of the finite differences.
        hparams: where to check, a pytree (tensor / tuple / list / dict) of float tensors.
        grad: the hypergradient to check, a pytree like ``hparams``.
        directions: as in :func:`check_hypergrad`.
        eps: finite-difference step along each direction.
        rtol: relative tolerance of the comparison.
        atol: absolute tolerance of the comparison.
        seed: seed of the random directions and of the RNG around each ``procedure`` call.

    Returns:
        A :class:`HypergradCheckReport` with ``procedure=True``; its rows' ``inner_err`` and
        ``inner_grad_norm`` are NaN and ``inner_ok`` True (printed as ``-``).

    Raises:
        HypergradError: bad arguments, or ``procedure`` returning a structure that changes.

    Warns:
        HypergradWarning: ``hparams`` or ``params`` are not float64.

    Example:
        >>> import hypergrad as hg, hypergrad.testing as hgt
        >>> inner = lambda w, lam: 0.5 * ((w - 1.0) ** 2).sum() + 0.5 * lam * (w**2).sum()
        >>> outer = lambda w, lam: (w**2).sum()
        >>> def sgd(lam, steps=10):  # the procedure hg.unrolled_grad differentiates
        ...     w = torch.zeros(2, dtype=torch.float64)
        ...     for _ in range(steps):
        ...         w = w - 0.3 * ((w - 1.0) + lam * w)
        ...     return w
        >>> lam = torch.tensor(0.5, dtype=torch.float64)
        >>> g, _ = hg.unrolled_grad(inner, outer, torch.zeros(2, dtype=torch.float64), lam,
        ...                         steps=10, optimizer=hg.optim.sgd(lr=0.3))
        >>> hgt.check_unrolled(sgd, outer, lam, g).passed, hgt.check_unrolled(sgd, outer, lam,
        ...                                                                  1.01 * g).passed
        (True, False)
    """
    _callable(procedure, "procedure")
    _callable(outer_loss, "outer_loss")
    settings = CheckSettings(directions=directions, eps=eps, rtol=rtol, atol=atol, seed=seed)
    if grad is None:
        raise HypergradTypeError(
            "grad is required: check_unrolled checks a given unrolled hypergradient (e.g. the "
            "first output of hg.unrolled_grad)"
        )
    trees = _Trees(procedure, "procedure", hparams, eps, seed)
    return run_check(problem=_procedure_problem(trees, outer_loss, grad), settings=settings)


def assert_unrolled_close(
    procedure: Callable[[PyTree], PyTree],
    outer_loss: Loss,
    hparams: PyTree,
    grad: PyTree,
    *,
    directions: int | str | Sequence[PyTree] | None = None,
    eps: float = 1e-4,
    rtol: float = 1e-4,
    atol: float = 1e-8,
    seed: int = 0,
) -> HypergradCheckReport:
    """:func:`check_unrolled`, raising ``AssertionError`` (message: the table) on failure.

    Args:
        procedure: as in :func:`check_unrolled`.
        outer_loss: as in :func:`check_unrolled`.
        hparams: as in :func:`check_unrolled`.
        grad: as in :func:`check_unrolled`.
        directions: as in :func:`check_unrolled`.
        eps: as in :func:`check_unrolled`.
        rtol: as in :func:`check_unrolled`.
        atol: as in :func:`check_unrolled`.
        seed: as in :func:`check_unrolled`.

    Returns:
        The :class:`HypergradCheckReport` when the check passed.

    Raises:
        AssertionError: the check failed; the message is ``str(report)``.
    """
    report = check_unrolled(
        procedure,
        outer_loss,
        hparams,
        grad,
        directions=directions,
        eps=eps,
        rtol=rtol,
        atol=atol,
        seed=seed,
    )
    return raise_if_failed(report)
