"""The contract of every proximal operator: each property below runs on every row of
``ALL_PROX`` (``tests/helpers.py``), so a new operator is one row there.

* the output has the input's structure, shapes and dtype (a tensor, or a pytree);
* it is non-expansive, ``‖prox(x) − prox(y)‖ <= ‖x − y‖`` (far and near pairs);
* it is the prox: for a penalty ``g``, ``F(y) = scaling · g(y) + ½‖y − x‖²`` is 1-strongly convex
  with its minimum at ``p = prox(x)``, so ``F(p + δ) >= F(p) + ½‖δ‖²`` for every perturbation
  ``δ``; for a set, ``p`` is in it, ``prox(p) = p``, and ``⟨x − p, z − p⟩ <= 0`` for every
  ``z`` in the set;
* its derivatives in ``x``, in every hyperparameter (and in ``scaling`` for a penalty) match
  central finite differences in float64 (``torch.autograd.gradcheck``) at points that
  ``hg.prox.kinks`` says are away from its kinks;
* its kink rule is complete: along a segment, the directional derivative jumps only where
  ``hg.prox.kinks`` finds a kink;
* float32 in, float32 out, the float64 answer to float32 rounding;
* bad hyperparameters are refused with a ``HypergradValueError``: a NaN entry, a tensor that does
  not broadcast to its shape, and for a penalty a NaN or negative ``scaling``.

Values against independent argmins (scipy, KKT, sorting references), closed-form Jacobians,
``torch.func`` transforms and pytree hyperparameters are in ``test_prox.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ALL_PROX, F64, PROX_X_SHAPE, ProxCase

import hypergrad as hg

SCALING = 0.7
SCALES = (0.1, 0.5, 1.5, 4.0)  # inputs inside and outside every threshold, ball, box
KINK_TOL = 1e-3  # how far from a kink the derivative checks stay


def test_every_operator_is_a_row() -> None:
    """Every operator that ``hg.prox`` exports (``__all__``, less the two kink functions) has a
    row in ALL_PROX, and every row is one of them."""
    exported = {getattr(hg.prox, n) for n in hg.prox.__all__} - {hg.prox.kinks, hg.prox.kink_mask}
    rows = {getattr(p.values[0].op, "func", p.values[0].op) for p in ALL_PROX}
    missing = sorted(op.__name__ for op in exported - rows)
    assert not missing, f"hg.prox operators without an ALL_PROX row (tests/helpers.py): {missing}"
    assert rows <= exported


def _hparams(case: ProxCase, seed: int, dtype: torch.dtype = F64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return case.make(tuple(torch.rand(s, generator=g, dtype=dtype) for s in case.shapes))


def _x(seed: int, scale: float, shape: tuple[int, ...] = PROX_X_SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return scale * torch.randn(shape, generator=g, dtype=F64)


def _prox(case: ProxCase, x, ts, scaling=SCALING):
    return case.op(x, case.pack(ts), scaling)


def _away_from_kinks(case: ProxCase) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A draw of ``x`` and the hyperparameters with no coordinate within KINK_TOL of a kink."""
    for seed in range(100):
        x, ts = _x(seed, 1.5), _hparams(case, seed)
        count = hg.prox.kinks(case.op, x, case.pack(ts), SCALING, tol=KINK_TOL)
        assert count is not None, "the operator has no kink rule: add one in hypergrad/prox.py"
        if count == 0:
            return x, ts
    raise AssertionError("no draw away from the kinks in 100 tries")


@pytest.mark.parametrize("case", ALL_PROX)
def test_output_has_the_inputs_structure_shape_and_dtype(case: ProxCase) -> None:
    ts = _hparams(case, 0)
    x = _x(0, 1.5)
    out = _prox(case, x, ts)
    assert isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype == x.dtype
    # a pytree, with scalar hyperparameters (they broadcast to every leaf)
    scalars = case.make(tuple(torch.full((), 0.5, dtype=F64) for _ in case.shapes))
    tree = {"w": _x(1, 1.5), "b": (_x(2, 1.5, (2, 4)),), "v": [_x(3, 1.5, (4,))]}
    out = _prox(case, tree, scalars)
    assert isinstance(out, dict) and list(out) == ["w", "b", "v"]
    assert isinstance(out["b"], tuple) and isinstance(out["v"], list)
    for got, given in (
        (out["w"], tree["w"]),
        (out["b"][0], tree["b"][0]),
        (out["v"][0], tree["v"][0]),
    ):
        assert got.shape == given.shape and got.dtype == given.dtype
        assert torch.isfinite(got).all()


@pytest.mark.parametrize("case", ALL_PROX)
def test_non_expansive(case: ProxCase) -> None:
    for seed in range(6):
        ts = _hparams(case, seed)
        for scale in SCALES:
            x = _x(seed, scale)
            for y in (_x(seed + 100, scale), x + 1e-3 * _x(seed + 200, 1.0)):
                moved = float(torch.linalg.norm(_prox(case, x, ts) - _prox(case, y, ts)))
                assert moved <= float(torch.linalg.norm(x - y)) * (1 + 1e-12) + 1e-15, (seed, scale)


def _penalty_is_minimal(case: ProxCase, x: torch.Tensor, ts: tuple[torch.Tensor, ...]) -> None:
    h = case.pack(ts)

    def objective(y: torch.Tensor) -> float:
        return float(SCALING * case.penalty(y, h) + 0.5 * ((y - x) ** 2).sum())

    p = _prox(case, x, ts)
    fp = objective(p)
    assert math.isfinite(fp)
    g = torch.Generator().manual_seed(7)
    deltas = [r * torch.randn(x.shape, generator=g, dtype=F64) for r in (1e-4, 1e-2, 0.3, 3.0)
              for _ in range(10)]  # fmt: skip
    for i in range(x.numel()):  # each coordinate alone, both ways
        for step in (1e-3, -1e-3):
            e = torch.zeros(x.numel(), dtype=F64)
            e[i] = step
            deltas.append(e.reshape(x.shape))
    for d in deltas:
        # F is 1-strongly convex with its minimum at p
        bound = fp + 0.5 * float((d**2).sum()) - 1e-10 * (1 + abs(fp))
        assert objective(p + d) >= bound, (float(d.abs().max()), objective(p + d), fp)


def _projection_is_optimal(case: ProxCase, x: torch.Tensor, ts: tuple[torch.Tensor, ...]) -> None:
    h = case.pack(ts)
    p = _prox(case, x, ts)
    assert case.member(p, h, 1e-12)
    torch.testing.assert_close(_prox(case, p, ts), p, rtol=0, atol=1e-12)  # idempotent
    for seed in range(10):  # points of the set: projections of other inputs
        z = _prox(case, _x(seed + 300, 3.0), ts)
        assert case.member(z, h, 1e-12)
        inner = float(((x - p) * (z - p)).sum())
        assert inner <= 1e-10 * (1 + float(torch.linalg.norm(x - p) * torch.linalg.norm(z - p)))


@pytest.mark.parametrize("case", ALL_PROX)
def test_it_is_the_prox_of_its_penalty_or_the_projection_onto_its_set(case: ProxCase) -> None:
    assert (case.penalty is None) != (case.member is None), "a row is a penalty or a set"
    check = _penalty_is_minimal if case.penalty is not None else _projection_is_optimal
    for seed in range(3):
        for scale in SCALES:
            check(case, _x(seed, scale), _hparams(case, seed))


@pytest.mark.parametrize("case", ALL_PROX)
def test_derivatives_match_central_differences_away_from_kinks(case: ProxCase) -> None:
    x, ts = _away_from_kinks(case)
    n = len(ts)
    inputs = [x.clone().requires_grad_(), *(t.clone().requires_grad_() for t in ts)]
    if case.penalty is not None:  # a projection ignores scaling
        inputs.append(torch.tensor(SCALING, dtype=F64, requires_grad=True))

    def fn(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        scaling = rest[n] if len(rest) > n else SCALING
        return case.op(x, case.pack(rest[:n]), scaling)

    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("case", ALL_PROX)
def test_the_kink_rule_finds_where_the_derivative_jumps(case: ProxCase) -> None:
    """Along ``x(t) = a + t d`` (through every threshold, ball and box face) the slope of
    ``prox(x(t))`` jumps only at a kink: each jump, a change of slope between two grid steps
    well above the changes two steps before and after (curvature changes smoothly), is within
    ``tol = 3 h ‖d‖`` of a point that ``kinks`` counts."""
    ts = _hparams(case, 1)
    a, d = _x(5, 0.1), _x(6, 2.0)
    n = 2401
    t = torch.linspace(-1.0, 1.0, n, dtype=F64)
    h = float(t[1] - t[0])
    ys = torch.stack([_prox(case, a + ti * d, ts).reshape(-1) for ti in t])
    change = ((ys[2:] - 2 * ys[1:-1] + ys[:-2]) / h).abs().amax(dim=1)  # at t[1:-1]
    around = torch.maximum(change[:-4], change[4:])  # two steps before and after
    jumps = (change[2:-2] > 0.05) & (change[2:-2] > 4 * around)  # at t[3:-3]
    assert jumps.any(), "the segment crosses no kink: the check would not be able to fail"
    tol = 3 * h * float(torch.linalg.norm(d))
    for i in torch.nonzero(jumps).flatten().tolist():
        x = a + t[i + 3] * d
        assert hg.prox.kinks(case.op, x, case.pack(ts), SCALING, tol=tol), float(t[i + 3])


@pytest.mark.parametrize("case", ALL_PROX)
def test_float32_in_float32_out(case: ProxCase) -> None:
    x, ts = _away_from_kinks(case)
    out64 = _prox(case, x, ts)
    out32 = _prox(case, x.float(), tuple(t.float() for t in ts))
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out64, rtol=1e-5, atol=1e-5)
    plain = case.make(tuple(torch.full((), 0.5, dtype=F64) for _ in case.shapes))
    plain = tuple(float(v) for v in plain)  # numbers keep x's dtype too
    assert _prox(case, x.float(), plain).dtype == torch.float32


@pytest.mark.parametrize("case", ALL_PROX)
def test_bad_hyperparameters_are_refused(case: ProxCase) -> None:
    x, ts = _x(0, 1.5), _hparams(case, 0)
    for i, shape in enumerate(case.shapes):
        nan = ts[i].clone()
        nan.reshape(-1)[0] = math.nan
        with pytest.raises(hg.HypergradValueError, match="NaN|finite"):
            _prox(case, x, ts[:i] + (nan,) + ts[i + 1 :])
        wide = ts[i].expand((5, *shape)).clone()  # does not broadcast to x's (or the groups')
        with pytest.raises(hg.HypergradValueError, match="shape"):
            _prox(case, x, ts[:i] + (wide,) + ts[i + 1 :])
    if case.penalty is not None:
        for bad in (math.nan, -0.1, torch.tensor(math.nan, dtype=F64)):
            with pytest.raises(hg.HypergradValueError, match="scaling"):
                _prox(case, x, ts, bad)
    if not case.shapes:  # no hyperparameters: documented as ignored
        torch.testing.assert_close(case.op(x, math.nan), case.op(x))
