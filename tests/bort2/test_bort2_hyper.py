"""BORT²'s hyper step (examples/bort2/bort2/step2/hyper.py) against a plain re-implementation,
written here, of the update in the authors' code (``fixmatch_mscm_dist_net_meta_learn_retrain.py``
lines 373-417, ``utils/implicit_diff.py`` and ``utils/meta_optim.py``): one forward of F_θ in
train mode, a Gumbel sample, one forward of M_ψ, the AuxiLearn Neumann series, clip, SGD.

All four combinations of ``step2.hyper.convention`` x ``official_sign`` are checked to float64
precision, on a tiny digit CNN with BatchNorm and dropout in both networks, including the
running statistics that the authors' forward passes update."""

import copy

import pytest
import torch
import torch.nn.functional as F
from bort2.config import ConfigError, HyperConfig, Step2Config
from bort2.models import DigitCNN
from bort2.step2 import (
    AuthorsNeumann,
    BilevelLabelUpdater,
    build_student,
    build_threshold,
    current_mask,
)

import hypergrad as hg

GSEED = 11


def _s2(hinge_reduction="mean", **hyper):
    """The ``step2`` configuration the hyper step reads: its ``hyper`` section from ``hyper``."""
    return Step2Config(hinge_reduction=hinge_reduction, hyper=HyperConfig(**hyper))


pytestmark = pytest.mark.usefixtures("one_thread")


def _gumbel_hard(logits, gen):
    """Straight-through Gumbel-softmax, written independently of hypergrad.labels."""
    u = torch.rand(logits.shape, generator=gen, dtype=logits.dtype)
    y_soft = torch.softmax(logits - torch.log(-torch.log(u)), dim=1)
    y_hard = F.one_hot(y_soft.argmax(1), logits.shape[1]).to(logits.dtype)
    return y_hard + y_soft - y_soft.detach()


def _problem(sigma_bias=3.0, seed=0):
    """F_theta (trained-looking BN statistics) and M_psi (official sigma head) in float64."""
    torch.manual_seed(seed)
    labeler = DigitCNN(num_classes=3, width=1 / 32, image_size=8).double()
    x = torch.randn(12, 3, 8, 8, dtype=torch.float64)
    labeler.train()
    for _ in range(3):
        labeler(x + torch.randn_like(x))
    labeler.eval()
    student = build_student(labeler, "bort2", 3, sigma_head="official")
    with torch.no_grad():  # sigma's BN shift: mean log sigma > 0, so relu(outer) is not zero
        student.sigma_branch[1].bias.fill_(sigma_bias)
    student.train()
    x_weak = x + 0.05 * torch.randn_like(x)
    threshold = build_threshold("fixed", 0.0, 0.999, 3)
    return labeler, student, threshold, x, x_weak


def _authors_update(
    labeler, student, x, x_weak, tau, convention, official_sign, alpha, lr, clip, terms=4
):
    """The authors' hyper step, step by step (one forward of each network, shared draws).

    ``terms``: Neumann terms summed (the authors: all 4; hypergrad.Neumann drops a term that
    grew, which the library convention's reference mirrors)."""
    gen = torch.Generator().manual_seed(GSEED)
    seeds = torch.randint(0, 2**62, (3,), generator=gen).tolist()
    labeler.train()
    torch.manual_seed(seeds[0])
    pred_u = labeler(x_weak)
    max_prob, _ = F.softmax(pred_u, 1).max(1)
    label_u = _gumbel_hard(pred_u, gen)
    mask_u = (max_prob >= tau).to(x.dtype)
    torch.manual_seed(seeds[1])
    feats, a1 = student.net.features_with_fc1(x)
    sig = F.softplus(student.sigma_branch(a1))
    logit = student.net.head(feats + sig * torch.randn_like(feats))
    if convention == "official":  # cross_entropy_bp_to_onehot, with or without the minus sign
        loss_s = torch.log(torch.sum(label_u * torch.softmax(logit, 1), 1) + 1e-10)
        loss_s = loss_s if official_sign else -loss_s
        loss_sampled = (loss_s * mask_u).mean()
    else:
        ce = -(label_u * torch.log_softmax(logit, 1)).sum(1)
        loss_sampled = (ce * mask_u).sum() / len(ce)
        loss_sampled = -loss_sampled if official_sign else loss_sampled
    hinge = F.relu(4.0 - torch.log(sig + 1e-7).mean(1)).mean()
    loss_train = loss_sampled + 0.1 * hinge
    loss_val = F.relu(torch.mean(torch.log(sig + 1e-7)))
    params, aux = list(student.parameters()), list(labeler.parameters())
    dval = torch.autograd.grad(loss_val, params, retain_graph=True, allow_unused=True)
    dval = [torch.zeros_like(p) if g is None else g for g, p in zip(dval, params)]
    dtrain = torch.autograd.grad(loss_train, params, create_graph=True)
    p = v = dval
    for _ in range(terms - 1):
        hv = torch.autograd.grad(dtrain, params, grad_outputs=v, retain_graph=True)
        v = [vi - alpha * hi for vi, hi in zip(v, hv)]
        p = [pi + vi for pi, vi in zip(p, v)]
    if convention == "library":  # the implicit-function theorem's alpha factor
        p = [alpha * pi for pi in p]
    v3 = torch.autograd.grad(dtrain, aux, grad_outputs=p)
    hyper = [-g for g in v3]
    norm = torch.sqrt(sum((g**2).sum() for g in hyper))
    scale = min(1.0, clip / (float(norm) + 1e-12))
    with torch.no_grad():
        for t, g in zip(aux, hyper):
            t.sub_(lr * scale * g)
    labeler.eval()
    return float(norm), float(loss_val)


@pytest.mark.parametrize("convention", ["official", "library"])
@pytest.mark.parametrize("official_sign", [False, True])
def test_hyper_step_equals_the_authors_update(convention, official_sign):
    labeler, student, threshold, x, x_weak = _problem()
    with torch.no_grad():  # a tau that masks some rows (train-mode probabilities)
        labeler.train()
        conf = labeler(x_weak).softmax(1).amax(1)
        labeler.eval()
    tau = float(conf.median())
    threshold = build_threshold("fixed", tau, 0.999, 3)
    # official: alpha large enough that the H terms matter; library: small enough that
    # hypergrad.Neumann's growth check never stops the series early
    alpha = 2e-2 if convention == "official" else 1e-6
    lr, clip = 0.7, 1e3
    settings = _s2(
        convention=convention, official_sign=official_sign, alpha=alpha, lr=lr, clip=clip
    )
    ref_l, ref_s = copy.deepcopy(labeler), copy.deepcopy(student)
    theta0 = [p.detach().clone() for p in labeler.parameters()]
    updater = BilevelLabelUpdater(student, labeler, threshold, settings)
    info = updater(x, x_weak, torch.Generator().manual_seed(GSEED))
    terms = 4
    if convention == "library":  # hypergrad.Neumann stops before a term that grew
        terms = info.solve.iterations + (0 if info.solve.diverged else 1)
    else:
        assert info.solve.iterations == 3
    ref_norm, ref_outer = _authors_update(
        ref_l, ref_s, x, x_weak, tau, convention, official_sign, alpha, lr, clip, terms
    )
    assert ref_outer > 0 and info.outer_loss == pytest.approx(ref_outer, rel=1e-12)
    assert info.hypergrad_norm == pytest.approx(ref_norm, rel=1e-9)
    mine = torch.cat([(a - t0).reshape(-1) for a, t0 in zip(labeler.parameters(), theta0)])
    ref = torch.cat([(b - t0).reshape(-1) for b, t0 in zip(ref_l.parameters(), theta0)])
    assert float(ref.norm()) > 1e-6  # the update is not trivially zero
    assert float((mine - ref).norm() / ref.norm()) < 1e-9
    torch.testing.assert_close(mine, ref, rtol=1e-7, atol=1e-9 * float(ref.abs().max()))
    # running statistics: F_theta and M_psi re-estimated once, as by the authors' forwards
    for mine, ref in ((labeler, ref_l), (student, ref_s)):
        for (k, a), (_, b) in zip(mine.named_buffers(), ref.named_buffers()):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=k)
    # and the mask really masked something
    pred = torch.zeros_like(conf, dtype=torch.long)  # a global tau: pred is not used
    assert 0 < int(current_mask(threshold, conf, pred).sum()) < len(conf)


def test_the_authors_sign_reverses_their_update():
    """+log p flips the CE part of the hypergradient (the hinge does not depend on theta through
    the labels), so with the authors' sign the update points against the true-CE one."""
    out = {}
    for sign in (False, True):
        labeler, student, threshold, x, x_weak = _problem()
        up = BilevelLabelUpdater(student, labeler, threshold, _s2(official_sign=sign, alpha=1e-6))
        batch, _ = up.batches(x, x_weak, torch.Generator().manual_seed(GSEED))
        labeler.train()
        hyper, _ = up.step.compute(batch)
        out[sign] = torch.cat([h.reshape(-1) for h in hyper])
    a, c = out[False], out[True]
    assert float((a @ c) / (a.norm() * c.norm())) < -0.5


def test_zero_outer_loss_under_relu_leaves_theta_and_reports_it():
    labeler, student, threshold, x, x_weak = _problem(sigma_bias=-0.5)
    theta0 = [p.detach().clone() for p in labeler.parameters()]
    up = BilevelLabelUpdater(student, labeler, threshold, _s2(labeler_mode="eval"))
    info = up(x, x_weak, torch.Generator().manual_seed(GSEED))
    assert info.outer_loss == 0.0 and info.hypergrad_norm == 0.0
    assert all(torch.equal(p, t) for p, t in zip(labeler.parameters(), theta0))
    # without the ReLU the same step moves theta
    up = BilevelLabelUpdater(
        student, labeler, threshold, _s2(labeler_mode="eval", outer_relu=False)
    )
    info = up(x, x_weak, torch.Generator().manual_seed(GSEED))
    assert info.outer_loss < 0 and info.hypergrad_norm > 0


def test_eval_labeler_mode_freezes_every_buffer():
    labeler, student, threshold, x, x_weak = _problem()
    before = {k: v.clone() for m in (labeler, student) for k, v in m.state_dict().items()}
    up = BilevelLabelUpdater(student, labeler, threshold, _s2(labeler_mode="eval"))
    up(x, x_weak, torch.Generator().manual_seed(GSEED))
    assert not labeler.training
    for m in (labeler, student):
        for k, v in m.named_buffers():
            assert torch.equal(v, before[k]), k


def test_authors_neumann_is_the_unscaled_series_and_reports_growth():
    a = torch.tensor([[2.0, 0.5], [0.5, -1.0]], dtype=torch.float64)  # indefinite
    b = (torch.tensor([1.0, -2.0], dtype=torch.float64),)
    x, info = AuthorsNeumann(steps=4, alpha=0.1).solve(lambda v: (a @ v[0],), b)
    m, acc, v = torch.eye(2, dtype=torch.float64) - 0.1 * a, b[0].clone(), b[0].clone()
    for _ in range(4):
        v = m @ v
        acc = acc + v
    torch.testing.assert_close(x[0], acc, rtol=1e-14, atol=0)
    assert info.iterations == 4 and not info.converged and info.diverged  # the -1 mode grows
    # hypergrad.Neumann is alpha times the same series when nothing grows
    spd = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    x1, _ = AuthorsNeumann(steps=3, alpha=0.1).solve(lambda v: (spd @ v[0],), b)
    x2, i2 = hg.Neumann(maxiter=3, alpha=0.1).solve(lambda v: (spd @ v[0],), b)
    assert not i2.diverged
    torch.testing.assert_close(0.1 * x1[0], x2[0], rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="alpha"):
        AuthorsNeumann(alpha=float("inf"))
    labeler, student, threshold, _, _ = _problem()
    with pytest.raises(ValueError, match="convention") as exc:  # checked as the key declares
        BilevelLabelUpdater(student, labeler, threshold, _s2(convention="paper"))
    assert isinstance(exc.value, ConfigError) and "step2.hyper.convention='paper'" in str(exc.value)


def test_control_computes_but_does_not_apply_the_hypergradient():
    """``step2.hyper.apply=false``: theta's parameters stay, its BatchNorm
    statistics are re-estimated exactly as in the applied step, the diagnostics are the same."""
    runs = {}
    for apply in (True, False):
        labeler, student, threshold, x, x_weak = _problem()
        theta0 = [p.detach().clone() for p in labeler.parameters()]
        up = BilevelLabelUpdater(student, labeler, threshold, _s2(alpha=2e-2, lr=0.5, apply=apply))
        info = up(x, x_weak, torch.Generator().manual_seed(GSEED))
        moved = any(not torch.equal(p, t) for p, t in zip(labeler.parameters(), theta0))
        runs[apply] = (info.hypergrad_norm, moved, dict(labeler.named_buffers()))
    assert runs[True][0] == runs[False][0] > 0
    assert runs[True][1] and not runs[False][1]
    for k, v in runs[True][2].items():
        assert torch.equal(v, runs[False][2][k]), k
