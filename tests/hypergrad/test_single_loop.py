"""hg.SingleLoop, the single-loop HyperStep method, against exact references.

* ridge regression (closed forms): call t returns ``∇_θ L_out − M v_{t−1}`` with
  ``v_{t−1} = ρ Σ_{k<t} (I − ρH)^k g`` (the recursion written densely), so the bias falls below
  ``||M|| (1 − ρμ)^t ||H⁻¹ g||``; the first call equals hg.FirstOrder(alpha=ρ);
* a conv/BatchNorm(train)/dropout network in float64: the one combined backward pass gives
  autograd's separate H v and M v with the same dropout mask;
* the state: kept, reported, reset, kept across a step-size change, dropped on NaN/Inf; the
  collectives of ``distributed="exact"``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel
from test_first_order import _first_order, _network, _ridge

import hypergrad as hg
from hypergrad import modules

F64 = torch.float64


def _calls(step, n):
    out, infos = [], []
    for _ in range(n):
        step.hyper[0].grad = None
        infos.append(step(None))
        out.append(step.hyper[0].grad.clone())
    return out, infos


def test_ridge_follows_the_recursion_and_its_rate():
    model, lam, inner, outer, H, g, mixed, exact = _ridge()
    eig = torch.linalg.eigvalsh(H)
    rho = float(1.0 / eig[-1])
    rate = 1.0 - rho * float(eig[0])
    step = hg.HyperStep(model, [lam], inner, outer, method=hg.SingleLoop(step=rho))
    got, infos = _calls(step, 80)
    v, term = rho * g, rho * g
    m_norm = float((lam.detach().exp() * model.weight.detach()[0]).abs().max())
    h_inv_g = float(torch.linalg.solve(H, g).norm())
    for t in range(80):  # call t+1 uses v_t = ρ Σ_{k≤t} (I − ρH)^k g
        assert rel(got[t], -mixed(v)) < 1e-10
        bound = m_norm * rate ** (t + 1) * h_inv_g
        assert float((got[t] - exact).norm()) <= bound * (1 + 1e-6) + 1e-12 * float(exact.norm())
        residual = float((g - H @ v).norm() / g.norm())
        assert infos[t].adjoint_residual == pytest.approx(residual, rel=1e-9)
        assert infos[t].step == t + 1
        term = term - rho * (H @ term)
        v = v + term
    assert isinstance(infos[0], hg.SingleLoopInfo)
    assert torch.equal(step.adjoint[0], step._loop_v[0])
    first_order, _ = _first_order(model, lam, inner, outer, alpha=rho)
    assert rel(got[0], first_order) < 1e-8  # the first step is FirstOrder(alpha=ρ)


def test_network_combined_product_equals_separate_autograd_products():
    model, labeler, inner, outer = _network()
    psi, theta = list(model.parameters()), list(labeler.parameters())
    rho = 0.2
    torch.manual_seed(3)
    with hg.frozen_buffers([model]):
        g_out = torch.autograd.grad(outer(model, None), psi)
        grads = torch.autograd.grad(inner(model, None), psi, create_graph=True)
        v = [rho * x for x in g_out]
        dot = sum((gi * vi).sum() for gi, vi in zip(grads, v))
        hv = torch.autograd.grad(dot, psi, retain_graph=True)
        mv = torch.autograd.grad(dot, theta)
    step = hg.HyperStep(model, labeler, inner, outer, method=hg.SingleLoop(step=rho))
    torch.manual_seed(3)
    step(None)
    got = torch.cat([p.grad.flatten() for p in theta])
    assert rel(got, torch.cat([-m.flatten() for m in mv])) < 1e-10
    want_v = [vi + rho * (go - h) for vi, go, h in zip(v, g_out, hv)]
    assert all(rel(a, b) < 1e-10 for a, b in zip(step.adjoint, want_v))
    assert all(p.grad is None for p in psi)


def test_state_is_kept_reset_and_dropped():
    model, lam, inner, outer, H, g, mixed, _ = _ridge()
    step = hg.HyperStep(model, [lam], inner, outer, method=hg.SingleLoop(step=0.5))
    _calls(step, 3)
    kept = step.adjoint
    step.method = hg.SingleLoop(step=0.4)  # same system: the adjoint is kept
    assert step.adjoint is kept
    assert step(None).step == 4
    step.reset_adjoint()
    assert step.adjoint is None and step(None).step == 1
    step.method = hg.Implicit()
    assert step.adjoint is None and step._loop_v is None
    step.method = hg.SingleLoop(step=10.0)  # ρ λ_max > 2: the recursion does not contract
    lam.grad = None
    with pytest.warns(hg.SolveFailedWarning, match="above 1"):
        info = step(None)
    assert info.failure == "residual above 1" and info.adjoint_residual > 1
    assert info.skipped and "single-loop" in info.skip_reason and lam.grad is None
    assert step.adjoint is None and info.step == 0  # dropped: the next step restarts
    with pytest.raises(hg.HypergradValueError):
        hg.SingleLoop()
    with pytest.raises(hg.FrozenSettingError):
        hg.SingleLoop(step=0.1).step = 0.2


def test_distributed_exact_collectives(monkeypatch):
    model, lam, inner, outer, *_ = _ridge()
    sizes = []

    def counting(mode):
        def reduce(tree):
            sizes.append(sum(t.numel() for t in tree))
            return tree

        return reduce if mode == "exact" else None

    monkeypatch.setattr(modules, "make_reducer", counting)
    step = hg.HyperStep(
        model, [lam], inner, outer, method=hg.SingleLoop(step=0.5), distributed="exact"
    )
    alone = hg.HyperStep(model, [lam], inner, outer, method=hg.SingleLoop(step=0.5))
    ours, _ = _calls(step, 2)
    n_psi, n_theta = model.weight.numel(), lam.numel()
    # first step: g for v_0, then (g, H v) together, then the result; later steps: two
    assert sizes == [n_psi, 2 * n_psi, n_theta, 2 * n_psi, n_theta]
    theirs, _ = _calls(alone, 2)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
