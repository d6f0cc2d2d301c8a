"""Hessian columns for the column-building solvers (Exact, Nystrom) from one batched backward
pass (``InnerOperator.hvp_batched``, ``torch.autograd.grad(..., is_grads_batched=True)``): the
same numbers as one product per column, which stays the fallback (recompute engine, operations
without a batching rule)."""

from __future__ import annotations

import pytest
import torch

import hypergrad as hg
from hypergrad.implicit import linearization
from hypergrad.solvers import dense

F64 = torch.float64


def _no_batch(self, vs):  # the linearization cannot batch: one product per column
    return None


def _problem():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 5, generator=g, dtype=F64), torch.randn(40, 2, generator=g, dtype=F64)
    xv, yv = torch.randn(20, 5, generator=g, dtype=F64), torch.randn(20, 2, generator=g, dtype=F64)
    params = {
        "w1": 0.3 * torch.randn(5, 6, generator=g, dtype=F64),
        "w2": 0.3 * torch.randn(6, 2, generator=g, dtype=F64),
    }
    lam = torch.full((2,), -1.0, dtype=F64)

    def inner(p, h):  # a small tanh network: leaves couple, the Hessian is dense
        out = torch.tanh(x @ p["w1"]) @ p["w2"]
        return (
            ((out - y) ** 2).mean()
            + h[0].exp() * (p["w1"] ** 2).sum()
            + h[1].exp() * (p["w2"] ** 2).sum()
        )

    def outer(p, h):
        return ((torch.tanh(xv @ p["w1"]) @ p["w2"] - yv) ** 2).mean()

    return inner, outer, params, lam


@pytest.mark.parametrize(
    "solver",
    [hg.Exact(damping=1.0), hg.Nystrom(rank=20, damping=1.0), hg.Nystrom(rank=42, damping=1.0)],
)
def test_batched_columns_equal_one_product_per_column(solver, monkeypatch):
    inner, outer, params, lam = _problem()
    calls = []
    real = linearization.GradientLinearization.rmatvec_batched

    def spy(self, vs):
        out = real(self, vs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(linearization.GradientLinearization, "rmatvec_batched", spy)
    monkeypatch.setattr(dense, "batching_pays", lambda *a: True)  # not left to the timings
    g_batched, info = hg.implicit_grad(inner, outer, params, lam, solver=solver)
    assert calls and all(calls)  # the batched path ran
    monkeypatch.setattr(linearization.GradientLinearization, "rmatvec_batched", _no_batch)
    g_loop, info_loop = hg.implicit_grad(inner, outer, params, lam, solver=solver)
    torch.testing.assert_close(g_batched, g_loop, rtol=1e-12, atol=1e-14)
    assert info.solve.matvecs == info_loop.solve.matvecs  # products counted the same


def test_recompute_engine_falls_back_to_one_product_per_column():
    inner, outer, params, lam = _problem()
    g_reuse, _ = hg.implicit_grad(inner, outer, params, lam, solver=hg.Exact(damping=1.0))
    g_recompute, _ = hg.implicit_grad(
        inner, outer, params, lam, solver=hg.Exact(damping=1.0), engine="recompute"
    )
    torch.testing.assert_close(g_reuse, g_recompute, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("pays", [True, False])
def test_batching_is_chosen_by_the_probe_batch(pays, monkeypatch):
    """Columns 0 and 1 are single products, columns 2-9 one probe batch; the rest is batched
    only when the probe beat as many single products. The matrix is the same either way."""
    inner, outer, params, lam = _problem()
    calls, seen = [], []
    real = linearization.GradientLinearization.rmatvec_batched

    def spy(self, vs):
        calls.append(vs[0].shape[0])
        return real(self, vs)

    def decide(t_one, t_batch, k):
        seen.append((t_one > 0, t_batch > 0, k))
        return pays

    monkeypatch.setattr(linearization.GradientLinearization, "rmatvec_batched", spy)
    monkeypatch.setattr(dense, "batching_pays", decide)
    g, info = hg.implicit_grad(inner, outer, params, lam, solver=hg.Exact(damping=1.0))
    assert seen == [(True, True, dense.PROBE_COLUMNS)]
    assert calls == ([8, 32] if pays else [8])  # 42 unknowns
    assert info.solve.matvecs == 42
    monkeypatch.setattr(linearization.GradientLinearization, "rmatvec_batched", _no_batch)
    g_loop, _ = hg.implicit_grad(inner, outer, params, lam, solver=hg.Exact(damping=1.0))
    torch.testing.assert_close(g, g_loop, rtol=1e-12, atol=1e-14)


def test_batching_pays_compares_per_column_times():
    assert dense.batching_pays(1e-4, 4e-4, 8)  # 0.05 ms per column batched vs 0.1 ms
    assert not dense.batching_pays(1e-4, 9e-4, 8)
