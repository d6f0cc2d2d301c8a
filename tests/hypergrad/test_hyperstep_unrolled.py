"""``HyperStep(method=hg.Unrolled(...))``: the look-ahead hypergradient of Meta-Weight-Net / DARTS.

References: the functional ``unrolled_grad`` over the same network through
``torch.func.functional_call`` (same numbers to rounding, float64), and central finite differences
of a look-ahead written out by hand in this file (plain SGD steps on detached copies).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import hypergrad as hg

F64 = torch.float64


def _setup(seed: int = 0, dropout: float = 0.0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Dropout(dropout), nn.Linear(6, 3)
    ).to(F64)
    # Meta-Weight-Net: per-example loss -> weight in (0, 1)
    wnet = nn.Sequential(nn.Linear(1, 5), nn.Tanh(), nn.Linear(5, 1), nn.Sigmoid()).to(F64)
    g = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(16, 4, generator=g, dtype=F64), torch.randint(0, 3, (16,), generator=g)
    xv, yv = torch.randn(12, 4, generator=g, dtype=F64), torch.randint(0, 3, (12,), generator=g)
    return model, wnet, (x, y), (xv, yv)


def _weighted(logits, y, wnet_out, detach=True):
    """Meta-Weight-Net's weighted loss; its authors feed the weighting net a detached loss."""
    losses = F.cross_entropy(logits, y, reduction="none")
    feature = losses.detach() if detach else losses
    return (wnet_out(feature.unsqueeze(1)).squeeze(1) * losses).mean()


def mwn_inner(wnet, detach=True):
    return lambda m, b: _weighted(m(b[0]), b[1], wnet, detach)


def outer(m, b):
    return F.cross_entropy(m(b[0]), b[1])


@pytest.mark.parametrize("steps, truncate", [(1, None), (3, None), (3, 1)])
def test_matches_functional_unrolled_grad(steps, truncate):
    model, wnet, batch, val = _setup()
    opt = hg.optim.sgd(lr=0.3, momentum=0.5)
    step = hg.HyperStep(
        model, wnet, mwn_inner(wnet), outer,
        method=hg.Unrolled(opt, steps=steps, truncate=truncate),
    )  # fmt: skip
    hyper, info = step.compute(batch, val)
    assert isinstance(info, hg.UnrolledInfo) and info.steps == steps

    params0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    hparams = {k: v.detach().clone() for k, v in wnet.named_parameters()}
    frozen = copy.deepcopy(model)  # its running statistics may change; model's must not matter

    def inner_f(p, h):
        logits = functional_call(frozen, p, (batch[0],))
        losses = F.cross_entropy(logits, batch[1], reduction="none")
        w = functional_call(wnet, h, (losses.detach().unsqueeze(1),)).squeeze(1)
        return (w * losses).mean()

    def outer_f(p, h):
        return F.cross_entropy(functional_call(frozen, p, (val[0],)), val[1])

    ref, rinfo = hg.unrolled_grad(
        inner_f, outer_f, params0, hparams, steps=steps, optimizer=opt, truncate=truncate
    )
    for (name, _), h in zip(wnet.named_parameters(), hyper):
        torch.testing.assert_close(h, ref[name], rtol=1e-12, atol=1e-15, msg=name)
    assert info.inner_losses == pytest.approx(rinfo.inner_losses, rel=1e-13)
    assert info.outer_loss == pytest.approx(rinfo.outer_loss, rel=1e-13)


def _lookahead_outer(model, wnet, batch, val, lr, steps):
    """Outer loss after `steps` plain SGD steps on detached copies of the model (no graph)."""
    m = copy.deepcopy(model)
    for _ in range(steps):
        params = [p for p in m.parameters()]
        grads = torch.autograd.grad(_weighted(m(batch[0]), batch[1], wnet, False), params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= lr * g
    with torch.no_grad():
        return float(outer(m, val))


@pytest.mark.parametrize("steps", [1, 2])
def test_matches_central_differences(steps):
    """Without the detach: beyond one step the weighting net's input depends on theta through
    psi_1, and a detached input would hide that path (see the next test)."""
    model, wnet, batch, val = _setup(seed=3)
    lr = 0.5
    step = hg.HyperStep(
        model, wnet, mwn_inner(wnet, detach=False), outer,
        method=hg.Unrolled(hg.optim.sgd(lr=lr), steps=steps),
    )  # fmt: skip
    hyper, _ = step.compute(batch, val)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        d = [torch.randn(p.shape, generator=g, dtype=F64) for p in wnet.parameters()]
        eps = 1e-5
        vals = []
        for sign in (1.0, -1.0):
            shifted = copy.deepcopy(wnet)
            with torch.no_grad():
                for p, di in zip(shifted.parameters(), d):
                    p += sign * eps * di
            vals.append(_lookahead_outer(model, shifted, batch, val, lr, steps))
        fd = (vals[0] - vals[1]) / (2 * eps)
        analytic = sum(float((h * di).sum()) for h, di in zip(hyper, d))
        assert analytic == pytest.approx(fd, rel=1e-6, abs=1e-10)


def test_detached_input_is_exact_for_one_step_only():
    """The authors' detach is harmless for one look-ahead step (the input is the loss at psi_0,
    independent of theta) and wrong for two; hypergrad.testing-style differences see it."""
    model, wnet, batch, val = _setup(seed=3)
    out = {}
    for detach in (True, False):
        step = hg.HyperStep(
            model, wnet, mwn_inner(wnet, detach), outer,
            method=hg.Unrolled(hg.optim.sgd(lr=0.5), steps=2),
        )  # fmt: skip
        out[detach] = step.compute(batch, val)[0]
    gap = max(float((a - b).abs().max()) for a, b in zip(out[True], out[False]))
    assert gap > 1e-4


def test_model_buffers_and_grads_untouched_with_freeze_changed_with_update():
    model, wnet, batch, val = _setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = hg.HyperStep(
        model, wnet, mwn_inner(wnet), outer, method=hg.Unrolled(hg.optim.sgd(lr=0.1))
    )
    info = step(batch, val)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # parameters and running statistics
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in wnet.parameters())
    assert isinstance(model[4].weight, nn.Parameter)  # the swap was undone
    assert info.time_s > 0
    hg.HyperStep(
        model, wnet, mwn_inner(wnet), outer, method=hg.Unrolled(hg.optim.sgd(lr=0.1)),
        buffers="update",
    )(batch, val)  # fmt: skip
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])


def test_dropout_draws_match_the_functional_path():
    """With dropout on, both paths consume the RNG in the same order: equal numbers."""
    model, wnet, batch, val = _setup(dropout=0.3)
    opt = hg.optim.sgd(lr=0.3)
    torch.manual_seed(11)
    hyper, _ = hg.HyperStep(model, wnet, mwn_inner(wnet), outer, method=hg.Unrolled(opt)).compute(
        batch, val
    )
    params0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    hparams = {k: v.detach().clone() for k, v in wnet.named_parameters()}

    def inner_f(p, h):
        logits = functional_call(model, p, (batch[0],))
        losses = F.cross_entropy(logits, batch[1], reduction="none")
        return (
            functional_call(wnet, h, (losses.detach().unsqueeze(1),)).squeeze(1) * losses
        ).mean()

    torch.manual_seed(11)
    with hg.frozen_buffers([model]):
        ref, _ = hg.unrolled_grad(
            inner_f, lambda p, h: F.cross_entropy(functional_call(model, p, (val[0],)), val[1]),
            params0, hparams, steps=1, optimizer=opt,
        )  # fmt: skip
    for (name, _), h in zip(wnet.named_parameters(), hyper):
        torch.testing.assert_close(h, ref[name], rtol=1e-12, atol=1e-15)


def test_learning_the_lookahead_learning_rate():
    """optimizer as a function of the hyper tensors: d outer / d log lr vs central differences."""
    model, _, batch, val = _setup(seed=5)
    log_lr = torch.tensor(-1.0, dtype=F64, requires_grad=True)
    start = -1.0
    inner = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
    step = hg.HyperStep(
        model, [log_lr], inner, outer,
        method=hg.Unrolled(lambda hs: hg.optim.sgd(lr=hs[0].exp()), steps=2),
    )  # fmt: skip
    step(batch, val)
    fixed = nn.Sequential(nn.Linear(1, 1))  # a weighting net that returns a constant 1
    with torch.no_grad():
        fixed[0].weight.zero_()
        fixed[0].bias.fill_(1.0)
    fixed = fixed.to(F64)
    eps = 1e-6
    fd = (
        _lookahead_outer(model, fixed, batch, val, math.exp(start + eps), 2)
        - _lookahead_outer(model, fixed, batch, val, math.exp(start - eps), 2)
    ) / (2 * eps)
    assert float(log_lr.grad) == pytest.approx(fd, rel=1e-6)


SGD = hg.optim.sgd(lr=0.1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (lambda: {"method": hg.Unrolled()}, "needs optimizer"),
        (lambda: {"method": hg.Unrolled(0.1)}, "functional optimizer"),
        (lambda: {"method": hg.Unrolled(SGD), "solver": hg.CG()}, "no solver"),
        (lambda: {"method": hg.Unrolled(SGD, steps=0)}, "steps"),
        (lambda: {"method": hg.Unrolled(SGD, truncate=2)}, "truncate"),
        (lambda: {"method": hg.Unrolled(SGD), "distributed": "exact"}, "local"),
        (lambda: {"method": "unrolled"}, r"not a name \(pass method=hg.Unrolled\(optimizer"),
        (lambda: {"method": "lookahead"}, "method must be hg.Implicit"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    model, wnet, _, _ = _setup()
    with pytest.raises(hg.HypergradError, match=match):
        hg.HyperStep(model, wnet, mwn_inner(wnet), outer, **kwargs())


def test_the_old_keywords_are_not_arguments():
    """steps=, optimizer=, truncate= belong to hg.Unrolled: HyperStep has no such keywords."""
    model, wnet, _, _ = _setup()
    for old in ({"steps": 2}, {"optimizer": SGD}, {"truncate": 1}):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(old))}'"):
            hg.HyperStep(model, wnet, mwn_inner(wnet), outer, **old)


def test_hyper_not_used_is_an_error():
    model, wnet, batch, val = _setup()
    unused = nn.Linear(2, 2).to(F64)
    step = hg.HyperStep(
        model, unused, lambda m, b: F.cross_entropy(m(b[0]), b[1]), outer,
        method=hg.Unrolled(hg.optim.sgd(lr=0.1)),
    )  # fmt: skip
    with pytest.raises(hg.HypergradError, match="silently zero"):
        step(batch, val)


def test_check_hyperstep_refuses_an_unrolled_step():
    import hypergrad.testing as hgt

    model, wnet, batch, val = _setup()
    step = hg.HyperStep(
        model, wnet, mwn_inner(wnet), outer, method=hg.Unrolled(hg.optim.sgd(lr=0.1))
    )
    with pytest.raises(hg.HypergradValueError, match="look-ahead"):
        hgt.check_hyperstep(step, batch, lambda hyper: None, val)
