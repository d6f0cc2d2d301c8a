"""hg.FirstOrder, the first-order meta step of HyperStep, against exact references.

* ridge regression (closed forms): for a quadratic inner loss the central differences are exact
  up to rounding, so the step must equal the truncated preconditioned series
  ``∇_θ L_out − M α Σ_{k≤K} (I − αH)^k g`` computed densely, and approach the exact implicit
  hypergradient at the rate ``(1 − α μ)^{K+1}`` (μ the smallest Hessian eigenvalue);
* a small conv/BatchNorm(train)/dropout network in float64: the finite-difference mixed product
  equals autograd's double-backward product with the same dropout mask, to the central
  difference's O(ε²) error;
* the optimizer adaptation: ``update_derivative`` equals central differences of torch's own
  SGD/Adam/AdamW updates with respect to the gradient;
* refusals, the pass count, buffers, and the collectives of ``distributed="exact"``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import rel
from torch import nn

import hypergrad as hg
from hypergrad import modules
from hypergrad.first_order import update_derivative

F64 = torch.float64


def _ridge(n=40, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, d, generator=g, dtype=F64), torch.randn(n, 1, generator=g, dtype=F64)
    xv, yv = torch.randn(25, d, generator=g, dtype=F64), torch.randn(25, 1, generator=g, dtype=F64)
    model = nn.Linear(d, 1, bias=False).double()
    lam = torch.linspace(-2.0, 0.0, d, dtype=F64).requires_grad_(True)

    def inner(m, batch):
        return 0.5 * ((m(x) - y) ** 2).mean() + 0.5 * (lam.exp() * m.weight[0] ** 2).sum()

    def outer(m, batch):
        return 0.5 * ((m(xv) - yv) ** 2).mean()

    H = x.T @ x / n + torch.diag(lam.detach().exp())
    with torch.no_grad():  # the inner solution, so the exact reference is the true hypergradient
        model.weight.copy_(torch.linalg.solve(H, x.T @ y / n).T)
    w = model.weight.detach()[0]
    grad_out = xv.T @ (xv @ w[:, None] - yv)[:, 0] / 25  # ∇_w L_out

    def mixed(v):  # M v = ∂²L_in/∂λ∂w · v = e^λ ⊙ w ⊙ v
        return lam.detach().exp() * w * v

    exact = -mixed(torch.linalg.solve(H, grad_out))
    return model, lam, inner, outer, H, grad_out, mixed, exact


def _first_order(model, lam, inner, outer, **kw):
    step = hg.HyperStep(model, [lam], inner, outer, method=hg.FirstOrder(**kw))
    lam.grad = None
    info = step(None)
    return lam.grad.clone(), info


@pytest.mark.parametrize("terms", [0, 1, 5])
def test_ridge_equals_the_truncated_series(terms):
    model, lam, inner, outer, H, g, mixed, exact = _ridge()
    alpha = 0.5
    v, term = alpha * g, alpha * g
    for _ in range(terms):  # α Σ_{k≤K} (I − αH)^k g
        term = term - alpha * (H @ term)
        v = v + term
    want = -mixed(v)
    got, info = _first_order(model, lam, inner, outer, alpha=alpha, terms=terms)
    assert isinstance(info, hg.FirstOrderInfo)
    assert info.passes == 3 + 2 * terms
    # central differences of a quadratic: exact but for rounding, eps / (relative step 6e-6)
    assert rel(got, want) < 1e-8
    assert info.hypergrad_norm == pytest.approx(float(want.norm()), rel=1e-8)
    assert rel(want, exact) > 1e-3  # a biased estimate: the test can tell it from the exact one


def test_ridge_bias_falls_at_the_rate_of_the_series():
    model, lam, inner, outer, H, g, mixed, exact = _ridge()
    eig = torch.linalg.eigvalsh(H)
    alpha = float(1.0 / eig[-1])
    rate = 1.0 - alpha * float(eig[0])  # ||I − αH|| on its range
    for terms in (0, 10, 60):
        got, _ = _first_order(model, lam, inner, outer, alpha=alpha, terms=terms)
        # bias = −M (H⁻¹ − P_K) g = −M (I − αH)^{K+1} H⁻¹ g: ||·|| ≤ ||M|| rate^{K+1} ||H⁻¹ g||
        m_norm = float((lam.detach().exp() * model.weight.detach()[0]).abs().max())
        bound = m_norm * rate ** (terms + 1) * float(torch.linalg.solve(H, g).norm())
        assert float((got - exact).norm()) <= bound * (1 + 1e-6) + 1e-12
    assert rel(got, exact) < 1e-3  # 60 terms: close to the exact hypergradient


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(3 * 16, 3)

    def forward(self, x):
        return self.fc(self.drop(torch.tanh(self.bn(self.conv(x))).flatten(1)))


def _network(seed=0):
    torch.manual_seed(seed)
    model, labeler = _Net().double().train(), nn.Linear(36, 3).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 1, 6, 6, generator=g, dtype=F64)
    yv = torch.randint(0, 3, (12,), generator=g)

    def inner(m, batch):
        targets = torch.softmax(labeler(x.flatten(1)), dim=1)
        return -(targets * torch.log_softmax(m(x), dim=1)).sum(1).mean()

    def outer(m, batch):
        return nn.functional.cross_entropy(m(x), yv)

    return model, labeler, inner, outer


def test_network_finite_difference_equals_the_double_backward_product():
    model, labeler, inner, outer = _network()
    psi, theta = list(model.parameters()), list(labeler.parameters())
    alpha = 0.3
    torch.manual_seed(5)
    with hg.frozen_buffers([model]):
        g_out = torch.autograd.grad(outer(model, None), psi)  # consumes the outer pass's draws
        grads = torch.autograd.grad(inner(model, None), psi, create_graph=True)
        dot = sum((gi * (alpha * go)).sum() for gi, go in zip(grads, g_out))
        want = [-m for m in torch.autograd.grad(dot, theta)]
    step = hg.HyperStep(model, labeler, inner, outer, method=hg.FirstOrder(alpha=alpha))
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    torch.manual_seed(5)
    info = step(None)
    got = [p.grad for p in theta]
    # central difference of a smooth function: relative error O(ε² ||v||²) with ε||v|| = 6e-6
    # times max(1, ||ψ||), far below 1e-6; a mask drawn anew for one side would be O(1)
    assert rel(torch.cat([t.flatten() for t in got]), torch.cat([t.flatten() for t in want])) < 1e-6
    assert info.fd_eps > 0 and info.passes == 3
    assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())  # frozen
    assert all(p.grad is None for p in psi)  # the inner model's .grad is never touched


def _derivative_by_torch(opt_factory, p, delta=1e-6):
    """Central difference of torch's own update of ``p`` w.r.t. a gradient at 0 (elementwise:
    every coordinate's update depends on its own gradient only)."""
    steps = []
    for sign in (1.0, -1.0):
        q = p.detach().clone().requires_grad_(True)
        opt = opt_factory([q])
        opt.load_state_dict(copy.deepcopy(OPT_STATE[id(p)]))
        q.grad = torch.full_like(q, sign * delta)
        opt.step()
        steps.append(q.detach() - p.detach())
    return -(steps[0] - steps[1]) / (2 * delta)


OPT_STATE: dict[int, dict] = {}

FACTORIES = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-wd": lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.01),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.2),
    "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam-l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99)),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("taken", [0, 1, 3])
def test_update_derivative_equals_torch_updates(name, taken):
    if name.startswith("adam") and taken == 0:
        pytest.skip("Adam has no second moment before its first step (refused: see below)")
    g = torch.Generator().manual_seed(2)
    p = torch.randn(7, generator=g, dtype=F64).requires_grad_(True)
    opt = FACTORIES[name]([p])
    for _ in range(taken):
        p.grad = torch.randn(7, generator=g, dtype=F64)
        opt.step()
    OPT_STATE[id(p)] = opt.state_dict()
    (got,) = update_derivative(opt, (p,))
    want = _derivative_by_torch(FACTORIES[name], p)
    # central differences: exact for SGD (affine in g); O(δ²) for Adam's second moment
    assert rel(got, want) < 1e-7
    assert bool((got > 0).all())


def test_first_order_with_the_optimizer_uses_its_update_derivative():
    model, lam, inner, outer, H, g, mixed, _ = _ridge()
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    got, _ = _first_order(model, lam, inner, outer, optimizer=opt)
    assert rel(got, -mixed(0.25 * g)) < 1e-8  # SGD: P = lr


def test_refusals():
    model, lam, inner, outer, *_ = _ridge()
    with pytest.raises(hg.HypergradValueError, match="exactly one of alpha"):
        hg.FirstOrder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(hg.HypergradValueError, match="exactly one of alpha"):
        hg.FirstOrder(alpha=0.1, optimizer=opt)
    with pytest.raises(hg.HypergradValueError, match="fd_step"):
        hg.FirstOrder(alpha=0.1, fd_step=1.0)
    with pytest.raises(hg.HypergradValueError):
        hg.FirstOrder(alpha=-1.0)
    with pytest.raises(hg.HypergradTypeError, match="torch.optim"):
        hg.FirstOrder(optimizer="sgd")
    for bad, match in [
        (torch.optim.RMSprop(model.parameters(), lr=0.1), "adapts to torch.optim.SGD"),
        (torch.optim.Adam(model.parameters(), lr=0.1), "no state yet"),
        (torch.optim.Adam(model.parameters(), lr=0.1, amsgrad=True), "amsgrad"),
        (torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1), "does not hold"),
    ]:
        step = hg.HyperStep(model, [lam], inner, outer, method=hg.FirstOrder(optimizer=bad))
        with pytest.raises((hg.HypergradTypeError, hg.HypergradValueError), match=match):
            step(None)
    with pytest.raises(hg.FrozenSettingError):
        hg.FirstOrder(alpha=0.1).terms = 3


@pytest.mark.parametrize("terms", [0, 2])
def test_distributed_exact_reduces_the_outer_gradient_once(terms, monkeypatch):
    """One parameter-sized collective for the outer gradient (one more per Richardson term) and
    one hyper-sized collective for the result."""
    model, lam, inner, outer, *_ = _ridge()
    sizes = []

    def counting(mode):
        def reduce(tree):
            sizes.append(sum(t.numel() for t in tree))
            return tree

        return reduce if mode == "exact" else None

    monkeypatch.setattr(modules, "make_reducer", counting)
    step = hg.HyperStep(
        model, [lam], inner, outer, method=hg.FirstOrder(alpha=0.5, terms=terms),
        distributed="exact",
    )  # fmt: skip
    alone, _ = _first_order(model, lam, inner, outer, alpha=0.5, terms=terms)
    sizes.clear()
    lam.grad = None
    step(None)
    n_psi, n_theta = model.weight.numel(), lam.numel()
    assert sizes == [n_psi] * (1 + terms) + [n_theta]
    assert torch.equal(lam.grad, alone)  # the identity reducer changes nothing


def test_settings_equality_and_hash():
    a, b = hg.FirstOrder(alpha=0.1, terms=2), hg.FirstOrder(alpha=0.1, terms=2)
    assert a == b and hash(a) == hash(b) and a != hg.FirstOrder(alpha=0.1)
    assert a.replace(terms=0).terms == 0
    assert math.isnan(hg.FirstOrderInfo(terms=0).fd_eps)
