"""A solution at a kink of a prox/projection operator is reported (issue 30 item 6).

At a lasso solution with a coordinate exactly at its threshold the solution map is not
differentiable: autograd returns one one-sided derivative, jaxopt the other. The implicit entry
points now count such coordinates (``info.extras["kinks"]``) and warn with
``NonDifferentiableWarning``. Problems with closed forms: ``f(w) = ½‖w − y‖²`` with the lasso
penalty has ``w* = soft(y, λ)``, at a kink where ``|y_i| = λ``; with a box ``w* = clamp(y)``, at a
kink where ``y_i`` equals a bound.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hypergrad as hg

DT = torch.float64


def _lasso_layer(y: torch.Tensor):
    f = lambda w, _: 0.5 * ((w - y) ** 2).sum()  # noqa: E731
    T = hg.conditions.proximal_gradient(f, hg.prox.prox_lasso, 1.0)

    @hg.custom_fixed_point(T, solver=hg.Exact())
    def solve(h):
        lam = h[1]
        return torch.sign(y) * torch.relu(y.abs() - lam)  # the closed form

    return solve


@pytest.mark.parametrize(("y", "expected"), [((3.0, 1.0, -2.0), 1), ((3.0, 0.5, -2.0), 0)])
def test_lasso_coordinate_at_its_threshold_is_counted_and_warned(y, expected) -> None:
    solve = _lasso_layer(torch.tensor(y, dtype=DT))
    lam = torch.tensor(1.0, dtype=DT, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        solve(((), lam)).sum().backward()
    kinds = [w.category for w in caught]
    assert solve.last_info.extras["kinks"] == expected
    assert (hg.NonDifferentiableWarning in kinds) == (expected > 0)
    # away from kinks the derivative is the closed form: d/dλ Σ soft(y, λ) = −Σ sign(y_i) on
    # the support, here −(1 − 1) = 0 for y = (3, ·, −2) (the middle coordinate is 0 or at 0)
    assert float(lam.grad) == pytest.approx(0.0, abs=1e-12)


def test_forward_mode_reports_the_kink_too() -> None:
    solve = _lasso_layer(torch.tensor([3.0, 1.0], dtype=DT))
    lam = torch.tensor(1.0, dtype=DT)
    with pytest.warns(hg.NonDifferentiableWarning):
        torch.func.jvp(lambda l: solve(((), l)), (lam,), (torch.ones((), dtype=DT),))
    assert solve.last_info.extras["kinks"] == 1


def test_box_bound_touched_exactly_is_counted() -> None:
    y = torch.tensor([0.5, 1.0, 2.0], dtype=DT)  # upper bound 1: the second sits on it
    loss = lambda w, c: 0.5 * ((w - c) ** 2).sum()  # noqa: E731
    T = hg.conditions.projected_gradient(loss, hg.prox.projection_box, 0.5)

    @hg.custom_fixed_point(T, solver=hg.Exact())
    def solve(h):
        return h[0].clamp(0.0, 1.0)

    c = y.clone().requires_grad_(True)
    with pytest.warns(hg.NonDifferentiableWarning, match="1 coordinate"):
        solve((c, (0.0, 1.0))).sum().backward()
    assert solve.last_info.extras["kinks"] == 1
    # 1 inside the box, 0 where clamped; at the bound itself autograd's choice (torch splits a
    # tie of clamp's bound evenly: here 1/3, neither one-sided limit, which is why it warns)
    g = c.grad.tolist()
    assert g[0] == pytest.approx(1.0, abs=1e-12) and g[2] == pytest.approx(0.0, abs=1e-12)
    assert 0.0 <= g[1] <= 1.0


def test_an_unknown_operator_reports_none_and_does_not_warn() -> None:
    y = torch.tensor([3.0, 1.0], dtype=DT)
    f = lambda w, _: 0.5 * ((w - y) ** 2).sum()  # noqa: E731
    soft = lambda x, lam, s: torch.sign(x) * torch.relu(x.abs() - s * lam)  # noqa: E731
    T = hg.conditions.proximal_gradient(f, soft, 1.0)

    @hg.custom_fixed_point(T, solver=hg.Exact())
    def solve(h):
        return torch.sign(y) * torch.relu(y.abs() - h[1])

    lam = torch.tensor(1.0, dtype=DT, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hg.NonDifferentiableWarning)
        solve(((), lam)).sum().backward()
    assert solve.last_info.extras["kinks"] is None


def test_inner_proximal_gradient_reports_the_kink() -> None:
    y = torch.tensor([3.0, 1.0, -2.0], dtype=DT)
    f = lambda w, _: 0.5 * ((w - y) ** 2).sum()  # noqa: E731
    lasso = hg.inner.ProximalGradient(f, hg.prox.prox_lasso, tol=1e-12)
    lam = torch.tensor(1.0, dtype=DT, requires_grad=True)
    with pytest.warns(hg.NonDifferentiableWarning):
        lasso.run(torch.zeros(3, dtype=DT), ((), lam)).sum().backward()
    assert lasso.last_implicit_info.extras["kinks"] == 1
    lam2 = torch.tensor(0.5, dtype=DT, requires_grad=True)  # no coordinate at |y_i| = 0.5
    lasso.run(torch.zeros(3, dtype=DT), ((), lam2)).sum().backward()
    assert lasso.last_implicit_info.extras["kinks"] == 0
    assert float(lam2.grad) == pytest.approx(-1.0, abs=1e-9)  # −Σ sign(y_i) over 3 actives
