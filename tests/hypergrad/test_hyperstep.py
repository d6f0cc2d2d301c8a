"""HyperStep on CNNs with BatchNorm (train mode) and dropout.

* determinism: identical seeds give identical hypergradients, reuse == recompute engines;
* buffer policy: running statistics bit-identical with "freeze", changed with "update";
* the inner model's .grad is never touched; clip_norm and accumulate;
* numbers: a ~50-parameter conv/BN/linear network against a dense float64 computation built from
  the full Hessian and mixed-partial blocks (torch.autograd.functional on flat vectors).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import rel as _rel
from torch import nn

import hypergrad as hg

F64 = torch.float64


class Net(nn.Module):
    def __init__(self, ch=4, size=6, classes=3, p=0.3, act=torch.relu):
        super().__init__()
        self.conv = nn.Conv2d(1, ch, 3)
        self.bn = nn.BatchNorm2d(ch)
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(ch * (size - 2) ** 2, classes)
        self.act = act
        with torch.no_grad():  # non-trivial affine BN parameters
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.3, 0.3)

    def forward(self, x):
        h = self.act(self.bn(self.conv(x))).flatten(1)
        return self.fc(self.drop(h))


def _batch(n, size, seed, classes=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, size, size, generator=g, dtype=F64)
    y = torch.randint(0, classes, (n,), generator=g)
    return {"x": x, "y": y}


def _losses(labeler, wd):
    def inner(model, batch):
        x = batch["x"]
        targets = torch.softmax(labeler(x.flatten(1)), dim=1)
        ce = -(targets * torch.log_softmax(model(x), dim=1)).sum(1).mean()
        return ce + wd * sum((p**2).sum() for p in model.parameters())

    def outer(model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"])

    return inner, outer


def _setup(seed=0, p=0.3, solver=None, engine="reuse", **kw):
    torch.manual_seed(seed)
    model = Net(p=p).double().train()
    labeler = nn.Linear(36, 3).double()
    inner, outer = _losses(labeler, 1e-2)
    solver = solver or hg.Neumann(maxiter=5, alpha=0.05)
    method = hg.Implicit(solver=solver, engine=engine)
    step = hg.HyperStep(model, labeler, inner, outer, method=method, **kw)
    return model, labeler, step


def _buffers(model):
    return {k: v.clone() for k, v in model.named_buffers()}


def _hgrad(labeler):
    return torch.cat([p.grad.reshape(-1) for p in labeler.parameters()])


# --------------------------------------------------------------------------- determinism


def test_same_seed_gives_identical_hypergradients_and_dropout_matters():
    model, labeler, step = _setup()
    batch, val = _batch(16, 6, 1), _batch(12, 6, 2)
    grads = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        info = step(batch, val)
        assert not info.solve.diverged
        grads.append(_hgrad(labeler).clone())
    assert torch.equal(grads[0], grads[1])
    assert float(grads[0].norm()) > 0
    # another seed draws other dropout masks: a different hypergradient
    assert _rel(grads[2], grads[0]) > 1e-3


def test_reuse_and_recompute_engines_agree_with_dropout_and_bn():
    batch, val = _batch(16, 6, 3), _batch(12, 6, 4)
    out = {}
    for engine in ("reuse", "recompute"):
        model, labeler, step = _setup(engine=engine)
        torch.manual_seed(11)
        step(batch, val)
        out[engine] = _hgrad(labeler).clone()
        # the caller's RNG stream advances identically with both engines
        out[engine + "_rng"] = torch.rand(4)
    assert _rel(out["recompute"], out["reuse"]) <= 1e-10
    assert torch.equal(out["reuse_rng"], out["recompute_rng"])


def test_every_product_sees_the_same_dropout_mask():
    # Build the Hessian of a dropout network column by column (one product per column). If any
    # product drew a fresh mask the columns would come from different Hessians and the matrix
    # would not be symmetric; with the contract's "same draws" it is, for both engines.
    from hypergrad.solvers import dense_matrix

    torch.manual_seed(30)
    model = Net(ch=2, size=5, p=0.5).double().train()
    labeler = nn.Linear(25, 3).double()
    inner, _ = _losses(labeler, 1e-2)
    x = {"x": _batch(12, 5, 31)["x"]}
    psi, theta = tuple(model.parameters()), tuple(labeler.parameters())
    mats = {}
    for engine in ("reuse", "recompute"):
        torch.manual_seed(32)
        op = hg.InnerOperator(lambda ps, hs: inner(model, x), psi, theta, engine=engine)
        mats[engine] = dense_matrix(op.hvp, psi)
    for m in mats.values():
        assert float((m - m.T).abs().max()) <= 1e-12 * float(m.abs().max())
    assert float((mats["reuse"] - mats["recompute"]).abs().max()) <= 1e-12

    # the check has teeth: products that re-draw the mask give a non-symmetric matrix
    def redraw_hvp(v):
        loss = inner(model, x)
        g = torch.autograd.grad(loss, psi, create_graph=True)
        return tuple(t.detach() for t in torch.autograd.grad(g, psi, v))

    bad = dense_matrix(redraw_hvp, psi)
    assert float((bad - bad.T).abs().max()) > 1e-6 * float(bad.abs().max())


# --------------------------------------------------------------------------- buffers / grads


def test_freeze_keeps_running_stats_bit_identical():
    model, labeler, step = _setup(buffers="freeze")
    # give the running stats non-default values first
    with torch.no_grad():
        model(_batch(16, 6, 6)["x"])
    before = _buffers(model)
    ids = {k: id(v) for k, v in model.named_buffers()}
    torch.manual_seed(0)
    step(_batch(16, 6, 7), _batch(8, 6, 8))
    after = _buffers(model)
    assert set(before) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert {k: id(v) for k, v in model.named_buffers()} == ids
    assert model.training


def test_freeze_covers_the_hyper_module_buffers_too():
    torch.manual_seed(0)
    model = Net().double().train()
    labeler = nn.Sequential(nn.Linear(36, 3), nn.BatchNorm1d(3)).double().train()
    inner, outer = _losses(labeler, 1e-2)
    with torch.no_grad():
        labeler(torch.randn(8, 36, dtype=F64))
    before_m, before_l = _buffers(model), _buffers(labeler)
    step = hg.HyperStep(model, labeler, inner, outer, solver=hg.Neumann(maxiter=3, alpha=0.05))
    torch.manual_seed(0)
    step(_batch(16, 6, 14))
    for k, v in _buffers(labeler).items():
        assert torch.equal(v, before_l[k]), k
    for k, v in _buffers(model).items():
        assert torch.equal(v, before_m[k]), k
    assert all(p.grad is not None for p in labeler.parameters())


def test_update_changes_running_stats():
    model, labeler, step = _setup(buffers="update")
    before = _buffers(model)
    torch.manual_seed(0)
    step(_batch(16, 6, 9))
    after = _buffers(model)
    assert not torch.equal(before["bn.running_mean"], after["bn.running_mean"])
    assert not torch.equal(before["bn.running_var"], after["bn.running_var"])
    assert int(after["bn.num_batches_tracked"]) > int(before["bn.num_batches_tracked"])


def test_freeze_and_update_give_the_same_hypergradient():
    batch = _batch(16, 6, 10)
    res = []
    for buffers in ("freeze", "update"):
        model, labeler, step = _setup(buffers=buffers)
        torch.manual_seed(3)
        step(batch)
        res.append(_hgrad(labeler).clone())
    assert _rel(res[1], res[0]) <= 1e-12  # train-mode BN normalises with batch statistics


def test_inner_grad_untouched():
    model, labeler, step = _setup()
    preset = {n: torch.full_like(p, 0.25) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = preset[n].clone()
    torch.manual_seed(0)
    step(_batch(8, 6, 11))
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, preset[n]), n
    model2, labeler2, step2 = _setup()
    torch.manual_seed(0)
    step2(_batch(8, 6, 11))
    assert all(p.grad is None for p in model2.parameters())
    assert all(p.grad is not None for p in labeler2.parameters())


def test_clip_norm_rescales_exactly():
    batch = _batch(16, 6, 12)
    model, labeler, step = _setup()
    torch.manual_seed(1)
    raw, info = step.compute(batch)
    assert all(p.grad is None for p in labeler.parameters())  # compute() does not write .grad
    raw = torch.cat([h.reshape(-1) for h in raw])
    norm = float(raw.norm())
    clip = 0.37 * norm
    model, labeler, step = _setup(clip_norm=clip)
    torch.manual_seed(1)
    info = step(batch)
    g = _hgrad(labeler)
    assert info.clipped
    assert float(g.norm()) == pytest.approx(clip, rel=1e-10)
    assert _rel(g, raw * (clip / norm)) <= 1e-10
    # a larger clip value leaves the hypergradient unchanged
    model, labeler, step = _setup(clip_norm=10 * norm)
    torch.manual_seed(1)
    info = step(batch)
    assert not info.clipped
    assert _rel(_hgrad(labeler), raw) <= 1e-12


def test_accumulate_adds():
    batch = _batch(16, 6, 13)
    model, labeler, step = _setup()
    torch.manual_seed(2)
    step(batch)
    g = _hgrad(labeler).clone()
    model, labeler, step = _setup(accumulate=True)
    g0 = [torch.randn_like(p) for p in labeler.parameters()]
    for p, a in zip(labeler.parameters(), g0):
        p.grad = a.clone()
    torch.manual_seed(2)
    step(batch)
    assert _rel(_hgrad(labeler), g + torch.cat([a.reshape(-1) for a in g0])) <= 1e-12
    # without accumulate the old .grad is overwritten
    model, labeler, step = _setup(accumulate=False)
    for p, a in zip(labeler.parameters(), g0):
        p.grad = a.clone()
    torch.manual_seed(2)
    step(batch)
    assert _rel(_hgrad(labeler), g) <= 1e-12


# --------------------------------------------------------------------------- dense reference


SHAPES = [(2, 1, 3, 3), (2,), (2,), (2,), (3, 8), (3,)]  # conv, conv bias, BN w/b, fc


def _split(vec, shapes):
    out, i = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        out.append(vec[i : i + n].reshape(s))
        i += n
    return out


def _tiny_forward(psi, x):
    cw, cb, bw, bb, fw, fb = _split(psi, SHAPES)
    h = F.conv2d(x, cw, cb)
    h = F.batch_norm(h, None, None, bw, bb, training=True, eps=1e-5)
    return F.linear(torch.tanh(h).flatten(1), fw, fb)


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


@pytest.mark.parametrize("hyper_kind", ["module", "tensors"])
def test_tiny_network_matches_dense_float64(hyper_kind):
    torch.manual_seed(21)
    model = Net(ch=2, size=4, p=0.0, act=torch.tanh).double().train()
    labeler = nn.Linear(16, 3).double()
    omega = torch.randn(10, dtype=F64, requires_grad=True)  # per-example weights
    assert [tuple(p.shape) for p in model.parameters()] == SHAPES
    n_psi = sum(p.numel() for p in model.parameters())
    assert 40 <= n_psi <= 60
    batch, val = _batch(10, 4, 22), _batch(9, 4, 23)
    wd = 0.05

    def inner_ref(psi, lab_flat, om, x):
        W, b = lab_flat[:48].reshape(3, 16), lab_flat[48:]
        targets = torch.softmax(F.linear(x.flatten(1), W, b), dim=1)
        ce = -(targets * torch.log_softmax(_tiny_forward(psi, x), dim=1)).sum(1)
        return (torch.sigmoid(om) * ce).mean() + wd * (psi**2).sum()

    def inner(m, bt):
        x = bt["x"]
        targets = torch.softmax(labeler(x.flatten(1)), dim=1)
        ce = -(targets * torch.log_softmax(m(x), dim=1)).sum(1)
        return (torch.sigmoid(omega) * ce).mean() + wd * sum((p**2).sum() for p in m.parameters())

    def outer(m, bt):
        return F.cross_entropy(m(bt["x"]), bt["y"])

    psi0, lab0, om0 = _flat(model), _flat(labeler), omega.detach().clone()
    x, xv, yv = batch["x"], val["x"], val["y"]
    with torch.no_grad():  # the hand-written forward is the module's forward
        torch.testing.assert_close(_tiny_forward(psi0, x), model(x), rtol=1e-13, atol=1e-13)

    H = torch.autograd.functional.hessian(lambda p: inner_ref(p, lab0, om0, x), psi0)
    if hyper_kind == "module":
        theta0 = lab0

        def grad_psi(theta):
            p = psi0.clone().requires_grad_(True)
            return torch.autograd.grad(inner_ref(p, theta, om0, x), p, create_graph=True)[0]
    else:
        theta0 = om0

        def grad_psi(theta):
            p = psi0.clone().requires_grad_(True)
            return torch.autograd.grad(inner_ref(p, lab0, theta, x), p, create_graph=True)[0]

    M = torch.autograd.functional.jacobian(grad_psi, theta0)  # (n_psi, n_theta)
    p = psi0.clone().requires_grad_(True)
    g_out = torch.autograd.grad(F.cross_entropy(_tiny_forward(p, xv), yv), p)[0]
    ref = -M.T @ torch.linalg.solve(H, g_out)
    assert float(torch.linalg.cond(H)) < 1e6

    hyper = labeler if hyper_kind == "module" else [omega]
    before = _buffers(model)
    step = hg.HyperStep(model, hyper, inner, outer, solver=hg.Exact())
    info = step(batch, val)
    got = _hgrad(labeler) if hyper_kind == "module" else omega.grad.clone()
    assert _rel(got, ref) <= 1e-8
    assert info.solve.converged
    for k, v in _buffers(model).items():
        assert torch.equal(v, before[k])
    # an iterative solver reaches the same answer (the Hessian may be indefinite: MINRES)
    if hyper_kind == "module":
        for q in labeler.parameters():
            q.grad = None
    else:
        omega.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hg.HyperStep(model, hyper, inner, outer, solver=hg.MINRES(tol=1e-12, maxiter=500))(
            batch, val
        )
    got = _hgrad(labeler) if hyper_kind == "module" else omega.grad
    assert _rel(got, ref) <= 1e-7
