"""Inner solvers whose solution is differentiable in the hyperparameters: each ``run(x0,
hparams)`` runs the plain iteration without autograd and returns the solution through
:func:`~hypergrad.custom_fixed_point` or :func:`~hypergrad.custom_root`, so gradients reach
``hparams`` by implicit differentiation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import conditions
from ..errors import FrozenSettingError, HypergradTypeError
from ..implicit import custom_fixed_point, custom_root
from ..solvers import CG, DensePreconditioner, Solver
from ..tree import PyTree
from ._common import InnerInfo, check_positive
from .fixed_points import check_options, fixed_point
from .proximal_gradient import SmoothGrad, check_smooth_grad, fista
from .smooth import lbfgs, newton

Loss = Callable[[PyTree, PyTree], torch.Tensor]


#: the attributes that are settings: validated at construction, then read by every run
_SETTINGS = frozenset({"T", "loss", "smooth_loss", "prox", "solver", "options", "factor"})


class _Options(dict[str, Any]):
    """A solver's keyword settings, read-only once the solver is built."""

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise FrozenSettingError(
            "an inner solver's settings are fixed at construction (they were validated then): "
            "build a new solver with the settings you want"
        )

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse
    __ior__ = _refuse


class _Differentiable:
    """Shared state: the last inner report and the last implicit-derivative report.

    The settings (:data:`_SETTINGS`) are frozen by :meth:`_freeze` at the end of each
    constructor: assigning one raises :class:`~hypergrad.FrozenSettingError`, as for the linear
    solvers, so a run never uses a value that skipped validation.
    """

    options: dict[str, Any]

    def __init__(self) -> None:
        self.last_info: InnerInfo | None = None
        self._decorated: Any = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SETTINGS and self.__dict__.get("_frozen", False):
            cls = type(self).__name__
            raise FrozenSettingError(
                f"{cls}.{name} is a setting, fixed at construction (validated then): build a "
                f"new hg.inner.{cls}(...) instead"
            )
        object.__setattr__(self, name, value)

    def _freeze(self) -> None:
        self.options = _Options(self.options)
        self._frozen = True

    @property
    def last_implicit_info(self) -> Any:
        """The :class:`~hypergrad.HypergradInfo` of the most recent derivative through this
        solver's last ``run`` (None before one): the linear solve and ``stationarity``."""
        return None if self._decorated is None else self._decorated.last_info

    def _record(self, info: InnerInfo) -> None:
        self.last_info = info


class FixedPoint(_Differentiable):
    """A fixed point ``x = T(x, hparams)`` (Picard or Anderson), differentiable in ``hparams``.

    ``run(x0, hparams)`` solves with :func:`~hypergrad.inner.fixed_point` and returns ``x``
    through :func:`~hypergrad.custom_fixed_point`: gradients reach ``hparams`` by solving
    ``(I − ∂T/∂x)ᵀ u = v`` with ``solver`` (default ``hg.GMRES()``; for a contraction,
    ``hg.Neumann(alpha=1.0, maxiter=...)`` is the classic adjoint iteration). This is the
    layer of a deep equilibrium model.

    Args:
        T: ``(x, hparams) -> pytree like x``.
        method, maxiter, tol, memory, mixing: as in :func:`~hypergrad.inner.fixed_point`.
        solver: the linear solver of the implicit derivative.

    Attributes:
        last_info: the :class:`~hypergrad.inner.InnerInfo` of the last solve.

    Example:
        >>> import torch, hypergrad as hg
        >>> W = 0.5 * torch.eye(3, dtype=torch.float64).roll(1, 0)
        >>> layer = hg.inner.FixedPoint(lambda z, x: torch.tanh(W @ z + x), tol=1e-12)
        >>> x = torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64, requires_grad=True)
        >>> z = layer.run(torch.zeros(3, dtype=torch.float64), x)
        >>> z.sum().backward()
        >>> layer.last_info.converged, x.grad.shape
        (True, torch.Size([3]))
    """

    def __init__(
        self,
        T: Callable[[PyTree, PyTree], PyTree],
        *,
        method: str = "anderson",
        maxiter: int = 100,
        tol: float = 1e-6,
        memory: int = 5,
        mixing: float = 1.0,
        solver: Solver | None = None,
    ) -> None:
        super().__init__()
        self.T = T
        self.options: dict[str, Any] = dict(
            method=method, maxiter=maxiter, tol=tol, memory=memory, mixing=mixing
        )
        check_options(method, maxiter, tol, memory, mixing, 1e-10)  # now, not at the first run

        def solve(hparams: PyTree, x0: PyTree) -> PyTree:
            x, info = fixed_point(self.T, x0, hparams, **self.options)
            self._record(info)
            return x

        self._decorated = custom_fixed_point(T, solver=solver)(solve)
        self._freeze()

    def run(self, x0: PyTree, hparams: PyTree) -> PyTree:
        """The fixed point from ``x0``, differentiable in ``hparams`` (a pytree of tensors)."""
        return self._decorated(hparams, x0)


class ProximalGradient(_Differentiable):
    """``argmin_x f(x, hparams_smooth) + g(x, hparams_prox)`` by (F)ISTA, differentiable in
    both hyperparameter parts.

    ``run(x0, (hparams_smooth, hparams_prox))`` solves with :func:`~hypergrad.inner.fista` and
    returns ``x`` through :func:`~hypergrad.custom_fixed_point` of the proximal-gradient map
    ``T(x) = prox(x − s ∇f(x), hparams_prox, s)``
    (:func:`hypergrad.conditions.proximal_gradient`) with ``s`` the step size the solve ended
    with: the fixed points of ``T`` are the minimisers for every ``s``, so the derivative does
    not depend on it. A part without hyperparameters is written ``()`` and reaches its function
    as None (the convention of :mod:`hypergrad.conditions`).

    Args:
        smooth_loss: ``f(x, hparams_smooth) -> scalar``.
        prox: ``prox(x, hparams_prox, scaling)``, e.g. :func:`hypergrad.prox.prox_lasso`.
        stepsize, maxiter, tol, accelerated: as in :func:`~hypergrad.inner.fista`.
        solver: the linear solver of the implicit derivative (default ``hg.GMRES()``).
        smooth_grad: ``(x, hparams_smooth) -> ∇_x f`` in closed form, for the iterations
            (see :func:`~hypergrad.inner.fista`: no autograd per step, checked against
            autograd of ``smooth_loss`` at each returned point). The implicit derivative
            still differentiates ``T`` through ``smooth_loss`` by autograd.

    Attributes:
        last_info: the :class:`~hypergrad.inner.InnerInfo` of the last solve.

    Example (lasso; the derivative of the solution in λ):
        >>> import torch, hypergrad as hg
        >>> X = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> y = torch.tensor([3.0, 4.0], dtype=torch.float64)
        >>> f = lambda w, _: 0.5 * ((X @ w - y) ** 2).sum()
        >>> lasso = hg.inner.ProximalGradient(f, hg.prox.prox_lasso, tol=1e-12)
        >>> lam = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
        >>> w = lasso.run(torch.zeros(2, dtype=torch.float64), ((), lam))
        >>> w.sum().backward()  # w = (y_i x_ii − λ) / x_ii²: dw/dλ = −1 − 1/4
        >>> w.detach(), round(float(lam.grad), 10)
        (tensor([2.0000, 1.7500], dtype=torch.float64), -1.25)
    """

    def __init__(
        self,
        smooth_loss: Loss,
        prox: Callable[..., PyTree],
        *,
        stepsize: float | None = None,
        maxiter: int = 500,
        tol: float = 1e-6,
        accelerated: bool = True,
        solver: Solver | None = None,
        smooth_grad: SmoothGrad | None = None,
    ) -> None:
        super().__init__()
        self.smooth_loss, self.prox, self.solver = smooth_loss, prox, solver
        if stepsize is not None:
            check_positive(stepsize, "stepsize")
        check_smooth_grad(smooth_grad)
        self.options: dict[str, Any] = dict(
            stepsize=stepsize,
            maxiter=maxiter,
            tol=tol,
            accelerated=accelerated,
            smooth_grad=smooth_grad,
        )
        conditions.proximal_gradient(smooth_loss, prox, 1.0)  # callables checked now
        self._freeze()

    def run(self, x0: PyTree, hparams: PyTree) -> PyTree:
        """The minimiser from ``x0``, differentiable in ``hparams = (hparams_smooth,
        hparams_prox)``."""
        step = [self.options["stepsize"] or 1.0]  # this run's step size, set by the solve

        def T(params: PyTree, h: PyTree) -> PyTree:
            return conditions.proximal_gradient(self.smooth_loss, self.prox, step[0])(params, h)

        def kinks(params: PyTree, h: PyTree, rtol: float) -> int | None:
            # the operator's kinks at this run's step (info.extras["kinks"] of the derivative)
            T_s = conditions.proximal_gradient(self.smooth_loss, self.prox, step[0])
            return T_s.kinks(params, h, rtol)  # type: ignore[attr-defined, no-any-return]

        T.kinks = kinks  # type: ignore[attr-defined]

        def solve(hparams: PyTree, x0: PyTree) -> PyTree:
            h_smooth, h_prox = _split(hparams)
            x, info = fista(self.smooth_loss, self.prox, x0, h_smooth, h_prox, **self.options)
            assert info.stepsize is not None
            step[0] = info.stepsize
            self._record(info)
            return x

        _split(hparams)
        self._decorated = custom_fixed_point(T, solver=self.solver)(solve)
        return self._decorated(hparams, x0)


def _split(hparams: PyTree) -> tuple[PyTree, PyTree]:
    if not isinstance(hparams, (tuple, list)) or len(hparams) != 2:
        raise HypergradTypeError(
            "hparams must be a pair (hparams_smooth, hparams_prox); write () for a part "
            f"without hyperparameters. Got {type(hparams).__name__}"
        )
    return tuple(  # type: ignore[return-value]
        None if isinstance(h, (tuple, list)) and len(h) == 0 else h for h in hparams
    )


class _SmoothSolver(_Differentiable):
    def __init__(self, loss: Loss, solver: Solver | None, options: dict[str, Any]) -> None:
        super().__init__()
        self.loss, self.options = loss, options
        self._check()

        def solve(hparams: PyTree, x0: PyTree) -> PyTree:
            x, info = self._iterate(self.loss, x0, hparams, **self.options)
            self._record(info)
            return x

        self._decorated = custom_root(conditions.stationary(loss), solver=solver)(solve)

    _iterate: Callable[..., tuple[PyTree, InnerInfo]]

    def _check(self) -> None:
        self._iterate(lambda x, _: (x**2).sum(), torch.zeros(1), None, **self.options)

    def run(self, x0: PyTree, hparams: PyTree) -> PyTree:
        """The minimiser from ``x0``, differentiable in ``hparams`` (a pytree of tensors)."""
        return self._decorated(hparams, x0)


class Newton(_SmoothSolver):
    """``argmin_x loss(x, hparams)`` by damped Newton (dense Hessian), differentiable in
    ``hparams``.

    ``run(x0, hparams)`` solves with :func:`~hypergrad.inner.newton` and returns ``x`` through
    :func:`~hypergrad.custom_root` of the stationarity condition ``∇_x loss = 0``
    (:func:`hypergrad.conditions.stationary`; the adjoint system is Hessian-symmetric, solved
    by ``hg.CG()`` unless ``solver`` says otherwise).

    With ``reuse_hessian=True`` (for an outer loop that calls ``run`` again and again from the
    previous solution) one :class:`~hypergrad.DensePreconditioner`, ``self.factor``, holds the
    factor of the last Hessian computed: a run's first Newton step reuses the previous run's
    factor (see :func:`~hypergrad.inner.newton`) and, unless ``solver`` says otherwise, the
    implicit derivative is solved by ``hg.CG(tol=1e-10, preconditioner=self.factor)``, which
    with the factor of the last Newton step converges in two or three products instead of a
    dense solve or an unpreconditioned CG (``docs/inner.md``, "In an outer loop"). The answer
    is unchanged: both solves still stop on their own measured residuals.

    Args:
        loss: ``(x, hparams) -> scalar``.
        maxiter, tol: as in :func:`~hypergrad.inner.newton`.
        solver: the linear solver of the implicit derivative.
        reuse_hessian: keep one Hessian factor across steps and runs, for the Newton steps
            and the implicit derivative's CG (see above).

    Attributes:
        last_info: the :class:`~hypergrad.inner.InnerInfo` of the last solve.
        factor: the kept :class:`~hypergrad.DensePreconditioner` (None without
            ``reuse_hessian``).

    Example (ridge: ``w* = y / (1 + λ)``, ``dw*/dλ = −y / (1 + λ)²``):
        >>> import torch, hypergrad as hg
        >>> y = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> ridge = hg.inner.Newton(lambda w, lam: 0.5 * ((w - y) ** 2).sum()
        ...                         + 0.5 * lam * (w**2).sum())
        >>> lam = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
        >>> ridge.run(torch.zeros(2, dtype=torch.float64), lam).sum().backward()
        >>> round(float(lam.grad), 10)
        -0.75
    """

    _iterate = staticmethod(newton)

    def __init__(
        self,
        loss: Loss,
        *,
        maxiter: int = 50,
        tol: float = 1e-8,
        solver: Solver | None = None,
        reuse_hessian: bool = False,
    ) -> None:
        if not isinstance(reuse_hessian, bool):
            raise HypergradTypeError(
                f"reuse_hessian must be True or False, got {type(reuse_hessian).__name__}"
            )
        self.factor = DensePreconditioner() if reuse_hessian else None
        if reuse_hessian and solver is None:
            solver = CG(tol=1e-10, preconditioner=self.factor)
        super().__init__(loss, solver, dict(maxiter=maxiter, tol=tol))
        if self.factor is not None:
            self.options["factor"] = self.factor
        self._freeze()


class LBFGS(_SmoothSolver):
    """``argmin_x loss(x, hparams)`` by L-BFGS, differentiable in ``hparams``.

    ``run(x0, hparams)`` solves with :func:`~hypergrad.inner.lbfgs` and returns ``x`` through
    :func:`~hypergrad.custom_root` of ``∇_x loss = 0`` (as :class:`Newton`).

    Args:
        loss: ``(x, hparams) -> scalar``.
        maxiter, tol, history: as in :func:`~hypergrad.inner.lbfgs`.
        solver: the linear solver of the implicit derivative (default ``hg.CG()``).

    Attributes:
        last_info: the :class:`~hypergrad.inner.InnerInfo` of the last solve.

    Example:
        >>> import torch, hypergrad as hg
        >>> y = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> ridge = hg.inner.LBFGS(lambda w, lam: 0.5 * ((w - y) ** 2).sum()
        ...                        + 0.5 * lam * (w**2).sum(), tol=1e-12)
        >>> lam = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
        >>> ridge.run(torch.zeros(2, dtype=torch.float64), lam).sum().backward()
        >>> round(float(lam.grad), 10), ridge.last_info.converged
        (-0.75, True)
    """

    _iterate = staticmethod(lbfgs)

    def __init__(
        self,
        loss: Loss,
        *,
        maxiter: int = 500,
        tol: float = 1e-6,
        history: int = 10,
        solver: Solver | None = None,
    ) -> None:
        super().__init__(loss, solver, dict(maxiter=maxiter, tol=tol, history=history))
        self._freeze()
