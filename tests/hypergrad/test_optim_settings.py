"""Learning an optimizer's own settings through ``unrolled_grad``.

References, all independent of ``hypergrad.optim``:
* values: ``torch.optim.SGD``/``Adam``/``AdamW`` run in place in float64;
* hypergradients: central finite differences of the outer loss after T steps of ``torch.optim``
  (the setting perturbed by ±eps), and a hand-written autograd unroll of SGD with Nesterov
  momentum and of Adam, written out formula by formula in this file.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torchopt

import hypergrad as hg

F64 = torch.float64
T = 6


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(30, 5, generator=g, dtype=F64)
    y = X @ torch.randn(5, generator=g, dtype=F64) + 0.1 * torch.randn(30, generator=g, dtype=F64)
    Xv = torch.randn(20, 5, generator=g, dtype=F64)
    yv = Xv @ torch.randn(5, generator=g, dtype=F64)
    w0 = 0.5 * torch.randn(5, generator=g, dtype=F64)
    w0[0] = 0.0  # with X[:, 0] zeroed below: a parameter whose gradient is exactly zero
    X[:, 0] = 0.0
    inner = lambda w, h: 0.5 * ((X @ w - y) ** 2).mean()  # noqa: E731
    outer = lambda w, h: 0.5 * ((Xv @ w - yv) ** 2).mean()  # noqa: E731
    return inner, outer, w0


def _torch_optim_outer(make_opt, settings: dict[str, float]) -> float:
    """Outer loss after T steps of a torch.optim optimizer built from float settings."""
    inner, outer, w0 = _problem()
    w = w0.clone().requires_grad_(True)
    opt = make_opt([w], settings)
    for _ in range(T):
        opt.zero_grad()
        inner(w, None).backward()
        opt.step()
    return float(outer(w.detach(), None))


TORCH_OPTIMS = {
    "sgd": lambda ps, s: torch.optim.SGD(
        ps, lr=s["lr"], momentum=s["momentum"], dampening=s["dampening"],
        weight_decay=s["weight_decay"], nesterov=False,
    ),
    "nesterov": lambda ps, s: torch.optim.SGD(
        ps, lr=s["lr"], momentum=s["momentum"], weight_decay=s["weight_decay"], nesterov=True
    ),
    "adam": lambda ps, s: torch.optim.Adam(
        ps, lr=s["lr"], betas=(s["beta1"], s["beta2"]), eps=s["eps"],
        weight_decay=s["weight_decay"],
    ),
    "adamw": lambda ps, s: torch.optim.AdamW(
        ps, lr=s["lr"], betas=(s["beta1"], s["beta2"]), eps=s["eps"],
        weight_decay=s["weight_decay"],
    ),
}  # fmt: skip

HG_OPTIMS = {
    "sgd": lambda h: hg.optim.sgd(
        lr=h["lr"], momentum=h["momentum"], dampening=h["dampening"],
        weight_decay=h["weight_decay"],
    ),
    "nesterov": lambda h: hg.optim.sgd(
        lr=h["lr"], momentum=h["momentum"], weight_decay=h["weight_decay"], nesterov=True
    ),
    "adam": lambda h: hg.optim.adam(
        lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
        weight_decay=h.get("weight_decay", 0.0),
    ),
    "adamw": lambda h: hg.optim.adamw(
        lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"]
    ),
}  # fmt: skip

SETTINGS = {
    "sgd": {"lr": 0.2, "momentum": 0.7, "dampening": 0.3, "weight_decay": 0.05},
    "nesterov": {"lr": 0.2, "momentum": 0.8, "weight_decay": 0.02},
    "adam": {"lr": 0.05, "beta1": 0.85, "beta2": 0.97, "eps": 1e-3, "weight_decay": 0.05},
    "adamw": {"lr": 0.05, "beta1": 0.85, "beta2": 0.97, "eps": 1e-3, "weight_decay": 0.1},
}


def _hparams(settings):
    return {k: torch.tensor(v, dtype=F64) for k, v in settings.items()}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_values_match_torch_optim(name):
    """T steps of hg.optim reproduce torch.optim in float64 (same arithmetic, to rounding)."""
    inner, _, w0 = _problem()
    opt = HG_OPTIMS[name](_hparams(SETTINGS[name]))
    w = (w0.clone().requires_grad_(True),)
    state = opt.init(w)
    for _ in range(T):
        grads = torch.autograd.grad(inner(w[0], None), w)
        updates, state = opt.update(grads, state, params=w)
        w = (torch.detach(w[0] + updates[0]).requires_grad_(True),)
    ref = w0.clone().requires_grad_(True)
    topt = TORCH_OPTIMS[name]([ref], SETTINGS[name])
    for _ in range(T):
        topt.zero_grad()
        inner(ref, None).backward()
        topt.step()
    torch.testing.assert_close(w[0].detach(), ref.detach(), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_hypergradient_of_every_setting_matches_finite_differences(name):
    """d outer / d setting for every setting, against central differences of torch.optim runs."""
    inner, outer, w0 = _problem()
    settings = SETTINGS[name]
    grads, info = hg.unrolled_grad(
        inner, outer, w0, _hparams(settings), steps=T, optimizer=HG_OPTIMS[name]
    )
    assert info.truncate == T
    for key, value in settings.items():
        eps = 1e-6 * max(abs(value), 1e-3)
        plus = _torch_optim_outer(TORCH_OPTIMS[name], {**settings, key: value + eps})
        minus = _torch_optim_outer(TORCH_OPTIMS[name], {**settings, key: value - eps})
        fd = (plus - minus) / (2 * eps)
        got = float(grads[key])
        assert abs(got - fd) <= 1e-6 * max(abs(fd), 1e-6), (name, key, got, fd)


def _hand_unroll(kind: str, h: dict[str, torch.Tensor], truncate: int = T) -> torch.Tensor:
    """The outer loss after T steps written out by hand (autograd through the formulas)."""
    inner, outer, w0 = _problem()
    w = w0.clone().requires_grad_(True)
    buf = m = v = None
    for t in range(1, T + 1):
        keep = t > T - truncate
        hh = h if keep else {k: x.detach() for k, x in h.items()}
        if not keep:
            w = w.detach().requires_grad_(True)
            buf = None if buf is None else buf.detach()
            m = None if m is None else m.detach()
            v = None if v is None else v.detach()
        (g,) = torch.autograd.grad(inner(w, None), w, create_graph=keep)
        if kind == "nesterov":
            g = g + hh["weight_decay"] * w
            buf = g if buf is None else hh["momentum"] * buf + g
            w = w - hh["lr"] * (g + hh["momentum"] * buf)
        else:  # adam
            m = (1 - hh["beta1"]) * g if m is None else hh["beta1"] * m + (1 - hh["beta1"]) * g
            v = (
                (1 - hh["beta2"]) * g**2
                if v is None
                else hh["beta2"] * v + (1 - hh["beta2"]) * g**2
            )
            mhat = m / (1 - hh["beta1"] ** t)
            denom = torch.where(v > 0, v, 1.0).sqrt() * (v > 0) / (1 - hh["beta2"] ** t) ** 0.5
            w = w - hh["lr"] * mhat / (denom + hh["eps"])
    return outer(w, None)


@pytest.mark.parametrize("truncate", [T, 2])
@pytest.mark.parametrize("kind", ["nesterov", "adam"])
def test_matches_hand_written_unroll(kind, truncate):
    settings = dict(SETTINGS[kind])
    if kind == "adam":
        del settings["weight_decay"]
    h = {k: torch.tensor(x, dtype=F64, requires_grad=True) for k, x in settings.items()}
    ref = torch.autograd.grad(_hand_unroll(kind, h, truncate), list(h.values()))
    inner, outer, w0 = _problem()
    got, _ = hg.unrolled_grad(
        inner, outer, w0, _hparams(settings), steps=T, optimizer=HG_OPTIMS[kind],
        truncate=truncate,
    )  # fmt: skip
    for (key, _), r in zip(h.items(), ref):
        torch.testing.assert_close(got[key], r, rtol=1e-11, atol=1e-14, msg=key)
        assert torch.isfinite(got[key])


def test_contract_example_torchopt_log_lr():
    """DESIGN.md's example: a function of hparams returning torchopt.sgd with a tensor lr."""
    inner, outer, w0 = _problem()
    h = {"loglr": torch.tensor(-1.5, dtype=F64)}
    g1, _ = hg.unrolled_grad(
        inner, outer, w0, h, steps=T, optimizer=lambda h: torchopt.sgd(lr=h["loglr"].exp())
    )
    g2, _ = hg.unrolled_grad(
        inner, outer, w0, h, steps=T, optimizer=lambda h: hg.optim.sgd(lr=h["loglr"].exp())
    )
    lr = float(torch.tensor(-1.5, dtype=F64).exp())
    eps = 1e-6
    fd = (
        _torch_optim_outer(lambda ps, s: torch.optim.SGD(ps, lr=s["lr"]), {"lr": lr * (1 + eps)})
        - _torch_optim_outer(lambda ps, s: torch.optim.SGD(ps, lr=s["lr"]), {"lr": lr * (1 - eps)})
    ) / (2 * eps * lr)
    torch.testing.assert_close(g1["loglr"], g2["loglr"], rtol=1e-12, atol=0)
    assert abs(float(g1["loglr"]) - fd * lr) <= 1e-6 * abs(fd * lr)


def test_torchopt_tensor_weight_decay_gets_a_clear_error():
    inner, outer, w0 = _problem()
    h = {"wd": torch.tensor(0.01, dtype=F64)}
    with pytest.raises(hg.HypergradTypeError, match="hypergrad.optim"):
        hg.unrolled_grad(
            inner, outer, w0, h, steps=2,
            optimizer=lambda h: torchopt.sgd(lr=0.1, momentum=0.9, weight_decay=h["wd"]),
        )  # fmt: skip


def test_prebuilt_optimizer_with_user_tensor_explains_the_fix():
    inner, outer, w0 = _problem()
    h = {"lr": torch.tensor(0.1, dtype=F64)}
    with pytest.raises(hg.HypergradError, match="function of the hyperparameters"):
        hg.unrolled_grad(inner, outer, w0, h, steps=2, optimizer=hg.optim.sgd(lr=h["lr"]))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: hg.optim.sgd(lr=-0.1), "lr"),
        (lambda: hg.optim.sgd(lr=0.1, momentum=1.0), "momentum"),
        (lambda: hg.optim.sgd(lr=0.1, nesterov=True), "Nesterov"),
        (lambda: hg.optim.sgd(lr=torch.ones(2)), "scalar"),
        (lambda: hg.optim.adam(betas=(0.9,)), "betas"),
        (lambda: hg.optim.adam(betas=(0.9, 1.0)), "betas"),
        (lambda: hg.optim.adamw(lr="fast"), "lr"),
    ],
)
def test_bad_settings_are_refused(make, match):
    with pytest.raises(hg.HypergradError, match=match):
        make()


def test_bad_optimizer_arguments_are_refused():
    inner, outer, w0 = _problem()
    h = torch.tensor(0.1, dtype=F64)
    with pytest.raises(hg.HypergradTypeError, match="functional optimizer"):
        hg.unrolled_grad(inner, outer, w0, h, steps=2, optimizer=0.1)
    with pytest.raises(hg.HypergradTypeError, match="must return a functional optimizer"):
        hg.unrolled_grad(inner, outer, w0, h, steps=2, optimizer=lambda h: 0.1)


# --------------------------------------------------------------------------------------------
# settings: finite and in torch.optim's range when built; tensors re-checked at each step
# --------------------------------------------------------------------------------------------
_BUILD = {
    "sgd": lambda s: hg.optim.sgd(**{"lr": 0.1, **s}),
    "adam": lambda s: hg.optim.adam(**s),
    "adamw": lambda s: hg.optim.adamw(**s),
}
_FIELDS = {
    "sgd": ["lr", "momentum", "dampening", "weight_decay"],
    "adam": ["lr", "beta1", "beta2", "eps", "weight_decay"],
    "adamw": ["lr", "beta1", "beta2", "eps", "weight_decay"],
}
_CASES = [(o, f) for o, fields in _FIELDS.items() for f in fields]


def _build(opt: str, field: str, value):
    if field in ("beta1", "beta2"):
        betas = [0.9, 0.999]
        betas[field == "beta2"] = value
        return _BUILD[opt]({"betas": tuple(betas)})
    return _BUILD[opt]({field: value})


@pytest.mark.parametrize("as_tensor", [False, True], ids=["number", "tensor"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(("opt", "field"), _CASES, ids=[f"{o}-{f}" for o, f in _CASES])
def test_non_finite_settings_are_refused(opt, field, bad, as_tensor):
    """eps=inf used to build an Adam that never moves; every setting must be finite."""
    value = torch.tensor(bad, dtype=F64) if as_tensor else bad
    name = {"beta1": "betas[0]", "beta2": "betas[1]"}.get(field, field)
    with pytest.raises(hg.HypergradValueError, match=rf"{re.escape(name)} must be"):
        _build(opt, field, value)


_OUT_OF_RANGE = [
    ("sgd", "lr", -1e-3), ("sgd", "momentum", -0.1), ("sgd", "momentum", 1.0),
    ("sgd", "dampening", -0.1), ("sgd", "dampening", 1.5), ("sgd", "weight_decay", -1e-4),
    ("adam", "lr", -1e-3), ("adam", "beta1", -0.1), ("adam", "beta1", 1.0),
    ("adam", "beta2", 1.0), ("adam", "eps", -1e-8), ("adam", "weight_decay", -0.1),
    ("adamw", "beta2", 1.5), ("adamw", "eps", -1e-8), ("adamw", "weight_decay", -0.1),
]  # fmt: skip


@pytest.mark.parametrize("as_tensor", [False, True], ids=["number", "tensor"])
@pytest.mark.parametrize(("opt", "field", "value"), _OUT_OF_RANGE)
def test_out_of_range_settings_are_refused(opt, field, value, as_tensor):
    v = torch.tensor(value, dtype=F64) if as_tensor else value
    with pytest.raises(hg.HypergradValueError, match="must be"):
        _build(opt, field, v)


def test_edges_of_the_ranges_are_accepted():
    hg.optim.sgd(lr=0.0, momentum=0.0, dampening=1.0, weight_decay=0.0)
    hg.optim.adam(lr=0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)


def _steps(opt, n=3):
    p = (torch.ones(3, dtype=F64),)
    state = opt.init(p)
    for _ in range(n):
        _, state = opt.update((p[0].clone(),), state, params=p)


@pytest.mark.parametrize("make", [hg.optim.sgd, hg.optim.adam, hg.optim.adamw])
def test_learned_lr_turning_negative_warns_once(make, recwarn):
    """An optimizer built from a learned lr tensor that an outer optimizer then steps below
    zero: the inner steps would ascend; update() warns, once per optimizer."""
    lr = torch.tensor(0.05, dtype=F64, requires_grad=True)
    opt = make(lr=lr)
    _steps(opt)  # in range: no warning
    assert not [w for w in recwarn if issubclass(w.category, hg.HypergradWarning)]
    outer = torch.optim.SGD([lr], lr=1.0)
    lr.grad = torch.tensor(0.2, dtype=F64)
    outer.step()  # lr = -0.15
    with pytest.warns(hg.optim.OptimizerSettingWarning, match=r"lr .*-0\.15.*ascend") as rec:
        _steps(opt, 4)
    assert len([w for w in rec if w.category is hg.optim.OptimizerSettingWarning]) == 1
    assert issubclass(hg.optim.OptimizerSettingWarning, hg.HypergradWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _steps(opt)  # once per optimizer: already warned
    with pytest.raises(hg.HypergradValueError, match="lr must be >= 0"):
        make(lr=lr)  # a new optimizer from the negative value is refused outright


def test_tensor_beta_becoming_nan_warns_and_numbers_are_never_rechecked():
    b1 = torch.tensor(0.9, dtype=F64)
    opt = hg.optim.adam(betas=(b1, 0.999))
    b1.fill_(float("nan"))
    with pytest.warns(hg.optim.OptimizerSettingWarning, match=r"betas\[0\] is not finite"):
        _steps(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _steps(hg.optim.sgd(lr=0.1, momentum=0.9))  # plain numbers: nothing to re-check
        _steps(hg.optim.sgd(lr=torch.tensor(-2.0, dtype=F64).exp()))  # log-lr: always > 0
